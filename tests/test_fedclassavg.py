"""FedClassAvg: SupCon and the classifier proximal term by hand, the full local objective, zero weights reduce
to LG-FedAvg exactly, only the classifier travels, and a model-heterogeneous run."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from conftest import HETERO_MODELS, local_work, seeded, tiny_client, tiny_mlp
from fedpcd.algorithms import Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.fedclassavg import FedClassAvg, classifier_proximal, supcon_loss
from fedpcd.backends import run_experiment
from fedpcd.engine.rundir import RunDir
from fedpcd.models import head_keys
from fedpcd.resolve import load_config


def _alg(name: str = "fedclassavg", **params):
    alg = build_algorithm(name, params)
    local = LocalTraining(epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=1e-3)
    alg.setup(Context(num_clients=3, num_classes=3, rounds=2, seed=0, local=local))
    return alg


def _client():
    return tiny_client(torch.tensor([0, 1, 1, 2, 2, 2, 0, 1]), 3, seed=7, local_test=True)


def test_defaults():
    alg = build_algorithm("fedclassavg")
    assert (alg.rho, alg.prox, alg.lam, alg.tau, alg.normalize) == (0.1, "mse", 1.0, 0.07, True)
    assert FedClassAvg.heterogeneous


def test_supcon_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [3.0, 4.0]])  # rows 0-2 unit norm, row 3 norm 5
    y = torch.tensor([0, 0, 1, 2])  # sample 2 and 3 have no positive: not anchors
    tau = 0.5
    zn = F.normalize(z, dim=1)
    s = zn @ zn.T / tau

    def term(i, p):
        others = [a for a in range(4) if a != i]
        return -(s[i, p] - torch.logsumexp(s[i, others], 0))

    expect = (term(0, 1) + term(1, 0)) / 2
    torch.testing.assert_close(supcon_loss(z, y, tau), expect)
    s_raw = z @ z.T / tau  # normalize=False: raw dot products
    raw = (
        -(
            (s_raw[0, 1] - torch.logsumexp(s_raw[0, [1, 2, 3]], 0))
            + (s_raw[1, 0] - torch.logsumexp(s_raw[1, [0, 2, 3]], 0))
        )
        / 2
    )
    torch.testing.assert_close(supcon_loss(z, y, tau, normalize=False), raw)


def test_supcon_with_several_positives_and_none():
    z = torch.randn(5, 3, generator=seeded())
    y = torch.tensor([1, 1, 1, 0, 2])
    zn = F.normalize(z, dim=1)
    s = zn @ zn.T / 0.1
    terms = []
    for i in range(3):
        others = [a for a in range(5) if a != i]
        lse = torch.logsumexp(s[i, others], 0)
        terms.append(-sum(s[i, p] - lse for p in range(3) if p != i) / 2)
    torch.testing.assert_close(supcon_loss(z, y, 0.1), torch.stack(terms).mean())
    lonely = torch.randn(3, 4, requires_grad=True)
    value = supcon_loss(lonely, torch.tensor([0, 1, 2]), 0.1)
    assert value.item() == 0.0
    value.backward()  # still differentiable
    assert lonely.grad is not None and not lonely.grad.any()


def test_classifier_proximal_by_hand():
    model = tiny_mlp()
    ref = {k: v.detach() + 0.5 for k, v in model.state_dict().items() if k in head_keys(model)}
    w, b = model.head.weight, model.head.bias
    torch.testing.assert_close(
        classifier_proximal(model, ref, "norm"), torch.tensor(0.25 * (w.numel() + b.numel()))
    )
    torch.testing.assert_close(
        classifier_proximal(model, ref, "mse"), torch.tensor(0.25 * 2)
    )  # mean per tensor


def test_local_objective_by_hand():
    alg, model, data = _alg(rho=0.4, prox="norm", lam=0.3, tau=0.2), tiny_mlp(), _client()
    head = {k: v.detach() - 0.1 for k, v in model.state_dict().items() if k in head_keys(model)}
    loss = alg.loss(model, (data.x, data.y), local_work({"model": head}))
    z = model.features(data.x)
    n_head = sum(v.numel() for v in head.values())
    expect = F.cross_entropy(model.head(z), data.y) + 0.2 * 0.01 * n_head + 0.3 * supcon_loss(z, data.y, 0.2)
    torch.testing.assert_close(loss, expect)


def test_zero_weights_reduce_to_lgfedavg_exactly():
    data = _client()
    fca, lg = _alg(rho=0.0, lam=0.0), _alg("lgfedavg")
    server = lg.init_server(tiny_mlp())
    payload = lg.payload_for(server, 0)
    r_a, s_a = fca.local_update(tiny_mlp(), data, LocalWork(payload, None, seeded()))
    r_b, s_b = lg.local_update(tiny_mlp(), data, LocalWork(payload, None, seeded()))
    assert (
        r_a["model"].keys() == r_b["model"].keys() == set(head_keys(tiny_mlp()))
    )  # only the classifier travels
    assert all(torch.equal(r_a["model"][k], r_b["model"][k]) for k in r_b["model"])
    assert all(torch.equal(s_a[k], s_b[k]) for k in s_b)
    r_c, _ = _alg().local_update(tiny_mlp(), data, LocalWork(payload, None, seeded()))
    assert not torch.equal(r_c["model"]["head.weight"], r_b["model"]["head.weight"])  # the terms act


def test_model_heterogeneous_run(tmp_path):
    out = tmp_path / "fca"
    args = HETERO_MODELS + ["clients=5", "rounds=2", "algorithm.name=fedclassavg", f"output_dir={out}"]
    run_experiment(load_config(None, args), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["global_acc"] is None for r in rows)
    assert all(math.isfinite(r["personal_acc"]) and 0.0 <= r["personal_acc"] <= 1.0 for r in rows)
    ckpt = RunDir(out).load_checkpoint()
    assert set(ckpt["server"]["model"]) == {"head.weight", "head.bias"}
    fc1 = {k: s["fc1.weight"].shape for k, s in ckpt["client_states"].items()}
    assert fc1[0] != fc1[4]  # each client keeps its own extractor

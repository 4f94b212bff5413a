"""FedBN, APFL and Per-FedAvg: their updates against the papers' equations on tiny tensors (autograd on the
formulas, computed apart from the implementations), their invariants, the BatchNorm models FedBN needs, and a
2-round run of each on a slice of Fashion-MNIST.

FedBN's aggregation was also compared with its official code (med-air/FedBN, ``communication`` in
fed_digits.py, mode fedbn) on three perturbed ``simplecnn_bn`` clients: the same BatchNorm keys are kept local
(its rule: the key names containing "bn") and the averaged tensors agree to 2.4e-7 (float32 rounding of its
1/3-weighted sum). APFL's and Per-FedAvg's tests follow the papers' Algorithm 1: the authors' APFL code mixes
outputs rather than weights (see the module), and no Per-FedAvg code by its authors exists.
"""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import requires_fmnist, seeded, tiny_client, tiny_mlp
from fedpcd.algorithms import ALGORITHMS, ClientData, Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.common import local_steps
from fedpcd.algorithms.fedbn import BN_MODELS
from fedpcd.backends import run_experiment
from fedpcd.cli import main
from fedpcd.engine.federation import build_federation
from fedpcd.errors import UserError
from fedpcd.models import MODELS, batchnorm_keys, build_model
from fedpcd.resolve import load_config

ONE_STEP = LocalTraining(epochs=1, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0)  # 8 samples: 1 batch


def _alg(name: str, local: LocalTraining = ONE_STEP, **params):
    alg = build_algorithm(name, params)
    alg.setup(Context(num_clients=3, num_classes=3, rounds=2, seed=0, local=local))
    return alg


def _client(k: int = 0) -> ClientData:
    return tiny_client(torch.tensor([0, 1, 1, 2, 2, 2, 0, 1]), 3, seed=7 + k, cid=k, local_test=True)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _softmax_regression() -> nn.Module:
    """A linear classifier of the 1x2x2 inputs: its cross-entropy is smooth (the MLP's ReLU kinks lie within a
    finite difference's reach on these tiny data)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))


def _grad_at(weights: dict[str, torch.Tensor], data: ClientData, make=tiny_mlp) -> dict[str, torch.Tensor]:
    """grad f_i at ``weights`` (``make()``'s parameters) on the client's whole data, by autograd."""
    model = make()
    model.load_state_dict(weights, strict=False)
    loss = F.cross_entropy(model(data.x), data.y)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))


# ----- the BatchNorm models ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "channels", "size"), [("simplecnn_bn", 1, 16), ("simplecnn_bn", 3, 32), ("mlp_bn", 1, 8)]
)
def test_bn_models_keep_the_features_head_contract(name, channels, size):
    torch.manual_seed(0)
    model = build_model(name, channels, 10, size)
    x = torch.randn(4, channels, size, size)
    model.train()
    model(x)  # a training pass moves the running statistics
    model.eval()
    with torch.no_grad():
        z = model.features(x)
        assert z.shape == (4, model.feature_dim) and torch.equal(model(x), model.head(z))
    keys = batchnorm_keys(model)
    assert {k.split(".")[0] for k in keys} == (
        {"bn1", "bn2", "bn3", "bn4"} if name == "simplecnn_bn" else {"bn1", "bn2"}
    )
    assert all(
        not torch.equal(model.state_dict()[k], torch.zeros_like(model.state_dict()[k]))
        for k in keys
        if k.endswith("running_mean")
    )


def test_bn_models_named_by_fedbn_are_exactly_the_registered_models_with_batchnorm():
    small = {"wrn": {"depth": 10, "width": 1}}  # the same layers as WRN-28-10, fewer of them
    with_bn = set()
    for name in MODELS.names():
        tokens = name == "lstm"
        model = build_model(name, 0 if tokens else 1, 10, 80 if tokens else 32, **small.get(name, {}))
        if batchnorm_keys(model):
            with_bn.add(name)
    assert with_bn == set(BN_MODELS)
    assert not batchnorm_keys(build_model("resnet10", 1, 10, 32, norm="group"))


# ----- FedBN ------------------------------------------------------------------------------------------------


def _bn_client(k: int) -> ClientData:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(12, 1, 16, 16, generator=g) * (1 + k)  # feature shift: each client its own scale
    y = torch.arange(12) % 3
    return ClientData(k, x, y, torch.arange(12), x, y, torch.arange(12), 3)


def test_fedbn_keeps_every_batchnorm_tensor_local_and_averages_the_rest():
    alg = _alg("fedbn", LocalTraining(epochs=1, batch_size=4, lr=0.1))
    torch.manual_seed(0)
    model = build_model("simplecnn_bn", 1, 3, 16)
    bn = batchnorm_keys(model)
    assert len(bn) == 4 * 5  # weight, bias, running mean and variance, batch counter of 4 layers
    assert alg.private_keys(model) == bn
    server = alg.init_server(model)
    assert set(server["model"]).isdisjoint(bn) and list(server["initial"]) == bn
    received, initial = server["model"], {k: t.clone() for k, t in model.state_dict().items()}
    replies, states = [], []
    for k in (0, 1):
        model.load_state_dict(initial)  # a first participation: the seeded initial model (as the engine)
        work = LocalWork(alg.payload_for(server, k), None, seeded(k))
        reply, state = alg.local_update(model, _bn_client(k), work)
        assert set(reply["model"]).isdisjoint(bn) and list(state) == bn
        assert int(state["bn1.num_batches_tracked"]) == 3  # 3 batches of 4, all on this client
        pm = alg.personal_predictor(model, work)  # received non-BN tensors with this client's BN
        for key, value in pm.state_dict().items():
            assert torch.equal(value, (state if key in bn else received)[key]), key
        replies.append(reply)
        states.append(state)
    assert not torch.equal(states[0]["bn1.running_var"], states[1]["bn1.running_var"])
    new = alg.aggregate(dict(server), replies)["model"]
    for key in new:  # Alg. 1: equal sample counts, so the plain mean of the clients' non-BN tensors
        torch.testing.assert_close(new[key], (replies[0]["model"][key] + replies[1]["model"][key]) / 2)


def test_a_batchnorm_model_never_trains_on_a_batch_of_one_sample():
    """BatchNorm cannot normalise one sample in training (torch raises "Expected more than 1 value per
    channel"): a client whose n_k is 1 more than a multiple of B leaves its last one-sample batch out where
    its model has BatchNorm layers, and only then; a pass in eval mode (``training=False``) keeps it."""
    local = LocalTraining(epochs=2, batch_size=2, lr=0.1)
    data = _bn_client(0)
    data.train_idx = torch.arange(5)  # 5 = 2 * 2 + 1
    sizes = [len(y) for _, y in data.batches(2, seeded())]
    assert sizes == [2, 2, 1] and local_steps(data, local) == 6
    data.batchnorm = True
    kept = [y for _, y in data.batches(2, seeded())]
    assert [len(y) for y in kept] == [2, 2] and local_steps(data, local) == 4
    whole = [y for _, y in data.batches(2, seeded(), training=False)]
    assert [len(y) for y in whole] == [2, 2, 1]
    assert all(torch.equal(a, b) for a, b in zip(kept, whole, strict=False))  # the same order, less the last
    alg = _alg("fedbn", local)
    torch.manual_seed(0)
    model = build_model("simplecnn_bn", 1, 3, 16)
    work = LocalWork(alg.payload_for(alg.init_server(model), 0), None, seeded())
    _, state = alg.local_update(model, data, work)
    assert work.steps == 4 and int(state["bn1.num_batches_tracked"]) == 4
    data.batchnorm = False
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        alg.local_update(model, data, LocalWork(work.received, state, seeded()))


def test_the_federation_marks_the_clients_whose_architecture_has_batchnorm():
    config = load_config(
        None, ["dataset.name=synthetic", "clients=4", "model.name=[mlp, mlp_bn]", "algorithm.name=fedproto"]
    )
    fed = build_federation(config)
    assert fed.batchnorm == {"mlp_bn"}
    assert [c.batchnorm for c in fed.clients] == [False, True, False, True]
    worker = pickle.loads(pickle.dumps(fed))  # as the worker pool receives it: the clients rebuilt
    assert [c.batchnorm for c in worker.clients] == [False, True, False, True]


def test_fedbn_refuses_a_model_without_batchnorm_in_one_line(tmp_path, capsys):
    with pytest.raises(
        UserError, match=r"keeps each client's BatchNorm layers local, but the model \(MLP\) has none"
    ):
        _alg("fedbn").init_server(tiny_mlp())
    args = ["run", "--quiet", "dataset.name=synthetic", "model.name=mlp", "algorithm.name=fedbn", "clients=2"]
    assert main([*args, "rounds=1", f"output_dir={tmp_path}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f"set model.name to one of: {', '.join(BN_MODELS)} (resnet: norm=batch)")


# ----- APFL -------------------------------------------------------------------------------------------------


def test_apfl_one_local_step_by_hand():
    """Alg. 1 from one iterate: w - eta grad f(w), v - eta alpha grad f(v_bar) and
    alpha - eta_alpha <v - w, grad f(v_bar)>."""
    alg, model, data = _alg("apfl", alpha_init=0.3, alpha_lr=0.5), tiny_mlp(), _client()
    w = _params(model)
    v = {k: t + 0.2 * torch.randn_like(t) for k, t in model.state_dict().items()}
    work = LocalWork({"model": model.state_dict()}, {"v": v, "alpha": torch.tensor(0.3)}, seeded())
    alg.local_update(model, data, work)
    a, eta = 0.3, ONE_STEP.lr
    v_bar = {k: a * v[k] + (1 - a) * w[k] for k in w}
    g_w, g_bar = _grad_at(w, data), _grad_at(v_bar, data)
    for k in w:
        torch.testing.assert_close(model.state_dict()[k], w[k] - eta * g_w[k])
        torch.testing.assert_close(work.state["v"][k], v[k] - eta * a * g_bar[k])
    grad_alpha = sum(float(((v[k] - w[k]) * g_bar[k]).sum()) for k in w)
    assert 0 < a - 0.5 * grad_alpha < 1  # inside [0, 1]: the projection does nothing here
    torch.testing.assert_close(work.state["alpha"], torch.tensor(a - 0.5 * grad_alpha))
    assert work.steps == 1


def test_apfl_global_part_is_fedavg_bit_for_bit():
    local = LocalTraining(epochs=2, batch_size=3, lr=0.05, momentum=0.9, weight_decay=1e-3, grad_clip=0.5)
    apfl, fedavg = _alg("apfl", local), _alg("fedavg", local)
    model = tiny_mlp()
    payload = {"model": {k: t + 0.1 for k, t in model.state_dict().items()}}
    r_avg, _ = fedavg.local_update(model, _client(), LocalWork(payload, None, seeded()))
    work = LocalWork(payload, None, seeded())
    r_apfl, state = apfl.local_update(tiny_mlp(), _client(), work)
    assert r_apfl["train_loss"] == r_avg["train_loss"] and work.steps == 6
    assert all(torch.equal(r_apfl["model"][k], r_avg["model"][k]) for k in r_avg["model"])
    initial = tiny_mlp().state_dict()  # v^0: the seeded initial model, not the received one
    assert state["alpha"] != 0.5 and any(not torch.equal(state["v"][k], initial[k]) for k in initial)


def test_apfl_alpha_is_projected_onto_the_unit_interval_or_fixed():
    model, data = tiny_mlp(), _client()
    payload = {"model": {k: t + 1.0 for k, t in model.state_dict().items()}}  # w far from v^0
    _, state = _alg("apfl", alpha_lr=1.0e6).local_update(model, data, LocalWork(payload, None, seeded()))
    assert float(state["alpha"]) in (0.0, 1.0)
    _, state = _alg("apfl", adaptive_alpha=False, alpha_init=0.7).local_update(
        tiny_mlp(), data, LocalWork(payload, None, seeded())
    )
    assert torch.equal(state["alpha"], torch.tensor(0.7))


def test_apfl_personal_model_is_the_mixture_of_the_trained_models():
    alg, model, data = _alg("apfl", alpha_init=0.25), tiny_mlp(), _client()
    work = LocalWork({"model": model.state_dict()}, None, seeded())
    alg.local_update(model, data, work)
    w, v, a = _params(model), work.state["v"], work.state["alpha"]
    pm = alg.personal_predictor(model, work)
    for k, t in pm.named_parameters():
        torch.testing.assert_close(t.detach(), a * v[k] + (1 - a) * w[k])


# ----- Per-FedAvg -------------------------------------------------------------------------------------------


def _perfedavg_step(variant: str, make=tiny_mlp) -> tuple[dict, dict, ClientData]:
    """One local step (8 samples, batch 8: D = D' = D'' = the client's data) from ``make()``'s model."""
    alg, model, data = (
        _alg("perfedavg", variant=variant, alpha=0.2, beta=0.3, personal_steps=0),
        make(),
        _client(),
    )
    w = _params(model)
    work = LocalWork({"model": model.state_dict()}, None, seeded())
    reply, _ = alg.local_update(model, data, work)
    assert work.steps == 1
    return w, reply["model"], data


def test_perfedavg_fo_step_by_hand():
    """w <- w - beta grad f(w - alpha grad f(w; D); D')."""
    w, new, data = _perfedavg_step("fo")
    g = _grad_at(w, data)
    g_tilde = _grad_at({k: w[k] - 0.2 * g[k] for k in w}, data)
    for k in w:
        torch.testing.assert_close(new[k], w[k] - 0.3 * g_tilde[k])


def test_perfedavg_hf_step_by_hand():
    """w <- w - beta (I - alpha hess f(w; D'')) grad f(w_tilde; D'), here with the exact Hessian-vector
    product (double backward) of a smooth model: the finite difference with delta = 1e-3 agrees to its
    O(delta^2) and float32 rounding, and the Hessian term moves the step."""
    w, new, data = _perfedavg_step("hf", _softmax_regression)
    g = _grad_at(w, data, _softmax_regression)
    g_tilde = _grad_at({k: w[k] - 0.2 * g[k] for k in w}, data, _softmax_regression)
    model = _softmax_regression()
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(data.x), data.y), params, create_graph=True)
    names = [n for n, _ in model.named_parameters()]
    dot = sum((gr * g_tilde[n]).sum() for gr, n in zip(grads, names, strict=True))
    hvp = dict(zip(names, torch.autograd.grad(dot, params), strict=True))
    for k in w:
        torch.testing.assert_close(new[k], w[k] - 0.3 * (g_tilde[k] - 0.2 * hvp[k]), rtol=0, atol=2e-5)
    assert max(float((0.3 * 0.2 * hvp[k]).abs().max()) for k in w) > 1e-3  # the term the FO variant drops


def test_perfedavg_personal_model_is_the_received_model_after_alpha_steps():
    data = _client()
    for steps in (0, 1):
        alg, model = _alg("perfedavg", alpha=0.2, personal_steps=steps), tiny_mlp()
        received = {k: t + 0.05 for k, t in model.state_dict().items()}
        work = LocalWork({"model": received}, None, seeded())
        reply, _ = alg.local_update(model, data, work)
        pm = alg.personal_predictor(model, work)
        g = _grad_at(received, data)
        for k, t in pm.named_parameters():
            torch.testing.assert_close(t.detach(), received[k] - 0.2 * steps * g[k])
        assert not torch.equal(reply["model"]["fc1.weight"], pm.state_dict()["fc1.weight"])


def test_perfedavg_takes_fedavgs_number_of_steps():
    local = LocalTraining(epochs=2, batch_size=3, lr=0.05)
    for variant in ("fo", "hf"):
        work = LocalWork({"model": tiny_mlp().state_dict()}, None, seeded())
        _alg("perfedavg", local, variant=variant).local_update(tiny_mlp(), _client(), work)
        assert work.steps == math.ceil(8 / 3) * 2


# ----- registry and end to end ------------------------------------------------------------------------------


def test_the_three_are_registered_with_their_hyperparameters():
    assert {"fedbn", "apfl", "perfedavg"} <= set(ALGORITHMS.names())
    assert build_algorithm("apfl").__dict__ == {"alpha_init": 0.5, "adaptive_alpha": True, "alpha_lr": None}
    assert build_algorithm("perfedavg").__dict__ == {
        "variant": "fo",
        "alpha": 0.01,
        "beta": None,
        "delta": 1.0e-3,
        "personal_steps": 1,
    }
    with pytest.raises(
        UserError, match=r"'algorithm.variant' of algorithm 'perfedavg' \('so'\): valid choices: fo, hf"
    ):
        build_algorithm("perfedavg", {"variant": "so"})
    with pytest.raises(UserError, match=r"'algorithm.alpha_init' of algorithm 'apfl' \(1.5\)"):
        build_algorithm("apfl", {"alpha_init": 1.5})


@requires_fmnist
@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.name=fedbn", "model.name=simplecnn_bn"],
        ["algorithm.name=apfl"],
        ["algorithm.name=perfedavg", "algorithm.variant=hf"],
    ],
    ids=["fedbn", "apfl", "perfedavg"],
)
def test_two_rounds_on_fashion_mnist_report_finite_generic_and_personal_accuracy(tmp_path, extra):
    base = [
        "dataset.name=fmnist",
        "dataset.train_fraction=0.01",
        "model.name=simplecnn",
        "clients=3",
        "rounds=2",
    ]
    run_experiment(load_config(None, [*base, *extra, f"output_dir={tmp_path}"]), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["global_acc"]) and math.isfinite(row["personal_acc"]), row
        assert math.isfinite(row["train_loss"])

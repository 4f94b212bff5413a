"""FD: the distillation terms by hand, the server's per-class logit mean, what travels (mean logits of held
classes only, never weights), gamma = 0 equals the Local baseline exactly, and a model-heterogeneous run."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import HETERO_MODELS, local_work, seeded, tiny_client, tiny_mlp
from fedpcd.algorithms import ClientData, Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.fd import FD, logit_kl
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.backends import run_experiment
from fedpcd.engine.rundir import RunDir
from fedpcd.resolve import load_config


def _alg(name: str = "fd", **params):
    alg = build_algorithm(name, params)
    local = LocalTraining(epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=1e-3)
    alg.setup(Context(num_clients=3, num_classes=3, rounds=2, seed=0, local=local))
    return alg


def _client(labels: list[int] | None = None) -> ClientData:
    y = torch.tensor(labels if labels is not None else [0, 1, 1, 2, 2, 2, 0, 1])
    return tiny_client(y, 3, seed=7, local_test=True)


def test_defaults_and_flags():
    alg = build_algorithm("fd")
    assert (alg.gamma, alg.distill, alg.temperature, alg.weighting) == (1.0, "mse", 1.0, "uniform")
    assert FD.heterogeneous


def test_mse_distillation_loss_by_hand():
    alg, model, data = _alg(gamma=0.5), tiny_mlp(), _client()
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [9.0, 9.0, 9.0]])
    payload = {"logits": targets, "known": torch.tensor([True, True, False])}
    loss = alg.loss(model, (data.x, data.y), local_work(payload))
    out = model(data.x)
    held = data.y != 2  # class 2 has no global logits: adds 0, counts in the mean
    mse = ((out - targets[data.y]) ** 2 * held[:, None]).sum() / out.numel()
    torch.testing.assert_close(loss, F.cross_entropy(out, data.y) + 0.5 * mse)


def test_kl_distillation_by_hand():
    logits = torch.tensor([[1.0, 2.0], [0.5, -0.5], [3.0, 0.0]], requires_grad=True)
    targets = torch.tensor([[0.0, 4.0], [2.0, 0.0]])
    y, known, t = torch.tensor([0, 1, 0]), torch.tensor([True, False]), 2.0
    value = logit_kl(logits, y, targets, known, t)
    p = torch.softmax(targets[0] / t, 0)
    expect = 0.0
    for i in (0, 2):  # the class-1 sample has no target
        q = torch.softmax(logits[i].detach() / t, 0)
        expect += float((p * (p.log() - q.log())).sum())
    torch.testing.assert_close(value, torch.tensor(t * t * expect / 3))
    value.backward()
    assert logits.grad[1].abs().sum() == 0 and logits.grad[0].abs().sum() > 0


def test_before_any_upload_the_loss_is_cross_entropy():
    alg, model, data = _alg(distill="kl"), tiny_mlp(), _client()
    payload = alg.payload_for(alg.init_server(model), 0)
    assert (
        set(payload) == {"logits", "known"}
        and payload["logits"].shape == (3, 3)
        and not payload["known"].any()
    )
    torch.testing.assert_close(
        alg.loss(model, (data.x, data.y), local_work(payload)), F.cross_entropy(model(data.x), data.y)
    )


def _reply(classes, means, counts):
    return {
        "classes": torch.tensor(classes),
        "class_means": torch.tensor(means),
        "class_counts": torch.tensor(counts),
        "num_samples": sum(counts),
        "train_loss": 0.0,
    }


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_server_averages_logits_per_class_and_keeps_unreported(weighting):
    alg, model = _alg(weighting=weighting), tiny_mlp()
    server = alg.init_server(model)
    server["logits"][2] = torch.tensor([7.0, 7.0, 7.0])
    server = alg.aggregate(
        server,
        [_reply([0, 1], [[1.0, 0, 0], [0, 2.0, 0]], [1, 3]), _reply([1], [[0, 4.0, 2.0]], [1])],
    )
    c1 = [0.0, 3.0, 1.0] if weighting == "uniform" else [0.0, 2.5, 0.5]
    torch.testing.assert_close(server["logits"], torch.tensor([[1.0, 0, 0], c1, [7.0, 7.0, 7.0]]))
    assert server["known"].tolist() == [True, True, False]
    assert alg.global_predictor(model, server) is None


def test_reply_is_the_held_classes_mean_logits_and_no_weights():
    alg, model = _alg(), tiny_mlp()
    data = _client([0, 0, 2, 2, 2])
    reply, state = alg.local_update(
        model, data, LocalWork(alg.payload_for(alg.init_server(model), 0), None, seeded())
    )
    assert set(reply) == {"classes", "class_counts", "class_means", "num_samples", "train_loss"}
    assert reply["classes"].tolist() == [0, 2] and reply["class_counts"].tolist() == [2, 3]
    assert tensor_bytes(reply) == 2 * 8 + 2 * 8 + 2 * 3 * 4  # ids, counts, |S_k| x C logits
    model.load_state_dict(state["model"])
    model.eval()
    with torch.no_grad():
        out = model(data.x)
    torch.testing.assert_close(reply["class_means"], torch.stack([out[:2].mean(0), out[2:].mean(0)]))
    assert alg.personal_predictor(tiny_mlp(), local_work({}, state))(data.x).shape == (5, 3)


def test_gamma_zero_is_local_training_exactly():
    fd, local, data = _alg(gamma=0.0), _alg("local"), _client()
    payload = {"logits": torch.randn(3, 3, generator=seeded(3)), "known": torch.ones(3, dtype=torch.bool)}
    _, s_fd = fd.local_update(tiny_mlp(), data, LocalWork(payload, None, seeded()))
    _, s_local = local.local_update(
        tiny_mlp(), data, LocalWork(local.payload_for(local.init_server(tiny_mlp()), 0), None, seeded())
    )
    assert s_fd["model"].keys() == s_local.keys()
    assert all(torch.equal(s_fd["model"][k], s_local[k]) for k in s_local)
    _, s_fd2 = fd.local_update(
        tiny_mlp(), data, LocalWork(payload, s_fd, seeded(2))
    )  # later rounds: the own model
    _, s_local2 = local.local_update(tiny_mlp(), data, LocalWork({"model": {}}, s_local, seeded(2)))
    assert all(torch.equal(s_fd2["model"][k], s_local2[k]) for k in s_local2)


def test_distillation_changes_training_when_gamma_positive():
    data = _client()
    payload = {"logits": torch.full((3, 3), 5.0), "known": torch.ones(3, dtype=torch.bool)}
    _, a = _alg(gamma=0.0).local_update(tiny_mlp(), data, LocalWork(payload, None, seeded()))
    _, b = _alg(gamma=1.0).local_update(tiny_mlp(), data, LocalWork(payload, None, seeded()))
    assert not torch.equal(a["model"]["fc1.weight"], b["model"]["fc1.weight"])


def test_model_heterogeneous_run(tmp_path):
    out = tmp_path / "fd"
    args = HETERO_MODELS + ["clients=5", "rounds=2", "algorithm.name=fd", f"output_dir={out}"]
    run_experiment(load_config(None, args), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["global_acc"] is None for r in rows)
    assert all(math.isfinite(r["personal_acc"]) and 0.0 <= r["personal_acc"] <= 1.0 for r in rows)
    assert all(r["bytes_down"] == 5 * (10 * 10 * 4 + 10) for r in rows)  # C x C logits + mask, 5 clients
    assert all(r["bytes_up"] == 5 * (2 * 8 + 2 * 8 + 2 * 10 * 4) for r in rows)  # 2 classes each
    ckpt = RunDir(out).load_checkpoint()
    assert set(ckpt["server"]) == {"logits", "known"} and ckpt["server"]["known"].any()
    fc1 = {k: s["model"]["fc1.weight"].shape for k, s in ckpt["client_states"].items()}
    assert fc1[0] != fc1[4]  # each client keeps its own architecture

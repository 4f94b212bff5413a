"""Ditto: Eq. (2)'s proximal loss on tiny tensors, the global part is FedAvg bit for bit (hooks and a full
run under one seed), the personal model's start, anchor and optimiser, and a short end-to-end run."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL_EVERY_METRIC, local_work, seeded, spy_sgd, tiny_client, tiny_mlp
from fedpcd.algorithms import ClientData, Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms import ditto as ditto_module
from fedpcd.backends import run_experiment
from fedpcd.engine.rundir import RunDir
from fedpcd.resolve import load_config

SMALL = SMALL_EVERY_METRIC
LOCAL = LocalTraining(epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=1e-3)


def _alg(name: str = "ditto", **params):
    alg = build_algorithm(name, params)
    alg.setup(Context(num_clients=3, num_classes=3, rounds=2, seed=0, local=LOCAL))
    return alg


def _client(k: int = 0) -> ClientData:
    return tiny_client(torch.tensor([0, 1, 1, 2, 2, 2, 0, 1]), 3, seed=7 + k, cid=k, local_test=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _shifted(model, delta: float) -> dict:
    return {k: v + delta for k, v in model.state_dict().items()}


def test_defaults():
    alg = build_algorithm("ditto")
    assert alg.lam == 0.75
    assert (alg.personal_init, alg.anchor, alg.personal_optimizer) == ("initial", "global", "sgd")


def test_proximal_loss_value_and_gradient_by_hand():
    alg, model = _alg(lam=0.5), tiny_mlp()
    data = _client()
    batch = (data.x, data.y)
    anchor = _shifted(model, 0.1)  # every parameter 0.1 away from the anchor
    loss = alg.loss(model, batch, local_work({"anchor": anchor}))
    n_params = sum(p.numel() for p in model.parameters())
    ce = F.cross_entropy(model(data.x), data.y)
    torch.testing.assert_close(loss, ce + 0.5 / 2 * n_params * 0.01)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(data.x), data.y).backward()
    for n, p in model.named_parameters():  # grad CE + lambda (v - w)
        torch.testing.assert_close(got[n], p.grad + 0.5 * (p.detach() - anchor[n]))


def test_global_part_uses_plain_cross_entropy():
    alg, model = _alg(), tiny_mlp()
    data = _client()
    payload = {"model": _shifted(model, 1.0)}
    torch.testing.assert_close(
        alg.loss(model, (data.x, data.y), local_work(payload)), F.cross_entropy(model(data.x), data.y)
    )


def test_replies_equal_fedavg_and_personal_model_is_the_state():
    ditto, fedavg, model = _alg(), _alg("fedavg"), tiny_mlp()
    server = fedavg.init_server(model)
    initial = dict(server["model"])
    payload = fedavg.payload_for(server, 0)
    r_avg, s_avg = fedavg.local_update(model, _client(), LocalWork(payload, None, seeded()))
    model.load_state_dict(initial)
    r_ditto, state = ditto.local_update(model, _client(), LocalWork(payload, None, seeded()))
    assert s_avg is None and set(r_ditto) == set(r_avg) == {"model", "num_samples", "train_loss"}
    assert _equal(r_ditto["model"], r_avg["model"]) and r_ditto["train_loss"] == r_avg["train_loss"]
    assert set(state) == set(model.state_dict()) and not _equal(state, r_ditto["model"])
    model.load_state_dict(initial)
    assert _equal(ditto.personal_predictor(model, local_work(payload, state)).state_dict(), state)
    assert _equal(ditto.aggregate(ditto.init_server(model), [r_ditto])["model"], r_avg["model"])


def _personal_start(monkeypatch, alg, model, payload, state) -> dict:
    """The v_k the personal training (the loop whose payload carries the anchor) starts from."""
    seen: list[dict] = []
    real = ditto_module.train_loop

    def spy(algorithm, m, data, work, **kwargs):
        if "anchor" in work.payload:
            seen.append({k: v.clone() for k, v in m.state_dict().items()})
        return real(algorithm, m, data, work, **kwargs)

    monkeypatch.setattr(ditto_module, "train_loop", spy)
    alg.local_update(model, _client(), LocalWork(payload, state, seeded()))
    return seen[-1]


@pytest.mark.parametrize("init", ["global", "initial"])
def test_personal_model_starts_from_global_or_initial_then_from_the_state(monkeypatch, init):
    alg, model = _alg(personal_init=init), tiny_mlp()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    payload = {"model": _shifted(model, 0.5)}  # a later round's global model, not the initial one
    start = _personal_start(monkeypatch, alg, model, payload, None)
    assert _equal(start, payload["model"] if init == "global" else initial)
    state = _shifted(model, -0.3)
    assert _equal(_personal_start(monkeypatch, alg, model, payload, state), state)  # later: the previous v_k


@pytest.mark.parametrize("anchor", ["global", "local"])
def test_anchor_is_the_received_or_the_local_model(monkeypatch, anchor):
    alg, model = _alg(anchor=anchor), tiny_mlp()
    payload = {"model": _shifted(model, 0.5)}
    anchors: list[dict] = []
    real = type(alg).loss

    def spy(self, m, batch, work):
        if "anchor" in work.payload:
            anchors.append(work.payload["anchor"])
        return real(self, m, batch, work)

    monkeypatch.setattr(type(alg), "loss", spy)
    reply, _ = alg.local_update(model, _client(), LocalWork(payload, None, seeded()))
    want = payload["model"] if anchor == "global" else reply["model"]
    assert anchors and all(a is want for a in anchors)


@pytest.mark.parametrize(("option", "momentum", "wd"), [("sgd", 0.0, 0.0), ("local", 0.9, 1e-3)])
def test_personal_optimiser_settings(monkeypatch, option, momentum, wd):
    alg, model = _alg(personal_optimizer=option), tiny_mlp()
    loops = spy_sgd(monkeypatch)
    alg.local_update(model, _client(), LocalWork({"model": _shifted(model, 0.0)}, None, seeded()))
    settings = [(loop["lr"], loop["momentum"], loop["decay"]) for loop in loops]
    assert settings == [(0.1, 0.9, 1e-3), (0.1, momentum, wd)]  # FedAvg part, then the personal part


def test_personal_sgd_step_is_algorithm_1():
    """One batch, one epoch: v <- v - eta (grad F(v) + lambda (v - w))."""
    alg = build_algorithm("ditto", {"lam": 2.0})
    alg.setup(Context(3, 3, 1, 0, LocalTraining(epochs=1, batch_size=64, lr=0.05)))
    model, data = tiny_mlp(), _client()
    payload = {"model": _shifted(model, 0.2)}
    v0 = _shifted(model, -0.1)
    _, state = alg.local_update(model, data, LocalWork(payload, v0, seeded()))
    model.load_state_dict(v0)
    model.zero_grad()
    F.cross_entropy(model(data.x), data.y).backward()
    for n, p in model.named_parameters():
        expect = v0[n] - 0.05 * (p.grad + 2.0 * (v0[n] - payload["model"][n]))
        torch.testing.assert_close(state[n], expect)


def _run(tmp_path, name: str, extra: list[str] | None = None):
    out = tmp_path / name
    args = SMALL + ["clients=4", "rounds=3", "participation=0.5", "seed=3", f"algorithm.name={name}"]
    run_experiment(load_config(None, args + (extra or []) + [f"output_dir={out}"]), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, RunDir(out).load_checkpoint()


def test_global_model_equals_fedavg_under_the_same_seed_end_to_end(tmp_path):
    ditto_rows, ditto_ckpt = _run(tmp_path, "ditto")
    avg_rows, avg_ckpt = _run(tmp_path, "fedavg")
    assert _equal(ditto_ckpt["server"]["model"], avg_ckpt["server"]["model"])
    assert [r["global_acc"] for r in ditto_rows] == [r["global_acc"] for r in avg_rows]
    assert [r["bytes_up"] for r in ditto_rows] == [r["bytes_up"] for r in avg_rows]
    assert [r["round"] for r in ditto_rows] == [1, 2, 3]
    for r in ditto_rows:
        assert all(math.isfinite(r[k]) and 0.0 <= r[k] <= 1.0 for k in ["global_acc", "pa_l", "pa_v"])
    states = ditto_ckpt["client_states"]
    sampled = {k for r in ditto_rows for k in r["clients"]}
    assert set(states) == sampled and all(set(s) == set(avg_ckpt["server"]["model"]) for s in states.values())
    assert [r["personal_acc"] for r in ditto_rows] != [r["personal_acc"] for r in avg_rows]

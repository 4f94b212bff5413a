"""FedAvg-FT: replies and GM are FedAvg's exactly (hooks and a full run under one seed) while the personal
model is the received global model fine-tuned for ``finetune_epochs`` epochs; a short end-to-end run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import SMALL_EVERY_METRIC, local_work, seeded, tiny_client, tiny_mlp
from fedpcd.algorithms import ClientData, Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms import contract as contract_module
from fedpcd.backends import run_experiment
from fedpcd.engine.rundir import RunDir
from fedpcd.resolve import load_config

SMALL = SMALL_EVERY_METRIC


def _alg(name: str = "fedavg_ft", **params):
    alg = build_algorithm(name, params)
    local = LocalTraining(epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=0.0)
    alg.setup(Context(num_clients=3, num_classes=3, rounds=2, seed=0, local=local))
    return alg


def _client() -> ClientData:
    return tiny_client(torch.tensor([0, 1, 1, 2, 2, 2, 0, 1]), 3, seed=7, local_test=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _update(alg, payload: dict) -> tuple[dict, object, dict]:
    """(reply, state, personal model's weights) of one local update from the seeded model."""
    model = tiny_mlp()
    reply, state = alg.local_update(model, _client(), LocalWork(payload, None, seeded()))
    personal = alg.personal_predictor(model, local_work(payload, state))
    return reply, state, {k: v.clone() for k, v in personal.state_dict().items()}


def test_defaults_follow_the_fedgela_protocol():
    alg = build_algorithm("fedavg_ft")
    assert (alg.finetune_epochs, alg.finetune_from, alg.finetune_lr) == (10, "global", None)


def test_reply_is_fedavgs_and_the_personal_model_is_finetuned():
    payload = build_algorithm("fedavg").init_server(tiny_mlp())
    r_avg, s_avg, pm_avg = _update(_alg("fedavg"), payload)
    r_ft, s_ft, pm_ft = _update(_alg(), payload)
    assert s_avg is None and s_ft is None
    assert set(r_ft) == set(r_avg) and _equal(r_ft["model"], r_avg["model"])
    assert r_ft["train_loss"] == r_avg["train_loss"] and r_ft["num_samples"] == r_avg["num_samples"]
    assert _equal(pm_avg, r_avg["model"])  # FedAvg's PM: the local model
    assert not _equal(pm_ft, r_ft["model"]) and not _equal(pm_ft, payload["model"])


@pytest.mark.parametrize("source", ["global", "local"])
def test_finetuning_starts_from_the_received_global_or_the_local_model(source):
    payload = build_algorithm("fedavg").init_server(tiny_mlp())
    reply, _, personal = _update(_alg(finetune_epochs=0, finetune_from=source), payload)
    assert _equal(personal, payload["model"] if source == "global" else reply["model"])


def test_finetuning_epochs_and_lr(monkeypatch):
    alg = _alg(finetune_epochs=3, finetune_lr=0.5)
    calls: list[tuple[int | None, float | None]] = []
    real = contract_module.train_loop

    def spy(*args, epochs=None, lr=None):
        calls.append((epochs, lr))
        return real(*args, epochs=epochs, lr=lr)

    monkeypatch.setattr(contract_module, "train_loop", spy)
    _update(alg, build_algorithm("fedavg").init_server(tiny_mlp()))
    assert calls == [(None, None), (3, 0.5)]  # FedAvg's local epochs, then the fine-tuning


def _run(tmp_path, name: str) -> tuple[list[dict], dict]:
    out = tmp_path / name
    args = SMALL + ["clients=4", "rounds=2", "participation=0.5", "seed=4", f"algorithm.name={name}"]
    extra = ["algorithm.finetune_epochs=2"] if name == "fedavg_ft" else []
    run_experiment(load_config(None, args + extra + [f"output_dir={out}"]), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, RunDir(out).load_checkpoint()


def test_end_to_end_gm_equals_fedavg_and_personal_metrics_differ(tmp_path):
    ft_rows, ft_ckpt = _run(tmp_path, "fedavg_ft")
    avg_rows, avg_ckpt = _run(tmp_path, "fedavg")
    assert _equal(ft_ckpt["server"]["model"], avg_ckpt["server"]["model"])
    assert ft_ckpt["client_states"] == {} == avg_ckpt["client_states"]
    for key in ["global_acc", "bytes_up", "bytes_down", "train_loss"]:
        assert [r[key] for r in ft_rows] == [r[key] for r in avg_rows]
    assert [r["pa_l"] for r in ft_rows] != [r["pa_l"] for r in avg_rows]
    assert [r["round"] for r in ft_rows] == [1, 2]
    for r in ft_rows:
        assert all(math.isfinite(r[k]) and 0.0 <= r[k] <= 1.0 for k in ["global_acc", "pa_l", "pa_v"])

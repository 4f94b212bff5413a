"""The round loop: FedAvg == centralised SGD with one client, determinism, resume, participation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_fmnist, run_records
from fedpcd import seeds
from fedpcd.backends import run_experiment
from fedpcd.engine.federation import build_federation, sample_clients
from fedpcd.engine.rundir import RunDir
from fedpcd.errors import UserError
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]


@pytest.mark.parametrize("lr_decay", [1.0, 0.5])
def test_one_client_fedavg_equals_centralised_sgd(tmp_path, lr_decay):
    rounds = 3
    cfg = load_config(
        None,
        SMALL
        + [
            "clients=1",
            "partition.scheme=iid",
            f"rounds={rounds}",
            "local.momentum=0.0",
            "local.weight_decay=0.001",
            f"output_dir={tmp_path / 'run'}",
            "seed=5",
            f"local.lr_decay={lr_decay}",
        ],
    )
    run_experiment(cfg, progress=False)
    fed_state = torch.load(tmp_path / "run" / "checkpoint" / "state.pt", weights_only=False)["server"][
        "model"
    ]

    fed = build_federation(cfg)
    client = fed.clients[0]
    model = fed.new_model()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.local.lr, momentum=0.0, weight_decay=0.001)
    for epoch in range(1, rounds + 1):
        opt.param_groups[0]["lr"] = cfg.local.lr * lr_decay ** (epoch - 1)
        g = seeds.generator(seeds.client_update(cfg.seed, epoch, 0))
        order = client.train_idx[torch.randperm(client.num_samples, generator=g)]
        for start in range(0, len(order), cfg.local.batch_size):
            idx = order[start : start + cfg.local.batch_size]
            loss = F.cross_entropy(model(client.x[idx]), client.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fed_state[key], value, rtol=1e-6, atol=1e-7)


def test_same_seed_same_metrics_and_run_dir_files(tmp_path):
    args = SMALL + ["clients=4", "rounds=2", "partition.classes_per_client=3"]
    a = load_config(None, args + [f"output_dir={tmp_path / 'a'}"])
    b = load_config(None, args + [f"output_dir={tmp_path / 'b'}"])
    sa = run_experiment(a, progress=False)
    run_experiment(b, progress=False)
    assert run_records(tmp_path / "a") == run_records(tmp_path / "b")
    for name in ["config.yaml", "partition.json", "metrics.jsonl", "summary.json", "checkpoint/state.pt"]:
        assert (tmp_path / "a" / name).exists()
    part = json.loads((tmp_path / "a" / "partition.json").read_text())
    assert part["num_classes"] == 10 and len(part["clients"]) == 4
    assert all(sum(c > 0 for c in cl["train_counts"]) == 3 for cl in part["clients"])
    row = run_records(tmp_path / "a")[-1]
    for key in [
        "round",
        "global_acc",
        "personal_acc",
        "pa_l",
        "pa_v",
        "pa_global",
        "train_loss",
        "bytes_up",
        "bytes_down",
    ]:
        assert key in row
    assert 0.0 <= row["global_acc"] <= 1.0 and 0.0 <= row["personal_acc"] <= 1.0
    assert row["bytes_up"] == row["bytes_down"] > 0  # FedAvg sends the whole model both ways
    assert sa["final"]["round"] == 2


def test_different_seed_changes_results(tmp_path):
    a = run_experiment(
        load_config(None, SMALL + ["rounds=1", f"output_dir={tmp_path / 'a'}"]), progress=False
    )
    b = run_experiment(
        load_config(None, SMALL + ["rounds=1", "seed=1", f"output_dir={tmp_path / 'b'}"]), progress=False
    )
    assert a["final"]["train_loss"] != b["final"]["train_loss"]


def test_resume_continues_to_identical_metrics(tmp_path, monkeypatch):
    args = SMALL + ["clients=3", "rounds=3", "participation=0.67"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'full'}"]), progress=False)

    original = RunDir.append

    def crash_in_round_3(self, record):
        if record["round"] == 3:
            raise KeyboardInterrupt
        original(self, record)

    monkeypatch.setattr(RunDir, "append", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'cut'}"]), progress=False)
    monkeypatch.setattr(RunDir, "append", original)
    assert not (tmp_path / "cut" / "summary.json").exists()

    from fedpcd.backends import resume_run

    resume_run(tmp_path / "cut", progress=False)
    assert run_records(tmp_path / "cut") == run_records(tmp_path / "full")


def test_existing_run_dir_is_not_overwritten(tmp_path):
    cfg = load_config(None, SMALL + ["rounds=1", f"output_dir={tmp_path}"])
    run_experiment(cfg, progress=False)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="already holds a run"):
        run_experiment(cfg, progress=False)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_partial_participation_is_seeded_without_replacement(tmp_path):
    picks = [sample_clients(10, 3, 0, r) for r in range(1, 6)]
    assert all(len(p) == 3 and len(set(p)) == 3 for p in picks)
    assert picks == [sample_clients(10, 3, 0, r) for r in range(1, 6)]
    assert len({tuple(p) for p in picks}) > 1
    cfg = load_config(None, SMALL + ["clients=6", "participation=0.5", "rounds=2", f"output_dir={tmp_path}"])
    run_experiment(cfg, progress=False)
    rows = run_records(tmp_path)
    assert all(len(r["clients"]) == 3 and r["personal_eval"] == "participants" for r in rows)


def test_eval_every_writes_evaluated_rounds_only(tmp_path):
    cfg = load_config(None, SMALL + ["rounds=5", "eval_every=2", f"output_dir={tmp_path}"])
    run_experiment(cfg, progress=False)
    assert [r["round"] for r in run_records(tmp_path)] == [2, 4, 5]


def test_personal_test_split_evaluates_the_local_split_only(tmp_path):
    args = [*SMALL, "rounds=2", "clients=3"]
    rows = {}
    for mode in ("full", "split"):
        out = tmp_path / mode
        config = load_config(None, [*args, f"personal_test={mode}", f"output_dir={out}"])
        run_experiment(config, progress=False)
        rows[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["client_pa_split"] for r in rows["split"]] == [r["client_pa_split"] for r in rows["full"]]
    assert all(r["pa_l"] is None and r["pa_v"] is None and r["pa_global"] is None for r in rows["split"])
    assert all(0.0 <= r["pa_l"] <= 1.0 for r in rows["full"][-1:])  # the last round uses the full test set


def test_full_personal_metrics_every_personal_full_every_evaluated_rounds_pa_split_in_all(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, "rounds=7", "clients=3", "eval_every=2", "personal_full_every=2", f"output_dir={out}"]
    run_experiment(load_config(None, args), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 4, 6, 7]
    full = [r["round"] for r in rows if r["pa_global"] is not None]
    assert full == [4, 7]  # every 2nd evaluated round (rounds 4, 8, ...) and the last
    assert all(r["pa_l"] is not None and r["pa_v"] is not None for r in rows if r["round"] in full)
    assert all(r["pa_l"] is None and r["pa_v"] is None for r in rows if r["round"] not in full)
    assert all(r["personal_acc"] is not None for r in rows)


@requires_fmnist
@pytest.mark.slow
def test_fedavg_fmnist_iid_reaches_acceptance_accuracy(tmp_path):
    """FedAvg learns real data: 3 rounds of 10 IID clients on a 30% stratified subset of Fashion-MNIST's train
    set (18,000 images, a third of the whole set's cost) reach 70% GA on the whole test set."""
    cfg = load_config(
        None,
        [
            "dataset.name=fmnist",
            "dataset.train_fraction=0.3",
            "model.name=simplecnn",
            "partition.scheme=iid",
            "clients=10",
            "rounds=3",
            "local.epochs=1",
            "local.batch_size=32",
            "local.lr=0.05",
            "local.momentum=0.9",
            "eval_every=3",
            f"output_dir={tmp_path}",
        ],
    )
    summary = run_experiment(cfg, progress=False)
    assert summary["final"]["global_acc"] >= 0.70


def test_the_engine_reads_no_reply_field_by_a_string_literal():
    """Reply fields are read through algorithms.context's names (MODEL, NUM_SAMPLES, TRAIN_LOSS) or the typed
    ClientReply, never as reply["model"] / .get("num_samples") in the engine or the Flower backend."""
    import ast

    fields = {"model", "num_samples", "train_loss"}
    src = Path(__file__).resolve().parents[1] / "src" / "fedpcd"
    found = []
    for path in [*(src / "engine").rglob("*.py"), *(src / "flower").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):  # not the record's keys
                key = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                key = node.args[0] if node.func.attr == "get" and node.args else None
            if isinstance(key, ast.Constant) and key.value in fields:
                found.append(f"{path.relative_to(src)}:{node.lineno} {key.value!r}")
    assert not found, found


def test_a_resume_says_the_round_it_continues_from(tmp_path, capsys):
    from fedpcd.backends import resume_run

    out = tmp_path / "run"
    run_experiment(load_config(None, [*SMALL, "clients=2", "rounds=2", f"output_dir={out}"]), progress=False)
    text = (out / "config.yaml").read_text().replace("rounds: 2", "rounds: 3")
    (out / "config.yaml").write_text(text)
    capsys.readouterr()
    resume_run(out, progress=True, allow_changes=["rounds"])
    assert f"fedpcd: resuming {out} from round 2 of 3" in capsys.readouterr().err


def test_the_engine_imports_no_backend_and_no_tracker():
    """The engine is below the backends: no module of fedpcd.engine imports Flower, the trackers, or what
    chooses the backend and builds the observers (function-level imports included)."""
    from test_import_graph import import_graph

    above = ("fedpcd.flower", "fedpcd.trackers", "fedpcd.backends", "fedpcd.observers", "fedpcd.api")
    graph = import_graph()
    found = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module == "fedpcd.engine" or module.startswith("fedpcd.engine.")
        for target in targets
        if target.startswith(above)
    ]
    assert not found, found


def test_the_update_policy_has_one_home():
    """Which side clips, what a divergence under ``drop`` does and when a stored state is kept are decided in
    engine/update_policy.py only: no other engine or Flower module reads those settings."""
    src = Path(__file__).resolve().parents[1] / "src" / "fedpcd"
    found = [
        f"{path.relative_to(src)}"
        for path in [*(src / "engine").rglob("*.py"), *(src / "flower").rglob("*.py")]
        if path.name not in ("update_policy.py", "guard.py")
        and ('clipping == "client"' in path.read_text() or 'on_divergence == "drop"' in path.read_text())
    ]
    assert not found, found


def test_a_resume_reads_its_checkpoint_once(tmp_path, monkeypatch):
    """Run.resume reads and checks the checkpoint; the backend and the round loop use that one."""
    from fedpcd.backends import resume_run

    out = tmp_path / "run"
    run_experiment(load_config(None, [*SMALL, "clients=2", "rounds=1", f"output_dir={out}"]), progress=False)
    loads = []
    real = RunDir.load_checkpoint
    monkeypatch.setattr(RunDir, "load_checkpoint", lambda self, *a: loads.append(1) or real(self, *a))
    summary = resume_run(out, progress=False, changes=["rounds=2"])
    assert summary["rounds"] == 2 and len(loads) == 1

"""Experiment trackers: each logger writes, the files read back with the tool's own reader (MLflow's store
without any environment variable), resume without duplicate steps (W&B's offline history after a SIGKILL
too), the missing-package error, the sweep's grouping, and a 2-round run end to end."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys

import pytest

from fedpcd.config_identity import canonical_config
from fedpcd.engine.records import record_line
from fedpcd.errors import UserError
from fedpcd.resolve import load_config
from fedpcd.run_format import RunFiles
from fedpcd.sweep.grid import expand_sweep
from fedpcd.trackers import INSTALL, check_trackers, open_trackers, scalars

ALL = "tracking.loggers=[csv,tensorboard,wandb,mlflow]"


def record(rnd: int, **extra) -> dict:
    """A metrics.jsonl-like record; accuracies are multiples of 1/8 (exact in float32, as TensorBoard keeps
    them)."""
    return {
        "round": rnd,
        "global_acc": rnd / 8,
        "personal_acc": None,
        "bytes_up": 100 * rnd,
        "personal_eval": "participants",
        "clients": [0, 1],
        "global_class_acc": [0.5, None],
        **extra,
    }


def tensorboard_scalars(run: RunFiles) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.tensorboard))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_text(run: RunFiles, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.tensorboard))
    events.Reload()
    (event,) = events.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def wandb_runs(run: RunFiles) -> list[list[dict]]:
    """The records of each offline W&B run folder (in order of start), read by W&B's own reader."""
    out = []
    for folder in sorted(run.wandb.glob("offline-run-*")):
        text = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        out.append([json.loads(line) for line in text.splitlines() if line.startswith("{")])
    return out


def mlflow_read(run: RunFiles, run_id: str, keys: list[str]) -> tuple:
    """(status, params, tags, {key: [(step, value)]}) of an MLflow run in the run directory's store, opened
    as docs/trackers.md says, with MLFLOW_ALLOW_FILE_STORE unset."""
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        client = MlflowClient(tracking_uri=f"sqlite:///{run.path.resolve()}/mlflow.db")
        data = client.get_run(run_id)
        history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}
    return data.info.status, data.data.params, data.data.tags, history


def csv_rows(run: RunFiles) -> tuple[list[str], list[dict[str, str]]]:
    with open(run.metrics_csv, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


SUMMARY = {"rounds": 3, "wall_s": 1.5, "final": {"global_acc": 0.375, "clients": [0]}, "best": {"pa_l": None}}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run logged by all four loggers: rounds 1-2, then an error; resumed from round 1's checkpoint
    (metrics.jsonl rewritten to its records by the loop, then rounds 2 and 3 logged again), then closed
    with a summary."""
    path = tmp_path_factory.mktemp("tracked") / "run1"
    path.mkdir()
    config = load_config(None, [ALL, "tracking.group=grp", f"output_dir={path}"])
    run = RunFiles(path)
    with pytest.raises(RuntimeError), open_trackers(config, path) as trackers:
        trackers.log(record(1))
        trackers.log(record(2, left_out=[3]))  # a key first seen in round 2
        raise RuntimeError("the run fails")
    first = json.loads(run.trackers.read_text())
    first_status = mlflow_read(run, first["mlflow"]["run_id"], [])[0]
    run.metrics.write_text(record_line(record(1)))  # the checkpoint's records, as the round loop puts back
    with open_trackers(config, path, resume=True) as trackers:
        for again in (record(2, left_out=[3]), record(3)):  # round 2 recomputed as it was
            trackers.log(again)
        trackers.close(SUMMARY)
    return run, first, first_status


def test_state_file_keeps_the_ids_and_the_last_round(resumed):
    run, first, _ = resumed
    state = json.loads(run.trackers.read_text())
    assert {name: entry["last_round"] for name, entry in first.items()} == dict.fromkeys(first, 2)
    assert {name: entry["last_round"] for name, entry in state.items()} == dict.fromkeys(first, 3)
    assert state["wandb"]["id"] == first["wandb"]["id"]  # the same tracker runs go on
    assert state["mlflow"]["run_id"] == first["mlflow"]["run_id"]


def test_csv_mirrors_the_records_once_each(resumed):
    run = resumed[0]
    columns, rows = csv_rows(run)
    assert columns == [*record(1), "left_out"]  # keys in order of first appearance, the late one widened in
    assert [r["round"] for r in rows] == ["1", "2", "3"]  # round 2 logged again on resume: not duplicated
    assert [float(r["global_acc"]) for r in rows] == [1 / 8, 2 / 8, 3 / 8]
    assert rows[0]["personal_acc"] == "" and rows[0]["left_out"] == ""
    assert json.loads(rows[1]["left_out"]) == [3] and json.loads(rows[0]["global_class_acc"]) == [0.5, None]


def test_tensorboard_scalars_per_metric_with_step_round(resumed):
    run = resumed[0]
    tags = tensorboard_scalars(run)
    assert sorted(tags) == [
        "bytes_up",
        "global_acc",
        "summary.final.global_acc",
        "summary.rounds",
        "summary.wall_s",
    ]
    assert tags["global_acc"] == [(1, 0.125), (2, 0.25), (3, 0.375)]
    assert tags["bytes_up"] == [(1, 100.0), (2, 200.0), (3, 300.0)]
    assert tags["summary.final.global_acc"] == [(3, 0.375)]
    assert "group: grp" in tensorboard_text(run, "config")  # config.yaml, written once
    assert len(list(run.tensorboard.glob("events.out.tfevents.*"))) == 1  # rebuilt on resume


def test_wandb_offline_run_resumed_under_the_same_id(resumed):
    """The resume rebuilt the offline run: one folder of the same id, round 1 from the checkpointed records,
    then rounds 2 and 3 once each."""
    run, first, _ = resumed
    sessions = wandb_runs(run)
    assert len(sessions) == 1
    history = [r["history"]["item"] for s in sessions for r in s if r["type"] == "history"]
    assert [(h["_step"], h["global_acc"], h["bytes_up"]) for h in history] == [
        (1, 0.125, 100),
        (2, 0.25, 200),
        (3, 0.375, 300),
    ]
    assert all("clients" not in h and "personal_acc" not in h and "round" not in h for h in history)
    for session in sessions:
        (start,) = [r["run"] for r in session if r["type"] == "run"]
        assert (start["run_id"], start["run_group"], start["project"]) == (
            first["wandb"]["id"],
            "grp",
            "fedpcd",
        )
        assert (
            start["config"]["update"]["seed"] == 0 and start["config"]["update"]["tracking"]["group"] == "grp"
        )
    assert [r["exit"]["exit_code"] for s in sessions for r in s if r["type"] == "exit"] == [0]
    summary = {}
    for r in sessions[0]:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    assert summary["summary.final.global_acc"] == 0.375 and summary["summary.rounds"] == 3


def test_mlflow_store_run(resumed):
    run, first, first_status = resumed
    status, params, tags, history = mlflow_read(
        run, first["mlflow"]["run_id"], ["global_acc", "bytes_up", "summary.final.global_acc", "clients"]
    )
    assert (first_status, status) == ("FAILED", "FINISHED")
    assert history["global_acc"] == [(1, 0.125), (2, 0.25), (3, 0.375)]
    assert history["bytes_up"] == [(1, 100.0), (2, 200.0), (3, 300.0)]
    assert history["summary.final.global_acc"] == [(3, 0.375)]
    assert history["clients"] == []  # lists are skipped
    assert (
        params["seed"] == "0" and params["algorithm.name"] == "fedavg" and params["tracking.group"] == "grp"
    )
    assert json.loads(params["tracking.loggers"]) == ["csv", "tensorboard", "wandb", "mlflow"]
    assert tags["group"] == "grp" and tags["mlflow.runName"] == "run1"


def test_nothing_is_written_outside_the_run_directory(resumed):
    run = resumed[0]
    top = {p.name for p in run.path.iterdir()}
    assert top == {"metrics.jsonl", "trackers.json", "metrics.csv", "tensorboard", "wandb", "mlflow.db"}
    assert {p.name for p in run.wandb.iterdir()} >= {"cache"}  # W&B's caches and logs: in the run too


def test_scalars_keep_finite_numbers_only():
    tree = {"a": 1, "b": 0.5, "c": None, "d": "x", "e": True, "f": [1, 2], "g": {"h": 2, "i": float("nan")}}
    assert scalars(tree) == {"a": 1.0, "b": 0.5, "g.h": 2.0}


def test_without_loggers_nothing_is_written_nor_imported(tmp_path):
    code = (
        "import sys; from pathlib import Path; from fedpcd.config import Config; "
        "from fedpcd.trackers import open_trackers\n"
        f"with open_trackers(Config(), Path({str(tmp_path)!r})) as t:\n"
        "    t.log({'round': 1, 'global_acc': 0.5}); t.close({'rounds': 1})\n"
        "print(sorted(m for m in ('torch', 'wandb', 'mlflow', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "logger,module", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")]
)
def test_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, logger, module):
    monkeypatch.setitem(sys.modules, module, None)  # find_spec and import see it as not installed
    config = load_config(None, [f"tracking.loggers=[csv,{logger}]", f"output_dir={tmp_path}"])
    with pytest.raises(UserError) as err:
        open_trackers(config, tmp_path)
    assert str(err.value) == (
        f"tracking.loggers lists {logger!r}, but the package {module!r} is not installed; {INSTALL}"
    )
    assert list(tmp_path.iterdir()) == []  # checked before any logger writes


def test_mlflow_sqlite_store_without_sqlalchemy_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    config = load_config(None, ["tracking.loggers=[mlflow]", f"output_dir={tmp_path}"])
    with pytest.raises(UserError) as err:
        open_trackers(config, tmp_path)
    assert str(err.value) == (
        "tracking.loggers lists 'mlflow', whose SQLite store needs the package 'sqlalchemy', which is not "
        f"installed; {INSTALL}"
    )
    assert list(tmp_path.iterdir()) == []
    server = ["tracking.loggers=[mlflow]", "tracking.mlflow_uri=http://127.0.0.1:5000"]
    check_trackers(load_config(None, server))  # a tracking server: SQLAlchemy not needed here


def test_config_checks_and_resume_hash(tmp_path):
    assert load_config(None, ["tracking.loggers=csv"]).tracking.loggers == ["csv"]  # one name: a list of it
    for bad, says in (
        ("tracking.loggers=[csv,csv]", "list each logger once"),
        ("tracking.loggers=[neptune]", "'csv', 'tensorboard', 'wandb' or 'mlflow'"),
        ("tracking.wandb_mode=dryrun", "'offline' or 'online'"),
        ("tracking.project=a/b", "tracking.project"),
    ):
        with pytest.raises(UserError, match="^bad value for 'tracking") as err:
            load_config(None, [bad])
        assert says in str(err.value) and "\n" not in str(err.value)
    # trackers do not change what a run computes: a checkpoint's config record ignores them
    plain = load_config(None, [])
    tracked = load_config(None, [ALL, "tracking.group=g", "tracking.wandb_mode=online"])
    assert canonical_config(plain) == canonical_config(tracked)


def test_corrupt_state_file_is_a_user_error(tmp_path):
    config = load_config(None, ["tracking.loggers=[csv]", f"output_dir={tmp_path}"])
    RunFiles(tmp_path).trackers.write_text('{"csv": {"last_round": "two"}}')
    with pytest.raises(UserError, match="is not a fedpcd tracker state file"):
        open_trackers(config, tmp_path, resume=True)


def test_sweep_groups_its_runs_by_its_name(tmp_path):
    def grid(extra: str) -> list:
        path = tmp_path / "sweep.yaml"
        path.write_text(f"output_dir: {tmp_path / 'mysweep'}\n{extra}sweep:\n  seed: [0, 1]\n")
        return expand_sweep(path)

    assert [c.tracking.group for c in grid("tracking: {loggers: [csv]}\n")] == ["mysweep", "mysweep"]
    assert [c.tracking.group for c in grid("tracking: {loggers: [csv], group: mine}\n")] == ["mine", "mine"]
    assert [c.tracking.group for c in grid("")] == [None, None]  # no trackers: the config stays as it was


def test_two_round_run_feeds_every_tracker(tmp_path):
    from fedpcd.backends import run_experiment

    out = tmp_path / "run"
    config = load_config(
        None,
        [ALL, "dataset.name=digits", "model.name=mlp", "clients=4", "rounds=2", f"output_dir={out}"],
    )
    summary = run_experiment(config, progress=False)
    run = RunFiles(out)
    records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    accs = [(r["round"], r["global_acc"]) for r in records]
    assert [r["round"] for r in records] == [1, 2]
    assert [float(r["global_acc"]) for r in csv_rows(run)[1]] == [a for _, a in accs]
    assert tensorboard_scalars(run)["global_acc"] == [
        (s, pytest.approx(a, rel=1e-7)) for s, a in accs
    ]  # float32
    (session,) = wandb_runs(run)
    assert [
        (r["history"]["step"]["num"], r["history"]["item"]["global_acc"])
        for r in session
        if r["type"] == "history"
    ] == accs
    state = json.loads(run.trackers.read_text())
    status, _, _, history = mlflow_read(
        run, state["mlflow"]["run_id"], ["global_acc", "summary.final.global_acc"]
    )
    assert status == "FINISHED" and history["global_acc"] == accs
    assert history["summary.final.global_acc"] == [(2, summary["final"]["global_acc"])]


# a run of 3 rounds (a checkpoint each) logged to W&B offline and killed (SIGKILL) in round argv[2]: where
# argv[1] says, after W&B logged the round and before trackers.json / the checkpoint records it
KILLED_RUN = """
import os, signal, sys
from fedpcd.resolve import load_config
from fedpcd.engine.rundir import RunDir
from fedpcd.backends import run_experiment
from fedpcd.trackers import Trackers

where, rnd = sys.argv[1], int(sys.argv[2])

def kill_when(original, due):
    def patched(self, *args):
        if due(self, *args):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args)
    return patched

if where == "trackers.json":
    Trackers._save = kill_when(Trackers._save, lambda t: t._state["wandb"]["last_round"] == rnd)
else:
    RunDir.save_checkpoint = kill_when(RunDir.save_checkpoint, lambda d, state: state["round"] == rnd)
run_experiment(load_config(None, sys.argv[3:]), progress=False)
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["trackers.json", "checkpoint"])
def test_wandb_offline_history_after_a_kill_has_each_round_once(tmp_path, monkeypatch, where):
    """Killed between W&B's write of round 2 and the checkpoint of round 2 (before or after trackers.json
    records it), then resumed from round 1's checkpoint: W&B's offline history, read by W&B's own reader,
    holds every round once, in order, with the values of metrics.jsonl."""
    from fedpcd.backends import resume_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    args = ["tracking.loggers=[wandb]", "dataset.name=digits", "model.name=mlp", "clients=3", "rounds=3"]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, where, "2", *args, f"output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = RunFiles(out)
    state = json.loads(run.trackers.read_text())
    assert state["wandb"]["last_round"] == (1 if where == "trackers.json" else 2)  # the kill landed there
    resume_run(out, progress=False)
    expected = [(r["round"], r["global_acc"]) for r in map(json.loads, run.metrics.read_text().splitlines())]
    assert [rnd for rnd, _ in expected] == [1, 2, 3]
    history = [
        (r["history"]["step"]["num"], r["history"]["item"]["global_acc"])
        for session in wandb_runs(run)
        for r in session
        if r["type"] == "history"
    ]
    assert history == expected  # steps unique and increasing, none lost
    assert len(list(run.wandb.glob("offline-run-*"))) == 1  # the killed attempt's folder: rebuilt

"""engine.workers: the worker pool gives bitwise the results of one process, survives a dead worker, and its
processes die with the run's."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from conftest import FMNIST_DIR, HETERO_MODELS, requires_fmnist, run_records
from dataset_files import fmnist_test_slice
from fedpcd.algorithms import ALGORITHMS, FedAvg
from fedpcd.backends import resume_run, run_experiment
from fedpcd.engine import pool
from fedpcd.engine.federation import build_federation
from fedpcd.procs_guard import CORES_VAR, usable_cores
from fedpcd.resolve import load_config

FMNIST = [
    "dataset.name=fmnist",
    "dataset.train_fraction=0.03",
    "clients=6",
    "rounds=3",
    "local.batch_size=32",
]


@dataclass
class FailingFedAvg(FedAvg):
    """FedAvg whose client 1 raises in round 2; with ``die_once`` (a file path) the first client of round
    2 that runs in a worker process kills that process (once: the pool must rerun the client)."""

    die_once: str = ""

    def local_update(self, model, data, work):
        if data.id == 1 and work.round == 2:
            raise ValueError("injected failure")
        if self.die_once and work.round == 2 and multiprocessing.parent_process() is not None:
            marker = Path(self.die_once)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().local_update(model, data, work)


@pytest.fixture(scope="module")
def small_test_set(tmp_path_factory) -> Path:
    """The real train set and 10% of the test set: the last round's full evaluation of every personal
    model is most of these runs' time, and the pool's point is the same results, whatever the set's size."""
    return fmnist_test_slice(FMNIST_DIR, tmp_path_factory.mktemp("fmnist"), 0.1)


@pytest.fixture
def failing():
    name = "_pool_test_failing"
    ALGORITHMS.register(name)(FailingFedAvg)
    yield name
    ALGORITHMS.unregister(name)


def _run(tmp_path: Path, name: str, workers: int, args: list[str]) -> list[dict]:
    out = tmp_path / f"{name}-w{workers}"
    run_experiment(
        load_config(None, [*args, f"engine.workers={workers}", f"output_dir={out}"]), progress=False
    )
    return run_records(out)


def _assert_same_for_any_workers(
    tmp_path: Path, args: list[str], counts: tuple[int, ...] = (3,)
) -> list[dict]:
    """The records of ``args`` with workers 1, equal to those with each of ``counts`` (3 by default: two
    worker processes beside this one, the replies of both merged in task order)."""
    want = _run(tmp_path, "ref", 1, args)
    for workers in counts:
        assert _run(tmp_path, "pool", workers, args) == want, f"workers={workers} differs from workers=1"
    return want


@requires_fmnist
@pytest.mark.parametrize(
    ("extra", "counts"),
    [
        (["algorithm.name=fedavg", "partition.scheme=dirichlet", "partition.beta=0.3"], (2, 3)),
        (
            ["algorithm.name=scaffold"],
            (3,),
        ),  # a client state (its control variate) in every reply's round trip
        (["algorithm.name=fednh", "participation=0.5"], (3,)),  # a working value (the scale) and sampling
    ],
    ids=["fedavg", "scaffold", "fednh"],
)
def test_a_pool_is_bitwise_workers_1(tmp_path, extra, counts, small_test_set):
    args = [*FMNIST, f"dataset.root={small_test_set}", *extra]
    records = _assert_same_for_any_workers(tmp_path, args, counts)
    assert records[-1]["pa_global"] is not None  # the last round evaluates every personal metric


def test_model_heterogeneous_fedssa_is_bitwise_workers_1(tmp_path):
    args = [*HETERO_MODELS, "algorithm.name=fedssa", "clients=5", "rounds=3"]
    _assert_same_for_any_workers(tmp_path, args)


def test_a_failing_client_is_left_out_as_with_workers_1(tmp_path, failing, capsys):
    args = [*HETERO_MODELS[:1], "model.name=simplecnn", "clients=4", "rounds=3", f"algorithm.name={failing}"]
    records = _assert_same_for_any_workers(tmp_path, args)
    assert records[1]["left_out"] == [1] and records[1]["clients"] == [0, 2, 3]
    assert capsys.readouterr().err.count("client 1 failed (ValueError: injected failure)") == 2  # w1, w3


def test_a_worker_killed_mid_round_is_restarted_and_its_client_rerun(tmp_path, failing):
    marker = tmp_path / "died"
    args = [*HETERO_MODELS[:1], "model.name=simplecnn", "clients=4", "rounds=3", f"algorithm.name={failing}"]
    want = _run(tmp_path, "ref", 1, args)
    got = _run(tmp_path, "pool", 2, [*args, f"algorithm.die_once={marker}"])
    assert marker.exists(), "no client of round 2 ran in a worker: the test did not kill one"
    assert got == want


def test_auto_uses_one_process_for_a_short_run_and_caps_by_clients(monkeypatch):
    fed = build_federation(load_config(None, ["dataset.name=synthetic16", "clients=3", "participation=0.34"]))
    monkeypatch.setenv(CORES_VAR, "8")
    assert pool.auto_workers(fed) == (1, "1 clients per round")  # 1 client per round: nothing to share
    fed = build_federation(load_config(None, ["dataset.name=synthetic16", "clients=3"]))
    workers, why = pool.auto_workers(fed)
    assert workers == min(3, usable_cores()) and why in (
        "3 clients per round",
        f"{workers} usable cores",
    )
    monkeypatch.setenv(CORES_VAR, "1")
    assert pool.auto_workers(fed)[0] == 1


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@requires_fmnist
def test_kill_9_then_resume_with_workers_2_matches_the_uninterrupted_run(tmp_path):
    args = ["dataset.name=fmnist", "dataset.train_fraction=0.05", "clients=4", "rounds=4", "engine.workers=2"]
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "fedpcd.cli", "run", *args, f"output_dir={out}", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[psutil.Process] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:  # until round 2 is on disk
        workers = _children(proc.pid) or workers  # the worker and multiprocessing's resource tracker
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2 and workers:
            break
        time.sleep(0.2)
    assert proc.poll() is None, (
        f"the run ended before it could be killed: {proc.stderr.read().decode()[-500:]}"
    )
    assert workers, "the run started no worker process"
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive, f"worker processes {[p.pid for p in alive]} outlived their killed parent"
    resume_run(out, progress=False)
    ref = tmp_path / "ref"
    run_experiment(load_config(None, [*args[:-1], "engine.workers=1", f"output_dir={ref}"]), progress=False)
    assert run_records(out) == run_records(ref)
    assert len(json.loads((out / "summary.json").read_text())["final"]) > 0


def test_a_sweeps_jobs_share_the_cores_instead_of_oversubscribing_them(monkeypatch):
    from fedpcd import launchers

    monkeypatch.setattr(launchers, "die_with_parent", lambda parent: None)
    monkeypatch.setenv(CORES_VAR, "64")  # restored after the test
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    launchers._start_job(os.getpid(), 8 // 3)  # what LocalLauncher gives each of 3 jobs on 8 cores
    assert os.environ[CORES_VAR] == "2" and usable_cores() == 2

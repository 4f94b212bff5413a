"""Shared test setup: one torch thread (two spin-wait: up to 20x slower on a loaded 2-core box); the stop
signals at their defaults."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fedpcd

# FEDPCD_TEST_THREADS: run the suite under another thread count (results must not depend on it)
torch.set_num_threads(int(os.environ.get("FEDPCD_TEST_THREADS", "1")))
# one core per test process (the suite already spreads its files over the cores): engine.workers: auto runs
# in-process, also in the CLI processes the tests start; the worker pool's tests ask for workers explicitly
os.environ["FEDPCD_CORES"] = "1"

# The suite may run as a background job (a script's `make test &`), which starts with SIGINT and SIGQUIT
# ignored; a command started with a signal ignored keeps ignoring it (as `nohup` relies on), so the commands
# the signal tests start would too. The suite's processes take the signals' defaults, as a terminal's
# foreground command has them, and so do the commands they start.
for _sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def fmnist_available() -> bool:
    return (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists() or bool(os.environ.get("FEDPCD_DATA"))


requires_fmnist = pytest.mark.skipif(
    not fmnist_available(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)"
)


# a small synthetic run whose every evaluated round has every personal metric (PA-L, PA-V, PA-G too)
SMALL_EVERY_METRIC = [
    "dataset.name=synthetic",
    "model.name=mlp",
    "model.hidden=32",
    "local.batch_size=32",
    "personal_full_every=1",
]

# the model-heterogeneous setting of the end-to-end tests: a client per architecture CNN-1..5
HETERO_MODELS = [
    "dataset.name=synthetic16",
    "model.name=[cnn1, cnn2, cnn3, cnn4, cnn5]",
    "local.batch_size=32",
]
CNN5_SYNTHETIC16 = 416 + 12_832 + 16_500 + 250_500 + 5_010  # parameters of CNN-5 on 1x16x16, 10 classes


def tiny_client(labels: torch.Tensor, num_classes: int, seed: int, cid: int = 0, local_test: bool = False):
    """A client of 1x2x2 "images" shifted by their label (models built with image_size=2)."""
    from fedpcd.algorithms import ClientData

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(labels), 1, 2, 2, generator=g) + labels[:, None, None, None].float()
    return ClientData(
        id=cid,
        x=x,
        y=labels,
        train_idx=torch.arange(len(labels)),
        test_x=x,
        test_y=labels,
        local_test_idx=torch.arange(len(labels) if local_test else 0),
        num_classes=num_classes,
    )


def tiny_mlp(hidden: int = 8):
    """The unit tests' 3-class MLP on 1x2x2 inputs (``tiny_client``'s), same initial weights each call."""
    from fedpcd.models import build_model

    torch.manual_seed(0)
    return build_model("mlp", 1, 3, 2, hidden=hidden)


def seeded(seed: int = 1) -> torch.Generator:
    """A CPU generator in a known state (a client update's batch order)."""
    return torch.Generator().manual_seed(seed)


def local_work(payload, state=None, seed: int | None = None, **values):
    """A client update's work (round 1) with ``values`` as working values."""
    from fedpcd.algorithms import LocalWork

    rng = torch.Generator() if seed is None else torch.Generator().manual_seed(seed)
    return LocalWork(payload, state, rng, **values)


def spy_sgd(monkeypatch) -> list[dict[str, Any]]:
    """The client loops' SGD optimisers as they step (``fedpcd.algorithms.sgd.SGD``): one entry per optimiser
    that stepped, in order (its parameters, lr, momentum and decay; the entry keeps the optimiser)."""
    from fedpcd.algorithms.sgd import SGD

    loops: list[dict[str, Any]] = []
    real = SGD.step

    def step(self: SGD) -> None:
        if not loops or loops[-1]["opt"] is not self:
            loops.append(
                {
                    "opt": self,
                    "params": self.params,
                    "lr": self.lr,
                    "momentum": self.momentum,
                    "decay": self.weight_decay,
                }
            )
        real(self)

    monkeypatch.setattr(SGD, "step", step)
    return loops


def run_records(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl records without their wall-clock times (which differ between equal runs)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("wall_s")
    return rows


def run_summary(run_dir: Path) -> dict:
    """A run's summary.json without its wall-clock times."""
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_s")
    s["final"].pop("wall_s", None)
    return s


def assert_same_backend_run(local: Path, flower: Path) -> None:
    """A Flower run equals the local backend's bitwise: metrics (floats compared exactly), summaries,
    partitions and configs (but for ``backend`` and the output folder)."""
    assert run_records(local) == run_records(flower)
    assert run_summary(local) == run_summary(flower)
    assert (local / "partition.json").read_text() == (flower / "partition.json").read_text()
    cl = (local / "config.yaml").read_text().replace("backend: local", "backend: flower")
    assert cl.replace(str(local), "OUT") == (flower / "config.yaml").read_text().replace(str(flower), "OUT")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in the order `make test` (``--dist loadfile``: a file is one work unit, given to the workers in
    this order, two each at the start) should start them: the files with tests that start Ray, Flower or job
    processes (marked ``procs``: minutes without a line of output) first, each followed by a file without
    them, then the other files with slow tests, then the rest; stable otherwise. The long files so start at
    once instead of ending the run, and a worker next to a ``procs`` file goes through other tests, a dot
    each, so progress shows: with two workers the ``procs`` files share one worker."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    procs = {item.path for item in items if item.get_closest_marker("procs")}
    files = sorted(dict.fromkeys(item.path for item in items), key=lambda p: (p not in procs, p not in slow))
    first, rest = files[: len(procs)], files[len(procs) :]
    order: list[Path] = []
    for i, path in enumerate(first):
        order += [path, *rest[i : i + 1]]
    rank = {path: i for i, path in enumerate(order + rest[len(first) :])}
    items.sort(key=lambda item: rank[item.path])


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without xdist (-p no:xdist)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """A line as each worker is ready (starting a worker imports torch and collects the suite: a minute on a
    loaded machine), where ``-q`` shows nothing until the first test ends."""
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{node.gateway.id} ready: {len(ids)} tests")


TINY_SYNTHETIC = [  # a tiny synthetic federation: the DP, robust aggregation and server optimiser tests
    "dataset.name=synthetic",
    "dataset.train_fraction=0.1",
    "model.name=mlp",
    "model.hidden=16",
    "local.batch_size=64",
    "personal_test=split",
]


# the command line in a subprocess, as a user runs it (the hardening tests)
SRC = str(Path(fedpcd.__file__).resolve().parents[1])  # this checkout's package, for the subprocesses


TINY = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "local.batch_size=32", "clients=2"]


def cli_main(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``fedpcd ARGV`` through its entry point (``fedpcd.cli.main``) in this process, from ``cwd``: its exit
    code, stdout and stderr as ``subprocess.run`` gives them, without a new interpreter (and torch's import)
    per command. The tests of what a command says and writes use it; those of signals, processes and imports
    start real processes (:func:`start_cli`)."""
    from fedpcd.cli import main

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd or before)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # --help, argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["fedpcd", *argv], code, out.getvalue(), err.getvalue())


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The command failed with exit code 2 and exactly one 'fedpcd: error:' line on stderr."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpcd: error: "), proc.stderr
    return lines[0]


def install_plugin(site: Path, code: str) -> None:
    """An installed plugin (a dist-info with its entry point, and its module) in the folder ``site``."""
    info = site / "fedpcd_exit-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Name: fedpcd-exit\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedpcd.models]\nexit = fedpcd_exit\n")
    (site / "fedpcd_exit.py").write_text(code)


def start_cli(argv: list[str], out_dir: Path, **popen: object) -> subprocess.Popen:
    """``python -m fedpcd.cli ARGV`` in a new session, stdout and stderr to files in ``out_dir``."""
    with open(out_dir / "stdout.txt", "wb") as out, open(out_dir / "stderr.txt", "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "fedpcd.cli", *argv],
            stdout=out,
            stderr=err,
            start_new_session=True,
            **popen,
        )


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) (.*)$")


def log_lines(path) -> list[tuple[str, str]]:
    """(level, message) of each line of a run.log; every line must have a time and a level (a traceback's
    lines follow the line of its error and are skipped)."""
    lines = path.read_text().splitlines()
    assert lines and LOG_LINE.match(lines[0]), lines[:1]
    return [m.groups() for m in map(LOG_LINE.match, lines) if m]

"""A sweep of short runs: `fedpcd sweep` with its defaults against the same grid on one core.

The grid: ``--runs`` seeds (default 12) of FedAvg on Fashion-MNIST (10% of the train set, Simple-CNN, 10
clients Dir(0.5), 2 rounds). Timed, each a fresh `fedpcd sweep` process into its own folder, alternating
(``--repeats`` times, the median kept) so that a change of load touches both alike:

- reference: ``--jobs 1 engine.workers=1``: one run after another in one process, one core (what a sweep of
  short runs got before ``--jobs auto``: a short run's ``engine.workers: auto`` keeps one process);
- defaults: ``--jobs auto`` and ``engine.workers: auto``.

Prints the machine, the load before and after, both medians and their ratio against the target of
``TARGET``; checks that every run's metrics.jsonl equals the reference's (but wall times) and writes
``--json`` (default docs/performance/sweep_speed.json). Exits 1 when the metrics differ.

    python benchmarks/sweep_speed.py [--runs 12] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from demo_time import finish, load, machine_report

TARGET = 1.7  # the defaults at least this many times faster than one process
ROOT = Path(__file__).resolve().parents[1]


def grid(folder: Path, runs: int) -> Path:
    spec = {
        "dataset": {"name": "fmnist", "train_fraction": 0.1},
        "partition": {"scheme": "dirichlet", "beta": 0.5},
        "model": {"name": "simplecnn"},
        "clients": 10,
        "rounds": 2,
        "output_dir": str(folder / "runs"),
        "sweep": {"seed": list(range(runs))},
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def timed_sweep(folder: Path, runs: int, args: list[str]) -> float:
    """Seconds of one `fedpcd sweep` of a fresh grid in ``folder`` (emptied first)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    path = grid(folder, runs)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FEDPCD_CORES", None)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", "sweep", "--quiet", "--config", str(path), *args],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"fedpcd sweep {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return wall


def records(folder: Path) -> dict[str, list[dict]]:
    """Each run's metrics.jsonl records without wall times."""
    out = {}
    for metrics in sorted((folder / "runs").glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        for row in rows:
            row.pop("wall_s", None)
        out[metrics.parent.name] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="timings of each side (median kept)")
    parser.add_argument("--json", default=str(ROOT / "docs" / "performance" / "sweep_speed.json"))
    args = parser.parse_args()
    sides = {"one_process": ["--jobs", "1", "engine.workers=1"], "defaults": []}
    labels = {"one_process": "one process (--jobs 1 engine.workers=1)", "defaults": "defaults (--jobs auto)"}
    before = load()
    times: dict[str, list[float]] = {label: [] for label in sides}
    with tempfile.TemporaryDirectory(prefix="fedpcd-sweep-speed-") as tmp:
        results = {}
        for _ in range(args.repeats):
            for i, (label, extra) in enumerate(sides.items()):
                folder = Path(tmp) / str(i)
                times[label].append(timed_sweep(folder, args.runs, extra))
                results[label] = records(folder)
        reference, defaults = results.values()
    same = reference == defaults and len(reference) == args.runs
    medians = {label: statistics.median(t) for label, t in times.items()}
    ratio = medians["one_process"] / medians["defaults"]
    report = {
        **machine_report(before),
        "runs": args.runs,
        "seconds": times,
        "median_s": medians,
        "ratio": ratio,
        "target": TARGET,
        "metrics_equal": same,
    }
    print(f"{report['machine']['cpu']}, {report['machine']['usable_cores']} usable cores; load {before}")
    print(f"a sweep of {args.runs} runs of 2 rounds (Fashion-MNIST 10%, Simple-CNN, 10 clients):")
    for side, seconds in medians.items():
        print(f"  {labels[side]:42s} {seconds:7.1f} s")
    verdict = "met" if ratio >= TARGET else "missed"
    print(f"defaults / one process: {ratio:.2f}x (target >= {TARGET}x: {verdict})")
    finish(report, args.json, same, "metrics bitwise equal to one process's")


if __name__ == "__main__":
    main()

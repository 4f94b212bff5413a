"""How long the `fedpcd` command takes to answer before any work: help, listings, init, input errors.

Times (median of 5, ``--repeats``, after one untimed warm-up each) `fedpcd --help`, the listings (`fedpcd
list`, `fedpcd list configs`, `fedpcd list NAME` of a partition scheme, of an algorithm and of an unknown
name), `fedpcd init`, `fedpcd config show` and a config path typo, each a fresh process started from this
Python's bin/, against `python -c pass` (the interpreter's own start) measured in the same run, the rounds
interleaved so that a change of load touches every command alike; `python -c "import torch"` is timed
alike for comparison. Prints the machine, the load average before and after, and each command's median in
seconds and as a ratio to `python -c pass`, marking those above the target of ``TARGET`` times it. `fedpcd
list NAME` reads the shipped components' descriptions as rendered (src/fedpcd/descriptions.json), `fedpcd
config show` their declarations (src/fedpcd/declarations.json: parameters, presets, a model's size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from demo_time import cpu_model, load, machine_report

REPEATS = 5
TARGET = 40  # a command's median at most this many times `python -c pass`


def commands(fedpcd: str) -> dict[str, list[str]]:
    """Label -> argv; the first is the reference."""
    return {
        'python -c "pass"': [sys.executable, "-c", "pass"],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "fedpcd --help": [fedpcd, "--help"],
        "fedpcd list configs": [fedpcd, "list", "configs"],
        "fedpcd list": [fedpcd, "list"],
        "fedpcd list dirichlet": [fedpcd, "list", "dirichlet"],
        "fedpcd list fedavg": [fedpcd, "list", "fedavg"],
        "fedpcd list fedfoo (unknown)": [fedpcd, "list", "fedfoo"],
        "fedpcd init (a second time: exists)": [fedpcd, "init"],
        "fedpcd config show": [fedpcd, "config", "show"],
        "fedpcd config show (a headline config, a preset)": [
            fedpcd,
            "config",
            "show",
            "--config",
            "headline/fednh-fmnist",
        ],
        "fedpcd run --config missing.yaml": [fedpcd, "run", "--config", "missing.yaml"],
        "fedpcd run algorithm.name=fedgella (unknown)": [fedpcd, "run", "algorithm.name=fedgella"],
        "fedpcd config show roundz=3 (unknown key)": [fedpcd, "config", "show", "roundz=3"],
    }


def seconds(argv: list[str], cwd: str) -> float:
    """Wall time of one run of ``argv``; its output is discarded (a user error's exit 2 is expected)."""
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode not in (0, 2) or "Traceback" in done.stderr:
        sys.exit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return wall


def medians(cmds: dict[str, list[str]], cwd: str, repeats: int) -> dict[str, float]:
    """Each command's median wall time over ``repeats`` runs from ``cwd``, after one untimed warm-up each (the
    files in the page cache, .pyc files written), the rounds interleaved so that a change of load touches
    every command alike."""
    times: dict[str, list[float]] = {label: [] for label in cmds}
    for argv in cmds.values():
        seconds(argv, cwd)
    for _ in range(repeats):
        for label, argv in cmds.items():
            times[label].append(seconds(argv, cwd))
    return {label: statistics.median(values) for label, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, help=f"timed runs of each (default {REPEATS})"
    )
    parser.add_argument(
        "--json", default="docs/performance/cold_start.json", help="where the figures go (JSON)"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats
    fedpcd = str(Path(sys.executable).parent / "fedpcd")
    print(f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {cpu_model()}")
    print(f"niceness: {os.nice(0)}")
    before = load()
    print(f"load average before: {before}")
    with tempfile.TemporaryDirectory(prefix="fedpcd-cold-start-") as cwd:
        median_s = medians(commands(fedpcd), cwd, repeats)
    after = load()
    print(f"load average after: {after}")
    reference = next(iter(median_s.values()))
    print(f"median of {repeats} runs each, and as a ratio to the first (the interpreter's start):")
    for label, median in median_s.items():
        over = f"  above the target of {TARGET} x" if median / reference > TARGET else ""
        print(f"  {label:<38} {median:6.2f} s  {median / reference:6.2f} x{over}")
    rows = [{"command": label, "seconds": m, "ratio": m / reference} for label, m in median_s.items()]
    report = {**machine_report(before), "load_after": after, "niceness": os.nice(0), "repeats": repeats}
    report.update(target=TARGET, count=len(rows), rows=rows)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""How long the `fedpcd` command takes to answer before any work: help, the registries, a config path typo.

Times (median of 5, after one untimed warm-up each) `fedpcd --help`, `fedpcd list configs`, `fedpcd list`
and `fedpcd run --config <a missing file>`, each a fresh process started from this Python's bin/, against
`python -c "import torch"` measured in the same run, the rounds interleaved so that a change of load
touches every command alike. Prints the machine, the load average before and after, and each command's
median in seconds and as a ratio to the torch import: under 1 means the command answered without paying
for torch, about 1 or more that it imported it (`fedpcd list` must: the registries are the algorithm and
model modules).

    python benchmarks/cold_start.py          # its output here: docs/performance/cold_start.txt
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from demo_time import cpu_model, load

REPEATS = 5


def commands(fedpcd: str) -> dict[str, list[str]]:
    """Label -> argv; the first is the reference."""
    return {
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "fedpcd --help": [fedpcd, "--help"],
        "fedpcd list configs": [fedpcd, "list", "configs"],
        "fedpcd list": [fedpcd, "list"],
        "fedpcd run --config missing.yaml": [fedpcd, "run", "--config", "missing.yaml"],
    }


def seconds(argv: list[str], cwd: str) -> float:
    """Wall time of one run of ``argv``; its output is discarded (a user error's exit 2 is expected)."""
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode not in (0, 2) or "Traceback" in done.stderr:
        sys.exit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return wall


def main() -> None:
    fedpcd = str(Path(sys.executable).parent / "fedpcd")
    print(f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {cpu_model()}")
    print(f"niceness: {os.nice(0)}")
    print(f"load average before: {load()}")
    cmds = commands(fedpcd)
    times: dict[str, list[float]] = {label: [] for label in cmds}
    with tempfile.TemporaryDirectory(prefix="fedpcd-cold-start-") as cwd:
        for argv in cmds.values():  # warm-up: the files in the page cache, .pyc files written
            seconds(argv, cwd)
        for _ in range(REPEATS):
            for label, argv in cmds.items():
                times[label].append(seconds(argv, cwd))
    print(f"load average after: {load()}")
    medians = {label: statistics.median(values) for label, values in times.items()}
    reference = next(iter(medians.values()))
    print(f"median of {REPEATS} runs each, and as a ratio to the first (the torch import):")
    for label, median in medians.items():
        print(f"  {label:<34} {median:6.2f} s  {median / reference:5.2f} x")


if __name__ == "__main__":
    main()

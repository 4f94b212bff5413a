"""How long `fedpcd demo` takes here, with the machine and its load: the number the README states.

Runs `fedpcd demo --quiet --out <a fresh temporary folder> [overrides]` once, from start to end (nothing
reused), and prints the machine (cores, CPU model), the load average before and after, the CPU time the
demo used as a share of its wall time, and the wall time. Under load the demo takes longer: state the
time with the load it was measured at.

    python benchmarks/demo_time.py [KEY=VALUE ...]    # e.g. rounds=2 for a quick check of the script
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def machine_report(before: str) -> dict:
    """The head of a benchmark's JSON: the date, the CPU and its usable cores, the load ``before`` the run."""
    cores = len(os.sched_getaffinity(0))
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_model(), "usable_cores": cores},
        "load_before": before,
    }


def finish(report: dict, path: str, same: bool, what: str) -> None:
    """The end of a benchmark that checks results: the load now into ``report`` (printed), whether the
    results were ``same`` (``what`` they are), ``report`` written as JSON to ``path``; exit 1 unless same."""
    report["load_after"] = load()
    print(f"load after {report['load_after']}")
    print(f"{what}: {'yes' if same else 'NO'}")
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if same else 1)


def main() -> None:
    overrides = sys.argv[1:]
    fedpcd = shutil.which("fedpcd") or str(Path(sys.executable).parent / "fedpcd")
    print(f"machine: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), {cpu_model()}")
    print(f"load average before: {load()}")
    with tempfile.TemporaryDirectory(prefix="fedpcd-demo-time-") as tmp:
        cmd = [fedpcd, "demo", "--quiet", "--out", str(Path(tmp) / "demo"), *overrides]
        print("command:", " ".join(cmd), flush=True)
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"fedpcd demo failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = children.ru_utime + children.ru_stime
    print(f"load average after: {load()}")
    print(f"CPU time of the demo: {cpu:.0f} s ({100 * cpu / wall:.0f}% of one core over its wall time)")
    print(f"wall time: {wall:.0f} s ({wall / 60:.1f} min)")


if __name__ == "__main__":
    main()

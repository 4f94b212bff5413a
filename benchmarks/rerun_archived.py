"""Rerun archived runs with today's code and compare their metrics.jsonl (wall times aside) bitwise.

Each run directory's config.yaml is read as a resume reads it (keys added since it was written take the value
the run was made with) and run again into a temporary folder with ``engine.workers`` set; it prints one line
per run and worker count (and the metrics today's code adds), and exits 1 when any rerun differs in a metric
both have. The reference is the archived metrics.jsonl, or
with ``--reference COMMIT`` a rerun of the same config by the code of that commit (checked out in a temporary
git worktree): archives made on another machine or by older code can differ in the last bits, so a
refactor's "bitwise the same" is proven against the commit before it, on one machine.

    python benchmarks/rerun_archived.py docs/results/runs/fedmr-fmnist-p5c2/fedavg_seed0 --workers 1 2
    python benchmarks/rerun_archived.py RUN ... --reference eb57575 --set rounds=3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedpcd.backends import run_experiment
from fedpcd.resolve import load_run_config

ROOT = Path(__file__).resolve().parents[1]
# a run by the reference commit's code (its own config reader: it knows no key added later)
REFERENCE_RUN = """
import sys, torch
torch.set_num_threads(1)
try:  # a run directory's config as a resume reads it, where the reference has that reader
    from fedpcd.resolve import load_run_config as load
except ImportError:  # code from before fedpcd.resolve
    try:
        from fedpcd.config import load_run_config as load
    except ImportError:
        from fedpcd.config import load_config as load
try:  # where the reference chooses the backend
    from fedpcd.backends import run_experiment as run
except ImportError:
    from fedpcd.engine.simulation import run_local as run
run(load(sys.argv[1], sys.argv[2:]), progress=False)
"""


def records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.pop("wall_s", None)
    return rows


def reference_records(src: Path, config: Path, out: Path, overrides: list[str]) -> list[dict]:
    """The metrics of ``config`` run by the code under ``src`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-c", REFERENCE_RUN, str(config.resolve()), f"output_dir={out}", *overrides]
    subprocess.run(cmd, check=True, env=env, cwd=out.parent)
    return records(out / "metrics.jsonl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="archived run directories")
    parser.add_argument("--workers", nargs="+", type=int, default=[1], help="engine.workers of the reruns")
    parser.add_argument(
        "--reference", metavar="COMMIT", help="compare with this commit's code, not the archive"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every rerun")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        src = None
        if args.reference:
            tree = Path(tmp) / "reference"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), args.reference]
            )
            src = tree / "src"
        try:
            for i, run in enumerate(args.runs):
                if src is None:
                    want = records(run / "metrics.jsonl")
                else:
                    want = reference_records(src, run / "config.yaml", Path(tmp) / f"ref{i}", args.set)
                for workers in args.workers:
                    out = Path(tmp) / f"new{i}-{workers}"
                    overrides = [f"output_dir={out}", f"engine.workers={workers}", *args.set]
                    t0 = time.perf_counter()
                    run_experiment(load_run_config(run / "config.yaml", overrides), progress=False)
                    got = records(out / "metrics.jsonl")
                    # metrics added since the reference was made are listed, every other one compared
                    added = sorted({k for row in got for k in row} - {k for row in want for k in row})
                    shared = [{k: v for k, v in row.items() if k not in added} for row in got]
                    verdict = "bitwise identical" if shared == want else "DIFFERS"
                    same &= shared == want
                    against = f"commit {args.reference}" if src else "the archive"
                    new = f"; new metrics: {', '.join(added)}" if added else ""
                    print(
                        f"{run} workers={workers}: {verdict} to {against} ({len(got)} records, "
                        f"{time.perf_counter() - t0:.0f} s{new})",
                        flush=True,
                    )
        finally:
            if src is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src.parent)])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

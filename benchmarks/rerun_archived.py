"""Rerun archived runs with today's code and compare their metrics.jsonl (wall times aside) bitwise.

Each run directory's config.yaml is read as a resume reads it (keys added since it was written take the value
the run was made with) and run again into a temporary folder with ``engine.workers`` set; it prints one
line per run and worker count, and exits 1 when any rerun differs from its archive.

    python benchmarks/rerun_archived.py docs/results/runs/fedmr-fmnist-p5c2/fedavg_seed0 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedpcd.config import load_run_config
from fedpcd.engine.simulation import run_local


def records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.pop("wall_s", None)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="archived run directories")
    parser.add_argument("--workers", nargs="+", type=int, default=[1], help="engine.workers of the reruns")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    same = True
    for run in args.runs:
        want = records(run / "metrics.jsonl")
        for workers in args.workers:
            with tempfile.TemporaryDirectory() as tmp:
                config = load_run_config(
                    run / "config.yaml", [f"output_dir={tmp}/run", f"engine.workers={workers}"]
                )
                t0 = time.perf_counter()
                run_local(config, progress=False)
                got = records(Path(tmp) / "run" / "metrics.jsonl")
            verdict = "bitwise identical" if got == want else "DIFFERS"
            same &= got == want
            print(
                f"{run} workers={workers}: {verdict} ({len(got)} records, {time.perf_counter() - t0:.0f} s)"
            )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

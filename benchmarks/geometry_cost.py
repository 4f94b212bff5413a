"""What the class-mean angles cost: recorded by the run (``geometry: true``) against rebuilt by the report.

The setting of FedGELA's geometry sweep (configs/repro/fedgela-fmnist-dirichlet.yaml: Fashion-MNIST 25%,
Simple-CNN, 10 clients Dir(0.1), 5 local epochs, evaluation every round) at ``--rounds`` rounds (default 1,
where the angles weigh most), FedAvg and FedGELA, seeds 0 .. ``--seeds`` - 1, one torch thread, one
process. For each run, alternating so that a change of load touches each alike:

- plain: the run without the angles; its rounds' seconds (summary.json ``wall_s``: training and the
  evaluation every run does) are the reference;
- recorded: the same run with ``geometry: true`` (the same rounds, plus one pass of features per model in
  the last round);
- rebuilt: ``fedpcd.report.geometry.run_geometry`` of the plain run (what ``fedpcd report --geometry`` does
  for a run without recorded angles: one more local update of every client from the final checkpoint).

Prints each run's extra seconds as a fraction of the plain run's, and the totals against the target of at
most ``TARGET``; checks that the recorded run's metrics equal the plain run's but for the angles and wall
times; writes ``--json`` (default docs/performance/geometry_cost.json). Exits 1 when the metrics differ.

    python benchmarks/geometry_cost.py [--rounds 1] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from demo_time import finish, load, machine_report

from fedpcd.backends import run_experiment
from fedpcd.report.geometry import run_geometry
from fedpcd.resolve import load_config
from fedpcd.run_format import ANGLES

TARGET = 0.10  # the angles' extra seconds at most this fraction of the runs' own
ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("fedavg", "fedgela")
SETTING = [  # configs/repro/fedgela-fmnist-dirichlet.yaml's
    "dataset.train_fraction=0.25",
    "clients=10",
    "local.epochs=5",
    "local.batch_size=64",
    "local.lr=0.01",
    "local.momentum=0.9",
    "local.weight_decay=1e-5",
    "model.name=simplecnn",
    "eval_every=1",
    "partition.scheme=dirichlet",
    "partition.beta=0.1",
]


def rounds_seconds(out: Path) -> float:
    return float(json.loads((out / "summary.json").read_text())["wall_s"])


def records(out: Path) -> list[dict]:
    """metrics.jsonl without wall times and angles."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "wall_s" and k not in ANGLES} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "docs" / "performance" / "geometry_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = load()
    runs, same = [], True
    with tempfile.TemporaryDirectory(prefix="fedpcd-geometry-cost-") as tmp:
        for seed in range(args.seeds):
            for name in ALGORITHMS:
                overrides = [*SETTING, f"rounds={args.rounds}", f"seed={seed}", f"algorithm.name={name}"]
                plain, recorded = Path(tmp) / f"{name}-{seed}", Path(tmp) / f"{name}-{seed}-geometry"
                for out, extra in ((plain, []), (recorded, ["geometry=true"])):
                    config = load_config(None, [*overrides, *extra, f"output_dir={out}"])
                    run_experiment(config, progress=False)
                started = time.perf_counter()
                run_geometry(plain)
                rebuilt = time.perf_counter() - started
                same = same and records(plain) == records(recorded)
                runs.append(
                    {
                        "algorithm": name,
                        "seed": seed,
                        "plain_s": rounds_seconds(plain),
                        "recorded_s": rounds_seconds(recorded),
                        "rebuilt_s": rebuilt,
                    }
                )
    plain_total = sum(r["plain_s"] for r in runs)
    recorded_extra = sum(r["recorded_s"] - r["plain_s"] for r in runs) / plain_total
    rebuilt_extra = sum(r["rebuilt_s"] for r in runs) / plain_total
    report = {
        **machine_report(before),
        "rounds": args.rounds,
        "runs": runs,
        "recorded_extra": recorded_extra,
        "rebuilt_extra": rebuilt_extra,
        "target": TARGET,
        "metrics_equal": same,
    }
    print(f"{report['machine']['cpu']}, one torch thread; load {before}")
    print(f"FedGELA's geometry sweep at {args.rounds} round(s): each run's seconds, then the angles' extra:")
    for r in runs:
        print(
            f"  {r['algorithm']:8s} seed {r['seed']}: {r['plain_s']:7.1f} s; recorded "
            f"{r['recorded_s'] - r['plain_s']:+6.1f} s, rebuilt by the report {r['rebuilt_s']:6.1f} s"
        )
    verdict = "met" if recorded_extra <= TARGET else "missed"
    print(f"recorded: {recorded_extra:+.1%} of the runs' seconds (target <= {TARGET:.0%}: {verdict})")
    print(f"rebuilt by the report: {rebuilt_extra:+.1%}")
    finish(report, args.json, same, "metrics equal but the angles")


if __name__ == "__main__":
    main()

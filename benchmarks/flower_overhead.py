"""Flower's per-round overhead as a ratio to the local backend, measured in one process.

The same config runs on each backend; a round's time is the ``wall_s`` every backend writes to
metrics.jsonl (from sending the payloads to the recorded round: training, personal and generic evaluation,
aggregation, and for Flower the messaging). The first round also pays one-off costs (Ray actors or workers
import torch and build the federation), so the ratio uses rounds 2.. ("steady"); startup is shown apart.

- local: ``run_experiment`` (backend local), clients one after another in this process;
- flower simulation: ``run_flower`` (Ray), default = as many ClientApps at once as cores, and with one Ray
  CPU (one ClientApp at a time: the same sequential compute as local, so the ratio is pure overhead);
- flower deployment: a SuperLink and ``--nodes`` SuperNodes on 127.0.0.1 with long-lived ClientApp workers
  (``fedpcd.flower.deploy``), against local with as many clients; ``--per-message`` adds Flower's default
  (a fresh ClientApp process per message).
Every Flower run is also checked to give bitwise the same metrics as local.

    python benchmarks/flower_overhead.py [--dataset fmnist] [--clients 4] [--nodes 2] [--rounds 4]
        [--train-fraction 0.25] [--skip-deploy] [--skip-serial] [--per-message] [--keep]

Absolute times on a small shared machine are noise; compare the ratios, which are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedpcd.backends import run_experiment
from fedpcd.resolve import load_config


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _same(a: Path, b: Path) -> bool:
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in _rows(a)]
    return strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in _rows(b)]


def _measure(
    name: str, clients: int, run_dir: Path, total_s: float, local_dir: Path | None
) -> dict[str, Any]:
    walls = [r["wall_s"] for r in _rows(run_dir)]
    steady = walls[1:] or walls
    return {
        "mode": name,
        "clients": clients,
        "first": walls[0],
        "steady": statistics.mean(steady),
        "total": total_s,
        "same": None if local_dir is None else _same(local_dir, run_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--model", default="simplecnn")
    parser.add_argument("--clients", type=int, default=4, help="clients of the simulation comparison")
    parser.add_argument(
        "--nodes", type=int, default=2, help="SuperNodes (= clients) of the deployment comparison"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--train-fraction", type=float, default=0.25)
    parser.add_argument("--skip-deploy", action="store_true")
    parser.add_argument("--skip-serial", action="store_true", help="skip the one-Ray-CPU simulation")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed at the end)")
    parser.add_argument(
        "--per-message",
        action="store_true",
        help="also time Flower's default deployment (a new ClientApp process per message)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    from fedpcd.engine import Run
    from fedpcd.flower.deploy import LoopbackDeployment
    from fedpcd.flower.simulation import run_flower

    base = [
        "seed=0",
        f"dataset.name={args.dataset}",
        f"dataset.train_fraction={args.train_fraction}",
        f"model.name={args.model}",
        f"rounds={args.rounds}",
        "engine.threads=1",
        "engine.checkpoint_every=0",
    ]
    out = Path(tempfile.mkdtemp(prefix="fedpcd-bench-flower-"))
    load = [os.getloadavg()[0]]
    results: list[dict[str, Any]] = []

    def local(tag: str, clients: int) -> Path:
        d = out / tag
        t0 = time.perf_counter()
        run_experiment(load_config(None, base + [f"clients={clients}", f"output_dir={d}"]), progress=False)
        results.append(_measure("local", clients, d, time.perf_counter() - t0, None))
        return d

    ref = local("local", args.clients)
    sims = [("flower simulation (Ray, all cores)", None)]
    if not args.skip_serial:
        sims.append(("flower simulation (Ray, 1 CPU)", 1))
    for i, (name, cpus) in enumerate(sims):
        d = out / f"sim{i}"
        cfg = load_config(None, base + [f"clients={args.clients}", f"output_dir={d}", "backend=flower"])
        t0 = time.perf_counter()
        run_flower(Run.create(cfg), progress=False, num_cpus=cpus)
        results.append(_measure(name, args.clients, d, time.perf_counter() - t0, ref))
    if not args.skip_deploy:
        ref2 = local("local-deploy", args.nodes) if args.nodes != args.clients else ref
        modes = [("flower deployment (long-lived workers)", True)]
        if args.per_message:
            modes.append(("flower deployment (process per message)", False))
        for i, (name, long_lived) in enumerate(modes):
            d = out / f"deploy{i}"
            cfg = load_config(None, base + [f"clients={args.nodes}", f"output_dir={d}"])
            t0 = time.perf_counter()
            with LoopbackDeployment(args.nodes, long_lived=long_lived) as dep:
                dep.run(cfg)
            results.append(_measure(name, args.nodes, d, time.perf_counter() - t0, ref2))
    load.append(os.getloadavg()[0])

    local_steady = {r["clients"]: r["steady"] for r in results if r["mode"] == "local"}
    header = ["mode", "clients", "round 1 s", "rounds 2+ s", "ratio vs local", "run total s", "same metrics"]
    rows = [
        [
            r["mode"],
            str(r["clients"]),
            f"{r['first']:.2f}",
            f"{r['steady']:.2f}",
            f"{r['steady'] / local_steady[r['clients']]:.2f}",
            f"{r['total']:.1f}",
            "-" if r["same"] is None else ("bitwise" if r["same"] else "NO"),
        ]
        for r in results
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print(
        f"\n{args.dataset} x{args.train_fraction}, {args.model}, {args.rounds} rounds, "
        "1 torch thread per process; "
        f"{os.cpu_count()} cores, load average {load[0]:.1f} before / {load[1]:.1f} after"
        + (f"; runs in {out}" if args.keep else "")
    )
    print(
        "ratio = mean round time (rounds 2+) / local's with the same clients; "
        "< 1 means clients ran in parallel"
    )
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

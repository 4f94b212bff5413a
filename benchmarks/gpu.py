"""The GPU checks: every algorithm on CUDA against the CPU, throughput, GPU memory, the worker pool.

Four parts, written to one JSON file (``--out``, default docs/performance/gpu.json) with the machine, torch,
the CUDA device's name and the date:

- parity: every registered algorithm for 2 rounds on a small federation, on the CPU and on CUDA in this
  process: each device's final GA and PA-split, the CUDA - CPU gap (percentage points) and any error a
  device mix-up raises (``error``, one line);
- throughput: speed.py's measurement (one FedAvg round; samples/s of a plain PyTorch loop with the data on
  the device, and of the engine's sequential and vectorized executors, as ratios to the plain loop) with 10
  and 100 clients per round, Simple-CNN on Fashion-MNIST and ResNet-18 on synthetic 3x32x32, on each device;
- memory: ``torch.cuda.max_memory_allocated`` over one round of each executor, per client (the peak above
  what was allocated before the round, divided by the clients) and as a ratio to the model's weights;
- pool: FedAvg rounds on the CPU with the worker pool at 1, 2, 4, 8 and 16 processes (those the usable cores
  allow; speed.py's ``train_only``), as samples/s and speed-ups over 1 process (the first round, with the
  workers' start, left out).

Every figure comes with its reference ratio. Without a CUDA device the CUDA parts hold "no CUDA device",
never a figure. ``--smoke`` runs a tiny CPU-only version of every part (synthetic data, 2 clients, small
models) in well under a minute; the test suite runs it (tests/test_gpu_script.py).

    python benchmarks/gpu.py [--smoke] [--out FILE]       # docs/performance.md: running it on a GPU machine
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from demo_time import cpu_model
from speed import Setting, measure, register_synthetic32, side_config, train_only

from fedpcd.algorithms import ALGORITHMS
from fedpcd.backends import run_experiment
from fedpcd.config import Config
from fedpcd.engine.federation import build_federation
from fedpcd.engine.pool import usable_cores
from fedpcd.errors import clip
from fedpcd.resolve import load_config

NO_CUDA = "no CUDA device"
METRICS = {"ga": "global_acc", "pa": "personal_acc"}  # the parity's figures: GA and PA-split
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "performance" / "gpu.json"
PARITY = [  # every algorithm's federation: Fashion-MNIST, Simple-CNN, 10 clients Dir(0.5), 2 rounds
    "dataset.name=fmnist",
    "dataset.train_fraction=0.05",
    "model.name=simplecnn",
    "clients=10",
    "rounds=2",
    "engine.checkpoint_every=0",
]
SMOKE_PARITY = [  # the same checks at toy size
    "dataset.name=synthetic16",
    "dataset.train_fraction=0.1",
    "model.name=cnn5",
    "clients=2",
    "rounds=2",
    "local.batch_size=32",
    "engine.checkpoint_every=0",
]
SETTINGS = {  # cuts of long server-side loops (the parity is of the device, not of the method's result)
    "fedbn": ["model.name=mlp_bn"],  # FedBN keeps batch-norm layers local: a model with them
    "creff": ["algorithm.retrain_epochs=2", "algorithm.match_steps=2"],
    "fedetf": ["algorithm.finetune_rounds=1", "algorithm.finetune_epochs=1"],
}
THROUGHPUT = [  # model, dataset, samples per client, batch size, training set size, repeats
    ("simplecnn", "fmnist", 320, 64, 60000, 3),
    ("resnet18", "synthetic32", 4, 4, 2000, 1),
]
SMOKE_THROUGHPUT = [("simplecnn", "synthetic16", 10, 10, 1000, 1)]
CLIENTS, SMOKE_CLIENTS = (10, 100), (2,)
WORKERS = (1, 2, 4, 8, 16)
PARTS = ("parity", "throughput", "memory", "pool")
POOL_ROUNDS, POOL_FRACTION = 3, 0.25  # speed.py's side-by-side federation: 20 clients Dir(0.1)
SMOKE_POOL = ["dataset.name=synthetic16", "model.name=cnn5", "clients=2", "dataset.train_fraction=0.1"]


def cuda_or_none() -> torch.device | None:
    """The CUDA device, None where there is none."""
    return torch.device("cuda") if torch.cuda.is_available() else None


def one_run(overrides: list[str], device: str) -> dict[str, Any]:
    """A run's final GA and PA-split (%) on ``device``, or the error it raised (one line)."""
    with tempfile.TemporaryDirectory(prefix="fedpcd-gpu-") as tmp:
        try:
            config = load_config(None, [*overrides, f"engine.device={device}", f"output_dir={tmp}/run"])
            final = run_experiment(config, progress=False)["final"]
        except Exception as exc:  # a device mix-up raises a RuntimeError; any failure is reported as found
            return {"error": clip(f"{type(exc).__name__}: {' '.join(str(exc).split())}", 300)}
    return {k: None if final.get(key) is None else 100 * final[key] for k, key in METRICS.items()}


def parity(base: list[str], cuda: bool) -> list[dict[str, Any]]:
    """Every algorithm's run on the CPU and on CUDA, and the CUDA - CPU gap of GA and PA (points)."""
    rows = []
    for name in ALGORITHMS.names():
        overrides = [*base, f"algorithm.name={name}", *SETTINGS.get(name, [])]
        row: dict[str, Any] = {"algorithm": name, "cpu": one_run(overrides, "cpu")}
        row["cuda"] = one_run(overrides, "cuda") if cuda else NO_CUDA
        cpu, gpu = row["cpu"], row["cuda"]
        if isinstance(gpu, dict) and "error" not in cpu and "error" not in gpu:
            row["gap"] = {k: None if None in (gpu[k], cpu[k]) else gpu[k] - cpu[k] for k in METRICS}
        print(f"parity {name}: {row}", flush=True)
        rows.append(row)
    return rows


def throughput(table: list[tuple[Any, ...]], clients: tuple[int, ...], device: str) -> list[dict[str, Any]]:
    """speed.py's rows (samples/s and ratios to the plain loop) of every model and clients per round."""
    rows = []
    for model, dataset, samples, batch, size, repeats in table:
        for k in clients:
            setting = Setting(model, dataset, k, None, samples, batch, size, repeats)
            rows.append({"device": device, **measure(setting, **{"engine.device": device})})
            print(f"throughput {device} {model} {k} clients: {rows[-1]}", flush=True)
    return rows


def memory(table: list[tuple[Any, ...]], clients: tuple[int, ...]) -> list[dict[str, Any]]:
    """The CUDA memory one round of each executor allocates at its peak, per client, against the model."""
    from speed import FederatedRunner, build

    rows = []
    for model, dataset, samples, batch, size, _ in table:
        for k in clients:
            setting = Setting(model, dataset, k, None, samples, batch, size, 1)
            fed, feds = build(setting, **{"engine.device": "cuda"})
            weights = sum(t.numel() * t.element_size() for t in fed.model_for(0).state_dict().values())
            for executor in [e for e, f in feds.items() if f is not None]:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                FederatedRunner(feds[executor]).round(1, list(range(k)))
                per_client = (torch.cuda.max_memory_allocated() - before) / k
                rows.append(
                    {
                        "model": model,
                        "clients": k,
                        "executor": executor,
                        "model_bytes": weights,
                        "peak_bytes_per_client": per_client,
                        "ratio_to_model": per_client / weights,
                    }
                )
                print(f"memory {rows[-1]}", flush=True)
            del fed, feds
            torch.cuda.empty_cache()
    return rows


def pool(config: Config, workers: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    """FedAvg rounds of every client with 1, 2, 4, ... workers on the CPU: samples/s over rounds 2.. and the
    speed-up over 1 worker."""
    fed = build_federation(config)
    samples = sum(c.num_samples for c in fed.clients)
    rows = []
    for n in workers:
        seconds = train_only(fed, n, rounds)[1:]  # the first round starts the workers
        rows.append({"workers": n, "samples_per_s": samples * len(seconds) / sum(seconds)})
        rows[-1]["speedup"] = rows[-1]["samples_per_s"] / rows[0]["samples_per_s"]
        print(f"pool {rows[-1]}", flush=True)
    return rows


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cuda = cuda_or_none()
    return {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "usable_cores": usable_cores(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(cuda) if cuda is not None else NO_CUDA,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU-only version of every part")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the JSON file (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to run (default all)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    register_synthetic32()
    cuda = cuda_or_none() is not None and not args.smoke
    table, clients = (SMOKE_THROUGHPUT, SMOKE_CLIENTS) if args.smoke else (THROUGHPUT, CLIENTS)
    result: dict[str, Any] = {**machine(), "smoke": args.smoke}
    if "parity" in args.parts:
        result["parity"] = parity(SMOKE_PARITY if args.smoke else PARITY, cuda)
    if "throughput" in args.parts:
        result["throughput"] = {
            "cpu": throughput(table, clients, "cpu"),
            "cuda": throughput(table, clients, "cuda") if cuda else NO_CUDA,
        }
    if "memory" in args.parts:
        result["memory"] = memory(table, clients) if cuda else NO_CUDA
    if "pool" in args.parts:
        cores = usable_cores()
        workers = tuple(n for n in WORKERS if n <= cores and (not args.smoke or n <= 2))
        if args.smoke:
            result["pool"] = pool(load_config(None, [*SMOKE_POOL, "output_dir=unused"]), workers, 2)
        else:
            result["pool"] = pool(side_config(POOL_FRACTION, POOL_ROUNDS, "unused"), workers, POOL_ROUNDS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

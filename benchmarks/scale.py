"""Scale: 1,000 clients with personal state, 10 per round; peak RSS and state bytes.

For each algorithm (FedAvg, FedPer, MOON, SCAFFOLD) and client-state backend (memory, disk; the engine's
``engine.client_state``), one fresh process (so that each peak RSS is its own) runs, on fmnist:

1. a fill phase: every client trains once, in rounds of ``--per-round`` consecutive clients, so that all
   ``--clients`` clients end with a personal state (FedPer's head, MOON's previous model, SCAFFOLD's
   control variates; FedAvg keeps none);
2. ``--rounds`` ordinary rounds of ``--per-round`` sampled clients, with personal evaluation on the local
   test splits (``personal_test: split``) and GA in the last one.

Clients are trained through the engine's executor seam (``fedpcd.engine.executor.LocalExecutor``) with a
:class:`fedpcd.engine.state_store.ClientStateStore` as the client states. Printed per run: peak RSS
(``ru_maxrss``), RSS after the data and the federation were built, the number of stored states, bytes per
client state (tensor bytes in memory, file size on disk), the state's share of the model, which keys it
holds, and the time. Target: FedAvg with 1,000 clients and 10 per round under 2 GB peak RSS.

    python benchmarks/scale.py [--clients 1000] [--per-round 10] [--rounds 3] [--backends memory disk]
    python benchmarks/scale.py --quick        # synthetic data, 40 clients, in this process (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import build_federation, global_accuracy, sample_clients
from fedpcd.engine.state_store import ClientStateStore
from fedpcd.engine.tasks import payloads_for
from fedpcd.resolve import load_config
from fedpcd.run_format import PA_SPLIT

ALGORITHMS = ("fedavg", "fedper", "moon", "scaffold")
TARGET_MB = 2048  # FedAvg, 1,000 clients, 10 per round


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, MB (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float | None:
    """The current resident set size, MB (None where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * resource.getpagesize() / 2**20


def state_keys(state: Any) -> str:
    """A short description of what a client state holds: its top-level keys (head keys for a state dict)."""
    if state is None:
        return "-"
    if isinstance(state, dict):
        return ",".join(str(k) for k in state)
    return type(state).__name__


def run_one(args: argparse.Namespace, algorithm_name: str, backend: str, workdir: Path) -> dict[str, Any]:
    """One algorithm on one backend, in this process; returns the measurements."""
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cfg = load_config(
        None,
        [
            f"dataset.name={args.dataset}",
            f"dataset.train_fraction={args.train_fraction}",
            f"clients={args.clients}",
            "partition.scheme=pathological",
            "partition.classes_per_client=2",
            f"participation={args.per_round / args.clients}",
            f"model.name={args.model}",
            f"local.batch_size={args.batch_size}",
            f"algorithm.name={algorithm_name}",
            "personal_test=split",
            f"engine.executor={args.executor}",
            f"engine.client_state={backend}",
            f"output_dir={workdir}",
        ],
    )
    fed = build_federation(cfg)
    algorithm = fed.new_algorithm()
    model = fed.model_for(0, fresh=True)
    server = algorithm.init_server(model)
    model_bytes = tensor_bytes(model.state_dict())
    store = ClientStateStore(backend, workdir / "client_states" if backend == "disk" else None, fed.device)
    rss_setup = rss_mb()
    setup_s = time.perf_counter() - t0

    def one_round(rnd: int, ids: list[int], evaluate: bool) -> list[dict[str, Any]]:
        nonlocal server
        results = LocalExecutor(fed, states=store).train(
            algorithm, payloads_for(algorithm, server, ids), rnd, evaluate
        )
        failed = [r for r in results if getattr(r, "error", None) is not None]
        if failed:
            raise RuntimeError(f"client {failed[0].client} failed: {failed[0].error!r}")
        server = algorithm.aggregate(server, [r.update for r in results])
        return [r.metrics for r in results if r.metrics]

    t1 = time.perf_counter()
    rnd = 0
    for start in range(0, args.clients, args.per_round):  # fill: every client once
        rnd += 1
        one_round(rnd, list(range(start, min(start + args.per_round, args.clients))), False)
    fill_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    personal: list[float] = []
    ga = None
    for i in range(args.rounds):
        rnd += 1
        ids = sample_clients(args.clients, args.per_round, cfg.seed, rnd)
        metrics = one_round(rnd, ids, True)
        personal = [m[PA_SPLIT.key] for m in metrics if m.get(PA_SPLIT.key) is not None]
        if i == args.rounds - 1:
            ga = global_accuracy(algorithm, fed.model_for(0), fed, server)
    rounds_s = time.perf_counter() - t2
    sample = store[next(iter(store))] if len(store) else None
    per_state = store.nbytes() / len(store) if len(store) else 0.0
    return {
        "algorithm": algorithm_name,
        "backend": backend,
        "clients": args.clients,
        "per_round": args.per_round,
        "states": len(store),
        "state_bytes": per_state,
        "state_share": per_state / model_bytes,
        "state_keys": state_keys(sample),
        "store_mb": store.nbytes() / 2**20,
        "model_bytes": model_bytes,
        "rss_setup_mb": rss_setup,
        "peak_rss_mb": peak_rss_mb(),
        "setup_s": setup_s,
        "fill_s": fill_s,
        "rounds_s": rounds_s,
        "ga": ga,
        PA_SPLIT.key: sum(personal) / len(personal) if personal else None,
    }


def run_child(args: argparse.Namespace, algorithm_name: str, backend: str) -> dict[str, Any]:
    """``run_one`` in a fresh Python process (its own peak RSS)."""
    cmd = [sys.executable, __file__, "--one", algorithm_name, backend, *args.passthrough]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{algorithm_name}/{backend} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (
    f"{'algorithm':10s} {'backend':7s} {'states':>6s} {'B/state':>9s} {'share':>6s} {'store MB':>8s} "
    f"{'setup RSS':>9s} {'peak RSS':>8s} {'fill s':>7s} {'rounds s':>8s} {'GA':>6s} {'PA':>6s}  state keys"
)


def print_row(r: dict[str, Any]) -> None:
    """One table line."""
    print(
        f"{r['algorithm']:10s} {r['backend']:7s} {r['states']:6d} {r['state_bytes']:9.0f} "
        f"{r['state_share']:6.2f} {r['store_mb']:8.1f} {_fmt(r['rss_setup_mb'], '8.0f')}M "
        f"{r['peak_rss_mb']:7.0f}M {r['fill_s']:7.1f} {r['rounds_s']:8.1f} {_fmt(r['ga'], '6.3f')} "
        f"{_fmt(r[PA_SPLIT.key], '6.3f')}  {r['state_keys'][:60]}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="synthetic16, 40 clients, in-process (smoke test)"
    )
    parser.add_argument("--clients", type=int, help="default 1000 (quick: 40)")
    parser.add_argument("--per-round", type=int, help="default 10 (quick: 5)")
    parser.add_argument("--rounds", type=int, default=3, help="sampled rounds after the fill phase")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    parser.add_argument("--backends", nargs="+", default=["memory", "disk"], choices=["memory", "disk"])
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--train-fraction", type=float, default=0.25, help="fmnist: 15 samples per client")
    parser.add_argument("--model", default="simplecnn")
    parser.add_argument("--batch-size", type=int, default=5, help="3 local steps of 15 samples")
    parser.add_argument("--executor", default="auto", help="engine.executor (auto | sequential | vectorized)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--in-process", action="store_true", help="no child processes (peak RSS is shared)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--one", nargs=2, metavar=("ALGORITHM", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.dataset, args.rounds, args.in_process = "synthetic16", 1, True
    args.clients = args.clients or (40 if args.quick else 1000)
    args.per_round = args.per_round or (5 if args.quick else 10)
    raw = list(sys.argv[1:] if argv is None else argv)
    args.passthrough = [a for a in raw if a not in ("--in-process",)]
    if args.one:
        with tempfile.TemporaryDirectory(prefix="fedpcd-scale-") as tmp:
            print(json.dumps(run_one(args, args.one[0], args.one[1], Path(tmp))))
        return 0
    print(
        f"fedpcd scale benchmark: {args.clients} clients, {args.per_round} per round, {args.model} on "
        f"{args.dataset} (train_fraction {args.train_fraction}), executor {args.executor}, "
        f"{args.threads} torch thread(s); one process per row: {not args.in_process}",
        flush=True,
    )
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows = []
    for name in args.algorithms:
        for backend in args.backends:
            if args.in_process:
                with tempfile.TemporaryDirectory(prefix="fedpcd-scale-") as tmp:
                    row = run_one(args, name, backend, Path(tmp))
            else:
                row = run_child(args, name, backend)
            rows.append(row)
            print_row(row)
    fedavg = [r for r in rows if r["algorithm"] == "fedavg"]
    ok = all(r["peak_rss_mb"] < TARGET_MB for r in fedavg) if fedavg else None
    print(
        "\nB/state: bytes per stored client state (memory: tensor bytes; disk: file size); share: of the "
        "model's bytes; setup RSS: after data + federation were built"
    )
    if ok is not None:
        worst = max(r["peak_rss_mb"] for r in fedavg)
        print(
            f"target: FedAvg peak RSS < {TARGET_MB} MB with {args.clients} clients, {args.per_round} per "
            f"round: {worst:.0f} MB -> {'PASS' if ok else 'FAIL'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "pass": ok}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FedAvg training throughput as a ratio to a plain PyTorch loop (target >= 0.9).

Both sides train the same model class on the same samples with the same batch size and optimiser, in one
process, alternating, with one torch thread:
- federated: one FedAvg round, 10 clients x 1 local epoch, through the engine's run_client and aggregate
  (evaluation excluded);
- plain: one epoch of a hand-written loop over the same in-memory tensors (shuffled index batches).
ratio = plain time / federated time = federated throughput / plain throughput. Absolute times on a shared
machine are noise; the ratio is measured in the same run.

    python benchmarks/throughput.py [--dataset fmnist] [--model simplecnn] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fedpcd.engine.client_update import run_client
from fedpcd.engine.federation import build_federation
from fedpcd.engine.tasks import ClientTask
from fedpcd.resolve import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--model", default="simplecnn")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_config(
        None,
        [
            f"dataset.name={args.dataset}",
            f"model.name={args.model}",
            "partition.scheme=iid",
            f"clients={args.clients}",
            f"local.batch_size={args.batch_size}",
            "local.epochs=1",
            "output_dir=/dev/null",
        ],
    )
    fed = build_federation(cfg)
    algorithm = fed.new_algorithm()
    model = fed.new_model()
    server = algorithm.init_server(model)
    x, y = fed.clients[0].x, fed.clients[0].y
    all_idx = torch.cat([c.train_idx for c in fed.clients])

    def federated_round(rnd: int) -> float:
        nonlocal server
        t0 = time.perf_counter()
        replies = []
        for client in fed.clients:
            payload = algorithm.payload_for(server, client.id)
            replies.append(
                run_client(algorithm, fed, ClientTask(rnd, client.id, payload, None, False)).update
            )
        server = algorithm.aggregate(server, replies)
        return time.perf_counter() - t0

    plain_model = fed.new_model()

    def plain_epoch(rnd: int) -> float:
        t0 = time.perf_counter()
        opt = torch.optim.SGD(
            plain_model.parameters(),
            lr=cfg.local.lr,
            momentum=cfg.local.momentum,
            weight_decay=cfg.local.weight_decay,
        )
        plain_model.train()
        g = torch.Generator().manual_seed(rnd)
        order = all_idx[torch.randperm(len(all_idx), generator=g)]
        for start in range(0, len(order), args.batch_size):
            idx = order[start : start + args.batch_size]
            loss = F.cross_entropy(plain_model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return time.perf_counter() - t0

    plain_epoch(0)  # warm-up both paths
    federated_round(0)
    ratios = []
    for rep in range(1, args.repeats + 1):
        tp = plain_epoch(rep)
        tf = federated_round(rep)
        ratios.append(tp / tf)
        print(f"repeat {rep}: plain {tp:.2f} s, federated {tf:.2f} s, ratio {tp / tf:.3f}")
    print(
        f"samples per epoch: {len(all_idx)}; {args.dataset}/{args.model}, batch {args.batch_size}, "
        f"{args.clients} clients, {args.threads} thread(s)"
    )
    print(
        f"throughput ratio federated/plain (median of {args.repeats}): {statistics.median(ratios):.3f} "
        f"(target >= 0.9)"
    )


if __name__ == "__main__":
    main()

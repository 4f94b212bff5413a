"""The local backend: the round loop in one process, one model object per architecture reused for every
client (a client without state gets it reset to the architecture's seeded initial weights)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fedpcd.config import Config, load_config
from fedpcd.data.stats import partition_json
from fedpcd.engine.executor import train_clients
from fedpcd.engine.federation import build_federation, global_accuracy, sample_clients, set_threads
from fedpcd.engine.rundir import RunDir, round_record, summary_of
from fedpcd.errors import UserError

RecordHook = Callable[[dict[str, Any]], None]


def is_eval_round(rnd: int, config: Config) -> bool:
    return rnd % config.eval_every == 0 or rnd == config.rounds


def run_local(config: Config, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) an experiment in-process; writes the run directory and returns the summary."""
    set_threads(config)
    fed = build_federation(config)
    run_dir = RunDir(config.output_dir)
    algorithm = fed.new_algorithm()
    if resume:
        ckpt = run_dir.load_checkpoint()
        server, client_states, start, wall = (
            ckpt["server"],
            ckpt["client_states"],
            ckpt["round"],
            ckpt["wall_s"],
        )
        records = run_dir.truncate(start)
    else:
        run_dir.create(
            config, partition_json(fed.partition, fed.dataset.train_y.numpy(), fed.dataset.test_y.numpy())
        )
        server = algorithm.init_server(fed.model_for(0, fresh=True))  # client 0's architecture
        client_states: dict[int, Any] = {}
        start, wall, records = 0, 0.0, []

    bar = tqdm(
        range(start + 1, config.rounds + 1),
        initial=start,
        total=config.rounds,
        disable=not progress,
        desc=f"{config.algorithm.name}",
        unit="round",
        leave=False,
    )
    for rnd in bar:
        t0 = time.perf_counter()
        evaluate = is_eval_round(rnd, config)
        ids = sample_clients(config.clients, config.participation, config.seed, rnd)
        results = train_clients(algorithm, fed, server, ids, client_states, rnd, evaluate)
        replies = [r.reply for r in results]
        evals = [r.metrics for r in results]
        down = sum(r.bytes_down for r in results)
        up = sum(r.bytes_up for r in results)
        server = algorithm.aggregate(server, replies)
        ga = global_accuracy(algorithm, fed.model_for(0), fed, server) if evaluate else None
        round_wall = time.perf_counter() - t0
        wall += round_wall
        if evaluate:
            record = round_record(rnd, ga, replies, evals, ids, up, down, round_wall)
            run_dir.append(record)
            records.append(record)
            bar.set_postfix(GA=_fmt(record["global_acc"]), PA=_fmt(record["personal_acc"]))
        every = config.engine.checkpoint_every
        if every and (rnd % every == 0 or rnd == config.rounds):
            run_dir.save_checkpoint(
                {"round": rnd, "server": server, "client_states": client_states, "wall_s": wall}
            )
    bar.close()
    summary = summary_of(records, wall, config.rounds)
    run_dir.write_summary(summary)
    return summary


def resume_run(run_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """Continue an interrupted run from its last checkpoint, with its own resolved config."""
    path = Path(run_dir)
    if not RunDir(path).checkpoint.exists():
        raise UserError(f"no checkpoint in {path}: nothing to resume (is it a fedpcd run directory?)")
    config = load_config(path / "config.yaml", [f"output_dir={path}"])
    return run_local(config, resume=True, progress=progress)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"

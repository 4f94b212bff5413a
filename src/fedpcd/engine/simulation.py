"""The local backend: the round loop in one process, one model object per architecture reused for every
client (a client without state gets it reset to the architecture's seeded initial weights).

Reliability (engine/guard.py, engine/rundir.py, engine/checkpoint.py): a client that raises is left out
of its round with a warning; a non-finite reply stops the run (or, with ``engine.on_divergence: drop``, is
left out); the run holds a lock on its directory, checkpoints every ``engine.checkpoint_every`` rounds (server
and client states, the metrics so far, the global RNG states) and ``resume_run`` continues from the last
checkpoint to the same metrics.jsonl as an uninterrupted run.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fedpcd.algorithms import FedAvg
from fedpcd.config import Config, load_config
from fedpcd.data.stats import partition_json
from fedpcd.engine.checkpoint import (
    check_allowed_changes,
    check_checkpoint,
    checkpoint_records,
    checkpoint_state,
    restore_rng,
)
from fedpcd.engine.executor import train_clients
from fedpcd.engine.federation import (
    Federation,
    build_federation,
    global_evaluation,
    resolve_device,
    sample_clients,
    set_threads,
)
from fedpcd.engine.guard import check_server, screen_replies, warn
from fedpcd.engine.metrics import accuracy, predict
from fedpcd.engine.records import round_record, summary_of
from fedpcd.engine.rundir import RunDir
from fedpcd.engine.state_store import state_store_for
from fedpcd.errors import UserError
from fedpcd.run_format import headline

RecordHook = Callable[[dict[str, Any]], None]


def is_eval_round(rnd: int, config: Config) -> bool:
    return rnd % config.eval_every == 0 or rnd == config.rounds


def extra_global_accuracies(algorithm: FedAvg, fed: Federation, server: dict[str, Any]) -> dict[str, float]:
    """The accuracies of the algorithm's extra global predictors on the full test set (``global_acc_<name>``
    in metrics.jsonl; see ``FedAvg.extra_global_predictors``)."""
    test_x = getattr(fed, "test_x", None)
    test_y = getattr(fed, "test_y", None)
    if test_x is None or test_y is None:
        test_x, test_y = fed.dataset.normalized("test"), fed.dataset.test_y
    return {
        name: accuracy(predict(predictor, test_x), test_y)
        for name, predictor in algorithm.extra_global_predictors(fed.model_for(0), server)
    }


def aggregate_round(
    algorithm: FedAvg,
    config: Config,
    rnd: int,
    server: dict[str, Any],
    replies: list[dict[str, Any]],
    ids: list[int],
) -> dict[str, Any]:
    """``algorithm.aggregate`` with the round named in any failure, then the server-state divergence check."""
    try:
        server = algorithm.aggregate(server, replies)
    except UserError:
        raise
    except Exception as exc:
        raise RuntimeError(
            f"round {rnd}: algorithm {config.algorithm.name!r} failed to aggregate the updates of client(s) "
            f"{', '.join(map(str, ids))}: {type(exc).__name__}: {exc}"
        ) from exc
    check_server(config, rnd, server, ids)
    return server


def run_local(
    config: Config, resume: bool = False, progress: bool = True, allow_changes: Sequence[str] = ()
) -> dict[str, Any]:
    """Run (or resume) an experiment in-process; writes the run directory and returns the summary.

    The run directory is locked for the run (a second process on it gets a UserError naming this one). A
    resume refuses a checkpoint written with another config, but for the ``allow_changes`` keys
    (``checkpoint.RESUME_CHANGES``)."""
    set_threads(config)
    run_dir = RunDir(config.output_dir)
    if not resume:
        run_dir.check_new(config)  # before loading any data
    with run_dir.lock():
        return _run_locked(config, run_dir, resume, progress, allow_changes)


def _run_locked(
    config: Config, run_dir: RunDir, resume: bool, progress: bool, allow_changes: Sequence[str]
) -> dict[str, Any]:
    ckpt = None
    if resume and run_dir.checkpoint.exists():  # checked before any data is loaded
        ckpt = run_dir.load_checkpoint(resolve_device(config.engine.device))
        check_checkpoint(ckpt, run_dir, config, allow_changes)
        if ckpt["round"] < config.rounds:
            run_dir.discard_summary()  # of a finished run whose rounds were raised: it goes on
    fed = build_federation(config)
    algorithm = fed.new_algorithm()
    if ckpt is not None:
        server, start, wall = ckpt["server"], ckpt["round"], float(ckpt.get("wall_s", 0.0))
        client_states = state_store_for(config, fed.device)
        client_states.replace(ckpt["client_states"])  # disk: files written after the checkpoint are undone
        records = checkpoint_records(ckpt, run_dir.checkpoint)
        if records is None:  # a checkpoint written before checkpoints held the metrics
            records = run_dir.truncate(start)
        else:  # metrics.jsonl as it was at the checkpoint (drops rounds after it and any torn line)
            run_dir.rewrite(records)
        for k in range(config.clients):  # build every architecture's model (seeds the global RNG) ...
            fed.model_for(k)
        restore_rng(ckpt.get("rng"))  # ... before the global RNG states are put back
    else:
        # a fresh run, or a resumed one killed before its first checkpoint: from round 0, same config
        run_dir.create(
            config,
            partition_json(fed.partition, fed.dataset.train_y.numpy(), fed.dataset.test_y.numpy()),
            restart=resume,
        )
        server = algorithm.init_server(fed.model_for(0, fresh=True))  # client 0's architecture
        client_states = state_store_for(config, fed.device)
        client_states.clear()  # disk: the files of an attempt killed before its first checkpoint
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
    drop = config.engine.on_divergence == "drop"
    for rnd in bar:
        t0 = time.perf_counter()
        evaluate = is_eval_round(rnd, config)
        ids = sample_clients(config.clients, config.participation, config.seed, rnd)
        before = {k: copy.deepcopy(client_states.get(k)) for k in ids} if drop else {}
        results = train_clients(algorithm, fed, server, ids, client_states, rnd, evaluate)
        screened = screen_replies(
            config,
            rnd,
            [r.client for r in results],
            [r.reply if r.error is None else None for r in results],
            [r.error for r in results],
        )
        for k in screened.diverged:  # a dropped update leaves the client's state as it was
            if before.get(k) is None:
                client_states.pop(k, None)
            else:
                client_states[k] = before[k]
        kept = [results[i] for i in screened.kept]
        kept_ids = [r.client for r in kept]
        replies = [r.reply for r in kept]
        down = sum(r.bytes_down for r in results)
        up = sum(r.bytes_up for r in results)
        server = aggregate_round(algorithm, config, rnd, server, replies, kept_ids)
        round_wall = time.perf_counter() - t0
        if evaluate:
            ga, ga_classes = global_evaluation(algorithm, fed.model_for(0), fed, server)
            extra = extra_global_accuracies(algorithm, fed, server)
            round_wall = time.perf_counter() - t0
            record = round_record(
                rnd, ga, replies, [r.metrics for r in kept], kept_ids, up, down, round_wall, extra, ga_classes
            )
            if len(kept) < len(results):
                record["left_out"] = sorted({*screened.failed, *screened.diverged})
            run_dir.append(record)
            records.append(record)
            bar.set_postfix(headline(record))
        wall += round_wall
        every = config.engine.checkpoint_every
        if every and (rnd % every == 0 or rnd == config.rounds):
            run_dir.save_checkpoint(checkpoint_state(rnd, server, client_states, wall, records, config))
    bar.close()
    summary = summary_of(records, wall, config.rounds)
    run_dir.write_summary(summary)
    return summary


def resume_run(
    run_dir: str | Path, progress: bool = True, allow_changes: Sequence[str] = ()
) -> dict[str, Any]:
    """Continue an interrupted run from its last checkpoint, with its own resolved config.

    A run killed before its first checkpoint restarts from round 0 (its config.yaml is kept); a finished
    run (summary.json) is not run again: its summary is returned, unless ``rounds`` was raised (allowed in
    ``allow_changes``): then it goes on. A config.yaml changed since the checkpoint is refused with a
    one-line diff, but for the ``allow_changes`` keys (only ``checkpoint.RESUME_CHANGES`` may be given)."""
    check_allowed_changes(allow_changes)
    path = Path(run_dir)
    rd = RunDir(path)
    rd.check_links()
    if not rd.config.is_file():
        if rd.checkpoint.exists():
            raise UserError(f"{path} has a checkpoint but no config.yaml: it cannot be resumed")
        raise UserError(
            f"no checkpoint in {path}: nothing to resume (not a fedpcd run directory: no config.yaml)"
        )
    config = load_config(rd.config, [f"output_dir={path}"])
    if rd.summary.exists():
        if not rd.checkpoint.exists():
            return rd.read_summary()
        ckpt = rd.load_checkpoint()
        check_checkpoint(ckpt, rd, config, allow_changes)
        if ckpt["round"] >= config.rounds:
            return rd.read_summary()
    if not rd.checkpoint.exists():
        warn(f"{path} has no checkpoint (stopped before its first one): restarting it from round 0")
    return run_local(config, resume=True, progress=progress, allow_changes=allow_changes)

"""The round loop of every backend: sample, send, screen the replies, aggregate, evaluate, record, checkpoint.

:func:`run_rounds` is the only round loop. Clients are reached through an executor
(:class:`fedpcd.engine.executor.Executor`): the local backend's ``LocalExecutor`` (in this process) or the
Flower backend's ``GridExecutor`` (ClientApps through Flower's Grid). Everything else is the same code for
both: the divergence guard and client-failure handling (engine/guard.py), the records (engine/records.py),
checkpoints and their resume (engine/checkpoint.py), the run directory (engine/rundir.py).

A checkpoint holds the server state, every client's state (``Executor.states``), the metrics so far and the
global RNG states; resuming from it (``checkpoint`` argument, read by :func:`open_checkpoint` before any data
is loaded) gives the same metrics.jsonl as an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

from fedpcd.algorithms import Algorithm, build_algorithm
from fedpcd.algorithms.context import MODEL
from fedpcd.config import Config
from fedpcd.data.stats import partition_json
from fedpcd.engine.checkpoint import (
    check_checkpoint,
    check_server_state,
    checkpoint_records,
    checkpoint_state,
    file_sha256,
    restore_rng,
)
from fedpcd.engine.executor import Executor, StatesUnavailable
from fedpcd.engine.federation import (
    Federation,
    build_federation,
    global_evaluation,
    resolve_device,
    sample_clients,
    set_threads,
)
from fedpcd.engine.guard import InvalidReply, check_server, reply_problem, screen_replies, warn
from fedpcd.engine.metrics import accuracy, balanced_accuracy, predict
from fedpcd.engine.privacy import (
    add_noise,
    check_privacy,
    clip_update,
    dp_epsilon,
    noise_uploads,
    reported_samples,
    stat_bounds,
)
from fedpcd.engine.records import round_record, summary_of
from fedpcd.engine.robust import check_robust, robust_aggregate
from fedpcd.engine.rundir import RunDir
from fedpcd.engine.server_opt import check_server_optimizer, server_step
from fedpcd.errors import UserError
from fedpcd.labels import PRESET, preset_record, run_log_line
from fedpcd.logs import LOGGER, RUN_LOG_ONLY, run_log
from fedpcd.run_format import (
    CODE,
    GA_BALANCED,
    PERSONAL,
    STATISTICS,
    code_version,
    headline,
    headline_text,
)
from fedpcd.trackers import check_trackers, open_trackers

RecordHook = Callable[[dict[str, Any]], None]


def is_eval_round(rnd: int, config: Config) -> bool:
    return rnd % config.eval_every == 0 or rnd == config.rounds


def is_full_eval_round(rnd: int, config: Config) -> bool:
    """An evaluated round whose personal models are evaluated on the full test set (PA-L, PA-V, PA-G): with
    ``personal_test: full``, every ``personal_full_every`` evaluated rounds and the last; never with
    ``split``."""
    if config.personal_test != "full":
        return False
    return rnd % (config.eval_every * config.personal_full_every) == 0 or rnd == config.rounds


def extra_global_accuracies(
    algorithm: Algorithm, fed: Federation, server: dict[str, Any]
) -> dict[str, float]:
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
    algorithm: Algorithm,
    config: Config,
    rnd: int,
    server: dict[str, Any],
    replies: list[dict[str, Any]],
    ids: list[int],
) -> dict[str, Any]:
    """``algorithm.aggregate`` with the round named in any failure, then the server-state divergence check."""
    try:
        if config.aggregation.robust == "none":
            server = algorithm.aggregate(server, replies)
        else:
            server = robust_aggregate(config, server, replies, algorithm)
    except UserError:
        raise
    except Exception as exc:
        raise RuntimeError(
            f"round {rnd}: algorithm {config.algorithm.name!r} failed to aggregate the updates of client(s) "
            f"{', '.join(map(str, ids))}: {type(exc).__name__}: {exc}"
        ) from exc
    check_server(config, rnd, server, ids)
    return server


def open_checkpoint(
    config: Config, run_dir: RunDir, resume: bool, allow_changes: Sequence[str] = ()
) -> dict[str, Any] | None:
    """The checkpoint a resume continues from, checked against ``config`` (None: start from round 0).

    Reads no data, so a wrong resume fails before the dataset is loaded or Flower is started."""
    if not (resume and run_dir.checkpoint.exists()):
        return None
    ckpt = run_dir.load_checkpoint(resolve_device(config.engine.device))
    check_checkpoint(ckpt, run_dir, config, allow_changes)
    if checkpoint_rounds(ckpt) not in (None, config.rounds):
        use = build_algorithm(config.algorithm.name, config.algorithm.params()).total_rounds_use()
        if use is not None:
            raise UserError(
                f"{run_dir.path}: algorithm {config.algorithm.name!r} cannot go on with rounds "
                f"{checkpoint_rounds(ckpt)} -> {config.rounds}: {use}, so the longer run would not equal one "
                "made with that many rounds from the start; start a new run"
            )
    if ckpt["round"] < config.rounds:
        run_dir.discard_summary()  # of a finished run whose rounds were raised: it goes on
    return ckpt


def checkpoint_rounds(checkpoint: dict[str, Any]) -> int | None:
    """The ``rounds`` of the config a checkpoint was written with (None: a checkpoint without its config)."""
    text = checkpoint.get("config")
    return json.loads(text).get("rounds") if isinstance(text, str) else None


def extended_records(records: list[dict[str, Any]], checkpoint: dict[str, Any], config: Config) -> list[dict]:
    """The records of a run extended past its old last round R to ``config.rounds``, as a run of that many
    rounds from the start has them: R was evaluated because it was the last (``is_eval_round``), and with
    the full personal test where the longer run tests only the split (``is_full_eval_round``). So R's record
    is dropped where the longer run does not evaluate R, and keeps its split metrics only (PA-L, PA-V and
    PA-G None, as ``split_metrics`` gives) where it tests the split only; else the records are unchanged."""
    old = checkpoint_rounds(checkpoint)
    rnd = checkpoint["round"]
    if old is None or rnd != old or old >= config.rounds or not records or records[-1]["round"] != rnd:
        return records
    if not is_eval_round(rnd, config):
        return records[:-1]
    was_full = is_full_eval_round(rnd, config.model_copy(update={"rounds": old}))
    if was_full and not is_full_eval_round(rnd, config):
        last = dict(records[-1])
        for metric in PERSONAL[1:]:  # all but PA-split
            for suffix in STATISTICS.values():
                last[metric.key + suffix] = None
        return [*records[:-1], last]
    return records


@contextmanager
def open_run(
    config: Config,
    *,
    resume: bool,
    allow_changes: Sequence[str] = (),
    federation: Federation | None = None,
    checkpoint: dict[str, Any] | None = None,
) -> Iterator[tuple[RunDir, dict[str, Any] | None, Federation]]:
    """The set-up of a run on every backend, each check before the data is loaded: torch threads; a new
    run's ``output_dir`` checked (:meth:`RunDir.check_new`); the trackers' packages; then, with the run
    directory locked, the checkpoint a resume continues from (``checkpoint``: already read and checked by
    the caller), then, logging to its run.log (:func:`fedpcd.logs.run_log`) for the rest of the block, the
    federation (``federation``: already built by the caller). Yields (run directory, checkpoint or None,
    federation)."""
    set_threads(config)
    run_dir = RunDir(config.output_dir)
    if not resume:
        run_dir.check_new(config)
    check_trackers(config)
    check_privacy(config)
    check_robust(config)
    check_server_optimizer(config)
    # both re-entrant: a Flower simulation's ServerApp thread takes them again; a refused resume (a changed
    # config, a damaged checkpoint) leaves the folder as it was, its run.log included
    with run_dir.lock():
        if checkpoint is None:
            checkpoint = open_checkpoint(config, run_dir, resume, allow_changes)
        with run_log(run_dir.path):
            fed = federation if federation is not None else build_federation(config)
            yield run_dir, checkpoint, fed


def play_round(
    config: Config,
    fed: Federation,
    algorithm: Algorithm,
    executor: Executor,
    server: dict[str, Any],
    rnd: int,
) -> tuple[dict[str, Any], dict[str, Any] | None, float]:
    """One round: sample, train through ``executor``, screen the replies, clip (``privacy.clipping:
    server``), noise each reply's class statistics, aggregate (robustly with ``aggregation.robust``), add the
    DP noise, take the server optimiser's step, evaluate on evaluated rounds. Returns the new server state,
    the round's record (None when not evaluated) and its wall time."""
    t0 = time.perf_counter()
    ids = sample_clients(config.clients, config.participation, config.seed, rnd)
    evaluate = is_eval_round(rnd, config)
    results = executor.train(algorithm, server, ids, rnd, evaluate, is_full_eval_round(rnd, config))
    for r in results:  # a reply the server cannot aggregate fails its client, it never stops the run
        n = reported_samples(config, fed.clients[r.client].num_samples)
        problem = None if r.error else reply_problem(r.update, algorithm.payload_for(server, r.client), n)
        if problem is not None:
            r.update, r.error = {}, InvalidReply(problem)
    screened = screen_replies(
        config,
        rnd,
        [r.client for r in results],
        [r.update if r.error is None else None for r in results],
        [r.error for r in results],
    )
    kept = [results[i] for i in screened.kept]
    privacy = config.privacy
    uploads = algorithm.upload_bounds()
    if privacy.clip is not None:
        bounds = stat_bounds(config, algorithm.ctx.num_classes)
        for r in kept:
            if privacy.clipping == "server":
                payload = algorithm.payload_for(server, r.client)
                name = config.algorithm.name
                r.update, r.clipped = clip_update(r.update, payload, privacy.clip, name, bounds)
            r.update = noise_uploads(r.update, uploads, config, rnd, r.client, bounds.num_classes)
    kept_ids = [r.client for r in kept]
    before = server.get(MODEL)
    server = aggregate_round(algorithm, config, rnd, server, [r.update for r in kept], kept_ids)
    joined = [u.key for u in uploads if u.kind == "model" and u.key in server]
    server = add_noise(server, config, rnd, len(kept), joined, type(algorithm).averages_model)
    if before is not None:
        server = server_step(config, before, server)
    if not evaluate:
        return server, None, time.perf_counter() - t0
    ga, ga_classes = global_evaluation(algorithm, fed.model_for(0), fed, server)
    extra = extra_global_accuracies(algorithm, fed, server)
    wall = time.perf_counter() - t0
    up, down = sum(r.bytes_up for r in results), sum(r.bytes_down for r in results)
    record = round_record(rnd, ga, kept, kept_ids, up, down, wall, extra, ga_classes)
    record[GA_BALANCED.key] = None if ga_classes is None else balanced_accuracy(ga_classes)
    if len(kept) < len(results):
        record["left_out"] = sorted({*screened.failed, *screened.diverged})
    if privacy.clip is not None:
        record["dp_clipped"] = sum(r.clipped for r in kept)
        record["dp_epsilon"] = dp_epsilon(config, rnd)
    return server, record, wall


def run_rounds(
    config: Config,
    run_dir: RunDir,
    fed: Federation,
    executor: Executor,
    checkpoint: dict[str, Any] | None = None,
    *,
    restart: bool = False,
    progress: bool = True,
    desc: str | None = None,
    on_record: RecordHook | None = None,
) -> dict[str, Any]:
    """Run rounds ``checkpoint["round"] + 1 .. config.rounds`` (all of them without a checkpoint) in the
    locked ``run_dir``; write metrics.jsonl, checkpoints and summary.json; return the summary. A round that
    raises (a divergence, a failed aggregation) leaves stopped.json naming it and the error.

    ``restart``: a resumed run that had no checkpoint yet starts again from round 0 (its config.yaml kept).
    Every record goes to the run's trackers (``tracking.loggers``, :mod:`fedpcd.trackers`), then to
    ``on_record``."""
    algorithm = fed.new_algorithm()
    if checkpoint is not None:
        # the server's model must fit the run's (other server state may change shape over rounds, e.g. FedSC's
        # prototype bank); the global RNG the reference draws from is restored below
        reference = algorithm.init_server(fed.model_for(0, fresh=True)).get(MODEL, {})
        check_server_state(checkpoint["server"], {MODEL: reference}, run_dir.checkpoint)
        server, start = checkpoint["server"], checkpoint["round"]
        wall = float(checkpoint.get("wall_s", 0.0))
        executor.restore(checkpoint["client_states"])
        records = checkpoint_records(checkpoint, run_dir.checkpoint)
        if records is None:  # a checkpoint written before checkpoints held the metrics
            records = run_dir.truncate(start)
        # metrics.jsonl as it was at the checkpoint (drops rounds after it and any torn line), its last round
        # as a run of config.rounds records it
        records = extended_records(records, checkpoint, config)
        run_dir.rewrite(records)
        for k in range(config.clients):  # build every architecture's model (seeds the global RNG) ...
            fed.model_for(k)
        restore_rng(checkpoint.get("rng"))  # ... before the global RNG states are put back
        # on stderr with the progress bar, and always in run.log
        level = logging.INFO if progress else logging.DEBUG
        LOGGER.log(level, "resuming %s from round %d of %d", run_dir.path, start, config.rounds)
    else:
        train_y, test_y = fed.dataset.train_y.numpy(), fed.dataset.test_y.numpy()
        run_dir.create(config, partition_json(fed.partition, train_y, test_y), restart=restart)
        server = algorithm.init_server(fed.model_for(0, fresh=True))  # client 0's architecture
        executor.restore({})  # disk: the files of an attempt killed before its first checkpoint
        start, wall, records = 0, 0.0, []
        LOGGER.debug(
            "starting %s: %s on %s, %d clients, %d rounds (backend %s)",
            run_dir.path,
            config.algorithm.name,
            config.dataset.name,
            config.clients,
            config.rounds,
            config.backend,
        )
        said = run_log_line(config.to_dict())
        if said is not None:  # on stderr when the config was read: here for run.log
            LOGGER.warning(said, extra={RUN_LOG_ONLY: True})

    rounds = range(start + 1, config.rounds + 1)
    desc = desc or config.algorithm.name
    with (
        open_trackers(config, run_dir.path, resume=checkpoint is not None or restart) as trackers,
        tqdm(
            rounds,
            initial=start,
            total=config.rounds,
            disable=not progress,
            desc=desc,
            unit="round",
            leave=False,
        ) as bar,
    ):
        run_dir.discard_stopped()
        for rnd in bar:
            try:
                server, record, round_wall = play_round(config, fed, algorithm, executor, server, rnd)
            except Exception as exc:
                run_dir.write_stopped(rnd, exc)
                raise
            wall += round_wall
            if record is not None:
                run_dir.append(record)
                records.append(record)
                LOGGER.debug("round %d: %s, %.2f s", rnd, headline_text(record), round_wall)
                bar.set_postfix(headline(record))
                trackers.log(record)
                if on_record is not None:
                    on_record(record)
            every = config.engine.checkpoint_every
            if every and (rnd % every == 0 or rnd == config.rounds):
                try:
                    states = executor.states()
                except StatesUnavailable as exc:
                    warn(f"round {rnd}: no checkpoint ({exc}); a resume starts from the previous one")
                    continue
                digest = file_sha256(run_dir.partition, "partition file")
                run_dir.save_checkpoint(checkpoint_state(rnd, server, states, wall, records, config, digest))
                LOGGER.debug("round %d: checkpoint saved", rnd)
        summary = {**summary_of(records, wall, config.rounds), CODE: code_version()}
        preset = preset_record(config.to_dict())
        if preset is not None:  # the preset, its keys and those the config overrode (fedpcd.labels)
            summary[PRESET] = preset
        run_dir.write_summary(summary)
        trackers.close(summary)
    LOGGER.debug("summary written: final %s, %.1f s of rounds", headline_text(summary["final"]), wall)
    return summary

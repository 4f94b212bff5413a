"""The round loop of every backend: sample, send, screen the replies, aggregate, evaluate, record, checkpoint.

:func:`run_rounds` is the only round loop. Clients are reached through an executor
(:class:`fedpcd.engine.executor.Executor`): the local backend's ``LocalExecutor`` (in this process) or the
Flower backend's ``GridExecutor`` (ClientApps through Flower's Grid). Everything else is the same code for
both: the divergence guard and client-failure handling (engine/guard.py), the records (engine/records.py),
checkpoints and their resume (engine/checkpoint.py), the run directory (engine/rundir.py).

A checkpoint holds the server state, every client's state (``Executor.states``), the metrics so far and the
global RNG states; resuming from it (the run's checkpoint, read by :meth:`fedpcd.engine.run.Run.resume` before
any data is loaded) gives the same metrics.jsonl as an uninterrupted run. The loop imports no backend and no
tracker: whoever starts the run passes its observers in (:class:`RoundObserver`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Protocol

import torch

from fedpcd import seeds
from fedpcd.algorithms import Algorithm
from fedpcd.algorithms.context import MODEL
from fedpcd.config import Config
from fedpcd.data.stats import partition_json
from fedpcd.engine.checkpoint import (
    check_server_state,
    checkpoint_records,
    checkpoint_rounds,
    checkpoint_state,
    restore_rng,
)
from fedpcd.engine.executor import Executor, StatesUnavailable
from fedpcd.engine.federation import Federation, class_mean_angles, global_evaluation, sample_clients
from fedpcd.engine.guard import check_server
from fedpcd.engine.metrics import balanced_accuracy
from fedpcd.engine.privacy import add_noise, dp_epsilon
from fedpcd.engine.records import round_record, summary_of
from fedpcd.engine.robust import robust_aggregate
from fedpcd.engine.run import Run
from fedpcd.engine.server_opt import server_step
from fedpcd.engine.tasks import payloads_for
from fedpcd.engine.update_policy import admit_replies
from fedpcd.errors import UserError
from fedpcd.labels import PRESET, preset_record, run_log_line
from fedpcd.logs import LOGGER, RUN_LOG_ONLY
from fedpcd.run_format import CODE, GA_BALANCED, PERSONAL, STATISTICS, code_version, headline_text

RecordHook = Callable[[dict[str, Any]], None]


class RoundObserver(Protocol):
    """What watches a run's rounds (a progress bar, trackers, a caller's per-round callback), passed to
    :func:`run_rounds` by the layer that starts the run."""

    def start(self, run: Run, first: int) -> None:
        """The rounds are about to run, from round ``first`` + 1 (0: a fresh run); the run's folder holds
        metrics.jsonl as of that round."""
        ...

    def round(self, rnd: int, record: dict[str, Any] | None) -> None:
        """Round ``rnd`` is done: its record as written to metrics.jsonl (None: not evaluated). An exception
        stops the run there, before that round's checkpoint."""
        ...

    def stop(self, summary: dict[str, Any] | None) -> None:
        """The run is over: its summary (written to summary.json), or None when it stopped on an error."""
        ...


def is_eval_round(rnd: int, config: Config) -> bool:
    return rnd % config.eval_every == 0 or rnd == config.rounds


def is_full_eval_round(rnd: int, config: Config) -> bool:
    """An evaluated round whose personal models are evaluated on the full test set (PA-L, PA-V, PA-G): with
    ``personal_test: full``, every ``personal_full_every`` evaluated rounds and the last; never with
    ``split``."""
    if config.personal_test != "full":
        return False
    return rnd % (config.eval_every * config.personal_full_every) == 0 or rnd == config.rounds


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


def play_round(
    config: Config,
    fed: Federation,
    algorithm: Algorithm,
    executor: Executor,
    server: dict[str, Any],
    rnd: int,
) -> tuple[dict[str, Any], dict[str, Any] | None, float]:
    """One round: sample, send each participant its payload (computed once), train through ``executor``,
    admit the replies (:func:`fedpcd.engine.update_policy.admit_replies`: screened, clipped, noised),
    aggregate (robustly with ``aggregation.robust``), add the DP noise, take the server optimiser's step,
    evaluate on evaluated rounds. Returns the new server state, the round's record (None when not evaluated)
    and its wall time."""
    t0 = time.perf_counter()
    evaluate, full = is_eval_round(rnd, config), is_full_eval_round(rnd, config)
    ids = sample_clients(config.clients, config.clients_per_round, config.seed, rnd)
    payloads = payloads_for(algorithm, server, ids)
    results = executor.train(algorithm, payloads, rnd, evaluate, full)
    sizes = [client.num_samples for client in fed.clients]
    kept, screened = admit_replies(config, algorithm, sizes, payloads, results, rnd)
    uploads = algorithm.upload_bounds()
    kept_ids = [r.client for r in kept]
    before = server.get(MODEL)
    server = aggregate_round(algorithm, config, rnd, server, [r.update for r in kept], kept_ids)
    joined = [u.key for u in uploads if u.kind == "model" and u.key in server]
    spent = dp_epsilon(config, rnd, len(ids), algorithm) if evaluate else None  # after this round's release
    server = add_noise(server, config, rnd, len(kept), joined, type(algorithm).averages_model)
    if before is not None:
        server = server_step(config, before, server)
    if not evaluate:
        return server, None, time.perf_counter() - t0
    ga, ga_classes, extra = global_evaluation(algorithm, fed.model_for(0), fed, server)
    angles = {}
    if config.geometry and rnd == config.rounds:  # the class-mean angles (fedpcd.engine.metrics)
        personal = [(r.client, r.metrics) for r in kept]
        angles = class_mean_angles(algorithm, fed.model_for(0), fed, server, personal)
    wall = time.perf_counter() - t0
    up, down = sum(r.bytes_up for r in results), sum(r.bytes_down for r in results)
    record = round_record(rnd, ga, kept, kept_ids, up, down, wall, extra, ga_classes)
    record[GA_BALANCED.key] = None if ga_classes is None else balanced_accuracy(ga_classes)
    record.update(angles)
    if len(kept) < len(results):
        record["left_out"] = sorted({*screened.failed, *screened.diverged})
    if config.privacy.clip is not None:
        record["dp_clipped"] = sum(r.clipped for r in kept)
        record["dp_epsilon"] = spent
    return server, record, wall


def _start(run: Run, fed: Federation, algorithm: Algorithm, executor: Executor, progress: bool) -> tuple:
    """The state the rounds start from: (server state, last round done, wall time so far, records). A
    resumed run's comes from its checkpoint (metrics.jsonl rewritten as it was then, the clients' states and
    the global RNG states put back); a fresh run's folder gets its files first."""
    config, folder, checkpoint = run.config, run.folder, run.checkpoint
    if checkpoint is None:
        train_y, test_y = fed.dataset.train_y.numpy(), fed.dataset.test_y.numpy()
        folder.create(config, partition_json(fed.partition, train_y, test_y), restart=run.restart)
        server = algorithm.init_server(fed.model_for(0, fresh=True))  # client 0's architecture
        torch.manual_seed(seeds.global_generator(config.seed))
        executor.restore({})  # disk: the files of an attempt killed before its first checkpoint
        LOGGER.debug(
            "starting %s: %s on %s, %d clients, %d rounds (backend %s)",
            folder.path,
            config.algorithm.name,
            config.dataset.name,
            config.clients,
            config.rounds,
            config.backend,
        )
        said = run_log_line(config.to_dict())
        if said is not None:  # on stderr when the config was read: here for run.log
            LOGGER.warning(said, extra={RUN_LOG_ONLY: True})
        return server, 0, 0.0, []
    # the server's model must fit the run's (other server state may change shape over rounds, e.g. FedSC's
    # prototype bank)
    reference = algorithm.init_server(fed.model_for(0, fresh=True)).get(MODEL, {})
    check_server_state(checkpoint["server"], {MODEL: reference}, folder.checkpoint)
    server, start = checkpoint["server"], checkpoint["round"]
    wall = float(checkpoint.get("wall_s", 0.0))
    executor.restore(checkpoint["client_states"])
    records = checkpoint_records(checkpoint, folder.checkpoint)
    if records is None:  # a checkpoint written before checkpoints held the metrics
        records = folder.truncate(start)
    # metrics.jsonl as it was at the checkpoint (drops rounds after it and any torn line), its last round as
    # a run of config.rounds records it
    records = extended_records(records, checkpoint, config)
    folder.rewrite(records)
    restore_rng(checkpoint.get("rng"))
    # on stderr with the progress bar, and always in run.log
    level = logging.INFO if progress else logging.DEBUG
    LOGGER.log(level, "resuming %s from round %d of %d", folder.path, start, config.rounds)
    return server, start, wall, records


def run_rounds(
    run: Run,
    fed: Federation,
    executor: Executor,
    observers: Sequence[RoundObserver] = (),
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Run rounds ``checkpoint["round"] + 1 .. config.rounds`` of the open ``run`` (all of them without a
    checkpoint); write metrics.jsonl, checkpoints and summary.json; return the summary. A round that raises
    (a divergence, a failed aggregation) leaves stopped.json naming it and the error.

    Each round goes to the ``observers``, in their order (:class:`RoundObserver`); ``progress``: the
    resuming line on stderr rather than in run.log only."""
    config, folder = run.config, run.folder
    algorithm = fed.new_algorithm()
    server, start, wall, records = _start(run, fed, algorithm, executor, progress)
    outcome: dict[str, Any] = {}
    with ExitStack() as stack:
        for observer in observers:
            observer.start(run, start)
            stack.callback(lambda o=observer: o.stop(outcome.get("summary")))
        folder.discard_stopped()
        for rnd in range(start + 1, config.rounds + 1):
            try:
                server, record, round_wall = play_round(config, fed, algorithm, executor, server, rnd)
            except Exception as exc:
                folder.write_stopped(rnd, exc)
                raise
            wall += round_wall
            if record is not None:
                folder.append(record)
                records.append(record)
                LOGGER.debug("round %d: %s, %.2f s", rnd, headline_text(record), round_wall)
            for observer in observers:
                observer.round(rnd, record)
            every = config.engine.checkpoint_every
            if every and (rnd % every == 0 or rnd == config.rounds):
                _save_checkpoint(run, executor, rnd, server, wall, records)
        summary = {**summary_of(records, wall, config.rounds), CODE: code_version()}
        preset = preset_record(config.to_dict())
        if preset is not None:  # the preset, its keys and those the config overrode (fedpcd.labels)
            summary[PRESET] = preset
        folder.write_summary(summary)
        outcome["summary"] = summary
    LOGGER.debug("summary written: final %s, %.1f s of rounds", headline_text(summary["final"]), wall)
    return summary


def _save_checkpoint(
    run: Run, executor: Executor, rnd: int, server: dict[str, Any], wall: float, records: list[dict]
) -> None:
    """The checkpoint after round ``rnd``; skipped with a warning when the clients' states cannot all be had
    (a resume then starts from the previous one)."""
    try:
        states = executor.states()
    except StatesUnavailable as exc:
        LOGGER.warning("round %d: no checkpoint (%s); a resume starts from the previous one", rnd, exc)
        return
    state = checkpoint_state(rnd, server, states, wall, records, run.config, run.folder.partition)
    run.folder.save_checkpoint(state)
    LOGGER.debug("round %d: checkpoint saved", rnd)

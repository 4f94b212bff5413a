"""The local backend (the round loop of engine/rounds.py with the in-process ``LocalExecutor``: one model
object per architecture reused for every client, a client without state reset to the architecture's seeded
initial weights) and ``resume_run`` for runs of either backend.

Reliability (engine/guard.py, engine/rundir.py, engine/checkpoint.py): a client that raises is left out
of its round with a warning; a non-finite reply stops the run (or, with ``engine.on_divergence: drop``, is
left out); the run holds a lock on its directory, checkpoints every ``engine.checkpoint_every`` rounds (server
and client states, the metrics so far, the global RNG states) and ``resume_run`` continues from the last
checkpoint to the same metrics.jsonl as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpcd.config import Config
from fedpcd.config_identity import dump_config
from fedpcd.engine.checkpoint import check_allowed_changes, check_checkpoint
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.guard import warn
from fedpcd.engine.pool import worker_count
from fedpcd.engine.rounds import RecordHook, open_run, run_rounds
from fedpcd.engine.rundir import RunDir
from fedpcd.errors import UserError
from fedpcd.logs import LOGGER
from fedpcd.resolve import load_run_config


def check_record_hook(config: Config, on_record: RecordHook | None) -> None:
    """Refuse a record hook for a run on the Flower backend, whose rounds run inside Flower's ServerApp."""
    if on_record is not None and config.backend == "flower":
        raise UserError(
            "a per-round callback needs backend=local (a Flower run's rounds run inside Flower's ServerApp); "
            "read the run's metrics.jsonl instead"
        )


def run_local(
    config: Config,
    resume: bool = False,
    progress: bool = True,
    allow_changes: Sequence[str] = (),
    on_record: RecordHook | None = None,
) -> dict[str, Any]:
    """Run (or resume) an experiment in-process; writes the run directory and returns the summary.

    The run directory is locked for the run (a second process on it gets a UserError naming this one). A
    resume refuses a checkpoint written with another config, but for the ``allow_changes`` keys
    (``checkpoint.RESUME_CHANGES``). ``on_record``: called with each evaluated round's record
    (``run_rounds``)."""
    with open_run(config, resume=resume, allow_changes=allow_changes) as (run_dir, checkpoint, fed):
        adaptive = config.engine.workers == "auto"
        executor = LocalExecutor(fed, worker_count(fed), adaptive=adaptive)
        try:
            return run_rounds(
                config,
                run_dir,
                fed,
                executor,
                checkpoint,
                restart=resume,
                progress=progress,
                on_record=on_record,
            )
        finally:
            executor.close()


def resume_run(
    run_dir: str | Path,
    progress: bool = True,
    allow_changes: Sequence[str] = (),
    on_record: RecordHook | None = None,
    changes: Sequence[str] = (),
) -> dict[str, Any]:
    """Continue an interrupted run from its last checkpoint, with its own resolved config.

    A run killed before its first checkpoint restarts from round 0 (its config.yaml is kept); a finished
    run (summary.json) is not run again: its summary is returned (logging "already finished"), unless
    ``rounds`` was raised (allowed in ``allow_changes``): then it goes on. A config.yaml changed since the
    checkpoint is refused with a one-line diff, but for the ``allow_changes`` keys (only
    ``checkpoint.RESUME_CHANGES`` may be given). ``changes``: ``KEY=VALUE`` items of those keys (each one
    allowed by being given) written into config.yaml first, e.g. ``rounds=30``, which extends a run: N must
    exceed the rounds done, and the extended run equals one made with N rounds from the start
    (:func:`fedpcd.engine.rounds.extended_records`; an algorithm whose rounds depend on the total is
    refused). ``on_record``: called with each evaluated round's record (local backend only)."""
    keys = [item.partition("=")[0] for item in changes]
    allow_changes = [*allow_changes, *keys]
    check_allowed_changes(allow_changes)
    path = Path(run_dir)
    rd = RunDir(path)
    rd.check_links()
    if not rd.config.is_file():
        if rd.checkpoint.exists():
            raise UserError(f"{path} has a checkpoint but no config.yaml: it cannot be resumed")
        if rd.lock_file.exists() and not rd.holds_run():  # killed while it started: nothing to resume yet
            raise UserError(
                f"{path} was stopped before its run started (no config.yaml yet): start it again with the "
                "same fedpcd run command (same config and output_dir)"
            )
        raise UserError(
            f"no checkpoint in {path}: nothing to resume (not a fedpcd run directory: no config.yaml)"
        )
    config = load_run_config(rd.config, [f"output_dir={path}", *changes])
    check_record_hook(config, on_record)
    if changes:
        _write_changes(rd, config, keys, changes)
    if rd.summary.exists():
        if not rd.checkpoint.exists():
            return _finished(rd)
        ckpt = rd.load_checkpoint()
        check_checkpoint(ckpt, rd, config, allow_changes)
        if ckpt["round"] >= config.rounds:
            return _finished(rd)
    if not rd.checkpoint.exists():
        warn(f"{path} has no checkpoint (stopped before its first one): restarting it from round 0")
    if config.backend == "flower":  # continues on Flower: the same loop, the clients' states sent back
        from fedpcd.flower import run_flower

        return run_flower(config, progress=progress, resume=True, allow_changes=allow_changes)
    return run_local(config, resume=True, progress=progress, allow_changes=allow_changes, on_record=on_record)


def _finished(rd: RunDir) -> dict[str, Any]:
    """A finished run's summary, saying so."""
    summary = rd.read_summary()
    LOGGER.info(
        "%s: already finished (%s rounds); nothing to run (extend it with: fedpcd run --resume %s rounds=N)",
        rd.path,
        summary.get("rounds", "?"),
        rd.path,
    )
    return summary


def _write_changes(rd: RunDir, config: Config, keys: Sequence[str], changes: Sequence[str]) -> None:
    """Write a resume's ``KEY=VALUE`` changes into the run's config.yaml (its ``output_dir`` as written),
    after checking them: ``rounds`` above the rounds done (the checkpoint's round, else summary.json's)."""
    done = rd.load_checkpoint()["round"] if rd.checkpoint.exists() else None
    if done is None and rd.summary.exists():
        done = rd.read_summary().get("rounds")
    if "rounds" in keys and done is not None and config.rounds <= done:
        raise UserError(
            f"rounds={config.rounds} does not extend {rd.path}: it has run {done} rounds; give more than "
            f"{done}"
        )
    dump_config(load_run_config(rd.config, list(changes)), rd.config)

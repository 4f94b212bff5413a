"""The backend is chosen here, above the engine and Flower: a run of ``backend: local`` goes to the engine's
round loop in this process (:func:`fedpcd.engine.run_local`), one of ``backend: flower`` through Flower's
simulation engine (:func:`fedpcd.flower.run_flower`). Runs are opened with :class:`fedpcd.engine.Run` and
their rounds watched by :func:`fedpcd.observers.round_observers`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpcd.config import Config
from fedpcd.engine import Run, run_local
from fedpcd.engine.rounds import RecordHook
from fedpcd.errors import UserError
from fedpcd.observers import round_observers

__all__ = ["check_round_callback", "resume_run", "run_experiment"]


def check_round_callback(config: Config, on_record: RecordHook | None) -> None:
    """Refuse a per-round callback for a run on the Flower backend, whose rounds run inside Flower's
    ServerApp."""
    if on_record is not None and config.backend == "flower":
        raise UserError(
            "a per-round callback needs backend=local (a Flower run's rounds run inside Flower's ServerApp); "
            "read the run's metrics.jsonl instead"
        )


def run_experiment(
    config: Config, progress: bool = True, on_record: RecordHook | None = None
) -> dict[str, Any]:
    """Run a resolved config on its backend; returns the summary (also written to summary.json).

    ``on_record`` (local backend only) is called with each evaluated round's record, as written to
    metrics.jsonl, right after the trackers got it; an exception it raises stops the run there, before that
    round's checkpoint (the run resumes from the one before)."""
    check_round_callback(config, on_record)
    return _run(Run.create(config), progress, on_record)


def resume_run(
    target: str | Path | Config,
    progress: bool = True,
    allow_changes: Sequence[str] = (),
    on_record: RecordHook | None = None,
    changes: Sequence[str] = (),
) -> dict[str, Any]:
    """Continue an interrupted run from its last checkpoint, with its own resolved config, on its backend
    (:meth:`fedpcd.engine.Run.resume`: ``target`` a run directory, or a config whose ``output_dir`` holds
    its run or none yet).

    A run killed before its first checkpoint restarts from round 0 (its config.yaml is kept); a finished
    run (summary.json) is not run again: its summary is returned (logging "already finished"), unless
    ``rounds`` was raised: then it goes on. ``allow_changes``/``changes``: as :meth:`Run.resume`'s
    ``allow``/``changes`` (``changes=["rounds=30"]`` extends a run; the extended run equals one made with
    that many rounds from the start). ``on_record``: called with each evaluated round's record (local
    backend only)."""
    run = Run.resume(target, allow=allow_changes, changes=changes)
    check_round_callback(run.config, on_record)
    if run.finished:
        return run.summary()
    return _run(run, progress, on_record)


def _run(run: Run, progress: bool, on_record: RecordHook | None) -> dict[str, Any]:
    """``run`` on its config's backend, watched by its observers."""
    observers = round_observers(run.config, progress, on_record)
    if run.config.backend == "flower":
        from fedpcd.flower.simulation import run_flower

        return run_flower(run, observers, progress=progress)
    return run_local(run, observers, progress=progress)

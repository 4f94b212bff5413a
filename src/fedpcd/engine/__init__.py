"""The engine: federation setup, the round loop, evaluation and run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedpcd.algorithms import Algorithm
from fedpcd.config import Config
from fedpcd.engine.checkpoint import check_checkpoint
from fedpcd.engine.federation import Federation, build_federation, set_threads
from fedpcd.engine.rounds import RecordHook
from fedpcd.engine.rundir import RunDir
from fedpcd.engine.simulation import check_record_hook, resume_run, run_local
from fedpcd.errors import UserError
from fedpcd.resolve import load_config

__all__ = ["check_record_hook", "open_run", "resume_run", "run_experiment", "run_local"]


def run_experiment(
    config: Config, progress: bool = True, on_record: RecordHook | None = None
) -> dict[str, Any]:
    """Run a resolved config on its backend; returns the summary (also written to summary.json).

    ``on_record`` (local backend only) is called with each evaluated round's record, as written to
    metrics.jsonl, right after the trackers got it; an exception it raises stops the run there, before that
    round's checkpoint (the run resumes from the one before)."""
    check_record_hook(config, on_record)
    if config.backend == "flower":
        from fedpcd.flower import run_flower

        return run_flower(config, progress=progress)
    return run_local(config, progress=progress, on_record=on_record)


def open_run(run_dir: str | Path) -> tuple[Federation, Algorithm, dict[str, Any]]:
    """A finished run for analysis: its federation (data and partition rebuilt from its config.yaml), its
    algorithm and its last checkpoint (``server``, ``client_states``, ``round``), which must be one of that
    config (``checkpoint.check_checkpoint``)."""
    path = Path(run_dir)
    run = RunDir(path)
    if not run.checkpoint.exists():
        raise UserError(f"no checkpoint in {path}: this needs the run's final state (archived runs lack it)")
    config = load_config(run.config, [f"output_dir={path}"])
    set_threads(config)
    fed = build_federation(config)
    state = run.load_checkpoint(fed.device)
    check_checkpoint(state, run, config)
    return fed, fed.new_algorithm(), state

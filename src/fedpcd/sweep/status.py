"""Where one run of a sweep's grid stands (``run_status``) and its summary, read from its folder."""

from __future__ import annotations

from typing import Any

from fedpcd.config import Config
from fedpcd.errors import UserError
from fedpcd.run_format import RunFiles
from fedpcd.run_read import read_summary
from fedpcd.utils import path_error

SKIP_REASONS = {
    "stuck": "started but has no checkpoint; delete the folder to rerun it",
    "broken": "its summary.json is corrupt (not a fedpcd summary); delete the folder to rerun it",
}


def run_status(config: Config) -> str:
    """'done' (a readable summary.json), 'broken' (a summary.json that is not one: corrupt or cut short),
    'resume' (started: a checkpoint, or only its config.yaml when it was stopped before its first checkpoint,
    which ``resume_run`` restarts from round 0), 'new', or 'stuck' (run files but no config.yaml: it cannot be
    resumed)."""
    run = RunFiles(config.output_dir)
    try:
        if run.summary.exists():
            return "done" if read_run_summary(config) is not None else "broken"
        if run.checkpoint.exists() or run.config.is_file():
            return "resume"
        return "stuck" if run.metrics.exists() else "new"
    except OSError as exc:  # e.g. a folder on the way that cannot be searched
        raise path_error(run.path, exc, "read the run folder") from None


def read_run_summary(config: Config) -> dict[str, Any] | None:
    """The run's summary.json as a dict; None where it is missing or is not a fedpcd summary."""
    try:
        return read_summary(RunFiles(config.output_dir).summary)
    except UserError:
        return None

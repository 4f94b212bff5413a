"""Loading the finished runs below a folder for ``fedpcd report``: their config (brought to the current form),
records and summary, each file read with ``fedpcd.run_read``'s checks; runs counted twice refused; the runs
that stopped listed."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpcd.config_identity import run_setting
from fedpcd.errors import UserError, clip
from fedpcd.run_format import CODE, RunFiles
from fedpcd.run_read import read_metrics, read_summary
from fedpcd.utils import path_error, read_json, show_path


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as dotted keys -> values; a list or mapping as JSON text, a partition's ``then`` whole."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "then":
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
    return out


@dataclass
class Run:
    """A finished run as the report reads it: its folder, config (current form), records and summary."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def code(self) -> dict[str, Any] | None:
        """summary.json's record of the code that made it (``fedpcd.run_format.code_version``), or None."""
        return self.summary.get(CODE)

    @functools.cached_property
    def flat(self) -> dict[str, Any]:
        """Its config as dotted keys (:func:`flatten`), computed once: a report's grouping and pairing ask
        for it many times per run."""
        return flatten(self.config)

    @functools.cached_property
    def setting(self) -> dict[str, Any]:
        """Its setting as dotted keys: the config without what changes no number
        (``fedpcd.config_identity.run_setting``), flattened, computed once."""
        return flatten(run_setting(self.config))

    @functools.cached_property
    def setting_json(self) -> dict[str, str]:
        """Each item of :attr:`setting` as the JSON text ``"key": value`` (sorted keys), in key order,
        computed once: grouping and pairing compare the runs of a report by them, many times per run."""
        return {
            k: json.dumps({k: self.setting[k]}, sort_keys=True, default=str)[1:-1]
            for k in sorted(self.setting)
        }


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _readable_partition(part: Any) -> bool:
    if not isinstance(part, dict) or not isinstance(part.get("scheme"), str):
        return False
    if any(key in part and not _is_number(part[key]) for key in ("beta", "rho", "classes_per_client")):
        return False
    return part.get("then") is None or _readable_partition(part["then"])


def _readable_config(config: dict[str, Any]) -> bool:
    """Whether a config that no longer validates still has, well-typed, the keys the report reads."""
    algorithm = config.get("algorithm")
    if not isinstance(algorithm, dict) or not isinstance(algorithm.get("name"), str):
        return False
    whole = [config.get("seed"), config.get("clients")]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in whole):
        return False
    return _readable_partition(config.get("partition"))


def current_form(config: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """A run's config with the keys added since it was written filled with their defaults, so runs made
    by an older fedpcd group with new ones (as written if it no longer validates but still has the keys the
    report reads; otherwise a UserError naming ``path``)."""
    from fedpcd.resolve import config_from_dict

    try:
        return config_from_dict(config).to_dict()
    except UserError as exc:
        reason = str(exc)
    plain = json.loads(json.dumps(config, default=str))  # YAML dates and the like as text
    if not _readable_config(plain):
        raise UserError(f"config file {show_path(path)} is not a fedpcd run config: {clip(reason, 160)}")
    return plain


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError) as exc:
        raise path_error(path, exc, "read") from None


def load_runs(root: str | Path) -> list[Run]:
    """Every finished run (a folder with summary.json) below ``root``; a run file that is missing, unreadable
    or malformed is one line naming it."""
    from fedpcd.config_input import read_yaml  # aliases, deep nesting and huge numbers refused

    root = Path(root)
    if not _exists(root):
        raise UserError(f"runs folder not found: {show_path(root)}")
    runs = []
    for files in RunFiles.finished_below(root):
        config = current_form(read_yaml(files.config, links=False), files.config)
        records = read_metrics(files.metrics)
        runs.append(Run(files.path, config, records, read_summary(files.summary)))
    if not runs:
        raise UserError(f"no finished runs (folders with summary.json) below {show_path(root)}")
    return runs


def refuse_duplicates(runs: list[Run]) -> None:
    """A one-line UserError when two runs have the same config (seed included): one run counted twice,
    e.g. a copy filed under another grid point's name."""
    seen: dict[str, Path] = {}
    for run in runs:
        key = json.dumps(run_setting(run.config), sort_keys=True, default=str)
        if key in seen:
            raise UserError(
                f"runs {show_path(seen[key])} and {show_path(run.path)} have the same config (seed "
                "included): one run counted twice; remove the one whose folder name is not its config"
            )
        seen[key] = run.path


def unfinished_runs(root: str | Path) -> list[tuple[str, str]]:
    """Run folders below ``root`` (a config.yaml) without a summary.json, sorted: (path relative to ``root``,
    why it stopped from its stopped.json, e.g. ``stopped in round 13: DivergenceError``, or "")."""
    root = Path(root)
    return sorted(
        (files.path.relative_to(root).as_posix(), _stopped_note(files.stopped))
        for files in RunFiles.started_below(root)
        if not files.summary.exists()
    )


DIVERGED = "DivergenceError"  # the error a stopped.json names for a run stopped by divergence


@dataclass
class StoppedRun:
    """A run that a round's error stopped (stopped.json, no summary.json): its folder, config (current
    form) and stopped.json's record: ``round``, ``error`` (the exception's type), ``message`` and, from
    runs made since it was added, ``code`` (``fedpcd.run_format.code_version``)."""

    path: Path
    config: dict[str, Any]
    stopped: dict[str, Any]

    @property
    def code(self) -> dict[str, Any] | None:
        """stopped.json's record of the code that ran (None in runs stopped before it was recorded)."""
        return self.stopped.get(CODE)

    @property
    def diverged(self) -> bool:
        """Whether the engine stopped it by divergence."""
        return self.stopped.get("error") == DIVERGED


def read_stopped(files: RunFiles) -> StoppedRun | None:
    """The run of ``files`` if it is stopped and readable; None for a finished or still running run, or a
    folder that is not a fedpcd run (an unreadable config or stopped.json)."""
    from fedpcd.config_input import read_yaml

    if files.summary.exists() or not files.config.exists():
        return None
    try:
        stopped = read_json(files.stopped, "stopped file", links=False)
        config = current_form(read_yaml(files.config, links=False), files.config)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, UserError):
        return None
    if not isinstance(stopped, dict) or not isinstance(stopped.get("round"), int):
        return None
    return StoppedRun(files.path, config, stopped)


def stopped_runs(root: str | Path) -> list[StoppedRun]:
    """Every stopped run below ``root`` (:func:`read_stopped`), in the sorted order of their folders."""
    found = (read_stopped(files) for files in RunFiles.started_below(root))
    return sorted((run for run in found if run is not None), key=lambda run: run.path)


def _stopped_note(path: Path) -> str:
    try:
        stopped = read_json(path, "stopped file", links=False)
        return f"stopped in round {int(stopped['round'])}: {stopped['error']}"
    except (UserError, ValueError, TypeError, KeyError):  # absent or not fedpcd's
        return ""

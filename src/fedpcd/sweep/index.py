"""The sweep's results index, ``<output_dir>/index.sqlite``: one row per run of the grid (its config and
summary as JSON plus the headline numbers as columns), updated as runs end.

SQLite rather than Parquet: it is in Python's standard library (no pyarrow), transactional (a sweep killed
while writing never leaves a torn index), updated row by row as runs finish without rewriting the file, and
read by the sqlite3 shell, pandas.read_sql or any SQL client."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from fedpcd.config import Config
from fedpcd.config_input import merge_dicts, parse_overrides, read_yaml
from fedpcd.errors import UserError, clip
from fedpcd.run_format import GA, PA_SPLIT
from fedpcd.sweep.status import read_run_summary, run_status
from fedpcd.utils import make_folder, path_error, refuse_link, show_path

INDEX_FILE = "index.sqlite"  # in the sweep's output_dir, next to the runs' folders
SQLITE_SIDE_FILES = ("-journal", "-wal", "-shm")  # what SQLite writes beside a database
# the headline numbers as columns <when>_<name>, e.g. final_ga: name -> metric (names kept from before the
# metric table; users query them), when: the summary's "final" (last evaluated round) or "best"
INDEX_METRICS = {"ga": GA, "pa": PA_SPLIT}
INDEX_WHEN = ("final", "best")
INDEX_COLUMNS = {
    "output_dir": "TEXT PRIMARY KEY",
    "status": "TEXT",  # done | broken | resume | stuck | new (run_status)
    "algorithm": "TEXT",
    "dataset": "TEXT",
    "partition": "TEXT",  # the partition section as JSON
    "clients": "INTEGER",
    "participation": "REAL",
    "seed": "INTEGER",
    "rounds": "INTEGER",
    **{f"{when}_{name}": "REAL" for when in INDEX_WHEN for name in INDEX_METRICS},
    "wall_s": "REAL",
    "config": "TEXT",  # the resolved config as JSON
    "summary": "TEXT",  # summary.json as written (NULL until the run is done)
}


def index_path(path: str | Path, overrides: list[str] | None = None) -> Path:
    """``<output_dir>/index.sqlite`` of a sweep file."""
    raw = merge_dicts(read_yaml(path), parse_overrides(overrides or []))
    return Path(raw.get("output_dir", "runs/sweep")) / INDEX_FILE


def index_row(config: Config) -> dict[str, Any]:
    """One index row: the run's status, config and (once done) its summary's headline numbers."""
    status = run_status(config)
    summary = read_run_summary(config) if status == "done" else None
    parts = {when: (summary or {}).get(when) for when in INDEX_WHEN}
    parts = {when: part if isinstance(part, dict) else {} for when, part in parts.items()}
    return {
        "output_dir": config.output_dir,
        "status": status,
        "algorithm": config.algorithm.name,
        "dataset": config.dataset.name,
        "partition": json.dumps(config.to_dict()["partition"], sort_keys=True),
        "clients": config.clients,
        "participation": config.participation,
        "seed": config.seed,
        "rounds": config.rounds,
        **{
            f"{when}_{name}": parts[when].get(metric.key)
            for when in INDEX_WHEN
            for name, metric in INDEX_METRICS.items()
        },
        "wall_s": (summary or {}).get("wall_s"),
        "config": json.dumps(config.to_dict(), sort_keys=True),
        "summary": json.dumps(summary, sort_keys=True) if summary is not None else None,
    }


def write_index(path: Path, configs: list[Config]) -> None:
    """Insert or replace the rows of ``configs`` in the SQLite index at ``path`` (one transaction). A folder
    that cannot hold it, or a file there that is not such an index (corrupt, read-only), is one line naming
    it: the index only mirrors the run folders, so deleting it loses nothing."""
    from fedpcd.engine.rundir import create_regular_file

    make_folder(path.parent, target=path)
    for suffix in SQLITE_SIDE_FILES:  # SQLite opens these itself: none may be a link
        refuse_link(path.with_name(path.name + suffix))
    create_regular_file(path, "the sweep index ")  # never through a link (dangling or not), nor a FIFO
    rows = [index_row(c) for c in configs]
    columns = ", ".join(f"{name} {kind}" for name, kind in INDEX_COLUMNS.items())
    marks = ", ".join(f":{name}" for name in INDEX_COLUMNS)
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as db, db:
            db.execute(f"CREATE TABLE IF NOT EXISTS runs ({columns})")
            db.executemany(f"INSERT OR REPLACE INTO runs VALUES ({marks})", rows)
    except sqlite3.Error as exc:
        cause = clip(str(exc))
        if "unable to open" in cause:  # SQLite does not say why: ask the system
            try:
                os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o666))
            except OSError as why:
                cause = why.strerror or cause
        damaged = not isinstance(exc, sqlite3.OperationalError) or "columns" in cause  # not a lock or mode
        hint = "; delete it: the next sweep writes it anew from the run folders" if damaged else ""
        raise UserError(f"cannot write the sweep index {show_path(path)}: {cause}{hint}") from None
    except OSError as exc:
        raise path_error(path, exc, "write the sweep index") from None

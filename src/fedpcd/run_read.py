"""Reading a run's result files, checked: the one reader of ``metrics.jsonl`` and of ``summary.json``, for the
report, the sweep and a resume alike. Each value is checked against ``fedpcd.run_schema``, so a hand-edited or
foreign file is one line naming the file, the line and the field. No torch here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fedpcd.errors import UserError
from fedpcd.run_schema import Record, Summary, check
from fedpcd.utils import parse_json, read_json, read_user_text, show_path


def read_metrics(path: str | Path, *, resuming: bool = False) -> list[dict[str, Any]]:
    """A run's metrics.jsonl as records; a line that is not a record the schema admits
    (``fedpcd.run_schema.Record``) is one line naming the file, the line number and the field.

    ``resuming``: a missing file has no records yet, and a last line without its newline that does not parse
    is a write cut short by a kill, ignored (a resume writes that round again)."""
    path = Path(path)
    if resuming and not os.path.lexists(path):
        return []
    lines = read_user_text(path, "metrics file", links=False).split("\n")
    records = []
    lengths = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"metrics file {show_path(path)} line {number}"
        try:
            data = parse_json(line, where, lines=False)
        except UserError:
            if resuming and number == len(lines):  # the unterminated last line: torn by a kill
                break
            raise
        record = check(Record, data, where)
        if record.get("global_class_acc") is not None:
            lengths.add(len(record["global_class_acc"]))
        records.append(record)
    if len(lengths) > 1:
        raise UserError(f"metrics file {show_path(path)}: 'global_class_acc' changes length between rounds")
    return records


def read_summary(path: str | Path) -> dict[str, Any]:
    """A run's summary.json; anything the summary schema (``fedpcd.run_schema.Summary``) refuses is one line
    naming the file and the field."""
    summary = read_json(path, "summary file", links=False)
    return check(Summary, summary, f"summary file {show_path(path)} is not a fedpcd summary")

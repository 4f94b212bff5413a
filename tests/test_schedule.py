"""tests/conftest.py's file order for `make test` (--dist loadfile: a file is one work unit, in order)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import pytest_collection_modifyitems


def _item(file: str, *marks: str) -> SimpleNamespace:
    return SimpleNamespace(path=Path(file), get_closest_marker=lambda name: name if name in marks else None)


def test_process_files_start_first_each_beside_another_file_then_slow_files():
    items = [
        _item("a.py"),
        _item("b.py", "slow"),
        _item("c.py"),
        _item("c.py", "slow", "procs"),
        _item("d.py", "slow"),
        _item("e.py", "slow", "procs"),
        _item("e.py"),
        _item("f.py"),
    ]
    pytest_collection_modifyitems(items)
    files = [item.path.name for item in items]
    assert files == ["c.py", "c.py", "b.py", "e.py", "e.py", "d.py", "a.py", "f.py"]
    assert [item.get_closest_marker("procs") for item in items[:2]] == [None, "procs"]  # stable in a file

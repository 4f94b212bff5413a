"""Hardening of the commands' own files: every write to a user's path (report --out, partition --json/--plot,
the sweep index) and every read of a run file (summary.json, metrics.jsonl, config.yaml, partition.json, an
explicit partition) that fails is one line naming the path and the cause, exit code 2, with the files
already there unchanged; a sweep exits 0 exactly when every run of its grid is finished."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
from pathlib import Path

import pytest
import yaml

import fedpcd.backends
import fedpcd.utils
from fedpcd.cli import main
from fedpcd.errors import RunInUseError, UserError
from fedpcd.resolve import load_config
from fedpcd.sweep.grid import expand_sweep
from fedpcd.sweep.status import run_status
from fedpcd.utils import atomic_write_text, read_json

RUN = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "rounds=1", "clients=2"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("fedpcd: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: relative path -> bytes (None for a folder)."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))
    }


def _fake_run(folder: Path, seed: int = 0) -> Path:
    """A finished 2-round run directory written by hand (no training)."""
    folder.mkdir(parents=True)
    cfg = load_config(None, ["dataset.name=synthetic", "model.name=mlp", "rounds=2", f"seed={seed}"])
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    records = [
        {"round": r, "global_acc": 0.4 + r / 10, "personal_acc": 0.5, "bytes_up": 10, "bytes_down": 10}
        for r in (1, 2)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"rounds": 2, "wall_s": 1.0}))
    return folder


def _fail_with(monkeypatch, code: int) -> None:
    """Every new file fedpcd writes atomically fails with ``code`` (as a read-only folder would, for root
    too)."""

    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fedpcd.utils.tempfile, "mkstemp", refused)


# ----- atomic_write: the one place a write to a user's path fails ------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT])
def test_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch, code):
    target = tmp_path / "out.txt"
    target.write_text("old")

    def fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fedpcd.utils.os, "fsync", fsync)
    with pytest.raises(UserError) as info:
        atomic_write_text(target, "new")
    assert str(info.value) == f"cannot write {target}: {os.strerror(code)}"
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_write_onto_a_folder_or_under_a_file_names_both(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "keep").write_text("k")
    (tmp_path / "file").write_text("f")
    with pytest.raises(UserError, match=f"^cannot write {tmp_path}/dir: Is a directory$"):
        atomic_write_text(tmp_path / "dir", "x")
    with pytest.raises(UserError) as info:
        atomic_write_text(tmp_path / "file" / "sub" / "x.txt", "x")
    assert (
        str(info.value) == f"cannot write {tmp_path}/file/sub/x.txt: {tmp_path}/file is a file, not a folder"
    )
    assert _tree(tmp_path) == {"dir": None, "dir/keep": b"k", "file": b"f"}


@pytest.mark.parametrize("name", ["a\x00b", "a\nb", "a\u202eb", "a\u200bb"])
def test_paths_with_invisible_characters_are_shown_escaped(tmp_path, name):
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(UserError) as info:
        atomic_write_text(tmp_path / "a-file" / name, "x")
    message = str(info.value)
    assert message.startswith(f"cannot write '{tmp_path}/a-file/{repr(name)[1:-1]}': ")
    assert not any(c in message for c in "\x00\n\u202e\u200b"), message


def test_read_json_names_the_file_and_the_problem(tmp_path):
    path = tmp_path / "f.json"
    cases = {
        "{bad": "is not valid JSON at line 1",
        "[" * 100000 + "]" * 100000: "is nested more than 32 levels deep",
        "9" * 5000: "holds an integer too long to read",
    }
    for text, needle in cases.items():
        path.write_text(text)
        with pytest.raises(UserError, match=f"^thing {path} {needle}"):
            read_json(path, "thing")
    path.write_bytes(b"\xff")
    with pytest.raises(UserError, match=f"^thing {path} is not UTF-8 text"):
        read_json(path, "thing")
    with pytest.raises(UserError, match=f"^thing {tmp_path} is a folder; give a regular file$"):
        read_json(tmp_path, "thing")
    with pytest.raises(UserError, match=f"^thing {tmp_path}/none not found$"):
        read_json(tmp_path / "none", "thing")


# ----- report -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out", "needle"),
    [
        ("a-file", "cannot write {t}/a-file/report.md: {t}/a-file is a file, not a folder"),
        ("a-file/sub/board.md", "cannot write {t}/a-file/sub/board.md: {t}/a-file is a file, not a folder"),
        ("a-folder.md", "cannot write {t}/a-folder.md: it is a folder; name a new path or remove it"),
        ("board.md", "cannot write {t}/board: it is a file; name a new path or remove it"),
    ],
)
def test_report_out_of_the_wrong_type_is_one_line(tmp_path, capsys, out, needle):
    _fake_run(tmp_path / "runs" / "a")
    target = tmp_path / "t"
    target.mkdir()
    (target / "a-file").write_text("mine")
    (target / "a-folder.md").mkdir()
    (target / "a-folder.md" / "notes").write_text("mine")
    (target / "board").write_text("mine")
    before = _tree(target)
    assert main(["report", str(tmp_path / "runs"), "--out", str(target / out)]) == 2
    assert _error_line(capsys) == "fedpcd: error: " + needle.format(t=target)
    assert _tree(target) == before


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_report_out_that_cannot_be_written_keeps_the_old_report(tmp_path, monkeypatch, capsys, code):
    _fake_run(tmp_path / "runs" / "a")
    out = tmp_path / "rep"
    assert main(["report", str(tmp_path / "runs"), "--out", str(out)]) == 0
    before = _tree(out)
    _fail_with(monkeypatch, code)
    capsys.readouterr()
    assert main(["report", str(tmp_path / "runs"), "--out", str(out), "--title", "New"]) == 2
    line = _error_line(capsys)  # the first file the report could not write (its figures come first)
    assert line.startswith(f"fedpcd: error: cannot write {out}/") and line.endswith(f": {os.strerror(code)}")
    assert _tree(out) == before


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{}", "summary.json is not a fedpcd summary: it has no 'rounds'"),
        ("[1, 2]", "summary.json is not a fedpcd summary: expected a JSON object, got list"),
        ("{bad", "summary.json is not valid JSON at line 1"),
        (
            '{"rounds": "3", "wall_s": 1}',
            "summary.json is not a fedpcd summary: 'rounds' must be a whole number",
        ),
        ('{"rounds": 3, "wall_s": 1' + "0" * 5000 + "}", "summary.json holds an integer too long to read"),
    ],
)
def test_report_on_a_malformed_summary_is_one_line(tmp_path, capsys, content, needle):
    run = _fake_run(tmp_path / "runs" / "a")
    (run / "summary.json").write_text(content)
    assert main(["report", str(tmp_path / "runs")]) == 2
    assert _error_line(capsys).startswith(f"fedpcd: error: summary file {run}/{needle}")


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("[1, 2]", "line 2: expected a JSON object, got list"),
        ('{"round": "2"}', "line 2: 'round' must be a whole number, got '2'"),
        ('{"global_acc": 0.5}', "line 2: it has no 'round'"),
        ('{"round": 2, "global_acc": "high"}', "line 2: 'global_acc' must be a number, got 'high'"),
        ('{"round": 2, "global_acc": 0.5', "line 2 is not valid JSON: Expecting ',' delimiter"),
    ],
)
def test_report_on_a_malformed_metrics_line_is_one_line(tmp_path, capsys, line, needle):
    run = _fake_run(tmp_path / "runs" / "a")
    first = (run / "metrics.jsonl").read_text().splitlines()[0]
    (run / "metrics.jsonl").write_text(f"{first}\n{line}\n")
    assert main(["report", str(tmp_path / "runs")]) == 2
    assert _error_line(capsys) == f"fedpcd: error: metrics file {run}/metrics.jsonl {needle}"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("a: &a [x, x]\nb: [*a, *a]\n", "uses the YAML alias *a"),
        ("algorithm: 3\n", "is not a fedpcd run config: bad value for 'algorithm'"),
        ("seed: " + "[" * 1000 + "]" * 1000 + "\n", "is nested more than 32 levels deep"),
    ],
)
def test_report_on_a_malformed_run_config_is_one_line(tmp_path, capsys, content, needle):
    run = _fake_run(tmp_path / "runs" / "a")
    (run / "config.yaml").write_text(content)
    assert main(["report", str(tmp_path / "runs")]) == 2
    err = _error_line(capsys)
    assert err.startswith(f"fedpcd: error: config file {run}/config.yaml {needle}"), err


def test_report_on_a_malformed_partition_json_is_one_line(tmp_path, capsys):
    _fake_run(tmp_path / "runs" / "a")
    other = _fake_run(tmp_path / "runs" / "b")
    cfg = load_config(
        None, ["dataset.name=synthetic", "model.name=mlp", "rounds=2", "algorithm.name=fedprox"]
    )
    data = {**cfg.to_dict(), "partition": {"scheme": "dirichlet", "beta": 0.1}}
    (other / "config.yaml").write_text(yaml.safe_dump(data))  # a second method and setting: papers' layout
    for run in ("a", "b"):
        (tmp_path / "runs" / run / "partition.json").write_text('{"clients": [{"train_counts": [1, -1]}]}')
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 2
    assert _error_line(capsys).startswith("fedpcd: error: partition file ")
    assert not (tmp_path / "rep" / "report.md").exists()


def test_report_notes_that_cannot_be_read_is_one_line(tmp_path, capsys):
    _fake_run(tmp_path / "runs" / "a")
    assert main(["report", str(tmp_path / "runs"), "--notes", str(tmp_path)]) == 2
    assert _error_line(capsys) == f"fedpcd: error: notes file {tmp_path} is a folder; give a regular file"


@pytest.mark.parametrize("last", ["0", "-3", "x"])
def test_report_last_must_be_a_positive_whole_number(tmp_path, capsys, last):
    _fake_run(tmp_path / "runs" / "a")
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "runs"), "--last", last])
    assert exc.value.code == 2
    assert "argument --last: expected a whole number >= 1" in capsys.readouterr().err


# ----- partition --json / --plot ------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("folder", "cannot write {t}/folder: it is a folder; name a new path or remove it"),
        ("a-file/p.out", "cannot write {t}/a-file/p.out: {t}/a-file is a file, not a folder"),
    ],
)
def test_partition_output_of_the_wrong_type_fails_before_loading_data(
    tmp_path, monkeypatch, capsys, option, target, needle
):
    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded before the output path was checked")

    monkeypatch.setattr("fedpcd.data.datasets.load_dataset", no_data)
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("mine")
    before = _tree(tmp_path)
    assert main(["partition", "dataset.name=synthetic", option, str(tmp_path / target)]) == 2
    assert _error_line(capsys) == "fedpcd: error: " + needle.format(t=tmp_path)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize("code", [errno.EACCES, errno.ENOSPC])
def test_partition_output_that_cannot_be_written_keeps_the_old_file(
    tmp_path, monkeypatch, capsys, option, code
):
    target = tmp_path / "out"
    target.write_text("old")
    _fail_with(monkeypatch, code)
    assert main(["partition", "dataset.name=synthetic", option, str(target)]) == 2
    assert _error_line(capsys) == f"fedpcd: error: cannot write {target}: {os.strerror(code)}"
    assert _tree(tmp_path) == {"out": b"old"}


# ----- explicit partition files (CLI path; the cases themselves are in test_partition.py) -----------------


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            json.dumps({"clients": [[2**70], [1]]}),
            ": client 0: index out of range [0, 1000): 1180591620717411303424",
        ),
        ('{"clients": [[' + "9" * 5000 + "], [1]]}", " holds an integer too long to read (over 4300 digits)"),
        ("[" * 100000 + "]" * 100000, " is nested more than 3 levels deep"),
        ('{"clients": [[], []]}', ": every client's list is empty; list at least one sample index"),
    ],
)
def test_explicit_partition_file_problems_are_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "clients.json"
    path.write_text(content)
    argv = ["partition", "dataset.name=synthetic", "clients=2", "partition.scheme=explicit"]
    assert main([*argv, f"partition.path={path}"]) == 2
    assert _error_line(capsys) == f"fedpcd: error: explicit partition file {path}{needle}"


def test_deeply_nested_override_is_one_line(capsys):
    assert main(["partition", "dataset.name=synthetic", "seed=" + "[" * 10000 + "]" * 10000]) == 2
    assert _error_line(capsys) == "fedpcd: error: override 'seed' is nested more than 32 levels deep"


# ----- sweep --------------------------------------------------------------------------------------------


def _sweep_file(tmp_path: Path, out: Path) -> Path:
    spec = {
        "dataset": {"name": "synthetic"},
        "model": {"name": "mlp", "hidden": 8},
        "clients": 2,
        "rounds": 1,
        "output_dir": str(out),
        "sweep": {"seed": [0, 1]},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_sweep_output_dir_under_a_file_fails_before_any_run(tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    path = _sweep_file(tmp_path, tmp_path / "a-file" / "runs")
    assert main(["sweep", "--config", str(path)]) == 2
    index = tmp_path / "a-file" / "runs" / "index.sqlite"
    assert (
        _error_line(capsys)
        == f"fedpcd: error: cannot write {index}: {tmp_path}/a-file is a file, not a folder"
    )
    assert (tmp_path / "a-file").read_text() == "mine"


def test_sweep_with_a_corrupt_index_fails_before_any_run_and_keeps_it(tmp_path, capsys):
    out = tmp_path / "runs"
    out.mkdir()
    junk = os.urandom(4096)
    (out / "index.sqlite").write_bytes(junk)
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: cannot write the sweep index {out}/index.sqlite: file is not a database; delete it: "
        "the next sweep writes it anew from the run folders"
    )
    assert _tree(out) == {"index.sqlite": junk}


def test_sweep_with_a_read_only_index_is_one_line(tmp_path, monkeypatch, capsys):
    real = sqlite3.connect

    def read_only(path, *args, **kwargs):
        return real(f"file:{path}?mode=ro", *args, uri=True, **kwargs)

    out = tmp_path / "runs"
    path = _sweep_file(tmp_path, out)
    assert main(["sweep", "--dry-run", "--config", str(path)]) == 0
    out.mkdir()
    with real(out / "index.sqlite") as db:
        db.execute("CREATE TABLE other (x)")
    monkeypatch.setattr(sqlite3, "connect", read_only)
    capsys.readouterr()
    assert main(["sweep", "--config", str(path)]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: cannot write the sweep index {out}/index.sqlite: "
        "attempt to write a readonly database"
    )
    assert sorted(p.name for p in out.iterdir()) == ["index.sqlite"]


def test_sweep_skips_a_corrupt_summary_and_exits_2(tmp_path, capsys):
    out = tmp_path / "runs"
    path = _sweep_file(tmp_path, out)
    assert main(["sweep", "--config", str(path)]) == 0
    assert capsys.readouterr().out.endswith("sweep: all 2 runs finished\n")
    (out / "seed0" / "summary.json").write_bytes(b"\x00garbage")
    assert [run_status(c) for c in expand_sweep(path)] == ["broken", "done"]
    assert main(["sweep", "--config", str(path)]) == 2
    assert _error_line(capsys) == (
        "fedpcd: error: sweep: 1 of 2 runs skipped, 1 finished (skipped: seed0); the lines above say why; "
        "rerun the same command to retry"
    )
    assert (out / "seed0" / "summary.json").read_bytes() == b"\x00garbage"
    with sqlite3.connect(out / "index.sqlite") as db:
        assert db.execute("SELECT status FROM runs ORDER BY output_dir").fetchall() == [
            ("broken",),
            ("done",),
        ]
    assert main(["sweep", "--dry-run", "--config", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"broken  {out}/seed0\n")


def test_sweep_that_skips_a_stuck_run_exits_2_with_one_line(tmp_path, capsys):
    out = tmp_path / "runs"
    (out / "seed1").mkdir(parents=True)
    (out / "seed1" / "metrics.jsonl").write_text("")
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 2
    captured = capsys.readouterr()
    assert f"skip {out}/seed1: started but has no checkpoint; delete the folder to rerun it\n" in captured.out
    assert captured.err == (
        "fedpcd: error: sweep: 1 of 2 runs skipped, 1 finished (skipped: seed1); the lines above say why; "
        "rerun the same command to retry\n"
    )
    assert (out / "seed0" / "summary.json").exists() and (out / "seed1" / "metrics.jsonl").read_text() == ""


def test_sweep_skips_a_run_locked_by_another_process_and_exits_2(tmp_path, capsys):
    out = tmp_path / "runs"
    (out / "seed0").mkdir(parents=True)
    fd = os.open(out / "seed0" / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: to fedpcd, another process holds the run
        os.write(fd, b"4242\n")
        assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 2
    finally:
        os.close(fd)
    captured = capsys.readouterr()
    assert f"skip {out}/seed0 is in use by another fedpcd process (pid 4242)" in captured.out
    assert captured.err == (
        "fedpcd: error: sweep: 1 of 2 runs skipped, 1 finished (skipped: seed0); the lines above say why; "
        "rerun the same command to retry\n"
    )
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 0  # lock gone: it runs now


def test_sweep_exits_0_when_another_sweep_finished_the_runs_it_could_not(tmp_path, monkeypatch, capsys):
    """Two sweeps on one folder: whatever this one could not run (held by the other, or finished by it while
    this one ran something else) counts as finished when it is at the end."""
    real = fedpcd.backends.run_experiment
    path = _sweep_file(tmp_path, tmp_path / "runs")
    configs = expand_sweep(path)

    def other_sweep_too(config, progress=False):
        if config.output_dir.endswith("seed0"):
            real(configs[1], progress=False)  # meanwhile the other sweep finishes seed1
            real(config, progress=False)  # ... and holds seed0, which it finishes too
            raise RunInUseError(f"{config.output_dir} is in use by another fedpcd process (pid 1)")
        raise AssertionError("seed1 was run twice")

    monkeypatch.setattr(fedpcd.backends, "run_experiment", other_sweep_too)
    assert main(["sweep", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"skip {configs[0].output_dir} is in use" in out
    assert f"done {configs[1].output_dir} (finished meanwhile by another process)" in out
    assert out.endswith("sweep: all 2 runs finished\n")


def test_sweep_with_a_failed_run_counts_it(tmp_path, monkeypatch, capsys):
    real = fedpcd.backends.run_experiment

    def fail_seed1(config, progress=False):
        if config.output_dir.endswith("seed1"):
            raise UserError("diverged\nsecond line")
        return real(config, progress=progress)

    monkeypatch.setattr(fedpcd.backends, "run_experiment", fail_seed1)
    out = tmp_path / "runs"
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 2
    assert capsys.readouterr().err == (
        f"FAILED {out}/seed1: UserError: diverged\n"
        "fedpcd: error: sweep: 1 of 2 runs failed, 1 finished (failed: seed1); the lines above say why; "
        "rerun the same command to retry\n"
    )


def test_sweep_index_path_that_is_a_folder_names_the_cause(tmp_path, capsys):
    out = tmp_path / "runs"
    (out / "index.sqlite").mkdir(parents=True)
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 2
    index = out / "index.sqlite"
    assert _error_line(capsys) == f"fedpcd: error: cannot write the sweep index {index}: Is a directory"
    assert _tree(out) == {"index.sqlite": None}


def test_sweep_goes_on_when_the_index_fails_midway_and_says_so_at_the_end(tmp_path, monkeypatch, capsys):
    real, calls = sqlite3.connect, []

    def full_after_the_first(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise sqlite3.OperationalError("database or disk is full")
        return real(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", full_after_the_first)
    out = tmp_path / "runs"
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: sweep: all 2 runs finished, but cannot write the sweep index {out}/index.sqlite: "
        "database or disk is full"
    )
    assert all((out / f"seed{s}" / "summary.json").exists() for s in (0, 1))
    monkeypatch.setattr(sqlite3, "connect", real)
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 0  # the index caught up
    with real(out / "index.sqlite") as db:
        assert db.execute("SELECT status FROM runs").fetchall() == [("done",), ("done",)]


@pytest.mark.parametrize("label", ["..", ".", "/", "..//.."])
def test_sweep_setting_label_that_leaves_the_sweep_folder_is_refused(tmp_path, capsys, label):
    """A `setting` labelled `..` would put its run outside the sweep's output_dir (over the sweep itself)."""
    path = tmp_path / "s.yaml"
    path.write_text(
        f"dataset: {{name: synthetic16}}\nclients: 2\nrounds: 1\noutput_dir: {tmp_path / 'runs'}\n"
        f"sweep:\n  setting:\n    - {{label: {json.dumps(label)}, clients: 2}}\n"
    )
    assert main(["sweep", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "not a folder below" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]  # nothing written anywhere

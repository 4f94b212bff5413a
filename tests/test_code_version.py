"""Every run records the code that made it, and a paired comparison of runs made by different code says so."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from fedpcd.backends import run_experiment
from fedpcd.report.document import write_report
from fedpcd.resolve import load_config
from fedpcd.run_format import (
    ALLOW_DIRTY,
    CODE,
    RESULTS_VERSION,
    code_version,
    comparable,
    diff_hash,
    same_code,
)

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "clients=3", "rounds=2"]


def test_same_code_needs_the_same_commit_and_results_number():
    a = {"fedpcd": "0.1.0", "commit": "abc", "results": 1}
    assert same_code(a, dict(a)) and same_code({**a, "fedpcd": "0.2.0"}, a)  # the version string is a label
    assert not same_code(a, {**a, "commit": "abd"}) and not same_code(a, {**a, "results": 2})
    assert not same_code(None, a) and not same_code(None, None)  # unrecorded matches nothing


def test_a_run_records_its_code_and_the_report_flags_pairs_made_by_different_code(tmp_path):
    for name in ("fedavg", "fedprox"):
        args = [*SMALL, f"algorithm.name={name}", f"output_dir={tmp_path / name}"]
        run_experiment(load_config(None, args), progress=False)
    code = json.loads((tmp_path / "fedavg" / "summary.json").read_text())[CODE]
    assert code == code_version() and code["results"] == RESULTS_VERSION
    assert code["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", code["commit"])
    assert "made by different code" not in write_report(tmp_path, paired_with="fedavg")

    path = tmp_path / "fedprox" / "summary.json"
    summary = json.loads(path.read_text())
    summary[CODE] = {**summary[CODE], "results": RESULTS_VERSION + 1}
    path.write_text(json.dumps(summary))
    text = write_report(tmp_path, paired_with="fedavg")
    assert "**Paired runs made by different code** (1;" in text
    assert f"`fedprox` (results {RESULTS_VERSION + 1}, " in text
    assert f"`fedavg` (results {RESULTS_VERSION}, " in text


def _git(folder, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def test_the_diff_hash_changes_with_the_diff_and_counts_untracked_files(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "0")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "1")
    assert diff_hash(tmp_path) == ""  # clean
    (tmp_path / "a.py").write_text("x = 2\n")
    first = diff_hash(tmp_path)
    (tmp_path / "a.py").write_text("x = 3\n")
    second = diff_hash(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{64}", first) and second != first
    (tmp_path / "a.py").write_text("x = 2\n")
    assert diff_hash(tmp_path) == first  # the same changes, the same hash
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "new.py").write_text("y = 1\n")  # untracked: dirty too, its content counted
    untracked = diff_hash(tmp_path)
    (tmp_path / "new.py").write_text("y = 2\n")
    assert untracked not in ("", None) and diff_hash(tmp_path) != untracked
    (tmp_path / ".gitignore").write_text("new.py\n")  # ignored files are not the code; .gitignore itself is
    assert diff_hash(tmp_path) not in (untracked, "")


def test_same_code_and_comparable_read_new_and_old_records():
    clean = {"fedpcd": "0.1.0", "commit": "5e1e752" + "0" * 33, "dirty": False, "diff": None, "results": 1}
    dirty = {**clean, "dirty": True, "diff": "a" * 64}
    old_dirty = {"fedpcd": "0.1.0", "commit": clean["commit"] + "+dirty", "results": 1}
    assert same_code(clean, dict(clean)) and same_code(dirty, dict(dirty))
    assert not same_code(clean, dirty) and not same_code(dirty, {**dirty, "diff": "b" * 64})
    assert same_code(old_dirty, dict(old_dirty))  # as before the flag: two '+dirty' of one commit match
    assert not same_code(old_dirty, dirty) and not same_code(old_dirty, clean)
    assert comparable(clean, dict(clean)) is None
    assert comparable(clean, dirty) == comparable(old_dirty, old_dirty) == "dirty tree"
    other = {**clean, "commit": "553556a" + "1" * 33}
    assert comparable(clean, other) == "runs from commits 5e1e752, 553556a"
    assert comparable(clean, {**clean, "results": 2}) == "results numbers 1, 2"
    assert comparable(clean, None) == comparable({**clean, "commit": None}, clean) == "no commit recorded"


def test_a_sweep_into_the_archive_refuses_a_dirty_tree_unless_allowed_and_the_runs_record_it(
    tmp_path, monkeypatch, capsys
):
    from fedpcd import run_format
    from fedpcd.cli import main

    if code_version()["commit"] is None:
        pytest.skip("needs a git checkout")
    monkeypatch.setenv(ALLOW_DIRTY, "0")  # restored after the test (the sweep sets it)
    monkeypatch.setattr(run_format, "diff_hash", lambda here: "d" * 64)  # a dirty tree
    archive = tmp_path / "docs" / "results" / "runs" / "tiny"
    path = tmp_path / "s.yaml"
    path.write_text(f"output_dir: {archive}\nsweep:\n  seed: [0]\n")
    argv = ["sweep", "--config", str(path), *SMALL, "rounds=1", "engine.workers=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(
        "is in the archive of runs (docs/results/runs) and src/fedpcd has uncommitted changes; commit them "
        "first, or give --allow-dirty (the runs record it)"
    )
    assert not archive.exists()
    assert main([*argv, "--allow-dirty"]) == 0
    code = json.loads((archive / "seed0" / "summary.json").read_text())[CODE]
    assert (code["dirty"], code["diff"], code["allow_dirty"]) == (True, "d" * 64, True)
    outside = tmp_path / "runs" / "tiny"
    path.write_text(f"output_dir: {outside}\nsweep:\n  seed: [0]\n")
    monkeypatch.setattr(run_format, "diff_hash", lambda here: "d" * 64)
    monkeypatch.setenv(ALLOW_DIRTY, "0")
    assert main(argv) == 0  # outside the archive a dirty tree may run
    assert "allow_dirty" not in json.loads((outside / "seed0" / "summary.json").read_text())[CODE]

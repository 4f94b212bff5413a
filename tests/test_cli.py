"""The fedpcd command: exit codes, one-line errors, run/partition/list/demo output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fedpcd
from conftest import requires_fmnist
from doc_blocks import blocks, fedpcd_commands
from fedpcd.cli import main

ROOT = Path(__file__).resolve().parents[1]

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "rounds=1", "clients=3"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "dataset.name=imagenet"], "unknown dataset 'imagenet'"),
        (["run", "partition.scheme=zigzag"], "unknown partition scheme"),
        (["run", "model.name=vgg"], "unknown model 'vgg'"),
        (["run", "algorithm.name=fedfoo"], "unknown algorithm 'fedfoo'"),
        (["partition", "dataset.name=synthetic", "partition.classes_per_client=11"], "classes_per_client"),
        (["partition", "dataset.name=synthetic", "clients=100000"], "more clients"),
        (["run", "--config", "/nonexistent.yaml"], "config file not found"),
        (["run"], "needs --config"),
        (["run", "--resume", "/nonexistent-run"], "no checkpoint"),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in _error_line(capsys)


def test_missing_data_files_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDPCD_DATA", str(tmp_path))
    assert (
        main(["partition", "dataset.name=cifar10", "dataset.download=false", f"dataset.root={tmp_path}"]) == 2
    )
    assert "cifar10" in _error_line(capsys)


def test_run_prints_table_and_writes_run_dir(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--quiet", *SMALL, f"output_dir={out}"]) == 0
    stdout = capsys.readouterr().out
    assert "GA" in stdout and "PA-split" in stdout and str(out) in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 1 and 0 <= summary["final"]["global_acc"] <= 1
    # a second run into the same folder is refused and leaves it intact
    assert main(["run", "--quiet", *SMALL, f"output_dir={out}"]) == 2
    assert "already holds a run" in _error_line(capsys)
    assert json.loads((out / "summary.json").read_text()) == summary


def test_list_names_every_kind(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for needle in ["algorithm  fedavg", "dataset    fmnist", "partition  dirichlet", "model      simplecnn"]:
        assert needle in out


def test_console_script_entry_point_exit_code():
    proc = subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", "run", "colour=red"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("fedpcd: error: unknown config key 'colour'")


@requires_fmnist
def test_partition_fmnist_p10c2_acceptance(tmp_path, capsys):
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    argv = [
        "partition",
        "dataset.name=fmnist",
        "partition.scheme=pathological",
        "partition.classes_per_client=2",
        "clients=10",
        f"--json={js}",
        f"--plot={png}",
    ]
    assert main(argv) == 0
    assert png.stat().st_size > 1000
    part = json.loads(js.read_text())
    counts = np.array([c["train_counts"] for c in part["clients"]])
    assert ((counts > 0).sum(1) == 2).all()
    assert counts.sum() == 60000 and (counts.sum(0) == 6000).all()  # every index used exactly once
    for k in range(5):
        assert set(np.flatnonzero(counts[k])) == {2 * k, 2 * k + 1}
    assert ((counts > 0).sum(0) >= 1).all()


@requires_fmnist
def test_dirichlet_same_seed_same_partition(tmp_path):
    def part(seed, name):
        path = tmp_path / name
        assert (
            main(
                [
                    "partition",
                    "dataset.name=fmnist",
                    "partition.scheme=dirichlet",
                    "partition.beta=0.1",
                    f"seed={seed}",
                    f"--json={path}",
                ]
            )
            == 0
        )
        return json.loads(path.read_text())

    assert part(0, "a.json") == part(0, "b.json")
    assert part(0, "a.json") != part(1, "c.json")


def test_overrides_may_stand_between_options(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "rounds=1", "--quiet", *SMALL[:-2], "partition.scheme=iid", f"output_dir={out}"]
    assert main(argv) == 0
    assert "scheme: iid" in (out / "config.yaml").read_text()
    with pytest.raises(SystemExit) as exc:
        main(["run", "--quiet", "--bogus"])
    assert exc.value.code == 2


def _readme_use_commands() -> list[list[str]]:
    """The `fedpcd ...` commands of the README's blocks that a reader runs, in order (tests/doc_blocks.py)."""
    return [
        ["fedpcd", *argv]
        for block in blocks("README.md")
        if block.runs and block.lang == "bash"
        for argv in fedpcd_commands(block.code)
    ]


def test_readme_use_commands_that_need_no_training_run_on_a_fresh_clone(tmp_path, monkeypatch, capsys):
    """Every command of the README's blocks that trains nothing runs, in the order written, from a folder
    holding only the repository's configs/ and docs/ (what a fresh clone has)."""
    commands = _readme_use_commands()
    assert ["fedpcd", "--version"] in commands and len(commands) >= 8
    for name in ("configs", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    quick = [c for c in commands if c[1] in ("list", "partition") or c[1:2] == ["report"] and "docs/" in c[2]]
    assert len(quick) >= 4
    for argv in quick:
        assert main(argv[1:]) == 0, argv
    capsys.readouterr()
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out == f"fedpcd {fedpcd.__version__}\n"
    assert (tmp_path / "board.md").exists() and (tmp_path / "part.json").exists()


def test_ctrl_c_names_the_command_that_resumes_this_run(tmp_path, monkeypatch, capsys):
    import fedpcd.backends

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fedpcd.backends, "run_experiment", interrupted)
    out = tmp_path / "my-run"
    assert main(["run", "dataset.name=synthetic", f"output_dir={out}"]) == 130
    assert capsys.readouterr().err.strip() == f"fedpcd: interrupted (resume with: fedpcd run --resume {out})"


def test_the_version_is_defined_once():
    """pyproject.toml defines the version; the package, --version and CITATION.cff agree with it."""
    import re

    import yaml

    declared = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert fedpcd.__version__ == declared
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["version"] == declared and cff["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")

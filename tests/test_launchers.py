"""fedpcd sweep --launcher ray | slurm: the options' errors, and end to end on a Ray cluster on loopback and
through submitit's local processes: the same run folders (metrics bitwise) and index as the local launcher,
one line per failure, finished runs skipped on a rerun, the progress line with its ETA."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import run_records, run_summary
from fedpcd.cli import main
from fedpcd.launchers import SLURM_TIME_MIN, parse_slurm
from fedpcd.resolve import load_config
from fedpcd.sweep.progress import Progress

requires = {
    module: pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} not installed")
    for module in ("ray", "submitit")
}
RUNS = ["lr0.05", "lr0.1", "lr1e30"]  # the grid's run folders; lr1e30 diverges in round 1: a failing run
NOT_A_RUN = {"index.sqlite", "submitit"}  # what a sweep folder holds besides the runs' folders


def _grid(tmp_path: Path, out: Path) -> Path:
    spec = {
        "dataset": {"name": "synthetic"},
        "model": {"name": "mlp", "hidden": 16},
        "clients": 2,
        "rounds": 2,
        "output_dir": str(out),
        "sweep": {"local.lr": [0.05, 0.1, 1.0e30]},
    }
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[str]]:
    """The grid run by the local launcher (in this process): its folder and its FAILED lines (the folder
    written OUT), what every launcher must give."""
    tmp = tmp_path_factory.mktemp("reference")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["sweep", "--config", str(_grid(tmp, tmp / "local"))]) == 2  # lr1e30 fails
    failed = [line for line in err.getvalue().splitlines() if line.startswith("FAILED")]
    return tmp / "local", [line.replace(str(tmp / "local"), "OUT") for line in failed]


def _index(root: Path) -> dict[str, dict]:
    """The index's rows by run name, without what names the folder or the wall time."""
    with sqlite3.connect(root / "index.sqlite") as db:
        db.row_factory = sqlite3.Row
        rows = [dict(r) for r in db.execute("SELECT * FROM runs")]
    out = {}
    for row in rows:
        config, summary = json.loads(row.pop("config")), json.loads(row.pop("summary") or "null")
        config.pop("output_dir")
        if summary is not None:
            summary.pop("wall_s")
            summary["final"].pop("wall_s", None)
        row.pop("wall_s")
        name = Path(row.pop("output_dir")).name
        out[name] = {**row, "config": config, "summary": summary}
    return out


def _assert_same_sweep(reference: Path, root: Path) -> None:
    """Same run folders with the same files: metrics.jsonl bitwise (wall times aside), summaries, partitions,
    stop records, configs (but for the folder), and the same index."""
    assert sorted(p.name for p in root.iterdir() if p.name not in NOT_A_RUN) == RUNS
    for name in RUNS:
        ref, run = reference / name, root / name
        assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in ref.iterdir())
        assert run_records(run) == run_records(ref)
        for file in ("partition.json", "stopped.json"):
            assert (run / file).exists() == (ref / file).exists()
            if (ref / file).exists():
                assert (run / file).read_text() == (ref / file).read_text()
        if (ref / "summary.json").exists():
            assert run_summary(run) == run_summary(ref)
        config = (run / "config.yaml").read_text().replace(str(run), "OUT")
        assert config == (ref / "config.yaml").read_text().replace(str(ref), "OUT")
    assert _index(root) == _index(reference)
    assert [_index(root)[n]["status"] for n in RUNS] == ["done", "done", "resume"]


def _check_output(out: str, err: str, root: Path, reference_failed: list[str]) -> None:
    """The local launcher's one FAILED line, the closing line, and progress lines over the grid as runs end:
    each but the last with an ETA, the last counting 2 finished and 1 failed."""
    failed = [line.replace(str(root), "OUT") for line in err.splitlines() if line.startswith("FAILED")]
    assert failed == reference_failed and len(failed) == 1
    assert err.splitlines()[-1].startswith("fedpcd: error: sweep: 1 of 3 runs failed, 2 finished")
    progress = [line for line in out.splitlines() if line.startswith("sweep: ") and "finished," in line]
    assert progress[-1] == "sweep: 2/3 finished, 0 running, 1 failed"
    assert len(progress) >= 3 and all("; ETA " in line for line in progress[:-1])


def _rerun_skips_finished(root: Path, rerun) -> None:
    """Run the sweep again: the finished runs stay untouched, the failing one fails again in one line."""
    before = [(root / n / "summary.json").stat().st_mtime_ns for n in RUNS[:2]]
    code, out, err = rerun()
    assert code == 2
    assert "sweep: 3 runs, 2 finished or skipped, 1 to run" in out
    assert [line.split(":")[0] for line in err.splitlines() if line.startswith("FAILED")] == [
        f"FAILED {root / 'lr1e30'}"
    ]
    assert [(root / n / "summary.json").stat().st_mtime_ns for n in RUNS[:2]] == before


# ----- the options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--launcher", "kube"], "unknown launcher 'kube'; valid choices: local, ray, slurm"),
        (["--address", "10.0.0.1:6379"], "--address goes with --launcher ray (the address of a Ray cluster)"),
        (["--slurm", "time=30"], "--slurm KEY=VALUE goes with --launcher slurm"),
        (
            ["--launcher", "slurm", "--slurm", "nodes=2"],
            "unknown --slurm key 'nodes'; valid choices: cluster, cpus, gpus, mem, partition, time",
        ),
        (["--launcher", "slurm", "--slurm", "time=1h"], "--slurm time= takes a whole number, got '1h'"),
        (["--launcher", "slurm", "--slurm", "mem=0"], "--slurm mem= must be above 0, got '0'"),
        (
            ["--launcher", "slurm", "--slurm", "cluster=aws"],
            "unknown --slurm cluster 'aws'; valid choices: local, slurm",
        ),
    ],
)
def test_launcher_options_are_checked_before_anything_runs(tmp_path, capsys, args, line):
    out = tmp_path / "runs"
    assert main(["sweep", "--config", str(_grid(tmp_path, out)), *args]) == 2
    assert capsys.readouterr().err == f"fedpcd: error: {line}\n"
    assert not out.exists()  # no index, no run folder


@requires["ray"]
def test_a_ray_address_where_nothing_answers_is_one_line(tmp_path, capsys):
    out = tmp_path / "runs"
    args = ["--launcher", "ray", "--address", "127.0.0.1:1"]  # a closed port on loopback: refused at once
    assert main(["sweep", "--config", str(_grid(tmp_path, out)), *args]) == 2
    assert capsys.readouterr().err == (
        "fedpcd: error: cannot reach the Ray cluster at 127.0.0.1:1: Connection refused; start one with `ray "
        "start --head` and give the address it prints, or leave --address out to start one for the sweep\n"
    )
    assert not out.exists()


@requires["submitit"]
def test_slurm_without_sbatch_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    assert main(["sweep", "--config", str(_grid(tmp_path, tmp_path / "runs")), "--launcher", "slurm"]) == 2
    assert capsys.readouterr().err == (
        "fedpcd: error: --launcher slurm: Slurm's sbatch and srun are not on the PATH (submit from a Slurm "
        "login node); --slurm cluster=local runs the jobs on this machine instead\n"
    )


@requires["submitit"]
def test_a_submission_slurm_refuses_stops_the_sweep_with_its_reason(tmp_path, capsys, monkeypatch):
    slurm = tmp_path / "bin"  # a Slurm that refuses every job
    slurm.mkdir()
    refuse = "echo 'sbatch: error: invalid partition specified: nope' >&2"
    for command, body in (("sbatch", refuse), ("srun", "")):
        (slurm / command).write_text(f"#!/bin/sh\n{body}\nexit 1\n")
        (slurm / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{slurm}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "runs"
    args = ["--launcher", "slurm", "--slurm", "partition=nope"]
    assert main(["sweep", "--config", str(_grid(tmp_path, out)), *args]) == 2
    assert capsys.readouterr().err == (
        "fedpcd: error: submitting a Slurm job failed: sbatch: error: invalid partition specified: nope\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["index.sqlite", "submitit"]  # no run started


@pytest.mark.parametrize(("launcher", "module"), [("ray", "ray"), ("slurm", "submitit")])
def test_a_missing_cluster_extra_is_one_line(tmp_path, capsys, monkeypatch, launcher, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    assert main(["sweep", "--config", str(_grid(tmp_path, tmp_path / "runs")), "--launcher", launcher]) == 2
    assert capsys.readouterr().err == (
        f"fedpcd: error: --launcher {launcher} needs {module}, which is not installed: "
        'pip install "fedpcd[cluster]"\n'
    )


def test_parse_slurm_by_hand():
    assert parse_slurm([]) == ("slurm", {"timeout_min": SLURM_TIME_MIN})
    items = ["partition=gpu", "time=120", "cpus=4", "mem=16", "gpus=1", "cluster=local"]
    assert parse_slurm(items) == (
        "local",
        {
            "slurm_partition": "gpu",
            "timeout_min": 120,
            "cpus_per_task": 4,
            "mem_gb": 16.0,
            "gpus_per_node": 1,
        },
    )


def test_eta_without_a_fixed_number_of_jobs_divides_by_the_runs_running(tmp_path):
    """Slurm's queue decides how many run at once: 2 of 6 done (10 s and 20 s), 4 left: ETA 4 * 15 s / the
    runs running now (at least 1). A run counts as running once its process holds its lock."""
    progress = Progress(total=6, done=0, todo=6, jobs=None)
    progress.end("a", "done", 10.0)
    progress.end("b", "done", 20.0)
    assert progress.line() == "sweep: 2/6 finished, 0 running; ETA 60 s"
    for seed in (0, 1, 2):
        progress.start(load_config(None, ["rounds=5", f"output_dir={tmp_path / f's{seed}'}"]))
    for seed in (0, 1):  # their processes hold their locks; s2 is still queued
        (tmp_path / f"s{seed}").mkdir()
        (tmp_path / f"s{seed}" / ".lock").write_text(str(os.getpid()))
    assert progress.line() == "sweep: 2/6 finished, 2 running (s0 round 0/5, s1 round 0/5); ETA 30 s"


# ----- end to end ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.procs
@requires["ray"]
def test_ray_sweep_on_a_running_cluster_matches_the_local_launcher(tmp_path, reference, monkeypatch):
    """A Ray cluster on 127.0.0.1 started here as the launcher starts one without --address (2 CPUs where
    the machine has them; stopped at the end); the sweep, a process of its own, joins it with --address."""
    import ray

    from fedpcd.launchers import RayLauncher
    from fedpcd.procs_guard import usable_cores

    root = tmp_path / "ray"
    command = [sys.executable, "-m", "fedpcd.cli", "sweep", "--config", str(_grid(tmp_path, root))]
    monkeypatch.setenv("FEDPCD_CORES", "2")
    cpus = usable_cores()  # 2 where the machine has them
    ray_files = Path(tempfile.mkdtemp(prefix="fedpcd-ray-", dir="/tmp"))  # short: Ray's sockets live there
    monkeypatch.setenv("RAY_TMPDIR", str(ray_files))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, ray_files, ignore_errors=True)
        head = cleanup.enter_context(RayLauncher(None, None))
        here = "a Ray cluster on this machine"
        assert head.describe() == f"sweep: runs on {here}, {cpus} at a time, 1 CPU each"
        address = ray.get_runtime_context().gcs_address

        def sweep() -> tuple[int, str, str]:
            proc = subprocess.run(
                [*command, "--launcher", "ray", "--address", address], capture_output=True, text=True
            )
            return proc.returncode, proc.stdout, proc.stderr

        code, out, err = sweep()
        assert code == 2, err
        assert f"sweep: runs on the Ray cluster at {address}, {cpus} at a time, 1 CPU each" in out
        _check_output(out, err, root, reference[1])
        _assert_same_sweep(reference[0], root)
        _rerun_skips_finished(root, sweep)
    assert not ray.is_initialized()


@pytest.mark.slow
@pytest.mark.procs
@requires["submitit"]
def test_slurm_sweep_through_submitit_local_matches_the_local_launcher(tmp_path, reference, capsys):
    """submitit's local executor (--slurm cluster=local): one job process per run, all at once."""
    root = tmp_path / "slurm"
    args = ["sweep", "--config", str(_grid(tmp_path, root)), "--launcher", "slurm"]

    def sweep() -> tuple[int, str, str]:
        code = main([*args, "--slurm", "cluster=local", "--slurm", "time=30"])
        return code, *capsys.readouterr()

    code, out, err = sweep()
    assert code == 2, err
    assert (
        "sweep: one submitit job per run as processes on this machine, all at once (job files and logs: "
        f"{root / 'submitit'})"
    ) in out
    _check_output(out, err, root, reference[1])
    _assert_same_sweep(reference[0], root)
    assert "DivergenceError" in "".join(p.read_text() for p in (root / "submitit").glob("*_log.err"))
    _rerun_skips_finished(root, sweep)

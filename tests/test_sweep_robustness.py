"""A sweep that holds up: no write through a link planted in its folder, its progress lines, a grid bounded
before it is built, its workers dying with it (SIGKILL, SIGTERM), and a dead worker's run retried once on a
fresh worker before it counts as failed."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import SRC, TINY, cli_main, install_plugin, one_error_line, run_records
from fedpcd.cli import main
from fedpcd.errors import UserError
from fedpcd.resolve import load_config
from fedpcd.sweep.grid import MAX_RUNS, expand_sweep

RUN = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=2"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("fedpcd: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``, links not followed: relative path -> bytes (None for a folder, the
    target for a link)."""
    out: dict[str, bytes | None] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(folder))] = os.readlink(p).encode()
        else:
            out[str(p.relative_to(folder))] = None if p.is_dir() else p.read_bytes()
    return out


def _sweep_file(tmp_path: Path, out: Path, seeds: int = 2, rounds: int = 1, **extra) -> Path:
    spec = {
        "dataset": {"name": "synthetic"},
        "model": {"name": "mlp", "hidden": 8},
        "clients": 2,
        "rounds": rounds,
        "output_dir": str(out),
        "sweep": {"seed": list(range(seeds))},
        **extra,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _foreign_db(path: Path) -> bytes:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE theirs (x)")
        db.execute("INSERT INTO theirs VALUES (1)")
    return path.read_bytes()


@pytest.mark.parametrize(
    "planted", ["index.sqlite", "dangling index.sqlite", "index.sqlite-journal", "seed1"]
)
def test_sweep_folder_links_are_refused_and_nothing_is_written_outside(tmp_path, capsys, planted):
    """A linked index.sqlite (to a foreign database), a dangling one, a linked journal and a linked run
    folder: one line naming the link, before any run; what they point to (or would create) is untouched."""
    out, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    name = planted.split()[-1]
    if planted == "index.sqlite":
        _foreign_db(elsewhere / "theirs.db")
        (out / name).symlink_to(elsewhere / "theirs.db")
    elif planted == "seed1":
        (out / name).symlink_to(elsewhere, target_is_directory=True)
    else:  # dangling: writing through it would create the file it names
        (out / name).symlink_to(elsewhere / "created-by-fedpcd")
    before, inside = _tree(elsewhere), _tree(out)
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out))]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: {out / name} is a symbolic link; fedpcd never writes through links in a run or "
        "sweep folder: replace it with the real file or folder, or set output_dir to a new folder"
    )
    assert _tree(elsewhere) == before and _tree(out) == inside  # no run, no index, nothing outside


def test_a_link_planted_after_the_sweep_started_is_not_followed(tmp_path):
    """The index is opened without following a link whenever it is written (not only at the start)."""
    from fedpcd.errors import UserError
    from fedpcd.sweep.grid import expand_sweep
    from fedpcd.sweep.index import write_index

    out, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    configs = expand_sweep(_sweep_file(tmp_path, out))
    elsewhere.mkdir()
    out.mkdir()
    (out / "index.sqlite").symlink_to(elsewhere / "new.db")
    with pytest.raises(UserError, match="index.sqlite is a symbolic link"):
        write_index(out / "index.sqlite", configs)
    assert list(elsewhere.iterdir()) == []
    (out / "index.sqlite").unlink()
    os.mkfifo(out / "index.sqlite")  # a FIFO would hang SQLite's open
    with pytest.raises(UserError, match="index.sqlite: it is not a regular file"):
        write_index(out / "index.sqlite", configs)


def test_sweep_prints_grid_progress_as_runs_end(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(["sweep", "--config", str(_sweep_file(tmp_path, out, seeds=3))]) == 0
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("sweep: ") and "finished," in line]
    assert [p.split(";")[0].split(" (")[0] for p in progress] == [
        "sweep: 1/3 finished, 0 running",
        "sweep: 2/3 finished, 0 running",
        "sweep: 3/3 finished, 0 running",
    ]
    assert "; ETA " in progress[0] and "; ETA " in progress[1] and "ETA" not in progress[2]
    assert lines[-1] == "sweep: all 3 runs finished"


def test_progress_line_counts_running_rounds_and_eta(tmp_path):
    """By hand: 2 of 5 done (10 s and 20 s), 1 failed, 2 left on 2 jobs: ETA 2 * 15 s / 2 = 15 s; a running
    run shows its last evaluated round from its metrics.jsonl."""
    from fedpcd.sweep.progress import Progress

    cfg = load_config(None, [*RUN, "rounds=7", f"output_dir={tmp_path / 'seed3'}"])
    (tmp_path / "seed3").mkdir()
    (tmp_path / "seed3" / "metrics.jsonl").write_text('{"round": 1}\n{"round": 4}\n{"rou')  # torn last line
    (tmp_path / "seed3" / ".lock").write_text(str(os.getpid()))  # its process holds the run's lock
    progress = Progress(total=5, done=0, todo=5, jobs=2)
    progress.end("a", "done", 10.0)
    progress.end("b", "done", 20.0)
    progress.end("c", "failed")
    progress.start(cfg)
    assert progress.line() == "sweep: 2/5 finished, 1 running, 1 failed (seed3 round 0/7); ETA 15 s"
    (tmp_path / "seed3" / "metrics.jsonl").write_text('{"round": 1}\n{"round": 4}\n')
    assert progress.line() == "sweep: 2/5 finished, 1 running, 1 failed (seed3 round 4/7); ETA 15 s"


def _children(pid: int) -> set[int]:
    """The pids of the live processes whose parent is ``pid`` (Linux /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_a_sweep_leaves_no_worker_behind(tmp_path):
    """`fedpcd sweep --jobs 2` killed with SIGKILL once both workers run: the workers (and the pool's
    resource tracker) end too, instead of running the queued runs on their own."""
    out = tmp_path / "runs"
    path = _sweep_file(tmp_path, out, seeds=6, rounds=200)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedpcd.cli", "sweep", "--jobs", "2", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(1200):  # the workers have taken their runs: two run folders are locked by them
            locks = [p.read_text().strip() for p in out.glob("*/.lock")] if out.exists() else []
            if len([pid for pid in locks if pid]) == 2:
                break
            assert proc.poll() is None, "the sweep ended before its workers started"
            time.sleep(0.1)
        else:
            raise AssertionError("the workers did not start their runs")
        family = _children(proc.pid)
        assert len(family) >= 2
        proc.kill()
        proc.wait()
        for _ in range(600):  # the kernel signals them at once; allow for a loaded machine
            if not any(_alive(pid) for pid in family):
                break
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in family)
    finally:  # whatever happened, nothing of this test's sweep (its own process group) keeps running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigterm_on_a_sweep_stops_its_workers_runs_at_once(tmp_path):
    """SIGTERM to `fedpcd sweep --jobs 2` (the sweep only, not its process group, as `kill PID` sends it)
    stops the runs its workers hold, as Ctrl-C does: exit 143, one line, no process left, each run
    unfinished with its lock released, and the same command resumes them. (Waiting for the runs to end
    instead, the sweep would exit only after 10000 rounds.)"""
    out = tmp_path / "grid"
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "dataset": {"name": "synthetic"}, "model": {"name": "mlp", "hidden": 8}, "clients": 2,
        "rounds": 10000, "engine": {"workers": 1}, "output_dir": str(out), "sweep": {"seed": [0, 1, 2]},
    }))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedpcd.cli", "sweep", "--quiet", "--config", str(sweep), "--jobs", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    started = [out / "seed0" / "metrics.jsonl", out / "seed1" / "metrics.jsonl"]
    try:
        for _ in range(3000):  # both workers' runs have done a round
            if all(m.exists() and m.read_text() for m in started):
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
        psutil.wait_procs(workers, timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143
    assert err == f"fedpcd: interrupted (resume with: fedpcd sweep --config {sweep})\n"
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    for seed in (0, 1):
        run = out / f"seed{seed}"
        assert not (run / "summary.json").exists() and (run / ".lock").read_text() == ""
    assert not (out / "seed2").exists()  # queued: never started
    listed = subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", "sweep", "--config", str(sweep), "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert listed == ["resume", str(out / "seed0"), "resume", str(out / "seed1"), "new", str(out / "seed2")]


def test_a_sweep_grid_over_the_limit_is_counted_and_refused_before_it_is_built(tmp_path):
    sweep = {"output_dir": str(tmp_path / "s"), "sweep": {f"a{i}": list(range(100)) for i in range(4)}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    start = time.monotonic()
    line = one_error_line(cli_main(["sweep", "--config", str(path), "--dry-run"]))
    assert time.monotonic() - start < 30  # 10^8 configs would take hours
    assert line == (
        f"fedpcd: error: the sweep in {path} has 100,000,000 runs (100 a0 x 100 a1 x 100 a2 x 100 a3), over "
        f"the limit of {MAX_RUNS:,}; split it into several sweep files"
    )


def test_a_sweep_grid_at_the_limit_is_not_refused_by_the_count(tmp_path, monkeypatch):
    import fedpcd.sweep.grid as sweep_grid

    monkeypatch.setattr(sweep_grid, "MAX_RUNS", 4)
    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path / "s"), "sweep": {"seed": [0, 1], "rounds": [1, 2]}})
    )
    assert len(expand_sweep(path, TINY)) == 4
    path.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path / "s"), "sweep": {"seed": [0, 1, 2], "rounds": [1, 2]}})
    )
    with pytest.raises(UserError, match=r"has 6 runs \(2 rounds x 3 seed\), over the limit of 4;"):
        expand_sweep(path, TINY)


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def _two_run_sweep(tmp_path: Path, rounds: int) -> Path:
    path = tmp_path / "sweep.yaml"
    base = {"output_dir": str(tmp_path / "s"), "rounds": rounds, "engine": {"checkpoint_every": 1}}
    path.write_text(yaml.safe_dump({**base, "sweep": {"seed": [0, 1]}}))
    return path


def test_a_sweep_worker_killed_mid_run_is_retried_on_a_fresh_worker(tmp_path):
    from fedpcd.flower import procs

    path = _two_run_sweep(tmp_path, rounds=30)
    env = {**os.environ, "PYTHONPATH": SRC}
    argv = [sys.executable, "-m", "fedpcd.cli", "sweep", "--config", str(path), "--jobs", "2", *TINY]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
    try:
        metrics = tmp_path / "s" / "seed0" / "metrics.jsonl"
        while proc.poll() is None and _lines(metrics) < 1:
            time.sleep(0.1)
        holder = int((tmp_path / "s" / "seed0" / ".lock").read_text())  # the worker running seed0
        assert holder in {p[0] for p in procs.descendants(proc.pid)}
        os.kill(holder, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert f"retry {tmp_path / 's' / 'seed0'}: its worker process died; once more" in stdout
    assert "Traceback" not in stderr and "sweep: all 2 runs finished" in stdout
    assert all((tmp_path / "s" / f"seed{i}" / "summary.json").is_file() for i in (0, 1))


_WORKER_ONLY_KILL = """
import multiprocessing, os, signal
if multiprocessing.parent_process() is not None:  # a sweep's worker process only
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_plugin_that_kills_every_worker_fails_its_runs_with_a_one_line_summary(tmp_path):
    site = tmp_path / "site"
    install_plugin(site, _WORKER_ONLY_KILL)
    path = _two_run_sweep(tmp_path, rounds=1)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{site}"}
    proc = subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", "sweep", "--config", str(path), "--jobs", "2", *TINY],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("its worker process died; once more") == 2
    failed = [line for line in proc.stderr.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 2 and all(
        line.endswith("(killed, or code in it ended the process)") for line in failed
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fedpcd: error: ")]
    assert len(errors) == 1 and errors[0].startswith("fedpcd: error: sweep: 2 of 2 runs failed, 0 finished")


def _configs(tmp_path: Path, runs: int, **extra: object) -> list:
    items = [f"{k}={v}" for k, v in extra.items()]
    return expand_sweep(_sweep_file(tmp_path, tmp_path / "grid", seeds=runs), items)


def test_jobs_auto_fills_the_cores_with_runs_each_taking_its_workers(tmp_path, monkeypatch):
    """`--jobs auto`: as many runs at once as the usable cores hold at each run's engine.workers (auto: 1),
    at most the runs to do; one for Flower runs (Ray takes the machine)."""
    from fedpcd.sweep.run import auto_jobs

    monkeypatch.setenv("FEDPCD_CORES", "8")
    cores = min(8, len(os.sched_getaffinity(0)))
    assert auto_jobs(_configs(tmp_path, 12)) == (cores, f"{cores} usable cores")
    assert auto_jobs(_configs(tmp_path, 3))[0] == min(3, cores)
    assert auto_jobs(_configs(tmp_path, 12, **{"engine.workers": 2}))[0] == max(1, cores // 2)
    flower = (1, "Flower runs: each takes the machine's cores")
    assert auto_jobs(_configs(tmp_path, 12, backend="flower")) == flower
    assert auto_jobs([]) == (1, "no runs to do")
    monkeypatch.setenv("FEDPCD_CORES", "1")
    assert auto_jobs(_configs(tmp_path, 12)) == (1, "1 usable core")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores")
def test_a_sweep_without_jobs_runs_side_by_side_as_one_process_would(tmp_path, capsys, monkeypatch):
    """`fedpcd sweep` without --jobs on 2 cores: its 3 runs go 2 at a time in worker processes, and give
    bitwise the metrics of the same grid run one after another in this process (--jobs 1)."""
    monkeypatch.setenv("FEDPCD_CORES", "2")
    auto, one = tmp_path / "auto", tmp_path / "one"
    for out, jobs in ((auto, []), (one, ["--jobs", "1"])):
        path = _sweep_file(tmp_path, out, seeds=3, rounds=2)
        assert main(["sweep", "--config", str(path), *jobs]) == 0
        text = capsys.readouterr().out
        line = "sweep: runs in 2 worker processes on this machine (--jobs auto: 2 usable cores)"
        assert (line in text) == (out == auto), text
    for seed in range(3):
        assert run_records(auto / f"seed{seed}") == run_records(one / f"seed{seed}")

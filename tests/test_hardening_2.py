"""Hardening, round 2: sweep folders never written through links, sweep workers die with their parent, the
sweep's progress lines, trackers that hold every step once after any kill, every OSError/MemoryError at the
CLI one line, checkpoints checked against the model's shapes, SIGTERM as Ctrl-C, YAML duplicate keys and
size limits, a resume that keeps hand-written files, and plugins that exit on import."""

from __future__ import annotations

import contextlib
import json
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

from fedpcd.cli import main

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


# ----- symbolic links in a sweep folder ---------------------------------------------------------------


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


# ----- a sweep's progress -----------------------------------------------------------------------------


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
    from fedpcd.config import load_config
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


# ----- sweep workers die with their parent ------------------------------------------------------------


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


# ----- trackers after a kill at each write ------------------------------------------------------------

_KILL_AT = """
import os, sys
import fedpcd.trackers as trackers
from fedpcd.cli import main
from fedpcd.engine.rundir import RunDir

point, argv = sys.argv[1], sys.argv[2:]
ROUND = 2


def kill(cls, name, when, hit):
    real = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        if when == "before" and hit(self, *args):
            os._exit(9)
        out = real(self, *args, **kwargs)
        if when == "after" and hit(self, *args):
            os._exit(9)
        return out

    setattr(cls, name, wrapped)


at_step = lambda self, step, *rest: step == ROUND
if point in ("csv", "tensorboard", "mlflow"):  # the logger wrote round 2; trackers.json still says 1
    cls = {"csv": trackers._Csv, "tensorboard": trackers._TensorBoard, "mlflow": trackers._MLflow}[point]
    kill(cls, "log", "after", at_step)
elif point == "trackers.json":  # every logger and trackers.json have round 2; the checkpoint has round 1
    last = lambda self: max(e["last_round"] for e in self._state.values())
    kill(trackers.Trackers, "_save", "after", lambda self: last(self) == ROUND)
elif point == "checkpoint":  # killed while writing round 2's checkpoint
    kill(RunDir, "save_checkpoint", "before", lambda self, state: state["round"] == ROUND)
if __name__ == "__main__":  # not in the engine's worker processes (spawned: they import this file)
    sys.exit(main(argv))
"""


@pytest.mark.parametrize("point", ["csv", "tensorboard", "mlflow", "trackers.json", "checkpoint"])
def test_trackers_hold_each_step_once_after_a_kill_at_each_write(tmp_path, point):
    """A run killed (os._exit, no cleanup) right after each tracker write of round 2, and before round 2's
    checkpoint: the resume continues from round 1 and metrics.csv, TensorBoard and MLflow hold rounds 1, 2
    and 3 once each, with the values of metrics.jsonl."""
    from fedpcd.run_format import RunFiles
    from test_trackers import csv_rows, mlflow_read, tensorboard_scalars

    out = tmp_path / "run"
    script = tmp_path / "kill_at.py"
    script.write_text(_KILL_AT)
    argv = ["run", "--quiet", *RUN, "rounds=3", "engine.workers=1", f"output_dir={out}"]
    argv.append("tracking.loggers=[csv,tensorboard,mlflow]")
    done = subprocess.run([sys.executable, str(script), point, *argv], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr[-2000:]
    run = RunFiles(out)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    accs = [(r["round"], r["global_acc"]) for r in records]
    assert [rnd for rnd, _ in accs] == [1, 2, 3]
    assert [(int(r["round"]), float(r["global_acc"])) for r in csv_rows(run)[1]] == accs
    assert tensorboard_scalars(run)["global_acc"] == [(s, pytest.approx(a, rel=1e-7)) for s, a in accs]
    run_id = json.loads(run.trackers.read_text())["mlflow"]["run_id"]
    assert mlflow_read(run, run_id, ["global_acc"])[3]["global_acc"] == accs


# ----- every OSError / MemoryError at the CLI: one line -----------------------------------------------

_FULL = (
    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: file write "
    "failed"
)


def test_disk_full_during_the_checkpoint_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    """torch's zip writer reports the short write of a full disk as a RuntimeError: one line naming the
    checkpoint file; no temp file left, round 1's metrics kept; a resume after space is freed finishes."""
    import torch

    import fedpcd.engine.rundir as rundir

    real_save = torch.save

    def full(obj, fh, *args, **kwargs):
        if isinstance(obj, dict) and "client_states" in obj:  # the checkpoint, not a client state
            fh.write(b"PK\x03\x04 partial")
            raise RuntimeError(_FULL)
        return real_save(obj, fh, *args, **kwargs)

    class NoSpace:
        f_bavail, f_frsize = 12, 4096

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(rundir.os, "fstatvfs", lambda fd: NoSpace)
    out = tmp_path / "run"
    assert main(["run", "--quiet", *RUN, "rounds=2", "engine.workers=1", f"output_dir={out}"]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: cannot write {out}/checkpoint/state.pt: No space left on device"
    )
    assert os.listdir(out / "checkpoint") == []
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert (out / "summary.json").exists()


def test_a_torch_error_that_is_no_write_failure_is_left_as_it_is(tmp_path, monkeypatch):
    import torch

    from fedpcd.engine.rundir import save_tensors

    monkeypatch.setattr(torch, "save", lambda obj, fh: (_ for _ in ()).throw(RuntimeError("a bug")))
    with open(tmp_path / "x", "wb") as fh, pytest.raises(RuntimeError, match="a bug"):
        save_tensors({}, fh)


def test_permission_denied_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys):
    """As root a mode-000 folder is readable: the PermissionError it gives other users is injected."""
    import errno

    from fedpcd.engine.rundir import RunDir

    out = tmp_path / "locked" / "run"

    def denied(self, config=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(self.path))

    monkeypatch.setattr(RunDir, "check_new", denied)
    assert main(["run", "--quiet", *RUN, "rounds=1", f"output_dir={out}"]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: cannot access {out}: Permission denied; give this user access to it, or choose "
        "another path"
    )


def test_a_name_over_255_bytes_is_one_line(tmp_path, capsys):
    out = tmp_path / ("é" * 130) / "run"  # 260 bytes in UTF-8
    assert main(["run", "--quiet", *RUN, "rounds=1", f"output_dir={out}"]) == 2
    err = _error_line(capsys)
    assert "File name too long" in err and "a name in the path is over 255 bytes" in err
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    import fedpcd.engine

    def exhausted(config, progress=True):
        raise MemoryError

    monkeypatch.setattr(fedpcd.engine, "run_experiment", exhausted)
    assert main(["run", "--quiet", *RUN, f"output_dir={tmp_path / 'run'}"]) == 2
    assert _error_line(capsys).startswith(
        "fedpcd: error: out of memory; free memory, or make the run smaller"
    )


def test_sigterm_on_a_local_run_is_like_ctrl_c(tmp_path):
    """The message with the resume command, exit code 143, and the .lock released (emptied)."""
    out = tmp_path / "run"
    argv = ["run", "--quiet", *RUN, "rounds=500", "engine.workers=1", f"output_dir={out}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedpcd.cli", *argv], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        for _ in range(1200):  # a round is done: the run holds its lock and runs
            if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text():
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143
    assert err == f"fedpcd: interrupted (resume with: fedpcd run --resume {out})\n"
    assert (out / ".lock").read_text() == ""


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


# ----- checkpoints checked against the model's shapes -------------------------------------------------


def test_a_server_tensor_of_the_wrong_shape_is_refused_with_one_line():
    import torch

    from fedpcd.engine.checkpoint import check_server_state
    from fedpcd.errors import UserError

    reference = {"model": {"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}, "round_lr": 0.1}
    fits = {"model": {"fc.weight": torch.ones(3, 4), "fc.bias": torch.ones(3)}, "extra": [torch.ones(2)]}
    check_server_state(fits, reference, "ckpt")  # more than the reference: state added in later rounds
    wrong = {"model": {"fc.weight": torch.ones(4, 3), "fc.bias": torch.ones(3)}}
    with pytest.raises(UserError) as exc:
        check_server_state(wrong, reference, "ckpt")
    assert str(exc.value) == (
        "ckpt: the checkpoint's server tensor model.fc.weight is [4, 3] torch.float32, but the run's model "
        "needs [3, 4] torch.float32; it is not this run's checkpoint: delete the checkpoint folder to "
        "restart the run"
    )
    with pytest.raises(UserError, match="has no tensor model.fc.bias, which the run's model needs"):
        check_server_state({"model": {"fc.weight": torch.ones(3, 4)}}, reference, "ckpt")
    with pytest.raises(UserError, match=r"model.fc.bias is \[3\] torch.float64"):
        check_server_state({"model": {**fits["model"], "fc.bias": torch.ones(3).double()}}, reference, "c")


# ----- configs: duplicate keys, size bounds -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("seed: 1\nrounds: 2\nseed: 3\n", "gives the key 'seed' twice (lines 1 and 3); keep one of them"),
        ("partition: {scheme: iid, scheme: dirichlet}\n", "gives the key 'scheme' twice (line 1)"),
        ("seed: [" + "1, " * 20_000 + "1]\n", "has a list or mapping of more than 10000 entries (line 1)"),
        ("seed: 1\n" + "#" * 300_000 + "\n", "is over 256 KiB; a config holds settings, not data"),
    ],
)
def test_yaml_duplicate_keys_and_sizes_are_refused(tmp_path, capsys, text, error):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["run", "--config", str(path)]) == 2
    assert _error_line(capsys).startswith(f"fedpcd: error: config file {path} {error}")


def test_an_override_with_a_duplicate_key_is_refused(capsys):
    assert main(["run", "partition={scheme: iid, scheme: dirichlet}"]) == 2
    assert _error_line(capsys) == (
        "fedpcd: error: override 'partition' gives the key 'scheme' twice (line 1); keep one of them"
    )


# ----- a resume keeps what it did not write -----------------------------------------------------------


def _hand_written(folder: Path) -> bytes:
    folder.mkdir()
    text = "# my experiment\ndataset: {name: synthetic}  # tiny\nmodel: {name: mlp, hidden: 8}\n"
    text += f"clients: 2\nrounds: 1\nengine: {{workers: 1}}\noutput_dir: {folder}\n"
    (folder / "config.yaml").write_text(text)
    return text.encode()


def test_resume_keeps_a_hand_written_config_yaml(tmp_path, capsys):
    out = tmp_path / "run"
    mine = _hand_written(out)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert (out / "config.yaml").read_bytes() == mine and (out / "summary.json").exists()


def test_resume_refuses_a_foreign_partition_json(tmp_path, capsys):
    out = tmp_path / "run"
    mine = _hand_written(out)
    (out / "partition.json").write_text('{"clients": [[0], [1]]}')
    assert main(["run", "--resume", str(out), "--quiet"]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning.startswith("fedpcd: warning: ") and "restarting it from round 0" in warning
    assert error.startswith(
        f"fedpcd: error: {out}/partition.json is not the one this run writes (another partition, or written "
        "by hand); fedpcd never overwrites files it did not write for this run"
    )
    assert (out / "partition.json").read_text() == '{"clients": [[0], [1]]}'
    assert (out / "config.yaml").read_bytes() == mine


# ----- plugins that exit on import --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "raised"),
    [("import sys\nsys.exit(0)", "SystemExit: 0"), ("raise BaseException('odd')", "BaseException: odd")],
)
def test_a_plugin_exiting_on_import_is_one_line_exit_2(tmp_path, monkeypatch, capsys, code, raised):
    from importlib.metadata import EntryPoint

    import fedpcd.registry
    from fedpcd.algorithms import ALGORITHMS

    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))
    monkeypatch.setattr(ALGORITHMS, "_plugins_loaded", False)
    monkeypatch.setattr(ALGORITHMS, "_plugin_error", None)
    module = f"fedpcd_test_exits_{abs(hash(code))}"
    (tmp_path / f"{module}.py").write_text(code + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = EntryPoint("exits", module, "fedpcd.algorithms")
    monkeypatch.setattr(
        fedpcd.registry, "entry_points", lambda group: [plugin] if group == "fedpcd.algorithms" else []
    )
    assert main(["run", "--quiet", *RUN, "rounds=1", f"output_dir={tmp_path / 'run'}"]) == 2
    assert _error_line(capsys) == (
        f"fedpcd: error: plugin 'exits' (fedpcd.algorithms = {module}) failed to load: {raised}"
    )
    assert not (tmp_path / "run").exists()
    sys.modules.pop(module, None)

"""Stopping a run: SIGTERM and every other terminal stop signal as Ctrl-C (one line, the lock released),
Ctrl-C on a Flower simulation (fedpcd's line only), a SIGKILL during start-up or at each tracker write (the
run restarts or resumes with every step once), and processes that end with their parent (procs_guard's
watch, pool workers that leave Ctrl-C to the sweep)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SRC, TINY, cli_main, one_error_line, start_cli
from fedpcd import cli, procs_guard
from fedpcd.cli import main
from fedpcd.errors import STOP_SIGNALS, Terminated, interrupt_behind
from fedpcd.procs_guard import exit_when_gone

RUN = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=2"]


_KILL_TRACKERS_AT = """
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
    script.write_text(_KILL_TRACKERS_AT)
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


_STOP_IN_CHECKPOINT = """
import os, signal, sys
from fedpcd.cli import main
from fedpcd.engine import rundir

save = rundir.save_tensors


class Cut:  # round 2's checkpoint file: a SIGHUP comes during torch's third write into it, as from kill -HUP
    def __init__(self, fh):
        self.fh, self.writes = fh, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            os.kill(os.getpid(), signal.SIGHUP)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)


round_2 = lambda obj: isinstance(obj, dict) and obj.get("round") == 2
rundir.save_tensors = lambda obj, fh: save(obj, Cut(fh) if round_2(obj) else fh)
sys.exit(main(sys.argv[1:]))
"""


def test_a_stop_signal_during_a_checkpoint_write_ends_the_run_as_the_signal_and_it_resumes(tmp_path):
    """torch's zip writer calls the file's write, and turns the stop signal raised there into a RuntimeError:
    such a run once ended as an I/O error (exit 2). It ends as the signal, and resumes from round 1's
    checkpoint with no temp file left."""
    out = tmp_path / "run"
    script = tmp_path / "stop_in_checkpoint.py"
    script.write_text(_STOP_IN_CHECKPOINT)
    argv = ["run", "--quiet", *RUN, "rounds=3", "engine.workers=1", "engine.checkpoint_every=1"]
    done = subprocess.run(
        [sys.executable, str(script), *argv, f"output_dir={out}"], capture_output=True, text=True
    )
    assert done.returncode == 128 + signal.SIGHUP, done.stderr[-2000:]
    assert done.stderr == f"fedpcd: interrupted (resume with: fedpcd run --resume {out})\n"
    assert (out / ".lock").read_text() == ""
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    assert not list(out.rglob("*.tmp"))


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


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_exit_when_gone_ends_this_process_with_status_0_once_the_other_ends():
    other = _sleeper()
    code = (
        "import sys, time; from fedpcd.procs_guard import exit_when_gone; "
        "exit_when_gone(int(sys.argv[1]), poll=0.05); print('watching', flush=True); time.sleep(300); "
        "sys.exit(3)"
    )
    watcher = subprocess.Popen(
        [sys.executable, "-c", code, str(other.pid)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout.readline() == "watching\n"
        assert watcher.poll() is None  # the other process still runs: so does this one
        other.kill()
        other.wait()
        assert watcher.wait(timeout=60) == 0
    finally:
        for p in (other, watcher):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_exit_when_gone_of_a_process_already_gone_exits_at_once():
    gone = _sleeper()
    gone.kill()
    gone.wait()
    code = (
        f"import time; from fedpcd.procs_guard import exit_when_gone; exit_when_gone({gone.pid}, poll=0.05); "
    )
    code += "time.sleep(300)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.slow
def test_the_flower_worker_exits_when_its_parent_pid_does():
    """``python -m fedpcd.flower.worker --parent-pid PID`` (what LoopbackDeployment starts) exits 0 once PID
    has ended, whatever it was doing (here: importing torch, or polling a SuperNode that is not there)."""
    pytest.importorskip("flwr")
    launcher = _sleeper()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedpcd.flower.worker",
            "--insecure",
            "--runtime-api-address",
            "127.0.0.1:9",
            "--parent-pid",
            str(launcher.pid),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(0.5)
        assert worker.poll() is None
        launcher.kill()
        launcher.wait()
        assert worker.wait(timeout=120) == 0, worker.stdout.read()
    finally:
        for p in (launcher, worker):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_exit_when_gone_and_die_with_parent_share_one_watch(monkeypatch):
    """Where the kernel has no parent-death signal, die_with_parent watches its parent with the thread that
    exit_when_gone uses (one mechanism), ending with status 1 (exit_when_gone: 0)."""
    calls = []
    monkeypatch.setattr(procs_guard, "_parent_death_signal", lambda: False)
    monkeypatch.setattr(
        procs_guard, "_watch", lambda holds, status, poll: calls.append((holds(), status, poll))
    )
    procs_guard.die_with_parent(os.getppid())
    exit_when_gone(os.getpid(), poll=0.25)
    assert calls == [(True, 1, procs_guard.POLL_S), (True, 0, 0.25)]


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_each_stop_signal_ends_a_run_with_one_line_its_lock_released(tmp_path, sig):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC}
    argv = ["run", "--quiet", *TINY, "rounds=100000", "engine.checkpoint_every=1", f"output_dir={out}"]
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedpcd.cli", *argv], stdout=subprocess.DEVNULL, stderr=err, env=env
        )
    try:
        while proc.poll() is None and not _lines(out / "metrics.jsonl"):
            time.sleep(0.1)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "err").read_text().splitlines() == [
        f"fedpcd: interrupted (resume with: fedpcd run --resume {out})"
    ]
    assert (out / ".lock").read_text() == ""  # released (a holder that dies leaves its pid there)


class _StoppedAfter(io.BytesIO):
    """A file whose reads and writes are cut by a SIGHUP after ``calls`` of them: torch's zip writer and
    reader call them, and turn the interrupt into a RuntimeError or SystemError (a stop signal during a
    checkpoint's write once ended a run as an I/O error, exit 2)."""

    def __init__(self, data: bytes = b"", calls: int = 2) -> None:
        super().__init__(data)
        self.calls = calls

    def _count(self) -> None:
        self.calls -= 1
        if self.calls < 0:
            raise Terminated(signal.SIGHUP)

    def write(self, data):
        self._count()
        return super().write(data)

    def readinto(self, buffer):
        self._count()
        return super().readinto(buffer)

    def read(self, size=-1):
        self._count()
        return super().read(size)


@pytest.mark.parametrize("calls", [0, 1, 2, 3, 5])
def test_a_stop_signal_while_torch_writes_or_reads_a_checkpoint_stays_a_stop(tmp_path, monkeypatch, calls):
    import torch

    from fedpcd.engine.checkpoint import load_weights_only
    from fedpcd.engine.rundir import save_tensors

    state = {"w": torch.arange(6.0), "b": torch.ones(2)}
    with pytest.raises(Terminated):
        save_tensors(state, _StoppedAfter(calls=calls))
    saved = io.BytesIO()
    torch.save(state, saved)
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda path, **kw: load(_StoppedAfter(saved.getvalue(), calls), **kw))
    with pytest.raises(Terminated):
        load_weights_only(tmp_path / "checkpoint.pt")


def test_a_library_error_that_stands_for_a_stop_signal_ends_the_command_as_the_signal(monkeypatch, capsys):
    def cut_write(args):
        try:
            raise Terminated(signal.SIGHUP)
        except Terminated:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 46 vs 0") from None

    monkeypatch.setitem(cli.HANDLERS, "list", cut_write)
    assert main(["list"]) == 128 + signal.SIGHUP
    assert capsys.readouterr().err == "fedpcd: interrupted\n"
    plain = RuntimeError("a bug")
    assert interrupt_behind(plain) is None
    plain.__context__ = plain  # a cycle ends the walk
    assert interrupt_behind(plain) is None


def test_a_run_started_with_sighup_ignored_outlives_it(tmp_path):
    """``nohup fedpcd run ...``: a command started with SIGHUP ignored keeps ignoring it (a closed terminal
    does not stop it), as Python keeps an ignored SIGINT; SIGTERM still stops it with its one line."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC}
    argv = ["run", "--quiet", *TINY, "rounds=100000", "engine.checkpoint_every=1", f"output_dir={out}"]
    ignore_hup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731 - as nohup does
    proc = start_cli(argv, tmp_path, env=env, preexec_fn=ignore_hup)
    try:
        while proc.poll() is None and not _lines(out / "metrics.jsonl"):
            time.sleep(0.1)
        proc.send_signal(signal.SIGHUP)
        seen = _lines(out / "metrics.jsonl")
        while proc.poll() is None and _lines(out / "metrics.jsonl") < seen + 2:
            time.sleep(0.1)
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, (tmp_path / "stderr.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "stderr.txt").read_text().splitlines() == [
        f"fedpcd: interrupted (resume with: fedpcd run --resume {out})"
    ]


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


_KILL_START_UP_AT = """
import os, signal, sys
import fedpcd.engine.run, fedpcd.utils
from fedpcd.cli import main
at = sys.argv[1]
if at == "data":  # while the data loads, before any run file is written
    fedpcd.engine.run.build_federation = lambda config: os.kill(os.getpid(), signal.SIGKILL)
else:  # between writing a run file's temp file and renaming it into place
    replace = os.replace
    def killing(src, dst):
        if str(dst).endswith(at):
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst)
    fedpcd.utils.os.replace = killing
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("at", ["data", "config.yaml", "partition.json"])
def test_a_run_killed_during_start_up_restarts_as_readme_says(tmp_path, at):
    ref, out = tmp_path / "ref", tmp_path / "out"
    argv = ["run", "--quiet", *TINY, "rounds=1"]
    assert cli_main([*argv, f"output_dir={ref}"]).returncode == 0
    env = {**os.environ, "PYTHONPATH": SRC}
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_START_UP_AT, at, *argv, f"output_dir={out}"],
        capture_output=True,
        env=env,
        timeout=180,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    if at == "partition.json":  # config.yaml is in place: the resume restarts it from round 0
        again = cli_main(["run", "--quiet", "--resume", str(out)])
    else:  # nothing to resume: the resume says so in one line, and the same command starts it again
        line = one_error_line(cli_main(["run", "--quiet", "--resume", str(out)]))
        assert line == (
            f"fedpcd: error: {out} was stopped before its run started (no config.yaml yet): start it again "
            "with the same fedpcd run command (same config and output_dir)"
        )
        again = cli_main([*argv, f"output_dir={out}"])
    assert again.returncode == 0, again.stderr
    assert _without_wall(out) == _without_wall(ref)
    assert not [p.name for p in out.rglob("*.tmp")]


def _without_wall(run: Path) -> list[dict[str, object]]:
    """A run's metrics.jsonl records without their wall times (the rest is bitwise reproducible)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in records]


def _sigint_blocked() -> bool:
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_pool_worker_starts_with_ctrl_c_blocked_and_this_process_keeps_its_handler():
    """Found by benchmarks/chaos.py: a terminal's Ctrl-C while a pool worker still imported torch printed its
    KeyboardInterrupt traceback. Workers started inside ``starting_children`` start with SIGINT blocked
    (their initializer then says what Ctrl-C does there and unblocks it)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from fedpcd.procs_guard import starting_children

    before = signal.getsignal(signal.SIGINT)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        with starting_children():
            future = pool.submit(_sigint_blocked)
        assert signal.getsignal(signal.SIGINT) is before and not _sigint_blocked()
        assert future.result(timeout=60) is True


def test_a_ctrl_c_while_a_worker_starts_is_answered_after_the_start():
    """Found by benchmarks/chaos.py (a SIGINT to a workers-auto run's process group, 12 s in): ``starting_
    children`` ignored Ctrl-C, so one that came while a pool started a worker was lost and the run went on to
    its end. Now it is held and raises KeyboardInterrupt as the block ends; the engine's worker initializer
    unblocks it in the worker (which ignores it: the round loop answers Ctrl-C)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from fedpcd.engine.federation import build_federation
    from fedpcd.engine.pool import _start_worker
    from fedpcd.launchers import _start_job
    from fedpcd.procs_guard import starting_children
    from fedpcd.resolve import load_config

    finished = []
    with pytest.raises(KeyboardInterrupt), starting_children():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # a Python handler would have run by now
        finished.append(True)
    assert finished == [True] and not _sigint_blocked()
    fed = build_federation(load_config(None, [*TINY, "clients=2"]))
    context = multiprocessing.get_context("spawn")
    # the engine's pool worker and the sweep's: each initializer unblocks Ctrl-C
    for start, args in ((_start_worker, (fed, os.getpid())), (_start_job, (os.getpid(), 1))):
        with ProcessPoolExecutor(1, mp_context=context, initializer=start, initargs=args) as pool:
            with starting_children():
                future = pool.submit(_sigint_blocked)
            assert future.result(timeout=120) is False, start.__name__


def test_a_stop_signal_while_a_worker_starts_waits_for_the_start_then_stops(tmp_path):
    """Found by benchmarks/chaos.py: SIGHUP while a pool started a worker cut the worker's start-up data
    short, and the worker died with an UnpicklingError traceback on the terminal. Inside
    ``starting_children`` a stop signal is held; it raises (Terminated) as the block ends."""
    from fedpcd.errors import Terminated
    from fedpcd.procs_guard import starting_children, stop_signals_raise

    previous = stop_signals_raise()
    finished = []
    try:
        with pytest.raises(Terminated) as stopped, starting_children():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)  # a Python handler would have run by now
            finished.append(True)
        assert stopped.value.signum == signal.SIGHUP and finished == [True]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ----- also seen: a pool worker left a zombie after it ended -----------------------------------------------


def test_no_worker_process_is_left_after_a_workers_2_run_returns_not_even_a_zombie(tmp_path):
    import psutil

    from fedpcd.backends import run_experiment
    from fedpcd.resolve import load_config

    config = load_config(None, [*TINY, "clients=4", "rounds=2", "engine.workers=2", f"output_dir={tmp_path}"])
    before = {child.pid for child in psutil.Process().children(recursive=True)}  # other tests' (xdist)
    run_experiment(config, progress=False)
    left = {}
    for child in psutil.Process().children(recursive=True):
        if child.pid in before:
            continue
        try:
            left[child.pid] = (child.status(), " ".join(child.cmdline()))
        except psutil.ZombieProcess:
            left[child.pid] = (psutil.STATUS_ZOMBIE, "")
        except psutil.NoSuchProcess:  # gone, and reaped
            continue
    # multiprocessing's resource tracker lives as long as this process; no worker, live or zombie, is left
    assert not [pid for pid, (_, cmd) in left.items() if "resource_tracker" not in cmd], left


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a report draws in one process on one core")
def test_ctrl_c_while_a_report_draws_its_figures_ends_it_with_one_line_and_no_process_left(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group) while `fedpcd report --out` draws the figures of
    seven settings in worker processes: the workers finish the figure each draws and end, the command says
    it was interrupted in one line (exit 130) and writes no report.md."""
    import psutil

    folder = Path(__file__).resolve().parents[1] / "docs/results/runs/leaderboard-fmnist-bn"
    out = tmp_path / "board.md"
    env = {**os.environ, "FEDPCD_CORES": "2"}  # the suite's processes keep to one core
    proc = start_cli(["report", str(folder), "--out", str(out)], tmp_path, env=env)
    seen: set[psutil.Process] = set()
    try:
        for _ in range(2400):  # a drawing worker runs
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
            seen |= set(psutil.Process(proc.pid).children(recursive=True))
            if any("spawn_main" in " ".join(p.cmdline()) for p in seen if p.is_running()):
                break
            time.sleep(0.05)
        time.sleep(1.0)  # drawing
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (tmp_path / "stderr.txt").read_text() == "fedpcd: interrupted\n"
    assert not out.exists()
    _, alive = psutil.wait_procs(list(seen), timeout=10)
    assert alive == []

"""Hardening, round 3: Ctrl-C on a Flower simulation prints fedpcd's line only (no Ray worker reports), a
run out of memory (``ulimit -v``) is one line, the run's config inside Flower messages is read with the config
file's limits, and the Flower worker's ``--parent-pid`` watch (procs_guard's, shared with the pool)."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpcd import procs_guard
from fedpcd.config_input import MAX_CONFIG_BYTES
from fedpcd.errors import UserError
from fedpcd.procs_guard import exit_when_gone, out_of_memory_line
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]
SMALLER_RUN = (
    "make the run smaller (fewer clients per round, a smaller local.batch_size or model, engine.workers=1, "
    "fewer sweep --jobs)"
)


def _cli(argv: list[str], out_dir: Path, **popen: object) -> subprocess.Popen:
    """``python -m fedpcd.cli ARGV`` in a new session, stdout and stderr to files in ``out_dir``."""
    with open(out_dir / "stdout.txt", "wb") as out, open(out_dir / "stderr.txt", "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "fedpcd.cli", *argv],
            stdout=out,
            stderr=err,
            start_new_session=True,
            **popen,
        )


# ----- Ctrl-C on a Flower simulation --------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_on_a_flower_simulation_prints_only_fedpcds_line(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group) in the middle of a Flower simulation: exit 130, the
    interrupt line and nothing else on either stream (Ray used to report each ClientApp stopped in the middle
    of a task as "(raylet) A worker died ... SYSTEM_ERROR"), no process of the run left."""
    pytest.importorskip("flwr")
    from fedpcd.flower import procs

    out = tmp_path / "run"
    for sub in ("flwr-home", "ray"):
        (tmp_path / sub).mkdir()
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "RAY_TMPDIR": str(tmp_path / "ray")}
    argv = ["run", "--quiet", "backend=flower", *SMALL, "clients=2", "rounds=500", f"output_dir={out}"]
    proc = _cli(argv, tmp_path, env=env)
    seen: set[procs.Proc] = set()
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        seen |= procs.descendants(proc.pid)
        time.sleep(0.2)
    seen |= procs.descendants(proc.pid)
    assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
    assert any("ClientAppActor" in _cmdline(p.pid) for p in seen)  # Ray ran the ClientApps
    os.killpg(proc.pid, signal.SIGINT)
    try:
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert stderr.splitlines() == [f"fedpcd: interrupted (resume with: fedpcd run --resume {out})"], stderr
    assert stdout == ""
    procs.wait_gone(seen, timeout=10.0)  # (the watchdog is released as the run ends: it may exit just after)
    assert not [p for p in seen if procs.alive(p)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ----- out of memory --------------------------------------------------------------------------------------


@pytest.fixture
def no_limit(monkeypatch):
    monkeypatch.setattr(procs_guard, "_address_space_limit", lambda: None)


@pytest.fixture
def limit_600_mib(monkeypatch):
    monkeypatch.setattr(procs_guard, "_address_space_limit", lambda: 600 * 2**20)


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised from ``inner`` (as numpy raises its ImportError from the extension's error)."""
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


NOT_MAPPED = ImportError("libtorch_cpu.so: failed to map segment from shared object")


def test_memory_errors_are_recognised_through_their_chain(no_limit):
    line = f"out of memory; free memory, or {SMALLER_RUN}"
    assert out_of_memory_line(MemoryError()) == line
    assert out_of_memory_line(OSError(errno.ENOMEM, "Cannot allocate memory")) == line
    assert out_of_memory_line(_chained(ImportError("numpy C-extensions failed"), MemoryError())) == line
    assert out_of_memory_line(_chained(RuntimeError("wrapped"), OSError(errno.ENOMEM, "x"))) == line
    torch_cpu = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    assert out_of_memory_line(torch_cpu) == line
    assert out_of_memory_line(ImportError("libc10.so: cannot allocate memory")) == line
    # not memory: other errors, other errnos, a library that cannot be mapped without a limit (noexec mount)
    for exc in (
        ValueError("cannot allocate memory"),
        OSError(errno.ENOSPC, "No space left on device"),
        ImportError("No module named 'torch'"),
        NOT_MAPPED,
        SystemError("error return without exception set"),
        _chained(RuntimeError("x"), KeyError("y")),
    ):
        assert out_of_memory_line(exc) is None, exc


def test_under_an_address_space_limit_the_line_names_it(limit_600_mib):
    line = (
        "out of memory: this process may use at most 600 MiB of address space (ulimit -v or -d); raise that "
        f"limit, or {SMALLER_RUN}"
    )
    assert out_of_memory_line(NOT_MAPPED) == line
    assert out_of_memory_line(
        SystemError("<function _find_and_load> returned NULL without setting an exception")
    )
    assert out_of_memory_line(MemoryError()) == line
    assert out_of_memory_line(ImportError("No module named 'torch'")) is None


@pytest.mark.slow
def test_the_address_space_limit_is_read_from_the_process():
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 40, resource.RLIM_INFINITY)); "
        "from fedpcd import procs_guard; print(procs_guard._address_space_limit())"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and hard < 1 << 40:
        pytest.skip("this process's hard address-space limit is below 1 TiB")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(1 << 40)


@pytest.mark.slow
def test_a_run_under_ulimit_v_too_small_for_torch_is_one_line(tmp_path):
    """``ulimit -v 358400`` (350 MiB): importing torch fails to map libtorch (an ImportError); the command
    says memory ran out and what the limit is, in one line, with exit code 2 (it used to be a traceback)."""
    limit = 350 * 2**20

    def small_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    out = tmp_path / "run"
    proc = _cli(
        ["run", "--quiet", *SMALL, "clients=2", "rounds=1", f"output_dir={out}"],
        tmp_path,
        preexec_fn=small_address_space,
    )
    assert proc.wait(timeout=300) == 2
    assert (tmp_path / "stderr.txt").read_text() == (
        "fedpcd: error: out of memory: this process may use at most 350 MiB of address space (ulimit -v or "
        f"-d); raise that limit, or {SMALLER_RUN}\n"
    )
    assert not out.exists()


# ----- the run's config inside Flower messages ----------------------------------------------------------


@pytest.fixture
def flower_message(monkeypatch):
    """A QUERY (discovery) message carrying ``text`` as the run's config, as the ServerApp sends it."""
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedpcd.flower.protocol import DISCOVER, TASK

    for attr, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, attr, value)

    def make(text: str):
        task = ConfigRecord({"action": DISCOVER, "config": text})
        msg = Message(RecordDict({TASK: task}), message_type=MessageType.QUERY, dst_node_id=1)
        msg.metadata.__dict__["_message_id"] = "m"
        return msg

    return make


def _discover_error(msg) -> UserError:
    """What the ServerApp makes of the ClientApp's error reply to ``msg`` (one node, partition 0)."""
    from flwr.app import Context, Message, RecordDict
    from flwr.app.error import Error

    from fedpcd.flower.client_app import app
    from fedpcd.flower.protocol import raise_for_error

    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    with pytest.raises(UserError) as raised:
        app(msg, context)
    ex = raised.value
    reply = Message(Error(code=0, reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg)  # as Flower's runtimes do
    with pytest.raises(UserError) as server_side:
        raise_for_error(reply, "node 1")
    return server_side.value


def test_the_config_in_a_message_is_read_with_the_config_file_limits(flower_message):
    from fedpcd.flower.protocol import config_from_text, config_text

    config = load_config(None, [*SMALL, "clients=2", "rounds=3"])
    text = config_text(config)
    assert config_from_text(text) == config  # the round trip still holds
    first = 1 + text.splitlines().index("rounds: 3")
    twice = text + "rounds: 300\n"
    assert str(_discover_error(flower_message(twice))) == (
        f"node 1: the run's config in this message gives the key 'rounds' twice (lines {first} and "
        f"{len(twice.splitlines())}); keep one of them"
    )
    oversized = text + "# " + "x" * MAX_CONFIG_BYTES + "\n"
    assert str(_discover_error(flower_message(oversized))) == (
        f"node 1: the run's config in this message is over {MAX_CONFIG_BYTES // 1024} KiB, the limit of a "
        "config file"
    )
    aliased = text.replace("name: synthetic", "name: &d synthetic", 1) + "extra: *d\n"
    with pytest.raises(UserError, match=r"^the run's config in this message uses the YAML alias \*d .*"):
        config_from_text(aliased)
    with pytest.raises(
        UserError, match=r"^the run's config in this message must hold a mapping of keys, got"
    ):
        config_from_text("- 1\n- 2\n")
    with pytest.raises(UserError, match=r"^the run's config in this message is not valid YAML$"):
        config_from_text("a: [1\n")


# ----- processes that end with another one ------------------------------------------------------------


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

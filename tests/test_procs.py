"""fedpcd.flower.procs and the watchdog's environment search on small process trees this test starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpcd.flower import procs, watchdog

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to cross-check")


@pytest.fixture
def spawn():
    """Start ``sh -c SCRIPT``; every process started is SIGKILLed and reaped at the end."""
    started: list[subprocess.Popen] = []

    def start(script: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        popen = subprocess.Popen(["sh", "-c", script], env=env, stdin=subprocess.DEVNULL)
        started.append(popen)
        return popen

    yield start
    for popen in started:
        procs.stop(procs.descendants(popen.pid) | {procs.identity(popen.pid) or (popen.pid, 0)}, 0)
        popen.wait()


def _until(get, ok=bool, timeout: float = 10.0):
    """``get()`` once ``ok`` of it holds (polled; fails after ``timeout`` s)."""
    end = time.monotonic() + timeout
    while not ok(value := get()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)
    return value


def _start_ticks(pid: int) -> float:
    """The start time in /proc/PID/stat (field 22, clock ticks after boot), in seconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[19]) / os.sysconf("SC_CLK_TCK")


def test_descendants_and_identity_of_a_tree(spawn):
    shell = spawn("sleep 30 & sleep 30 & wait")

    def comm(p) -> str:
        return Path(f"/proc/{p.pid}/comm").read_text().strip()

    # both forked and exec'd (a forked child is "sh" until its exec: a busy machine shows it)
    tree = _until(
        lambda: procs.descendants(shell.pid), lambda d: len(d) == 2 and {comm(p) for p in d} == {"sleep"}
    )
    mine = procs.descendants(os.getpid())
    assert tree < mine and procs.identity(shell.pid) in mine  # grandchildren too, not only children
    for proc in (*tree, procs.identity(shell.pid)):
        assert proc.started == pytest.approx(_start_ticks(proc.pid), abs=1e-9)  # the kernel's own number
        assert procs.identity(proc.pid) == proc and procs.alive(proc)  # stable over calls
    assert {comm(p) for p in tree} == {"sleep"}


def test_stop_terminates_then_kills(spawn):
    polite = spawn("sleep 30 & wait")
    stubborn = spawn("trap '' TERM; exec sleep 30")  # sleep inherits the ignored SIGTERM
    tree = _until(lambda: procs.descendants(polite.pid)) | {procs.identity(polite.pid)}
    # once it runs sleep: before its exec the shell may not have set the trap yet (a busy machine showed it)
    stubborn_id = _until(
        lambda: procs.identity(stubborn.pid),
        lambda p: p is not None and Path(f"/proc/{p.pid}/comm").read_text().strip() == "sleep",
    )
    t0 = time.monotonic()
    assert procs.stop(tree, timeout=20.0) == []
    assert time.monotonic() - t0 < 10.0  # SIGTERM was enough: no waiting for the timeout
    assert not [p for p in tree if procs.alive(p)]
    polite.wait(timeout=5)  # (its exit status depends on whether sleep or sh got SIGTERM first)
    t0 = time.monotonic()
    assert procs.stop([stubborn_id], timeout=0.5) == []
    assert time.monotonic() - t0 >= 0.5  # it waited out the SIGTERM, then SIGKILLed
    assert stubborn.wait(timeout=5) == -9


def test_a_recycled_pid_is_not_signalled(spawn):
    victim = spawn("exec sleep 30")
    real = _until(lambda: procs.identity(victim.pid))
    recycled = procs.Proc(real.pid, real.started - 1.0)  # what a recorded, long-gone process left behind
    assert not procs.alive(recycled)
    assert procs.stop([recycled], timeout=0.1) == []
    assert procs.wait_gone([recycled], timeout=0) == []
    assert procs.alive(real) and victim.poll() is None  # the process now holding the pid was left alone


def test_a_zombie_counts_as_gone(spawn):
    quick = spawn("exit 3")
    _until(lambda: Path(f"/proc/{quick.pid}/stat").read_text().split(") ")[1][0] == "Z")  # exited, unreaped
    assert procs.identity(quick.pid) is None
    assert quick.pid not in {p.pid for p in procs.descendants(os.getpid())}
    assert quick.wait(timeout=1) == 3  # stop() and the others left it to be reaped by its parent


def test_watchdog_finds_processes_by_environment_mark(spawn, tmp_path):
    mark = str(tmp_path / "ray-tmp")
    marked = spawn("exec sleep 30", env={**os.environ, "RAY_TMPDIR": mark})
    other = spawn("exec sleep 30")
    marked_id = _until(lambda: procs.identity(marked.pid))
    _until(lambda: procs.identity(other.pid))
    found = _until(lambda: watchdog.with_env_mark(mark))
    assert found == {marked_id}  # not the unmarked sibling, nor this process (whose environment lacks it)

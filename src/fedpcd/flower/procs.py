"""Processes by id: find the ones a run started, stop them, check they are gone (on psutil).

A process is identified by ``(pid, start time)`` so that a recycled pid is never signalled by mistake.
Zombies (exited, not yet reaped by their parent) count as gone.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterable
from typing import NamedTuple

import psutil


class Proc(NamedTuple):
    """A process's identity: its pid and when it started (seconds after boot, to the clock tick)."""

    pid: int
    started: float


def _identity(p: psutil.Process) -> Proc | None:
    """``p``'s identity, or None if it is gone or a zombie.

    The start time is psutil's ``create_time`` less the boot time: the kernel's start time in clock ticks,
    which (unlike ``create_time`` alone) a change of the system clock does not move.
    """
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return Proc(p.pid, round(p.create_time() - psutil.boot_time(), 2))
    except psutil.NoSuchProcess:
        return None


def _live(proc: Proc) -> psutil.Process | None:
    """The psutil handle of this very process (same pid and start time) if it still runs, else None."""
    try:
        p = psutil.Process(proc[0])
    except psutil.NoSuchProcess:
        return None
    return p if _identity(p) == tuple(proc) else None


def identity(pid: int) -> Proc | None:
    """``(pid, start time)`` of a running process, or None."""
    try:
        return _identity(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return None


def descendants(pid: int) -> set[Proc]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), zombies excluded."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    return {ident for ident in map(_identity, children) if ident is not None}


def alive(proc: Proc) -> bool:
    """Whether this very process (same pid and start time) still runs (zombies count as gone)."""
    return _live(proc) is not None


def _signal(procs: Iterable[Proc], sig: int) -> None:
    for proc in procs:
        p = _live(proc)
        if p is not None:
            with contextlib.suppress(psutil.NoSuchProcess):  # psutil re-checks the start time first
                p.send_signal(sig)


def stop(procs: Iterable[Proc], timeout: float = 10.0) -> list[Proc]:
    """SIGTERM each process, wait up to ``timeout`` s, SIGKILL the rest; returns those still alive after."""
    running = [p for p in procs if alive(p)]
    _signal(running, signal.SIGTERM)
    left = wait_gone(running, timeout)
    _signal(left, signal.SIGKILL)
    return wait_gone(left, 5.0)


def wait_gone(procs: Iterable[Proc], timeout: float) -> list[Proc]:
    """Wait up to ``timeout`` s for the processes to exit on their own; returns those still alive.

    A polling loop rather than ``psutil.wait_procs``, which waits out the timeout on a zombie whose parent
    has not reaped it yet.
    """
    left = list(procs)
    end = time.monotonic() + timeout
    while True:
        left = [p for p in left if alive(p)]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.05)

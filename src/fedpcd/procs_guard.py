"""Guards of a fedpcd process: child processes that end with their parent, and the one line for a process
that ran out of memory.

A worker started by ``fedpcd sweep --jobs N`` calls :func:`die_with_parent` first (the pool's initializer):
on Linux the kernel sends it SIGKILL when its parent ends, however it ends (``kill -9`` included:
``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread polls the parent's pid and ends the worker once it
changed. Either way a killed sweep leaves no worker running queued runs, and once the workers are gone the
pool's resource tracker (which exits when the last holder of its pipe does) goes too. A process told the pid
of another one to end with (the Flower worker's ``--parent-pid``) polls it with the same thread:
:func:`exit_when_gone`.

:func:`out_of_memory_line` tells a failure for lack of memory (a MemoryError, an OSError ENOMEM, a shared
library such as torch's that could not be mapped under ``ulimit -v``) from other errors, so that the command
line says so in one line instead of a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fedpcd.errors import STOP_SIGNALS, Terminated

try:  # at import, not when memory has run out (it is a shared library)
    import resource
except ImportError:  # not on Unix
    resource = None  # type: ignore[assignment]

CORES_VAR = "FEDPCD_CORES"  # caps the cores a run's ``engine.workers: auto`` uses (a sweep's share per run)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0  # the watchdog's polling interval where there is no parent-death signal


def usable_cores() -> int:
    """Cores this process may run on, capped by ``FEDPCD_CORES`` when set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    cap = os.environ.get(CORES_VAR, "")
    return max(1, min(cores, int(cap))) if cap.isdigit() else cores


@contextlib.contextmanager
def starting_children() -> Iterator[None]:
    """The block starts processes (a pool's ``submit``): the stop signals, Ctrl-C among them, wait for its
    end and are then handled as usual (raised inside it, they would cut a child's start-up data short, and
    the child would die with an UnpicklingError traceback on the terminal). SIGINT is also blocked in this
    thread meanwhile, so a spawned child starts with it blocked (the mask survives fork and exec): a
    terminal's Ctrl-C while it imports torch stays pending there, and prints no traceback, until its
    initializer has said what Ctrl-C does there (:func:`unblock_ctrl_c`). Ignoring SIGINT instead lost a
    Ctrl-C that came during the block (found by benchmarks/chaos.py: the run went on to its end). Main
    thread only (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started later, it would unblock SIGINT in this thread
    held: list[int] = []
    catch = [sig for sig in not_ignored((signal.SIGINT, *STOP_SIGNALS)) if signal.getsignal(sig) is not None]
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in catch}
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending Ctrl-C is answered now
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


def unblock_ctrl_c(handler: Any) -> None:
    """In a child started by :func:`starting_children`: SIGINT's ``handler`` from now on, then SIGINT
    unblocked; a Ctrl-C that came during the start is dropped (it reached this process's parent too, which
    answers it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # drops a pending SIGINT
    signal.signal(signal.SIGINT, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def not_ignored(signals: Iterable[int]) -> list[int]:
    """Those of ``signals`` this process does not ignore: a command started with a signal ignored keeps
    ignoring it, as Python keeps an ignored SIGINT (``nohup fedpcd run ...`` outlives a closed terminal)."""
    return [sig for sig in signals if signal.getsignal(sig) != signal.SIG_IGN]


def stop_signals_raise() -> dict[int, Any]:
    """Make each of ``STOP_SIGNALS`` (SIGTERM, SIGHUP, SIGQUIT) raise :class:`Terminated` in the main thread,
    as Ctrl-C raises KeyboardInterrupt, but those ignored (:func:`not_ignored`); returns the handlers it
    replaced (to put back)."""

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    return {sig: signal.signal(sig, terminate) for sig in not_ignored(STOP_SIGNALS)}


def _parent_death_signal() -> bool:
    """Ask the kernel for SIGKILL when the parent ends (Linux); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here: the command line imports this module at start, before it needs ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(holds: Callable[[], bool], status: int, poll: float) -> None:
    """End this process with exit ``status`` once ``holds()`` is false, as a daemon thread checks every
    ``poll`` seconds."""

    def loop() -> None:
        while holds():
            time.sleep(poll)
        os._exit(status)

    threading.Thread(target=loop, name="fedpcd-parent-watch", daemon=True).start()


def die_with_parent(parent: int) -> None:
    """Make this process end when its parent (pid ``parent``, as the parent saw itself) ends; a parent that
    is already gone ends it at once."""
    if not _parent_death_signal():
        _watch(lambda: os.getppid() == parent, 1, POLL_S)  # re-parented: the parent died
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return True


def exit_when_gone(pid: int, poll: float = 0.5) -> None:
    """Exit (status 0) once process ``pid`` (any process, not only this one's parent) has ended, as a daemon
    thread finds every ``poll`` seconds; one that is already gone ends this process within ``poll``."""
    _watch(lambda: _exists(pid), 0, poll)


_LIBRARY_NOT_MAPPED = "failed to map segment from shared object"  # dlopen's mmap failed (ENOMEM or EPERM)
_NO_MEMORY_TEXTS = ("cannot allocate memory", "can't allocate memory")  # strerror(ENOMEM); torch's allocator
_SMALLER_RUN = (
    "make the run smaller (fewer clients per round, a smaller local.batch_size or model, engine.workers=1, "
    "fewer sweep --jobs)"
)


def _address_space_limit() -> int | None:
    """The lower of this process's address-space and data limits (``ulimit -v``, ``-d``) in bytes, or None."""
    if resource is None:
        return None
    limits = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA)]
    finite = [lim for lim in limits if lim != resource.RLIM_INFINITY]
    return min(finite) if finite else None


_SHARED_FILE = (
    "unable to resize file"  # torch: a tensor's shared-memory file could not grow (/dev/shm, ulimit -f)
)


def _lack_of_memory(exc: BaseException, limited: bool) -> bool:
    """Whether this one exception says memory ran out (under an address-space limit if ``limited``)."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    if not isinstance(exc, (ImportError, RuntimeError, SystemError)):
        return False
    text = str(exc).lower()
    if any(t in text for t in _NO_MEMORY_TEXTS) or _SHARED_FILE in text:
        return True
    # without a limit, a library that cannot be mapped is more likely on a noexec mount; an import that
    # fails without an exception (SystemError) is CPython's allocator failing inside the import machinery
    return limited and (_LIBRARY_NOT_MAPPED in text or isinstance(exc, SystemError))


def out_of_memory_line(exc: BaseException) -> str | None:
    """One line saying memory ran out when ``exc`` or an exception it came from (``__cause__``,
    ``__context__``) means so, else None: a MemoryError, an OSError ENOMEM, an ImportError of a shared
    library that could not be mapped into memory, torch's "can't allocate memory"."""
    limit = _address_space_limit()
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if _lack_of_memory(current, limit is not None):
            break
        todo += [current.__cause__, current.__context__]
    else:
        return None
    if isinstance(current, RuntimeError) and _SHARED_FILE in str(current):
        return (
            "out of shared memory: tensors sent to worker processes did not fit in /dev/shm (full, or over "
            f"the file size limit, ulimit -f); free space there, or {_SMALLER_RUN}"
        )
    if limit is None:
        return f"out of memory; free memory, or {_SMALLER_RUN}"
    return (
        f"out of memory: this process may use at most {limit / 2**20:.0f} MiB of address space (ulimit -v or "
        f"-d); raise that limit, or {_SMALLER_RUN}"
    )

"""Child processes that die with their parent (a sweep's pool workers, a run's worker pool).

A worker started by ``fedpcd sweep --jobs N`` calls :func:`die_with_parent` first (the pool's initializer):
on Linux the kernel sends it SIGKILL when its parent ends, however it ends (``kill -9`` included:
``prctl(PR_SET_PDEATHSIG)``); elsewhere a daemon thread polls the parent's pid and ends the worker once it
changed. Either way a killed sweep leaves no worker running queued runs, and once the workers are gone the
pool's resource tracker (which exits when the last holder of its pipe does) goes too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0  # the watchdog's polling interval where there is no parent-death signal


def _parent_death_signal() -> bool:
    """Ask the kernel for SIGKILL when the parent ends (Linux); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    """End this process once its parent is no longer ``parent`` (it died: the child was re-parented)."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


def die_with_parent(parent: int) -> None:
    """Make this process end when its parent (pid ``parent``, as the parent saw itself) ends; a parent that
    is already gone ends it at once."""
    if not _parent_death_signal():
        threading.Thread(target=_watch, args=(parent,), name="fedpcd-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

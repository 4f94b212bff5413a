"""A watchdog that stops what a Flower simulation started when its process dies without cleaning up.

``run_flower`` stops Ray's processes itself when the run ends, fails or is interrupted (Ctrl-C, SIGTERM).
Only a SIGKILL (or a crash of the interpreter) skips that, and Ray then leaves some of its processes
(the dashboard and runtime-env agents) running and listening. This watchdog is started first, as a child
of the run's process, with a pipe on its stdin:

- while the run lives, it records (pid, start time) of every process descended from it, once a second;
- when the run writes ``done`` (it cleaned up itself) the watchdog exits;
- when the pipe closes without ``done`` (the run died), it stops every recorded process still alive and
  every process whose environment names the run's temporary directory (Ray's RAY_TMPDIR), then removes
  that directory.

It ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group; the run handles it).
Usage: ``python -m fedpcd.flower.watchdog PARENT_PID TEMP_DIR``.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from fedpcd.flower import procs

DONE = b"done\n"


def with_env_mark(mark: str) -> set[procs.Proc]:
    """Live processes (this one excluded) whose environment mentions ``mark`` (the run's temporary dir)."""
    found: set[procs.Proc] = set()
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # gone, a zombie, or another user's
            if p.pid != os.getpid() and any(mark in value for value in p.environ().values()):
                ident = procs.identity(p.pid)
                if ident is not None:
                    found.add(ident)
    return found


def watch(parent: int, temp_dir: str, interval: float = 1.0) -> int:
    """Watch ``parent`` through stdin (see the module doc); returns the number of processes stopped."""
    me = os.getpid()
    seen: set[procs.Proc] = set()
    buffer = b""
    while True:
        seen |= {p for p in procs.descendants(parent) if p[0] != me}
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], interval)
        if not ready:
            continue
        chunk = os.read(sys.stdin.fileno(), 1024)
        buffer += chunk
        if DONE in buffer:
            return 0
        if not chunk:  # EOF without "done": the run died
            break
    doomed = {p for p in seen | with_env_mark(temp_dir) if p[0] not in (me, parent) and procs.alive(p)}
    procs.stop(doomed, timeout=3.0)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return len(doomed)


def start(temp_dir: str | Path) -> subprocess.Popen[bytes]:
    """Start the watchdog for this process and ``temp_dir``; tell it ``done`` with :func:`release`."""
    return subprocess.Popen(
        [sys.executable, "-m", "fedpcd.flower.watchdog", str(os.getpid()), str(temp_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def release(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Tell the watchdog the run cleaned up after itself, and wait for it to exit."""
    with contextlib.suppress(OSError, ValueError):
        if proc.stdin is not None:
            proc.stdin.write(DONE)
            proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # pragma: no cover - the watchdog reads every second
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch(int(args[0]), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

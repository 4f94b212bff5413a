"""Small shared helpers: atomic file writes and seed derivation."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask (read without changing it for longer than two system calls)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so a rename inside it survives a power loss (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Any], None], mode: str = "w", fsync: bool = True) -> None:
    """Write through ``write(fileobj)`` into a temp file beside ``path``, fsync it, then rename it over
    ``path``: readers (and a process killed at any moment) see the old file or the new one, never a half.

    The file gets the usual permissions of a new file (0666 minus the umask), not mkstemp's 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as fh:
            write(fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda fh: fh.write(text), mode="w")


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client id, ...): stable across processes and backends."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1

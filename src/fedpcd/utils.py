"""Small shared helpers: atomic file writes, user-path errors, JSON reading and seed derivation."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedpcd.errors import UserError, clip

_UMASK_LOCK = threading.Lock()
MAX_JSON_DEPTH = 32  # nesting levels of a JSON file fedpcd reads (its own files need fewer than 5)
MAX_READ_BYTES = 1024**3  # the largest file fedpcd reads whole (a partition, a summary, metrics, a LEAF file)
_KINDS = {  # what a path that is not a regular file is, for the one-line refusal
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


def show_path(path: str | Path) -> str:
    """A path for a one-line message: as it is, or escaped (``repr``) where it holds characters that are
    not printable (a newline, NUL, right-to-left override, zero-width space, undecodable bytes)."""
    text = os.fspath(path)
    text = text if isinstance(text, str) else os.fsdecode(text)
    return text if text.isprintable() else repr(text)


def show_text(text: object) -> str:
    """Text for the terminal, every character that is not printable escaped (an ESC sequence, a newline, a
    carriage return, a right-to-left override show as ``\\x1b``, ``\\n``, ``\\r``, ``\\u202e``): what fedpcd
    prints of a user's text (a path, a name, an error line) can neither drive the terminal nor fake a line."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def path_error(path: str | Path, exc: OSError | ValueError, action: str = "write") -> UserError:
    """The one line for a failed operation on a user's path: ``cannot ACTION PATH: CAUSE``, the cause being
    the system's words (No space left on device, Permission denied, Is a directory, ...)."""
    if isinstance(exc, OSError):
        cause = exc.strerror or str(exc)
    elif "null" in str(exc):  # open() and mkdir() refuse a path with a NUL byte
        cause = "the path holds a NUL byte"
    else:
        cause = clip(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return UserError(f"cannot {action} {show_path(path)}: {cause}")


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists but is not a folder (None if there is none)."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return None if candidate.is_dir() else candidate
        except (OSError, ValueError):
            return None
    return None


def make_folder(folder: str | Path, target: str | Path | None = None) -> None:
    """``mkdir -p folder``; a failure is one line naming ``target`` (default: the folder) and the cause, e.g.
    a file where a folder should be."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        action = "write" if target is not None else "create the folder"
        blocker = _file_in_the_way(folder) if isinstance(exc, OSError) else None
        if blocker is not None:
            raise UserError(
                f"cannot {action} {show_path(target or folder)}: {show_path(blocker)} is a file, not a folder"
            ) from None
        raise path_error(target or folder, exc, action) from None


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

    The file gets the usual permissions of a new file (0666 minus the umask), not mkstemp's 0600. Missing
    folders are created. Any OSError (a full disk, no permission, a folder at ``path`` or a file where a
    folder should be) is a :class:`UserError` of one line naming ``path`` and the cause (:func:`path_error`);
    ``path`` then keeps its old content and no temp file is left.
    """
    path = Path(path)
    make_folder(path.parent, target=path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except (OSError, ValueError) as exc:
        raise path_error(path, exc) from None
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as fh:
            write(fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise path_error(path, exc) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda fh: fh.write(text), mode="w")


def check_writable(path: str | Path, folder: bool = False) -> None:
    """Refuse early (before any work) a target that cannot be written: a file (``folder``) or a folder
    (a file target) already at ``path``, or a file where one of its folders should be. Other causes (no
    space, no permission) show when the write happens."""
    path = Path(path)
    try:
        wrong = path.exists() and path.is_dir() != folder
    except (OSError, ValueError) as exc:
        raise path_error(path, exc) from None
    if wrong:
        what = "a file" if folder else "a folder"
        raise UserError(f"cannot write {show_path(path)}: it is {what}; name a new path or remove it")
    blocker = _file_in_the_way(path.parent)
    if blocker is not None:
        raise UserError(f"cannot write {show_path(path)}: {show_path(blocker)} is a file, not a folder")


def refuse_link(path: str | Path) -> None:
    """A UserError if ``path`` is a symbolic link: fedpcd never writes through one in a run or sweep
    folder."""
    if os.path.islink(path):
        raise UserError(
            f"{path} is a symbolic link; fedpcd never writes through links in a run or sweep folder: replace "
            "it with the real file or folder, or set output_dir to a new folder"
        )


def _depth(data: Any) -> int:
    """Nesting depth of parsed JSON (0 for a scalar), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(text: str, where: str, max_depth: int = MAX_JSON_DEPTH, lines: bool = True) -> Any:
    """JSON text as data; invalid JSON, a number too long to read or nesting deeper than ``max_depth`` is a
    UserError of one line starting with ``where`` (e.g. 'summary file runs/a/summary.json'), invalid JSON
    with its line number unless ``lines`` is False (``where`` names the line)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        at = f" at line {exc.lineno}" if lines else ""
        raise UserError(f"{where} is not valid JSON{at}: {exc.msg}") from None
    except RecursionError:
        data, deep = None, True
    except ValueError:  # an integer of more digits than Python reads (4300 by default)
        limit = sys.get_int_max_str_digits()
        raise UserError(f"{where} holds an integer too long to read (over {limit} digits)") from None
    else:  # a text of fewer brackets than the bound cannot nest deeper: the walk is skipped
        deep = text.count("[") + text.count("{") > max_depth and _depth(data) > max_depth
    if deep:
        raise UserError(f"{where} is nested more than {max_depth} levels deep")
    return data


def read_user_bytes(
    path: str | Path, what: str = "file", limit: int = MAX_READ_BYTES, links: bool = True, hint: str = ""
) -> bytes:
    """A file a user hands in, read whole but bounded.

    Opened without blocking (a FIFO never waits for a writer) and refused unless it is a regular file (a FIFO,
    device, socket or folder is named by its kind) or when over ``limit`` bytes (checked from its size before
    reading, and again while reading a file that grows); with ``links=False`` a symbolic link at ``path`` is
    refused, never followed (run and sweep folders). Every failure is one line naming ``what`` and the path
    (``hint``: what to do about a file too large).
    """
    too_large = f"{what} {show_path(path)} is over {_size(limit)}{f'; {hint}' if hint else ''}"
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        if not links and os.path.islink(path):  # where O_NOFOLLOW is missing
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise UserError(f"{what} {show_path(path)} not found") from None
    except (OSError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ELOOP and not links:
            raise UserError(
                f"{what} {show_path(path)} is a symbolic link; fedpcd never follows links in a run or sweep "
                "folder: replace it with the real file"
            ) from None
        raise path_error(path, exc, f"read {what}") from None
    try:  # the kind and size are checked on the open file, before a byte is read
        info = os.fstat(fd)
        kind = stat.S_IFMT(info.st_mode)
        if kind != stat.S_IFREG:
            kind_name = _KINDS.get(kind, "not a regular file")
            raise UserError(f"{what} {show_path(path)} is {kind_name}; give a regular file")
        if info.st_size > limit:
            raise UserError(too_large)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise path_error(path, exc, f"read {what}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UserError(too_large)
    return data


def _size(n: int) -> str:
    """A byte count for a message: '3.1 GiB', '256 KiB', '12 bytes'."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def read_user_text(
    path: str | Path, what: str = "file", limit: int = MAX_READ_BYTES, links: bool = True, hint: str = ""
) -> str:
    """A user's text file (:func:`read_user_bytes`: bounded, a regular file); one line naming ``what`` and the
    path when it is missing, unreadable, too large, not a regular file or not UTF-8."""
    data = read_user_bytes(path, what, limit, links, hint)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {show_path(path)} is not UTF-8 text (byte {exc.start})") from None


def read_json(
    path: str | Path, what: str = "file", max_depth: int = MAX_JSON_DEPTH, links: bool = True
) -> Any:
    """The JSON data in a user's file; one line naming ``what`` and the path for a missing, unreadable,
    too large, non-UTF-8 or invalid file (see :func:`read_user_text`, :func:`parse_json`)."""
    return parse_json(read_user_text(path, what, links=links), f"{what} {show_path(path)}", max_depth)


@contextlib.contextmanager
def quiet(logger: logging.Logger) -> Iterator[None]:
    """``logger`` at WARNING for the block (a library's INFO chatter off)."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def text_table(rows: list[list[str]], header: list[str]) -> str:
    """A plain-text table: left-aligned columns under a header and a dashed rule."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    rule = ["-" * w for w in widths]
    return "\n".join([fmt.format(*header), fmt.format(*rule)] + [fmt.format(*r) for r in rows])


_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc|ref):`~?([^`]+)`")


def plain_text(text: str) -> str:
    """Docstring text without reST markup, as the command line and the generated docs show it: ``x`` and
    :func:`x` (any role) become `x` (Markdown's code), everything else is kept."""
    return _ROLE.sub(r"`\1`", text.replace("``", "`"))

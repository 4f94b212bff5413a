"""fedpcd's log: status lines on stderr and, while a run lasts, ``run.log`` in its run directory.

Every module logs through the ``fedpcd`` logger (``logging.getLogger("fedpcd")`` or a child such as
``fedpcd.engine``). Its stderr lines look like the command line's own: ``fedpcd: message``, with the level
named for warnings and errors (``fedpcd: warning: message``); they go through ``tqdm.write``, so a progress
bar on the terminal is redrawn below them rather than broken. :func:`setup` chooses how much reaches stderr
(the command line's verbosity; importing this module sets verbosity 0: info and up). :func:`run_log` adds
the run directory's ``run.log``, which records everything (debug included), each line with its time and
level, for as long as the run holds its directory; a resumed run appends to it.

The ``fedpcd`` logger does not propagate to the root logger (a program that configures logging itself
would print each line twice); its handlers are this module's.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from fedpcd._version import __version__
from fedpcd.errors import UserError
from fedpcd.run_format import RunFiles

LOGGER = logging.getLogger("fedpcd")
FILE_FORMAT = "%(asctime)s %(levelname)s %(message)s"

RUN_LOG_ONLY = "run_log_only"  # a record with this attribute true goes to run.log alone (``extra=``)
_RUN_LOGS: set[Path] = set()  # the run.log files this process writes now


class _Console(logging.Handler):
    """``fedpcd: message`` lines on the current ``sys.stderr`` (replaced after set-up by a test or a
    redirection), written with ``tqdm.write`` so that an open progress bar is kept below them."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"fedpcd: {level}{record.getMessage()}"

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, RUN_LOG_ONLY, False):  # already said on stderr when the config was read
            return
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except Exception:  # a closed or broken stderr: logging's own report of the failure
            self.handleError(record)


def _console() -> _Console:
    """The ``fedpcd`` logger's stderr handler, added once."""
    for handler in LOGGER.handlers:
        if isinstance(handler, _Console):
            return handler
    handler = _Console()
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.DEBUG)  # the handlers choose: stderr by verbosity, run.log everything
    LOGGER.propagate = False
    return handler


def setup(verbosity: int) -> None:
    """Configure the ``fedpcd`` logger's stderr lines (once; a later call changes only the level):
    ``verbosity`` -1 or less shows warnings and errors only, 0 info too, 1 or more debug too."""
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    _console().setLevel(level)


class _AppendNoFollow(logging.FileHandler):
    """A file handler appending to its file, which it never opens through a symbolic link."""

    def _open(self) -> TextIO:  # logging.FileHandler's hook that opens the file
        flags = (
            os.O_WRONLY
            | os.O_APPEND
            | os.O_CREAT
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_CLOEXEC", 0)
        )
        return open(os.open(self.baseFilename, flags, 0o666), "a", encoding=self.encoding)


def _file_line(handler: logging.Handler, level: int, text: str, error: BaseException | None = None) -> None:
    """A line for run.log alone (not for stderr): the run's start and how it ended (``error``: with its
    traceback)."""
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    handler.handle(LOGGER.makeRecord(LOGGER.name, level, __file__, 0, text, (), exc_info))


@contextmanager
def run_log(path: str | Path) -> Iterator[None]:
    """Log to ``run.log`` in the run directory ``path`` (created, or appended to) for the block: every
    ``fedpcd`` line from debug up, with its time and level, plus a line for the start (fedpcd's version, the
    process id) and one for the end (finished, interrupted, or the error that stopped it, with its traceback
    unless it is a user error). Re-entrant: a nested block for the same directory writes nothing more.

    A process runs one run at a time: lines logged by anything else in the process meanwhile land there too.
    A run.log that cannot be opened (a symbolic link there included: never followed) is a one-line
    UserError."""
    file = RunFiles(path).run_log
    key = file.resolve()
    if key in _RUN_LOGS:
        yield
        return
    try:
        handler = _AppendNoFollow(file, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {file}: {exc.strerror or exc}") from None
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    LOGGER.addHandler(handler)
    _RUN_LOGS.add(key)
    _file_line(handler, logging.INFO, f"fedpcd {__version__}, pid {os.getpid()}: run {Path(path).resolve()}")
    try:
        yield
    except KeyboardInterrupt:
        _file_line(handler, logging.WARNING, "interrupted")
        raise
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            _file_line(handler, logging.WARNING, f"stopped (exit {exc.code})")
        elif isinstance(exc, UserError):
            _file_line(handler, logging.ERROR, f"stopped: {exc}")
        else:
            _file_line(handler, logging.ERROR, f"stopped: {type(exc).__name__}: {exc}", exc)
        raise
    else:
        _file_line(handler, logging.INFO, "finished")
    finally:
        _RUN_LOGS.discard(key)
        LOGGER.removeHandler(handler)
        handler.close()


setup(0)

"""User-facing errors: the CLI turns them into one line on stderr and exit code 2."""

from __future__ import annotations

import reprlib
import signal

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 6, 6


def clip(text: str, limit: int = 80) -> str:
    """Cut ``text`` to at most ``limit`` characters.

    Args:
        text: Any text.
        limit: The most characters kept.

    Returns:
        ``text`` itself if it fits, else its start ending in ``...``.
    """
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(value: object, limit: int = 80) -> str:
    """A value's ``repr`` for an error message, never building the whole repr of a huge value.

    Args:
        value: Any value.
        limit: The most characters kept (``clip``).

    Returns:
        The (abbreviated) repr, at most ``limit`` characters.
    """
    try:
        text = _REPR.repr(value)
    except ValueError:  # an integer with more digits than Python converts to text
        text = f"<{type(value).__name__} too long to show>"
    return clip(text, limit)


class UserError(Exception):
    """A problem with the user's input (config, names, data files): one clear line, no traceback.

    Its message names the problem and the valid choices; the command line prints it as one line on stderr
    and exits with code 2, the Python API raises it.
    """


def choices(kind: str, name: object, valid: list[str] | tuple[str, ...]) -> UserError:
    """The standard 'unknown X' error naming the valid choices.

    Args:
        kind: What was asked for, e.g. ``algorithm``.
        name: The unknown name given.
        valid: The valid names.

    Returns:
        The error (to raise): ``unknown algorithm 'x'; valid choices: a, b``.
    """
    return UserError(f"unknown {kind} {short(name)}; valid choices: {', '.join(sorted(valid))}")


class DivergenceError(UserError):
    """Training produced a non-finite loss or weight (a user error: the fix is in the config, e.g. local.lr).

    Raised by the engine's divergence guard with the round, the client(s) and the algorithm; the run
    directory keeps every round written before it.
    """


class RunInUseError(UserError):
    """A run directory is locked by another live fedpcd process (a second run or resume would interleave)."""


# the signals besides SIGINT that end a process at a terminal (a closed terminal: SIGHUP; Ctrl-\: SIGQUIT)
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGQUIT (``STOP_SIGNALS``), handled as Ctrl-C: the run stops where it is, its lock
    released, its resume command said; the command exits with 128 + the signal's number. Unlike Ctrl-C at a
    terminal, which reaches every process of the foreground group, the signal may have reached this process
    only: whatever it started (a sweep's worker processes) is told to stop by it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum

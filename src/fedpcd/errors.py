"""User-facing errors: the CLI turns them into one line on stderr and exit code 2."""

from __future__ import annotations

import difflib
import reprlib
import signal
from collections.abc import Iterable

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


def close_matches(name: object, valid: Iterable[str]) -> list[str]:
    """The valid names nearest to a mistyped one (``difflib.get_close_matches``: at most 3, similarity at
    least 0.6, the nearest first; none for a name that is not text).

    Args:
        name: The name given.
        valid: The valid names.

    Returns:
        The near names, e.g. ``['fedgela']`` for ``'fedgella'``.
    """
    if not isinstance(name, str):
        return []
    return difflib.get_close_matches(name, list(valid), n=3, cutoff=0.6)


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """`` (did you mean 'a'?)`` (or ``'a', 'b' or 'c'``) for the :func:`close_matches` of ``name``; empty when
    none is near. Every message about an unknown name a user typed puts it after the name.

    Args:
        name: The name given.
        valid: The valid names.

    Returns:
        The clause, with its leading space, or "".
    """
    near = [repr(n) for n in close_matches(name, valid)]
    if not near:
        return ""
    return f" (did you mean {' or '.join([', '.join(near[:-1]), near[-1]] if len(near) > 1 else near)}?)"


def choices(kind: str, name: object, valid: list[str] | tuple[str, ...]) -> UserError:
    """The standard 'unknown X' error naming the near names and the valid choices.

    Args:
        kind: What was asked for, e.g. ``algorithm``.
        name: The unknown name given.
        valid: The valid names.

    Returns:
        The error (to raise): ``unknown algorithm 'fedgella' (did you mean 'fedgela'?); valid choices: a,
            b``.
    """
    hint = did_you_mean(name, valid)
    return UserError(f"unknown {kind} {short(name)}{hint}; valid choices: {', '.join(sorted(valid))}")


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


def interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or stop signal (:class:`Terminated`) that ``exc`` stands for, else None. torch turns one
    raised in a file's write or read, which its zip writer and reader call, into a RuntimeError ('[enforce
    fail at inline_container.cc]') or SystemError with the interrupt as its ``__context__``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def reraise_interrupt(exc: BaseException) -> None:
    """Raise the Ctrl-C or stop signal that ``exc`` stands for (:func:`interrupt_behind`), if any: for a
    handler that would otherwise answer ``exc`` as a failure of its own."""
    interrupt = interrupt_behind(exc)
    if interrupt is not None:
        raise interrupt from None

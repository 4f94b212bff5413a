"""User-facing errors: the CLI turns them into one line on stderr and exit code 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (config, names, data files): one clear line, no traceback."""


def choices(kind: str, name: object, valid: list[str] | tuple[str, ...]) -> UserError:
    """The standard 'unknown X' error naming the valid choices."""
    return UserError(f"unknown {kind} {name!r}; valid choices: {', '.join(sorted(valid))}")


class DivergenceError(UserError):
    """Training produced a non-finite loss or weight (a user error: the fix is in the config, e.g. local.lr).

    Raised by the engine's divergence guard with the round, the client(s) and the algorithm; the run
    directory keeps every round written before it."""


class RunInUseError(UserError):
    """A run directory is locked by another live fedpcd process (a second run or resume would interleave)."""

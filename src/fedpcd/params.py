"""Parameters of the registered classes and functions (algorithms, models, partition schemes): their
defaults, and a given set checked against them."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from fedpcd.errors import UserError, short


def check_params(kind: str, name: str, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Fill ``defaults`` with ``given``; an unknown key is a UserError naming the valid ones."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        valid = ", ".join(sorted(defaults)) or "(none)"
        raise UserError(
            f"unknown parameter {short(unknown[0])} for {kind} {name!r}; valid parameters: {valid}"
        )
    return {**defaults, **given}


def callable_defaults(fn: Any, skip: int = 0) -> dict[str, Any]:
    """Keyword parameters (with defaults) of a function, skipping the first ``skip`` positional ones."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    return {
        p.name: (None if p.default is inspect.Parameter.empty else p.default)
        for p in params
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def dataclass_defaults(cls: type) -> dict[str, Any]:
    """Field defaults of a dataclass (the algorithms' hyperparameters)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out

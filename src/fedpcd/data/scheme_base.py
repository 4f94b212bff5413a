"""What the partition schemes share: the registry, ``SchemeSplit``, index helpers and parameter resolution.

A scheme is a function ``scheme(labels, num_clients, num_classes, rng, *, <parameters>)`` registered in
``PARTITIONERS``; its keyword-only parameters with defaults are its config keys, typed and bounded by their
annotations (``fedpcd.params``). ``resolve_params`` checks a given set against them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedpcd.errors import UserError
from fedpcd.params import param_defaults, validate_params
from fedpcd.registry import Registry

PARTITIONERS: Registry[Callable[..., list[np.ndarray]]] = Registry("partition scheme")

TestSplitFn = Callable[[np.ndarray, np.random.Generator], list[np.ndarray]]


class SchemeSplit(list):
    """What a partitioner may return instead of a plain list: the per-client train index arrays (it *is* that
    list), plus, optionally, the scheme's own local test split ``test_split(test_labels, rng)`` and
    ``info`` (scheme details, e.g. fedssa's (class, proportion) lists). ``make_partition`` uses
    ``test_split`` instead of ``local_test_split`` when it is set."""

    def __init__(
        self,
        train: Sequence[np.ndarray],
        test_split: TestSplitFn | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(train)
        self.test_split = test_split
        self.info = info or {}


# ----------------------------------------------------------------------------------------------- helpers


def _count_matrix(indices: Sequence[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels)
    out = np.zeros((len(indices), num_classes), dtype=np.int64)
    for k, idx in enumerate(indices):
        if len(idx):
            out[k] = np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)[:num_classes]
    return out


def _class_indices(labels: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """The (sorted) indices of each class 0..C-1."""
    order = np.argsort(labels, kind="stable").astype(np.int64)
    counts = np.bincount(labels, minlength=num_classes)[:num_classes]
    return np.split(order, np.cumsum(counts)[:-1])


def _as_int64(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]


def _cut_bounds(shares: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    """End positions floor(cumsum(share) * n) of the chunks, row by row (``shares`` [..., K], ``n`` [...]).

    Bounds from the last positive share on are pinned to n, so float round-off neither loses a sample nor
    hands one to a trailing zero-share client."""
    n = np.asarray(n, dtype=np.int64)[..., None]
    bounds = np.minimum(np.floor(np.cumsum(shares, axis=-1) * n).astype(np.int64), n)
    width = shares.shape[-1]
    last_positive = width - 1 - np.argmax((shares > 0)[..., ::-1], axis=-1)
    pinned = np.arange(width) >= last_positive[..., None]
    return np.where(pinned, n, np.maximum(bounds, 0))


def _check_labels(labels: Any, what: str) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise UserError(f"{what} labels must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{what} labels must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


# --------------------------------------------------------------------------------------------- parameters


def scheme_params(scheme: str) -> dict[str, object]:
    """The scheme's parameters with their defaults (its config keys); UserError for an unknown scheme."""
    return param_defaults("partition scheme", scheme, PARTITIONERS.get(scheme))


def resolve_params(
    scheme: str, params: Mapping[str, Any] | None = None, prefix: str | None = None
) -> dict[str, object]:
    """All of the scheme's parameters, validated, defaults filled (longtail's ``then`` included): what
    ``make_partition`` will use, e.g. for writing the resolved config. UserError on an unknown scheme,
    unknown keys or bad values (named ``<prefix>.<key>``, default ``partition.<key>``)."""
    fn = PARTITIONERS.get(scheme)
    given = dict(params or {})
    if given.get("scheme") == scheme:  # tolerate the config section's own name field
        del given["scheme"]
    return validate_params("partition scheme", scheme, fn, given, prefix)

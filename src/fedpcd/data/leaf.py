"""LEAF's JSON format (FEMNIST, Shakespeare): ``train/`` and ``test/`` folders of ``*.json`` files.

Each file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``
(Caldas et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097; github.com/TalwalkarLab/leaf).
A user's samples may be spread over several files of a split; they are merged in file-name order. Every
sample keeps its user as a group id (users numbered in sorted order over both splits), so the ``natural``
partition scheme gives one client per writer (FEMNIST) or speaking role (Shakespeare).

LEAF publishes scripts, not preprocessed files: its ``preprocess.sh`` turns the raw NIST / Gutenberg data
into these folders (``leaf/data/<name>/data/{train,test}``), so nothing is downloaded here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpcd.data.sources import LEAF_SPLITS
from fedpcd.errors import UserError, clip
from fedpcd.utils import read_user_text, show_path

# LEAF's Shakespeare vocabulary (models/utils/language_utils.py ALL_LETTERS): 80 symbols, id = position
SHAKESPEARE_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
FEMNIST_CLASSES = 62  # 10 digits, 26 upper-case and 26 lower-case letters
FEMNIST_SIDE = 28


def read_leaf_split(folder: Path) -> dict[str, tuple[list[Any], list[Any]]]:
    """user -> (x list, y list) over every ``*.json`` file in ``folder`` (file-name order); a file that is not
    LEAF JSON is a one-line UserError naming it."""
    users: dict[str, tuple[list[Any], list[Any]]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(read_user_text(path, "LEAF file"))
        except (ValueError, RecursionError) as exc:
            raise UserError(f"LEAF file {show_path(path)} is not valid JSON: {clip(str(exc))}") from None
        block = data.get("user_data") if isinstance(data, dict) else None
        if not isinstance(block, dict):
            raise UserError(f"LEAF file {show_path(path)}: expected an object with 'users' and 'user_data'")
        for user, samples in block.items():
            x = samples.get("x") if isinstance(samples, dict) else None
            y = samples.get("y") if isinstance(samples, dict) else None
            if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y):
                raise UserError(
                    f"LEAF file {show_path(path)}: user {clip(str(user), 40)} needs lists 'x' and 'y' of "
                    "equal length"
                )
            xs, ys = users.setdefault(str(user), ([], []))
            xs.extend(x)
            ys.extend(y)
    return users


def read_leaf(
    folder: Path,
    encode_x: Callable[[list[Any], Path], np.ndarray],
    encode_y: Callable[[list[Any], Path], np.ndarray],
) -> dict[str, torch.Tensor]:
    """``train_x``, ``train_y``, ``test_x``, ``test_y``, ``train_groups``, ``test_groups`` of a LEAF folder;
    ``encode_x`` / ``encode_y`` turn one split's samples (in user order) into arrays, naming the folder in
    their errors."""
    splits = {s: read_leaf_split(folder / s) for s in LEAF_SPLITS}
    names = sorted(set(splits["train"]) | set(splits["test"]))
    group_of = {u: g for g, u in enumerate(names)}
    out: dict[str, torch.Tensor] = {}
    for s, users in splits.items():
        order = sorted(users, key=group_of.__getitem__)
        xs = [v for u in order for v in users[u][0]]
        ys = [v for u in order for v in users[u][1]]
        groups = np.concatenate(
            [np.full(len(users[u][1]), group_of[u], dtype=np.int64) for u in order] or [np.zeros(0, np.int64)]
        )
        if not ys:
            raise UserError(f"LEAF folder {show_path(folder / s)} holds no samples")
        out[f"{s}_x"] = torch.from_numpy(np.ascontiguousarray(encode_x(xs, folder / s)))
        out[f"{s}_y"] = torch.from_numpy(encode_y(ys, folder / s))
        out[f"{s}_groups"] = torch.from_numpy(groups)
    return out


def femnist_x(xs: list[Any], where: Path) -> np.ndarray:
    """FEMNIST's flattened 28x28 grey values in [0, 1] -> uint8 ``[N, 1, 28, 28]`` (x 255, rounded)."""
    try:
        arr = np.asarray(xs, dtype=np.float32)
    except (TypeError, ValueError):
        raise UserError(
            f"FEMNIST files in {show_path(where)}: every x must be a list of 784 numbers"
        ) from None
    if arr.ndim != 2 or arr.shape[1] != FEMNIST_SIDE * FEMNIST_SIDE:
        raise UserError(f"FEMNIST files in {show_path(where)}: every x must be a list of 784 numbers")
    if not np.isfinite(arr).all() or arr.min() < 0.0 or arr.max() > 1.0:
        raise UserError(f"FEMNIST files in {show_path(where)}: pixel values must lie in [0, 1]")
    return np.rint(arr * 255.0).astype(np.uint8).reshape(-1, 1, FEMNIST_SIDE, FEMNIST_SIDE)


def class_ids(num_classes: int, name: str) -> Callable[[list[Any], Path], np.ndarray]:
    """An ``encode_y`` for integer labels 0..num_classes-1."""

    def encode(ys: list[Any], where: Path) -> np.ndarray:
        ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < num_classes for v in ys)
        if not ok:
            raise UserError(
                f"{name} files in {show_path(where)}: every y must be an integer in 0..{num_classes - 1}"
            )
        return np.asarray(ys, dtype=np.int64)

    return encode


_ORDER = np.argsort([ord(c) for c in SHAKESPEARE_LETTERS])
_SORTED = np.array([ord(c) for c in SHAKESPEARE_LETTERS], dtype=np.uint32)[_ORDER]


def letters(text: str, where: Path) -> np.ndarray:
    """Ids of ``text``'s characters in LEAF's vocabulary (int64); a character outside it is a UserError."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    pos = np.minimum(np.searchsorted(_SORTED, codes), len(_SORTED) - 1)
    ids = _ORDER[pos]
    bad = np.flatnonzero(_SORTED[pos] != codes)
    if len(bad):
        raise UserError(
            f"Shakespeare files in {show_path(where)}: character {text[bad[0]]!r} is not in LEAF's 80-symbol "
            "vocabulary"
        )
    return ids


def shakespeare_x(xs: list[Any], where: Path) -> np.ndarray:
    """Shakespeare's input strings (all of one length L, LEAF's 80) -> uint8 character ids ``[N, L]``."""
    if not all(isinstance(v, str) for v in xs) or len({len(v) for v in xs}) > 1:
        raise UserError(
            f"Shakespeare files in {show_path(where)}: every x must be a string of the same length"
        )
    length = len(xs[0]) if xs else 0
    if length == 0:
        raise UserError(f"Shakespeare files in {show_path(where)}: the x strings are empty")
    return letters("".join(xs), where).astype(np.uint8).reshape(len(xs), length)


def shakespeare_y(ys: list[Any], where: Path) -> np.ndarray:
    """Shakespeare's targets (one next character each) -> int64 ids."""
    if not all(isinstance(v, str) and len(v) == 1 for v in ys):
        raise UserError(f"Shakespeare files in {show_path(where)}: every y must be one character")
    return letters("".join(ys), where).astype(np.int64)

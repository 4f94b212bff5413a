"""Checkpoints: what ``--resume`` needs after a round, and the checks a checkpoint passes before it is used.

A checkpoint (``RunDir.checkpoint``) holds the server and client states, the wall time, the metrics so far (so
a resume rewrites metrics.jsonl from it), the global RNG states and the resolved config (canonical JSON and
its SHA-256: a resume with another config is refused, but for ``RESUME_CHANGES`` allowed explicitly). It loads
with ``torch.load(weights_only=True)``: a run directory never executes code.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpcd.config import Config
from fedpcd.config_identity import (
    RESUME_CHANGES,
    canonical_config,
    config_changes,
    config_hash,
    describe_changes,
)
from fedpcd.engine.records import record_line
from fedpcd.errors import UserError, clip, reraise_interrupt, short
from fedpcd.run_format import RunFiles
from fedpcd.utils import read_user_bytes

# 3: + the config (canonical JSON and SHA-256); 2: + metrics so far and global RNG states (1: server,
# client_states, wall_s)
CHECKPOINT_FORMAT = 3


def load_weights_only(
    path: str | Path, map_location: torch.device | str | None = None, what: str = "checkpoint", hint: str = ""
) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain data only, never code. A file that does not load
    is one line of our own naming it (never torch's advice to load it without that safeguard); a Ctrl-C or
    stop signal during the read stays what it is."""
    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - refused by the safe unpickler, truncated or foreign: all one answer
        reraise_interrupt(exc)
        raise UserError(
            f"cannot load {what} {path}: it is corrupt, truncated or holds objects other than tensors and "
            f"plain data (only those are loaded, never code){hint}"
        ) from None


def load_checkpoint_file(path: str | Path, map_location: torch.device | str | None = None) -> dict[str, Any]:
    """A checkpoint file, loaded with ``weights_only=True`` and checked for the keys a resume needs."""
    path = Path(path)
    hint = "; delete the checkpoint folder to restart the run"
    state = load_weights_only(path, map_location, "checkpoint", hint)
    if not isinstance(state, dict) or not all(k in state for k in ("round", "server", "client_states")):
        raise UserError(f"{path} is not a fedpcd checkpoint (needs 'round', 'server' and 'client_states')")
    if (
        isinstance(state["round"], bool)
        or not isinstance(state["round"], int)
        or not isinstance(state["client_states"], dict)
        or not isinstance(state["server"], dict)
    ):
        raise UserError(f"{path} is not a fedpcd checkpoint (bad 'round', 'server' or 'client_states')")
    return state


def _tensors(tree: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """(key path, tensor) of every tensor in nested dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, (*prefix, key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, (*prefix, i))


def _at(tree: Any, keys: tuple[Any, ...]) -> Any:
    """The value at a key path of nested dicts and lists (None where the path is missing)."""
    for key in keys:
        if isinstance(tree, dict):
            tree = tree.get(key)
        elif isinstance(tree, (list, tuple)) and isinstance(key, int) and key < len(tree):
            tree = tree[key]
        else:
            return None
    return tree


def check_server_state(server: dict[str, Any], reference: dict[str, Any], path: str | Path) -> None:
    """Refuse a checkpoint's server state that does not fit the run's model: every tensor of ``reference``
    (what the algorithm's ``init_server`` makes of the run's model) must be at the same key in ``server``,
    with the same shape and dtype; ``server`` may hold more (state an algorithm adds in later rounds).
    One line naming the first tensor that does not fit."""
    for keys, ref in _tensors(reference):
        name = ".".join(map(str, keys))
        got = _at(server, keys)
        if not isinstance(got, torch.Tensor):
            raise UserError(
                f"{path}: the checkpoint's server state has no tensor {clip(name)}, which the run's model "
                "needs; it is not this run's checkpoint: delete the checkpoint folder to restart the run"
            )
        if got.shape != ref.shape or got.dtype != ref.dtype:
            raise UserError(
                f"{path}: the checkpoint's server tensor {clip(name)} is {list(got.shape)} {got.dtype}, but "
                f"the run's model needs {list(ref.shape)} {ref.dtype}; it is not this run's checkpoint: "
                "delete the checkpoint folder to restart the run"
            )


def changes_since(old: str | Config, config: Config) -> dict[str, tuple[Any, Any]]:
    """``key: (old, new)`` between two runs' identities: the one question "is this the same run?" (empty:
    it is). ``old``: a config, or one recorded as its identity (``canonical_config``: canonical JSON of what
    a run computes, not where it lives or who watches it)."""
    text = old if isinstance(old, str) else canonical_config(old)
    return config_changes(json.loads(text), json.loads(canonical_config(config)))


def checkpoint_rounds(checkpoint: dict[str, Any]) -> int | None:
    """The ``rounds`` of the config a checkpoint was written with (None: a checkpoint without its config)."""
    text = checkpoint.get("config")
    return json.loads(text).get("rounds") if isinstance(text, str) else None


def check_checkpoint(state: dict[str, Any], run: RunFiles, config: Config, allow: Sequence[str] = ()) -> None:
    """Refuse a checkpoint of ``run`` (loaded by :func:`load_checkpoint_file`) that does not belong to
    ``config``.

    Its config record must match ``config`` but for the ``allow``ed keys of ``RESUME_CHANGES`` (else a
    one-line ``key: old -> new`` diff; a checkpoint from before the record is not compared), and its fields
    must be in range: round in 0..rounds, client ids in 0..clients-1, wall time, metrics, format."""
    path = run.checkpoint
    fmt = state.get("format", 1)
    if isinstance(fmt, bool) or not isinstance(fmt, int) or not 1 <= fmt <= CHECKPOINT_FORMAT:
        raise UserError(
            f"{path}: checkpoint format {short(fmt)} is not one this fedpcd reads (1..{CHECKPOINT_FORMAT})"
        )
    if "partition_sha256" in state and state["partition_sha256"] != file_sha256(
        run.partition, "partition file"
    ):
        raise UserError(
            f"{run.partition} changed since the checkpoint (its SHA-256 differs): a run cannot go on with "
            "another partition; restore the file or start a new run"
        )
    if "config" in state or "config_sha256" in state:
        text, digest = state.get("config"), state.get("config_sha256")
        if not isinstance(text, str) or not isinstance(digest, str) or config_hash(text) != digest:
            raise UserError(f"{path}: the checkpoint's config record is corrupt (its SHA-256 does not match)")
        if digest != config_hash(canonical_config(config)):
            try:
                changes = changes_since(text, config)
            except ValueError:
                raise UserError(f"{path}: the checkpoint's config record is not JSON") from None
            diff = describe_changes(changes)
            unsafe = [k for k in changes if k not in RESUME_CHANGES]
            if unsafe:
                raise UserError(
                    f"{run.config} changed since its checkpoint ({diff}); a run cannot go on with "
                    f"another {unsafe[0]}: restore config.yaml or start a new run (a resume may change only "
                    f"{', '.join(RESUME_CHANGES)})"
                )
            missing = [k for k in changes if k not in allow]
            if missing:
                raise UserError(
                    f"{run.config} changed since its checkpoint ({diff}); to go on with the change, add "
                    f"--allow-config-change {' '.join(missing)}"
                )
    rnd = state["round"]
    if not 0 <= rnd <= config.rounds:
        raise UserError(
            f"{path}: checkpoint round {rnd} is outside 0..{config.rounds} (rounds never go below the round "
            "a checkpoint was written at)"
        )
    bad = [k for k in state["client_states"] if isinstance(k, bool) or not isinstance(k, int)]
    bad += [k for k in state["client_states"] if k not in bad and not 0 <= k < config.clients]
    if bad:
        raise UserError(
            f"{path}: the checkpoint holds a state of client {short(bad[0])}, but clients are "
            f"0..{config.clients - 1}"
        )
    wall = state.get("wall_s", 0.0)
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not 0 <= wall < math.inf:
        raise UserError(f"{path}: the checkpoint's wall_s {short(wall)} is not a time in seconds")
    checkpoint_records(state, path)


def checkpoint_state(
    rnd: int,
    server: dict[str, Any],
    client_states: Mapping[int, Any],
    wall_s: float,
    records: Sequence[dict[str, Any]],
    config: Config | None = None,
    partition: str | Path | None = None,
) -> dict[str, Any]:
    """What ``--resume`` needs after round ``rnd``: server and client states, the metrics so far (so a
    metrics.jsonl line torn or written after the checkpoint never matters), the global RNG states, the
    run's ``config`` (canonical JSON and its SHA-256: a resume checks it against config.yaml) and the
    SHA-256 of its ``partition`` file (:func:`file_sha256`: a resume refuses a partition.json changed since).

    ``client_states``: a dict, or a store with ``to_dict()`` (engine/state_store.py)."""
    digest = file_sha256(partition, "partition file") if partition is not None else None
    to_dict = getattr(client_states, "to_dict", None)
    state = {
        "format": CHECKPOINT_FORMAT,
        "round": int(rnd),
        "server": server,
        "client_states": to_dict() if callable(to_dict) else dict(client_states),
        "wall_s": float(wall_s),
        "metrics": "".join(record_line(r) for r in records),
        "rng": rng_state(),
    }
    if config is not None:
        state["config"] = canonical_config(config)
        state["config_sha256"] = config_hash(state["config"])
    if digest is not None:
        state["partition_sha256"] = digest
    return state


def file_sha256(path: str | Path, what: str) -> str:
    """SHA-256 (hex) of a run file, read as every run-folder file is (bounded, never through a link)."""
    return hashlib.sha256(read_user_bytes(path, what, links=False)).hexdigest()


def checkpoint_records(
    state: dict[str, Any], path: str | Path = "the checkpoint"
) -> list[dict[str, Any]] | None:
    """The metrics a checkpoint holds (None for checkpoints written before they held them); a record that is
    not JSON, or whose round is out of order or after the checkpoint's, is a UserError naming ``path``."""
    text = state.get("metrics")
    if text is None:
        return None
    if not isinstance(text, str):
        raise UserError(f"{path}: the checkpoint's metrics are not text")
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(f"{path}: metrics line {i} in the checkpoint is not valid JSON") from None
        rnd = row.get("round") if isinstance(row, dict) else None
        last = rows[-1]["round"] if rows else 0
        if isinstance(rnd, bool) or not isinstance(rnd, int) or not last < rnd <= state["round"]:
            raise UserError(
                f"{path}: metrics line {i} in the checkpoint is not a record of a round in "
                f"{last + 1}..{state['round']}"
            )
        rows.append(row)
    return rows


def rng_state() -> dict[str, Any]:
    """The global torch, numpy and Python RNG states, as tensors and plain data (weights_only-loadable).

    The engine itself never draws from them (every random choice comes from a generator seeded with
    (seed, round, client)); they are kept so that code which does (a user's algorithm) resumes identically."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any] | None) -> None:
    """Restore the global RNG states saved by :func:`rng_state` (no-op for None)."""
    if not state:
        return
    try:
        torch.set_rng_state(state["torch"])
        np_state = state["numpy"]
        np.random.set_state(
            (
                "MT19937",
                np_state["keys"].numpy().astype(np.uint32),
                int(np_state["pos"]),
                int(np_state["has_gauss"]),
                float(np_state["cached_gaussian"]),
            )
        )
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError):
        raise UserError("the checkpoint's random number generator states are corrupt") from None

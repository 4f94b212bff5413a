"""A codec between the engine's plain dicts and Flower records.

Payloads, replies, client states and personal metrics are dicts whose leaves are tensors, numbers, strings,
bools or None, possibly nested (``{"model": {name: tensor}, "num_samples": 12}``); a client state may be None.
:func:`encode` turns one such object into at most three Flower records stored under ``NAME.*``:

- ``NAME.meta`` (ConfigRecord): every leaf's path, in the dict's own order, and a one-letter kind per leaf
  (``t`` tensor, ``s`` scalar, ``n`` None, ``e`` empty dict, ``l`` empty list), or ``root-none`` for a None
  object. This is what makes None, empty dicts and key order round-trip;
- ``NAME.arrays`` (ArrayRecord): the tensor leaves (dtype and shape kept; decoded as CPU tensors);
- ``NAME.config`` (ConfigRecord): the scalar leaves. Flower keeps int, float, bool, str and bytes apart,
  so ``1`` stays an int and ``1.0`` a float; homogeneous lists of those are kept as lists.

Nested keys are flattened into a path with ``/``; each key is percent-quoted first, so keys may themselves
contain dots, slashes or percent signs (state-dict keys such as ``features.0.weight`` stay readable).
Only ``str`` keys are allowed. :func:`decode` is the exact inverse.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

SEP = "/"
SCALARS = (bool, int, float, str, bytes)
Records = dict[str, ArrayRecord | ConfigRecord]


def _path(parts: tuple[str, ...]) -> str:
    return SEP.join(quote(p, safe="") for p in parts)


def _parts(path: str) -> list[str]:
    return [unquote(p) for p in path.split(SEP)]


def _flatten(obj: Mapping[str, Any], prefix: tuple[str, ...], out: list[tuple[tuple[str, ...], Any]]) -> None:
    for key, value in obj.items():
        if not isinstance(key, str):
            raise TypeError(f"only str keys can be encoded, got {type(key).__name__} key {key!r} at {prefix}")
        parts = (*prefix, key)
        if isinstance(value, Mapping) and value:
            _flatten(value, parts, out)
        else:
            out.append((parts, value))


def _scalar_ok(value: Any) -> bool:
    if isinstance(value, SCALARS):
        return True
    if isinstance(value, list) and value:
        first = type(value[0])
        return first in SCALARS and all(type(v) is first for v in value)
    return False


def encode(obj: Mapping[str, Any] | None, name: str) -> Records:
    """``obj`` as Flower records keyed ``NAME.meta`` / ``NAME.arrays`` / ``NAME.config`` (see module doc)."""
    meta = ConfigRecord()
    if obj is None:
        meta["root-none"] = True
        return {f"{name}.meta": meta}
    if not isinstance(obj, Mapping):
        raise TypeError(f"{name}: expected a dict or None, got {type(obj).__name__}")
    leaves: list[tuple[tuple[str, ...], Any]] = []
    _flatten(obj, (), leaves)
    arrays, config = ArrayRecord(), ConfigRecord()
    paths, kinds = [], []
    for parts, value in leaves:
        path = _path(parts)
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bfloat16:
                raise TypeError(f"{name}: bfloat16 tensor at {'/'.join(parts)} cannot be encoded; cast it")
            arrays[path] = Array.from_numpy_ndarray(value.detach().cpu().numpy())
            kind = "t"
        elif value is None:
            kind = "n"
        elif isinstance(value, Mapping):  # empty dict (non-empty ones were flattened)
            kind = "e"
        elif isinstance(value, list) and not value:
            kind = "l"
        elif _scalar_ok(value):
            config[path] = value
            kind = "s"
        else:
            raise TypeError(
                f"{name}: cannot encode {type(value).__name__} at {'/'.join(parts)}; leaves must be tensors, "
                "int, float, bool, str, bytes, None or same-typed lists of scalars"
            )
        paths.append(path)
        kinds.append(kind)
    if paths:
        meta["paths"] = paths
        meta["kinds"] = "".join(kinds)
    records: Records = {f"{name}.meta": meta}
    if len(arrays):
        records[f"{name}.arrays"] = arrays
    if len(config):
        records[f"{name}.config"] = config
    return records


def decode(records: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The object that :func:`encode` stored under ``NAME`` in ``records`` (a RecordDict or a plain dict)."""
    if f"{name}.meta" not in records:
        raise KeyError(f"no encoded object {name!r} in these records")
    meta = records[f"{name}.meta"]
    if meta.get("root-none", False):
        return None
    arrays = records.get(f"{name}.arrays")
    config = records.get(f"{name}.config")
    out: dict[str, Any] = {}
    for path, kind in zip(meta.get("paths", []), meta.get("kinds", ""), strict=True):
        if kind == "t":
            value: Any = torch.from_numpy(np.array(arrays[path].numpy(), copy=True))
        elif kind == "s":
            value = config[path]
            value = list(value) if isinstance(value, list) else value
        elif kind == "n":
            value = None
        elif kind == "e":
            value = {}
        elif kind == "l":
            value = []
        else:
            raise ValueError(f"{name}: unknown leaf kind {kind!r} at {path}")
        *parents, leaf = _parts(path)
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def put(target: MutableMapping[str, Any], name: str, obj: Mapping[str, Any] | None) -> None:
    """Store ``obj`` under ``NAME`` in a RecordDict (e.g. ``context.state``), replacing what was there."""
    clear(target, name)
    for key, record in encode(obj, name).items():
        target[key] = record


def get(source: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """The object stored under ``NAME``, or ``default`` when there is none."""
    if f"{name}.meta" not in source:
        return default
    return decode(source, name)


def clear(target: MutableMapping[str, Any], name: str) -> None:
    """Remove every record of ``NAME`` from ``target``."""
    for suffix in (".meta", ".arrays", ".config"):
        target.pop(f"{name}{suffix}", None)


def record_dict(**objects: Mapping[str, Any] | None) -> RecordDict:
    """A RecordDict holding each keyword's object under its name, e.g. ``record_dict(payload=p, info=i)``."""
    rd = RecordDict()
    for name, obj in objects.items():
        put(rd, name, obj)
    return rd

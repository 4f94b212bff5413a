"""A sweep file's grid: the product of its ``sweep:`` lists (the ``setting`` axis sets several keys at once),
each run's folder named from its swept values, the count bounded by ``MAX_RUNS`` before any run is built."""

from __future__ import annotations

import copy
import itertools
import math
import re
from pathlib import Path
from typing import Any

from fedpcd.config import Config
from fedpcd.config_input import merge_dicts, parse_overrides, read_yaml
from fedpcd.errors import UserError, clip
from fedpcd.labels import warn_overrides
from fedpcd.resolve import config_from_dict
from fedpcd.utils import show_path

MAIN_KEYS = ("name", "scheme")
SETTING = "setting"  # the axis whose values are mappings of several keys set together
MAX_RUNS = 100_000  # runs of one sweep's grid (counted before any is built)


def _label(key: str, value: Any) -> str:
    if key == SETTING:
        return str(value["label"]) if "label" in value else _plain(value)
    leaf = key.split(".")[-1]
    if isinstance(value, dict):
        main = next((str(value[k]) for k in MAIN_KEYS if k in value), leaf)
        rest = "".join(f"-{k}{_plain(v)}" for k, v in value.items() if k not in MAIN_KEYS)
        return main + rest
    return f"{leaf}{_plain(value)}"


def _plain(value: Any) -> str:
    if isinstance(value, dict):
        return "-".join(f"{k}{_plain(v)}" for k, v in value.items())
    return str(value)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = copy.deepcopy(value)


def expand_sweep(path: str | Path, overrides: list[str] | None = None) -> list[Config]:
    """The resolved configs of a sweep file's grid (overrides apply to every run)."""
    raw = read_yaml(path)
    grid = raw.pop("sweep", None)
    if not isinstance(grid, dict) or not grid:
        raise UserError(
            f"{path} has no 'sweep:' mapping of keys to lists of values; see 'fedpcd sweep --help'"
        )
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"sweep key {key!r} in {path} must map to a non-empty list of values")
        if key == SETTING and not all(isinstance(v, dict) for v in values):
            raise UserError(f"every value of the sweep axis 'setting' in {path} must be a mapping of keys")
    count = math.prod(len(values) for values in grid.values())
    if count > MAX_RUNS:
        axes = " x ".join(f"{len(values)} {clip(str(key), 40)}" for key, values in grid.items())
        raise UserError(
            f"the sweep in {show_path(path)} has {count:,} runs ({axes}), over the limit of {MAX_RUNS:,}; "
            "split it into several sweep files"
        )
    extra = parse_overrides(overrides or [])
    base = merge_dicts(raw, extra)
    root = Path(base.get("output_dir", "runs/sweep"))
    configs, names, said = [], set(), set()
    for combo in itertools.product(*grid.values()):
        run = copy.deepcopy(base)
        for key, value in zip(grid, combo, strict=True):
            if key == SETTING:
                for sub_key, sub_value in value.items():
                    if sub_key != "label":
                        _set(run, sub_key, sub_value)
            else:
                _set(run, key, value)
        name = re.sub(
            r"[^A-Za-z0-9.=_-]+", "", "_".join(_label(k, v) for k, v in zip(grid, combo, strict=True))
        )
        if name.strip(".") == "":  # "", "." or "..": not a folder of its own below output_dir
            raise UserError(
                f"a run of the sweep in {path} would get the folder name {name!r}, not a folder below "
                f"{root}; give its setting a label of letters, digits, '=', '_' or '-'"
            )
        if name in names:
            raise UserError(f"two runs of the sweep in {path} would share the folder name {name!r}")
        names.add(name)
        run["output_dir"] = str(root / name)
        tracking = run.get("tracking")
        if isinstance(tracking, dict) and tracking.get("loggers"):  # its runs group as the sweep in trackers
            tracking.setdefault("group", (root.resolve().name or "sweep")[:128])
        configs.append(config_from_dict(run))
        warn_overrides(configs[-1].to_dict(), {"config file": run, "command line": extra}, said)
    return configs

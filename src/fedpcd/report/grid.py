"""Many runs as a grid of methods (rows) x settings (columns), and the per-run values read out of it.

A run's *method* is its ``algorithm`` section (name and parameters); its *setting* is every other config key
that differs between the runs (partition, number of clients, participation, dataset, ...), named the way the
papers name them (P10C2, Dir(0.1), IID; ``K=100`` and ``participation=0.1`` added when they vary). Seeds of
the same method and setting form one cell. A run's value of a metric is either the mean over its last
``last`` evaluated rounds ("last") or its best evaluated round ("best"), the two protocols the papers mix.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedpcd.labels import overrides_suffix, run_label
from fedpcd.report.groups import group_runs, preset_keys, setting_columns
from fedpcd.report.read import Run
from fedpcd.report.stats import last_mean

if TYPE_CHECKING:
    import pandas as pd

METHOD_SECTION = "algorithm"


def is_reference(method: str, reference: str) -> bool:
    """Whether the method label ``method`` is the reference algorithm's: its name, with any options of its
    own, but not under a preset (``fedavg preset=fedadam`` is FedAdam, compared with FedAvg as any method)."""
    return method.split()[0] == reference and " preset=" not in method


PROTOCOLS = ("last", "best")
_SCHEME_ORDER = ["iid", "dirichlet", "shards", "pathological", "fedssa", "longtail", "explicit"]


def partition_name(partition: dict[str, Any], clients: int) -> str:
    """The papers' short name of a partition: P10C2, Dir(0.1), IID, shards(2), LT(0.01)+..., SSA-C2."""
    scheme = partition.get("scheme")
    if scheme == "pathological":
        return f"P{clients}C{partition.get('classes_per_client')}"
    if scheme == "dirichlet":
        return f"Dir({partition.get('beta'):g})"
    if scheme == "iid":
        return "IID"
    if scheme == "shards":
        return f"shards({partition.get('shards_per_client')})"
    if scheme == "fedssa":
        return f"SSA-C{partition.get('classes_per_client')}"
    if scheme == "longtail":
        return f"LT({partition.get('rho'):g})+{partition_name(partition.get('then') or {}, clients)}"
    return str(scheme)


def _setting_sort_key(config: dict[str, Any], unusual: int) -> tuple:
    """Settings that differ from the others only in the partition first, ordered from mild to strong skew
    (IID, Dir(0.5), Dir(0.1), P10C3, P10C2), then those with ``unusual`` other keys (P5C2, K=100 ...)."""
    part = config.get("partition", {})
    scheme = part.get("scheme")
    rank = _SCHEME_ORDER.index(scheme) if scheme in _SCHEME_ORDER else len(_SCHEME_ORDER)
    strength = -float(part.get("beta", part.get("classes_per_client", 0)) or 0)
    return (
        unusual,
        rank,
        strength,
        config.get("clients", 0),
        json.dumps(config, sort_keys=True, default=str),
    )


@dataclass
class Grid:
    """Runs arranged as methods x settings; ``cells[(method, setting)]`` holds the seeds' runs."""

    methods: list[str]
    settings: list[str]
    cells: dict[tuple[str, str], list[Run]] = field(default_factory=dict)

    def runs(self, method: str, setting: str) -> list[Run]:
        return self.cells.get((method, setting), [])


def build_grid(runs: Sequence[Run], reference: str = "fedavg") -> Grid:
    """Arrange runs by method (the algorithm section) and setting (every other varying key but the seed)."""
    varying, _ = group_runs(list(runs))
    method_keys = [k for k in varying if k.partition(".")[0] == METHOD_SECTION]
    setting_keys = [k for k in varying if k.partition(".")[0] != METHOD_SECTION]
    flats = [run.flat for run in runs]
    # the keys a run's preset sets (at the preset's value) are its method's: they name no setting
    presets = [preset_keys(run) for run in runs]
    usual = {
        k: _usual(k, [f.get(k) for f, keys in zip(flats, presets, strict=True) if k not in keys])
        for k in setting_keys
    }
    methods: dict[str, None] = {}
    settings: dict[str, tuple] = {}
    cells: dict[tuple[str, str], list[Run]] = {}
    for run, flat, preset in zip(runs, flats, presets, strict=True):
        name = run.config[METHOD_SECTION]["name"]
        method_values = tuple(flat.get(k) for k in method_keys)
        cell = setting_columns(method_keys, method_values, name).get(METHOD_SECTION)
        method = cell + overrides_suffix(run.config) if cell else run_label(run.config)
        unusual = [
            k for k in setting_keys if k not in preset and json.dumps(flat.get(k), default=str) != usual[k]
        ]
        setting = _setting_name(run.config, flat, unusual)
        methods.setdefault(method)
        others = sum(not k.startswith("partition.") for k in unusual)
        settings.setdefault(
            setting, _setting_sort_key({k: v for k, v in run.config.items() if k != "seed"}, others)
        )
        cells.setdefault((method, setting), []).append(run)
    ordered_methods = sorted(methods, key=lambda m: (not is_reference(m, reference), m))
    ordered_settings = sorted(settings, key=lambda s: settings[s])
    return Grid(ordered_methods, ordered_settings, cells)


def _usual(key: str, values: list[Any]) -> str | None:
    """The value (as JSON) most runs have for a config key, left out of setting names: the most common one,
    a tie going to the key's default; None (show the key everywhere) for a tie without the default."""
    from fedpcd.config import Config

    default = json.dumps(Config().to_dict().get(key) if "." not in key else None, default=str)
    counts = Counter(json.dumps(v, default=str) for v in values).most_common()
    if not counts:  # every run's preset sets the key
        return default
    tied = [v for v, n in counts if n == counts[0][1]]
    if len(tied) == 1:
        return tied[0]
    return default if default in tied else None


def _setting_name(config: dict[str, Any], flat: dict[str, Any], shown: list[str]) -> str:
    """The partition's short name, then ``key=value`` for the other keys in ``shown`` (those whose value
    differs from the one most runs have; pathological names already carry the number of clients)."""
    clients = int(config.get("clients", 0))
    part = config.get("partition", {})
    name = partition_name(part, clients)
    extra = []
    for key in shown:
        if key.startswith("partition.") or (key == "clients" and part.get("scheme") == "pathological"):
            continue
        label = "K" if key == "clients" else key
        extra.append(f"{label}={flat.get(key)}")
    return " ".join([name, *extra])


def run_value(run: Run, metric: str, protocol: str, last: int) -> float | None:
    """A run's ``metric``: mean over its last ``last`` evaluated rounds, or its best evaluated round."""
    if protocol == "last":
        return last_mean(run.records, metric, last)
    values = [r[metric] for r in run.records if r.get(metric) is not None]
    return max(values) if values else None


def cell_values(grid: Grid, metric: str, protocol: str, last: int) -> dict[tuple[str, str], list[float]]:
    """Per cell, the seeds' values of ``metric`` under ``protocol`` (cells without a value left out)."""
    out = {}
    for key, members in grid.cells.items():
        values = [v for v in (run_value(r, metric, protocol, last) for r in members) if v is not None]
        if values:
            out[key] = values
    return out


def cell_means(grid: Grid, metric: str, protocol: str, last: int) -> pd.DataFrame:
    """Methods x settings in the grid's order: the mean over seeds of each cell's ``cell_values`` (NaN: no
    value), with ``statistics.fmean`` (exactly rounded: the mean the tables print)."""
    import pandas as pd

    means = [(m, s, statistics.fmean(v)) for (m, s), v in cell_values(grid, metric, protocol, last).items()]
    frame = pd.DataFrame(means, columns=["method", "setting", "mean"])
    table = frame.pivot(index="method", columns="setting", values="mean")
    return table.reindex(index=grid.methods, columns=grid.settings).astype(float)

"""The Python API: run experiments, read runs and sweep indexes as pandas DataFrames, partition labels.

::

    import fedpcd

    result = fedpcd.run("configs/example.yaml", rounds=2, local__lr=0.05, algorithm__name="fednh")
    result.metrics[["round", "global_acc", "personal_acc"]]
    runs = fedpcd.load_runs("runs/")  # every finished run below runs/: one row per (run, evaluated round)
    parts = fedpcd.partition(labels, "dirichlet", clients=10, seed=0, beta=0.1)

Each function goes through the code the command line runs (``load_config``, ``run_experiment``,
``make_partition``, the report's run readers, the sweep's index), with the same checks: bad input is a
:class:`~fedpcd.errors.UserError` of one line naming the problem and the valid choices.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from fedpcd.config import Config, DatasetConfig, apply_overrides, config_from_dict
from fedpcd.config_input import read_yaml
from fedpcd.errors import UserError, choices, clip, short
from fedpcd.params import SECTIONS, param_spec, type_text
from fedpcd.run_format import RunFiles
from fedpcd.utils import show_path, text_table

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["RunResult", "describe", "load_index", "load_runs", "partition", "run"]


@dataclass(frozen=True, eq=False)
class RunResult:
    """One finished run: its directory, resolved config, summary (summary.json) and per-round metrics
    (metrics.jsonl as a DataFrame: one row per evaluated round, ``round`` first)."""

    run_dir: Path
    config: Config = field(repr=False)
    summary: dict[str, Any] = field(repr=False)
    metrics: pd.DataFrame = field(repr=False)


def _nested(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"local__lr": 0.05, "rounds": 2}`` -> ``{"local": {"lr": 0.05}, "rounds": 2}`` (``__`` nests)."""
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        *parents, leaf = parts = key.split("__")
        if not all(parts):
            raise UserError(f"bad override {short(key)}; '__' separates nested keys, e.g. local__lr=0.05")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {short(key)} conflicts with the override of {short(part)}")
        if isinstance(node.get(leaf), dict):
            raise UserError(f"override {short(key)} conflicts with the overrides of keys inside it")
        node[leaf] = os.fspath(value) if isinstance(value, os.PathLike) else value
    return tree


def _resolve(config: str | os.PathLike[str] | Config | Mapping[str, Any] | None, overrides: dict) -> Config:
    if config is None:
        raw: dict[str, Any] = {}
    elif isinstance(config, (str, os.PathLike)):
        raw = read_yaml(config)
    elif isinstance(config, Config):
        raw = config.to_dict()
    elif isinstance(config, Mapping):
        raw = dict(config)
    else:
        raise UserError(
            f"config must be a YAML file path, a Config, a mapping or None, got {type(config).__name__}"
        )
    return config_from_dict(apply_overrides(raw, _nested(overrides)))


def run(
    config: str | os.PathLike[str] | Config | Mapping[str, Any] | None = None,
    /,
    *,
    progress: bool = False,
    **overrides: Any,
) -> RunResult:
    """Run one experiment, as ``fedpcd run`` does, and return its :class:`RunResult`.

    ``config``: a YAML file, a :class:`~fedpcd.config.Config`, a mapping of config keys, or None (every
    default). ``overrides``: config keys, ``__`` separating nested ones (``local__lr=0.05`` is the command
    line's ``local.lr=0.05``); as there, switching ``algorithm__name`` (or a model name, a partition scheme)
    drops the given section's other keys. The run writes its directory (``output_dir``) as the command line
    does, and refuses one that holds a finished run."""
    from fedpcd.engine import run_experiment
    from fedpcd.report import read_metrics

    resolved = _resolve(config, overrides)
    summary = run_experiment(resolved, progress=progress)
    files = RunFiles(resolved.output_dir)
    return RunResult(files.path, resolved, summary, _frame(read_metrics(files.metrics), ["round"]))


def _frame(rows: list[dict[str, Any]], first: list[str]) -> pd.DataFrame:
    """Rows as a DataFrame: the ``first`` columns (there even without rows), then the others in the order
    they appear (a metric missing from a row is NaN)."""
    import pandas as pd

    frame = pd.DataFrame.from_records(rows)
    return frame.reindex(columns=first + [c for c in frame.columns if c not in first])


def load_runs(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Every finished run (a folder with summary.json) at or under ``path``, as ``fedpcd report`` reads
    them: one row per (run, evaluated round), columns ``run`` (its folder relative to ``path``),
    ``algorithm``, ``dataset``, ``seed``, ``round``, then the metrics of metrics.jsonl under their keys.
    No finished run, or a malformed run file, is a one-line UserError."""
    from fedpcd.report import load_runs as finished_runs

    root = Path(path)
    rows = []
    for found in finished_runs(root):
        dataset = found.config.get("dataset")
        about = {
            "run": found.path.relative_to(root).as_posix(),
            "algorithm": found.config["algorithm"]["name"],
            "dataset": dataset.get("name") if isinstance(dataset, dict) else None,
            "seed": found.config["seed"],
        }
        rows.extend({**about, **record} for record in found.records)
    return _frame(rows, ["run", "algorithm", "dataset", "seed", "round"])


def load_index(sweep_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """A sweep's SQLite index (``<output_dir>/index.sqlite``, or the file itself) as a DataFrame: one row
    per run of the grid, the index's columns (``fedpcd.sweep.INDEX_COLUMNS``: status, algorithm, ..., the
    final and best GA and PA-split, and the config, partition and summary as JSON text), sorted by
    ``output_dir``. Read only; a missing or unreadable index is a one-line UserError."""
    import pandas as pd

    from fedpcd.sweep import INDEX_COLUMNS, INDEX_FILE

    path = Path(sweep_dir)
    index = path / INDEX_FILE if path.is_dir() else path
    if not index.is_file():
        raise UserError(f"no sweep index at {show_path(index)}: a sweep writes <its output_dir>/{INDEX_FILE}")
    query = f"SELECT {', '.join(INDEX_COLUMNS)} FROM runs ORDER BY output_dir"
    try:
        with contextlib.closing(sqlite3.connect(f"{index.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return pd.read_sql_query(query, db)
    except (sqlite3.Error, pd.errors.DatabaseError) as exc:
        raise UserError(f"cannot read the sweep index {show_path(index)}: {clip(str(exc))}") from None


def partition(
    labels: Any,
    scheme: str = "dirichlet",
    clients: int = 10,
    seed: int = 0,
    *,
    num_classes: int | None = None,
    **params: Any,
) -> list[np.ndarray]:
    """The training index arrays of ``clients`` clients (int64, one per client) that a run with this seed,
    scheme and parameters (``params``: the config's ``partition.*`` keys) gives its training labels: the
    engine's own ``make_partition``. ``num_classes`` defaults to 1 + the largest label (a run uses its
    dataset's class count: pass it where a class may be absent from ``labels``)."""
    from fedpcd.data.partition import make_partition

    no_test = np.zeros(0, dtype=np.int64)  # the schemes draw before the test split: it cannot change these
    return make_partition(np.asarray(labels), no_test, clients, scheme, params, seed, num_classes).train


# ----- describe: `fedpcd list NAME` -----------------------------------------------------------------------

_YEAR = re.compile(r"\b(?:19|20)\d\d\b")


def _registries() -> list[tuple[str, Any]]:
    from fedpcd.algorithms import ALGORITHMS
    from fedpcd.data.datasets import DATASETS
    from fedpcd.data.partition import PARTITIONERS
    from fedpcd.models import MODELS

    return [
        ("algorithm", ALGORITHMS),
        ("model", MODELS),
        ("dataset", DATASETS),
        ("partition scheme", PARTITIONERS),
    ]


def _paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring on one line."""
    return " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())


def _citation(text: str) -> str | None:
    """The first parenthesised part of ``text`` that names a year: ``Fan et al., NeurIPS 2023, "..."``."""
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "(":
            if depth == 0:
                start = i + 1
            depth += 1
        elif char == ")" and depth:
            depth -= 1
            if depth == 0 and _YEAR.search(text[start:i]):
                return text[start:i]
    return None


def _paper(obj: Any) -> str:
    """A declared ``paper`` attribute, else the citation in the description, else in the first paragraph of
    the module that defines the component (an algorithm's module opens with its paper)."""
    declared = getattr(obj, "paper", None)
    if isinstance(declared, str):
        return declared
    module = inspect.getmodule(obj)
    return (
        _citation(_paragraph(obj.__doc__)) or _citation(_paragraph(module.__doc__ if module else "")) or "-"
    )


def _default_text(value: Any) -> str:
    """A default as a config file writes it (YAML flow style): ``null``, ``true``, ``''``, ``{beta: 0.2}``."""
    return (
        yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1000)
        .removesuffix("...\n")
        .strip()
    )


def _block(kind: str, name: str, obj: Any) -> str:
    where = f"{obj.__module__}.{obj.__qualname__}"
    lines = [f"{kind} {name} ({where})", f"paper: {_paper(obj)}", f"description: {_paragraph(obj.__doc__)}"]
    if kind == "dataset":
        keys = ", ".join(f"dataset.{k}" for k in DatasetConfig.model_fields if k != "name")
        lines.append(f"parameters: none of its own ({keys} apply to every dataset)")
        return "\n".join(lines)
    spec = param_spec(kind, name, obj)
    if not spec.defaults:
        lines.append("parameters: none")
        return "\n".join(lines)
    defaults = spec.validate({})  # as a config gets them (e.g. longtail's ``then`` with its scheme's)
    rows = [[key, type_text(spec.annotations[key]), _default_text(value)] for key, value in defaults.items()]
    if kind == "algorithm":
        from fedpcd.algorithms.presets import describe_presets

        presets = describe_presets(name)
        if presets:
            lines.append("presets (set as algorithm.preset=<name>; a key set in the config wins):")
            lines.extend(presets)
    lines.append(f"parameters (set as {SECTIONS[kind]}.<parameter>=<value>):")
    lines.extend(line.rstrip() for line in text_table(rows, ["parameter", "type", "default"]).splitlines())
    return "\n".join(lines)


def describe(name: str) -> str:
    """What ``fedpcd list NAME`` prints: each registered algorithm, model, dataset or partition scheme called
    ``name``, with its class or function, paper, one-line description and parameters (type, default). An
    unknown name is a one-line UserError listing the valid ones."""
    registries = _registries()
    blocks = [_block(kind, name, registry.get(name)) for kind, registry in registries if name in registry]
    if not blocks:
        names = {n for _, registry in registries for n in registry.names()}
        raise choices("algorithm, model, dataset or partition scheme", name, sorted(names))
    return "\n\n".join(blocks)

"""The Python API: run experiments and sweeps, read runs, sweep indexes and reports as pandas DataFrames.

```python
import fedpcd

result = fedpcd.run("configs/example.yaml", rounds=2, local__lr=0.05, algorithm__name="fednh")
result.metrics[["round", "global_acc", "personal_acc"]]
runs = fedpcd.load_runs("runs/")  # every finished run below runs/: one row per (run, evaluated round)
parts = fedpcd.partition(labels, "dirichlet", clients=10, seed=0, beta=0.1)
```

Each function goes through the code the command line runs (`load_config`, `run_experiment` and `resume_run`
of `fedpcd.backends`, `run_sweep`, `write_report`, `make_partition`, the report's run readers, the sweep's
index), with the same checks: bad input is a `UserError` of one line naming the problem and the valid choices.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import yaml

from fedpcd.components import default_text, describe
from fedpcd.config import Config
from fedpcd.config_identity import flatten
from fedpcd.config_input import apply_overrides, read_yaml
from fedpcd.config_input import config_path as config_file
from fedpcd.errors import UserError, clip, short
from fedpcd.resolve import config_from_dict, load_run_config
from fedpcd.run_format import RunFiles
from fedpcd.utils import show_path

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Report",
    "RunResult",
    "describe",
    "load_index",
    "load_runs",
    "partition",
    "report",
    "run",
    "sweep",
]


@dataclass(frozen=True, eq=False)
class RunResult:
    """One finished run.

    Attributes:
        run_dir: Its directory (the config's ``output_dir``).
        config: The resolved config it ran with.
        summary: Its summary.json.
        metrics: Its metrics.jsonl as a DataFrame: one row per evaluated round, ``round`` first.
    """

    run_dir: Path
    config: Config = field(repr=False)
    summary: dict[str, Any] = field(repr=False)
    metrics: pd.DataFrame = field(repr=False)


@dataclass(frozen=True, eq=False)
class Report:
    """What ``fedpcd report`` makes of a folder of runs.

    Attributes:
        markdown: The report's markdown, as the command prints it.
        tables: Its tables by the heading above each (``All runs``: a row per setting, its seeds together;
            ``GA (%), mean of the last 5 evaluated rounds``, ... where the runs differ in method and setting):
            the cells as the markdown shows them, columns of plain numbers as numbers (``-``: missing).
    """

    markdown: str = field(repr=False)
    tables: dict[str, pd.DataFrame] = field(repr=False)


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
        raw = read_yaml(config_file(os.fspath(config)))
    elif isinstance(config, Config):
        raw = config.to_dict()
    elif isinstance(config, Mapping):
        raw = dict(config)
    else:
        raise UserError(
            f"config must be a YAML file path, a Config, a mapping or None, got {type(config).__name__}"
        )
    raw = apply_overrides(raw, _nested(overrides))
    return config_from_dict(raw)


def run(
    config: str | os.PathLike[str] | Config | Mapping[str, Any] | None = None,
    /,
    *,
    resume: bool = False,
    progress: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    **overrides: Any,
) -> RunResult:
    """Run one experiment, as ``fedpcd run`` does, and return its `RunResult`.

    The run writes its directory (``output_dir``) as the command line does, and refuses one that already
    holds a run unless ``resume`` is set.

    Args:
        config: A YAML file (or the name of a shipped config, as ``--config`` takes), a `Config`, a
            mapping of config keys, or None (every default). With ``resume``, also a run directory: that
            run continues with its config.yaml, as ``fedpcd run --resume RUN_DIR`` does; ``rounds=N``
            then extends it to N rounds (``fedpcd run --resume RUN_DIR rounds=N``), the same metrics as a
            run of N rounds from the start.
        resume: Continue the run in ``output_dir`` from its last checkpoint (``fedpcd run --resume``'s own
            code); a finished run is returned as it is, a folder without a run starts it. The run there
            must have been made with this config (but for ``output_dir``, ``tracking`` and
            ``engine.workers``).
        progress: Show the command line's progress bar.
        on_round: Called after every evaluated round with its metrics record (the dict written to
            metrics.jsonl), e.g. to plot live in a notebook; an exception it raises stops the run there,
            before that round's checkpoint, so ``resume=True`` continues it. Local backend only.
        **overrides: Config keys, ``__`` separating nested ones (``local__lr=0.05`` is the command line's
            ``local.lr=0.05``); as there, switching ``algorithm__name`` (or a model name, a partition
            scheme) drops the given section's other keys.

    Returns:
        The finished run: its directory, config, summary and per-round metrics.

    Raises:
        UserError: A bad config or override, an output_dir holding a run (of another config, with
            ``resume``), a run that diverged: one line.
    """
    from fedpcd.backends import check_round_callback, resume_run, run_experiment

    changes: list[str] = []
    if resume and isinstance(config, (str, os.PathLike)) and Path(config).is_dir():
        if set(overrides) - {"rounds"}:
            raise UserError(
                "a run directory resumes with its config.yaml as written: of the overrides only rounds=N "
                "(more rounds: the run is extended)"
            )
        changes = _override_items(overrides)
        out = Path(config)
        summary = resume_run(out, progress=progress, on_record=on_round, changes=changes)
    else:
        target = _resolve(config, overrides)
        check_round_callback(target, on_round)
        out = Path(target.output_dir)
        if resume:
            summary = resume_run(target, progress=progress, on_record=on_round)
        else:
            summary = run_experiment(target, progress=progress, on_record=on_round)
    from fedpcd.run_read import read_metrics

    files = RunFiles(out)
    # the config the run was made with, as its folder holds it (a resumed run's may predate today's keys)
    used = load_run_config(files.config, [f"output_dir={out}"])
    return RunResult(files.path, used, summary, _frame(read_metrics(files.metrics), ["round"]))


def _override_items(overrides: Mapping[str, Any] | None) -> list[str]:
    """``{"local.lr": 0.05}`` (or ``local__lr``) as the command line's ``["local.lr=0.05"]``."""
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise UserError(
            f"overrides must be a mapping of config keys to values, got {type(overrides).__name__}"
        )
    items = []
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise UserError(f"override keys are dotted config keys (text), got {short(key)}")
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        try:
            text = default_text(value)
        except yaml.YAMLError:
            raise UserError(f"override {short(key)}: {type(value).__name__} is not a config value") from None
        items.append(f"{key.replace('__', '.')}={text}")
    return items


def sweep(
    config_path: str | os.PathLike[str],
    *,
    jobs: int | Literal["auto"] = 1,
    overrides: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """Run a sweep file's grid, as ``fedpcd sweep`` does, and return its index.

    Finished runs are skipped, stopped ones resumed; progress lines are printed as on the command line.

    Args:
        config_path: A sweep file: a config with a top-level ``sweep:`` mapping of keys to lists of values
            (or a shipped one's name, e.g. ``headline/fednh-fmnist``).
        jobs: Runs in parallel (processes; 1: one after another in this process, which also runs
            algorithms and models registered only here); ``"auto"``: as ``fedpcd sweep`` by default, as many
            as the machine's cores hold.
        overrides: Config keys (dotted, or with ``__``) and values applied to every run, e.g.
            ``{"rounds": 2, "local.lr": 0.05}``.

    Returns:
        The sweep's index (`load_index`): one row per run of the grid.

    Raises:
        UserError: A bad sweep file or override; a run that failed or could not run (the others ran;
            `load_index` reads the index, calling `sweep` again retries them).
    """
    from fedpcd.sweep.index import index_path
    from fedpcd.sweep.run import run_sweep

    if jobs != "auto" and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise UserError(f"jobs must be a whole number >= 1 or 'auto', got {short(jobs)}")
    items = _override_items(overrides)
    path = config_file(os.fspath(config_path))
    run_sweep(path, items, jobs=jobs)
    return load_index(index_path(path, items))


def _tables(markdown: str) -> dict[str, pd.DataFrame]:
    """The pipe tables of a report's markdown by the ``##`` heading above each (``All runs`` before any)."""
    import pandas as pd

    tables: dict[str, pd.DataFrame] = {}
    heading, rows = "All runs", []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if rows:
            header, _, *body = rows  # the second row is the |---| rule
            frame = pd.DataFrame(body, columns=header)
            for i in range(frame.shape[1]):
                with contextlib.suppress(ValueError, TypeError):  # text stays text
                    frame.isetitem(i, pd.to_numeric(frame.iloc[:, i].replace("-", None)))
            tables[heading] = frame
            rows = []
        if line.startswith("## "):
            heading = line[3:].strip()
    return tables


def report(
    path: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    paired_with: str | None = None,
    last: int = 5,
    rounds_to: Sequence[float] = (),
    swing: bool = False,
    best: bool = False,
    geometry: bool = False,
    title: str | None = None,
    notes: str | os.PathLike[str] | None = None,
) -> Report:
    """The report of the finished runs below ``path``, as ``fedpcd report`` makes it.

    Args:
        path: A folder searched for run directories (a sweep's output_dir, an archive, one run).
        out: Also write the report there, with its figures, as ``fedpcd report --out`` does: a folder
            (report.md inside) or a .md file (figures in the folder of the same name beside it).
        paired_with: An algorithm: add GA and PA-split differences to its run of the same setting and seed.
        last: Average each run over its last ``last`` evaluated rounds.
        rounds_to: Add columns R<x>%: the first round at which GA reaches x%.
        swing: Add GA's max - min over the last rounds (``--swing``).
        best: Add each run's best GA over all rounds (``--best``).
        geometry: Add class-mean angles (``--geometry``): those a run recorded (``geometry: true``), else
            rebuilt from its checkpoint.
        title: A ``# TITLE`` heading on top of the markdown.
        notes: A markdown file put under the title.

    Returns:
        The markdown and its tables as DataFrames.

    Raises:
        UserError: No finished run below ``path``, a malformed run file, an unwritable ``out``, a bad option.
    """
    from fedpcd.report.document import write_report

    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise UserError(f"last must be a whole number >= 1, got {short(last)}")
    try:
        targets = [float(x) for x in rounds_to]
    except (TypeError, ValueError):
        raise UserError(f"rounds_to must be a list of accuracies in %, got {short(rounds_to)}") from None
    text = write_report(
        path,
        out,
        last=last,
        rounds_to=targets,
        paired_with=paired_with,
        with_swing=swing,
        geometry=geometry,
        with_best=best,
        title=title,
        notes=notes,
    )
    return Report(text, _tables(text))


def _frame(rows: list[dict[str, Any]], first: list[str]) -> pd.DataFrame:
    """Rows as a DataFrame: the ``first`` columns (there even without rows), then the others in the order
    they appear (a metric missing from a row is NaN)."""
    import pandas as pd

    frame = pd.DataFrame.from_records(rows)
    return frame.reindex(columns=first + [c for c in frame.columns if c not in first])


# metrics.jsonl keys that are also config keys: in load_runs the config's value is under config.<key>
_RECORD_KEYS = ("clients",)  # a record's: the round's participants; the config's: how many clients there are


def _config_columns(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config as columns: dotted keys (``local.lr``), lists and mappings as JSON text."""
    return {
        f"config.{key}" if key in _RECORD_KEYS else key: json.dumps(value)
        if isinstance(value, (list, dict))
        else value
        for key, value in flatten(config).items()
        if key != "seed"  # a column already
    }


def load_runs(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Every finished run (a folder with summary.json) at or under ``path``, as ``fedpcd report`` reads them.

    Args:
        path: A folder of runs (searched recursively) or one run directory.

    Returns:
        One row per (run, evaluated round). Columns: ``run`` (its folder relative to ``path``),
            ``algorithm``, ``dataset``, ``seed``, ``round``, ``setting`` (the name ``fedpcd report`` on the
            run's folder gives its setting among the runs beside it, e.g. those of its sweep: P10C2, Dir(0.1),
            ..., with the keys that set it apart, e.g. ``Dir(0.3) K=100 participation=0.1``); then the
            metrics of metrics.jsonl under their keys (a metric a round lacks is NaN); then the run's resolved
            config under dotted keys (``algorithm.name``, ``local.lr``, ``partition.beta``, ...; lists and
            mappings as JSON text; the number of clients is ``config.clients``, as ``clients`` is the round's
            participants).

    Raises:
        UserError: No finished run, or a malformed run file: one line naming it.
    """
    from fedpcd.report.grid import build_grid
    from fedpcd.report.read import Run
    from fedpcd.report.read import load_runs as finished_runs

    root = Path(path)
    found = finished_runs(root)
    folders: dict[Path, list[Run]] = {}
    for run in found:  # a sweep's runs: the folders in its output_dir
        folders.setdefault(run.path.parent, []).append(run)
    settings = {
        id(run): setting
        for runs in folders.values()
        for (_, setting), cell in build_grid(runs).cells.items()
        for run in cell
    }
    rows, config_keys = [], {}
    for run in found:
        dataset = run.config.get("dataset")
        about = {
            "run": run.path.relative_to(root).as_posix(),
            "algorithm": run.config["algorithm"]["name"],
            "dataset": dataset.get("name") if isinstance(dataset, dict) else None,
            "seed": run.config["seed"],
            "setting": settings[id(run)],
        }
        config = _config_columns(run.config)
        config_keys.update(dict.fromkeys(config))
        rows.extend({**about, **record, **config} for record in run.records)
    frame = _frame(rows, ["run", "algorithm", "dataset", "seed", "round", "setting"])
    return frame[[c for c in frame.columns if c not in config_keys] + list(config_keys)]


def load_index(sweep_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """A sweep's SQLite index as a DataFrame (read only).

    Args:
        sweep_dir: The sweep's output_dir (holding index.sqlite), or the index file itself.

    Returns:
        One row per run of the grid, sorted by ``output_dir``, with the index's columns
            (``fedpcd.sweep.index.INDEX_COLUMNS``: status, algorithm, ..., the final and best GA and PA-split,
            and the config, partition and summary as JSON text).

    Raises:
        UserError: A missing or unreadable index, or a row with a value out of its schema
            (``fedpcd.run_schema.IndexRow``), naming the row and the field.
    """
    import pandas as pd

    from fedpcd.run_schema import IndexRow, check
    from fedpcd.sweep.index import INDEX_COLUMNS, INDEX_FILE

    path = Path(sweep_dir)
    index = path / INDEX_FILE if path.is_dir() else path
    if not index.is_file():
        raise UserError(f"no sweep index at {show_path(index)}: a sweep writes <its output_dir>/{INDEX_FILE}")
    query = f"SELECT {', '.join(INDEX_COLUMNS)} FROM runs ORDER BY output_dir"
    try:
        with contextlib.closing(sqlite3.connect(f"{index.resolve().as_uri()}?mode=ro", uri=True)) as db:
            rows = db.execute(query).fetchall()
    except sqlite3.Error as exc:
        raise UserError(f"cannot read the sweep index {show_path(index)}: {clip(str(exc))}") from None
    for row in rows:  # each row's values within the schema's bounds before they reach a table
        check(
            IndexRow,
            dict(zip(INDEX_COLUMNS, row, strict=True)),
            f"sweep index {show_path(index)} row {row[0]!r}",
        )
    return pd.DataFrame.from_records(rows, columns=list(INDEX_COLUMNS), coerce_float=True)


def partition(
    labels: Any,
    scheme: str = "dirichlet",
    clients: int = 10,
    seed: int = 0,
    *,
    num_classes: int | None = None,
    **params: Any,
) -> list[np.ndarray]:
    """The clients' training indices that a run with this seed, scheme and parameters gives its labels.

    This is the engine's own ``make_partition``.

    Args:
        labels: The training labels (integers from 0), e.g. a dataset's targets.
        scheme: A registered partition scheme (``fedpcd list`` names them).
        clients: The number of clients.
        seed: The run's seed.
        num_classes: The number of classes; None: 1 + the largest label (a run uses its dataset's class
            count: pass it where a class may be absent from ``labels``).
        **params: The scheme's parameters (the config's ``partition.*`` keys), e.g. ``beta=0.1``.

    Returns:
        One int64 array of indices into ``labels`` per client.

    Raises:
        UserError: An unknown scheme or parameter, a bad value, labels the scheme cannot split.
    """
    from fedpcd.data.partition import make_partition

    no_test = np.zeros(0, dtype=np.int64)  # the schemes draw before the test split: it cannot change these
    return make_partition(np.asarray(labels), no_test, clients, scheme, params, seed, num_classes).train

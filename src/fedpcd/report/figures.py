"""The report's figures: accuracy over rounds, one line per setting (``plot_curves``) or one plot per setting
(one line per method, the band spanning the seeds), the global model's accuracy per class as heatmaps
(methods x classes per setting, rounds x classes per run), and the partitions' client x class counts (from
the runs' partition.json, no data needed).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fedpcd.errors import UserError
from fedpcd.procs_guard import die_with_parent, starting_children, unblock_ctrl_c
from fedpcd.report.grid import Grid
from fedpcd.report.groups import group_runs, method_columns
from fedpcd.report.read import Run
from fedpcd.run_format import HEADLINE, RunFiles
from fedpcd.utils import atomic_write, read_json, show_path

# Below this many figures per process, drawing them all here is faster than starting worker processes (each
# imports Matplotlib: about 1.5 s of CPU, where a figure of a large report takes 1-2 s).
FIGURES_PER_PROCESS = 3

Job = tuple[Callable[..., Any], tuple[Any, ...]]  # a figure to draw: function(*args) writes it


def _start_drawer(parent: int) -> None:
    unblock_ctrl_c(signal.SIG_IGN)  # Ctrl-C is the report's: it stops the drawing
    die_with_parent(parent)


@contextlib.contextmanager
def drawing(jobs: Sequence[Job], workers: int = 1) -> Iterator[Callable[[], list[Any]]]:
    """Start drawing the figures of ``jobs`` (``function(*args)`` each writes one); yields the function that
    waits for them and returns each job's result, in order. They are drawn in up to ``workers`` worker
    processes while the block goes on, as many as have ``FIGURES_PER_PROCESS`` figures each, if that is 2 or
    more; else here, when the results are asked for. The figures are the same bytes either way; while they are
    awaited, a progress bar on a terminal counts the figures done. On leaving the block (a Ctrl-C or a stop
    signal included) the workers finish the figure each is drawing and the rest are cancelled; a figure whose
    worker died is drawn here. Worker processes are spawned: a Python script that asks for them needs the
    ``if __name__ == "__main__":`` guard (its main module is imported again in each)."""
    processes = min(workers, len(jobs) // FIGURES_PER_PROCESS)
    if processes < 2:
        yield lambda: [function(*args) for function, args in _counted(jobs)]
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(
        processes,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_drawer,
        initargs=(os.getpid(),),
    )

    def results() -> list[Any]:
        out = []
        for future, (function, args) in _counted(list(zip(futures, jobs, strict=True))):
            try:
                out.append(future.result())
            except BrokenProcessPool:  # its worker died (out of memory, killed)
                out.append(function(*args))
        return out

    try:
        with starting_children():
            futures = [pool.submit(function, *args) for function, args in jobs]
        yield results
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _counted(items: Sequence[Any]) -> Iterable[Any]:
    """``items`` counted by a progress bar on a terminal (``disable=None``: none in a pipe or a log), advanced
    as each figure is done: a large report's figures take a while."""
    from tqdm import tqdm

    return tqdm(items, desc="figures", unit="figure", leave=False, disable=None)


def setting_grid(grid: Grid, setting: str) -> Grid:
    """The part of ``grid`` in one setting (every method kept, in order): what its figures read, and all a
    worker process drawing them is sent."""
    cells = {key: runs for key, runs in grid.cells.items() if key[1] == setting}
    return Grid(list(grid.methods), [setting], cells)


def slug(text: str) -> str:
    """A file-name-safe form of a setting name."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text).strip("_")


def plot_setting_curves(grid: Grid, setting: str, path: str | Path) -> None:
    """GA and PA-split over rounds in one setting: one line per method (mean over seeds), the band spans the
    seeds (min to max), colours from tab20 with two line styles so 40 methods stay distinguishable, the
    first (reference) method in thick black."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 5.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    colours = colormaps["tab20"].colors
    lw = 1.4 if len(grid.methods) <= 12 else 1.0
    for ax, metric in zip(axes, HEADLINE, strict=False):
        for i, method in enumerate(grid.methods):
            members = grid.runs(method, setting)
            by_round: dict[int, list[float]] = {}
            for run in members:
                for r in run.records:
                    if r.get(metric.key) is not None:
                        by_round.setdefault(r["round"], []).append(100 * r[metric.key])
            if not by_round:
                continue
            rounds = sorted(by_round)
            style = {"color": colours[i % 20], "linestyle": "-" if i < 20 else "--", "lw": lw}
            if i == 0:  # the reference method (FedAvg) stands out
                style = {"color": "black", "linestyle": "-", "lw": 2.2}
            ax.plot(rounds, [statistics.fmean(by_round[t]) for t in rounds], label=method, **style)
            if len(members) > 1:
                low = [min(by_round[t]) for t in rounds]
                high = [max(by_round[t]) for t in rounds]
                ax.fill_between(rounds, low, high, color=style["color"], alpha=0.15, lw=0)
        if ax.has_data():
            ax.set_title(f"{setting}: {metric.label}")
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(f"{metric.label} (%)")
            ax.grid(alpha=0.3)
    handles, labels = axes[1].get_legend_handles_labels()
    if len(labels) < len(axes[0].get_legend_handles_labels()[1]):
        handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7, ncols=1 + len(labels) // 26)
    fig.set_layout_engine("constrained")
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=100, metadata={"Software": None}), "wb")


def partition_counts(run: Run) -> list[list[int]] | None:
    """The run's client x class train counts from its partition.json (None if the file is missing); a
    malformed file is one line naming it."""
    path = RunFiles(run.path).partition
    if not path.exists():
        return None
    data = read_json(path, "partition file")
    clients = data.get("clients") if isinstance(data, dict) else None
    counts = [c.get("train_counts") if isinstance(c, dict) else None for c in clients or []]
    if (
        not counts
        or not all(isinstance(row, list) and row for row in counts)
        or len({len(row) for row in counts}) != 1
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for row in counts for v in row)
    ):
        raise UserError(
            f"partition file {show_path(path)} is not a fedpcd partition: expected "
            '{"clients": [{"train_counts": [...]}, ...]} with one count >= 0 per class for every client'
        )
    return counts


def last_class_accuracy(run: Run, key: str) -> list | None:
    """``key`` (``global_class_acc`` or ``client_class_acc``) of the run's last evaluated round having it."""
    return next((r[key] for r in reversed(run.records) if r.get(key) is not None), None)


def plot_heatmap(rows: list[str], matrix: list[list[float | None]], path: str | Path, title: str) -> None:
    """A rows x classes accuracy heatmap in % (blank where there is no value), values printed when small."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = np.array([[np.nan if v is None else 100 * v for v in row] for row in matrix], dtype=float)
    num_rows, num_classes = data.shape
    size = (min(3.5 + 0.5 * num_classes, 16), min(max(2.4, 1.5 + 0.3 * num_rows), 14))
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=100)
    ax.set_yticks(range(num_rows), rows, fontsize=8)
    ax.set_xlabel("class")
    ax.set_title(title, fontsize=10)
    if num_classes <= 30:
        ax.set_xticks(range(num_classes))
    if num_rows * num_classes <= 800:
        # each value inside its cell: the layout need not measure them (about 1/7 of a heatmap's time)
        cell = {"ha": "center", "va": "center", "fontsize": 6, "in_layout": False}
        for i in range(num_rows):
            for c in range(num_classes):
                if not np.isnan(data[i, c]):
                    colour = "black" if data[i, c] > 60 else "white"
                    ax.text(c, i, f"{data[i, c]:.0f}", color=colour, **cell)
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=100, metadata={"Software": None}), "wb")


def setting_class_heatmap(grid: Grid, setting: str, path: str | Path) -> bool:
    """Methods x classes: the global model's accuracy on each class of the test set at each run's last
    evaluated round, mean over seeds (which classes each method loses under this skew). False: no data."""
    import numpy as np

    rows, matrix = [], []
    for method in grid.methods:
        per_seed = [
            v for v in (last_class_accuracy(r, "global_class_acc") for r in grid.runs(method, setting)) if v
        ]
        if per_seed:
            values = np.array([[np.nan if x is None else x for x in v] for v in per_seed], dtype=float)
            rows.append(method)
            matrix.append([None if np.isnan(x) else float(x) for x in np.nanmean(values, axis=0)])
    if not rows:
        return False
    if len({len(row) for row in matrix}) > 1:
        raise UserError(
            f"the runs of setting {setting!r} record accuracy per class for different numbers of classes "
            f"({', '.join(str(len(row)) for row in matrix)}); are they runs of one dataset?"
        )
    plot_heatmap(rows, matrix, path, f"{setting}: global model, accuracy per class (last evaluated round)")
    return True


def run_class_heatmap(run: Run, path: str | Path) -> bool:
    """One run: the global model's accuracy on each class (columns) at each evaluated round (rows), how
    classes are learnt and forgotten under label skew. False when the run recorded none (no global model, or
    a run written before ``global_class_acc`` existed)."""
    rows = [r for r in run.records if r.get("global_class_acc") is not None]
    if not rows:
        return False
    title = f"{show_path(run.path.name)}: global model, accuracy per class and round"
    plot_heatmap([f"round {r['round']}" for r in rows], [r["global_class_acc"] for r in rows], path, title)
    return True


def plot_curves(runs: list[Run], path: str | Path) -> None:
    """GA and PA-split over rounds, mean over seeds, one line per setting."""
    import pandas as pd
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    varying, groups = group_runs(runs)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for key, members in groups.items():
        label = ", ".join(method_columns(varying, key, members[0]).values()) or "run"
        records = pd.DataFrame.from_records([r for run in members for r in run.records])
        for ax, metric in zip(axes, HEADLINE, strict=False):
            values = records.reindex(columns=["round", metric.key]).dropna()
            means = values.groupby("round")[metric.key].agg(statistics.fmean)  # over the seeds, by round
            if len(means):  # a method without this metric (no global model: no GA) gets no line and no entry
                ax.plot(means.index, 100 * means, label=label)
            ax.set_title(metric.label)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
            ax.set_ylabel("accuracy (%)")
    for ax in axes:
        if ax.has_data():
            ax.legend(fontsize=7)
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110), mode="wb")

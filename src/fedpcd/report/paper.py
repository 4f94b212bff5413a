"""The papers' tables of many runs: methods as rows, settings as columns (``fedpcd.report.grid``).

A cell is mean ± std over seeds of a per-run value, either the mean over the run's last ``last`` evaluated
rounds ("last") or its best evaluated round ("best"); the best method of each column is in bold, "(n)"
follows a cell with fewer seeds than the table's fullest cell, and an arrow marks a method whose paired
difference to the reference method (same setting and seed: same partition and initial weights) exceeds the
paired t-test (``fedpcd.report.verdict.separation``).

Also here: the communication view of FedMR's and FedSC's tables (rounds and megabytes each method needs to
reach the reference method's best GA of the same setting and seed), the mean ranks, the legend and reading
text generated from the runs, a CSV of every cell, and the document's sections, which link the figures of
``fedpcd.report.figures``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpcd.config_identity import run_setting
from fedpcd.report.figures import (
    Job,
    drawing,
    partition_counts,
    plot_setting_curves,
    setting_class_heatmap,
    setting_grid,
    slug,
)
from fedpcd.report.grid import PROTOCOLS, Grid, cell_means, cell_values, is_reference, run_value
from fedpcd.report.groups import paired_run, without_algorithm
from fedpcd.report.read import DIVERGED, Run, flatten, read_stopped
from fedpcd.report.stats import last_rounds_phrase, mean_bytes, mean_std, swing
from fedpcd.report.verdict import critical_t, separation
from fedpcd.run_format import GA, HEADLINE, REPORTED, RunFiles
from fedpcd.utils import atomic_write_text

if TYPE_CHECKING:
    import pandas as pd

ARROWS = {1: "↑", -1: "↓"}


def _reference_runs(grid: Grid, reference: str) -> dict[str, Run]:
    """The runs of ``reference``'s method(s) by their whole setting and seed (``without_algorithm``)."""
    return {
        without_algorithm(run): run
        for (method, _), members in grid.cells.items()
        if is_reference(method, reference)
        for run in members
    }


def paired_differences(
    grid: Grid, metric: str, protocol: str, last: int, reference: str = "fedavg"
) -> dict[tuple[str, str], list[float]]:
    """Per cell of a method other than ``reference``: each seed's value of ``metric`` minus that of the
    ``reference`` run of the same setting and seed (same partition and initial weights), which removes the
    spread the seeds share; seeds without such a pair or a value are left out, cells left with none too."""
    refs = _reference_runs(grid, reference)
    out = {}
    for (method, setting), members in grid.cells.items():
        if is_reference(method, reference):
            continue
        diffs = []
        for run in members:
            ref = paired_run(run, refs)
            mine = run_value(run, metric, protocol, last)
            theirs = run_value(ref, metric, protocol, last) if ref is not None else None
            if mine is not None and theirs is not None:
                diffs.append(mine - theirs)
        if diffs:
            out[(method, setting)] = diffs
    return out


def seeds_cell(values: Sequence[float], most: int, signed: bool = False) -> str:
    """``mean_std`` of a cell, followed by "(n)" when it has n seeds, fewer than ``most`` (the table's
    fullest cell)."""
    text = mean_std(list(values), signed=signed)
    return f"{text} ({len(values)})" if values and len(values) < most else text


def pivot_table(grid: Grid, metric: str, protocol: str, last: int, reference: str = "fedavg") -> str:
    """Markdown: methods x settings, mean ± std over seeds in %, the column's best mean in bold, "(n)" after a
    cell with fewer seeds than the fullest, ↑ / ↓ after a method ``separation`` puts above / below
    ``reference`` (``paired_differences``)."""
    values = cell_values(grid, metric, protocol, last)
    diffs = paired_differences(grid, metric, protocol, last, reference)
    most = max((len(v) for v in values.values()), default=0)
    means = cell_means(grid, metric, protocol, last)
    best = means.max()  # per setting
    lines = [
        "| method | " + " | ".join(grid.settings) + " |",
        "|---|" + "---|" * len(grid.settings),
    ]
    for method in grid.methods:
        cells = []
        for setting in grid.settings:
            vals = values.get((method, setting))
            text = seeds_cell(vals or [], most)
            if means.at[method, setting] == best[setting]:  # NaN (no value) equals nothing
                text = f"**{text}**"
            arrow = ARROWS.get(separation(diffs.get((method, setting), [])))
            cells.append(f"{text} {arrow}" if arrow else text)
        if any(c != "-" for c in cells):
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def difference_table(grid: Grid, metric: str, protocol: str, last: int, reference: str = "fedavg") -> str:
    """Markdown: methods x settings, the ``paired_differences`` to ``reference`` in points, mean ± std over
    the paired seeds, "(n)" and ↑ / ↓ as in ``pivot_table``."""
    diffs = paired_differences(grid, metric, protocol, last, reference)
    most = max((len(v) for v in diffs.values()), default=0)
    lines = ["| method | " + " | ".join(grid.settings) + " |", "|---|" + "---|" * len(grid.settings)]
    for method in grid.methods:
        cells = []
        for setting in grid.settings:
            vals = diffs.get((method, setting), [])
            arrow = ARROWS.get(separation(vals))
            text = seeds_cell(vals, most, signed=True)
            cells.append(f"{text} {arrow}" if arrow else text)
        if any(c != "-" for c in cells):
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def separated_settings(
    grid: Grid, metric: str, last: int, reference: str = "fedavg"
) -> dict[str, dict[int, list[str]]]:
    """Per method, the settings where ``separation`` of its last-rounds ``paired_differences`` is +1 / -1."""
    out: dict[str, dict[int, list[str]]] = {}
    for (method, setting), diffs in paired_differences(grid, metric, "last", last, reference).items():
        sign = separation(diffs)
        if sign:
            out.setdefault(method, {1: [], -1: []})[sign].append(setting)
    for sides in out.values():
        for settings in sides.values():
            settings.sort(key=grid.settings.index)
    return out


def _setting_key(config: dict) -> str:
    """A run's setting apart from its algorithm and seed (runs equal in it share a column of the grid)."""
    flat = flatten(run_setting(config))
    keep = {k: v for k, v in flat.items() if not k.startswith("algorithm.") and k != "seed"}
    return json.dumps(keep, sort_keys=True, default=str)


def _method_key(config: dict) -> str:
    return json.dumps(config.get("algorithm"), sort_keys=True, default=str)


def diverged_cells(grid: Grid) -> set[tuple[str, str]]:
    """The (method, setting) cells of ``grid`` with a run stopped by divergence: a run folder beside the
    grid's runs (in a folder holding one of them) without summary.json whose stopped.json names a
    ``DivergenceError``.
    Its method and setting are those of the grid's finished runs with the same algorithm section and the same
    setting (``_setting_key``); a stopped run matching no method or no setting of the grid is not placed."""

    methods, settings, folders = {}, {}, set()
    for (method, setting), members in grid.cells.items():
        for run in members:
            methods[_method_key(run.config)] = method
            settings[_setting_key(run.config)] = setting
            if run.path.is_dir():
                folders.add(run.path.parent)
    cells = set()
    beside = (RunFiles(p) for folder in sorted(folders) for p in sorted(folder.iterdir()) if p.is_dir())
    for stopped in filter(None, map(read_stopped, beside)):
        if not stopped.diverged:
            continue
        method = methods.get(_method_key(stopped.config))
        setting = settings.get(_setting_key(stopped.config))
        if method is not None and setting is not None:
            cells.add((method, setting))
    return cells


def mean_ranks(
    grid: Grid, metric: str, protocol: str, last: int, diverged: set[tuple[str, str]] | None = None
) -> dict[str, list[float]]:
    """Per method, its rank in each setting where it has a value (1 = the best mean over seeds; ties share
    the mean of their ranks). A method with a run stopped by divergence in a setting (``diverged_cells``)
    ranks last there, whatever its other seeds reached (several such methods share the last ranks); only for
    a metric the method reports somewhere (a method without a global model gets no GA rank). ``diverged``:
    ``diverged_cells(grid)`` where the caller has it already (it reads the stopped runs beside the grid's)."""
    means = cell_means(grid, metric, protocol, last)
    has_metric = means.notna().any(axis=1)
    for method, setting in diverged_cells(grid) if diverged is None else diverged:
        if method in means.index and setting in means.columns and has_metric[method]:
            means.loc[method, setting] = -math.inf
    ranks = means.rank(ascending=False)  # each setting on its own
    return {method: row.dropna().tolist() for method, row in ranks.iterrows() if row.notna().any()}


def _separated_text(sides: dict[int, list[str]] | None) -> str:
    """ "↑2 ↓1": in how many settings a method is separated above / below the reference ("-": none)."""
    counts = [f"{ARROWS[sign]}{len(sides[sign])}" for sign in (1, -1) if sides and sides[sign]]
    return " ".join(counts) or "-"


def ranking_table(grid: Grid, last: int, reference: str = "fedavg") -> str | None:
    """Markdown: every method's mean rank over the settings, for GA and PA-split (last-N protocol), each
    followed by the number of settings where ``separation`` puts the method above / below ``reference``;
    best first: by GA rank, then the methods without a global model by PA rank. None for a single setting."""
    if len(grid.settings) < 2:
        return None
    diverged = diverged_cells(grid)
    ranks = [mean_ranks(grid, m.key, "last", last, diverged) for m in HEADLINE]
    separated = [separated_settings(grid, m.key, last, reference) for m in HEADLINE]
    rows = []
    for method in grid.methods:
        means = [statistics.fmean(r[method]) if r.get(method) else float("inf") for r in ranks]
        texts = []
        for mean, rank, marks in zip(means, ranks, separated, strict=True):
            if not rank.get(method):
                texts += ["-", "-"]
            else:
                vs = "reference" if is_reference(method, reference) else _separated_text(marks.get(method))
                texts += [f"{mean:.1f} ({len(rank[method])})", vs]
        if any(t != "-" for t in texts):
            rows.append(((*means, method), f"| {method} | " + " | ".join(texts) + " |"))
    header = "| method | " + " | ".join(
        f"{m.label} mean rank (settings) | {m.label} ↑/↓ vs {reference} (settings)" for m in HEADLINE
    )
    return "\n".join(
        [header + " |", "|---" * (1 + 2 * len(HEADLINE)) + "|"] + [line for _, line in sorted(rows)]
    )


def communication_table(grid: Grid, reference: str = "fedavg") -> str | None:
    """Markdown: per method and setting, the rounds and megabytes (up + down) to reach the best GA of the
    ``reference`` run of the same setting and seed. Rounds are evaluated rounds (resolution ``eval_every``);
    megabytes are the mean traffic of an evaluated round times those rounds. None without reference runs."""
    refs = _reference_runs(grid, reference)
    if not refs:
        return None
    lines = ["| method | " + " | ".join(grid.settings) + " |", "|---|" + "---|" * len(grid.settings)]
    for method in grid.methods:
        cells = []
        for setting in grid.settings:
            reached, tried = [], 0
            for run in grid.runs(method, setting):
                ref = paired_run(run, refs)
                target = run_value(ref, GA.key, "best", 0) if ref is not None else None
                if target is None or all(r.get(GA.key) is None for r in run.records):
                    continue
                tried += 1
                first = next((r["round"] for r in run.records if (r.get(GA.key) or -1.0) >= target), None)
                if first is not None:
                    per_round = mean_bytes(run.records, "bytes_up") + mean_bytes(run.records, "bytes_down")
                    reached.append((first, first * per_round / 1e6))
            if not tried:
                cells.append("")
            elif not reached:
                cells.append("-")
            else:
                text = (
                    f"{statistics.fmean(r for r, _ in reached):.0f} "
                    f"({statistics.fmean(mb for _, mb in reached):.1f} MB)"
                )
                cells.append(text if len(reached) == tried else f"{text} [{len(reached)}/{tried}]")
        if any(cells):
            lines.append(f"| {method} | " + " | ".join(c or "n/a" for c in cells) + " |")
    return "\n".join(lines)


def cells_csv(grid: Grid, last: int) -> str:
    """CSV, one row per method and setting: seeds, then mean and std of every metric under both protocols."""
    import pandas as pd

    per_run = pd.DataFrame(
        {
            "method": method,
            "setting": setting,
            **{f"{m.key}_{p}": run_value(run, m.key, p, last) for m in REPORTED for p in PROTOCOLS},
        }
        for method in grid.methods
        for setting in grid.settings
        for run in grid.runs(method, setting)
    )
    values = per_run.columns[2:]
    per_run[values] = per_run[values].astype(float)  # a metric no run has: NaN, not None
    cells = per_run.groupby(["method", "setting"], sort=False).agg(
        seeds=("method", "size"),
        **{f"{c}_{stat}": (c, how) for c in values for stat, how in (("mean", _mean), ("std", _std))},
    )
    return cells.to_csv(float_format="%.6f", lineterminator="\n")


def _mean(values: pd.Series) -> float:
    """``statistics.fmean`` of the values there are (NaN: none), as ``mean_std`` prints them."""
    present = values.dropna().tolist()
    return statistics.fmean(present) if present else math.nan


def _std(values: pd.Series) -> float:
    """``statistics.stdev`` of the values there are (NaN: fewer than two), as ``mean_std`` prints them."""
    present = values.dropna().tolist()
    return statistics.stdev(present) if len(present) > 1 else math.nan


def seeds_phrase(grid: Grid) -> str:
    """'1 seed in every cell' or 'n = 1-3 seeds per cell (the table's (n) marks the cells with fewer)'."""
    counts = sorted({len(members) for members in grid.cells.values()})
    if len(counts) == 1:
        return f"{counts[0]} seed{'s' if counts[0] > 1 else ''} in every cell"
    return f"n = {counts[0]}-{counts[-1]} seeds per cell (the tables' (n) marks the cells with fewer)"


def legend(grid: Grid, reference: str = "fedavg") -> str:
    """How the tables' cells, counts and arrows are made, and the limits of the arrows."""
    return (
        f"Cells: mean ± std over seeds ({seeds_phrase(grid)}; a single value: one seed). ↑ / ↓: the "
        f"method's paired difference to {reference} (each seed's run minus the {reference} run of the "
        "same setting and seed: same partition and initial weights) separates from zero by a two-sided "
        "paired t-test at the 5% level with n - 1 degrees of freedom over its n >= 2 paired seeds "
        f"(|t| > {critical_t(2):.2f} for n = 2, {critical_t(3):.2f} for n = 3, "
        f"{critical_t(5):.2f} for n = 5); with one seed "
        "nothing is marked. Over many methods and settings some marks are expected by chance; the std "
        "sees only what changes with the seed (partition, initial weights, sampling), not the test set, "
        "the budget or the host's floating-point path. Mean ranks order means; two ranks apart are not "
        "thereby separated (only the arrows "
        "against the reference are)."
    )


def reading(grid: Grid, last: int, reference: str = "fedavg") -> str:
    """The reading paragraph, generated from the runs: the seeds behind the cells, how far the reference
    method's own GA moves between its last evaluated rounds, and, per headline metric, the methods
    ``separation`` puts above or below ``reference`` and where (nothing else is claimed)."""
    sentences = [f"{seeds_phrase(grid).capitalize()}."]
    swings = [
        (value, setting, run.config.get("seed"))
        for (method, setting), members in grid.cells.items()
        if is_reference(method, reference)
        for run in members
        if (value := swing(run.records, GA.key, last)) is not None
    ]
    if swings:
        value, setting, seed = max(swings, key=lambda x: x[0])
        sentences.append(
            f"{reference}'s own GA moves by up to {100 * value:.2f} points between its last "
            f"{min(last, max(len(r.records) for m in grid.cells.values() for r in m))} evaluated rounds "
            f"({setting}, seed {seed}): single runs a few points apart are not separated."
        )
    most = max((len(members) for members in grid.cells.values()), default=0)
    if most < 2:
        sentences.append(
            f"With one seed per cell no difference to {reference} is marked: the tables and mean ranks "
            "describe single runs and separate no method from another."
        )
        return " ".join(sentences)
    for metric in HEADLINE:
        marks = separated_settings(grid, metric.key, last, reference)
        sides = []
        for sign, word in ((1, "above"), (-1, "below")):
            named = [f"{m} ({', '.join(v[sign])})" for m, v in marks.items() if v[sign]]
            if named:
                sides.append(f"{word} it: {'; '.join(named)}")
        if sides:
            sentences.append(f"{metric.label}, separated from {reference} (↑ / ↓): {' / '.join(sides)}.")
        else:
            sentences.append(f"{metric.label}: no method is separated from {reference}.")
    sentences.append(
        "No other difference is marked: it is within its seed spread by this rule, or it has a single "
        "paired seed, which the rule does not judge."
    )
    return " ".join(sentences)


def figure_jobs(
    grid: Grid, figures: Path
) -> tuple[list[Path], list[tuple[Callable[..., Any], tuple[Any, ...]]]]:
    """Each setting's curves, class heatmap and partition, as the files to write into ``figures`` and the
    calls (:func:`fedpcd.report.figures.drawing`) that draw them. The partitions are read here: a malformed
    partition.json is its one line before any figure is drawn."""
    from fedpcd.data.stats import plot_counts

    firsts = {
        setting: next((runs[0] for (m, s), runs in grid.cells.items() if s == setting and runs), None)
        for setting in grid.settings
    }
    partitions = {setting: None if run is None else partition_counts(run) for setting, run in firsts.items()}
    jobs: list[Job] = []
    paths = []
    for setting in grid.settings:
        name, part = slug(setting), setting_grid(grid, setting)
        for kind, function in (("curves", plot_setting_curves), ("classes", setting_class_heatmap)):
            paths.append(figures / f"{kind}-{name}.png")
            jobs.append((function, (part, setting, paths[-1])))
        counts = partitions[setting]
        if counts is not None:
            title = f"{setting}, seed {firsts[setting].config['seed']}"
            paths.append(figures / f"partition-{name}.png")
            jobs.append((plot_counts, (counts, paths[-1], title)))
    return paths, jobs


def figure_sections(grid: Grid, figures: Path, link: Callable[[Path], str]) -> list[str]:
    """The figure sections linking the files ``figure_jobs`` drew into ``figures`` (those that exist)."""
    curves, classes, partitions = [], [], []
    for setting in grid.settings:
        name = slug(setting)
        for kind, caption, into in (
            ("curves", setting, curves),
            ("classes", f"{setting} per class", classes),
            ("partition", f"{setting} partition", partitions),
        ):
            path = figures / f"{kind}-{name}.png"
            if path.exists():
                into.append(f"![{caption}]({link(path)})")
    parts = []
    if curves:
        parts.append("## Accuracy over rounds\n\n" + "\n\n".join(curves) + "\n")
    if classes:
        parts.append("## Global model accuracy per class\n\n" + "\n\n".join(classes) + "\n")
    if partitions:
        parts.append("## Partitions (train samples per client and class)\n\n" + "\n".join(partitions) + "\n")
    return parts


def paper_sections(
    grid: Grid,
    last: int,
    figures: Path | None,
    link: Callable[[Path], str],
    reference: str = "fedavg",
    workers: int = 1,
) -> tuple[str, list[Path]]:
    """The papers' tables (GA and PA-split, last and best), the communication view and, with ``figures``
    (a folder), the per-setting curves and heatmaps written there and linked through ``link``, and cells.csv.
    Returns (the markdown, the files written). With ``workers`` > 1 the figures are drawn in up to that
    many worker processes while the tables are computed (:func:`fedpcd.report.figures.drawing`)."""
    if figures is None:
        return "\n".join(table_sections(grid, last, reference)), []
    paths, jobs = figure_jobs(grid, figures)
    with drawing(jobs, workers) as drawn:
        parts = table_sections(grid, last, reference)
        # a heatmap without data is not drawn (False); the others return None
        written = [path for path, result in zip(paths, drawn(), strict=True) if result is not False]
    atomic_write_text(figures / "cells.csv", cells_csv(grid, last))
    written.append(figures / "cells.csv")
    parts += figure_sections(grid, figures, link)
    return "\n".join(parts), written


def table_sections(grid: Grid, last: int, reference: str) -> list[str]:
    """The sections of ``paper_sections`` without the figures: the reading, the legend, the ranking, the
    tables of each headline metric and the communication table."""
    last_rounds = last_rounds_phrase([r for members in grid.cells.values() for r in members], last, False)
    parts = [
        f"## Reading (generated from the runs; mean of {last_rounds})\n\n{reading(grid, last, reference)}\n",
        f"{legend(grid, reference)}\n",
    ]
    ranking = ranking_table(grid, last, reference)
    if ranking is not None:
        parts.append(
            f"## Ranking: mean rank over the settings (mean of {last_rounds})\n\n"
            "In each setting the methods are ranked by their mean over seeds (1 = best; ties share a rank); "
            "a method with a run stopped by divergence in a setting (a stopped.json naming a "
            f"{DIVERGED}) ranks last in that setting, whatever its other seeds reached (several such methods "
            "share the last ranks). The number of settings ranked is in brackets, then in how many settings "
            f"the method is separated above (↑) or below (↓) {reference}.\n\n"
            f"{ranking}\n"
        )
    for metric in HEADLINE:
        for protocol in PROTOCOLS:
            how = f"mean of {last_rounds}"
            if protocol == "best":
                how = "best evaluated round"
            table = pivot_table(grid, metric.key, protocol, last, reference)
            parts.append(f"## {metric.label} (%), {how}\n\n{table}\n")
        if paired_differences(grid, metric.key, "last", last, reference):
            parts.append(
                f"## {metric.label}: paired difference to {reference} (points), mean of {last_rounds}\n\n"
                f"{difference_table(grid, metric.key, 'last', last, reference)}\n"
            )
    comm = communication_table(grid, reference)
    if comm is not None:
        parts.append(
            f"## Communication: evaluated rounds (and MB up + down) to reach {reference}'s best GA\n\n"
            "Per setting and seed, the first evaluated round whose GA reaches the best GA of the "
            f"{reference} run with the same setting and seed; '-': never reached; [k/n]: k of n seeds "
            "reached it.\n\n"
            f"{comm}\n"
        )
    return parts

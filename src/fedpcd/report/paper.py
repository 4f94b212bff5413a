"""The papers' layout of many runs: methods as rows, settings as columns.

A run's *method* is its ``algorithm`` section (name and parameters); its *setting* is every other config key
that differs between the runs (partition, number of clients, participation, dataset, ...), named the way the
papers name them (P10C2, Dir(0.1), IID; ``K=100`` and ``participation=0.1`` added when they vary). Seeds of
the same method and setting form one cell: mean ± std over seeds of a per-run value, either the mean over the
run's last ``last`` evaluated rounds ("last") or its best evaluated round ("best"), the two protocols the
papers mix; the best method of each column is in bold, "(n)" follows a cell with fewer seeds than the table's
fullest cell, and an arrow marks a method whose paired difference to the reference method (same setting and
seed: same partition and initial weights) exceeds the seed spread (``separation``).

Also here: the communication view of FedMR's and FedSC's tables (rounds and megabytes each method needs to
reach the reference method's best GA of the same setting and seed), one accuracy-vs-round plot per setting
(one line per method, the band spanning the seeds), the partitions' client x class heatmaps (from the runs'
partition.json, no data needed) and a CSV of every cell.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedpcd.errors import UserError
from fedpcd.report import (
    Run,
    _flatten,
    _without_algorithm,
    group_runs,
    last_mean,
    last_rounds_phrase,
    mean_bytes,
    mean_std,
    setting_columns,
    swing,
)
from fedpcd.run_format import GA, HEADLINE, REPORTED, RunFiles
from fedpcd.utils import atomic_write, atomic_write_text, read_json, show_path

METHOD_SECTION = "algorithm"
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
    flats = [_flatten(run.config) for run in runs]
    usual = {k: _usual(k, [f.get(k) for f in flats]) for k in setting_keys}
    methods: dict[str, None] = {}
    settings: dict[str, tuple] = {}
    cells: dict[tuple[str, str], list[Run]] = {}
    for run, flat in zip(runs, flats, strict=True):
        method = setting_columns(method_keys, tuple(flat.get(k) for k in method_keys)).get(METHOD_SECTION)
        method = method or run.config[METHOD_SECTION]["name"]
        unusual = [k for k in setting_keys if json.dumps(flat.get(k), default=str) != usual[k]]
        setting = _setting_name(run.config, flat, unusual)
        methods.setdefault(method)
        others = sum(not k.startswith("partition.") for k in unusual)
        settings.setdefault(
            setting, _setting_sort_key({k: v for k, v in run.config.items() if k != "seed"}, others)
        )
        cells.setdefault((method, setting), []).append(run)
    ordered_methods = sorted(methods, key=lambda m: (m.split()[0] != reference, m))
    ordered_settings = sorted(settings, key=lambda s: settings[s])
    return Grid(ordered_methods, ordered_settings, cells)


def _usual(key: str, values: list[Any]) -> str | None:
    """The value (as JSON) most runs have for a config key, left out of setting names: the most common one,
    a tie going to the key's default; None (show the key everywhere) for a tie without the default."""
    from fedpcd.config import Config

    default = json.dumps(Config().to_dict().get(key) if "." not in key else None, default=str)
    counts = Counter(json.dumps(v, default=str) for v in values).most_common()
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


ARROWS = {1: "↑", -1: "↓"}


def separation(diffs: Sequence[float]) -> int:
    """+1 (-1) when paired differences are above (below) zero beyond their seed spread:
    |mean| > 2 std / sqrt(n) with n >= 2 seeds, a t-like rule (t = mean / (std / sqrt(n)) > 2), not a
    significance test; 0 otherwise, always 0 for a single seed."""
    if len(diffs) < 2:
        return 0
    mean = statistics.fmean(diffs)
    if abs(mean) <= 2 * statistics.stdev(diffs) / math.sqrt(len(diffs)):
        return 0
    return 1 if mean > 0 else -1


def _reference_runs(grid: Grid, reference: str) -> dict[str, Run]:
    """The runs of ``reference``'s method(s) by their whole setting and seed (``_without_algorithm``)."""
    return {
        _without_algorithm(run): run
        for (method, _), members in grid.cells.items()
        if method.split()[0] == reference
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
        if method.split()[0] == reference:
            continue
        diffs = []
        for run in members:
            ref = refs.get(_without_algorithm(run))
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
    best = {
        s: max((statistics.fmean(v) for (m, s2), v in values.items() if s2 == s), default=None)
        for s in grid.settings
    }
    lines = [
        "| method | " + " | ".join(grid.settings) + " |",
        "|---|" + "---|" * len(grid.settings),
    ]
    for method in grid.methods:
        cells = []
        for setting in grid.settings:
            vals = values.get((method, setting))
            text = seeds_cell(vals or [], most)
            if vals and statistics.fmean(vals) == best[setting]:
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


def mean_ranks(grid: Grid, metric: str, protocol: str, last: int) -> dict[str, list[float]]:
    """Per method, its rank in each setting where it has a value (1 = the best mean over seeds; ties share
    the mean of their ranks)."""
    values = cell_values(grid, metric, protocol, last)
    ranks: dict[str, list[float]] = {}
    for setting in grid.settings:
        means = {m: statistics.fmean(v) for (m, s), v in values.items() if s == setting}
        for method, mean in means.items():
            above = sum(other > mean for other in means.values())
            ties = sum(other == mean for other in means.values())
            ranks.setdefault(method, []).append(above + (ties + 1) / 2)
    return ranks


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
    ranks = [mean_ranks(grid, m.key, "last", last) for m in HEADLINE]
    separated = [separated_settings(grid, m.key, last, reference) for m in HEADLINE]
    rows = []
    for method in grid.methods:
        means = [statistics.fmean(r[method]) if r.get(method) else float("inf") for r in ranks]
        texts = []
        for mean, rank, marks in zip(means, ranks, separated, strict=True):
            if not rank.get(method):
                texts += ["-", "-"]
            else:
                vs = "reference" if method.split()[0] == reference else _separated_text(marks.get(method))
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
                ref = refs.get(_without_algorithm(run))
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
    for i, method in enumerate(grid.methods):
        members = grid.runs(method, setting)
        for ax, metric in zip(axes, HEADLINE, strict=False):
            by_round: dict[int, list[float]] = {}
            for run in members:
                for r in run.records:
                    if r.get(metric.key) is not None:
                        by_round.setdefault(r["round"], []).append(100 * r[metric.key])
            if not by_round:
                continue
            rounds = sorted(by_round)
            lw = 1.4 if len(grid.methods) <= 12 else 1.0
            style = {"color": colours[i % 20], "linestyle": "-" if i < 20 else "--", "lw": lw}
            if i == 0:  # the reference method (FedAvg) stands out
                style = {"color": "black", "linestyle": "-", "lw": 2.2}
            ax.plot(rounds, [statistics.fmean(by_round[t]) for t in rounds], label=method, **style)
            if len(members) > 1:
                low = [min(by_round[t]) for t in rounds]
                high = [max(by_round[t]) for t in rounds]
                ax.fill_between(rounds, low, high, color=style["color"], alpha=0.15, lw=0)
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


def cells_csv(grid: Grid, last: int) -> str:
    """CSV, one row per method and setting: seeds, then mean and std of every metric under both protocols."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    header = ["method", "setting", "seeds"]
    for metric in REPORTED:
        for protocol in PROTOCOLS:
            header += [f"{metric.key}_{protocol}_mean", f"{metric.key}_{protocol}_std"]
    writer.writerow(header)
    tables = {(m.key, p): cell_values(grid, m.key, p, last) for m in REPORTED for p in PROTOCOLS}
    for method in grid.methods:
        for setting in grid.settings:
            members = grid.runs(method, setting)
            if not members:
                continue
            row: list[Any] = [method, setting, len(members)]
            for metric in REPORTED:
                for protocol in PROTOCOLS:
                    vals = tables[(metric.key, protocol)].get((method, setting), [])
                    row += [
                        f"{statistics.fmean(vals):.6f}" if vals else "",
                        f"{statistics.stdev(vals):.6f}" if len(vals) > 1 else "",
                    ]
            writer.writerow(row)
    return buffer.getvalue()


def _listing(names: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


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
        "same setting and seed: same partition and initial weights) has |mean| > 2 std / √n over its "
        "n >= 2 paired seeds; with one seed nothing is marked. This is a t-like rule, not a significance "
        "test: under a t distribution a t of 2 has a two-sided p of about 0.30 for n = 2 and 0.18 for "
        "n = 3, and over many methods and settings some marks are expected by chance; the std sees only "
        "what changes with the seed (partition, initial weights, sampling), not the test set or the "
        "budget. Mean ranks order means; two ranks apart are not thereby separated (only the arrows "
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
        if method.split()[0] == reference
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


def paper_sections(
    grid: Grid,
    last: int,
    figures: Path | None,
    link: Callable[[Path], str],
    reference: str = "fedavg",
) -> str:
    """The papers' tables (GA and PA-split, last and best), the communication view and, with ``figures``
    (a folder), the per-setting curves and partition heatmaps written there and linked through ``link``."""
    from fedpcd.data.stats import plot_counts

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
            "the number of settings with a value is in brackets, then in how many settings the method is "
            f"separated above (↑) or below (↓) {reference}.\n\n"
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
    if figures is not None:
        curves, partitions, classes = [], [], []
        for setting in grid.settings:
            name = slug(setting)
            plot_setting_curves(grid, setting, figures / f"curves-{name}.png")
            curves.append(f"![{setting}]({link(figures / f'curves-{name}.png')})")
            if setting_class_heatmap(grid, setting, figures / f"classes-{name}.png"):
                classes.append(f"![{setting} per class]({link(figures / f'classes-{name}.png')})")
            first = next((runs[0] for (m, s), runs in grid.cells.items() if s == setting and runs), None)
            counts = partition_counts(first) if first is not None else None
            if counts is not None:
                title = f"{setting}, seed {first.config['seed']}"
                plot_counts(counts, figures / f"partition-{name}.png", title=title)
                partitions.append(f"![{setting} partition]({link(figures / f'partition-{name}.png')})")
        atomic_write_text(figures / "cells.csv", cells_csv(grid, last))
        parts.append("## Accuracy over rounds\n\n" + "\n\n".join(curves) + "\n")
        if classes:
            parts.append("## Global model accuracy per class\n\n" + "\n\n".join(classes) + "\n")
        if partitions:
            heading = "## Partitions (train samples per client and class)"
            parts.append(heading + "\n\n" + "\n".join(partitions) + "\n")
    return "\n".join(parts)


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
        for i in range(num_rows):
            for c in range(num_classes):
                if not np.isnan(data[i, c]):
                    colour = "black" if data[i, c] > 60 else "white"
                    ax.text(c, i, f"{data[i, c]:.0f}", ha="center", va="center", fontsize=6, color=colour)
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
    title = f"{run.path.name}: global model, accuracy per class and round"
    plot_heatmap([f"round {r['round']}" for r in rows], [r["global_class_acc"] for r in rows], path, title)
    return True

"""Render the results pages from their templates and the archive; ``--check`` compares byte for byte.

Every page in ``PAGES`` is the output of its template, ``templates/<page>.j2`` (Jinja2), rendered against the
archived runs under docs/results/runs/ and the benchmarks' archived JSON under docs/performance/. A template
is the page's prose with every result number, ± value, seed count and verdict or direction word made by a
directive:

- ``{% set c = claim("NAME/GLOB", ref="NAME/GLOB", metric="global_acc", last=5) %}`` (GLOB relative to
  docs/results/runs/): the runs matching ``run``, each reduced to one number (``last`` N evaluated rounds'
  mean, ``"best"``, ``"all"``; or ``round="A-B"``, ``stat="swing"``, ``stat="hours"``, ``rounds_to=X``,
  ``minus=KEY``, ``unit="kB"`` with ``per=N``), accuracies in %; with ``ref`` paired by seed (the two runs of
  a pair may differ only in their method and the config keys ``vary="k1,k2"``), and the claim's values are
  the paired differences. ``{{ c }}`` writes "+1.23 ± 0.45 (5 seeds: ...)"; ``{{ c.mean|s(2) }}`` a signed
  number, ``{{ c.std|f(2) }}`` an unsigned one; ``{{ c.seeds }}`` every seed's value; ``c.each[i]``, ``c.n``,
  ``c.run.mean``, ``c.ref.mean``, ``c.total`` (stat="hours"). ``replicate="FOLDER"`` (a paired claim):
  FOLDER holds the same runs under the same names rerun on another floating-point path (only ``engine``
  differs, e.g. ``engine.threads=2``); each seed's difference is then the mean of its two paths'
  differences, so the host's rounding noise enters the t-test, and ``c.spread`` is the largest gap between a
  seed's two differences.
- ``{{ label("NAME/GLOB") }}``: the method's name as `fedpcd report` gives those runs, e.g.
  "fedsc preset=official (overrides local.lr, ...)" for a preset run whose config overrides the preset.
- ``{{ paper("KEY") }}``: a paper's own result, from ``templates/papers.yaml`` (setting, table, the method's
  and the baseline's values, the metric): "SETTING (TABLE): METHOD 59.60 vs FedAvg 47.26 GA, +12.3";
  ``{{ paper("KEY").value_text }}`` (``.baseline_text``) the method's (the baseline's) value alone, "59.60",
  as a paper column's cell. An entry without a baseline is a single value: it has no margin.
- ``{{ c.verdict(paper("KEY")) }}``: the verdict of ``fedpcd.report.verdict`` against that paper's margin
  (points, at the precision the page quotes it; refused for a single value); ``c.verdict(direction=1)`` for a
  claimed direction.
- ``{{ c.says("word", "sense") }}``: a verdict or direction word, rendered only when the runs support it:
  sense "separates" / "noise" (the paired t-test does / does not separate), "above" / "below" (the sign of the
  paired mean), "beyond" / "behind" (a separation in that direction), "every seed" (one sign on every seed),
  "above on every seed" / "below on every seed" (that sign on every seed, for a word like "ahead on" or
  "lower on" in front), "mixed signs" (both signs among the seeds); a separation needs ``MIN_SEEDS`` seeds,
  and "too few seeds" is the sense of one on fewer.
- ``{% set t = table("RUNS [fedpcd report options] [--setting S]") %}`` then ``{{ t.cell(row, column) }}``:
  a cell of `fedpcd report`'s table.
- ``{{ report_page("docs/leaderboard.md") }}``, ``{{ leaderboard_cells("docs/leaderboard.md") }}``: a
  leaderboard page and its cells.csv, as `benchmarks/leaderboard.sh`'s `fedpcd report` call with that --out
  writes them.
- ``{% set d = diverged("NAME/GLOB") %}``: the runs matching the pattern that the engine stopped by divergence
  (stopped.json naming a ``DivergenceError``, no summary.json), counted against every seed the pattern
  matches, finished or stopped: ``{{ d }}`` writes "diverged in round 1 on 5 of 5 seeds" ("in rounds 2-4"
  when they stopped in different rounds); ``d.n``, ``d.seeds``, ``d.rounds``, and ``d.code`` as a claim's
  (None when the stopped runs name one clean commit).
- ``{{ bench("speed.json", "rows.0.ratio", 2) }}``: a number from a benchmark's archived JSON.
- ``means("NAME/GLOB", metric=...)``: each grid point's mean over its matching runs, {run name: mean}; e.g.
  ``holds((means(...)|dictsort(by="value")|last)[0] == "scaffold", ...)`` backs "the best".
- ``{{ holds(c.mean < d.mean, "what the prose says") }}``: nothing when the condition holds, else an error
  naming it: the check behind a comparison the prose words itself ("lower", "the lowest", "within one std").
- ``{{ scale.MIN_SEEDS }}``, ``scale.critical_t(n)``: the verdict scale's constants (fedpcd.report.verdict).
- ``{{ descriptions() }}``: src/fedpcd/descriptions.json, what ``fedpcd list NAME`` says of every shipped
  component (``fedpcd.components.shipped_descriptions``), read by the command without importing torch.
- ``{{ declarations() }}``: src/fedpcd/declarations.json, the shipped algorithms' and models' parameters,
  presets and flags (``fedpcd.declarations.shipped_declarations``), read to load a config without torch.

A paired claim whose runs were not all made by one clean commit (summary.json's code record) renders its
numbers but refuses ``verdict`` and ``says`` (naming the runs); a folder holding the same config twice
refuses both runs (``fedpcd.report.read.load_runs``).

Outside directives a template may hold no result number and no word of the verdict vocabulary
(``scan_template``; a table's cells like prose, whatever their column, a paper's included), except in a block
that ``<!-- not a result: REASON -->`` exempts (REASON in ``EXEMPT_REASONS``; on a line of its own it exempts
the block below, inline the text back to the previous comment or directive), in code, and in names with
digits (``MASKS``).

usage: python benchmarks/render_docs.py [--check] [--repo PATH]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml

import fedpcd.algorithms  # noqa: F401  (the pages are rendered from the declarations, never from a stale
import fedpcd.models  # noqa: F401  rendering of them: src/fedpcd/declarations.json is one of the pages)
from fedpcd.components import shipped_descriptions
from fedpcd.declarations import shipped_declarations
from fedpcd.labels import run_label
from fedpcd.report import verdict as verdict_scale
from fedpcd.report.document import write_report
from fedpcd.report.grid import build_grid, run_value
from fedpcd.report.groups import group_runs, same_setting
from fedpcd.report.paper import cells_csv, figure_sections
from fedpcd.report.read import load_runs, refuse_duplicates, stopped_runs
from fedpcd.report.stats import mean_std, rounds_to_target, swing
from fedpcd.report.tables import report_table
from fedpcd.report.verdict import separation, verdict
from fedpcd.run_format import comparable

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = "templates"
PAPERS = "templates/papers.yaml"  # the papers' own numbers (see ``PaperResult``)
RUNS = "docs/results/runs"
BENCH = "docs/performance"
PAGES = [
    "README.md",
    "docs/leaderboard.md",
    "docs/leaderboard/cells.csv",
    "docs/leaderboard-bn.md",
    "docs/leaderboard-bn/cells.csv",
    "docs/performance.md",
    "src/fedpcd/descriptions.json",  # what `fedpcd list NAME` prints without importing torch
    "src/fedpcd/declarations.json",  # the shipped components' declarations, for loading configs without torch
    *(
        f"docs/results/{name}.md"
        for name in (
            "fedgela",
            "fedmr",
            "fednh",
            "fedsc",
            "fedssa",
            "generic-baselines",
            "personal-baselines",
            "presets",
        )
    ),
]
LEADERBOARD_SCRIPT = "benchmarks/leaderboard.sh"


LEGACY_MARK = "†"
LEGACY_NOTE = (
    f"{LEGACY_MARK} A verdict on runs that were not made by one clean commit (archived before runs recorded "
    "their code version, or from a dirty tree): the paired t-test gives it, but the two sides may come from "
    "different code versions, so it is history, not a comparison this page stands behind."
)


class RenderError(Exception):
    """A directive the archive does not back: the page is not rendered."""


# ---- one number per run -----------------------------------------------------------------------------------


def _percent(key: str) -> float:
    return 100.0 if "acc" in key or key.startswith("pa_") else 1.0


def run_number(run: Any, spec: dict[str, Any]) -> list[float]:
    """One run's numbers for a claim: its metric at ``round`` (A or A-B), or over its last rounds, or a
    statistic of it (see the module docstring)."""
    key, scale = spec["metric"], _percent(spec["metric"])
    if spec.get("unit") == "kB":  # bytes as kB, per ``per`` participants
        scale = 1 / 1000 / float(spec.get("per", 1))
    records = run.records
    if spec.get("round") is not None:
        first, _, end = str(spec["round"]).partition("-")
        rounds = range(int(first), int(end or first) + 1)
        return [scale * r[key] for r in records if r["round"] in rounds and r.get(key) is not None]
    if spec.get("stat") == "hours":
        return [run.summary["wall_s"] / 3600]
    if spec.get("stat") == "swing":
        value = swing(records, key, int(spec.get("last", 5)))
        return [] if value is None else [scale * value]
    if spec.get("rounds_to") is not None:
        value = rounds_to_target(records, key, float(spec["rounds_to"]) / 100)
        return [] if value is None else [float(value)]
    last = str(spec.get("last", 5))
    last = str(len(records)) if last == "all" else last
    protocol, rounds = ("best", 0) if last == "best" else ("last", int(last))
    value = run_value(run, key, protocol, rounds)
    if value is not None and spec.get("minus"):  # a metric minus another of the same run
        other = run_value(run, spec["minus"], protocol, rounds)
        value = None if other is None else value - other
    return [] if value is None else [scale * value]


# ---- the papers' numbers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaperResult:
    """One result of a paper's table: ``method`` at ``value`` (%) in ``setting`` (``table`` names where), on
    ``metric``, quoted to ``value_decimals``; with a ``baseline`` at ``baseline_value``, also their
    difference, quoted to ``decimals``. An entry without a baseline is a single value: it has no margin."""

    key: str
    setting: str
    table: str
    method: str
    value: float
    baseline: str | None = None
    baseline_value: float | None = None
    metric: str = ""
    decimals: int = 1
    value_decimals: int = 2

    def __post_init__(self) -> None:
        if (self.baseline is None) != (self.baseline_value is None):
            raise RenderError(f"{PAPERS}: {self.key}: give both baseline and baseline_value, or neither")

    @property
    def margin(self) -> float:
        """The paper's difference, method minus baseline, in points at the quoted precision."""
        if self.baseline_value is None:
            raise RenderError(
                f"paper({self.key!r}) is a single value ({self.method} {self.value_text}), no margin: "
                f"a verdict needs an entry of {PAPERS} with a baseline"
            )
        return round(self.value - self.baseline_value, self.decimals)

    @property
    def value_text(self) -> str:
        """The method's value as the paper quotes it, e.g. "75.51" (the ``.value_text`` directive)."""
        return f"{self.value:.{self.value_decimals}f}"

    @property
    def baseline_text(self) -> str:
        """The baseline's value as the paper quotes it (the ``.baseline_text`` directive)."""
        if self.baseline_value is None:
            raise RenderError(f"paper({self.key!r}) is a single value ({self.method}): it has no baseline")
        return f"{self.baseline_value:.{self.value_decimals}f}"

    def __str__(self) -> str:
        metric = f" {self.metric}" if self.metric else ""
        quoted = f"{self.setting} ({self.table}): {self.method} {self.value_text}"
        if self.baseline is None:
            return f"{quoted}{metric}"
        margin = "level" if self.margin == 0 else f"{self.margin:+.{self.decimals}f}"
        return f"{quoted} vs {self.baseline} {self.baseline_text}{metric}, {margin}"


def load_papers(repo: Path) -> dict[str, PaperResult]:
    """The entries of templates/papers.yaml by key."""
    entries = yaml.safe_load((repo / PAPERS).read_text())
    try:
        return {key: PaperResult(key, **fields) for key, fields in entries.items()}
    except TypeError as error:  # a field PaperResult does not have, or a missing one
        raise RenderError(f"{PAPERS}: {error}") from None


def paper_result(papers: dict[str, PaperResult], key: str) -> PaperResult:
    """The ``paper`` directive."""
    if key not in papers:
        raise RenderError(f"paper({key!r}): not in {PAPERS} (its keys: {', '.join(papers)})")
    return papers[key]


# ---- claims -----------------------------------------------------------------------------------------------


def code_problem(runs: list[Any]) -> tuple[str, str] | None:
    """None when every run's code record (its summary's, or its stopped.json's) names one clean commit
    (``fedpcd.run_format.comparable``), else (the short reason, the reason naming the first run that breaks
    it)."""
    first = runs[0]
    for run in runs:
        why = comparable(first.code, run.code)
        if why is not None:
            where = f"{run.path.parent.name}/{run.path.name} vs {first.path.name}"
            return why, f"{why}: {where}"
    return None


@dataclass
class Side:
    """The numbers of one group of runs: per seed, their mean, std and count."""

    each: list[float]
    runs: list[Any] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.each)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.each)

    @property
    def std(self) -> float:
        return statistics.stdev(self.each) if len(self.each) > 1 else 0.0

    @property
    def total(self) -> float:
        return sum(self.each)


@dataclass
class Claim(Side):
    """A claim's numbers (the paired differences when it has a reference) and what it may say."""

    run: Side | None = None
    ref: Side | None = None
    label: str = ""
    code: tuple[str, str] | None = None
    notes: list[str] = field(default_factory=list)  # the page's legacy verdicts (see ``legacy_note``)
    gaps: list[float] | None = None  # with a replicate: per seed, the gap between its two paths' differences

    def __str__(self) -> str:
        text = mean_std(self.each, signed=self.ref is not None, scale=1.0)
        paths = "" if self.gaps is None else ", each the mean of 2 float paths"
        return f"{text} ({self.n} seed{'s' if self.n != 1 else ''}{paths}: {self.seeds})"

    @property
    def seeds(self) -> str:
        """Every seed's value, "+2.58, -0.25, ..." (signed for a paired claim), as ``{{ c }}`` lists them."""
        return ", ".join(f"{v:+.2f}" if self.ref is not None else f"{v:.2f}" for v in self.each)

    @property
    def spread(self) -> float:
        """The largest gap between a seed's paired differences on its two floating-point paths (points)."""
        if self.gaps is None:
            raise RenderError(f"{self.label}: a spread needs a claim with replicate=")
        return max(abs(gap) for gap in self.gaps)

    def _comparable(self, what: str) -> None:
        if self.ref is None:
            raise RenderError(f"{self.label}: {what} needs a paired claim (ref=)")
        if self.code is not None:
            raise RenderError(f"{self.label}: no {what} on runs not made by one clean commit: {self.code[1]}")

    def verdict(self, paper: PaperResult | None = None, direction: int | None = None) -> str:
        """The verdict scale's word for these paired differences against the margin of ``paper`` (a
        ``paper`` directive; or, for a claim of a direction without a number, ``direction`` +1 / -1);
        "no verdict (why)" for runs not made by one clean commit."""
        if self.ref is None or (paper is None) == (direction is None):
            raise RenderError(f"{self.label}: a verdict needs a paired claim and one of paper= or direction=")
        if paper is not None and not isinstance(paper, PaperResult):
            raise RenderError(f"{self.label}: verdict({paper!r}): the paper's margin comes from paper(KEY)")
        margin = None if paper is None else paper.margin  # refused for a single value, on any runs
        if self.code is not None:
            return f"no verdict ({self.code[0]})"
        return verdict(self.each, margin, direction)

    @property
    def separation(self) -> str:
        """ "separates" or "within seed noise", as the paired t-test decides, and "separates on too few seeds
        to decide" below ``MIN_SEEDS`` seeds (marked for legacy runs)."""
        if self.ref is None:
            raise RenderError(f"{self.label}: a separation needs a paired claim (ref=)")
        if not separation(self.each):
            return self.says("within seed noise", "noise")
        if self.n < verdict_scale.MIN_SEEDS:
            return self.says("separates on too few seeds to decide", "too few seeds")
        return self.says("separates", "separates")

    def says(self, word: str, sense: str) -> str:
        """``word`` when the runs support ``sense`` (see the module docstring), else a RenderError."""
        if sense == "every seed":
            holds = all(v > 0 for v in self.each) or all(v < 0 for v in self.each)
        elif sense in ("above on every seed", "below on every seed"):
            if self.ref is None:
                raise RenderError(f"{self.label}: {word!r} needs a paired claim (ref=)")
            sign = 1 if sense.startswith("above") else -1
            holds = all(sign * v > 0 for v in self.each)
        elif sense == "mixed signs":
            holds = any(v > 0 for v in self.each) and any(v < 0 for v in self.each)
        elif sense in ("above", "below"):
            if self.ref is None:
                raise RenderError(f"{self.label}: {word!r} needs a paired claim (ref=)")
            holds = (self.mean > 0) if sense == "above" else (self.mean < 0)
        elif sense in ("separates", "noise", "beyond", "behind", "too few seeds"):
            if self.ref is None:
                raise RenderError(f"{self.label}: {word!r} needs a paired claim (ref=)")
            sign, few = separation(self.each), self.n < verdict_scale.MIN_SEEDS
            if sense == "too few seeds":
                holds = sign != 0 and few
            elif sense != "noise" and few:  # a separation rests on MIN_SEEDS seeds
                raise RenderError(f"{self.label}: {word!r} needs {verdict_scale.MIN_SEEDS} seeds: {self}")
            else:
                holds = {"separates": sign != 0, "noise": sign == 0, "beyond": sign > 0, "behind": sign < 0}[
                    sense
                ]
        else:
            raise RenderError(f"{self.label}: unknown sense {sense!r} for {word!r}")
        if not holds:
            raise RenderError(f"{self.label}: the runs do not support {word!r} ({sense}): {self}")
        descriptive = sense in ("above", "below", "mixed signs") or sense.endswith("every seed")
        if not descriptive and self.code is not None:
            self.notes.append(self.code[1])
            return word + LEGACY_MARK
        return word


@dataclass
class Diverged:
    """The ``diverged`` directive: of the ``seeds`` a pattern matches, the runs stopped by divergence, each
    seed's stopping round in ``rounds``."""

    label: str
    seeds: list[int]
    rounds: dict[int, int]
    code: tuple[str, str] | None

    @property
    def n(self) -> int:
        return len(self.rounds)

    def __str__(self) -> str:
        low, high = min(self.rounds.values()), max(self.rounds.values())
        when = f"round {low}" if low == high else f"rounds {low}-{high}"
        return f"diverged in {when} on {self.n} of {len(self.seeds)} seeds"


class Archive:
    """The archived runs, loaded once per folder."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self._folders: dict[Path, list[Any]] = {}
        self._stopped: dict[Path, list[Any]] = {}
        self._grids: dict[Path, Any] = {}
        self._distinct: set[str] = set()  # the archive folders checked for runs counted twice
        self.legacy: list[str] = []  # the current page's verdicts on runs of no single clean commit
        self.noted = False  # whether the current page placed ``legacy_note``

    def legacy_note(self) -> str:
        """The ``legacy_note`` directive, placed after a page's claims: the footnote that explains the mark of
        ``Claim.says``, or nothing when the page has no marked verdict."""
        self.noted = True
        return LEGACY_NOTE if self.legacy else ""

    def folder(self, path: str | Path) -> list[Any]:
        """The finished runs below ``path`` (relative to the repository), read once per render process: the
        pages' claims, tables and leaderboard grids ask for the same folders many times. Not to be changed."""
        folder = (self.repo / path).resolve()
        if folder not in self._folders:
            self._folders[folder] = load_runs(folder)
        return self._folders[folder]

    def grid(self, path: str | Path) -> Any:
        """The leaderboard grid (``fedpcd.report.grid.build_grid``) of the runs below ``path``, built once."""
        folder = (self.repo / path).resolve()
        if folder not in self._grids:
            self._grids[folder] = build_grid(self.folder(path))
        return self._grids[folder]

    def runs(self, pattern: str) -> list[Any]:
        """The finished runs matching ``pattern`` (ARCHIVE/GLOB, relative to docs/results/runs/), from their
        archive folder (where two runs with one config are refused)."""
        folder = f"{RUNS}/{pattern.partition('/')[0]}"
        found = self.folder(folder)
        if folder not in self._distinct:
            refuse_duplicates(found)
            self._distinct.add(folder)
        root = (self.repo / RUNS).resolve()
        return sorted(
            (run for run in found if fnmatch.fnmatch(run.path.relative_to(root).as_posix(), pattern)),
            key=lambda run: run.path,
        )

    def diverged(self, pattern: str) -> Diverged:
        """The ``diverged`` directive (see the module docstring); an error when no run of the pattern
        diverged."""
        label = f"diverged({pattern!r})"
        folder = (self.repo / RUNS / pattern.partition("/")[0]).resolve()
        if folder not in self._stopped:
            self._stopped[folder] = stopped_runs(folder)
        root = (self.repo / RUNS).resolve()
        stopped = [
            run
            for run in self._stopped[folder]
            if run.diverged and fnmatch.fnmatch(run.path.relative_to(root).as_posix(), pattern)
        ]
        if not stopped:
            raise RenderError(f"{label}: no archived run matching it stopped by divergence")
        finished = [run.config["seed"] for run in self.runs(pattern)]
        rounds = {run.config["seed"]: run.stopped["round"] for run in stopped}
        if len(rounds) < len(stopped) or set(rounds) & set(finished):
            raise RenderError(f"{label}: a seed matches more than one run")
        return Diverged(label, sorted([*finished, *rounds]), rounds, code_problem(stopped))

    def label(self, pattern: str) -> str:
        """The ``label`` directive: the method's name as `fedpcd report` gives the runs matching ``pattern``
        (a preset run whose config overrides the preset's keys is named with them); one name for all."""
        labels = {run_label(run.config) for run in self.runs(pattern)}
        if len(labels) != 1:
            raise RenderError(f"label({pattern!r}): {len(labels)} method names: {', '.join(sorted(labels))}")
        return labels.pop()

    def means(self, pattern: str, **spec: Any) -> dict[str, float]:
        """The ``means`` directive: the mean over seeds of each grid point matching ``pattern``, named by its
        run folder without the pattern's fixed start and the ``_seedN`` end ("scaffold",
        "fedlc-denominatorall"), for the metric of ``spec`` as a claim takes it; runs without it left out."""
        spec.setdefault("metric", "global_acc")
        start = pattern.partition("/")[2].partition("*")[0]
        values: dict[str, list[float]] = {}
        for run in self.runs(pattern):
            name = re.sub(r"_seed\d+$", "", run.path.name).removeprefix(start)
            values.setdefault(name, []).extend(run_number(run, spec))
        return {name: statistics.fmean(each) for name, each in values.items() if each}

    def side(self, pattern: str, spec: dict[str, Any]) -> dict[int, tuple[list[float], Any]]:
        out: dict[int, tuple[list[float], Any]] = {}
        for run in self.runs(pattern):
            out.setdefault(run.config["seed"], ([], run))[0].extend(run_number(run, spec))
        return out

    def claim(self, run: str, ref: str | None = None, replicate: str | None = None, **spec: Any) -> Claim:
        """The ``claim`` directive (see the module docstring)."""
        spec.setdefault("metric", "global_acc")
        label = f"claim({run!r}{f', ref={ref!r}' if ref else ''})"
        mine = self.side(run, spec)
        if not mine:
            raise RenderError(f"{label}: no archived run matches {run}")
        values = [v for seed in sorted(mine) for v in mine[seed][0]]
        runs = [mine[seed][1] for seed in sorted(mine)]
        if ref is None:
            if replicate is not None:
                raise RenderError(f"{label}: replicate= needs a paired claim (ref=)")
            return Claim(values, runs, label=label, notes=self.legacy)
        theirs = self.side(ref, spec)
        vary = frozenset(k for k in str(spec.get("vary", "")).split(",") if k)
        diffs, refs = [], []
        for seed in sorted(mine):
            if seed not in theirs or len(theirs[seed][0]) != 1 or len(mine[seed][0]) != 1:
                raise RenderError(f"{label}: seed {seed} has no single value of {ref} to pair with")
            if not same_setting(mine[seed][1], theirs[seed][1], vary):
                raise RenderError(f"{label}: seed {seed}'s two runs differ in more than the method")
            diffs.append(mine[seed][0][0] - theirs[seed][0][0])
            refs.append(theirs[seed][1])
        ref_values = [theirs[seed][0][0] for seed in sorted(mine)]
        claim = Claim(diffs, runs + refs, run=Side(values, runs), ref=Side(ref_values, refs), label=label)
        if replicate is not None:
            self._replicate(claim, replicate, spec)
        claim.code, claim.notes = code_problem(claim.runs), self.legacy
        return claim

    def _replicate(self, claim: Claim, folder: str, spec: dict[str, Any]) -> None:
        """Each seed's difference becomes the mean of its own and its rerun's in ``folder`` (the same run
        names, another floating-point path: only ``engine`` differs); ``claim.gaps`` keeps their gaps."""
        assert claim.run is not None and claim.ref is not None
        gaps, means = [], []
        for diff, mine, theirs in zip(claim.each, claim.run.runs, claim.ref.runs, strict=True):
            (value, rerun), (ref_value, ref_rerun) = (
                self._rerun(claim.label, folder, r, spec) for r in (mine, theirs)
            )
            gaps.append(diff - (value - ref_value))
            means.append((diff + value - ref_value) / 2)
            claim.runs += [rerun, ref_rerun]
        claim.each, claim.gaps = means, gaps

    def _rerun(self, label: str, folder: str, original: Any, spec: dict[str, Any]) -> tuple[float, Any]:
        """The number and the run of ``original``'s rerun in ``folder`` (it may differ only in ``engine``)."""
        found = self.runs(f"{folder}/{original.path.name}")
        if len(found) != 1:
            raise RenderError(f"{label}: no rerun of {original.path.name} in {folder}")
        rerun, where = found[0], f"{label}: {folder}/{found[0].path.name}"
        engine = frozenset(
            f"engine.{key}" for run in (original, rerun) for key in run.config.get("engine", {})
        )
        if not same_setting(original, rerun, engine):
            raise RenderError(f"{where} differs from {original.path.name} in more than engine")
        if run_label(original.config) != run_label(rerun.config):
            raise RenderError(f"{where} is another method than {original.path.name}")
        if original.config.get("engine") == rerun.config.get("engine"):
            raise RenderError(f"{where} has the engine of {original.path.name}: not another float path")
        numbers = run_number(rerun, spec)
        if len(numbers) != 1:
            raise RenderError(f"{where} has no single value")
        return numbers[0], rerun


# ---- tables of `fedpcd report` ----------------------------------------------------------------------------


def table_options(text: str) -> argparse.Namespace:
    """A table directive's words: the runs folder and `fedpcd report`'s options, plus --setting."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("root")
    parser.add_argument("--paired-with")
    parser.add_argument("--swing", action="store_true")
    parser.add_argument("--best", action="store_true")
    parser.add_argument("--rounds-to", nargs="+", type=float, default=[])
    parser.add_argument("--last", type=int, default=5)
    parser.add_argument("--setting")
    parser.add_argument("--participants", type=int, default=0)
    return parser.parse_args(shlex.split(text))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


KB_BOTH = "kB up / down per round"
KB_CLIENT = "kB up / down per client"  # with --participants N: the report's kB divided by N


@dataclass
class Table:
    """One `fedpcd report` table: its cells by row key and column name."""

    options: argparse.Namespace
    rows: dict[str, tuple[dict[str, str], list[Any]]]
    header: list[str]

    def cell(self, row: str, column: str, metric: str | None = None) -> str:
        """The report's cell of ``row`` (its setting columns joined by "; ", only the algorithm with
        --setting) and ``column`` (the report's name, "(paired)" and case aside, "fedavg" standing for the
        reference; ``KB_BOTH``, ``KB_CLIENT``; with ``metric``: the mean ± std over seeds of that metric's
        best round)."""
        if row not in self.rows:
            raise RenderError(f"table {self.options.root}: no row {row!r} (its rows: {', '.join(self.rows)})")
        found, members = self.rows[row]
        names = {h.lower(): h for h in self.header}
        name = column.replace("(paired)", "").strip()
        if name.startswith("Δ") and " vs " not in name:
            name = f"{name} vs {self.options.paired_with}"
        if metric is not None:
            values = [v for v in (run_value(r, metric, "best", 0) for r in members) if v is not None]
            return mean_std(values)
        if name == KB_BOTH:
            return f"{found['kB up/rnd']} / {found['kB down/rnd']}"
        if name == KB_CLIENT and self.options.participants:
            up, down = (float(found[k]) / self.options.participants for k in ("kB up/rnd", "kB down/rnd"))
            return f"{up:.1f} / {down:.1f}"
        key = names.get(name.lower()) or names.get(
            name.lower().replace("fedavg", str(self.options.paired_with))
        )
        if key is None:
            raise RenderError(f"table {self.options.root}: no column {column!r} ({', '.join(self.header)})")
        return found[key]


def build_table(archive: Archive, text: str) -> Table:
    """The ``table`` directive: `fedpcd report`'s table of RUNS with the options in ``text``."""
    options = table_options(text)
    runs = archive.folder(options.root)
    generated = report_table(
        runs, options.last, options.rounds_to, options.paired_with, options.swing, False, options.best
    ).splitlines()
    header = _cells(generated[0])
    sections = header[: header.index("seeds")]
    _, groups = group_runs(runs)
    rows: dict[str, tuple[dict[str, str], list[Any]]] = {}
    for line, members in zip(generated[2:], groups.values(), strict=True):
        cells = dict(zip(header, _cells(line), strict=True))
        setting = "; ".join(cells[s] for s in sections if s != "algorithm")
        if options.setting is not None and setting != options.setting:
            continue
        key = (
            cells.get("algorithm", "")
            if options.setting is not None
            else "; ".join(cells[s] for s in sections)
        )
        rows[key] = (cells, members)
    if options.setting is not None and not rows:
        raise RenderError(f"no setting {options.setting!r} in the report of {options.root}")
    return Table(options, rows, header)


# ---- the leaderboard page and benchmark figures -----------------------------------------------------------


def leaderboard_command(repo: Path, page: str) -> argparse.Namespace:
    """The options of benchmarks/leaderboard.sh's `fedpcd report` call that writes ``page``."""
    text = (repo / LEADERBOARD_SCRIPT).read_text().replace("\\\n", " ")
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("root")
    for option in ("--out", "--title", "--notes"):
        parser.add_argument(option)
    parser.add_argument("--last", type=int, default=5)
    for line in text.splitlines():
        if line.strip().startswith("fedpcd report"):
            options = parser.parse_known_args(shlex.split(line.split(">", 1)[0])[2:])[0]
            if options.out == page:
                return options
    raise RenderError(f"{LEADERBOARD_SCRIPT} has no `fedpcd report` call with --out {page}")


def report_page(archive: Archive, page: str) -> str:
    """A leaderboard page as benchmarks/leaderboard.sh's `fedpcd report` writes it, linking the figures that
    script drew (they are not drawn here)."""
    repo = archive.repo
    options = leaderboard_command(repo, page)
    here = os.getcwd()
    os.chdir(repo)  # the page names its runs folder as the script gives it: relative to the repository
    try:
        text = write_report(options.root, None, options.last, title=options.title, notes=options.notes)
        figures = figure_sections(
            archive.grid(options.root),
            Path(page).with_suffix(""),
            lambda path: path.relative_to(Path(page).parent).as_posix(),
        )
    finally:
        os.chdir(here)
    return text.replace("\n## All runs", "\n" + "\n".join(figures) + "\n## All runs", 1)


def leaderboard_cells(archive: Archive, page: str) -> str:
    """A leaderboard's cells.csv (every cell's mean and std) as benchmarks/leaderboard.sh writes it beside
    ``page``."""
    options = leaderboard_command(archive.repo, page)
    return cells_csv(archive.grid(options.root), options.last)


def bench(repo: Path, name: str, path: str, decimals: int | None = None) -> str:
    """A value of a benchmark's archived JSON (docs/performance/NAME), by a dotted path (list indices as
    numbers), formatted with ``decimals`` when given."""
    value: Any = json.loads((repo / BENCH / name).read_text())
    for part in path.split("."):
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise RenderError(f"{name}: no value at {path!r}") from None
    return str(value) if decimals is None else f"{float(value):.{decimals}f}"


# ---- what a template may say outside directives -----------------------------------------------------------

EXEMPT_REASONS = {
    "setting": "a setting of the runs: data sizes, client, round, epoch and seed counts, hyperparameters",
    "paper": "a number or a claim quoted from a paper",
    "count": "a count of runs or methods, a time to regenerate, a date, a commit",
    "rule": "the verdict scale's constants",
    "computed": "computed without training by the command shown beside it (partitions, the ETF's geometry)",
    "install": "a measured install or test time, with its machine and load beside it",
    "machine": "the machine and its load when a benchmark ran, as its archived output prints them",
    "reference": "a citation's year, an equation's constant, an exit code, an address, a limit of the code",
}
REASONS = ", ".join(EXEMPT_REASONS)
COMMENT = re.compile(r"<!--(.*?)-->", re.S)
DIRECTIVE = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
EXEMPT_LINE = re.compile(r"^<!--\s*not a result:\s*(\w+)\s*-->\s*$")
# text that holds digits but no number: inline code, link targets, figures, scientific notation, names with
# digits (P10C2, ResNet-18, N=10, x^0.5, CIFAR-10/100), references to a paper's equations, tables, sections,
# a citation's year (Fan et al., NeurIPS 2023)
MASKS = [
    re.compile(r"`[^`]*`"),
    re.compile(r"\]\([^)]*\)"),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)?e-?\d+\b"),
    re.compile(r"\b[A-Za-z][\w-]*\d[\w./-]*"),
    re.compile(r"\b\w+\s?=\s?[\d.]+\b(?!\s*(?:%|points))"),
    re.compile(r"[\^#][\d.]+"),
    re.compile(r"\{[\d,\s.]+\}"),
    re.compile(r"\b[A-Za-z]+\(\s*[\d.]+\s*\)"),
    re.compile(r"\bDirichlet [\d.]+"),
    re.compile(r"\bet al\.,?(?: [A-Z][A-Za-z]*)? (?:19|20)\d\d\b"),
    re.compile(r"\b\d+[-/][A-Za-z]\w*"),
    re.compile(
        r"\b(?:Eqs?\.|Tables?|Figs?\.|Figure|[Ss]ections?|Sec\.|App\.|Alg\.|Algorithm)\s*[\d.]+(?:\s*[-,]\s*\d+)*"
    ),
    re.compile(  # a setting's size: 100 clients, 10% participation, 20 rounds x 5 epochs, 12.5% of the set
        r"(?<![\w.+-])\d+(?:,\d{3})*(?:\.\d+)?(?:%? (?:of|participation|per round)\b| ?x \d+\b|"
        r" (?:clients?|rounds?|(?:local )?epochs?|classes|images|samples|participants)\b)"
    ),
    re.compile(
        r"\b(?:[Ss]eeds?|[Rr]ounds?|[Cc]lients?|[Cc]lass)\s+\d+(?:\s*-\s*\d+)?(?![\d.])(?!\s*(?:%|points|x\b))"
    ),
]
NUMBER = re.compile(r"(?<![\w.])([+\-−]?)(\d+(?:,\d{3})*(?:\.\d+)?)(?![\w])")
RESULT_LIKE = re.compile(r"±|(?<![\w.])[+-]\d+(?:\.\d+)?")
# the verdict and direction vocabulary: words that say how a result compares
VOCABULARY = re.compile(
    r"\b(?:separat\w*|beats?|outperform\w*|reproduced|reproduces|better than|worse than|every seed"
    r"|seeds disagree|within (?:the )?(?:seed )?(?:noise|spread)|level with|direction only"
    r"|(?:above|below|ahead of|behind) (?:FedAvg|Standalone|FedAvg-FT|LG-FedAvg|FedSSA|the reference))\b",
    re.I,
)


BLANK = "\x00"  # a directive's characters in the text scan_template reads


def masked(text: str) -> str:
    """``text`` with what holds digits but no number (``MASKS``) blanked, positions kept."""
    for mask in MASKS:
        text = mask.sub(lambda m: " " * len(m.group()), text)
    return text


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, spans) of a template's prose outside code, figures and exempt blocks: each
    paragraph or list item is one span, each table row's cells are spans (whatever their column; a header
    row, the column names, is skipped)."""
    lines = text.splitlines()
    blocks: list[tuple[int, list[str]]] = []
    fence, exempt, fresh = False, False, True
    for number, line in enumerate(lines, 1):
        stripped = line.strip(" \t\r\n\f\v" + BLANK)  # a line of directives alone is blank
        if line.startswith("```"):
            fence, fresh = not fence, True
            continue
        if fence or line.startswith("![") or not stripped:
            exempt, fresh = exempt and fence, True
            continue
        match = EXEMPT_LINE.match(stripped)
        if match:
            blocks.append((number, [line]))  # its reason is checked like an inline one
            exempt, fresh = True, True
            continue
        if exempt:
            continue
        if stripped.startswith("|"):
            cells = _cells(stripped)
            if set(stripped.replace("|", "").strip()) <= set("-: "):
                continue
            if number < len(lines) and lines[number].strip().startswith("|---"):
                continue  # column names
            blocks.append((number, cells))
            fresh = True
            continue
        if fresh or stripped.startswith("- ") or line.startswith("#"):
            blocks.append((number, [line]))
        else:
            blocks[-1][1][-1] += " " + line
        fresh = line.startswith("#")
    return blocks


def unexempt(span: str) -> tuple[str, list[str]]:
    """The text of a span that no inline exemption covers (each covers back to the previous comment or
    directive), and the exemptions whose reason is not one of ``EXEMPT_REASONS``."""
    kept, unknown, rest = [], [], 0
    for m in COMMENT.finditer(span):
        body = m.group(1).strip()
        if not body.startswith("not a result:"):
            kept.append(span[rest : m.start()])
        else:
            covered = max(rest, span.rfind(BLANK, rest, m.start()) + 1)  # back to the last directive
            kept.append(span[rest:covered])
            if body.partition(":")[2].strip() not in EXEMPT_REASONS:
                unknown.append(body)
        rest = m.end()
    kept.append(span[rest:])
    return " ".join(kept), unknown


def scan_template(text: str) -> list[str]:
    """The result numbers and verdict words of a template outside its directives: one line each (see the
    module docstring for what is exempt: an inline exemption covers its span back to the previous comment or
    directive)."""
    problems: list[str] = []
    for number, spans in _blocks(DIRECTIVE.sub(lambda m: BLANK * len(m.group()), text)):
        for span in spans:
            kept, reasons = unexempt(span)
            problems += [f"line {number}: exemption {r!r}: the reasons are {REASONS}" for r in reasons]
            plain = masked(kept)
            for what, pattern in (("a number", NUMBER), ("a verdict word", VOCABULARY)):
                for m in pattern.finditer(plain):
                    where = _around(plain, m.start())
                    problems.append(
                        f"line {number}: {what} outside a directive: {m.group().strip()!r} in {where!r}"
                    )
    return problems


def _around(text: str, at: int) -> str:
    return " ".join(text[max(at - 40, 0) : at + 30].replace(BLANK, " ").split())


# ---- rendering --------------------------------------------------------------------------------------------


def _fixed(value: float, decimals: int = 2) -> str:
    return f"{abs(value):.{decimals}f}"


def _signed(value: float, decimals: int = 2) -> str:
    return f"{value:+.{decimals}f}"


def holds(condition: bool, what: str) -> str:
    """The ``holds`` directive: "" when ``condition`` is true, else a RenderError naming ``what``."""
    if not condition:
        raise RenderError(f"the runs do not support: {what}")
    return ""


def environment(repo: Path) -> jinja2.Environment:
    """The Jinja2 environment of the templates, with the directives as globals."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(repo / TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    archive = Archive(repo)
    papers = load_papers(repo)
    env.globals.update(
        paper=lambda key: paper_result(papers, key),
        archive=archive,
        claim=archive.claim,
        means=archive.means,
        diverged=archive.diverged,
        label=archive.label,
        legacy_note=archive.legacy_note,
        table=lambda text: build_table(archive, text),
        report_page=lambda page: report_page(archive, page),
        leaderboard_cells=lambda page: leaderboard_cells(archive, page),
        bench=lambda name, path, decimals=None: bench(repo, name, path, decimals),
        bench_value=lambda name, path: float(bench(repo, name, path)),
        holds=holds,
        scale=verdict_scale,
        descriptions=shipped_descriptions,
        declarations=shipped_declarations,
    )
    env.filters.update(f=_fixed, s=_signed)
    return env


def render(repo: Path, page: str, env: jinja2.Environment | None = None) -> str:
    """The text of ``page`` rendered from its template."""
    env = env or environment(repo)
    archive = env.globals["archive"]
    archive.legacy.clear()
    archive.noted = False
    try:
        text = env.get_template(f"{page}.j2").render()
    except RenderError as error:
        raise RenderError(f"{page}: {error}") from None
    if archive.legacy and not archive.noted:
        raise RenderError(
            f"{page}: {len(archive.legacy)} verdicts marked {LEGACY_MARK} but no {{{{ legacy_note() }}}}"
        )
    return text.rstrip("\n") + "\n"  # one end of line (a page's last directive may render nothing)


def differences(page: str, found: str, expected: str) -> list[str]:
    """One line naming the first line where ``found`` differs from the rendering ``expected`` (or none)."""
    if found == expected:
        return []
    a, b = found.splitlines(), expected.splitlines()
    for number, (mine, theirs) in enumerate(zip(a, b, strict=False), 1):
        if mine != theirs:
            words = [(x, y) for x, y in zip(mine.split(), theirs.split(), strict=False) if x != y]
            x, y = words[0] if words else (mine[:80], theirs[:80])
            return [f"{page} line {number}: found {x!r}, the rendering has {y!r}"]
    return [f"{page}: {len(a)} lines, the rendering has {len(b)}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the pages instead of writing them")
    parser.add_argument("--repo", type=Path, default=REPO, help="the repository (default: this one)")
    parser.add_argument("pages", nargs="*", help=f"pages to render (default: all of {', '.join(PAGES)})")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    os.chdir(repo)  # the report names its runs folder as given: relative, as in benchmarks/leaderboard.sh
    env = environment(repo)
    failed = 0
    for page in args.pages or PAGES:
        try:
            text = render(repo, page, env)
        except RenderError as error:
            print(error)
            failed += 1
            continue
        target = repo / page
        if args.check:
            found = differences(page, target.read_text() if target.exists() else "", text)
            for line in found:
                print(f"{line} (python benchmarks/render_docs.py {page} writes it)")
            failed += bool(found)
        elif not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"wrote {page}")
    if args.check and not failed:
        print(f"every page equals its rendering ({len(args.pages or PAGES)} pages)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

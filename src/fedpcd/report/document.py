"""``fedpcd report``'s document: the markdown (and its figures) for the runs below a folder, with the papers'
layout (``fedpcd.report.paper``) when the runs differ in method and setting. Every figure written is linked
from the markdown (relative paths), and :class:`Document` names the files written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpcd.report.figures import plot_curves, run_class_heatmap
from fedpcd.report.grid import METHOD_SECTION, build_grid
from fedpcd.report.groups import code_mismatches, group_runs
from fedpcd.report.paper import paper_sections
from fedpcd.report.read import load_runs, refuse_duplicates, unfinished_runs
from fedpcd.report.stats import last_rounds_phrase
from fedpcd.report.tables import check_rounds_to, report_table
from fedpcd.utils import check_writable, read_user_text


def output_paths(out: str | Path) -> tuple[Path, Path]:
    """(markdown file, figures folder) of ``--out``: a folder gets report.md inside; a path ending in .md is
    the markdown file itself, its figures in the folder of the same stem beside it (docs/leaderboard.md and
    docs/leaderboard/)."""
    out = Path(out)
    if out.suffix == ".md":
        return out, out.with_suffix("")
    return out / "report.md", out


@dataclass(frozen=True)
class Document:
    """A report: its markdown and the files written for it, the markdown file first (none without ``out``)."""

    markdown: str
    files: tuple[Path, ...]


def make_report(
    root: str | Path,
    out: str | Path | None = None,
    last: int = 5,
    rounds_to: Sequence[float] = (),
    paired_with: str | None = None,
    with_swing: bool = False,
    geometry: bool = False,
    with_best: bool = False,
    title: str | None = None,
    notes: str | Path | None = None,
    workers: int = 1,
) -> Document:
    """Print-ready markdown for the runs below ``root``; with ``out``, also written there with its figures
    (see ``output_paths``), each linked from the markdown. Runs of several methods in several settings also
    get the papers' layout (``fedpcd.report.paper``: methods x settings tables, communication, per-setting
    curves, partitions, cells.csv); other runs get the curves of GA and PA-split (``plot_curves``) and, for a
    single run, its accuracy per class. ``title`` becomes a heading and the markdown file ``notes`` a
    preamble under it. ``workers``: the processes that may draw the papers' layout's figures (the command
    line gives its usable cores; see ``fedpcd.report.figures.drawing``)."""
    markdown, figures = output_paths(out) if out is not None else (None, None)
    if markdown is not None and figures is not None:  # refused before any work (--geometry takes minutes)
        check_writable(markdown)
        check_writable(figures, folder=True)
    check_rounds_to(rounds_to)
    runs = load_runs(root)
    refuse_duplicates(runs)  # a report counts every run once
    table = report_table(runs, last, rounds_to, paired_with, with_swing, geometry, with_best)
    note = ""
    if paired_with is not None:
        note += (
            f" Δ vs {paired_with}: each run minus the {paired_with} run of the same setting and seed,"
            " mean ± std over seeds, in points."
        )
    if with_swing:
        note += " GA swing: max - min of GA over those rounds, in points."
    if with_best:
        note += " GA best: each run's highest GA over all its rounds."
    if geometry:
        note += (
            " ∠: mean angle in degrees between centred class means on the test set: the global model over all"
            " classes, each client's personal model over the classes it holds / lacks (FedGELA Fig. 3;"
            " an ETF has 96.38 for 10 classes)."
        )
    if rounds_to:
        note += " R<x>%: the first round with GA >= x%, mean over the seeds reaching it ((k/n): k of n did)."
    intro = (
        f"Runs below `{root}`: metrics in %, mean ± std over seeds of each run's mean over "
        f"{last_rounds_phrase(runs, last)}.{note}\n\n"
    )
    mismatched = code_mismatches(runs, paired_with) if paired_with is not None else []
    if mismatched:
        intro += (
            f"**Paired runs made by different code** ({len(mismatched)}; rerun one side with the other's "
            "code before reading their difference): " + "; ".join(mismatched) + ".\n\n"
        )
    varying, _ = group_runs(runs)
    sections = {k.partition(".")[0] for k in varying}
    written: list[Path] = []

    def link(path: Path) -> str:
        return path.relative_to(markdown.parent).as_posix() if markdown is not None else str(path)

    if METHOD_SECTION in sections and len(sections) > 1:
        paper, written = paper_sections(build_grid(runs), last, figures, link, workers=workers)
        text = intro + paper + f"\n## All runs\n\n{table}\n"
    else:
        text = intro + table + "\n"
        if figures is not None:
            plot_curves(runs, figures / "curves.png")
            written.append(figures / "curves.png")
            text += f"\n![GA and PA-split over rounds]({link(written[-1])})\n"
            if len(runs) == 1 and run_class_heatmap(runs[0], figures / "classes.png"):
                written.append(figures / "classes.png")
                text += f"\n![accuracy per class]({link(written[-1])})\n"
    if notes is not None:
        text = read_user_text(Path(notes), "notes file").strip() + "\n\n" + text
    unfinished = unfinished_runs(root)
    if unfinished:
        text += (
            "\nRuns without a summary (stopped, or still running), left out above: "
            + ", ".join(f"`{p}` ({note})" if note else f"`{p}`" for p, note in unfinished)
            + "\n"
        )
    if title:
        text = f"# {title}\n\n{text}"
    if markdown is None:
        return Document(text, ())
    from fedpcd.utils import atomic_write_text

    atomic_write_text(markdown, text)
    return Document(text, (markdown, *written))


def write_report(*args: Any, **kwargs: Any) -> str:
    """:func:`make_report`'s markdown (its arguments)."""
    return make_report(*args, **kwargs).markdown

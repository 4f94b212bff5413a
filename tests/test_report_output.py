"""`fedpcd report --out` writes its files and prints their paths, exactly those it wrote (the markdown only
with --print); report.md shows every figure it writes (relative links); the report's curves have
whole-number round ticks."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from fedpcd.cli import main
from fedpcd.report.document import make_report
from fedpcd.report.figures import plot_curves
from fedpcd.report.read import load_runs

TINY = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=3", "eval_every=1"]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two finished 3-round runs (two seeds) below one folder."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1):
        run = ["run", "--quiet", *TINY, "rounds=3", f"seed={seed}", f"output_dir={root / f's{seed}'}"]
        assert main(run) == 0
    return root


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four finished 1-round runs, two methods x two settings: the report's papers' layout."""
    root = tmp_path_factory.mktemp("grid")
    for algorithm in ("fedavg", "fedprox"):
        for scheme in ("iid", "pathological"):
            out = root / f"{algorithm}-{scheme}"
            setting = [f"partition.scheme={scheme}", f"algorithm.name={algorithm}", "rounds=1"]
            assert main(["run", "--quiet", *TINY, *setting, f"output_dir={out}"]) == 0
    return root


def image_links(markdown: str) -> list[str]:
    """The targets of the markdown's image links, in order."""
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def check_embedded(markdown_file: Path, files: tuple[Path, ...]) -> None:
    """Every figure of ``files`` is shown once in ``markdown_file`` through a relative link, and every image
    link there points to one of them."""
    figures = sorted(p for p in files if p.suffix == ".png")
    links = image_links(markdown_file.read_text())
    assert figures and all(not Path(link).is_absolute() for link in links)
    assert sorted(markdown_file.parent / link for link in links) == figures


def test_report_out_prints_the_written_paths_not_the_markdown(runs_dir, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["report", str(runs_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"wrote {out / 'report.md'}"
    written = {p for p in out.rglob("*") if p.is_file()}
    assert {Path(line.removeprefix("wrote ")) for line in printed} == written  # each file once, nothing else
    assert all(line.startswith("wrote ") for line in printed) and out / "curves.png" in written
    markdown = (out / "report.md").read_text()
    assert "|" in markdown and not any("|" in line for line in printed)  # the table is in the file only


def test_report_print_adds_the_markdown_and_no_out_prints_it_alone(runs_dir, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "board.md"
    assert main(["report", str(runs_dir), "--out", str(out), "--print"]) == 0
    text = capsys.readouterr().out
    markdown = out.read_text()
    assert text.startswith(markdown) and text[len(markdown) :].splitlines()[0] == f"wrote {out}"
    assert main(["report", str(runs_dir)]) == 0
    figure = "\n![GA and PA-split over rounds](board/curves.png)\n"
    assert figure in markdown  # without --out: the markdown but the figure it does not draw, nothing written
    assert capsys.readouterr().out == markdown.replace(figure, "")


def test_report_curves_have_whole_round_ticks(runs_dir, tmp_path, monkeypatch):
    drawn: list[Figure] = []
    savefig = Figure.savefig

    def keep(fig: Figure, *args, **kwargs):
        drawn.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_curves(load_runs(runs_dir), tmp_path / "curves.png")
    (fig,) = drawn
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks  # 3 rounds: not 1.0, 1.5


def test_report_embeds_its_curves_with_relative_links(runs_dir, tmp_path):
    folder = make_report(runs_dir, tmp_path / "report")
    assert folder.files == (tmp_path / "report" / "report.md", tmp_path / "report" / "curves.png")
    assert image_links(folder.markdown) == ["curves.png"]
    check_embedded(folder.files[0], folder.files)
    page = make_report(runs_dir, tmp_path / "docs" / "board.md")  # a .md: figures in board/ beside it
    assert page.files == (tmp_path / "docs" / "board.md", tmp_path / "docs" / "board" / "curves.png")
    assert image_links(page.markdown) == ["board/curves.png"]
    check_embedded(page.files[0], page.files)
    assert make_report(runs_dir).files == ()  # without out: nothing written
    assert image_links(make_report(runs_dir).markdown) == []


def test_report_of_one_run_embeds_its_class_heatmap_too(runs_dir, tmp_path):
    one = make_report(runs_dir / "s0", tmp_path / "one")
    assert [p.name for p in one.files] == ["report.md", "curves.png", "classes.png"]
    check_embedded(one.files[0], one.files)


def test_papers_layout_embeds_every_figure_and_lists_its_csv(grid_dir, tmp_path):
    out = tmp_path / "board"
    made = make_report(grid_dir, out)
    assert {p for p in out.rglob("*") if p.is_file()} == set(made.files)
    assert made.files[0] == out / "report.md" and out / "cells.csv" in made.files
    names = {p.name for p in made.files}
    assert {"curves-IID.png", "partition-IID.png", "classes-IID.png"} <= names
    check_embedded(made.files[0], made.files)


def test_report_names_exactly_the_files_it_wrote(runs_dir, grid_dir, tmp_path, capsys):
    """A folder holding other files, some just written (a paper-layout report's CSV and figures, a file of
    the user's): the final lines name the simple report's two files, nothing else."""
    out = tmp_path / "report"
    assert main(["report", str(grid_dir), "--out", str(out)]) == 0
    (out / "notes.csv").write_text("mine\n")
    now = time.time() + 5  # newer than the report below starts
    for path in out.rglob("*"):
        os.utime(path, (now, now))
    capsys.readouterr()
    assert main(["report", str(runs_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"wrote {out / 'report.md'}", f"wrote {out / 'curves.png'}"]
    check_embedded(out / "report.md", (out / "report.md", out / "curves.png"))


def test_a_malformed_partition_file_is_one_line_before_any_figure_is_drawn(grid_dir, tmp_path, capsys):
    """The partitions are read before the figures are drawn: a bad partition.json in the last setting ends
    the report in its one line with no figure (nor anything else) written, not after the others' figures."""
    runs = tmp_path / "runs"
    shutil.copytree(grid_dir, runs)
    bad = runs / "fedavg-pathological" / "partition.json"  # the setting's first run: its figure's
    bad.write_text('{"clients": [{"train_counts": "x"}]}')
    out = tmp_path / "board"
    assert main(["report", str(runs), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fedpcd: error: partition file {bad} is not a fedpcd partition")
    assert "\n" not in err
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]

"""`fedpcd report --out` writes its files and prints their paths (the markdown only with --print); the
report's curves have whole-number round ticks."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.figure import Figure

from fedpcd.cli import main
from fedpcd.report import load_runs, plot_curves

TINY = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=3", "eval_every=1"]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two finished 3-round runs (two seeds) below one folder."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1):
        run = ["run", "--quiet", *TINY, "rounds=3", f"seed={seed}", f"output_dir={root / f's{seed}'}"]
        assert main(run) == 0
    return root


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
    assert capsys.readouterr().out == markdown  # without --out: the markdown, nothing written


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

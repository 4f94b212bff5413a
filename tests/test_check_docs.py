"""benchmarks/check_docs.py: every number of docs/leaderboard.md and of the reproduction-status tables is
recomputed from the archived runs; the repository passes, and a copy with one digit changed does not."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("check_docs", ROOT / "benchmarks" / "check_docs.py")
check_docs = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_docs)

# what the checker reads besides the archive (linked into the copy, never written)
TEXT_FILES = [
    "README.md",
    "benchmarks/leaderboard.sh",
    "configs/leaderboard/notes.md",
    "configs/leaderboard/fmnist.yaml",
    "docs/leaderboard.md",
    "docs/leaderboard/cells.csv",
    *check_docs.STATUS_PAGES[1:],
]


def _copy(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for name in TEXT_FILES:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, repo / name)
    (repo / "docs" / "results" / "runs").symlink_to(ROOT / "docs" / "results" / "runs")
    return repo


def _tamper(path: Path, line_start: str, old: str, new: str) -> int:
    """Replace the first ``old`` in the first line starting with ``line_start``; its line number."""
    lines = path.read_text().splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines) if line.startswith(line_start) and old in line)
    lines[number] = lines[number].replace(old, new, 1)
    path.write_text("".join(lines))
    return number + 1


def test_the_repository_matches_its_archived_runs(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert check_docs.main(["--repo", str(ROOT)]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out == "every number matches its archived runs\n"


def test_a_changed_digit_a_wrong_verdict_and_a_number_without_a_run_fail(tmp_path, monkeypatch, capsys):
    repo = _copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    board = repo / "docs" / "leaderboard.md"
    row = next(x for x in board.read_text().splitlines() if x.startswith("| fedavg | "))
    number = row.split(" | ")[1].split()[0].strip("*")  # fedavg's first number (its mean rank)
    changed = number[:-1] + str((int(number[-1]) + 1) % 10)
    board_line = _tamper(board, "| fedavg | ", number, changed)
    fedmr = repo / "docs" / "results" / "fedmr.md"
    digit_line = _tamper(fedmr, "| Fashion-MNIST P5C2", "ΔGA -4.87", "ΔGA -4.86")
    verdict_line = _tamper(fedmr, "| Fashion-MNIST P10C2", "| no (within seed noise) |", "| yes |")
    readme = repo / "README.md"
    _tamper(readme, "| [FedSSA]", "five CNNs", "five CNNs, +2.1 points")
    assert check_docs.main(["--repo", str(repo)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"docs/leaderboard.md line {board_line}: found {changed!r}, expected {number!r}"
    assert any(
        line.startswith(f"docs/results/fedmr.md line {digit_line}: found 'ΔGA -4.86 ± 2.06") for line in lines
    )
    assert any(
        line.startswith(f"docs/results/fedmr.md line {verdict_line}: verdict 'yes' disagrees with the runs")
        for line in lines
    )
    assert any("README.md line" in line and "result-like number without a run" in line for line in lines)
    assert len(lines) == 4, lines


def test_rows_need_a_run_for_every_number(tmp_path):
    page = tmp_path / "page.md"
    row = {"paper's claim": "CIFAR-10: +3.5", "measured here": "about 84", "reproduces?": "no", "why": "-"}
    assert check_docs.check_row(tmp_path, page, row) == [
        "number without a run: 'about 84'",
        "a row without runs can only be 'not testable here'",
    ]
    row = {**row, "measured here": "-", "reproduces?": "not testable here (no GPU)"}
    assert check_docs.check_row(tmp_path, page, row) == []
    row = {**row, "reproduces?": "maybe"}
    assert check_docs.check_row(tmp_path, page, row) == [
        "'reproduces?' must start with one of: yes, direction only, no, not testable here"
    ]


@pytest.mark.parametrize(
    ("markdown", "kept"),
    [
        ("# T\n\n## A\n\n| x |\n\n## Curves\n\n![a](a.png)\n\n![b](b.png)\n", "# T\n\n## A\n\n| x |\n\n"),
        ("## A\n\ntext ![a](a.png)\n", "## A\n\ntext ![a](a.png)\n"),
        ("## A\n\n## B\n", "## A\n\n## B\n"),  # an empty section is no figure section
    ],
)
def test_figure_sections_are_left_out(markdown, kept):
    assert check_docs.without_figures(markdown) == kept

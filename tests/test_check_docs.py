"""benchmarks/check_docs.py: every number of docs/leaderboard.md, of the reproduction-status tables and of the
results pages' prose and tables is recomputed from the archived runs; the repository passes, and a copy with
one digit changed, a verdict word turned round or a number without a check comment does not."""

from __future__ import annotations

import importlib.util
import re
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
    *check_docs.PROSE_PAGES,
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


def _page(tmp_path: Path, name: str = "docs/results/fedmr.md") -> tuple[Path, Path]:
    """A copy of one results page beside a link to the archive: (repo, page)."""
    repo = tmp_path / "repo"
    (repo / name).parent.mkdir(parents=True)
    shutil.copyfile(ROOT / name, repo / name)
    (repo / "docs" / "results" / "runs").symlink_to(ROOT / "docs" / "results" / "runs")
    return repo, repo / name


def _replace(path: Path, old: str, new: str) -> int:
    """Replace the one ``old`` of ``path``; the line number where it starts."""
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return text[: text.index(old)].count("\n") + 1


def test_the_results_pages_prose_and_tables_match_their_runs():
    for name in check_docs.PROSE_PAGES:
        assert check_docs.check_prose(ROOT, name) == [], name


def test_a_prose_number_unlike_the_runs_fails(tmp_path):
    repo, page = _page(tmp_path)
    _replace(page, "FedProx\n  (-0.27 ± 1.30)", "FedProx\n  (-0.28 ± 1.30)")
    (problem,) = check_docs.check_prose(repo, "docs/results/fedmr.md")
    assert re.match(r"docs/results/fedmr\.md line \d+: -0\.28 is not what the runs give \(", problem), problem
    assert "-0.27, 1.30, 3.00" in problem  # the paired mean and std, the seed count: -0.27 ± 1.30 is right


def test_a_verdict_word_against_the_rule_fails(tmp_path):
    repo, page = _page(tmp_path)
    _replace(
        page, "MOON on P10C2 (-1.53 ± 0.40) separates", "MOON on P10C2 (-1.53 ± 0.40) is within seed noise"
    )
    (problem,) = check_docs.check_prose(repo, "docs/results/fedmr.md")
    assert (
        "verdict 'within seed noise' disagrees with the runs: " in problem
        and "is beyond its seed spread" in problem
    )
    _replace(
        page, "0.40) is within seed noise", "0.40) does not separate"
    )  # a negated verdict is read as one
    (problem,) = check_docs.check_prose(repo, "docs/results/fedmr.md")
    assert "verdict 'separate' (negated) disagrees with the runs" in problem


def test_a_prose_number_without_a_check_comment_fails(tmp_path):
    repo, page = _page(tmp_path)
    _replace(page, "hurt most.\n", "hurt most, by 3.1 points.\n")
    bullet = _replace(page, "- Ablations (Table 12)", "- Ablations (Table 12)")
    assert check_docs.check_prose(repo, "docs/results/fedmr.md") == [
        f"docs/results/fedmr.md line {bullet}: number without a check comment: 3.1 in "
        "'here and the two together hurt most, by 3.1 points.'"
    ]


def test_a_table_cell_unlike_the_report_fails(tmp_path):
    repo, page = _page(tmp_path)
    line = _replace(page, "| 60.70 ± 1.40 |", "| 60.71 ± 1.40 |")
    assert check_docs.check_prose(repo, "docs/results/fedmr.md") == [
        f"docs/results/fedmr.md line {line}: fedprox, GA: found '60.71 ± 1.40', the runs give '60.70 ± 1.40'"
    ]


@pytest.mark.parametrize(
    ("text", "numbers"),
    [
        ("P10C2, ResNet-18, lr 1e-5, Dir(0.1), Eq. 15, seed 2, N=10, `x 3`, 10-client", []),
        (
            "4.9 ± 2.1 below (seeds -5.0, +2.7; 5-9 points; 1,336 images)",
            [("", "4.9"), ("", "2.1"), ("-", "5.0"), ("+", "2.7"), ("", "5"), ("", "9"), ("", "1,336")],
        ),
    ],
)
def test_what_counts_as_a_number_in_prose(text, numbers):
    assert [(sign, digits) for sign, digits, _ in check_docs.numbers_in(text)] == numbers


def test_verdict_words_and_how_numbers_match():
    assert [
        (w, c) for w, c, _ in check_docs.verdicts_in("it separates; level with X; not within seed noise")
    ] == [("separates", 1), ("level", 0), ("within seed noise", 1)]
    assert check_docs.verdicts_in("the batch-level split and the levels") == []
    assert check_docs._matches("-", "6.8", [-6.84]) and not check_docs._matches("-", "6.9", [-6.84])
    assert check_docs._matches("", "4.9", [-4.87]) and not check_docs._matches("+", "4.9", [-4.87])


def test_exemptions_name_a_reason_and_hold_no_result(tmp_path):
    assert check_docs.check_span(tmp_path, "20 rounds x 5 epochs", "not a result: setting") == []
    assert check_docs.check_span(tmp_path, "20 rounds", "not a result: guess") == [
        "exemption 'guess': the reasons are setting, paper, count, rule, computed"
    ]
    assert check_docs.check_span(tmp_path, "GA 61.0 ± 1.8, level", "not a result: setting") == [
        "a '±' or a verdict word in text exempted as 'setting': 'GA 61.0 ± 1.8, level'"
    ]

"""Check the published numbers against the archived runs: exit 0 when every number matches, exit 1 with one
line per mismatch or per number that no run backs.

What is checked:

- docs/leaderboard.md and docs/leaderboard/cells.csv: rebuilt from the archived runs with the `fedpcd report`
  command of benchmarks/leaderboard.sh (its options, read from the script, with the archive as the runs
  folder) and compared line by line; the figure sections are left out of the comparison (no numbers). The
  notes file (the page's preamble) is the only hand-written text there, so a "±" or a decimal number in it
  that is not in the sweep config counts as a number without a run.
- Every reproduction-status table (the table after a `<!-- reproduction-status -->` line) in README.md and
  the five paper pages. In its "measured here" column each number is the text of a link to the archive
  folder of its runs, followed by a spec of how it is computed, e.g.
  `[ΔGA +1.00 ± 2.00 (3 seeds: ...)](runs/NAME) <!-- check: run=docs/results/runs/NAME/a_seed*
  ref=docs/results/runs/NAME/fedavg_seed* metric=global_acc last=5 claim=+ -->`: the runs matching ``run``
  (and ``ref``, paired by seed: each pair must differ in the algorithm only), ``metric`` as the mean over
  the ``last`` evaluated rounds (``last=best``: the best round), in %, mean ± std over seeds and each seed.
  The "reproduces?" column must agree with the paired difference and the paper's sign ``claim`` (+, - or
  0 for a tie): "yes" and "direction only" need ``fedpcd.report.paper.separation`` (|mean| > 2 std /
  sqrt(n), else 0) to equal it, "no" needs it not to, "not testable here" is for a row without runs or
  with one seed. A measured cell without a spec may hold no digit, and no other column but the paper's
  claim may hold a "±" or a signed number.

usage: python benchmarks/check_docs.py [--repo PATH]
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from fedpcd.report import load_runs, mean_std
from fedpcd.report.document import write_report
from fedpcd.report.grid import build_grid, run_value
from fedpcd.report.paper import cells_csv, separation
from fedpcd.run_format import REPORTED

REPO = Path(__file__).resolve().parents[1]
LEADERBOARD_SCRIPT = "benchmarks/leaderboard.sh"
LEADERBOARD_ARCHIVE = "docs/results/runs/leaderboard-fmnist"
SWEEP_CONFIG = "configs/leaderboard/fmnist.yaml"
STATUS_PAGES = [
    "README.md",
    *(f"docs/results/{name}.md" for name in ("fedgela", "fedmr", "fednh", "fedsc", "fedssa")),
]
STATUS_MARK = "<!-- reproduction-status -->"
VERDICTS = ("yes", "direction only", "no", "not testable here")
SPEC = re.compile(r"<!--\s*check:(.*?)-->")
LINK = re.compile(r"^\[([^\]]+)\]\(([^)\s]+)\)$")
RESULT_LIKE = re.compile(r"±|(?<![\w.])[+-]\d+(?:\.\d+)?")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+")


def _first_difference(found: str, expected: str) -> str:
    """The first differing word of two lines, with the expected one."""
    for a, b in zip(found.split(), expected.split(), strict=False):
        if a != b:
            return f"found {a!r}, expected {b!r}"
    return f"found {found[:80]!r}, expected {expected[:80]!r}"


def compare_lines(name: str, found: str, expected: str, numbers: list[int] | None = None) -> list[str]:
    """One line per line of ``found`` that differs from ``expected`` (or is missing from it, or extra);
    ``numbers``: the line numbers in the file of ``found``'s lines (default 1, 2, ...)."""
    a, b = found.splitlines(), expected.splitlines()
    numbers = numbers or list(range(1, len(a) + 1))
    problems = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            mine = a[i1 + k] if i1 + k < i2 else None
            theirs = b[j1 + k] if j1 + k < j2 else None
            at = i1 + k if mine is not None else i2
            where = f"{name} line {numbers[at] if at < len(numbers) else len(a) + 1}"
            if mine is None:
                problems.append(f"{where}: missing line {theirs[:100]!r}")
            elif theirs is None:
                problems.append(f"{where}: line not backed by the runs: {mine[:100]!r}")
            else:
                problems.append(f"{where}: {_first_difference(mine, theirs)}")
    return problems


def figure_free_lines(markdown: str) -> list[tuple[int, str]]:
    """(line number, line) of ``markdown`` but the sections that hold only images (the report's figures)."""
    kept: list[tuple[int, str]] = []
    section: list[tuple[int, str]] = []
    for number, line in enumerate([*markdown.splitlines(), "## end"], 1):
        if line.startswith("## "):
            body = [x for _, x in section[1:]]
            only_images = section and section[0][1].startswith("## ")
            images = [x for x in body if x.strip()]
            if not (only_images and images and all(x.startswith("![") for x in images)):
                kept += section
            section = []
        section.append((number, line))
    return kept


def without_figures(markdown: str) -> str:
    """``markdown`` without the sections that hold only images."""
    return "".join(line + "\n" for _, line in figure_free_lines(markdown))


def leaderboard_command(repo: Path) -> argparse.Namespace:
    """The options of the `fedpcd report` call in benchmarks/leaderboard.sh."""
    text = (repo / LEADERBOARD_SCRIPT).read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.strip().startswith("fedpcd report"))
    words = shlex.split(line.split(">", 1)[0])[2:]
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("root")
    for option in ("--out", "--title", "--notes"):
        parser.add_argument(option)
    parser.add_argument("--last", type=int, default=5)
    return parser.parse_known_args(words)[0]


def check_leaderboard(repo: Path) -> list[str]:
    """docs/leaderboard.md and its cells.csv against the report rebuilt from the archive; the notes."""
    options = leaderboard_command(repo)
    problems = []
    if options.root != LEADERBOARD_ARCHIVE:
        problems.append(f"{LEADERBOARD_SCRIPT}: the report must read the archive {LEADERBOARD_ARCHIVE}")
    expected = write_report(LEADERBOARD_ARCHIVE, None, options.last, title=options.title, notes=options.notes)
    page = Path(options.out)
    kept = figure_free_lines(page.read_text())
    found = "".join(line + "\n" for _, line in kept)
    problems += compare_lines(page.as_posix(), found, expected, [n for n, _ in kept])
    grid = build_grid(load_runs(LEADERBOARD_ARCHIVE))
    csv_path = page.with_suffix("") / "cells.csv"
    problems += compare_lines(csv_path.as_posix(), csv_path.read_text(), cells_csv(grid, options.last))
    config = Path(SWEEP_CONFIG).read_text()
    for number in DECIMAL.findall(Path(options.notes).read_text()):
        if number not in config:
            problems.append(f"{options.notes}: {number} is in no run and not in {SWEEP_CONFIG}")
    if "±" in Path(options.notes).read_text():
        problems.append(
            f"{options.notes}: a '±' value written by hand (results belong in the generated part)"
        )
    return problems


def status_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, {column: cell}) of every row of every reproduction-status table in ``path``."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() != STATUS_MARK:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("|"):
            j += 1
        header = [c.strip() for c in lines[j].strip().strip("|").split("|")]
        for k in range(j + 2, len(lines)):
            if not lines[k].startswith("|"):
                break
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", lines[k].strip().strip("|"))]
            yield k + 1, dict(zip(header, cells, strict=False))


def _spec(text: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(text))


def seed_values(repo: Path, pattern: str, metric: str, last: str) -> dict[int, tuple[float, object]]:
    """{seed: (value, run)} of the archived runs matching ``pattern`` (relative to ``repo``)."""
    out = {}
    for folder in sorted(repo.glob(pattern)):
        for run in load_runs(folder):
            value = run_value(
                run, metric, "best" if last == "best" else "last", 0 if last == "best" else int(last)
            )
            if value is not None:
                out[run.config["seed"]] = (value, run)
    return out


def measured(repo: Path, spec: dict[str, str]) -> tuple[str, list[float], list[str]]:
    """(the cell's expected text, the per-seed values or paired differences, problems)."""
    from fedpcd.report import _without_algorithm

    label = next(m.label for m in REPORTED if m.key == spec["metric"]) + (
        " best" if spec["last"] == "best" else ""
    )
    mine = seed_values(repo, spec["run"], spec["metric"], spec["last"])
    problems = [] if mine else [f"no archived run matches {spec['run']}"]
    if "ref" not in spec:
        values = [mine[s][0] for s in sorted(mine)]
        per_seed = ", ".join(f"{100 * v:.2f}" for v in values)
        return f"{label} {mean_std(values)} ({_seeds(values)}: {per_seed})", values, problems
    theirs = seed_values(repo, spec["ref"], spec["metric"], spec["last"])
    values = []
    for seed in sorted(mine):
        if seed not in theirs:
            problems.append(f"{spec['run']} seed {seed} has no run of {spec['ref']} to pair with")
            continue
        if _without_algorithm(mine[seed][1]) != _without_algorithm(theirs[seed][1]):
            problems.append(
                f"{spec['run']} seed {seed} and its {spec['ref']} run differ in more than the algorithm"
            )
        values.append(mine[seed][0] - theirs[seed][0])
    per_seed = ", ".join(f"{100 * v:+.2f}" for v in values)
    return f"Δ{label} {mean_std(values, signed=True)} ({_seeds(values)}: {per_seed})", values, problems


def _seeds(values: list[float]) -> str:
    return f"{len(values)} seed{'s' if len(values) != 1 else ''}"


def check_row(repo: Path, page: Path, row: dict[str, str]) -> list[str]:
    """The problems of one status-table row (see the module docstring)."""
    cell = row.get("measured here", "")
    given = row.get("reproduces?", "")
    verdict = next((v for v in sorted(VERDICTS, key=len, reverse=True) if given.startswith(v)), None)
    problems = [] if verdict else [f"'reproduces?' must start with one of: {', '.join(VERDICTS)}"]
    for column, text in row.items():
        if column not in ("measured here", "paper's claim") and RESULT_LIKE.search(text):
            problems.append(f"column {column!r} holds a result-like number without a run: {text[:60]!r}")
    specs = SPEC.findall(cell)
    visible = SPEC.sub("", cell).strip()
    if not specs:
        if re.search(r"\d", visible):
            problems.append(f"number without a run: {visible[:60]!r}")
        if verdict and verdict != "not testable here":
            problems.append("a row without runs can only be 'not testable here'")
        return problems
    link = LINK.match(visible)
    if len(specs) != 1 or not link:
        return [*problems, "the measured cell must be one [text](archive folder) link and one check comment"]
    spec = _spec(specs[0])
    if {"run", "metric", "last"} - set(spec) or spec["metric"] not in {m.key for m in REPORTED}:
        return [
            *problems,
            f"a check needs run=, metric= (one of {', '.join(m.key for m in REPORTED)}) and last=",
        ]
    text, values, found = measured(repo, spec)
    problems += found
    if link.group(1) != text:
        problems.append(f"found {link.group(1)!r}, the runs give {text!r}")
    folder = Path(spec["run"]).parent
    if (page.parent / link.group(2)).resolve() != (repo / folder).resolve():
        problems.append(f"the link {link.group(2)!r} does not point at the runs' folder {folder}")
    if "ref" in spec and verdict and verdict != "not testable here":
        claim = {"+": 1, "-": -1, "0": 0}.get(spec.get("claim", ""))
        if claim is None:
            problems.append(
                "a paired check needs claim=+, claim=- or claim=0 (the paper's direction or a tie)"
            )
        elif (separation(values) == claim) != (verdict in ("yes", "direction only")):
            problems.append(
                f"verdict {verdict!r} disagrees with the runs: the difference is "
                f"{'beyond' if separation(values) else 'within'} its seed spread (|mean| vs 2 std/sqrt(n))"
            )
    elif verdict == "not testable here" and len(values) > 1 and "ref" in spec:
        problems.append("'not testable here' with several seeds: say whether it reproduces")
    return problems


def check_status_tables(repo: Path) -> list[str]:
    problems = []
    for name in STATUS_PAGES:
        page = repo / name
        rows = list(status_rows(page))
        if not rows:
            problems.append(f"{name}: no reproduction-status table (a {STATUS_MARK} line, then the table)")
        for number, row in rows:
            problems += [f"{name} line {number}: {p}" for p in check_row(repo, page, row)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the repository to check (default: this one)")
    repo = parser.parse_args(argv).repo.resolve()
    os.chdir(repo)  # the report names its runs folder as given: relative, as in benchmarks/leaderboard.sh
    problems = check_leaderboard(repo) + check_status_tables(repo)
    for problem in problems:
        print(problem)
    if not problems:
        print("every number matches its archived runs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

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

- Every other number and verdict word of the results pages (PROSE_PAGES) and of the README's "## Results"
  part, outside code, figures and status tables (``check_prose``). A number or verdict word ("separates",
  "beats"; "within (seed) noise / spread", "level"; a "not" / "no" just before turns it round) is covered by
  the first check or exemption comment after it in its paragraph, list item or table row:
  ``<!-- check: run=GLOB [ref=GLOB] metric=KEY [last=N|best|all] [round=A[-B]] [stat=swing|hours]
  [rounds_to=X] [minus=KEY] [unit=kB per=N] [vary=KEYS] [says=separates|noise] -->`` (GLOB relative to
  docs/results/ unless it starts with docs/) backs each run's value (accuracies in %), their mean, std and
  count; with ``ref`` (paired by seed as above, ``vary`` naming config keys that may differ too) the paired
  differences, their mean, std and count and each side's mean and std. A number matches a value written with
  as many decimals (a signed number with its sign, an unsigned one its size); a verdict word (or ``says``)
  must agree with ``separation`` of the paired differences; "every seed" needs differences of one sign.
  ``<!-- not a result: REASON -->`` (REASON one of EXEMPT_REASONS; alone on the line before a paragraph or
  table: the whole of it) exempts numbers that are not results, and may hold no "± number" and no verdict
  word (a "rule" may name its verdicts). Headings name settings: no "±", signed number or verdict word.
- Tables copied from `fedpcd report` (``check_table``): a ``<!-- table: RUNS [--paired-with A] [--swing]
  [--best] [--rounds-to X ..] [--last N] [--setting S] [--participants N] -->`` line before the table; every
  number in it must be the report's, at the page's decimals.

usage: python benchmarks/check_docs.py [--repo PATH]
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import statistics
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
    from fedpcd.report import same_setting

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
        if not same_setting(mine[seed][1], theirs[seed][1]):
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


# ---- prose claims and the pages' other tables --------------------------------------------------------------

PROSE_PAGES = [
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
]
README_RESULTS = "## Results"  # the README's part with result claims: from this heading to the next "## "
EXEMPT_REASONS = {
    "setting": "a setting of the runs: data sizes, client, round, epoch and seed counts, hyperparameters",
    "paper": "a number quoted from a paper",
    "count": "a count of runs or methods, a time to regenerate, a date, a commit",
    "rule": "the separation rule's constants",
    "computed": "computed without training by the command shown beside it (partitions, the ETF's geometry)",
}
COMMENT = re.compile(r"<!--(.*?)-->", re.S)
TABLE_MARK = re.compile(r"^<!--\s*table:(.*?)-->\s*$")
EXEMPT_LINE = re.compile(r"^<!--\s*not a result:\s*(\w+)\s*-->\s*$")
# text that holds digits but no number: inline code, link targets, figures, scientific notation, names with
# digits (P10C2, ResNet-18, N=10, x^0.5, CIFAR-10/100), references to a paper's equations, tables, sections
MASKS = [
    re.compile(r"`[^`]*`"),
    re.compile(r"\]\([^)]*\)"),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)?e-?\d+\b"),
    re.compile(r"\b[A-Za-z][\w-]*\d[\w./-]*"),
    re.compile(r"\b\w+\s?=\s?[\d.]+\b(?!\s*(?:%|points))"),
    re.compile(r"[\^#][\d.]+"),
    re.compile(r"\{[\d,\s.]+\}"),
    re.compile(r"\b[A-Za-z]+\(\s*[\d.]+\s*\)"),
    re.compile(r"\b\d+[-/][A-Za-z]\w*"),
    re.compile(
        r"\b(?:Eqs?\.|Tables?|Figs?\.|Figure|[Ss]ections?|Sec\.|App\.|Alg\.|Algorithm)\s*[\d.]+(?:\s*[-,]\s*\d+)*"
    ),
    re.compile(
        r"\b(?:[Ss]eeds?|[Rr]ounds?|[Cc]lients?|[Cc]lass)\s+\d+(?:\s*-\s*\d+)?(?![\d.])(?!\s*(?:%|points|x\b))"
    ),
]
NUMBER = re.compile(r"(?<![\w.])([+\-−]?)(\d+(?:,\d{3})*(?:\.\d+)?)(?![\w])")
POSITIVE = re.compile(r"\b(?:separates?|beats?)\b")
NEGATIVE = re.compile(r"\bwithin (?:the )?(?:seed )?(?:noise|spread)\b|(?<![\w-])level\b(?!-)")
NEGATION = re.compile(r"\b(?:not|no|never|neither|nor)\b(?:\W+\w+){0,2}\W*$")
EVERY_SEED = re.compile(r"\bevery seed\b")


def _masked(text: str) -> str:
    for mask in MASKS:
        text = mask.sub(lambda m: " " * len(m.group()), text)
    return text


def numbers_in(text: str) -> list[tuple[str, str, int]]:
    """(sign, digits, position) of every number in prose ``text`` (see MASKS for what is not a number); a
    "+" or "-" right after a digit (a range, "5-9") is no sign."""
    masked = _masked(text)
    out = []
    for m in NUMBER.finditer(masked):
        sign = m.group(1).replace("−", "-")
        if sign and m.start() > 0 and (masked[m.start() - 1].isalnum() or masked[m.start() - 1] in ".)"):
            sign = ""
        out.append((sign, m.group(2), m.start()))
    return out


def verdicts_in(text: str) -> list[tuple[str, int, int]]:
    """(word, claimed separation: 1 separates, 0 does not, position) of each verdict word in ``text``; a
    "not" / "no" up to two words before it turns it round."""
    text = _masked(text)
    found = []
    for pattern, claim in ((POSITIVE, 1), (NEGATIVE, 0)):
        for m in pattern.finditer(text):
            negated = NEGATION.search(text[: m.start()]) is not None
            found.append((m.group(), 1 - claim if negated else claim, m.start()))
    return found


def _percent(key: str) -> float:
    return 100.0 if key in {m.key for m in REPORTED} or "acc" in key or key.startswith("pa_") else 1.0


def _run_number(run: object, spec: dict[str, str]) -> list[float]:
    """One run's numbers for a prose check: its metric at ``round=`` (A or A-B), or over its last rounds."""
    from fedpcd.report import rounds_to_target, swing

    key, scale = spec["metric"], _percent(spec["metric"])
    if spec.get("unit") == "kB":  # bytes as kB, per ``per`` participants
        scale = 1 / 1000 / float(spec.get("per", 1))
    records = run.records  # type: ignore[attr-defined]
    if "round" in spec:
        first, _, end = spec["round"].partition("-")
        rounds = range(int(first), int(end or first) + 1)
        return [scale * r[key] for r in records if r["round"] in rounds and r.get(key) is not None]
    if spec.get("stat") == "hours":  # the run's wall time (summary.json) in hours; the check backs their sum
        return [run.summary["wall_s"] / 3600]  # type: ignore[attr-defined]
    if spec.get("stat") == "swing":
        value = swing(records, key, int(spec.get("last", 5)))
        return [] if value is None else [scale * value]
    if "rounds_to" in spec:
        value = rounds_to_target(records, key, float(spec["rounds_to"]) / 100)
        return [] if value is None else [float(value)]
    last = spec.get("last", "5")
    last = str(len(records)) if last == "all" else last
    protocol, rounds = ("best", 0) if last == "best" else ("last", int(last))
    value = run_value(run, key, protocol, rounds)
    if value is not None and "minus" in spec:  # a metric minus another of the same run
        other = run_value(run, spec["minus"], protocol, rounds)
        value = None if other is None else value - other
    return [] if value is None else [scale * value]


def claim_values(repo: Path, spec: dict[str, str]) -> tuple[list[float], list[float], list[str]]:
    """(the numbers a prose check backs, its paired differences (empty if unpaired), problems): each run's
    number and their mean, std and count; with ``ref``, also the ref's and the paired differences'."""
    if "run" not in spec or "metric" not in spec:
        return (
            [],
            [],
            [
                "a prose check needs run= and metric= (and optionally ref=, last=, round=, stat=swing, "
                "rounds_to=)"
            ],
        )

    def side(pattern: str) -> dict[int, tuple[list[float], object]]:
        pattern = pattern if pattern.startswith("docs/") else f"docs/results/{pattern}"
        out = {}
        for folder in sorted(repo.glob(pattern)):
            if (folder / "summary.json").exists() or not (folder / "metrics.jsonl").exists():
                for run in load_runs(folder):
                    out.setdefault(run.config["seed"], ([], run))[0].extend(_run_number(run, spec))
        return out

    def summary(values: list[float]) -> list[float]:
        if not values:
            return []
        spread = [statistics.stdev(values)] if len(values) > 1 else []
        return [*values, statistics.fmean(values), *spread, float(len(values))]

    mine = side(spec["run"])
    if not mine:
        return [], [], [f"no archived run matches {spec['run']}"]
    values = [v for seed in sorted(mine) for v in mine[seed][0]]
    if spec.get("stat") == "hours":
        return [sum(values)], [], []
    if "ref" not in spec:
        return summary(values), [], []
    from fedpcd.report import same_setting

    theirs = side(spec["ref"])
    vary = frozenset(spec.get("vary", "").split(","))  # config keys the check lets differ too
    problems, diffs = [], []
    for seed in sorted(mine):
        if seed not in theirs or len(theirs[seed][0]) != 1 or len(mine[seed][0]) != 1:
            problems.append(f"{spec['run']} seed {seed} has no single value of {spec['ref']} to pair with")
            continue
        if not same_setting(mine[seed][1], theirs[seed][1], vary):
            problems.append(
                f"{spec['run']} seed {seed} and its {spec['ref']} run differ in more than the algorithm"
            )
        diffs.append(mine[seed][0][0] - theirs[seed][0][0])
    ref_values = [v for seed in sorted(theirs) for v in theirs[seed][0]]
    backed = summary(diffs) + summary(values)[-3:-1] + summary(ref_values)[-3:-1]  # and each side's mean, std
    if len(values) == 1:
        backed += values + ref_values
    return backed, diffs, problems


def _matches(sign: str, digits: str, values: list[float]) -> bool:
    """Whether ``sign digits`` is one of ``values`` written with as many decimals (no sign: its size)."""
    decimals = len(digits.partition(".")[2])
    plain = digits.replace(",", "")
    for value in values:
        if sign and f"{value:+.{decimals}f}" == sign + plain:
            return True
        if not sign and f"{abs(value):.{decimals}f}" == plain:
            return True
    return False


def check_span(repo: Path, text: str, comment: str) -> list[str]:
    """The problems of one prose span: ``text`` up to the check or exemption ``comment`` that ends it."""
    comment = comment.strip()
    numbers, verdicts = numbers_in(text), verdicts_in(text)
    if comment.startswith("not a result:"):
        reason = comment.partition(":")[2].strip()
        problems = (
            []
            if reason in EXEMPT_REASONS
            else [f"exemption {reason!r}: the reasons are {', '.join(EXEMPT_REASONS)}"]
        )
        if re.search(r"±\s*\d", text) or (verdicts and reason != "rule"):  # a rule may name its verdicts
            problems.append(f"a '±' or a verdict word in text exempted as {reason!r}: {text.strip()[-60:]!r}")
        return problems
    try:
        spec = _spec(comment.partition(":")[2])
    except ValueError:
        return [f"unreadable check comment {comment[:60]!r}"]
    values, diffs, problems = claim_values(repo, spec)
    if not values:
        return problems
    for sign, digits, at in numbers:
        if not _matches(sign, digits, values):
            problems.append(
                f"{sign + digits} is not what the runs give ({_listed(values)}): {_around(text, at)!r}"
            )
    if spec.get("says") not in (None, "separates", "noise"):
        problems.append(f"says={spec['says']}: say separates or noise")
    elif "says" in spec:
        verdicts.append((f"says={spec['says']}", int(spec["says"] == "separates"), 0))
    for word, claim, _ in verdicts:
        if not diffs:
            problems.append(f"verdict {word!r} needs a paired check (ref=)")
        elif (separation(diffs) != 0) != bool(claim):
            problems.append(
                f"verdict {word!r}{' (negated)' if claim != (POSITIVE.match(word) is not None) else ''} "
                f"disagrees with the runs: {_listed(diffs)} is {'beyond' if separation(diffs) else 'within'} "
                "its seed spread (|mean| vs 2 std/sqrt(n))"
            )
    if EVERY_SEED.search(text) and diffs and not (all(d > 0 for d in diffs) or all(d < 0 for d in diffs)):
        problems.append(f"'every seed' but the paired differences change sign: {_listed(diffs)}")
    return problems


def _listed(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _plain(cell: str) -> str:
    return COMMENT.sub("", cell).replace("**", "").replace("`", "").strip()


CELL_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
KB_BOTH = "kB up / down per round"
KB_CLIENT = "kB up / down per client"  # with the marker's --participants N: the report's kB divided by N


def _same_numbers(page: str, generated: str) -> bool:
    """Whether the numbers of a page cell are those of the report's cell, each at the page's decimals."""
    mine, theirs = CELL_NUMBER.findall(page), CELL_NUMBER.findall(generated)
    if len(mine) != len(theirs):
        return False
    for a, b in zip(mine, theirs, strict=True):
        decimals = len(a.partition(".")[2])
        if f"{float(a):.{decimals}f}" != f"{float(b):.{decimals}f}":
            return False
    return True


def table_options(text: str) -> argparse.Namespace:
    """A table marker's words: the runs folder and `fedpcd report`'s options, plus --setting."""
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


def check_table(repo: Path, marker: str, lines: list[str]) -> list[tuple[int, str]]:
    """(index into ``lines``, problem) for a page table marked ``<!-- table: RUNS [options] -->``: every
    number in it must be the cell of `fedpcd report RUNS [options]` in its row (the row's ``<!-- row: KEY
    -->`` or its first cell, KEY the report's setting columns joined by "; ", only the algorithm with
    --setting) and column (same name, "(paired)" and case aside; "kB up / down per round": both kB columns;
    a header's ``<!-- column: metric=M last=best -->``: the mean ± std over seeds of that metric's value;
    a "paper ..." column holds a paper's numbers and is not checked)."""
    from fedpcd.report import group_runs, mean_std, report_table

    try:
        options = table_options(marker)
    except (argparse.ArgumentError, ValueError) as error:
        return [(0, f"unreadable table marker: {error}")]
    runs = load_runs(repo / options.root)
    if not runs:
        return [(0, f"no archived runs below {options.root}")]
    generated = report_table(
        runs, options.last, options.rounds_to, options.paired_with, options.swing, False, options.best
    ).splitlines()
    header = _cells(generated[0])
    sections = header[: header.index("seeds")]
    _, groups = group_runs(runs)
    rows: dict[str, tuple[dict[str, str], list]] = {}
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
        return [(0, f"no setting {options.setting!r} in the report of {options.root}")]
    names = {h.lower(): h for h in header}
    page_header = _cells(lines[0])
    problems = []
    for i, line in enumerate(lines[2:], 2):
        cells = _cells(line)
        if re.search(r"<!--\s*check:", line):  # a row of prose claims: each number by its check comment
            problems += [(i, p) for p in check_text(repo, line)]
            continue
        keys = [m.group(1).strip() for m in re.finditer(r"<!--\s*row:(.*?)-->", line)]
        key = keys[0] if keys else _plain(cells[0]).lower()
        if key not in rows:
            problems.append((i, f"row {key!r} is not in the report (its rows: {', '.join(rows)})"))
            continue
        found, members = rows[key]
        for title, cell in zip(page_header, cells, strict=False):
            name = _plain(title).replace("(paired)", "").strip()
            if name.startswith("Δ") and " vs " not in name:
                name = f"{name} vs {options.paired_with}"
            if not re.search(r"\d", _plain(cell)) or name.lower() in ("method", "algorithm", *sections):
                continue
            if name.lower().startswith("paper") or title == page_header[0]:
                continue
            column = re.search(r"<!--\s*column:(.*?)-->", title)
            if column:
                spec = _spec(column.group(1))
                values = [
                    v for v in (run_value(r, spec["metric"], "best", 0) for r in members) if v is not None
                ]
                expected = mean_std(values)
            elif name == KB_BOTH:
                expected = f"{found['kB up/rnd']} / {found['kB down/rnd']}"
            elif name == KB_CLIENT and options.participants:
                up, down = (float(found[k]) / options.participants for k in ("kB up/rnd", "kB down/rnd"))
                expected = f"{up:.1f} / {down:.1f}"
            elif name.lower() in names or name.lower().replace("fedavg", str(options.paired_with)) in names:
                expected = found[
                    names.get(name.lower()) or names[name.lower().replace("fedavg", str(options.paired_with))]
                ]
            else:
                problems.append((i, f"column {name!r} is not one of the report's: {', '.join(header)}"))
                continue
            if not _same_numbers(_plain(cell), expected):
                problems.append((i, f"{key}, {name}: found {_plain(cell)!r}, the runs give {expected!r}"))
    return problems


def check_prose(repo: Path, name: str, first: int = 0, last: int | None = None) -> list[str]:
    """Every number and verdict word of page ``name`` (its lines ``first``..``last``) outside code blocks,
    figures and the status table: covered by the check or exemption comment that ends its span (the text
    since the previous such comment in the same paragraph, list item or table row), or in a marked table."""
    lines = (repo / name).read_text().splitlines()
    last = len(lines) if last is None else last
    problems: list[str] = []
    blocks: list[tuple[int, str, str | None]] = []  # (line index, text, exemption reason of the block)
    i, fence, exempt, fresh = first, False, None, True
    while i < last:
        line = lines[i]
        if line.startswith("```"):
            fence = not fence
        if fence or line.startswith("```") or line.startswith("!["):
            i, fresh = i + 1, True
            continue
        if line.strip() in (STATUS_MARK,) or TABLE_MARK.match(line.strip()):
            j = i + 1
            while j < last and not lines[j].startswith("|"):
                j += 1
            k = j
            while k < last and lines[k].startswith("|"):
                k += 1
            marker = TABLE_MARK.match(line.strip())
            if marker:
                problems += [
                    f"{name} line {j + n + 1}: {p}" for n, p in check_table(repo, marker.group(1), lines[j:k])
                ]
            i, fresh = k, True
            continue
        skip = EXEMPT_LINE.match(line.strip())
        if skip:
            exempt, i, fresh = skip.group(1), i + 1, True
            continue
        if not line.strip():
            exempt, i, fresh = None, i + 1, True
            continue
        if line.startswith("#"):  # a heading names a setting: no result-like number, no verdict
            if RESULT_LIKE.search(_masked(line)) or verdicts_in(line):
                problems.append(f"{name} line {i + 1}: a heading with a result-like number or a verdict word")
            i, fresh = i + 1, True
            continue
        if fresh or line.startswith("|") or line.lstrip().startswith("- "):
            blocks.append((i, line, exempt))
        else:
            start, text, reason = blocks[-1]
            blocks[-1] = (start, text + " " + line, reason)
        i, fresh = i + 1, False
    for start, text, reason in blocks:
        if reason is not None:
            text = COMMENT.sub(" ", text) + f"<!-- not a result: {reason} -->"
        problems += [f"{name} line {start + 1}: {p}" for p in check_text(repo, text)]
    return problems


def check_text(repo: Path, text: str) -> list[str]:
    """The problems of one paragraph, list item or table row: each span (the text up to a check or exemption
    comment, from the previous one) by ``check_span``; a number or verdict word after the last one."""
    problems, rest = [], 0
    for m in COMMENT.finditer(text):
        body = m.group(1).strip()
        if not (body.startswith("check:") or body.startswith("not a result:")):
            continue
        problems += check_span(repo, COMMENT.sub(" ", text[rest : m.start()]), body)
        rest = m.end()
    tail = COMMENT.sub(" ", text[rest:])
    for sign, digits, at in numbers_in(tail):
        problems.append(f"number without a check comment: {sign + digits} in {_around(tail, at)!r}")
    for word, _, at in verdicts_in(tail):
        problems.append(f"verdict {word!r} without a paired check comment: {_around(tail, at)!r}")
    return problems


def _around(text: str, at: int) -> str:
    return " ".join(text[max(at - 40, 0) : at + 30].split())


def readme_results(repo: Path) -> tuple[int, int]:
    """The README's result lines: from its "## Results" heading to the next "## " heading."""
    lines = (repo / "README.md").read_text().splitlines()
    first = lines.index(README_RESULTS)
    end = next((k for k in range(first + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    return first, end


def check_all_prose(repo: Path) -> list[str]:
    problems = []
    for name in PROSE_PAGES:
        problems += check_prose(repo, name)
    problems += check_prose(repo, "README.md", *readme_results(repo))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the repository to check (default: this one)")
    repo = parser.parse_args(argv).repo.resolve()
    os.chdir(repo)  # the report names its runs folder as given: relative, as in benchmarks/leaderboard.sh
    problems = check_leaderboard(repo) + check_status_tables(repo) + check_all_prose(repo)
    for problem in problems:
        print(problem)
    if not problems:
        print("every number matches its archived runs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The shipped tree points only at what the repository holds.

What the code relies on is written down in the repository (docs/design.md for the engine's conventions, the
papers themselves for method facts). So nothing shipped may cite design notes, specs or issue numbers that
live elsewhere ("see specs/fedmr.md", "spec 2.1", "CONTRACT.md", "issue 21", "once landed"), and every
relative markdown link and every path it names (``docs/...md``, ``configs/...yaml``, ...) must exist.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("src", "configs", "flower-app", "benchmarks", "docs", "README.md")
ARCHIVE = ROOT / "docs" / "results" / "runs"  # archived run data, kept as it was written
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini"}

# References to material outside the repository. Each pattern names what it catches.
FORBIDDEN = [
    (re.compile(r"\bCONTRACT(?:\.md)?\b"), "CONTRACT.md"),
    (re.compile(r"\bDESIGN\.md\b"), "DESIGN.md (the in-repo notes are docs/design.md)"),
    (re.compile(r"\bspecs/"), "a specs/ file"),
    (re.compile(r"\bspecs?\s+(?:sec(?:tion|\.)?\s*)?\d"), "a spec section ('spec 2.1')"),
    (re.compile(r"\bspec\s+(?:pitfall\s+)?[PT]\d"), "a spec item ('spec P8')"),
    (re.compile(r"\b(?:the|shared)\s+specs?\b"), "'the spec'"),
    (re.compile(r"\banchors\.md\b"), "anchors.md"),
    (re.compile(r"\bissue\s+\d+", re.IGNORECASE), "an issue number ('issue 21')"),
    (re.compile(r"\bonce\s+landed\b", re.IGNORECASE), "'once landed'"),
    (re.compile(r"(?<![\w-])seeds/"), "the seeds/ folder"),
    (re.compile(r"/work/shared|\.\./shared/"), "the shared folder"),
]

MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# repository paths named in text: docs/ and configs/ files everywhere; code paths in docs and configs only
# (source files also name paths inside other projects' repositories, e.g. the official codes)
DOC_PATH = re.compile(r"(?<![\w/.-])((?:docs|configs)/[\w./=-]*[\w-]\.(?:md|yaml|yml))\b")
CODE_PATH = re.compile(
    r"(?<![\w/.-])((?:src|tests|benchmarks|flower-app)/[\w./=-]*[\w-]\.(?:py|sh|toml|md))\b"
)
PLACEHOLDER = re.compile(r"\b[A-Z]{3,}\b")  # configs/repro/NAME.yaml


def shipped_files() -> list[Path]:
    files: list[Path] = []
    for name in SHIPPED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for p in sorted(path.rglob("*")):
            rel = p.relative_to(ROOT)
            if not p.is_file() or p.suffix not in TEXT or p.is_relative_to(ARCHIVE):
                continue
            hidden = any(part.startswith(".") or part.endswith(".egg-info") for part in rel.parts)
            if hidden or "__pycache__" in rel.parts:
                continue
            files.append(p)
    return files


def forbidden_hits(text: str) -> list[str]:
    """'line N: what (matched text)' for every reference to material outside the repository."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, what in FORBIDDEN:
            for m in pattern.finditer(line):
                hits.append(f"line {number}: {what} ({m.group(0)!r})")
    return hits


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def test_the_scan_covers_the_tree():
    files = {p.relative_to(ROOT).as_posix() for p in shipped_files()}
    assert {"README.md", "docs/design.md", "configs/example.yaml", "src/fedpcd/cli.py"} <= files
    assert not any(f.startswith("docs/results/runs/") for f in files)


@pytest.mark.parametrize(
    "text",
    [
        '"""FedMR regulariser; see specs/fedmr.md."""',
        "# rho 0.9 (spec 2.5)",
        "(specs/fednh.md sec. 5)",
        "see spec section 4",
        "spec pitfall P8",
        "as the spec's default",
        "The command line (CONTRACT.md).",
        "The metrics of DESIGN.md, defined once.",
        "The vectorized executor (issue 21).",
        "Add baselines to `algorithm` once landed.",
        "the papers in seeds/000.txt",
        "read ../shared/specs/anchors.md",
    ],
)
def test_the_detector_flags_external_references(text):
    assert forbidden_hits(text)


@pytest.mark.parametrize(
    "text",
    [
        "spec = importlib.util.spec_from_file_location(name, path)",
        "docs/design.md section 6",
        "FedNH (Dai et al., AAAI 2023), App. A.2",
        "FL-bench#5/#38",
        "def _fmt(value: float | None, spec: str) -> str:",
        "seeds 0-2",
    ],
)
def test_the_detector_leaves_ordinary_text_alone(text):
    assert not forbidden_hits(text)


def test_no_references_to_material_outside_the_repository():
    problems = []
    for path in shipped_files():
        for hit in forbidden_hits(_read(path)):
            problems.append(f"{path.relative_to(ROOT)} {hit}")
    assert not problems, "references to files the repository lacks:\n" + "\n".join(problems)


def test_markdown_links_resolve():
    broken = []
    for path in shipped_files():
        if path.suffix != ".md":
            continue
        for m in MD_LINK.finditer(_read(path)):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            target = unquote(target.split("#", 1)[0])
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: ({m.group(1)})")
    assert not broken, "markdown links to files that do not exist:\n" + "\n".join(broken)


def test_named_repository_paths_exist():
    missing = []
    for path in shipped_files():
        text = _read(path)
        rel = path.relative_to(ROOT)
        patterns = [DOC_PATH]
        if rel.parts[0] in ("docs", "configs") or rel.name == "README.md":
            patterns.append(CODE_PATH)
        for pattern in patterns:
            for m in pattern.finditer(text):
                named = m.group(1)
                if PLACEHOLDER.search(named):
                    continue
                if not (ROOT / named).exists() and not (path.parent / named).exists():
                    missing.append(f"{rel}: {named}")
    assert not missing, "paths named in the shipped tree that do not exist:\n" + "\n".join(missing)


def test_cli_help_and_list_cite_nothing_outside_the_repository(capsys):
    from fedpcd.cli import main
    from fedpcd.cli_args import build_parser

    parser = build_parser()
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [sub.format_help() for sub in action.choices.values()]
    assert main(["list"]) == 0
    texts.append(capsys.readouterr().out)
    hits = [hit for text in texts for hit in forbidden_hits(text)]
    assert not hits, "fedpcd --help / fedpcd list cite material outside the repository:\n" + "\n".join(hits)

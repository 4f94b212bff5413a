"""The fenced blocks of the documentation pages, as the tests that run them read them.

Every ```bash and ```python block of the runner pages (README.md, docs/getting-started.md) runs as written,
in order, as a reader following the page would run it: in a fresh folder with only the wheel installed
(tests/test_packaging.py), since the pages' commands name shipped configs and run the same after `pip
install` as in a clone. A page may say how the tests treat a block, in a comment right above it that a
reader of the page's source sees:

- ``<!-- doc-test: with KEY=VALUE ... -->``: these overrides are added to each ``fedpcd run --config``,
  ``fedpcd sweep --config`` and ``fedpcd demo`` command of the block (fewer rounds, less data: the
  commands stay the same, the runs get short);
- ``<!-- doc-test: clone: REASON -->``: the block needs the repository (its archived runs): it runs in a
  fresh copy of the working tree instead (tests/test_readme_blocks.py);
- ``<!-- doc-test: skip: REASON -->``: the block is not run (a set-up block: it installs the project, which
  ``make check-release`` tests, and ``make test`` would run the suite inside itself).

A ```yaml block under a sentence ending in "Save this as `NAME`:" is written to NAME, as the reader does.
Every other page's `fedpcd` commands are checked by the default suite (tests/test_readme_blocks.py): the
command line parses and its ``--config`` names a shipped config or a file the pages have the reader write.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md")  # the pages whose blocks run
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
DIRECTIVE = re.compile(r"<!-- doc-test: (?P<what>skip|with|clone)(?::)? (?P<arg>.*?) -->\s*$")
SAVE_AS = re.compile(r"Save this as `(?P<name>[^`]+)`:\s*$")
# the commands a `with` directive shortens: up to the end of the command, before a trailing comment
COMMAND = re.compile(r"(?:^\s*|[|&;]\s*)fedpcd\s")  # a line that runs fedpcd
SHORTENED = re.compile(r"^(?P<cmd>fedpcd (?:run --config|sweep --config|demo)\b.*?)(?P<comment>\s+#.*)?$")


def doc_pages() -> list[str]:
    """README.md and every page of docs/ (the site's pages and the results pages)."""
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    directive: tuple[str, str] | None  # ("skip" | "clone", reason) or ("with", overrides)
    save_as: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"

    @property
    def runs(self) -> bool:
        """A bash or python block that a runner executes (in the wheel's folder or in a clone)."""
        return self.lang in ("bash", "python") and not (self.directive and self.directive[0] == "skip")

    @property
    def in_clone(self) -> bool:
        return bool(self.directive and self.directive[0] == "clone")


def blocks(page: str) -> list[Block]:
    """The page's fenced blocks with what the text right above each says about it."""
    text = (ROOT / page).read_text(encoding="utf-8")
    found, previous_end = [], 0
    for match in FENCE.finditer(text):
        above = text[previous_end : match.start()].rstrip("\n")
        last_line = above.rsplit("\n", 1)[-1]
        directive = DIRECTIVE.search(last_line)
        save_as = SAVE_AS.search(above)
        found.append(
            Block(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                lang=match["lang"],
                code=match["code"],
                directive=(directive["what"], directive["arg"]) if directive else None,
                save_as=save_as["name"] if save_as else None,
            )
        )
        previous_end = match.end()
    return found


def shortened(code: str, overrides: str) -> str:
    """``code`` with ``overrides`` added to each command that SHORTENED matches (continuation lines
    joined first, so they go at the end of the whole command)."""
    lines = code.replace("\\\n", " ").splitlines()
    out = []
    for line in lines:
        match = SHORTENED.match(line)
        out.append(f"{match['cmd']} {overrides}{match['comment'] or ''}" if match else line)
    assert any(SHORTENED.match(line) for line in lines), "a `with` directive above a block it cannot shorten"
    return "\n".join(out) + "\n"


def block_code(block: Block) -> str:
    """The code a runner executes: shortened where the block's directive says so."""
    if block.directive and block.directive[0] == "with":
        assert block.lang == "bash", f"{block}: only bash blocks take a `with` directive"
        return shortened(block.code, block.directive[1])
    return block.code


def fedpcd_commands(code: str) -> list[list[str]]:
    """The ``fedpcd`` command lines of a bash block as argument lists (without the program name):
    continuation lines joined, comments dropped, each stage of a pipeline or ``&&`` chain on its own."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        if not COMMAND.search(line):  # e.g. a python -c string over several lines, which shlex cannot split
            continue
        words = shlex.split(line, comments=True)
        stage: list[str] = []
        for word in [*words, "|"]:
            if word in ("|", "&&", "||", ";"):
                if stage[:1] == ["fedpcd"]:
                    commands.append(stage[1:])
                stage = []
            else:
                stage.append(word)
    return commands

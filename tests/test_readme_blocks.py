"""Every ```bash and ```python block of README.md and docs/getting-started.md runs as written, in order, on
a fresh copy of the repository (the working tree's files that git tracks or would track, so uncommitted
edits count) with this environment's bin/ first on PATH, as a reader following the page would run them.

A page may say how the test shortens a block, in a comment right above it that a reader of the page's
source sees:

- ``<!-- doc-test: with KEY=VALUE ... -->``: these overrides are added to each ``fedpcd run --config``,
  ``fedpcd sweep --config`` and ``fedpcd demo`` command of the block (fewer rounds, less data: the
  commands stay the same, the runs get short);
- ``<!-- doc-test: skip: REASON -->``: the block is not run (the set-up block: it installs the project,
  which ``make check-release`` tests, and ``make test`` would run this suite inside itself).

A ```yaml block under a sentence ending in "Save this as `NAME`:" is written to NAME, as the reader does.
The pages' runs take minutes even shortened, so the test that runs them is marked `release` (`make
check-release`, which CI runs after `make test`); the parsing tests run in the default suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import requires_fmnist

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
DIRECTIVE = re.compile(r"<!-- doc-test: (?P<what>skip|with)(?::)? (?P<arg>.*?) -->\s*$")
SAVE_AS = re.compile(r"Save this as `(?P<name>[^`]+)`:\s*$")
# the commands a `with` directive shortens: up to the end of the command, before a trailing comment
SHORTENED = re.compile(r"^(?P<cmd>fedpcd (?:run --config|sweep --config|demo)\b.*?)(?P<comment>\s+#.*)?$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    directive: tuple[str, str] | None  # ("skip", reason) or ("with", overrides)
    save_as: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


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


def fresh_copy(dest: Path) -> Path:
    """The files of the working tree that git tracks or would track (not ignored), copied into ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_symlink():  # configs -> src/fedpcd/configs: the link, as git stores it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).symlink_to(os.readlink(source))
            continue
        if source.is_file():  # a tracked file deleted in the tree is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def environment() -> dict[str, str]:
    """This environment's bin/ first on PATH, as `source .venv/bin/activate` sets it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["MPLBACKEND"] = "Agg"
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    if block.lang == "bash":
        code = block.code
        if block.directive and block.directive[0] == "with":
            code = shortened(code, block.directive[1])
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        assert not block.directive, f"{block}: only bash blocks take a `with` directive"
        cmd = [sys.executable, "-c", block.code]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    output = f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{block} failed:\n{cmd[-1]}\n--- output ---\n{output}"


def test_the_pages_blocks_are_found_with_their_directives():
    """What the runner sees (a renamed fence or a mistyped directive would silently run less)."""
    readme = blocks("README.md")
    assert [b.lang for b in readme if b.lang in ("bash", "python")] == ["bash", "bash", "python"]
    assert readme[0].directive is not None and readme[0].directive[0] == "skip"
    assert readme[1].directive is not None and readme[1].directive[0] == "with"
    guide = blocks("docs/getting-started.md")
    assert guide[0].directive is not None and guide[0].directive[0] == "skip"
    yaml_blocks = [b for b in guide if b.lang == "yaml"]
    assert [b.save_as for b in yaml_blocks] == ["my-sweep.yaml"]
    assert all(b.lang in ("bash", "python", "yaml", "") for page in PAGES for b in blocks(page))


def test_a_with_directive_adds_its_overrides_at_the_end_of_each_command():
    code = (
        "fedpcd --version\n"
        "fedpcd run --config a.yaml rounds=50 \\\n           output_dir=runs/x   # a comment\n"
        "fedpcd sweep --config s.yaml --jobs 2\n"
        "fedpcd report runs/x --out r\n"
    )
    assert shortened(code, "rounds=1") == (
        "fedpcd --version\n"
        "fedpcd run --config a.yaml rounds=50             output_dir=runs/x rounds=1   # a comment\n"
        "fedpcd sweep --config s.yaml --jobs 2 rounds=1\n"
        "fedpcd report runs/x --out r\n"
    )


@pytest.mark.slow
@pytest.mark.release  # minutes each (the README's ~16 on a loaded 2-core machine): `make check-release`
@requires_fmnist
@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_the_page_runs_as_written_in_order(page, tmp_path):
    copy = fresh_copy(tmp_path / "clone")
    env = environment()
    ran = 0
    for block in blocks(page):
        if block.lang == "yaml" and block.save_as:
            (copy / block.save_as).write_text(block.code, encoding="utf-8")
        elif block.lang in ("bash", "python") and not (block.directive and block.directive[0] == "skip"):
            run_block(block, copy, env)
            ran += 1
    assert ran >= 2

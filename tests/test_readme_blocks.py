"""The documentation pages' commands (tests/doc_blocks.py says how the pages' blocks are read and where each
runs): the blocks marked `clone` run as written, in order, in a fresh copy of the repository (the working
tree's files that git tracks or would track, so uncommitted edits count) with this environment's bin/ first
on PATH; the other blocks of the runner pages run from the wheel in a fresh folder (tests/test_packaging.py).
Running them takes minutes, so those tests are marked `release` (`make check-release`, which CI runs after
`make test`); the parsing tests and the check of every page's `fedpcd` commands run in the default suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import PAGES, ROOT, block_code, blocks, doc_pages, fedpcd_commands, shortened
from fedpcd.cli_args import INIT_FILE, parse_args
from fedpcd.config_input import config_path
from fedpcd.errors import UserError


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


def test_the_pages_blocks_are_found_with_their_directives():
    """What the runners see (a renamed fence or a mistyped directive would silently run less)."""
    readme = blocks("README.md")
    assert [(b.lang, b.runs, b.in_clone) for b in readme if b.lang in ("bash", "python")] == [
        ("bash", False, False),  # set-up: skipped
        ("bash", False, False),  # the set-up with pip: skipped
        ("bash", True, False),  # the commands: from the wheel, shortened
        ("bash", True, True),  # reports of the archived runs: in a clone
        ("python", True, False),
    ]
    assert readme[2].directive is not None and readme[2].directive[0] == "with"
    guide = blocks("docs/getting-started.md")
    assert guide[0].directive is not None and guide[0].directive[0] == "skip"
    assert [b.save_as for b in guide if b.lang == "yaml"] == ["my-sweep.yaml"]
    assert [b.line for b in guide if b.in_clone] == [b.line for b in guide if "docs/results/runs" in b.code]
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


def test_the_commands_of_a_block_are_split_as_the_shell_splits_them():
    code = (
        "fedpcd list | grep plugin_   # a pipeline\n"
        "fedpcd sweep --config 'my sweep.yaml' \\\n    --jobs 2\n"
        "cd runs && fedpcd report x\n"
        "# fedpcd run in a comment\n"
    )
    assert fedpcd_commands(code) == [
        ["list"],
        ["sweep", "--config", "my sweep.yaml", "--jobs", "2"],
        ["report", "x"],
    ]


def reader_files() -> set[str]:
    """The config files the pages have the reader write: each "Save this as" block's, `fedpcd init`'s."""
    return {INIT_FILE} | {b.save_as for page in doc_pages() for b in blocks(page) if b.save_as}


def test_every_fedpcd_command_of_every_page_parses_and_names_a_config_that_exists(tmp_path, monkeypatch):
    """On any page (the site's, the results pages, the README): the command line is one `fedpcd` accepts,
    and its --config is a shipped config's name or a file the pages have the reader write, so it runs
    after `pip install` in any folder (an empty one here), not only in a clone."""
    monkeypatch.chdir(tmp_path)
    written = reader_files()
    seen = set()
    for page in doc_pages():
        for block in blocks(page):
            if block.lang != "bash":
                continue
            for argv in fedpcd_commands(block.code):
                where = f"{block}: fedpcd {' '.join(argv)}"
                try:
                    args = parse_args(argv)
                except SystemExit as exc:  # --version and --help exit 0 once parsed
                    assert exc.code == 0, f"{where}: the command line does not parse (exit {exc.code})"
                    continue
                config = getattr(args, "config", None)
                if config and config not in written:
                    try:
                        config_path(config)
                    except UserError as exc:
                        pytest.fail(f"{where}: {exc}")
                seen.add(page)
    # the pages whose commands a reader types (a renamed fence would silently check less)
    assert {"README.md", "docs/getting-started.md", "docs/cluster.md", "docs/flower.md", "docs/plugins.md",
            "docs/results/fednh.md", "docs/results/fedgela.md"} <= seen  # fmt: skip


@pytest.mark.slow
@pytest.mark.release  # the archived runs' reports: a minute or two
@pytest.mark.parametrize("page", [p for p in PAGES if any(b.in_clone for b in blocks(p))])
def test_the_blocks_that_need_the_repository_run_in_a_fresh_copy(page, tmp_path):
    copy = fresh_copy(tmp_path / "clone")
    env = environment()
    ran = 0
    for block in blocks(page):
        if block.in_clone:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", block_code(block)]
            if block.lang == "python":
                cmd = [sys.executable, "-c", block_code(block)]
            done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
            output = f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
            assert done.returncode == 0, f"{block} failed:\n{cmd[-1]}\n--- output ---\n{output}"
            ran += 1
    assert ran >= 1

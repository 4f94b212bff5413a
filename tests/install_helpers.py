"""What the clean-install tests share (test_fresh_install.py, test_packaging.py): the system Python, an
environment that holds nothing of the checkout or of the Python running the tests, and the torch pin."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = Path("/usr/bin/python3")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# a hang guard for the commands that install from the network, not a speed limit: CI gives `make test` and
# `make check-release` 90 minutes together, and a CUDA torch alone took ~14 minutes on a loaded machine
INSTALL_TIMEOUT = 3600

needs_system_python = pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3")
needs_git_checkout = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a git checkout"
)


def clean_env(*bin_dirs: Path) -> dict[str, str]:
    """``os.environ`` without a virtual environment or Python path; PATH is ``bin_dirs`` then the system's
    (no other Python ahead of the system one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = ":".join([*map(str, bin_dirs), SYSTEM_PATH])
    return env


def torch_requirement() -> str:
    """The torch pin that `make install` installs before the project (one place: the Makefile)."""
    found = re.search(r"^TORCH \?= (torch==\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile's TORCH variable pins torch"
    return found[1]

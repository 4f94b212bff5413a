"""The README's set-up works from a clean clone with only the system Python: `make install` creates the
project's .venv with it (an externally-managed interpreter such as Debian's is never touched) and every
later command uses that environment."""

from __future__ import annotations

import subprocess

import pytest

from install_helpers import (
    INSTALL_TIMEOUT,
    ROOT,
    SYSTEM_PYTHON,
    clean_env,
    needs_git_checkout,
    needs_system_python,
)


@pytest.mark.slow
@pytest.mark.release
@needs_system_python
@needs_git_checkout
def test_make_install_from_a_clean_clone_with_the_system_python(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = clean_env()
    done = subprocess.run(
        ["make", "install", f"SYSTEM_PYTHON={SYSTEM_PYTHON}"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "externally-managed-environment" not in done.stderr
    venv_python = clone / ".venv" / "bin" / "python"
    base = subprocess.run(
        [str(venv_python), "-c", "import sys, fedpcd; print(sys.base_prefix, fedpcd.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert base[0] == "/usr" and base[1].startswith(str(clone / "src"))  # the clone, installed editable
    version = subprocess.run(
        [str(clone / ".venv" / "bin" / "fedpcd"), "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.startswith("fedpcd ")

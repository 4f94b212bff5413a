"""`make torch` (part of `make install`) tries PyTorch's CPU wheel index first and, where that index does not
answer within TORCH_INDEX_TIMEOUT seconds, installs torch from the default index, saying so in one line and
then, in one line, what is installed and how big it is. Run against this suite's own environment, which
already holds the pinned torch: pip finds it satisfied, so nothing is downloaded or changed."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from install_helpers import ROOT, torch_requirement

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@pytest.fixture
def silent_index() -> Iterator[str]:
    """An address that accepts connections and never answers (a black-holed index)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield f"http://127.0.0.1:{server.getsockname()[1]}/whl/cpu"


def make_torch(index: str) -> subprocess.CompletedProcess[str]:
    env_root = sys.prefix  # the environment running the suite: its torch satisfies the pin
    return subprocess.run(
        ["make", "-s", "--no-print-directory", "torch", f"VIRTUAL_ENV={env_root}"]
        + [f"TORCH_CPU_INDEX={index}", "TORCH_INDEX_TIMEOUT=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: the timeout under test is the Makefile's 1 s
    )


@needs_make
@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_an_unreachable_cpu_index_falls_back_to_the_default_index_in_one_line(kind, silent_index):
    index = "http://127.0.0.1:9/whl/cpu" if kind == "refused" else silent_index
    done = make_torch(index)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    pin = torch_requirement()
    # a refused connection is said to fail at once with its reason, never to be a timeout
    what = r"failed at once \(.*[Rr]efused\)" if kind == "refused" else "did not answer within 1 s"
    said = rf"torch: {re.escape(index)} {what}: {re.escape(pin)} from the default index"
    assert any(re.fullmatch(said, line) for line in lines), done.stdout
    installed = [line for line in lines if line.startswith("torch: ") and " from the default index:" in line]
    assert len(installed) == 1, done.stdout
    version = pin.split("==")[1]
    found = re.fullmatch(
        rf"torch: {re.escape(version)}(\+\w+)? from the default index: (\d+) MB in site-packages/torch, "
        r"(\d+) MB of CUDA libraries \(nvidia\*, triton\)",
        installed[0],
    )
    assert found and int(found[2]) > 0, installed[0]
    assert "--index-url" not in done.stdout + done.stderr  # pip was never pointed at the dead index


def test_the_torch_step_shows_pips_progress():
    recipe = (ROOT / "Makefile").read_text()
    assert "PIP_INSTALL ?= $(PY) -m pip install --disable-pip-version-check\n" in recipe
    assert " -q" not in recipe.split("torch: $(PY)", 1)[1].split("\ninstall:", 1)[0]

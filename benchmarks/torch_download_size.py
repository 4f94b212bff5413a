"""What installing torch downloads, as pip resolves it, without downloading the wheels.

For each index (the PyTorch CPU wheel index, then the default index, PyPI) pip resolves `torch==<pin>` with
`pip install --dry-run --ignore-installed --report` under a clean configuration (no pip.conf, no PIP_*
variables, so no machine-local wheel folder takes part); the size of every wheel it picked comes from an
HTTP HEAD request on the wheel's URL. Prints one line per package and the total in MB (10^6 bytes); an
index that cannot be reached is reported as such.

    python benchmarks/torch_download_size.py [--torch torch==2.13.0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEXES = {"PyTorch CPU index": "https://download.pytorch.org/whl/cpu", "default index (PyPI)": None}


def makefile_pin() -> str:
    """The torch requirement `make install` installs (the Makefile's TORCH variable)."""
    found = re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return found[1] if found else "torch"


def resolve(requirement: str, index: str | None) -> list[tuple[str, str]]:
    """(name==version, wheel URL) of every package pip would install for ``requirement``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf anywhere: what a clean machine resolves
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        cmd += ["--disable-pip-version-check", "--timeout", "15", "--report", str(report), requirement]
        if index:
            cmd += ["--index-url", index]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError((done.stderr.strip().splitlines() or ["pip failed"])[-1])
        items = json.loads(report.read_text())["install"]
    return [
        (f"{i['metadata']['name']}=={i['metadata']['version']}", i["download_info"]["url"]) for i in items
    ]


def size(url: str) -> int:
    """The wheel's size in bytes (Content-Length of a HEAD request)."""
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=30) as reply:
        return int(reply.headers["Content-Length"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default=makefile_pin(), help="the requirement (default: the Makefile's)")
    args = parser.parse_args()
    for label, index in INDEXES.items():
        try:
            packages = resolve(args.torch, index)
        except (RuntimeError, OSError) as exc:
            print(f"{label}: not reachable from here ({exc})")
            continue
        sizes = sorted(((size(url), name) for name, url in packages), reverse=True)
        total = sum(nbytes for nbytes, _ in sizes) / 1e6
        print(f"{label}: {args.torch} resolves to {len(sizes)} wheels, {total:.0f} MB")
        for nbytes, name in sizes:
            print(f"  {nbytes / 1e6:9.1f} MB  {name}")


if __name__ == "__main__":
    main()

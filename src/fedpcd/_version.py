"""fedpcd's version, read once from the installed package's metadata (declared in pyproject.toml)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedpcd")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

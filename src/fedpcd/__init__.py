"""fedpcd: federated learning under label skew and partially class-disjoint data."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedpcd")  # defined once, in pyproject.toml
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

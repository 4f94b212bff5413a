"""Offline, loopback-only settings for Flower and Ray, and the temporary directories a run uses.

Imported by ``fedpcd.flower`` before anything from Flower or Ray, because both read some switches once,
at import time. Every default here can be overridden by setting the variable before importing fedpcd.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedpcd.errors import UserError

FLWR_PIN = "flwr[simulation]==1.41.0"
LOOPBACK = "127.0.0.1"

# No telemetry, no update checks, no runtime `uv sync` of app dependencies, no Ray usage stats; Ray binds
# every server to 127.0.0.1 (on Linux it otherwise picks the machine's address and listens on all
# interfaces: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray treat the machine as a single local node).
OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "RAY_DEDUP_LOGS": "0",
    # Ray's C++ failure-signal handler turns SIGTERM into an abort that skips every cleanup (Ray's agents
    # and actors stay behind); without it SIGTERM reaches Python and run_flower shuts Ray down
    "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1",
}


def set_offline_defaults() -> None:
    """Set the offline switches (unless the user set them) and apply them to already-imported modules."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    telemetry = sys.modules.get("flwr.supercore.telemetry")
    if telemetry is not None:  # Flower was imported before fedpcd.flower: it read the switch already
        telemetry.FLWR_TELEMETRY_ENABLED = os.environ["FLWR_TELEMETRY_ENABLED"]
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        constants.ENABLE_RAY_CLUSTER = False


def require_flwr() -> None:
    """A one-line UserError when Flower (with its Ray simulation extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec("flwr") is None:
        raise UserError(f"backend 'flower' needs Flower: pip install '{FLWR_PIN}'")


def require_ray() -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UserError(f"Flower's simulation engine needs Ray: pip install '{FLWR_PIN}'")


@contextmanager
def temporary_env(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the block; restore them afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    saved["PYTHONPATH"] = os.environ.get("PYTHONPATH")  # Flower's Ray backend rewrites it in place
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def flower_home(keep: bool = False) -> Iterator[Path]:
    """A temporary directory holding FLWR_HOME (``home``) and RAY_TMPDIR (``ray``); removed afterwards.

    The path is kept short on purpose: Ray puts Unix sockets under RAY_TMPDIR (107-byte limit).
    """
    base = Path(tempfile.mkdtemp(prefix="fedpcd-flwr-", dir="/tmp" if os.path.isdir("/tmp") else None))
    (base / "home").mkdir()
    (base / "ray").mkdir()
    try:
        with temporary_env(FLWR_HOME=str(base / "home"), RAY_TMPDIR=str(base / "ray"), RAY_ADDRESS=None):
            yield base
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


@contextmanager
def quiet_flower(verbose: bool = False) -> Iterator[None]:
    """Flower's console logging at ERROR for the block (unchanged when ``verbose``)."""
    import flwr  # noqa: F401  (installs Flower's console handler, which is what gets quieted)

    logger = logging.getLogger("flwr")
    saved = [(h, h.level) for h in logger.handlers]
    try:
        if not verbose:
            for handler, _ in saved:
                handler.setLevel(logging.ERROR)
        yield
    finally:
        for handler, level in saved:
            handler.setLevel(level)

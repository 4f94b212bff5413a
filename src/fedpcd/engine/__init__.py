"""The engine: federation setup, the round loop, evaluation, runs and their directories, and the local
backend. It imports no other backend and no tracker (``fedpcd.backends`` chooses the backend and passes the
round loop its observers)."""

from __future__ import annotations

from fedpcd.engine.local import run_local
from fedpcd.engine.run import Run, load_finished

__all__ = ["Run", "load_finished", "run_local"]

"""Flower adapters: any registered algorithm as a Flower ServerApp (the engine's round loop, clients reached
through Flower's Grid) and ClientApp (its client hooks, client state in ``context.state``), plus the ways
to run them.

- :func:`run_flower`: ``backend: flower``, the run through Flower's simulation engine in this process;
- ``fedpcd.flower.server_app:app`` / ``fedpcd.flower.client_app:app``: the components ``flwr run`` loads
  (see ``flower-app/`` and ``docs/flower.md``);
- :mod:`fedpcd.flower.deploy`: a SuperLink, SuperNodes and long-lived ClientApp workers on 127.0.0.1;
- :mod:`fedpcd.flower.codec`: the codec between the engine's dicts and Flower records.

Importing this package switches Flower's telemetry and update check, Ray's usage stats and runtime
dependency installation off (unless those variables are already set): nothing leaves the machine.
"""

from __future__ import annotations

from typing import Any

from fedpcd.flower import _env

_env.set_offline_defaults()

__all__ = ["run_flower"]


def __getattr__(name: str) -> Any:
    """``run_flower`` (:func:`fedpcd.flower.simulation.run_flower`), imported on first use: importing this
    package stays light (Flower and Ray load only when a run starts)."""
    if name != "run_flower":
        raise AttributeError(f"module 'fedpcd.flower' has no attribute {name!r}")
    from fedpcd.flower.simulation import run_flower

    return run_flower

"""Federated algorithms, one module each, registered by name in ``ALGORITHMS``.

Every module in this package is imported here, so a new algorithm file registers itself.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pydantic import TypeAdapter, ValidationError

from fedpcd.algorithms.base import ALGORITHMS, ClientData, Context, LocalTraining
from fedpcd.algorithms.fedavg import FedAvg, LocalWork
from fedpcd.errors import UserError
from fedpcd.params import check_params, dataclass_defaults

__all__ = ["ALGORITHMS", "ClientData", "Context", "FedAvg", "LocalTraining", "LocalWork", "build_algorithm"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_algorithm(name: str, params: dict[str, Any] | None = None) -> FedAvg:
    """Instantiate a registered algorithm with checked, typed hyperparameters (its dataclass fields)."""
    cls = ALGORITHMS.get(name)
    values = check_params("algorithm", name, dict(params or {}), dataclass_defaults(cls))
    try:
        return TypeAdapter(cls).validate_python(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise UserError(f"bad value for algorithm.{key} of {name!r}: {err['msg']}") from None

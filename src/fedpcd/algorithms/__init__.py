"""Federated algorithms, one module each, registered by name in ``ALGORITHMS``.

The contract every algorithm implements is ``contract.Algorithm`` (its defaults are FedAvg's); ``context``
holds what the hooks see, ``statedict`` and ``common`` the helpers they share, ``vectorizable`` the
capability the vectorized executor needs, ``readout`` the predictors made of a model plus tensors.

Every module in this package is imported here, so a new algorithm file registers itself. An algorithm's
hyperparameters are its dataclass fields, typed and bounded by their annotations (``fedpcd.params``).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from fedpcd.algorithms.context import ClientData, Context, Upload
from fedpcd.algorithms.contract import ALGORITHMS, Algorithm, LocalWork
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.params import LocalTraining, validate_params

__all__ = [
    "declared_uploads",
    "mean_aggregating",
    "ALGORITHMS",
    "Algorithm",
    "ClientData",
    "Context",
    "FedAvg",
    "LocalTraining",
    "LocalWork",
    "build_algorithm",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def declared_uploads(cls: type) -> tuple[Upload, ...] | None:
    """The ``uploads`` declaration that accompanies the ``aggregate`` algorithm class ``cls`` runs: None where
    the class that defines that ``aggregate`` (other than the contract's, FedAvg's) does not itself declare
    ``uploads``, so what its server averages is unknown."""
    owner = next(k for k in cls.__mro__ if "aggregate" in vars(k))
    if owner is Algorithm or "uploads" in vars(owner):
        return cls.uploads
    return None


def mean_aggregating(model: bool = False) -> list[str]:
    """The registered algorithms whose server's averaged quantities are declared (:func:`declared_uploads`),
    which ``aggregation.robust`` applies to; ``model``: only those whose server averages a model
    (``averages_model``), which ``server.optimizer`` and Krum apply to. Names starting with ``_`` are left
    out."""
    return [
        n
        for n in ALGORITHMS.names()
        if not n.startswith("_")
        and declared_uploads(ALGORITHMS.get(n)) is not None
        and (ALGORITHMS.get(n).averages_model or not model)
    ]


def build_algorithm(name: str, params: dict[str, Any] | None = None) -> Algorithm:
    """Instantiate a registered algorithm with checked, typed hyperparameters (its dataclass fields)."""
    cls = ALGORITHMS.get(name)
    return cls(**validate_params("algorithm", name, cls, params))

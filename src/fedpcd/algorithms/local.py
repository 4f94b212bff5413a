"""Local: standalone training, no federation (the "Local" baseline of FedNH, Dai et al., AAAI 2023, App. A.2).

Every client trains its own model, from its architecture's seeded initial model (built on the client), for
``local.epochs`` epochs each time it is sampled: its compute matches its participation under FedAvg, the
protocol of the FedNH paper [P] (its code [C] instead trains every client for floor(gamma R) rounds, the
same in expectation). Nothing is communicated: payloads and replies carry no tensors; there is no global
model (GA is None). PM = the client's latest model. Clients may have different architectures (FedSSA's
"Standalone" baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from fedpcd.algorithms.contract import ALGORITHMS, Predictor
from fedpcd.algorithms.fedavg import FedAvg


@ALGORITHMS.register("local")
@dataclass
class Local(FedAvg):
    """Local: the whole model is private; the server does nothing."""

    heterogeneous: ClassVar[bool] = True

    def private_keys(self, model: nn.Module) -> list[str]:
        return list(model.state_dict())

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """No global model."""
        return None

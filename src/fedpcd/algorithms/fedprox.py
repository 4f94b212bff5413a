"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Each client minimises h_k(w; w^t) = F_k(w) + (mu/2) ||w - w^t||^2 (Eq. 2), the proximal term pulling the local
model towards the round's global model w^t; the server averages as FedAvg. ``mu = 0`` is FedAvg exactly.

This module also holds the small state-dict helpers the other generic baselines (SCAFFOLD, FedNova, FedDyn,
FedDC) share: parameter names, squared distances, local step counts and aggregation weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.contract import ALGORITHMS, LocalWork
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import sq_distance

# ----- the algorithm ---------------------------------------------------------------------------------------


@ALGORITHMS.register("fedprox")
@dataclass
class FedProx(FedAvg):
    """FedProx: FedAvg whose local objective adds (mu/2)||w - w^t||^2 (Eq. 2); buffers are not penalised."""

    # Proximal weight mu of Eq. (2). 1e-2: FedMR Table 9's tuned value for FMNIST, CIFAR10 and CIFAR100
    # (Fan et al., TMLR 2023; SVHN 1e-3, Table 10's larger-scale CIFAR 1e-4). The paper tunes mu in
    # {0.001, ..., 1}.
    mu: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.01

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """Eq. (2): cross-entropy + (mu/2) ||w - w^t||^2 over the parameters (w^t = the payload model)."""
        ce = super().loss(model, batch, work)
        if self.mu == 0.0:
            return ce
        return ce + self.mu / 2 * sq_distance(model, work.payload["model"])

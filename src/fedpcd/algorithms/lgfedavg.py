"""LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", arXiv:2001.01523, 2020, Alg. 1).

The mirror image of FedPer: each client keeps its own body (local representation) and only the top layer,
the linear head, is global, sent and averaged. The whole model is trained jointly on the client.

Library choices: the private body starts from the client's seeded initial model (the paper's code can also
start from a FedAvg-pretrained model, not offered here); GA is None since there is no global body to pair
the averaged head with (personal metrics only). Clients may have different bodies (FedSSA's model-
heterogeneous baseline): only the head, of the same shape for all, is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from fedpcd.algorithms.contract import ALGORITHMS, Predictor
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.models import backbone_keys


@ALGORITHMS.register("lgfedavg")
@dataclass
class LGFedAvg(FedAvg):
    """LG-FedAvg: private body, shared (averaged) head; joint local training."""

    heterogeneous: ClassVar[bool] = True

    def private_keys(self, model: nn.Module) -> list[str]:
        """Everything but the head (parameters and buffers of the body)."""
        return backbone_keys(model)

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """No global model (bodies are local)."""
        return None

"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019).

Body and head are trained jointly on the client; only the body ("base layers") is sent and averaged, the
last linear layer ("personalization layer") never leaves the client (Sec. 3, Alg. 1). A baseline of the
FedNH paper (Dai et al., AAAI 2023, App. A.2: the last linear layer private, the rest shared).

The private head is FedAvg's ``private_keys`` (the contract's split of the model into a shared and a
private part, the client state); FedRep and FedBABU subclass FedPer and only change the training.

Protocol details (the library's; docs/design.md section 9):

- The personal part is the client state, a dict ``{state-dict key: tensor}``. A client that has none yet
  starts from its own model's seeded initial private part (the engine hands a client without state its
  architecture's initial weights), so nothing private is ever sent and the byte counters show the real
  traffic; clients may have different architectures where only the shared part must agree (LG-FedAvg, Local).
- Replies carry only the shared part; FedAvg's ``aggregate`` averages it by n_k.
- GM (FedNH Sec. 4.1): the averaged shared part with the *initial* private part, i.e. the initial
  head for methods that never upload one (FedPer, FedRep, FedBABU).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedpcd.algorithms.contract import ALGORITHMS
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.models import head_keys


@ALGORITHMS.register("fedper")
@dataclass
class FedPer(FedAvg):
    """FedPer: joint local training, the body is averaged, the last linear layer stays private."""

    def private_keys(self, model: nn.Module) -> list[str]:
        """The linear head."""
        return head_keys(model)

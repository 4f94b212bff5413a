"""FedBN (Li, Jiang, Zhang, Kamp & Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021), Algorithm 1.

Each client keeps its BatchNorm layers local: their weights and biases and their running statistics (mean,
variance, batch counter) never leave the client; the server averages every other tensor as FedAvg does
(Alg. 1: the BN parameters are skipped in the aggregation). The BN layers are FedAvg's ``private_keys``,
so they are the client state, initialised on the client from its architecture's seeded initial model.

Library choices (paper [P], official code [C] = med-air/FedBN):

- The BN tensors are found by module type (every ``BatchNorm`` layer's state-dict keys, shortcut BNs of a
  ResNet included); [C] skips the keys whose name contains ``"bn"``, which for its models is the same set.
- Aggregation weights n_k (FedAvg's); [C] weights clients uniformly, the same in its experiments, whose
  clients hold equally many samples.
- Personal model (PA): the received global non-BN tensors with the client's own BN after this round's
  training. [C] evaluates each client after the aggregation, i.e. with the next round's global tensors.
- Generic model (GA): the averaged non-BN tensors with the *initial* BN (the library's convention for
  private parts, FedNH Sec. 4.1); [P] has no global model.

A model without BatchNorm layers is refused in one line naming the models that have them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.errors import UserError
from fedpcd.models import batchnorm_keys

# The registered models with BatchNorm layers (with their default parameters, except where noted).
BN_MODELS = ("simplecnn_bn", "mlp_bn", "resnet10", "resnet18", "wrn", "efficientnet_b0")


@ALGORITHMS.register("fedbn")
@dataclass
class FedBN(FedAvg):
    """FedBN: FedAvg whose BatchNorm layers (parameters and statistics) stay on each client (Alg. 1)."""

    def private_keys(self, model: nn.Module) -> list[str]:
        """Every BatchNorm layer's tensors; a model without any is refused."""
        keys = batchnorm_keys(model)
        if not keys:
            raise UserError(
                f"algorithm 'fedbn' keeps each client's BatchNorm layers local, but the model "
                f"({type(model).__name__}) has none; set model.name to one of: {', '.join(BN_MODELS)} "
                "(resnet: norm=batch)"
            )
        return keys

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The received global non-BN tensors with this client's BN (its new state)."""
        model.load_state_dict({**work.received["model"], **work.state})
        return model

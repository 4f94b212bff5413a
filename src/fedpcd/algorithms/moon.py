"""MOON (Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021), Sec. 3.3, Eq. (3)-(4).

Local objective, per sample x with representation z = R_w(x) of the model being trained:

    l_con = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}) )    (3)
    l     = CE(f_w(x), y) + mu * l_con                                                           (4)

with sim the cosine similarity, z_glob the representation of x under the received global model w^t and
z_prev the one under this client's previous local model w_k^{t-1}. Both are frozen: they are evaluated
functionally (``torch.func.functional_call`` on the shared model object, eval mode, no gradient), never
deep-copied. The server side is FedAvg's.

Choices (each documented where it matters):

- Representation: the model's ``features(x)`` (the input of the linear head). The paper adds a 2-layer MLP
  projection head and takes its output; here no projection is added, so the contrastive term acts on the
  same representation every other method in the library uses and the model (and bytes sent) stay FedAvg's.
- Frozen models in eval mode (BatchNorm uses running statistics, nothing is updated), as the official code
  puts the global and previous models in ``eval()`` with ``requires_grad=False``.
- The previous local model is the client's own model after its last local update (model buffer size 1, the
  official code's default), stored in the client state as the full state dict (backbone and head).
- Round without a previous model (a client's first participation): the official code's negative pool is
  empty, its contrastive logits hold only the positive pair and the term is exactly 0 -- the loss is CE
  alone. Same here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import frozen_forward
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Reply
from fedpcd.algorithms.fedavg import FedAvg


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """Eq. (3), averaged over the batch: CE with the positive pair (z, z_glob) at index 0."""
    pos = F.cosine_similarity(z, z_glob, dim=1)
    neg = F.cosine_similarity(z, z_prev, dim=1)
    logits = torch.stack([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


@ALGORITHMS.register("moon")
@dataclass
class MOON(FedAvg):
    """MOON: FedAvg whose local loss adds mu * l_con (Eq. 4) against the global and previous local models."""

    # mu of Eq. (4). Default 1e-4: FedMR Table 9 (CIFAR-10 P10C3, the split FedMR's Table 10 repeats); the
    # tuned value depends on dataset and split (1e-4 .. 1 in FedMR's Table 9). mu = 0 is FedAvg.
    mu: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0e-4
    # tau of Eq. (3): 0.5, the official code's default (--temperature 0.5) and FedMR's setting.
    tau: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.5

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply; the new local model becomes the client state (w_k^{t-1} of next time)."""
        reply, _ = super().end_local(model, data, work, loss)
        return reply, {"prev": reply["model"]}

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """Eq. (4): CE + mu * l_con; l_con = 0 without a previous local model (first participation)."""
        x, y = batch
        z = model.features(x)
        ce = F.cross_entropy(model.head(z), y)
        if self.mu == 0.0 or not work.state or "prev" not in work.state:
            return ce
        z_glob, _ = frozen_forward(model, work.payload["model"], x)
        z_prev, _ = frozen_forward(model, work.state["prev"], x)
        return ce + self.mu * model_contrastive_loss(z, z_glob, z_prev, self.tau)

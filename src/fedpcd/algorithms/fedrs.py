"""FedRS (Li & Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data",
KDD 2021): the restricted softmax.

During local training on client k the logit of class c is o_c = alpha_c * w_c^T h + b_c with
alpha_c = 1 if client k holds class c and alpha_c = alpha (0 <= alpha <= 1) otherwise, so

    p(y = c | x) = exp(alpha_c w_c^T h + b_c) / sum_j exp(alpha_j w_j^T h + b_j)

and the loss is the cross-entropy of these restricted logits. The classifier vectors w_c of locally missing
classes receive gradients scaled by alpha, which limits how far they drift towards the local features.
Evaluation (global and personal) uses the plain logits; the server is FedAvg's.

- The paper writes the logit as w_c^T h (no bias); the library's head has a bias, which is left unscaled
  (alpha scales the class's weight row only). alpha = 1 is exactly FedAvg (the scaled weight equals the
  head's weight bit for bit); alpha = 0 removes the missing classes' weight rows from the local softmax.
- "Holds class c" = at least one training sample of class c (``ClientData.label_counts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork
from fedpcd.algorithms.fedavg import FedAvg


def restricted_logits(h: Tensor, weight: Tensor, bias: Tensor | None, scales: Tensor) -> Tensor:
    """o_c = scales_c * w_c^T h + b_c: the head's linear map with row c of its weight scaled by scales_c."""
    return F.linear(h, weight * scales[:, None], bias)


def class_scales(label_counts: Tensor, alpha: float) -> Tensor:
    """alpha_c: 1 for classes the client holds, ``alpha`` for the others (float32, shape [C])."""
    return torch.where(label_counts > 0, 1.0, float(alpha)).to(torch.float32)


@ALGORITHMS.register("fedrs")
@dataclass
class FedRS(FedAvg):
    """FedRS: FedAvg with the restricted softmax (missing classes' logits scaled by alpha) locally."""

    # alpha of the restricted softmax, in [0, 1]; alpha = 1 is FedAvg. Default 0.5: the middle of the
    # range the paper studies (FedGELA, which compares with it, gives no tuned value).
    alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5

    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """This client's alpha_c (``work.class_scales``), then FedAvg's begin."""
        work.class_scales = class_scales(data.label_counts, self.alpha)
        super().begin_local(model, data, work)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """Cross-entropy of the restricted logits."""
        x, y = batch
        head = model.head
        logits = restricted_logits(model.features(x), head.weight, head.bias, work.class_scales)
        return F.cross_entropy(logits, y)

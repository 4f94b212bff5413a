"""FedNTD (Lee et al., "Preservation of the Global Knowledge by Not-True Distillation in Federated Learning",
NeurIPS 2022): not-true distillation (the not-true softmax and L_NTD).

The local loss adds a distillation term from the received global model that only looks at the not-true
classes. With the not-true softmax over c != y,

    q~_tau(c) = exp(z_c / tau) / sum_{c' != y} exp(z_{c'} / tau),

    L = CE(q, y) + beta * L_NTD,   L_NTD = sum_{c != y} q~^g_tau(c) log( q~^g_tau(c) / q~_tau(c) )

(KL from the global model's not-true distribution to the local one), averaged over the batch as the official
code's ``KLDivLoss(reduction="batchmean")``, without a tau^2 factor (neither the paper's loss nor the code
has one). The teacher's logits come from the payload weights through a functional forward (eval mode, no
gradient; ``common.frozen_forward``). The server is FedAvg's. beta = 0 is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import frozen_forward
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork
from fedpcd.algorithms.fedavg import FedAvg


def not_true_logits(logits: Tensor, y: Tensor) -> Tensor:
    """The C-1 logits of the classes other than y, in class order (shape [B, C-1]): column j holds class
    j + (j >= y), a gather of fixed shape (vmap-traceable)."""
    c = logits.shape[-1]
    j = torch.arange(c - 1, device=logits.device)
    return logits.gather(-1, j + (j >= y[..., None]).long())


def ntd_loss(logits: Tensor, teacher_logits: Tensor, y: Tensor, tau: float) -> Tensor:
    """L_NTD averaged over the batch: KL(q~^g_tau || q~_tau) on the not-true classes."""
    log_q = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    log_q_g = F.log_softmax(not_true_logits(teacher_logits, y) / tau, dim=1)
    return (log_q_g.exp() * (log_q_g - log_q)).sum(dim=1).mean()


@ALGORITHMS.register("fedntd")
@dataclass
class FedNTD(FedAvg):
    """FedNTD: FedAvg whose local loss adds beta * L_NTD from the global model."""

    # beta and tau: the official config (config/fedntd.json: tau 1, beta 1), the values of the paper's runs.
    beta: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    tau: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """CE + beta * L_NTD against the received global model."""
        x, y = batch
        logits = model(x)
        ce = F.cross_entropy(logits, y)
        if self.beta == 0.0 or logits.shape[1] < 2:
            return ce
        _, teacher = frozen_forward(model, work.payload["model"], x)
        return ce + self.beta * ntd_loss(logits, teacher, y, self.tau)

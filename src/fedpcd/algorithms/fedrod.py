"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification",
ICLR 2022).

One body, two heads. The generic head (the model's ``head``) and the body are shared and averaged; they are
trained with the balanced-softmax loss (Sec. 4, "BSM"): CE(g(z) + log p_k(y)), p_k the client's training
class prior n_kc / n_k. The personal head is a private linear layer h_p (the paper's ResNet variant) trained
with CE(g(z).detach() + h_p(z.detach())) -- body and generic head fixed for it (FedNH App. A.2) --
and the personal prediction is g(z) + h_p(z). Both losses are summed into one SGD step; since each parameter
gets gradient from exactly one of them, this equals two separate updates.

Library choices: h_p starts at zero on every client (the first personal prediction is the generic one; the
paper does not fix its initialisation), so it needs no download; classes absent from the client get log
prior -inf in BSM (their logits drop out, the exact limit n_c -> 0). The hypernetwork personal head the
paper uses for its CNN is not implemented. GM = averaged body + generic head.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpcd.algorithms.common import balanced_softmax_loss, log_prior
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.readout import Readout
from fedpcd.algorithms.statedict import clone_state


@ALGORITHMS.register("fedrod")
@dataclass
class FedRoD(FedAvg):
    """FedRoD: BSM-trained shared body + generic head, private linear head on top; personal = sum of both."""

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Shared model from the payload, a trainable copy of the personal head h_p from the state (zeros at
        first; ``work.personal_head``) and the log class prior of BSM (``work.log_prior``)."""
        super().begin_local(model, data, work)
        if work.state is None:  # h_p has a bias even where the generic head has none (FedNH's conv2cifar)
            weight = model.head.weight.detach()
            work.state = {"weight": torch.zeros_like(weight), "bias": weight.new_zeros(weight.shape[0])}
        work.personal_head = {k: v.detach().clone().requires_grad_(True) for k, v in work.state.items()}
        work.log_prior = log_prior(data.label_counts)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """The shared model as the reply; the trained personal head as the state."""
        reply = {"model": clone_state(model), "num_samples": data.num_samples, "train_loss": loss}
        return reply, {k: v.detach().clone() for k, v in work.personal_head.items()}

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """BSM on the generic logits + CE of (generic logits, detached) + personal logits of detached z."""
        x, y = batch
        z = model.features(x)
        g = model.head(z)
        generic = balanced_softmax_loss(g, y, work.log_prior)
        h_p = work.personal_head
        personal = F.cross_entropy(g.detach() + F.linear(z.detach(), h_p["weight"], h_p["bias"]), y)
        return generic + personal

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        return [*model.parameters(), work.personal_head["weight"], work.personal_head["bias"]]

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """g(z) + h_p(z) with this round's body, generic head and personal head h_p."""
        return Readout(model, summed_logits, {k: v.detach() for k, v in work.personal_head.items()})


def summed_logits(model: nn.Module, x: Tensor, head: dict[str, Tensor]) -> Tensor:
    """g(z) + h_p(z): the generic head's and the personal head's logits of the features z."""
    z = model.features(x)
    return model.head(z) + F.linear(z, head["weight"], head["bias"])

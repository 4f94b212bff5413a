"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification",
ICLR 2022).

One body, two heads. The generic head (the model's ``head``) and the body are shared and averaged; they are
trained with the balanced-softmax loss (Sec. 4, "BSM"): CE(g(z) + log p_k(y)), p_k the client's training
class prior n_kc / n_k. The personal head is a private linear layer h_p (the paper's ResNet variant) trained
with CE(g(z).detach() + h_p(z.detach())) -- body and generic head fixed for it (specs/fednh.md sec. 5) --
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
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpcd.algorithms.base import ALGORITHMS, ClientData, balanced_softmax_loss, clone_state, log_prior
from fedpcd.algorithms.fedavg import FedAvg, LocalWork, Payload, Predictor, Reply


@ALGORITHMS.register("fedrod")
@dataclass
class FedRoD(FedAvg):
    """FedRoD: BSM-trained shared body + generic head, private linear head on top; personal = sum of both."""

    # ----- client -----
    # Working state of a client step (like FedNH's scale), read by the loss: lives until personal_predictor.
    vector_attrs: ClassVar[tuple[str, ...]] = ("_phead", "_log_prior")

    def begin_local(
        self, model: nn.Module, data: ClientData, payload: Payload, state: Any, rng: torch.Generator
    ) -> LocalWork:
        """Shared model from the payload, a trainable copy of the personal head from the state (zeros at
        first); joint training follows."""
        self.load_payload(model, payload, state)
        if state is None:
            state = {
                "weight": torch.zeros_like(model.head.weight.detach()),
                "bias": torch.zeros_like(model.head.bias.detach()),
            }
        self._phead = {k: v.detach().clone().requires_grad_(True) for k, v in state.items()}
        self._log_prior = log_prior(data.label_counts)
        return LocalWork(payload, state, payload, rng)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """The shared model as the reply; the trained personal head as the state."""
        reply = {"model": clone_state(model), "num_samples": data.num_samples, "train_loss": loss}
        return reply, {k: v.detach().clone() for k, v in self._phead.items()}

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], payload: Payload, state: Any) -> Tensor:
        """BSM on the generic logits + CE of (generic logits, detached) + personal logits of detached z."""
        x, y = batch
        z = model.features(x)
        g = model.head(z)
        generic = balanced_softmax_loss(g, y, self._log_prior)
        personal = F.cross_entropy(
            g.detach() + F.linear(z.detach(), self._phead["weight"], self._phead["bias"]), y
        )
        return generic + personal

    def trainable_parameters(self, model: nn.Module, payload: Payload, state: Any) -> Iterable[nn.Parameter]:
        return [*model.parameters(), self._phead["weight"], self._phead["bias"]]

    def personal_predictor(self, model: nn.Module, payload: Payload, state: Any) -> Predictor:
        """g(z) + h_p(z) with this round's body, generic head and personal head."""
        model.eval()
        extra = self.personal_extra(model, payload, state)
        return lambda x: self.personal_logits(model, x, extra)

    def personal_extra(self, model: nn.Module, payload: Payload, state: Any) -> dict[str, Any]:
        """The personal head h_p."""
        return {k: v.detach() for k, v in self._phead.items()}

    def personal_logits(self, model: nn.Module, x: Tensor, extra: dict[str, Any]) -> Tensor:
        """g(z) + h_p(z)."""
        z = model.features(x)
        return model.head(z) + F.linear(z, extra["weight"], extra["bias"])

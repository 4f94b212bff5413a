"""Ditto (Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021), Eq. (2) and Alg. 1; a baseline of the FedNH paper (Dai et al., AAAI 2023, Sec. 4.1, App. A.2).

The global model w is trained and aggregated exactly as FedAvg: same reply, same aggregate, and the FedAvg
part of a client's round runs first on the client's generator, so Ditto's GM equals FedAvg's bit for bit
under one seed. Each client also keeps a personal model v_k (its whole state dict, the client state, never
sent) and then trains it on Eq. (2),

    h_k(v; w^t) = F_k(v) + (lambda / 2) ||v - w^t||^2,

w^t the global model the client received, for the local epochs at the round's local learning rate (Alg. 1:
v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t))). The personal model is v_k; the proximal term covers
the parameters, not BatchNorm buffers.

Options, each naming its source (the paper [P], its official code [D] = litian96/ditto, the FedNH
benchmark code [C] = Yutong-Dai/FedNH, whose Ditto produced the FedNH paper's numbers):

- ``personal_init``: v_k before the client's first personal step. "initial" (default) = the seeded initial
  model w^0, as [D] and [C] do (every v_k starts as w^0); "global" = the global model received at first
  participation. [P]'s Alg. 1 takes {v_k^0} as an input and leaves it open.
- ``anchor``: the w of the proximal term. "global" = the received w^t ([P] Eq. 2 and Alg. 1, [D]); "local" =
  the client's freshly trained local model w_k^t of the same round, as [C]'s personal optimiser does.
- ``personal_optimizer``: "sgd" = plain SGD, no momentum and no weight decay ([P] Alg. 1, [D], [C]);
  "local" = the shared loop's optimiser settings (``local.momentum``, ``local.weight_decay``).

Not an option: with ``local.grad_clip`` set the whole gradient (proximal term included) is clipped; [C] clips
the cross-entropy gradient and adds lambda (v - w) after clipping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor, Reply, train_loop
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import clone_state, sq_distance


@ALGORITHMS.register("ditto")
@dataclass
class Ditto(FedAvg):
    """Ditto: FedAvg for the global model plus a private personal model trained on Eq. (2)."""

    # lambda of Eq. (2). 0.75: FedNH App. A.2 (the FedNH paper's and code's value); the Ditto
    # paper tunes lambda per dataset. lambda = 0: v_k is trained on its local loss alone.
    lam: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.75
    personal_init: Literal["initial", "global"] = "initial"  # [D] and [C]: v_k^0 = w^0
    anchor: Literal["global", "local"] = "global"  # "global": [P] Eq. 2 and [D]; "local": [C]
    personal_optimizer: Literal["sgd", "local"] = "sgd"  # "sgd": [P] Alg. 1, [D], [C]

    # ----- client -----
    def local_update(self, model: nn.Module, data: ClientData, work: LocalWork) -> tuple[Reply, Any]:
        """FedAvg's local update (the reply), then E epochs on Eq. (2) for v_k, which becomes the state."""
        payload, state = work.received, work.state
        initial = clone_state(model) if state is None and self.personal_init == "initial" else None
        reply, _ = super().local_update(model, data, work)
        if state is not None:
            model.load_state_dict(state)
        else:
            model.load_state_dict(initial if initial is not None else payload["model"])
        anchor = payload["model"] if self.anchor == "global" else reply["model"]
        work.payload = {**payload, "anchor": anchor}
        train_loop(self, model, data, work, plain_sgd=self.personal_optimizer == "sgd")
        work.state = clone_state(model)
        return reply, work.state

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """Cross-entropy for the global model; Eq. (2), CE + (lambda/2)||v - w||^2, for the personal one
        (its payload carries the anchor w)."""
        ce = super().loss(model, batch, work)
        if "anchor" not in work.payload or self.lam == 0.0:
            return ce
        return ce + self.lam / 2 * sq_distance(model, work.payload["anchor"])

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The personal model v_k."""
        model.load_state_dict(work.state)
        return model

"""pFedMe (T. Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020).

The bi-level problem (Eqs. 2-3): the global model w minimises sum_i F_i(w), the Moreau envelope

    F_i(w) = min_theta { f_i(theta) + (lambda / 2) ||theta - w||^2 },

whose minimiser theta_i(w) is client i's personalized model. Alg. 1, on client i each round: w_{i,0} = w^t;
for every local step r, on a fresh batch D_i, theta is solved approximately by K gradient steps at the
personal learning rate on

    h_i(theta; w_{i,r}, D_i) = f_i(theta; D_i) + (lambda / 2) ||theta - w_{i,r}||^2        (Eq. 7)

(theta warm-starts from the previous step's solution, as in the official code), then the local model moves
towards it, w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta) (eta: the round's local learning rate). The
client sends w_{i,R}; the server mixes, w^{t+1} = (1 - beta) w^t + beta * mean_i w_{i,R} (Alg. 1, server
update). The personal model is theta after the last step; the client keeps no state between rounds.

Mapping to the library: the local steps r are the shared loop's batches (R = ceil(n_i / B) E, ``local.epochs``
passes over shuffled batches of ``local.batch_size``; the official code draws R = ``local_epochs`` batches);
the K inner steps are plain SGD with ``local.weight_decay`` (the official optimiser's mu term; no momentum)
and ``local.grad_clip``. The proximal term covers the parameters; BatchNorm statistics are those the K
steps leave in the model (sent with w).

Options, each naming its source ([P] the paper, [O] the official code CharlieDinh/pFedMe):

- ``weighting``: the mean over the clients, "samples" = weighted by n_i ([O]), "uniform" = the plain
  mean over the sampled clients ([P] Alg. 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import Weighting, reply_weights, round_lr
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.sgd import SGD
from fedpcd.algorithms.statedict import clone_state, sq_distance, weighted_average


@ALGORITHMS.register("pfedme")
@dataclass
class PFedMe(FedAvg):
    """pFedMe: personalized models theta_i from Moreau envelopes (Eq. 7), local w pulled towards them."""

    # lambda 15, K 5, personal lr 0.1: [P] Sec. 5 and [O]'s MNIST command; beta: [P] also runs 2
    lam: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="lambda of Eqs. 2-3 and 7 (pull of theta to w)")
    ] = 15.0
    inner_steps: Annotated[int, Field(ge=1, description="K: gradient steps solving Eq. 7 per local step")] = 5
    personal_lr: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="learning rate of the K steps on theta")
    ] = 0.1
    beta: Annotated[
        float,
        Field(gt=0.0, allow_inf_nan=False, description="server mixing: (1-beta) w + beta * mean (1: FedAvg)"),
    ] = 1.0
    weighting: Annotated[
        Weighting, Field(description="the server mean: by n_i (samples; official code) or plain (Alg. 1)")
    ] = "samples"

    # ----- server -----
    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """w <- (1 - beta) w + beta * mean_i w_i over the float tensors (integer buffers: the mean)."""
        mean = weighted_average([r["model"] for r in replies], reply_weights(replies, self.weighting))
        if self.beta != 1.0:
            previous = server["model"]
            mean = {
                k: torch.lerp(previous[k], v, self.beta) if v.is_floating_point() else v
                for k, v in mean.items()
            }
        server["model"] = mean
        return server

    # ----- client -----
    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """Alg. 1 on the client: per batch, K SGD steps on Eq. 7 for theta (the model), then the local w
        moves towards theta; the model ends holding w, theta goes to ``work.personal``. Returns the mean over
        the batches of Eq. 7 at the K-th step."""
        cfg = self.ctx.local
        eta = round_lr(cfg, work.round)
        params = [p for p in model.parameters() if p.is_floating_point()]
        opt = SGD(params, lr=self.personal_lr, weight_decay=cfg.weight_decay)
        work.local = {n: p.detach().clone() for n, p in model.named_parameters() if p.is_floating_point()}
        model.train()
        total, seen = 0.0, 0
        for _ in range(cfg.epochs):
            for batch in data.batches(cfg.batch_size, work.rng):
                for _ in range(self.inner_steps):
                    loss = self.loss(model, batch, work)
                    opt.zero_grad()
                    loss.backward()
                    if cfg.grad_clip is not None:
                        nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    opt.step()
                    work.steps += 1
                with torch.no_grad():
                    for name, theta in model.named_parameters():
                        if name in work.local:
                            w = work.local[name]
                            w.sub_(eta * self.lam * (w - theta))
                total += float(loss.detach()) * len(batch[1])
                seen += len(batch[1])
        work.personal = clone_state(model)
        model.load_state_dict(work.local, strict=False)
        return total / max(seen, 1)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """Eq. 7: f_i(theta; batch) + (lambda / 2) ||theta - w_{i,r}||^2 (theta: the model, w: work.local)."""
        return super().loss(model, batch, work) + self.lam / 2 * sq_distance(model, work.local)

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The personalized model theta_i of the last local step."""
        model.load_state_dict(work.personal)
        return model

"""APFL (Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020),
Algorithm 1 with the adaptive mixing weight.

Each client i keeps a local model v_i and a mixing weight alpha_i (its client state); its personalised model
is the mixture v_bar_i = alpha_i v_i + (1 - alpha_i) w_i of v_i and its copy w_i of the global model. On
every local step, on one batch xi, from the same iterate (Alg. 1):

    w_i   <- w_i - eta grad f_i(w_i; xi)                        (the FedAvg part: w_i is sent and averaged)
    v_i   <- v_i - eta grad_v f_i(v_bar_i; xi)                  (= alpha_i grad f_i(v_bar_i; xi))
    alpha <- P_[0,1](alpha - eta_alpha <v_i - w_i, grad f_i(v_bar_i; xi)>)   (grad_alpha f_i(v_bar_i; xi))

All three gradients come from one backward pass of f_i(w_i) + f_i(alpha v_i + (1 - alpha) sg(w_i)) (sg: no
gradient), so w_i's steps are FedAvg's exactly: APFL's replies and global model equal FedAvg's bit for bit
under one seed. w_i and v_i take the shared loop's optimiser settings (``local.*``: lr schedule, momentum,
weight decay, the gradient-norm clip, each model clipped on its own); alpha takes a plain projected step.

Library choices (paper [P], the authors' code [C] = MLOPTPSU/FedTorch, ``apfl.py``):

- v_i^0 = the seeded initial model w^0 (as [C], whose personal model starts as a copy of the initial model).
  BatchNorm statistics of v_bar_i are v_i's (the mixture's forward passes update them).
- Personal model (PA): v_bar_i from this round's trained v_i and w_i (as [C], which evaluates it before the
  aggregation).
- [C] differs from [P] in ways not offered here: it mixes the two models' *outputs*, alpha v(x) +
  (1 - alpha) w(x), rather than their weights; it adapts alpha once per round (first batch), with the
  gradient sum <v - w, alpha g_v + (1 - alpha) g_w> + 0.02 alpha; and it steps w before computing v's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedpcd.algorithms.common import round_lr
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.sgd import SGD
from fedpcd.algorithms.statedict import StateDict, clone_state, device_of


def mixture(alpha: Tensor, v: StateDict, w: StateDict, params: set[str]) -> StateDict:
    """v_bar = alpha v + (1 - alpha) w over the parameters ``params``; the other tensors (BatchNorm
    statistics) are v's."""
    return {k: alpha * v[k] + (1 - alpha) * w[k] if k in params else v[k] for k in v}


@ALGORITHMS.register("apfl")
@dataclass
class APFL(FedAvg):
    """APFL: FedAvg for the global model plus a local model v_i mixed in with an adaptive weight alpha_i."""

    # alpha_i^0, every client's initial mixing weight; 0.5: [C]'s README example (-pa 0.5).
    alpha_init: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    # True: alpha_i takes the projected gradient step above; False: alpha_i stays alpha_init ([P]'s
    # fixed-alpha variant).
    adaptive_alpha: bool = True
    # Step size of alpha; None: the round's local lr (Alg. 1's eta_t, [P] and [C]).
    alpha_lr: Annotated[float, Field(gt=0.0)] | None = None

    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """At a first participation, v_i = the seeded initial model and alpha_i = ``alpha_init``; then the
        received global model into ``model`` (w_i)."""
        if work.state is None:
            alpha = torch.tensor(self.alpha_init, device=device_of(model))
            work.state = {"v": clone_state(model), "alpha": alpha}
        super().begin_local(model, data, work)

    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """Alg. 1's local steps for w_i, v_i and alpha_i on the same batches; returns w_i's mean loss."""
        cfg = self.ctx.local
        lr = round_lr(cfg, work.round)
        alpha_lr = lr if self.alpha_lr is None else self.alpha_lr
        w = dict(model.named_parameters())
        v = {k: t.detach().clone().requires_grad_(k in w) for k, t in work.state["v"].items()}
        alpha = work.state["alpha"].detach().clone().requires_grad_(self.adaptive_alpha)
        models = [list(w.values()), [v[k] for k in w]]
        opts = [SGD(p, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay) for p in models]
        model.train()
        total, seen = torch.zeros((), device=device_of(model)), 0
        for _ in range(cfg.epochs):
            for x, y in data.batches(cfg.batch_size, work.rng):
                loss_w = self.loss(model, (x, y), work)
                detached = {k: p.detach() for k, p in w.items()}
                v_bar = mixture(alpha, v, detached, set(w))
                loss_v = F.cross_entropy(functional_call(model, v_bar, (x,)), y)
                for opt in opts:
                    opt.zero_grad()
                alpha.grad = None
                (loss_w + loss_v).backward()
                for params, opt in zip(models, opts, strict=True):
                    if cfg.grad_clip is not None:
                        nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    opt.step()
                if self.adaptive_alpha:
                    with torch.no_grad():
                        alpha.sub_(alpha_lr * alpha.grad).clamp_(0.0, 1.0)
                work.steps += 1
                total += loss_w.detach() * len(y)
                seen += len(y)
        work.state = {"v": {k: t.detach() for k, t in v.items()}, "alpha": alpha.detach()}
        return float(total) / max(seen, 1)

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """v_bar_i = alpha_i v_i + (1 - alpha_i) w_i of this round's trained v_i and w_i."""
        params = {name for name, _ in model.named_parameters()}
        w = clone_state(model)
        model.load_state_dict(mixture(work.state["alpha"], work.state["v"], w, params))
        return model

"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020), Algorithm 1 with its two approximations.

The federation learns w minimising the mean of the MAML objectives F_i(w) = f_i(w - alpha grad f_i(w)), whose
gradient is (I - alpha hess f_i(w)) grad f_i(w - alpha grad f_i(w)). Each local step of client i takes
independent batches D, D' (and D'') from its data:

    w_tilde = w - alpha grad f_i(w; D)                                  (inner step, alpha)
    g       = grad f_i(w_tilde; D')
    FO:  w <- w - beta g                                                (the Hessian term dropped)
    HF:  w <- w - beta (g - alpha d),                                   (Hessian-free)
         d  = [grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')] / (2 delta)   (~ hess f_i(w; D'') g)

The server averages the local models as FedAvg. The personalised model of client i is the global model it
received after ``personal_steps`` steps w <- w - alpha grad f_i(w; D) on batches of its training data (the
paper's personalisation: one step of local gradient descent, then evaluate).

Library choices (no code by the authors; [D] = CharlieDinh/pFedMe's FO implementation):

- A round has K = ceil(n_k / B) E local steps (FedAvg's count of steps, ``local.*``); each step draws its
  2 (FO) or 3 (HF) batches of size B in turn from the client's shuffled passes over its data, which continue
  into a new pass as needed ([D] cycles its loader the same way).
- Plain SGD steps, as Alg. 1 (and [D]): ``local.momentum``, ``local.weight_decay`` and ``local.grad_clip``
  do not apply. beta defaults to the round's local lr (``local.lr``, ``local.lr_decay``); alpha is fixed, as
  in the objective.
- The personalisation steps use the client's training batches; [D] takes its one step on a test batch.
- Every forward pass in training mode updates BatchNorm statistics (3 or 5 per step).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import local_steps, round_lr
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Reply
from fedpcd.algorithms.fedavg import FedAvg


def endless_batches(
    data: ClientData, batch_size: int, rng: torch.Generator
) -> Iterator[tuple[Tensor, Tensor]]:
    """The client's batches, one shuffled pass after another (drawn from ``rng`` as the shared loop does)."""
    while True:
        yield from data.batches(batch_size, rng)


@ALGORITHMS.register("perfedavg")
@dataclass
class PerFedAvg(FedAvg):
    """Per-FedAvg: local MAML steps (FO or HF) on the federation's model; personalised by alpha-steps."""

    # "fo": Per-FedAvg (FO), first-order; "hf": Per-FedAvg (HF), Hessian-vector product by finite differences
    variant: Literal["fo", "hf"] = "fo"
    # Inner step size alpha of F_i (and of the personalisation steps); the library's default (local.lr's).
    alpha: Annotated[float, Field(gt=0.0)] = 0.01
    # Outer step size beta; None: the round's local lr.
    beta: Annotated[float, Field(gt=0.0)] | None = None
    # HF's finite-difference radius delta (the library's default).
    delta: Annotated[float, Field(gt=0.0)] = 1.0e-3
    # Steps from the received global model to the personalised model (the paper's: 1; 0 = the global model).
    personal_steps: Annotated[int, Field(ge=0)] = 1

    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """K local steps of Alg. 1 (FO or HF); returns the mean loss f_i(w_tilde; D')."""
        cfg = self.ctx.local
        beta = round_lr(cfg, work.round) if self.beta is None else self.beta
        params = list(model.parameters())
        batches = endless_batches(data, cfg.batch_size, work.rng)
        model.train()
        total, seen = 0.0, 0
        for _ in range(local_steps(data, cfg)):
            w = [p.detach().clone() for p in params]
            _step(params, gradients(self, model, next(batches), work)[0], self.alpha)  # w_tilde
            batch = next(batches)
            g, loss = gradients(self, model, batch, work)
            _load(params, w)
            if self.variant == "hf":
                d = hessian_product(self, model, g, next(batches), work, self.delta)
                g = [gi - self.alpha * di for gi, di in zip(g, d, strict=True)]
            _step(params, g, beta)
            work.steps += 1
            total += loss * len(batch[1])
            seen += len(batch[1])
        return total / max(seen, 1)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply, then ``model`` becomes the personalised model: the received global model after
        ``personal_steps`` alpha-steps on the client's training batches."""
        reply, state = super().end_local(model, data, work, loss)
        work.payload = work.received
        self.begin_local(model, data, work)
        model.train()
        batches = endless_batches(data, self.ctx.local.batch_size, work.rng)
        for _ in range(self.personal_steps if data.num_samples else 0):
            _step(list(model.parameters()), gradients(self, model, next(batches), work)[0], self.alpha)
        return reply, state


def gradients(
    algorithm: FedAvg, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork
) -> tuple[list[Tensor], float]:
    """(grad f_i(w; batch) for every parameter, the loss f_i(w; batch)) at the model's current weights w."""
    loss = algorithm.loss(model, batch, work)
    return list(torch.autograd.grad(loss, list(model.parameters()))), float(loss.detach())


def hessian_product(
    algorithm: FedAvg,
    model: nn.Module,
    g: list[Tensor],
    batch: tuple[Tensor, Tensor],
    work: LocalWork,
    delta: float,
) -> list[Tensor]:
    """HF's d = [grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')] / (2 delta) at the model's weights w
    (left as they were)."""
    params = list(model.parameters())
    w = [p.detach().clone() for p in params]
    _load(params, [wi + delta * gi for wi, gi in zip(w, g, strict=True)])
    plus = gradients(algorithm, model, batch, work)[0]
    _load(params, [wi - delta * gi for wi, gi in zip(w, g, strict=True)])
    minus = gradients(algorithm, model, batch, work)[0]
    _load(params, w)
    return [(a - b) / (2 * delta) for a, b in zip(plus, minus, strict=True)]


@torch.no_grad()
def _step(params: list[nn.Parameter], grads: list[Tensor], lr: float) -> None:
    """p <- p - lr g for every parameter."""
    for p, g in zip(params, grads, strict=True):
        p.sub_(lr * g)


@torch.no_grad()
def _load(params: list[nn.Parameter], values: list[Tensor]) -> None:
    for p, v in zip(params, values, strict=True):
        p.copy_(v)

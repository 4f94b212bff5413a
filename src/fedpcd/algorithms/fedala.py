"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedALA: Adaptive Local Aggregation for Personalized
Federated Learning", AAAI 2023), Sec. 4 and Alg. 1.

The server is FedAvg's. Each client keeps its trained local model Theta_i (the client state). Instead of
overwriting it with the received global model Theta, it initialises local training with the Adaptive Local
Aggregation (ALA) module:

    Theta_hat_i = Theta_i + (Theta - Theta_i) (.) [1^{|Theta_i| - p}; W_i^p]                  (Eqs. 4-5)

the lower layers take the global model, the p highest layers an element-wise mix with weights W_i^p in
[0, 1] (initially all ones). W_i^p is learnt on a random s% sample D_i^{s,t} of the local training data, by
gradient steps on the local loss of Theta_hat_i clipped to [0, 1] (Eq. 6):

    W <- clip(W - eta * grad_{Theta_hat} L(Theta_hat_i; D^s) (.) (Theta - Theta_i), 0, 1).

ALA is off in the first round (there is no local model yet: the client starts from the global model). At
the client's first ALA (round 2 under full participation) W is trained for passes over D^s until the
population std of the last ``window`` recorded losses falls below ``threshold``; at every later ALA it
gets one pass (Alg. 1). Then the client trains Theta_hat_i as FedAvg does and sends it; the locally trained
model is its personal model and its new state (with W).

Details as in the official code (TsingZ0/FedALA, ``utils/ALA.py``): the recorded loss of a pass is that of
its last batch; the sample is drawn anew every round; ALA runs in training mode and the local model's
BatchNorm statistics stay the client's. p counts layers (modules holding parameters, a layer's weight and
bias together; the official ``layer_idx`` counts parameter tensors, its default 2 = p 1). Not as there:
the official code samples a contiguous window of the client's data from a random start, here a uniformly
random subset of the same size (the paper's "randomly sample"); ``max_weight_epochs`` bounds the
train-until-converged loop, which the official code leaves unbounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.func import functional_call

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Reply, train_loop
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import StateDict, clone_state
from fedpcd.errors import UserError


def higher_layer_keys(model: nn.Module, layers: int) -> list[str]:
    """The parameter names of the model's last ``layers`` layers (modules holding parameters, in order)."""
    names = [n for n, p in model.named_parameters() if p.is_floating_point()]
    owners = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
    if layers > len(owners):
        raise UserError(
            f"FedALA's algorithm.layers={layers} exceeds the model's {len(owners)} layers with parameters; "
            f"choose 1..{len(owners)}"
        )
    top = set(owners[-layers:])
    return [n for n in names if n.rpartition(".")[0] in top]


def ala_mix(local: StateDict, glob: StateDict, weights: StateDict) -> StateDict:
    """Eqs. 4-5 on the higher layers: Theta_i + (Theta - Theta_i) (.) W, per tensor in ``weights``."""
    return {k: local[k] + (glob[k] - local[k]) * w for k, w in weights.items()}


def ala_weight_step(
    grads: StateDict, local: StateDict, glob: StateDict, weights: StateDict, eta: float
) -> StateDict:
    """Eq. 6: W <- clip(W - eta * grad (.) (Theta - Theta_i), 0, 1), the gradient taken at the mixed model."""
    return {k: torch.clamp(w - eta * grads[k] * (glob[k] - local[k]), 0.0, 1.0) for k, w in weights.items()}


@ALGORITHMS.register("fedala")
@dataclass
class FedALA(FedAvg):
    """FedALA: FedAvg whose clients start local training from an adaptive element-wise mix of their local and
    the global model (ALA, Eqs. 4-6)."""

    # eta 1.0, s 80, p 1: [P] Sec. 5 and [O]'s defaults; threshold 0.1 and window 10: [O]'s ALA defaults;
    # max_weight_epochs: neither [P] nor [O] bounds the loop
    eta: Annotated[float, Field(gt=0.0, allow_inf_nan=False, description="learning rate of W (Eq. 6)")] = 1.0
    sample_percent: Annotated[
        float, Field(gt=0.0, le=100.0, description="s: percent of the local data W is learnt on")
    ] = 80.0
    layers: Annotated[int, Field(ge=1, description="p: the highest layers ALA mixes (lower: global)")] = 1
    threshold: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="first ALA: stop when the losses' std is below")
    ] = 0.1
    window: Annotated[int, Field(ge=2, description="first ALA: the last pass losses the std covers")] = 10
    max_weight_epochs: Annotated[int, Field(ge=1, description="first ALA: at most this many passes")] = 100

    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """FedAvg's, once ``layers`` is checked against the model (before any training)."""
        higher_layer_keys(model, self.layers)
        return super().init_server(model)

    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """ALA (from the client's second participation on), then FedAvg's local training."""
        if work.state is not None:
            self.adaptive_local_aggregation(model, data, work)
        return train_loop(self, model, data, work)

    def adaptive_local_aggregation(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Alg. 1's ALA: learn W (``work.ala_weights``) on a random s% sample, then load the lower layers of
        the received global model (already in ``model``), the mixed higher layers and the local buffers."""
        glob, local = work.payload["model"], work.state["model"]
        keys = higher_layer_keys(model, self.layers)
        weights = work.state.get("weights")
        first = weights is None
        if first:
            weights = {k: torch.ones_like(local[k]) for k in keys}
        n = data.num_samples
        size = max(1, int(self.sample_percent / 100 * n))
        sample = data.train_idx[torch.randperm(n, generator=work.rng)[:size].to(data.train_idx.device)]
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = {k: v.clone() for k, v in local.items() if k not in params}
        model.train()
        losses: list[float] = []
        while True:
            for start in range(0, size, self.ctx.local.batch_size):
                idx = sample[start : start + self.ctx.local.batch_size]
                mixed = {k: v.requires_grad_(True) for k, v in ala_mix(local, glob, weights).items()}
                out = functional_call(model, {**params, **buffers, **mixed}, (data.x[idx],))
                loss = F.cross_entropy(out, data.y[idx])
                grads = dict(zip(mixed, torch.autograd.grad(loss, list(mixed.values())), strict=True))
                weights = ala_weight_step(grads, local, glob, weights, self.eta)
            losses.append(float(loss.detach()))
            if (
                not first
                or len(losses) >= self.max_weight_epochs
                or _settled(losses, self.window, self.threshold)
            ):
                break
        work.ala_weights = weights
        model.load_state_dict(
            {**ala_mix(local, glob, weights), **{k: local[k] for k in buffers}}, strict=False
        )

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply; the state is the trained local model and W (once learnt)."""
        reply, _ = super().end_local(model, data, work, loss)
        state: dict[str, Any] = {"model": clone_state(model)}
        if work.get("ala_weights") is not None:
            state["weights"] = {k: w.detach().clone() for k, w in work.ala_weights.items()}
        return reply, state


def _settled(losses: list[float], window: int, threshold: float) -> bool:
    """Alg. 1's convergence test: more than ``window`` losses and the last ``window`` with std < threshold."""
    if len(losses) <= window:
        return False
    tail = losses[-window:]
    mean = sum(tail) / window
    return math.sqrt(sum((x - mean) ** 2 for x in tail) / window) < threshold

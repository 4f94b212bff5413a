"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for FL", ICML 2020), Algorithm 1.

Server and clients keep control variates c and c_i (one tensor per parameter, zero at start). Each local
step is y_i <- y_i - eta_l (g_i(y_i) - c_i + c) (Eq. 3); afterwards option II of Eq. (4) sets
c_i^+ = c_i - c + (x - y_i) / (K eta_l), K the number of local steps and eta_l the round's local learning
rate, and the client sends (Delta y_i, Delta c_i) = (y_i - x, c_i^+ - c_i). The server (Eq. 5) moves
x <- x + eta_g mean(Delta y_i) and c <- c + (|S|/N) mean(Delta c_i) = c + (1/N) sum_{i in S} Delta c_i.

Differences from FedAvg, all in this file: the payload carries c, the correction (c - c_i) is added to every
gradient (``correct_grads``, before clipping, weight decay and momentum), the reply carries Delta c_i and the
server keeps c. With eta_g = 1 the model update is the weighted average of the y_i (x + mean(y_i - x) =
mean y_i), which is computed as such, so with zero variates the first round equals FedAvg's exactly.
Buffers (BatchNorm statistics) are averaged as in FedAvg. Peers' known bug (PFLlib#152, #160): the
denominator of option II is K * eta_l with K the *total* number of local steps (all epochs), as here.

Momentum: Alg. 1 is plain SGD. With heavy-ball momentum beta (the papers' local optimiser here, beta 0.9)
K steps move the model about K eta_l / (1 - beta) times the mean gradient, so the literal (x - y_i)/(K eta_l)
overestimates the gradient ~1/(1 - beta) = 10-fold and the variates blow up (NaN within 3 rounds on
fmnist P10C2 with 5 local epochs). ``momentum_aware`` (default) divides by the effective K eta_l / (1 - beta)
instead; with momentum 0 both forms are Alg. 1 exactly. ``momentum_aware=false`` is the literal formula.

Gradient clipping: the local loop clips the (corrected) gradient's norm at ``grad_clip`` = 10 unless
``local.grad_clip`` is set, as the official FedDC code does for its SCAFFOLD and FedDC runs; FedDC inherits
it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import Weighting, reply_weights, round_lr
from fedpcd.algorithms.context import ClientData, Context
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import StateDict, clone_state, shifted, weighted_average, zeros_like_params


def option_two_control(
    c_i: StateDict, c: StateDict, x: StateDict, y: StateDict, steps: int, lr: float
) -> StateDict:
    """Eq. (4), option II: c_i^+ = c_i - c + (x - y_i) / (K eta_l), per parameter."""
    scale = 1.0 / (steps * lr)
    return {k: c_i[k] - c[k] + (x[k] - y[k]) * scale for k in c_i}


@ALGORITHMS.register("scaffold")
@dataclass
class Scaffold(FedAvg):
    """SCAFFOLD, option II control variates; FedAvg plus the drift correction (c - c_i) on every gradient."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("control_delta",)
    unprivatised: ClassVar[str] = (
        "its server sums the control-variate deltas into c, which no declared kind (a mean under the "
        "upload's key, per-class rows) bounds: privatising them needs their own clipping and noise on c, a "
        "change of the method"
    )

    # Global step size eta_g of Eq. (5); 1 is the paper's choice in its experiments.
    server_lr: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    # Weights of mean(Delta y_i): "samples" (n_k, the library's FedAvg and FedMR's baselines, FedMR
    # Sec. 3.1) so SCAFFOLD differs from FedAvg only by its variates; "uniform" is Alg. 1's 1/|S|.
    # The c update is always (1/N) sum Delta c_i (c is the mean of all N client variates).
    weighting: Weighting = "samples"
    # Option II's denominator K eta_l / (1 - beta) under momentum beta (module docstring); False: K eta_l.
    momentum_aware: bool = True
    # Gradient-norm clip of the local loop when ``local.grad_clip`` is null (which takes precedence): 10, as
    # the official FedDC code (which also runs its SCAFFOLD) clips; without it the variates can diverge under
    # label skew. null: no clipping.
    grad_clip: Annotated[float | None, Field(gt=0.0, allow_inf_nan=False)] = 10.0

    def setup(self, ctx: Context) -> None:
        """The local loop clips at ``local.grad_clip`` if set, else at this algorithm's ``grad_clip`` (10, the
        official codes')."""
        if ctx.local.grad_clip is None:
            ctx = replace(ctx, local=ctx.local.model_copy(update={"grad_clip": self.grad_clip}))
        super().setup(ctx)

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """x^0 from the seeded model and c = 0."""
        server = super().init_server(model)
        server["control"] = zeros_like_params(model)
        return server

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """(x, c), sent to every sampled client."""
        return {"model": server["model"], "control": server["control"]}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """Eq. (5): x <- x + eta_g mean(y_i - x); c <- c + (1/N) sum_{i in S} Delta c_i."""
        x = server["model"]
        new = weighted_average([r["model"] for r in replies], reply_weights(replies, self.weighting))
        if self.server_lr != 1.0:
            for k in server["control"]:
                new[k] = x[k] + self.server_lr * (new[k] - x[k])
        server["model"] = new
        n = float(self.ctx.num_clients)
        control = {}
        for k, c in server["control"].items():
            total = torch.zeros_like(c)
            for r in replies:
                total.add_(r["control_delta"][k])
            control[k] = c + total / n
        server["control"] = control
        return server

    # ----- client -----
    def init_client_state(self, model: nn.Module) -> dict[str, Any]:
        """c_i = 0 (Alg. 1, initialisation)."""
        return {"control": zeros_like_params(model)}

    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Alg. 1 client: y_i <- x and the correction c - c_i of Eq. (3) (``work.correction``; c_i = 0 at
        first)."""
        work.state = dict(work.state) if work.state is not None else self.init_client_state(model)
        super().begin_local(model, data, work)
        c = work.payload["control"]
        work.correction = {k: c[k] - ci for k, ci in work.state["control"].items()}

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """Eq. (4) option II for c_i after the K corrected steps; reply (y_i, Delta c_i)."""
        state = work.state
        y = clone_state(model)
        steps, lr = work.steps, round_lr(self.ctx.local, work.round)
        if self.momentum_aware:
            lr /= 1.0 - self.ctx.local.momentum
        new_c = option_two_control(
            state["control"], work.received["control"], work.received["model"], y, steps, lr
        )
        delta = {k: new_c[k] - state["control"][k] for k in new_c}
        state["control"] = new_c
        reply = {"model": y, "control_delta": delta, "num_samples": data.num_samples, "train_loss": loss}
        return reply, state

    def correct_grads(
        self, grads: dict[str, Tensor], params: Mapping[str, Tensor], work: LocalWork
    ) -> dict[str, Tensor]:
        """Eq. (3): g_i(y) -> g_i(y) - c_i + c."""
        return shifted(grads, work.correction)

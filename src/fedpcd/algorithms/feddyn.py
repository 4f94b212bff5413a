"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021), Algorithm 1.

Client k, sampled in round t, minimises the dynamically regularised objective

    L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + (alpha/2) ||theta - theta^{t-1}||^2

and then updates its gradient state (zero at start)
grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1}). The server keeps h (zero at
start): h^t = h^{t-1} - (alpha/m) sum_{k in P_t} (theta_k^t - theta^{t-1}), m = all clients, and sets
theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - h^t / alpha.

Differences from FedAvg: the regularisers' gradients, -grad L_k(theta_k^{t-1}) + alpha (theta -
theta^{t-1}), are added to every minibatch gradient (``correct_grads``, exact; ``train_loss`` stays the
cross-entropy), the client keeps its gradient state, the server keeps h. Buffers (BatchNorm statistics)
are averaged as in FedAvg.
FedDyn does not reduce to FedAvg as alpha -> 0 (h^t / alpha stays finite and non-zero), so alpha must be > 0.

Metrics: ``global_acc`` scores theta^t; ``global_acc_local_mean`` scores the mean of the round's local models
(theta^t + h^t / alpha), the official code's headline number ("avg_model"; with full participation it is
also its "all_model").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import Weighting, reply_weights
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import shifted, weighted_average, zeros_like_params


@ALGORITHMS.register("feddyn")
@dataclass
class FedDyn(FedAvg):
    """FedDyn: linear + quadratic dynamic regulariser on the client, h-corrected average on the server."""

    extra_server_state: ClassVar[tuple[str, ...]] = ("h",)

    # alpha of Alg. 1. 1e-4: FedMR Table 9's tuned value for FMNIST, CIFAR10 and CIFAR100 (Fan et al.,
    # TMLR 2023; SVHN 1e-6 / 1e-5). The paper uses {0.1, 0.01, 0.001}.
    alpha: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0e-4
    # Weights of the server's model average: "uniform" = 1/|P_t| (the paper and official code);
    # "samples" = n_k like the library's FedAvg.
    weighting: Weighting = "uniform"

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """theta^0 from the seeded model and h^0 = 0 (parameters only)."""
        server = super().init_server(model)
        server["h"] = zeros_like_params(model)
        return server

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """Alg. 1 server: h <- h - (alpha/m) sum_k (theta_k - theta); theta <- avg_k theta_k - h / alpha."""
        prev = server["model"]
        new = weighted_average([r["model"] for r in replies], reply_weights(replies, self.weighting))
        m = float(self.ctx.num_clients)
        h = {}
        for k, h_k in server["h"].items():
            drift = torch.zeros_like(h_k)
            for r in replies:
                drift.add_(r["model"][k] - prev[k])
            h[k] = h_k - (self.alpha / m) * drift
            new[k] = new[k] - h[k] / self.alpha
        server["model"], server["h"] = new, h
        return server

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Alg. 1 client step: start from theta^{t-1} with the gradient state (zero at first); the linear
        term's gradient -grad L_k(theta_k^{t-1}) is ``work.linear``."""
        work.state = dict(work.state) if work.state is not None else {"grad": zeros_like_params(model)}
        super().begin_local(model, data, work)
        work.linear = {k: -g for k, g in work.state["grad"].items()}

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """After the regularised training: grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t -
        theta^{t-1})."""
        reply, state = super().end_local(model, data, work, loss)
        prev, theta = work.received["model"], reply["model"]
        state["grad"] = {k: g - self.alpha * (theta[k] - prev[k]) for k, g in state["grad"].items()}
        return reply, state

    def correct_grads(
        self, grads: dict[str, Tensor], params: Mapping[str, Tensor], work: LocalWork
    ) -> dict[str, Tensor]:
        """Gradient of the local regulariser: -grad L_k(theta_k^{t-1}) + alpha (theta - theta^{t-1})."""
        prev, linear = work.payload["model"], work.linear
        terms = {name: linear[name] + self.alpha * (params[name] - prev[name]) for name in linear}
        return shifted(grads, terms)

    # ----- extra metrics -----
    def extra_global_predictors(
        self, model: nn.Module, server: dict[str, Any]
    ) -> Iterator[tuple[str, Predictor]]:
        """``local_mean``: the (``weighting``) mean of the round's local models, theta^t + h^t / alpha, which
        the official code evaluates as its headline accuracy ("avg_model"), reported as
        ``global_acc_local_mean``; ``global_acc`` scores theta^t, the model the clients start from."""
        h = server["h"]
        model.load_state_dict({k: v + h[k] / self.alpha if k in h else v for k, v in server["model"].items()})
        yield "local_mean", model

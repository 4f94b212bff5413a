"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020).

Client i runs tau_i local steps; its cumulative update is x - y_i = eta G_i a_i, with a_i the vector of
weights its local solver gives the tau_i gradients. The generalised update (Sec. 4) is
x^{t+1} = x^t - tau_eff sum_i w_i eta G_i a_i / ||a_i||_1; FedNova (Sec. 5) takes w_i = p_i = n_i / n and
tau_eff = sum_i p_i ||a_i||_1, so

    x^{t+1} = x^t - (sum_i p_i ||a_i||_1) sum_i p_i (x^t - y_i) / ||a_i||_1.

With local momentum rho (PyTorch's heavy ball, no dampening) a_i = [1 - rho^{tau_i}, ..., 1 - rho] / (1 - rho)
and ||a_i||_1 = [tau_i - rho (1 - rho^{tau_i}) / (1 - rho)] / (1 - rho) (the paper's momentum variant,
as in FedMR's FedNova baseline); without momentum ||a_i||_1 = tau_i. With equal tau_i the update is FedAvg's.
Only parameters are normalised; buffers (BatchNorm statistics) are averaged with p_i as in FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import average_dicts, clone_state, param_names, weighted_average


def effective_steps(tau: int, rho: float) -> float:
    """||a||_1 for tau steps of SGD with momentum rho: [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)."""
    if rho == 0.0:
        return float(tau)
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


@ALGORITHMS.register("fednova")
@dataclass
class FedNova(FedAvg):
    """FedNova: FedAvg whose server normalises each client's update by its effective step count ||a_i||_1."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("normalized_update", "a_norm", "buffers")
    unprivatised: ClassVar[str] = (
        "its server scales the mean by tau_eff, the weighted step counts a_norm, which reveal each n_k and "
        "multiply the clipped update's sensitivity by a data-dependent factor"
    )

    # ||a_i||_1 with the local momentum of ``local.momentum`` (the paper's momentum variant, used by its
    # experiments and by the official code); False: a_i = tau_i (plain-SGD normalisation, ignores momentum).
    momentum_aware: bool = True

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """After FedAvg's local training: the normalised update d_i = (x - y_i) / ||a_i||_1 of the parameters.

        tau_i = ``work.steps`` = ceil(n_i / B) E. The client normalises (it knows which keys are parameters),
        as the official code does; the reply carries d_i, ||a_i||_1 and the buffers, so bytes equal FedAvg's.
        """
        rho = self.ctx.local.momentum if self.momentum_aware else 0.0
        a_norm = effective_steps(work.steps, rho)
        params = set(param_names(model))
        y = clone_state(model)
        x = work.received["model"]
        reply = {
            "normalized_update": {k: (x[k] - y[k]) / a_norm for k in y if k in params},
            "a_norm": a_norm,
            "buffers": {k: v for k, v in y.items() if k not in params},
            "num_samples": data.num_samples,
            "train_loss": loss,
        }
        return reply, work.state

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """x <- x - tau_eff sum_i p_i d_i; tau_eff = sum_i p_i ||a_i||_1; p_i = n_i / sum_S n_j."""
        x = server["model"]
        weights = [float(r["num_samples"]) for r in replies]
        total = sum(weights)
        p = [w / total for w in weights]
        tau_eff = sum(pi * float(r["a_norm"]) for pi, r in zip(p, replies, strict=True))
        direction = average_dicts([r["normalized_update"] for r in replies], weights)
        new = {k: x[k] - tau_eff * d for k, d in direction.items()}
        if replies[0]["buffers"]:
            new.update(weighted_average([r["buffers"] for r in replies], weights))
        server["model"] = {k: new[k] for k in x}
        return server

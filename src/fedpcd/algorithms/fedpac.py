"""FedPAC (Xu, Tong & Huang, "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration", ICLR 2023), Alg. 1.

The model is a shared feature extractor (the body, averaged by n_i as in FedAvg) and a personal linear
classifier (the head, the client state). Each round client i:

- extracts, with the received body, its statistics for the server (Sec. 4.3): the class-prior-weighted
  feature means h_i = [p_i(k) mu_ik]_k and the variance term
  V_i = (1 / n_i) sum_k [p_i(k) E||f(x)||^2_{y=k} - p_i(k)^2 ||mu_ik||^2];
- trains the head for ``head_epochs`` with the body fixed (CE), then the body for ``body_epochs`` with the
  head fixed on the feature-alignment objective (Eqs. 5-6)

      CE(g_i(f(x)), y) + lambda * (1/d) ||f(x) - c_y||^2,

  c_y the global prototype of class y (a class without one: the client's own class mean before training);
  the alignment is off in the first round;
- uploads the body, its head, its class prototypes after training with their counts, V_i and h_i.

The server averages the bodies, aggregates the prototypes per class weighted by the counts, and combines
the heads (Eqs. 10-12): for every client i of the round, the weights alpha_i on the simplex minimise

      sum_j alpha_ij^2 V_j + sum_k || h_ik - sum_j alpha_ij h_jk ||^2 = alpha_i^T (diag(V) + D_i) alpha_i,

D_i[j, j'] = sum_k <h_ik - h_jk, h_ik - h_j'k>; weights below 1e-3 are dropped and the rest renormalised
(the official code JianXu95/FedPAC), and client i's next head is sum_j alpha_ij g_j. The quadratic program
is the minimum-norm point of the convex hull of the columns a_j = [h_i - h_j; sqrt(V_j) e_j], solved
exactly (up to float rounding) by non-negative least squares: min_{b >= 0} ||A b||^2 + (1^T b - 1)^2 has
its minimiser at b = alpha / (1 + r), r the minimal value, so alpha = b / sum(b).

As the official code: statistics before local training (eval mode), prototypes after it, MSE as the mean
over the batch and the d dimensions, a separate head learning rate (``head_lr``: 0.1 there). The personal
model is the locally trained model (the official code's reported accuracy); the generic model (GA) is the
averaged body with the initial head, as FedPer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import ClassSums, aggregate_prototypes, class_means_reply
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Reply, train_loop
from fedpcd.algorithms.fedproto import prototype_mse
from fedpcd.algorithms.fedrep import FedRep
from fedpcd.algorithms.statedict import average_dicts, clone_state, device_of
from fedpcd.models import head_keys

MIN_WEIGHT = 1e-3  # combination weights below it are dropped (the official code's eps)


def pac_statistics(z: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """(V_i, h_i [C, d], class means [C, d]; zero rows for absent classes) of features ``z`` with labels
    ``y``, in float64 (Sec. 4.3, as the official ``statistics_extraction``)."""
    z = z.double()
    sums = ClassSums(
        num_classes, z.shape[1:], (), dtype=torch.float64, device=z.device, count_dtype=torch.float64
    )
    sums.add(y, z, z.pow(2).sum(1))
    counts = sums.counts
    n = counts.sum()
    means = sums.sums[0] / counts.clamp(min=1.0)[:, None]
    sq_norms = sums.sums[1] / counts.clamp(min=1.0)
    p = counts / n
    variance = (p * sq_norms - p.pow(2) * means.pow(2).sum(1)).sum() / n
    return variance, p[:, None] * means, means


def collaboration_weights(variances: Tensor, h: Tensor) -> Tensor:
    """[m, m]: row i holds alpha_i, the minimiser of alpha^T (diag(V) + D_i) alpha on the simplex (Eqs.
    10-12), weights below ``MIN_WEIGHT`` set to 0 and the row renormalised; ``variances`` [m], ``h``
    [m, C, d]."""
    from scipy.optimize import nnls  # here, not at import: SciPy's optimisers take 0.4 s to import

    v = variances.detach().double().cpu().numpy()
    flat = h.detach().double().cpu().flatten(1).numpy()  # [m, C d]
    m = len(v)
    rows = []
    for i in range(m):
        a = np.vstack([(flat[i] - flat).T, np.diag(np.sqrt(np.maximum(v, 0.0))), np.ones((1, m))])
        b = np.zeros(a.shape[0])
        b[-1] = 1.0
        beta, _ = nnls(a, b)
        alpha = beta / beta.sum()
        alpha[alpha < MIN_WEIGHT] = 0.0
        rows.append(alpha / alpha.sum())
    return torch.tensor(np.array(rows), dtype=torch.float64, device=variances.device)


@torch.no_grad()
def _features(model: nn.Module, data: ClientData, chunk: int = 512) -> Tensor:
    """f(x) of every training sample of the client, in eval mode, in ``train_idx`` order."""
    was_training = model.training
    model.eval()
    idx = data.train_idx
    z = torch.cat([model.features(data.x[idx[s : s + chunk]]) for s in range(0, len(idx), chunk)])
    model.train(was_training)
    return z


@ALGORITHMS.register("fedpac")
@dataclass
class FedPAC(FedRep):
    """FedPAC: feature alignment to global prototypes (Eqs. 5-6) and server-side classifier collaboration
    (Eqs. 10-12); the body is averaged, each client's head is a combination of the round's heads."""

    extra_uploads: ClassVar[tuple[str, ...]] = (
        "client",
        "head",
        "classes",
        "class_counts",
        "class_means",
        "variance",
        "h_ref",
    )
    extra_server_state: ClassVar[tuple[str, ...]] = ("prototypes", "known", "heads", "collaborated")

    # lambda 1.0 and 1 head epoch: [O]'s defaults; body epochs: [O]'s local_epoch (5); head lr: [O] 0.1
    lam: Annotated[
        float,
        Field(ge=0.0, allow_inf_nan=False, description="lambda: weight of the feature alignment (Eq. 6)"),
    ] = 1.0
    head_epochs: Annotated[int, Field(ge=0, description="epochs on the head (body fixed) first")] = 1
    body_epochs: (
        Annotated[int, Field(ge=1, description="epochs on the body (head fixed) then; null: local.epochs")]
        | None
    ) = None
    head_lr: (
        Annotated[
            float,
            Field(
                gt=0.0, allow_inf_nan=False, description="learning rate of the head epochs; null: local lr"
            ),
        ]
        | None
    ) = None

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """FedPer's body and initial head, the global prototypes (none known yet) and a slot per client for
        the combined head the server computed for it."""
        server = super().init_server(model)
        c, d, n, device = self.ctx.num_classes, int(model.feature_dim), self.ctx.num_clients, device_of(model)
        server["prototypes"] = torch.zeros(c, d, device=device)
        server["known"] = torch.zeros(c, dtype=torch.bool, device=device)
        server["heads"] = {k: torch.zeros(n, *v.shape, device=device) for k, v in server["initial"].items()}
        server["collaborated"] = torch.zeros(n, dtype=torch.bool, device=device)
        return server

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """The body, the global prototypes and, once computed, the client's combined head."""
        payload = {**super().payload_for(server, client_id), "prototypes": server["prototypes"]}
        payload["known"] = server["known"]
        if bool(server["collaborated"][client_id]):
            payload["head"] = {k: v[client_id] for k, v in server["heads"].items()}
        return payload

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """Bodies by n_i, prototypes by class counts, and head_i = sum_j alpha_ij head_j (Eqs. 10-12)."""
        server = super().aggregate(server, replies)
        server["prototypes"], server["known"] = aggregate_prototypes(
            server["prototypes"], server["known"], replies
        )
        alpha = collaboration_weights(
            torch.stack([r["variance"] for r in replies]), torch.stack([r["h_ref"] for r in replies])
        )
        heads = [r["head"] for r in replies]
        for i, reply in enumerate(replies):
            k = int(reply["client"])
            for key, value in average_dicts(heads, alpha[i].tolist()).items():
                server["heads"][key][k] = value
            server["collaborated"][k] = True
        return server

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """The body and the head (the combined one the server sent, else the own), then the statistics of the
        received body and the alignment targets (global prototype, else the own class mean)."""
        super().begin_local(model, data, work)
        if "head" in work.payload:
            model.load_state_dict(work.payload["head"], strict=False)
        variance, h, means = pac_statistics(_features(model, data), data.y[data.train_idx], data.num_classes)
        work.variance, work.h_ref = variance.float(), h.float()
        known = work.payload["known"]
        work.targets = torch.where(known[:, None], work.payload["prototypes"], means.to(known.device).float())

    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """Alg. 1: ``head_epochs`` on the head (body fixed, ``head_lr``), then ``body_epochs`` on the body."""
        work.phase = "head"
        train_loop(self, model, data, work, epochs=self.head_epochs, lr=self.head_lr)
        work.phase = "body"
        return train_loop(self, model, data, work, epochs=self.body_epochs)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """CE; in the body phase after the first round, + lambda * MSE(f(x), c_y) (Eq. 6)."""
        if work.get("phase") != "body" or work.round == 1 or self.lam == 0.0:
            return super().loss(model, batch, work)
        x, y = batch
        z = model.features(x)
        everywhere = torch.ones(len(work.targets), dtype=torch.bool, device=z.device)
        return F.cross_entropy(model.head(z), y) + self.lam * prototype_mse(z, y, work.targets, everywhere)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedPer's reply (the body; the head stays the state) plus the head, the prototypes after training,
        V_i and h_i."""
        reply, state = super().end_local(model, data, work, loss)
        reply.update(class_means_reply(model, data), client=data.id, variance=work.variance, h_ref=work.h_ref)
        reply["head"] = clone_state(model, head_keys(model))
        return reply, state

"""FedSC (Wang et al., "FedSC: Federated Learning with Semantic-Aware Collaboration", KDD 2025).

After local training each client sends, for every class it holds, its class prototype c_k^j (Eq. 3: the mean
feature of its samples under the final local model) and the count n_k^j. The server then builds
(Sec. 3.3-3.4):

- relational prototypes r_k^j (Eqs. 7-9): phi_k^j = cos(g^j, c_k^j) with g^j the mean of the reported c_k^j;
  r_k^j is the mean of c_k^j and the c_q^j of the M clients q whose phi_q^j is nearest to phi_k^j;
- consistent prototypes o^j (Eqs. 10-12): d_k = sqrt(1/2 sum_j (n_k^j/n_k - 1/C)^2),
  e_k = sigmoid(n_k/N - d_k/sum_i d_i) / sum_i (...), o^j = sum_{k in S_j} e_k r_k^j / sum_{k in S_j} e_k.

Every client receives the global model, the bank of all relational prototypes (with class labels) and O. Its
local loss is CE + rpcl_weight * RPCL + cpdr_weight * CPDR (all weights 1 in the paper):

- RPCL (Eqs. 13-14): multi-positive InfoNCE over the bank, s(z, r) = cos(z, r) / U(r) with
  U(r) = mean_q ||z_q - r||_2 (estimated on the mini-batch, detached, clamped at 1e-6) and temperature tau;
- CPDR (Eq. 15): ||z_i - o^{y_i}||_1 (paper, ``cpdr_dist="l1_sum"``); ``"mse_mean"`` is the form the official
  code meant to apply, mean_q (z_{i,q} - o^{y_i}_q)^2 (about 1/d of the L1 sum); ``"self_mse"`` is what that
  code computes: its target falls back to the features themselves (a ``torch.mean`` on a Python list raises
  inside a bare ``except``), so the term is identically 0 with zero gradient.

Samples of a class without prototypes get CE only; round 1 (no prototypes yet) is FedAvg. The model weights
are averaged as in FedAvg (by n_k over the round's participants). rpcl_weight = cpdr_weight = 0 is
FedAvg exactly.

Sources: [P] the paper (the default), [C] the official code hwang52/FedSC.
``compat_official=True`` reproduces [C]'s actual behaviour for auditing (all of it but its
batch-level augmentation, which lives in the data pipeline and is not reproduced):
no relational merge (r = c), e_k indexed by position within each class's list and not renormalised, RPCL with
the sample itself as the positive (constant logit 1/tau), plain cosine (no U) and the batch-wide pooled
negatives, CPDR = mse(z, z.detach()) (identically 0), prototypes collected from the last local epoch's
training forward passes. [C]'s hyperparameters (lr 0.1, no momentum or weight decay, 5 of 10 clients per
round) are config settings, not part of this switch.

Presets (``algorithm.preset``, ``FedSC.presets``): ``paper`` = [P]'s method and optimizer (lr 0.01, momentum
0.9, weight decay 1e-5, E = 10, B = 64); ``official`` = [C]'s effective behaviour (``compat_official``, CPDR
``self_mse`` = 0) with its optimizer (lr 0.1, no momentum or weight decay) and 5 of 10 clients per round;
``code_intended`` = the ``paper`` preset with CPDR in the per-element MSE form [C] meant to apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import ClassSums, class_means_reply
from fedpcd.algorithms.context import CLASS_MEAN_UPLOADS, ClientData, Upload
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import device_of
from fedpcd.algorithms.vectorizable import TwoFormLoss
from fedpcd.params import Preset

U_MIN = 1e-6  # clamp of the U normaliser (Eq. 13; a library choice)


# ----- server side: Eqs. 7-12 ------------------------------------------------------------------------------


def angle_scores(protos: Tensor) -> Tensor:
    """Eq. 7 for one class: phi_k = cos(g, c_k) with g the mean of the rows of ``protos`` ([n, d] -> [n])."""
    g = protos.mean(dim=0, keepdim=True)
    return F.cosine_similarity(protos, g.expand_as(protos), dim=1)


def select_neighbors(phi: Tensor, m: int) -> list[list[int]]:
    """Eq. 8: for each k, the (up to) m indices q != k with the smallest |phi_k - phi_q| (ties: lower q)."""
    n = len(phi)
    out = []
    for k in range(n):
        gap = (phi - phi[k]).abs().double()
        gap[k] = math.inf
        order = torch.sort(gap, stable=True).indices[: min(m, n - 1)]
        out.append([int(q) for q in order])
    return out


def relational_prototypes(protos: Tensor, m: int) -> Tensor:
    """Eqs. 7-9 for one class: r_k = (c_k + sum_{q in N_k} c_q) / (|N_k| + 1), N_k by ``select_neighbors``."""
    if m == 0 or len(protos) == 1:
        return protos.clone()
    rows = [
        protos[[k, *nbrs]].mean(dim=0) for k, nbrs in enumerate(select_neighbors(angle_scores(protos), m))
    ]
    return torch.stack(rows)


def discrepancy(counts: Tensor) -> Tensor:
    """Eq. 10: d_k = sqrt(1/2 sum_j (n_k^j/n_k - 1/C)^2) per row of the [K, C] count matrix."""
    counts = counts.double()
    b = counts / counts.sum(dim=1, keepdim=True).clamp_min(1.0)
    return torch.sqrt(0.5 * (b - 1.0 / counts.shape[1]).pow(2).sum(dim=1))


def discrepancy_weights(num_samples: Tensor, d: Tensor) -> Tensor:
    """Eq. 11: e_k = sigmoid(a n_k - b d_k) / sum_i sigmoid(a n_i - b d_i), a = 1/N, b = 1/sum_i d_i.

    N and sum d over the given (participating) clients; b d_k = 0 when every d_k is 0.
    """
    n = num_samples.double()
    d = d.double()
    total_d = float(d.sum())
    penalty = d / total_d if total_d > 0 else torch.zeros_like(d)
    s = torch.sigmoid(n / n.sum() - penalty)
    return s / s.sum()


def consistent_prototype(relational: Tensor, weights: Tensor) -> Tensor:
    """Eq. 12 restricted to the holders of the class: sum_k e_k r_k / sum_k e_k (a convex combination)."""
    w = weights.to(relational.dtype)
    return (w[:, None] * relational).sum(dim=0) / w.sum()


# ----- client side: Eqs. 13-15 -----------------------------------------------------------------------------


def u_normaliser(z: Tensor, bank: Tensor) -> Tensor:
    """Eq. 13: U(r) = mean_q ||z_q - r||_2 per prototype ([B, d], [P, d] -> [P]); detached, >= 1e-6."""
    return torch.cdist(z.detach(), bank.to(z.dtype)).mean(dim=0).clamp_min(U_MIN)


def rpcl_loss(
    z: Tensor,
    y: Tensor,
    bank: Tensor,
    bank_labels: Tensor,
    tau: float,
    u: Tensor | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    """Eq. 14 per sample ([B]): log sum_all exp(s/tau) - log sum_pos exp(s/tau), s = cos(z, r) / U(r) (13).

    Positives: the bank rows labelled y_i; negatives: all others. ``u`` None means U = 1. Every y_i needs at
    least one positive in the bank: the caller masks the other samples out, by indexing or with ``rows``
    (bool [B]; a sample outside it gets every row as a positive: exactly 0, no gradient; vmap-traceable).
    """
    s = F.cosine_similarity(z[:, None, :], bank[None, :, :].to(z.dtype), dim=2)
    if u is not None:
        s = s / u[None, :]
    logits = s / tau
    pos = bank_labels[None, :] == y[:, None]
    if rows is not None:
        pos = pos | ~rows[:, None]
    log_pos = torch.logsumexp(logits.masked_fill(~pos, -math.inf), dim=1)
    return torch.logsumexp(logits, dim=1) - log_pos


def official_rpcl_loss(z: Tensor, y: Tensor, bank: Tensor, bank_labels: Tensor, tau: float) -> Tensor:
    """[C]'s contrastive term per sample: the positive is z_i itself (logit 1/tau, no
    gradient); the negatives are the batch-wide pool, in which prototype r appears #{b : y_b != label(r)}
    times; plain cosine / tau (no U)."""
    mult = (bank_labels[None, :] != y[:, None]).sum(dim=0).to(z.dtype)  # [P]
    zd = z.detach()
    pos = F.cosine_similarity(z, zd, dim=1)[:, None] / tau  # = 1/tau, constant in z
    neg = (
        F.cosine_similarity(z[:, None, :], bank[None, :, :].to(z.dtype), dim=2) / tau + torch.log(mult)[None]
    )
    logits = torch.cat([pos, neg], dim=1)
    return torch.logsumexp(logits, dim=1) - logits[:, 0]


def cpdr_loss(z: Tensor, target: Tensor, dist: str) -> Tensor:
    """Eq. 15 per sample ([B]): "l1_sum" sum_q |z_q - o_q| [P]; "mse_mean" mean_q (z_q - o_q)^2 ([C] as
    intended); "self_mse" mean_q (z_q - z_q.detach())^2 = 0 with zero gradient ([C] as it runs: the target
    falls back to the features, ``target`` is ignored).

    ``target`` is detached (no gradient reaches the prototypes).
    """
    if dist == "self_mse":
        return (z - z.detach()).pow(2).mean(dim=1)
    diff = z - target.detach().to(z.dtype)
    if dist == "l1_sum":
        return diff.abs().sum(dim=1)
    if dist == "mse_mean":
        return diff.pow(2).mean(dim=1)
    raise ValueError(f"unknown cpdr_dist {dist!r}")


# ----- the algorithm ---------------------------------------------------------------------------------------

# the paper's options (Sec. 3.3-4.2): the ``paper`` and ``code_intended`` presets' algorithm part
_PAPER_OPTIONS: dict[str, Any] = {
    "tau": 0.05,
    "num_neighbors": 2,
    "rpcl_weight": 1.0,
    "cpdr_weight": 1.0,
    "cpdr_dist": "l1_sum",
    "use_u": True,
    "compat_official": False,
}
# the ``paper`` preset's values; ``code_intended`` changes only cpdr_dist
_PAPER_PRESET: dict[str, Any] = {
    **{f"algorithm.{k}": v for k, v in _PAPER_OPTIONS.items()},
    "local.lr": 0.01,
    "local.momentum": 0.9,
    "local.weight_decay": 1.0e-5,
    "local.epochs": 10,
    "local.batch_size": 64,
    "rounds": 100,
    "clients": 10,
}
# why the paper's presets leave protocol keys unset
_UNSET = {
    "participation": "the paper samples a random subset of clients each round, its fraction not given (the "
    "code: 5 of 10)",
    "model.name": "the experiment's (the paper's CNNs and ResNets per dataset)",
}


@ALGORITHMS.register("fedsc")
@dataclass
class FedSC(TwoFormLoss, FedAvg):
    """FedSC: CE + RPCL against relational prototypes + CPDR towards consistent prototypes."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("classes", "class_counts", "class_means")
    uploads: ClassVar[tuple[Upload, ...]] = CLASS_MEAN_UPLOADS

    tau: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.05  # RPCL temperature, [P] and [C]
    num_neighbors: Annotated[int, Field(ge=0)] = 2  # M of Eqs. 8-9, [P] (M = 2); [C] is effectively 0
    rpcl_weight: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0  # [P]/[C] 1; 0 turns RPCL off
    # Weight of CPDR: 1 in [P] and [C]; exposed because l1_sum is ~d x larger than mse_mean.
    # With l1_sum at 1, fmnist + Simple-CNN (d = 84) training collapsed (GA ~30%); 0.01 (~1/d) trains
    # (docs/results/fedsc.md).
    cpdr_weight: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    # "l1_sum": Eq. 15 [P]; "mse_mean": [C]'s mse_loss as intended; "self_mse": [C] as it runs (0)
    cpdr_dist: Literal["l1_sum", "mse_mean", "self_mse"] = "l1_sum"
    use_u: bool = True  # U(r) normaliser of Eq. 13 [P]; False: plain cosine as in [C]
    # Reproduce what [C] actually computes (module docstring); overrides the options above except the
    # weights and tau. For auditing only: CPDR is identically 0 there.
    compat_official: bool = False

    presets: ClassVar[dict[str, Preset]] = {
        "paper": Preset(
            "the paper: Eqs. 7-15 (L1-sum CPDR, U normaliser, M = 2, all weights 1), SGD lr 0.01, momentum "
            "0.9, weight decay 1e-5, E = 10, B = 64, 100 rounds, 10 clients",
            _PAPER_PRESET,
            _UNSET,
        ),
        "official": Preset(
            "the released code as it runs (compat_official; its CPDR target is the features, so CPDR is 0), "
            "SGD lr 0.1 without momentum or weight decay, E = 10, B = 64, 5 of 10 clients per round, 100 "
            "rounds",
            {
                "algorithm.compat_official": True,
                "algorithm.cpdr_dist": "self_mse",
                "algorithm.num_neighbors": 0,
                "algorithm.use_u": False,
                "algorithm.tau": 0.05,
                "algorithm.rpcl_weight": 1.0,
                "algorithm.cpdr_weight": 1.0,
                "local.lr": 0.1,
                "local.momentum": 0.0,
                "local.weight_decay": 0.0,
                "local.epochs": 10,
                "local.batch_size": 64,
                "clients": 10,
                "participation": 0.5,
                "rounds": 100,
            },
            {"model.name": _UNSET["model.name"]},
        ),
        "code_intended": Preset(
            "the paper preset with CPDR as the released code meant it: mean over dimensions of (z - o^y)^2 "
            "(mse_mean, about 1/d of Eq. 15's L1 sum), weight 1",
            {**_PAPER_PRESET, "algorithm.cpdr_dist": "mse_mean"},
            _UNSET,
        ),
    }

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """FedAvg's state plus an empty relational bank [0, d], consistent prototypes O [C, d], their mask; on
        the model's device."""
        server = super().init_server(model)
        d, c, device = int(model.feature_dim), self.ctx.num_classes, device_of(model)
        server["bank"] = torch.zeros(0, d, device=device)
        server["bank_labels"] = torch.zeros(0, dtype=torch.long, device=device)
        server["consistent"] = torch.zeros(c, d, device=device)
        server["known"] = torch.zeros(c, dtype=torch.bool, device=device)
        return server

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """(w_g, R, O) (Alg. 1): the same for every client; R holds every participant's R_k."""
        keys = ("model", "bank", "bank_labels", "consistent", "known")
        return {k: server[k] for k in keys}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """FedAvg's model average, then R (Eqs. 7-9) and O (Eqs. 10-12) from this round's prototypes."""
        server = super().aggregate(server, replies)
        server.update(self.build_prototypes(replies, server["consistent"].shape))
        return server

    def build_prototypes(self, replies: Sequence[Reply], shape: torch.Size) -> dict[str, Tensor]:
        """The bank (R, labels), O and the mask of classes with prototypes, from the replies' c_k^j, n_k^j; on
        the replies' device."""
        num_classes, dim = shape
        device = replies[0]["class_means"].device
        f64 = {"dtype": torch.float64, "device": device}
        counts = torch.zeros(len(replies), num_classes, **f64)
        protos = torch.zeros(len(replies), num_classes, dim, **f64)
        for k, r in enumerate(replies):
            counts[k, r["classes"]] = r["class_counts"].double()
            protos[k, r["classes"]] = r["class_means"].double()
        held = counts > 0
        n_k = torch.tensor([float(r["num_samples"]) for r in replies], **f64)
        e = discrepancy_weights(n_k, discrepancy(counts))
        m = 0 if self.compat_official else self.num_neighbors
        bank_rows: list[Tensor] = []
        bank_labels: list[Tensor] = []
        consistent = torch.zeros(num_classes, dim, **f64)
        for j in range(num_classes):
            holders = torch.nonzero(held[:, j]).flatten()
            if len(holders) == 0:
                continue
            rel = relational_prototypes(protos[holders, j], m)
            if self.compat_official:  # [C]: e indexed by position in the class's list, not renormalised
                consistent[j] = (e[: len(holders), None] * rel).sum(dim=0)
            else:
                consistent[j] = consistent_prototype(rel, e[holders])
            bank_rows.append(rel)
            bank_labels.append(torch.full((len(holders),), j, dtype=torch.long, device=device))
        if bank_rows:
            bank = torch.cat(bank_rows).float()
            labels = torch.cat(bank_labels)
        else:
            bank, labels = torch.zeros(0, dim, device=device), torch.zeros(0, dtype=torch.long, device=device)
        return {
            "bank": bank,
            "bank_labels": labels,
            "consistent": consistent.float(),
            "known": held.any(dim=0),
        }

    # ----- client -----
    def vectorize_blocker(self) -> str | None:
        if self.compat_official:
            return "FedSC with compat_official collects features during training"
        return super().vectorize_blocker()

    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """FedAvg's; compat_official: start collecting the last local epoch's training-mode features
        (``work.feature_sums``, from step ``work.collect_from`` on; ``work.step`` counts the steps)."""
        if self.compat_official:
            batches_per_epoch = math.ceil(data.num_samples / self.ctx.local.batch_size)
            work.collect_from = (self.ctx.local.epochs - 1) * batches_per_epoch
            work.step = 0
            work.feature_sums = ClassSums(data.num_classes, (int(model.feature_dim),), device=data.x.device)
        super().begin_local(model, data, work)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply, then c_k^j (Eq. 3) and n_k^j for the held classes.

        [P]: an eval-mode pass of the final local model over the (unaugmented) local data. compat_official:
        the means of the training-mode features of the last local epoch's forward passes ([C]).
        """
        reply, state = super().end_local(model, data, work, loss)
        if self.compat_official:
            classes, counts, means = work.feature_sums.held_means()
            reply.update({"classes": classes, "class_counts": counts, "class_means": means})
        else:
            reply.update(class_means_reply(model, data))
        return reply, state

    def loss_form(
        self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork, traceable: bool
    ) -> Tensor:
        """mean_i [CE_i + 1{y_i has prototypes} (rpcl_weight RPCL_i + cpdr_weight CPDR_i)] (Eqs. 14-16).
        ``traceable``: the samples of classes without prototypes masked instead of indexed out."""
        x, y = batch
        z = model.features(x)
        loss = F.cross_entropy(model.head(z), y)
        if self.compat_official:
            self._collect(work, z, y)
        payload = work.payload
        bank, bank_labels = payload["bank"], payload["bank_labels"]
        if len(bank_labels) == 0 or (self.rpcl_weight == 0.0 and self.cpdr_weight == 0.0):
            return loss  # round 1: no prototypes, pure CE
        if self.compat_official:
            return loss + self._official_terms(z, y, bank, bank_labels)
        valid = payload["known"][y]
        if traceable:  # every sample, the others weighted 0 (exactly 0 for RPCL, see rpcl_loss)
            zv, yv, rows, weight = z, y, valid, valid.to(z.dtype)
        elif not bool(valid.any()):
            return loss
        else:
            zv, yv, rows, weight = z[valid], y[valid], None, None
        extra = torch.zeros((), dtype=z.dtype, device=z.device)
        if self.rpcl_weight > 0.0:
            u = u_normaliser(z, bank) if self.use_u else None
            extra = extra + self.rpcl_weight * rpcl_loss(zv, yv, bank, bank_labels, self.tau, u, rows).sum()
        if self.cpdr_weight > 0.0:
            cpdr = cpdr_loss(zv, payload["consistent"][yv], self.cpdr_dist)
            extra = extra + self.cpdr_weight * (cpdr if weight is None else cpdr * weight).sum()
        return loss + extra / len(y)

    # ----- helpers -----
    def _official_terms(self, z: Tensor, y: Tensor, bank: Tensor, bank_labels: Tensor) -> Tensor:
        """[C]'s extra loss: the self-positive contrastive term plus mse(z, z.detach()) (= 0)."""
        extra = torch.zeros((), dtype=z.dtype, device=z.device)
        if self.rpcl_weight > 0.0:
            extra = extra + self.rpcl_weight * official_rpcl_loss(z, y, bank, bank_labels, self.tau).mean()
        if self.cpdr_weight > 0.0:
            extra = extra + self.cpdr_weight * F.mse_loss(z, z.detach())
        return extra

    @staticmethod
    def _collect(work: LocalWork, z: Tensor, y: Tensor) -> None:
        """compat_official: accumulate the training-mode features of the last local epoch per class (not
        outside a local update)."""
        if work.get("feature_sums") is None:
            return
        if work.step >= work.collect_from:
            work.feature_sums.add(y, z.detach().float())
        work.step += 1

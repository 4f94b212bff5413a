"""FedMR (Fan et al., "Federated Learning under Partially Class-Disjoint Data via Manifold Reshaping",
TMLR 2023): FedAvg with two feature-space regularisers, Eq. (5),

    L_k = CE + mu1 * l_intra (Eq. 3, decorrelation of each class's feature dimensions)
             + mu2 * l_inter (Eq. 4, hinge towards the own global class prototype).

Sources: [P] the paper (Sec. 3.3, Alg. 1, App. C), [C] the official code (MediaBrain-SJTU/FedMR). The official
code implements only the intra-class loss; everything about prototypes and l_inter follows [P] alone.

Protocol (Alg. 1; Sec. 3.3.2). After local training each client sends, for every class c it holds, the
mean feature g_k^c of its samples under the final local model (eval mode, no augmentation, no gradient)
and the count N_k^c; the server sets g_c = sum_k N_k^c g_k^c / sum_k N_k^c over the round's submitters
holding c (Sec. 3.3); a class nobody reported keeps its previous prototype (Alg. 1 leaves it open). In the
first round no prototype exists: nothing is broadcast and l_inter = 0. Prototypes are constants in the
local loss. Model weights are averaged with weights n_k (``weighting="samples"``, [P]: N_k / sum N) or
floor(n_k / B) (``"batches"``, [C]: ``len(train_dl)`` with drop_last=True; here the last partial batch is
still trained on); all-zero batch weights fall back to n_k.

Traffic: once prototypes exist the payload carries the C x d prototypes and a C-byte mask of the classes that
have one; a submitting client's reply carries |C_k| x d means, |C_k| class ids and |C_k| counts (int64).
Prototypes are exchanged only while l_inter is active (mu2 > 0 and ``lite_samples`` != 0): the intra-only
ablation sends exactly what FedAvg sends.

Backbone caveat (measured here, not in the paper): l_intra is computed on z = ``model.features``. On a ReLU
feature (Simple-CNN's default) a dimension that is zero for a whole class has no correlation and adds 0, so
the loss can also be lowered by switching dimensions off. ``model.feature_relu: false`` (Simple-CNN's z
before that ReLU) removes that shortcut (docs/results/fedmr.md). The paper's ResNet-18 feature is a global
average pool, where whole dimensions rarely switch off.

Ablations (Table 12): intra-only = ``mu2: 0``; inter-only = ``mu1: 0``; ``mu1 = mu2 = 0`` is FedAvg exactly.
Variants: Lite n (App. C.6, Table 11) = ``lite_samples: n``; prototype submission by a fixed random
fraction of the clients (Sec. 4.4, Table 5) = ``submit_fraction``.

Presets (``algorithm.preset``, ``FedMR.presets``): ``paper`` = Eq. (3)-(5) as printed (``intra_impl: paper``,
l_inter on the client's classes, aggregation by n_k) with the paper's optimizer (SGD lr 0.01, momentum 0.9,
weight decay 1e-5, E = 10, B = 128) and Table 9's FMNIST weights; ``official`` = the released code (l_intra
only, its normalisation, aggregation by batches, B = 64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd import seeds
from fedpcd.algorithms.common import ClassSums, aggregate_prototypes, class_means_reply
from fedpcd.algorithms.context import CLASS_MEAN_UPLOADS, ClientData, Upload
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import device_of, weighted_average
from fedpcd.algorithms.vectorizable import TwoFormLoss
from fedpcd.params import Preset

# ----- the two losses (Sec. 3.3.1, 3.3.2) -------------------------------------------------------------------


def intra_class_loss(
    z: Tensor, y: Tensor, impl: Literal["code", "paper"] = "code", eps: float = 1e-8
) -> Tensor:
    """Eq. (3) on one batch: for each class c of the batch with N_c >= 2, the correlation of z's dimensions.

    ``impl="paper"`` (Eq. 3): z_hat = (z - mu_c) / sqrt(var_biased + eps), M_c = z_hat^T z_hat / (N_c - 1),
    loss = mean over the counted classes of ||M_c||_F^2 (diagonal included:
    = (N/(N-1))^2 (d + sum_{i!=j} R_ij^2) with R the Pearson correlation matrix).
    ``impl="code"`` ([C] ``MR_loss``): z_hat = (z - mu_c) / sqrt(var_unbiased + eps), G_c = z_hat^T z_hat,
    L_c = mean of the d(d-1) off-diagonal G_ij^2, loss = sum_c L_c / sum_c N_c (the counted samples); this is
    about 1 for uncorrelated features, the scale the tuned mu1 of Table 9 assume (the paper's form is about
    d(d-1)/(N-1) times larger).
    Classes with one sample are skipped ([C]; [P]'s 1/(N-1) is undefined there); 0 if no class qualifies.
    ``eps`` keeps constant (e.g. dead-ReLU) dimensions finite.
    """
    d = z.shape[1]
    total = z.sum() * 0.0
    counted_classes, counted_samples = 0, 0
    if impl == "code" and d < 2:
        return total  # no off-diagonal entry
    for c in torch.unique(y).tolist():
        zc = z[y == c]
        n = zc.shape[0]
        if n < 2:
            continue
        centred = zc - zc.mean(dim=0, keepdim=True)
        if impl == "code":
            zh = centred / torch.sqrt(centred.pow(2).sum(dim=0) / (n - 1) + eps)
            g = zh.T @ zh
            off = g.pow(2).sum() - torch.diagonal(g).pow(2).sum()
            total = total + off / (d * (d - 1))
        elif impl == "paper":
            zh = centred / torch.sqrt(centred.pow(2).mean(dim=0) + eps)
            m = zh.T @ zh / (n - 1)
            total = total + m.pow(2).sum()
        else:
            raise ValueError(f"unknown intra impl {impl!r}")
        counted_classes += 1
        counted_samples += n
    if counted_classes == 0:
        return total
    return total / (counted_samples if impl == "code" else counted_classes)


def inter_class_loss(
    z: Tensor, y: Tensor, prototypes: Tensor, negatives: Tensor, eps: float = 1e-12
) -> Tensor:
    """l_inter of Eq. (4) on one batch, with per-class negative sets; prototypes are detached.

    d_n(c) = sqrt(|z_n - g_c|^2 + eps) (L2, not squared; eps avoids NaN gradients at z = g).
    D_{ci,cj} = (1/|B_ci|) sum_{n in B_ci} max(d_n(ci) - d_n(cj), 0) (zero margin), and the loss is the mean
    of D over the pairs (ci, cj) with ci a class of the batch and ``negatives[ci, cj]`` true; 0 if no pair.
    With every class of C_k in the batch and negatives = C_k x C_k minus the diagonal this is exactly
    1/(|C_k|(|C_k|-1)) sum_ci sum_cj D_{ci,cj}. ``negatives`` is a bool [C, C] matrix (row = anchor class),
    false wherever a prototype is missing and on the diagonal.
    """
    num_classes = prototypes.shape[0]
    g = prototypes.detach().to(z.dtype)
    dist = torch.sqrt((z[:, None, :] - g[None, :, :]).pow(2).sum(dim=2) + eps)  # [B, C]
    own = dist.gather(1, y[:, None])
    mask = negatives[y]  # [B, C]
    hinge = torch.relu(own - dist) * mask
    per_class = ClassSums(num_classes, (num_classes,), dtype=z.dtype, device=z.device, count_dtype=z.dtype)
    per_class.add(y, hinge)
    present = per_class.held
    pairs = negatives & present[:, None]
    if not bool(pairs.any()):
        return z.sum() * 0.0
    d_pairs = per_class.mean()
    return d_pairs[pairs[present]].sum() / pairs.sum()


def _one_hot(y: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """[B, C] float one-hot of ``y`` (vmap-friendly: a comparison, no data-dependent shape)."""
    return (y[:, None] == torch.arange(num_classes, device=y.device)).to(dtype)


def intra_class_loss_masked(
    z: Tensor, y: Tensor, num_classes: int, impl: Literal["code", "paper"] = "code", eps: float = 1e-8
) -> Tensor:
    """:func:`intra_class_loss` without data-dependent control flow (for ``torch.func.vmap``); equal up to
    float rounding. Class sums are one-hot products; ||G_c||_F^2 = sum_{i,j in c} (zh_i . zh_j)^2 (the
    Gram trick, [B, B] instead of C x [d, d]). A class with one sample has centred features 0, so it adds
    nothing (as the loop skips it); only the normalisers count the classes with N_c >= 2."""
    d = z.shape[1]
    if impl == "code" and d < 2:
        return z.sum() * 0.0
    if impl not in ("code", "paper"):
        raise ValueError(f"unknown intra impl {impl!r}")
    onehot = _one_hot(y, num_classes, z.dtype)  # [B, C]
    n = onehot.sum(dim=0)  # [C]
    mean = (onehot.T @ z) / n.clamp_min(1.0)[:, None]
    centred = z - onehot @ mean
    sq = onehot.T @ centred.pow(2)  # [C, d]
    var = sq / (n - 1.0).clamp_min(1.0)[:, None] if impl == "code" else sq / n.clamp_min(1.0)[:, None]
    zh = centred / (onehot @ torch.sqrt(var + eps))
    same = onehot @ onehot.T  # [B, B]: 1 where the two samples share a class
    gram_sq = (zh @ zh.T).pow(2) * same  # (zh_i . zh_j)^2 within classes
    counted = (n >= 2).to(z.dtype)  # [C]
    frob = onehot.T @ gram_sq.sum(dim=1)  # [C]: ||G_c||_F^2
    num_counted = counted.sum()
    if impl == "code":
        diag = (onehot.T @ zh.pow(2)).pow(2).sum(dim=1)  # [C]: sum_i G_c,ii^2
        total = ((frob - diag) * counted).sum() / (d * (d - 1))
        return total / (n * counted).sum().clamp_min(1.0)
    per_class = frob / (n - 1.0).clamp_min(1.0).pow(2)
    return (per_class * counted).sum() / num_counted.clamp_min(1.0)


def inter_class_loss_masked(
    z: Tensor, y: Tensor, prototypes: Tensor, negatives: Tensor, eps: float = 1e-12
) -> Tensor:
    """:func:`inter_class_loss` without data-dependent control flow (for ``torch.func.vmap``); equal up to
    float rounding (0 when no pair qualifies)."""
    num_classes = prototypes.shape[0]
    g = prototypes.detach().to(z.dtype)
    dist = torch.sqrt((z[:, None, :] - g[None, :, :]).pow(2).sum(dim=2) + eps)  # [B, C]
    own = dist.gather(1, y[:, None])
    onehot = _one_hot(y, num_classes, z.dtype)
    mask = (onehot @ negatives.to(z.dtype)) > 0  # negatives[y]
    hinge = torch.relu(own - dist) * mask
    counts = onehot.sum(dim=0)
    per_class = onehot.T @ hinge  # [C, C]
    pairs = (negatives & (counts > 0)[:, None]).to(z.dtype)
    return (per_class / counts.clamp_min(1.0)[:, None] * pairs).sum() / pairs.sum().clamp_min(1.0)


def negative_mask(known: Tensor, local: Tensor | None, mode: Literal["local", "all"]) -> Tensor:
    """[C, C] bool: negatives[ci, cj] for Eq. (4). "local" ([P] literal): cj in C_k; "all": any class with a
    prototype (what Sec. 3.3.2's motivation, support for the missing classes, implies). Both need prototypes
    for ci and cj; never cj = ci."""
    if mode not in ("local", "all"):
        raise ValueError(f"unknown inter negatives {mode!r}")
    if mode == "local" and local is None:
        raise ValueError('inter negatives "local" need the client\'s classes')
    allowed = known if mode == "all" else known & local
    c = known.shape[0]
    return known[:, None] & allowed[None, :] & ~torch.eye(c, dtype=torch.bool, device=known.device)


# ----- the algorithm ---------------------------------------------------------------------------------------


# the released code's argparse defaults (--mu 0.01, comm_round 100, n_parties = party_per_round = 10)
_OFFICIAL = {
    "algorithm.mu1": 1.0e-2,
    "algorithm.mu2": 0.0,
    "algorithm.intra_impl": "code",
    "algorithm.intra_eps": 1.0e-8,
    "algorithm.weighting": "batches",
    "local.lr": 0.01,
    "local.momentum": 0.9,
    "local.weight_decay": 1.0e-5,
    "local.epochs": 10,
    "local.batch_size": 64,
    "rounds": 100,
    "clients": 10,
    "participation": 1.0,
}


@ALGORITHMS.register("fedmr")
@dataclass
class FedMR(TwoFormLoss, FedAvg):
    """FedMR: CE + mu1 * intra-class decorrelation (Eq. 3) + mu2 * inter-class prototype hinge (Eq. 4)."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("classes", "class_counts", "class_means")
    uploads: ClassVar[tuple[Upload, ...]] = CLASS_MEAN_UPLOADS

    # Weight of l_intra, Eq. (5). Default 1e-2: Table 9, FMNIST (all splits); SVHN 1e-3, CIFAR-10/100 0.1.
    # On the "code" scale of ``intra_impl``. mu1 = 0 is the inter-only ablation (Table 12).
    mu1: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0e-2
    # Weight of l_inter, Eq. (5). Default 1e-4: Table 9, FMNIST and SVHN (all splits); CIFAR-10 1e-3/1e-4.
    # mu2 = 0 is the intra-only ablation (no prototypes exchanged).
    mu2: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0e-4
    # Normalisation of l_intra: "code" = [C] MR_loss (unbiased std, off-diagonal mean, divided by
    # the counted samples; the scale the tuned mu1 assume); "paper" = [P] Eq. (3) (biased std, 1/(N-1), full
    # Frobenius norm, mean over classes; about d(d-1)/(N-1) larger).
    intra_impl: Literal["code", "paper"] = "code"
    # Variance guard of l_intra: [C]'s 1e-8 (for both impls; [P] has none).
    intra_eps: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0e-8
    # Negative classes cj of Eq. (4): "local" = the client's classes C_k ([P], literal Eq. 4);
    # "all" = every class with a global prototype (Sec. 3.3.2's motivation). The anchor's own class is
    # never a negative.
    inter_negatives: Literal["local", "all"] = "local"
    # Lite variant (App. C.6, Table 11): l_inter on n random samples of each mini-batch (None: all samples;
    # 0: no l_inter, i.e. intra-only). Samples are drawn from a generator derived from the client's.
    lite_samples: Annotated[int, Field(ge=0)] | None = None
    # Fraction of clients that submit prototypes (Sec. 4.4, Table 5: 0.5, 0.8, 1.0). The submitters are a
    # random round(fraction * K) clients fixed at the start from the run seed; only theirs are aggregated.
    submit_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    # Aggregation weights: n_k ("samples", [P]) or floor(n_k / B) ("batches", [C] with drop_last=True).
    weighting: Literal["samples", "batches"] = "samples"

    presets: ClassVar[dict[str, Preset]] = {
        "paper": Preset(
            "the paper: Eq. (3) as printed, l_inter against the client's classes (Eq. 4), weights by n_k, "
            "Table 9's FMNIST mu1 1e-2 and mu2 1e-4, SGD lr 0.01, momentum 0.9, weight decay 1e-5, E = 10, "
            "B = 128, Table 1's 100 rounds with every client",
            {
                "algorithm.mu1": 1.0e-2,
                "algorithm.mu2": 1.0e-4,
                "algorithm.intra_impl": "paper",
                "algorithm.inter_negatives": "local",
                "algorithm.weighting": "samples",
                "local.lr": 0.01,
                "local.momentum": 0.9,
                "local.weight_decay": 1.0e-5,
                "local.epochs": 10,
                "local.batch_size": 128,
                "rounds": 100,
                "participation": 1.0,
            },
            {
                "clients": "Table 1 runs P5 and P10 (5 or 10 clients, all participating); Table 2 P50 and "
                "P100 with 10 per round and 200-400 rounds",
                "model.name": "the experiment's: SimpleCNN or ResNet-18 (WRN-28-10 for CIFAR-100)",
            },
        ),
        "official": Preset(
            "the released code: l_intra only (it has no l_inter, so mu2 0) with its normalisation, weights "
            "floor(n_k / B), SGD lr 0.01, momentum 0.9, weight decay 1e-5, E = 10, B = 64; its argparse "
            "defaults' 100 rounds of all 10 clients",
            _OFFICIAL,
            {"model.name": "its default simple-cnn (MOON's): the experiment's choice, as in the paper"},
        ),
        "official_readme": Preset(
            "the official preset as the released code's README command runs it: --mu=0.00001 (mu1 1e-5, "
            "1000x below the argparse default 0.01), 100 rounds, 50 clients, 10 per round (its Dirichlet "
            "beta 0.5 partition and ResNet-18 are the experiment's, not the preset's)",
            {**_OFFICIAL, "algorithm.mu1": 1.0e-5, "clients": 50, "participation": 0.2},
            {"model.name": "the command's resnet18: set it where the data fit"},
        ),
    }

    @property
    def uses_prototypes(self) -> bool:
        """Whether l_inter can be active (mu2 > 0 and not Lite 0), i.e. whether prototypes are exchanged."""
        return self.mu2 > 0.0 and self.lite_samples != 0

    def upload_bounds(self) -> tuple[Upload, ...]:
        """No class statistics where no prototypes are exchanged (``uses_prototypes`` false)."""
        return self.uploads if self.uses_prototypes else ()

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """FedAvg's state plus prototypes (C x d zeros, none known yet) and the fixed submitter mask (drawn on
        the CPU, the same on every device), on the model's device."""
        server = super().init_server(model)
        if not self.uses_prototypes:
            return server
        c, k, device = self.ctx.num_classes, self.ctx.num_clients, device_of(model)
        server["prototypes"] = torch.zeros(c, int(model.feature_dim), device=device)
        server["known"] = torch.zeros(c, dtype=torch.bool, device=device)
        m = min(k, max(1, round(self.submit_fraction * k)))
        g = seeds.generator(seeds.fedmr_submitters(self.ctx.seed))
        submitters = torch.zeros(k, dtype=torch.bool, device=device)
        submitters[torch.randperm(k, generator=g)[:m].to(device)] = True
        server["submitters"] = submitters
        return server

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """(w^t, G^t) (Alg. 1); G^t only once some prototype exists (never in the first round)."""
        payload = super().payload_for(server, client_id)
        if self.uses_prototypes:
            payload["submit"] = bool(server["submitters"][client_id])
            if bool(server["known"].any()):
                payload["prototypes"] = server["prototypes"]
                payload["known"] = server["known"]
        return payload

    def aggregation_weights(self, replies: Sequence[Reply]) -> list[float]:
        """p_k before normalisation: n_k ("samples") or floor(n_k / B) ("batches"; n_k if all are 0)."""
        samples = [float(r["num_samples"]) for r in replies]
        if self.weighting == "samples":
            return samples
        batches = [float(int(n) // self.ctx.local.batch_size) for n in samples]
        return batches if sum(batches) > 0 else samples

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """The model average by ``aggregation_weights``; prototypes by ``aggregate_prototypes`` (by counts,
        submitters only)."""
        server["model"] = weighted_average([r["model"] for r in replies], self.aggregation_weights(replies))
        if self.uses_prototypes:
            server["prototypes"], server["known"] = aggregate_prototypes(
                server["prototypes"], server["known"], replies
            )
        return server

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Alg. 1 client, before its E epochs on Eq. (5): the classes the client holds (``work.local``) and,
        for the Lite variant, the generator of its picks (``work.lite_rng``); the loss sees the payload
        without ``submit`` (only ``end_local`` reads it)."""
        work.local = data.label_counts > 0
        if self.uses_prototypes and self.lite_samples is not None:
            work.lite_rng = seeds.generator(seeds.fedmr_lite(work.rng.initial_seed()))
        super().begin_local(model, data, work)
        work.payload = {k: v for k, v in work.payload.items() if k != "submit"}

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply plus, if a submitter, the class means of the final model (Alg. 1)."""
        reply, state = super().end_local(model, data, work, loss)
        if self.uses_prototypes and work.received.get("submit", False):
            reply.update(class_means_reply(model, data))
        return reply, state

    def vectorize_blocker(self) -> str | None:
        """The Lite variant draws samples inside the loss, which vmap cannot reproduce per client."""
        reason = super().vectorize_blocker()
        if reason is None and self.uses_prototypes and self.lite_samples is not None:
            return "FedMR's Lite variant (lite_samples) draws random samples inside the loss"
        return reason

    def loss_form(
        self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork, traceable: bool
    ) -> Tensor:
        """Eq. (5): CE + mu1 l_intra + mu2 l_inter (l_inter = 0 while no prototype exists);
        ``traceable``: the masked forms of l_intra and l_inter."""
        payload = work.payload
        inter_on = self.uses_prototypes and "prototypes" in payload
        if self.mu1 == 0.0 and not inter_on:
            return FedAvg.loss(self, model, batch, work)  # plain cross-entropy, bit for bit
        x, y = batch
        z = model.features(x)
        total = F.cross_entropy(model.head(z), y)
        if self.mu1 > 0.0:
            if traceable:
                intra = intra_class_loss_masked(z, y, self.ctx.num_classes, self.intra_impl, self.intra_eps)
            else:
                intra = intra_class_loss(z, y, self.intra_impl, self.intra_eps)
            total = total + self.mu1 * intra
        if inter_on:
            neg = negative_mask(payload["known"], work.local, self.inter_negatives)
            if traceable:
                return total + self.mu2 * inter_class_loss_masked(z, y, payload["prototypes"], neg)
            zi, yi = z, y
            if self.lite_samples is not None and self.lite_samples < len(y):
                pick = torch.randperm(len(y), generator=work.lite_rng)[: self.lite_samples]
                zi, yi = z[pick], y[pick]
            total = total + self.mu2 * inter_class_loss(zi, yi, payload["prototypes"], neg)
        return total

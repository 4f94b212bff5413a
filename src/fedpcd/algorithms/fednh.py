"""FedNH (Dai et al., "Tackling Data Heterogeneity in FL with Class Prototypes", AAAI 2023).

The classifier is a matrix of class prototypes P (C x d, unit rows) held by the server, initialised
uniformly on the hypersphere (Sec. 3.2, Eq. 1) and sent in every payload. Clients train only the body
(and a scalar scale s) against the *frozen* prototypes with cosine logits s * <P_c, z/|z|> (Eq. 2), then
report per-class means of their normalised features (Eq. 3). The server averages body and s, and moves the
prototypes towards the clients' class means with smoothing rho, renormalising each row (Eq. 4, Alg. 1
lines 7-8). The personal model is the client's latest local body and s with the prototypes it trained
against; the global model is the averaged body and s with the updated prototypes (Sec. 4.1, Alg. 1).

Sources: [P] the paper, [C] the official code (Yutong-Dai/FedNH). Options follow [P] unless their comment
says otherwise; every option says which source it follows. ``rho = 1`` is FedUH (fixed uniform head, a [C]
variant).
The model's ``head`` (nn.Linear) is never used, trained or sent.

Presets (``algorithm.preset``, ``FedNH.presets``), both with the shared protocol of [P] and [C] (100 clients,
10% per round, E = 5, B = 64, SGD lr 0.01 x 0.99 per round, momentum 0.9, weight decay 1e-5, s trainable from
1.0): ``paper`` = Eq. (1)'s simplex init, App. A.2's uniform prototype weights, class means of the raw samples
(Eq. 3); ``official`` = [C]'s orthogonal init, count-weighted unit means, augmented means and its
gradient-norm clip 10.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd import seeds
from fedpcd.algorithms.common import ClassSums
from fedpcd.algorithms.context import ClientData, Upload, made_public
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Predictor, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.readout import Readout
from fedpcd.algorithms.statedict import (
    backbone_parameters,
    clone_state,
    device_of,
    load_backbone,
    weighted_average,
)
from fedpcd.errors import UserError
from fedpcd.models import backbone_keys
from fedpcd.params import Preset

EPS = 1e-12  # the norm guard of [C] (F.normalize's default)


# ----- prototype initialisation (Sec. 3.2, Eq. 1) --------------------------------------------------------


def _orthonormal_columns(d: int, k: int, generator: torch.Generator) -> Tensor:
    """A Haar-random d x k matrix with orthonormal columns (QR of a Gaussian, signs fixed), float64."""
    q, r = torch.linalg.qr(torch.randn(d, k, generator=generator, dtype=torch.float64))
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs


def simplex_prototypes(num_classes: int, dim: int, generator: torch.Generator) -> Tensor:
    """The regular simplex, the exact optimum of Eq. (1) when dim >= C - 1, randomly rotated.

    Rows of E = I - 11^T/C, normalised, have pairwise cosine -1/(C-1); they span the (C-1)-dim subspace
    orthogonal to 1. With U an orthonormal basis of that subspace and Q (dim x (C-1)) random orthonormal
    columns, W = normalize(E) U Q^T keeps every inner product and lives in R^dim. On the generator's device.
    """
    c = num_classes
    if dim < c - 1:
        raise ValueError(f"a regular simplex of {c} vertices needs dim >= {c - 1}, got {dim}")
    if c == 1:
        return F.normalize(torch.randn(1, dim, generator=generator, dtype=torch.float64)).float()
    e = torch.eye(c, dtype=torch.float64, device=generator.device) - 1.0 / c
    e = e / e.norm(dim=1, keepdim=True)
    u = torch.linalg.svd(e).U[:, : c - 1]  # E is a rank C-1 projection: its top C-1 singular vectors
    w = (e @ u) @ _orthonormal_columns(dim, c - 1, generator).T
    return F.normalize(w, dim=1).float()


def orthogonal_prototypes(num_classes: int, dim: int, generator: torch.Generator) -> Tensor:
    """[C]'s ``FedNH_head_init: orthogonal``: C orthonormal rows (cosine 0; needs C <= dim)."""
    if num_classes > dim:
        raise ValueError(f"{num_classes} orthogonal prototypes need dim >= {num_classes}, got {dim}")
    return _orthonormal_columns(dim, num_classes, generator).T.contiguous().float()


def optimized_prototypes(
    num_classes: int, dim: int, generator: torch.Generator, steps: int = 3000, lr: float = 0.01
) -> Tensor:
    """A numerical solution of Eq. (1) for any dim (the fallback): minimise the largest pairwise cosine.

    Maximising the minimum distance M is minimising the maximum cosine (M^2 = 2 - 2 max cos). Rows are
    W = normalize(V), so they stay on the sphere; Adam (learning rate cosine-annealed from ``lr``) minimises
    the smooth max (1/t) log sum_{i<j} exp(t cos_ij) while the temperature t grows from 10 to 1e4, and V is
    renormalised after every step. Seeded, float64. Reaches the known optima of small cases (hexagon,
    tetrahedron, octahedron, icosahedron, Tammes' 10 points in 3-D; tests/test_fednh.py).
    """
    c = num_classes
    if c == 1:
        return F.normalize(torch.randn(1, dim, generator=generator, dtype=torch.float64)).float()
    v = torch.randn(c, dim, generator=generator, dtype=torch.float64).requires_grad_(True)
    opt = torch.optim.Adam([v], lr=lr)
    iu = torch.triu_indices(c, c, offset=1, device=v.device)
    for step in range(steps):
        progress = step / max(steps - 1, 1)
        t = 10.0 * 1000.0**progress
        opt.param_groups[0]["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * progress)) + 1e-5
        w = F.normalize(v, dim=1)
        cos = (w @ w.T)[iu[0], iu[1]]
        loss = torch.logsumexp(t * cos, dim=0) / t
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            v.copy_(F.normalize(v, dim=1))  # |V| = 1 keeps Adam's step size meaningful on the sphere
    return F.normalize(v.detach(), dim=1).float()


def init_prototypes(method: str, num_classes: int, dim: int, seed: int) -> Tensor:
    """W^0 (C x dim, unit rows) by ``method``; the same seed gives the same W^0 everywhere (computed on the
    CPU: the caller moves it to its device)."""
    g = torch.Generator().manual_seed(seed)
    if method == "simplex":
        if dim >= num_classes - 1:
            return simplex_prototypes(num_classes, dim, g)
        return optimized_prototypes(num_classes, dim, g)
    if method == "optimize":
        return optimized_prototypes(num_classes, dim, g)
    if method == "orthogonal":
        if num_classes > dim:
            raise UserError(
                f"fednh init='orthogonal' needs feature_dim >= num_classes ({dim} < {num_classes}); "
                "use init='simplex' or init='optimize'"
            )
        return orthogonal_prototypes(num_classes, dim, g)
    raise ValueError(f"unknown prototype init {method!r}")


def max_pairwise_cosine(w: Tensor) -> float:
    """max_{i != j} <w_i, w_j> / (|w_i| |w_j|) (the quantity Eq. (1) minimises)."""
    w = F.normalize(w.double(), dim=1)
    g = w @ w.T
    g.fill_diagonal_(-math.inf)
    return float(g.max())


# ----- the model pieces (Sec. 3.2, Eq. 2) ----------------------------------------------------------------


def cosine_logits(z: Tensor, prototypes: Tensor, scale: Tensor | float) -> Tensor:
    """Eq. (2): logits_j = s * <P_j/|P_j|, z/|z|> (both normalised with the 1e-12 guard of [C])."""
    return scale * F.normalize(z, dim=1, eps=EPS) @ F.normalize(prototypes, dim=1, eps=EPS).T


@torch.no_grad()
def class_feature_means(
    model: nn.Module, data: ClientData, augmented: bool = False, rng: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. (3) with the final local body, in eval mode: (held classes, counts n_c, means mu_c of r = z/|z|).

    ``augmented`` passes the samples through the train-time augmentation first, as [C] does.
    """
    was_training = model.training
    model.eval()
    sums = ClassSums(data.num_classes, (model.feature_dim,), device=data.x.device)
    if augmented:
        if rng is None:
            raise ValueError("augmented class means need the client's generator")
        batches: Iterable[tuple[Tensor, Tensor]] = data.batches(512, rng, training=False)
    else:
        idx = data.train_idx
        batches = ((data.x[idx[i : i + 512]], data.y[idx[i : i + 512]]) for i in range(0, len(idx), 512))
    for xb, yb in batches:
        sums.add(yb, F.normalize(model.features(xb), dim=1, eps=EPS))
    model.train(was_training)
    return sums.held_means()


# ----- the algorithm ---------------------------------------------------------------------------------------


# the protocol both presets share (the paper's Sec. 4 setting, which the released code runs too)
_PROTOCOL = {
    "algorithm.rho": 0.9,
    "algorithm.learn_scale": True,
    "algorithm.scale_init": 1.0,
    "algorithm.body_weighting": "uniform",
    "local.lr": 0.01,
    "local.lr_decay": 0.99,
    "local.momentum": 0.9,
    "local.weight_decay": 1.0e-5,
    "local.epochs": 5,
    "local.batch_size": 64,
    "clients": 100,
    "participation": 0.1,
    "rounds": 200,
}
# why neither preset sets the model
_MODEL = {
    "model.name": "the dataset's: conv2cifar for CIFAR-10/100, ResNet-18 with GroupNorm for Tiny-ImageNet"
}


@ALGORITHMS.register("fednh")
@dataclass
class FedNH(FedAvg):
    """FedNH: frozen hyperspherical prototypes as the classifier, updated on the server from class means."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("scale", "classes", "class_means", "class_counts")
    uploads: ClassVar[tuple[Upload, ...]] = (
        Upload("scale", "model", "the trained scale s, averaged with the body (Alg. 1 line 9)"),
        Upload("classes", "classes", "the held classes the class means belong to"),
        Upload("class_means", "rows", "the class means of the normalised features (Eq. 3)"),
        Upload("class_counts", "counts", "n_k^c, the count weights of proto_weighting count_code"),
    )

    # Smoothing of the prototype update, Eq. (4); 0.9 in [P] App. A.2 and [C]. rho = 1: FedUH ([C]).
    rho: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9
    # W^0. "simplex": Eq. (1)'s optimum [P] -- the exact regular simplex when feature_dim >= C-1, else
    # the numerical max-separation solution ("optimize"); "orthogonal": [C]'s orthonormal rows.
    init: Literal["simplex", "optimize", "orthogonal"] = "simplex"
    # Prototype aggregation. "count_code" [C], the default (the released code's rule): clients send unit
    # class means and class counts; m_c = sum_k n_kc mu_kc/|mu_kc| / sum_k n_kc, normalised before the
    # smoothing. "uniform_paper" [P] App. A.2: alpha_k = 1/|S|, raw means, zeros for clients without c.
    proto_weighting: Literal["count_code", "uniform_paper"] = "count_code"
    # s^0: [C] uses 1.0 for the CNN and 20.0 for ResNet18; [P] names 30 for a fixed s.
    scale_init: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    learn_scale: bool = True  # s trainable and averaged with the body, [P] App. A.2 / [C]; False: s fixed
    # Body (and s) aggregation: "uniform" = (1/|S|) sum_k theta_k, [P] Alg. 1 line 9 and [C];
    # "samples" = weighted by n_k like the library's FedAvg.
    body_weighting: Literal["uniform", "samples"] = "uniform"
    # Class means over augmented training samples, as [C] does (eval mode, train-time augmentation);
    # False follows [P] Eq. (3) (r_i = f(theta; x_i)). Only matters for datasets with augmentation.
    means_augmented: bool = False

    presets: ClassVar[dict[str, Preset]] = {
        "paper": Preset(
            "the paper: simplex init (Eq. 1), uniform prototype weights (App. A.2), means of raw samples "
            "(Eq. 3); 100 clients, 10% per round, 200 rounds, E = 5, B = 64, SGD lr 0.01 x 0.99 per round, "
            "momentum 0.9, weight decay 1e-5, s trainable from 1.0, no gradient clipping",
            {
                "algorithm.init": "simplex",
                "algorithm.proto_weighting": "uniform_paper",
                "algorithm.means_augmented": False,
                **_PROTOCOL,
                "local.grad_clip": None,
            },
            _MODEL,
        ),
        "official": Preset(
            "the released code: orthogonal init, count-weighted unit class means, means over augmented "
            "samples, gradient-norm clip 10; otherwise the paper preset's protocol",
            {
                "algorithm.init": "orthogonal",
                "algorithm.proto_weighting": "count_code",
                "algorithm.means_augmented": True,
                **_PROTOCOL,
                "local.grad_clip": 10.0,
            },
            _MODEL,
        ),
    }

    def upload_bounds(self) -> tuple[Upload, ...]:
        """With ``learn_scale`` false s is sent back as received: public, not averaged; ``uniform_paper``
        uploads no counts."""
        uploads = list(self.uploads)
        if not self.learn_scale:
            uploads = list(made_public(uploads, "scale", "s^0 sent back unchanged: the server's own value"))
        if self.proto_weighting == "uniform_paper":
            uploads = [u for u in uploads if u.key != "class_counts"]
        return tuple(uploads)

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """Body from the seeded model, P^0 (Eq. 1) from the run seed, s^0 = ``scale_init``; on the model's
        device."""
        prototypes = init_prototypes(
            self.init, self.ctx.num_classes, model.feature_dim, seeds.fednh_prototypes(self.ctx.seed)
        )
        device = device_of(model)
        return {
            "model": clone_state(model, backbone_keys(model)),
            "prototypes": prototypes.to(device),
            "scale": torch.tensor(float(self.scale_init), device=device),
        }

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """(theta^t, s^t, W^t) (Alg. 1 line 2)."""
        return {"model": server["model"], "prototypes": server["prototypes"], "scale": server["scale"]}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """Alg. 1 lines 7-9: body and s averaged (``body_weighting``), prototypes by ``update_prototypes``."""
        if self.body_weighting == "uniform":
            weights = [1.0] * len(replies)
        else:
            weights = [float(r["num_samples"]) for r in replies]
        server["model"] = weighted_average([r["model"] for r in replies], weights)
        if self.learn_scale:
            scales = [{"s": r["scale"]} for r in replies]
            server["scale"] = weighted_average(scales, weights)["s"]
        server["prototypes"] = self.update_prototypes(server["prototypes"], replies)
        return server

    def update_prototypes(self, prototypes: Tensor, replies: Sequence[Reply]) -> Tensor:
        """Eq. (4) + Alg. 1 line 8: W_c <- normalize(rho W_c + (1 - rho) m_c) for classes some client holds.

        m_c per ``proto_weighting``; a class no participant holds keeps its prototype exactly.
        """
        if self.rho == 1.0 or not replies:
            return prototypes
        f64 = {"dtype": torch.float64, "device": prototypes.device}
        sums = ClassSums(prototypes.shape[0], prototypes.shape[1:], **f64, count_dtype=torch.float64)
        for r in replies:
            cls, means = r["classes"], r["class_means"].double()
            if self.proto_weighting == "count_code":
                sums.add(cls, F.normalize(means, dim=1, eps=EPS), weights=r["class_counts"].double())
            else:
                sums.add(cls, means / len(replies))
        agg, held = sums.sums[0], sums.held
        if self.proto_weighting == "count_code":
            agg[held] = F.normalize(sums.mean(), dim=1, eps=EPS)
        new = prototypes.double().clone()
        new[held] = F.normalize(self.rho * new[held] + (1.0 - self.rho) * agg[held], dim=1, eps=EPS)
        return new.to(prototypes.dtype)

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """GM = (theta^{t+1}, s^{t+1}, W^{t+1}) (Alg. 1)."""
        load_backbone(model, server["model"])
        tensors = {"prototypes": server["prototypes"], "scale": server["scale"]}
        return Readout(model, prototype_logits, tensors, head=prototype_head)

    # ----- client -----
    # ClientUpdate (Alg. 1 lines 11-15) is FedAvg's local_update: ``begin_local``, E epochs on Eq. (2) with
    # P frozen, then ``end_local``.
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Load the body (the model's linear head is never used); this client's working scale s
        (``work.scale``, trainable iff ``learn_scale``)."""
        load_backbone(model, work.payload["model"])
        work.scale = work.payload["scale"].detach().clone().requires_grad_(self.learn_scale)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """Alg. 1 line 14-15: the body, s and the class means (3) of the trained body."""
        classes, counts, means = class_feature_means(model, data, self.means_augmented, work.rng)
        reply: Reply = {
            "model": clone_state(model, backbone_keys(model)),
            "scale": work.scale.detach().clone(),
            "num_samples": data.num_samples,
            "train_loss": loss,
            "classes": classes,
        }
        if self.proto_weighting == "count_code":  # [C]: unit means + counts (reveals n_kc)
            reply["class_means"] = F.normalize(means, dim=1, eps=EPS)
            reply["class_counts"] = counts
        else:  # [P]: the means of Eq. (3) only
            reply["class_means"] = means
        return reply, work.state

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """Eq. (2): cross-entropy of the cosine logits against the frozen prototypes W^t."""
        x, y = batch
        return F.cross_entropy(cosine_logits(model.features(x), work.payload["prototypes"], work.scale), y)

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """The body and s; never the prototypes (frozen, Sec. 3.2) and never the unused linear head."""
        params = backbone_parameters(model)
        return [*params, work.scale] if self.learn_scale else params

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """Latest local body and s_k with W^t, the prototypes it trained against (Sec. 4.1), not W^{t+1}."""
        tensors = {"prototypes": work.received["prototypes"], "scale": work.scale.detach()}
        return Readout(model, prototype_logits, tensors, head=prototype_head)


def prototype_logits(model: nn.Module, x: Tensor, tensors: dict[str, Tensor]) -> Tensor:
    """Eq. (2)'s cosine logits of the body's features against ``tensors``' prototypes and scale."""
    return prototype_head(model.features(x), tensors)


def prototype_head(features: Tensor, tensors: dict[str, Tensor]) -> Tensor:
    return cosine_logits(features, tensors["prototypes"], tensors["scale"])

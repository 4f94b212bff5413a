"""FedGELA (Fan et al., NeurIPS 2023, "Federated Learning with Bilateral Curation for Partially Class-Disjoint
Data"), section 3.3 and Algorithm 1. Also its ablation FedGE (phi = 1, Table 4).

The classifier is a fixed simplex ETF M in R^{d x C} (never trained, never aggregated). It is **G**lobally the
plain ETF and **L**ocally **A**dapted: client k scales column c by phi_{k,c} = C n_{k,c} / n_k (Eq. 4). Only
the backbone (plus the optional projection / BatchNorm tensors) is trained and averaged; the model's own
``head`` is never used, sent or loaded.

Paper vs official code (each a field; the paper is the default except for ``scale``; the measurements behind
the defaults are in docs/results/fedgela.md):

- ``scale`` s: logits are ``s * phi_{k,c} * m_c^T h_hat``. Paper: s = sqrt(E_W), E_W tuned over 1e3..1e6
  (Fig. 4), i.e. s ~ 32..1000. Code: s = 1/temperature, argparse default tau = 0.2 (s = 5), README 1e-5.
  Default 2, from neither source: with L2-normalised features the local logits reach s * phi ~ s * C/|C_k|
  (25 for s = 5 on a 2-class client) and saturate.
- ``normalize``: ``l2`` = h / ||h||_2 (paper, E_H = 1); ``bn`` = BatchNorm1d with affine, no L2 (code's
  ``etf`` proxy); ``bn_l2`` = BatchNorm1d then L2 (code's ``l2norm`` proxy).
- ``projection``: ``fc`` = one Linear(feature_dim, proj_dim) after the backbone (paper App. C.1, the
  default); ``mlp`` = Linear(feature_dim, feature_dim)-ReLU-Linear(feature_dim, proj_dim) (code); ``none`` =
  the model's features are h. ``proj_dim`` None = feature_dim. The ETF has d = proj_dim rows (paper: 84 for
  SVHN/CIFAR-10, 512 for CIFAR-100); d >= C is required. Without a projection, a ReLU backbone's h is
  non-negative and cannot align with every ETF column (the first column of ``simplex_etf`` is nearly all
  negative, the QR of a positive matrix), so class 0 can hardly win the argmax.
- ``softmax``: ``local`` = Eq. 5, normalised over the client's classes C_k only (paper); ``all`` = over all C
  classes, missing classes entering with logit 0 (code). On a two-class client Eq. 5 sees h only through
  (m_a - m_b)^T h; with ``all`` the zero logits of missing classes also pull h towards m_y, which the global
  argmax over every column needs. With either loss a missing class's logit is constant (phi = 0), so nothing
  pushes h away from the columns of classes the client lacks (the paper's "space of missing classes used by
  existing ones", Fig. 3c); FedGE (phi = 1, every column in the loss) does.
- ``q``: phi = C * Q(n_{k,c}/n_k) / sum_c Q(n_{k,c}/n_k) with Q in {``x`` (paper default), ``exp``,
  ``sqrt``} (paper Table 6). For Q(x) = x this is exactly Eq. 4 with gamma = 1/C. The non-linear variants
  are normalised per client so that sum_c phi_{k,c} = C like the linear one (the mean column scale stays 1,
  so ``scale`` keeps its meaning) without any shared statistics (phi never leaves the client). Only Q(x) = x
  keeps the design rule sum_k p_k phi_k = 1 on a balanced federation. Q is applied to every class, so
  ``exp`` gives missing classes a non-zero phi (Q(0) = 1); with ``softmax=local`` they still never enter the
  loss, and personal prediction never picks them.
- ``weighting``: aggregation weights n_k (``samples``, paper) or floor(n_k / B) (``batches``, code, which uses
  drop_last=True; here the last partial batch is still trained on). All-zero weights fall back to n_k.
- Gradient clipping: the code clips the global gradient norm to 20 every step; the paper never mentions it.
  Set the engine's ``local.grad_clip: 20`` for code parity (it covers the projection tensors too).

Protocol: the server builds M in ``init_server`` from the stream ``fedpcd.seeds.fedgela_etf`` and sends it
with the backbone every round (stateless; for a C-class model it costs about what FedAvg's head costs, which
FedGELA never sends). phi_k is recomputed from the client's train label counts at each local update and kept
in the client state together with the class-presence mask (and, with a projection or BatchNorm, the locally
trained projection tensors) because ``personal_predictor`` needs them.

Presets (``algorithm.preset``, ``FedGELA.presets``): ``paper`` = every option as printed (L2-normalised
features, one FC projection, Eq. 5's local softmax, Q(x) = x, weights n_k) with a paper-range length s = 32
(E_W = 1e3, the low end of Fig. 4's 1e3..1e6) and the paper's optimizer (SGD lr 0.01, momentum 0.9, weight
decay 1e-4, E = 10, B = 100); ``official`` = the released code (s = 5 from tau 0.2, BatchNorm features, the
2-layer MLP projection, softmax over all classes, weights floor(n_k / B), gradient-norm clip 20, B = 64).

Inference (Sec. 3.3, Alg. 1): global = argmax_c m_c^T h_hat on the aggregated backbone; personal = argmax_c
phi_{k,c} m_c^T h_hat on the locally trained backbone, with classes absent from the client's training data
set to -inf. The code takes the argmax over all C classes with logit 0 for missing ones, so it can predict
a missing class whenever every present class has a negative logit; here it never can.
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
from fedpcd.algorithms.common import linear_init
from fedpcd.algorithms.context import ClientData, Upload
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
from fedpcd.params import Needs, Preset

BN_MOMENTUM = 0.1  # torch's BatchNorm1d default (the code's)
BN_EPS = 1e-5
L2_EPS = 1e-12

StateDict = dict[str, Tensor]


def simplex_etf(dim: int, num_classes: int, generator: torch.Generator) -> Tensor:
    """M = sqrt(C/(C-1)) U (I - 11^T/C), U in R^{d x C} orthonormal (Sec. 3.1): unit columns, pairwise cosine
    -1/(C-1), columns summing to 0, rank C-1. U is the reduced QR of a Uniform[0,1) matrix (as the code),
    computed on the generator's device."""
    if num_classes < 2:
        raise UserError(f"FedGELA's simplex ETF needs at least 2 classes, got {num_classes}")
    if dim < num_classes:
        raise UserError(
            f"FedGELA's simplex ETF needs feature dim d >= classes C, got d={dim} < C={num_classes}: "
            "use a wider model, or algorithm.projection=fc with algorithm.proj_dim >= C"
        )
    a = torch.rand(dim, num_classes, generator=generator, dtype=torch.float64)
    u, _ = torch.linalg.qr(a, mode="reduced")
    centre = torch.eye(num_classes, dtype=torch.float64, device=a.device) - 1.0 / num_classes
    return (math.sqrt(num_classes / (num_classes - 1)) * u @ centre).to(torch.float32)


Q_FUNCTIONS = {"x": lambda p: p, "exp": torch.exp, "sqrt": torch.sqrt}


def adaptation(label_counts: Tensor, q: str = "x") -> Tensor:
    """phi_k (Eq. 4, Table 6): C * Q(n_{k,c}/n_k) / sum_c Q(n_{k,c}/n_k); Q(x)=x gives C n_{k,c}/n_k.

    A client without samples gets phi = 1 (no information: the plain ETF).
    """
    counts = label_counts.to(torch.float64)
    num_classes = counts.numel()
    total = counts.sum()
    if total <= 0:
        return torch.ones(num_classes, device=counts.device)
    v = Q_FUNCTIONS[q](counts / total)
    return (num_classes * v / v.sum()).to(torch.float32)


def no_adaptation(label_counts: Tensor) -> tuple[Tensor, Tensor]:
    """(phi, present) = (1, all classes) on ``label_counts``' device: the plain ETF (FedGE, empty clients)."""
    n, device = label_counts.numel(), label_counts.device
    return torch.ones(n, device=device), torch.ones(n, dtype=torch.bool, device=device)


# the released code's argparse defaults (comm_round 400, n_parties = party_per_round = 10)
_OFFICIAL = {
    "algorithm.scale": 5.0,
    "algorithm.normalize": "bn",
    "algorithm.projection": "mlp",
    "algorithm.softmax": "all",
    "algorithm.q": "x",
    "algorithm.weighting": "batches",
    "local.lr": 0.01,
    "local.momentum": 0.9,
    "local.weight_decay": 1.0e-4,
    "local.epochs": 10,
    "local.batch_size": 64,
    "local.grad_clip": 20.0,
    "rounds": 400,
    "clients": 10,
    "participation": 1.0,
}


@ALGORITHMS.register("fedgela")
@dataclass
class FedGELA(FedAvg):
    """FedGELA: backbone trained against a fixed ETF scaled by the local label distribution (Eq. 4-5)."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("proj", "weight")
    uploads: ClassVar[tuple[Upload, ...]] = (
        Upload("proj", "model", "the trained projection (and BN) tensors, averaged with the backbone"),
        Upload("weight", "fixed", "p_k, the aggregation weight n_k or floor(n_k / B)"),
    )

    # s in s*phi*m^T h: paper sqrt(E_W) (tuned), code 1/tau (tau=0.2 -> 5); see above
    scale: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 2.0
    normalize: Literal["l2", "bn", "bn_l2"] = "l2"  # l2: paper (E_H = 1); bn / bn_l2: code proxies
    projection: Literal["none", "fc", "mlp"] = "fc"  # fc: paper App. C.1; mlp: code; none: model features
    # projection output = ETF dim d (None: the model's feature_dim); needs projection fc or mlp
    proj_dim: Annotated[int, Field(ge=1)] | None = None
    softmax: Literal["local", "all"] = "local"  # local: paper Eq. 5 (classes C_k); all: code (all C)
    q: Literal["x", "exp", "sqrt"] = "x"  # phi = Q(n_kc/n_k), normalised to sum C (paper Table 6)
    weighting: Literal["samples", "batches"] = "samples"  # n_k (paper) or floor(n_k/B) (code)

    presets: ClassVar[dict[str, Preset]] = {
        "paper": Preset(
            "the paper: s = 32 (E_W = 1e3, the low end of its tuned 1e3..1e6), L2-normalised features, "
            "one FC projection, Eq. 5's softmax over the client's classes, Q(x) = x, weights n_k, SGD lr "
            "0.01, momentum 0.9, weight decay 1e-4, E = 10, B = 100, no gradient clipping",
            {
                "algorithm.scale": 32.0,
                "algorithm.normalize": "l2",
                "algorithm.projection": "fc",
                "algorithm.softmax": "local",
                "algorithm.q": "x",
                "algorithm.weighting": "samples",
                "local.lr": 0.01,
                "local.momentum": 0.9,
                "local.weight_decay": 1.0e-4,
                "local.epochs": 10,
                "local.batch_size": 100,
                "local.grad_clip": None,
            },
            {
                "rounds": "the paper's budget depends on the dataset and participation (Sec. 5.1: 50 rounds "
                "with 10 clients, 100 with 50; CIFAR-100 100 / 200; PxCy 100), and Table 9 gives other ones",
                "clients": "two settings: 10 clients all participating, or 50 with 10 per round",
                "participation": "1.0 with 10 clients, 0.2 with 50 (see clients)",
                "model.name": "the paper's ResNet-18 for 32x32 inputs: resnet18 where the data fit",
            },
        ),
        "official": Preset(
            "the released code: s = 5 (1/tau, tau 0.2), BatchNorm features (its etf proxy), the 2-layer "
            "MLP projection, softmax over all classes, weights floor(n_k / B), gradient-norm clip 20, SGD lr "
            "0.01, momentum 0.9, weight decay 1e-4, E = 10, B = 64; its argparse defaults' 400 rounds of all "
            "10 clients",
            _OFFICIAL,
            {"model.name": "its default resnet18 (the 32x32 MOON variant): resnet18 where the data fit"},
        ),
        "official_readme": Preset(
            "the official preset as the released code's README command runs it: --temperature=0.00001 (s = "
            "1e5, where the argparse default is tau 0.2: s = 5), 100 rounds, 50 clients, 10 per round (its "
            "Dirichlet beta 0.5 partition and ResNet-18 are the experiment's, not the preset's)",
            {**_OFFICIAL, "algorithm.scale": 1.0e5, "rounds": 100, "clients": 50, "participation": 0.2},
            {"model.name": "the command's resnet18: set it where the data fit"},
        ),
    }

    # proj_dim sizes a projection: with projection=none it would be ignored, so it is an error
    check_combination: ClassVar[Needs] = Needs("proj_dim", "projection", ("fc", "mlp"))

    # ----- the classifier side: phi, projection tensors, features -----
    def local_adaptation(self, label_counts: Tensor) -> tuple[Tensor, Tensor]:
        """(phi_k, present_k): the column scales of the personal ETF and the mask of classes in C_k."""
        if int(label_counts.sum()) == 0:  # empty client: no local information
            return no_adaptation(label_counts)
        return adaptation(label_counts, self.q), label_counts > 0

    def etf_dim(self, model: nn.Module) -> int:
        """d: the ETF's rows (the projection output, or the model's feature_dim)."""
        feature_dim = int(model.feature_dim)
        return feature_dim if self.projection == "none" or self.proj_dim is None else self.proj_dim

    def init_projection(self, feature_dim: int, dim: int, generator: torch.Generator) -> StateDict:
        """Initial projection / BatchNorm tensors (empty for projection=none with normalize=l2). Linear layers
        use torch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)) init, BatchNorm weight 1, bias 0; all on the
        generator's device."""

        def linear(prefix: str, fan_in: int, fan_out: int) -> StateDict:
            w, b = linear_init(fan_out, fan_in, True, generator)
            return {f"{prefix}.weight": w, f"{prefix}.bias": b}

        out: StateDict = {}
        if self.projection == "fc":
            out.update(linear("fc", feature_dim, dim))
        elif self.projection == "mlp":
            out.update(linear("fc0", feature_dim, feature_dim))
            out.update(linear("fc1", feature_dim, dim))
        if self.normalize in ("bn", "bn_l2"):
            out.update(
                {
                    "bn.weight": torch.ones(dim, device=generator.device),
                    "bn.bias": torch.zeros(dim, device=generator.device),
                    "bn.running_mean": torch.zeros(dim, device=generator.device),
                    "bn.running_var": torch.ones(dim, device=generator.device),
                }
            )
        return out

    def embed(self, model: nn.Module, x: Tensor, proj: StateDict) -> Tensor:
        """h_hat: the model's features, then the optional projection, BatchNorm and L2 normalisation."""
        h = model.features(x).flatten(1)
        if self.projection == "fc":
            h = F.linear(h, proj["fc.weight"], proj["fc.bias"])
        elif self.projection == "mlp":
            h = F.linear(
                F.relu(F.linear(h, proj["fc0.weight"], proj["fc0.bias"])),
                proj["fc1.weight"],
                proj["fc1.bias"],
            )
        if self.normalize in ("bn", "bn_l2"):
            batch_stats = model.training and h.shape[0] > 1  # one sample has no batch variance: use running
            h = F.batch_norm(
                h,
                proj["bn.running_mean"],
                proj["bn.running_var"],
                proj["bn.weight"],
                proj["bn.bias"],
                training=batch_stats,
                momentum=BN_MOMENTUM,
                eps=BN_EPS,
            )
        if self.normalize in ("l2", "bn_l2"):
            h = F.normalize(h, dim=1, eps=L2_EPS)
        return h

    def logits(self, h_hat: Tensor, etf: Tensor, phi: Tensor | None = None) -> Tensor:
        """z_{k,c} = s * phi_{k,c} * m_c^T h_hat (Eq. 4-5); phi None is the plain ETF (global classifier)."""
        z = self.scale * (h_hat @ etf.to(h_hat.device))
        return z if phi is None else z * phi.to(z.device)

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """The backbone (no head), the ETF M (d x C) and the projection / BN tensors, all seeded (drawn on the
        CPU, the same on every device) and kept on the model's device."""
        dim = self.etf_dim(model)
        etf = simplex_etf(dim, self.ctx.num_classes, seeds.generator(seeds.fedgela_etf(self.ctx.seed)))
        proj_gen = seeds.generator(seeds.fedgela_projection(self.ctx.seed))
        proj = self.init_projection(int(model.feature_dim), dim, proj_gen)
        device = device_of(model)
        return {
            "model": clone_state(model, backbone_keys(model)),
            "etf": etf.to(device),
            "proj": {k: v.to(device) for k, v in proj.items()},
        }

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """Backbone, projection tensors and the (fixed) ETF; the ETF is re-sent every round."""
        return {"model": server["model"], "etf": server["etf"], "proj": server["proj"]}

    def aggregation_weight(self, num_samples: int) -> float:
        """p_k before renormalisation: n_k (paper) or floor(n_k / B) (code, drop_last=True)."""
        if self.weighting == "batches":
            return float(num_samples // self.ctx.local.batch_size)
        return float(num_samples)

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """theta <- sum_k p_k theta_k over backbone and projection tensors (Algorithm 1); M never changes."""
        weights = [float(r["weight"]) for r in replies]
        if sum(weights) <= 0:
            weights = [float(r["num_samples"]) for r in replies]
        server["model"] = weighted_average([r["model"] for r in replies], weights)
        if server["proj"]:
            server["proj"] = weighted_average([r["proj"] for r in replies], weights)
        return server

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor:
        """Generic model: aggregated backbone + plain ETF (phi = 1, all classes)."""
        load_backbone(model, server["model"])
        tensors = {"etf": server["etf"], "proj": server["proj"]}
        return Readout(model, self.generic_readout, tensors, self.feature_readout, self.generic_head)

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Load the global backbone; the loss sees phi_k, C_k (as its state) and a working copy of the
        projection tensors (trainable leaves this round; the received payload is not touched)."""
        phi, present = self.local_adaptation(data.label_counts)
        load_backbone(model, work.payload["model"])  # the model's head is never used
        proj = {
            k: v.detach().clone().requires_grad_(not k.startswith("bn.running"))
            for k, v in work.payload["proj"].items()
        }
        work.payload = {**work.payload, "proj": proj}
        work.state = {"phi": phi, "present": present}

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """Reply with the trained backbone and projection, without any head weights; keep phi, C_k and the
        trained projection as the client state."""
        state = work.state
        trained = {k: v.detach().clone() for k, v in work.payload["proj"].items()}
        if trained:
            state["proj"] = trained
        reply = {
            "model": clone_state(model, backbone_keys(model)),
            "proj": trained,
            "num_samples": data.num_samples,
            "weight": self.aggregation_weight(data.num_samples),
            "train_loss": loss,
        }
        return reply, state

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """Eq. 5: CE of s*phi*M^T h_hat over the local classes C_k (softmax=local) or all C (softmax=all)."""
        x, y = batch
        payload, state = work.payload, work.state
        z = self.logits(self.embed(model, x, payload["proj"]), payload["etf"], state["phi"])
        if self.softmax == "local":
            z = z.masked_fill(~state["present"].to(z.device), float("-inf"))
        return F.cross_entropy(z, y)

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """Backbone parameters and the projection / BN affine tensors; never the head, never the ETF."""
        return backbone_parameters(model) + [t for t in work.payload["proj"].values() if t.requires_grad]

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """Personal model: local backbone (and trained projection) + phi-scaled ETF; classes the client lacks
        get -inf."""
        state = work.state
        tensors = {
            "etf": work.received["etf"],
            "proj": state.get("proj", work.received["proj"]),
            "phi": state["phi"],
            "present": state["present"],
        }
        return Readout(model, self.personal_readout, tensors, self.feature_readout, self.personal_head)

    # ----- the predictors' readouts (``Readout``): logits = head(h_hat) -----
    def generic_readout(self, model: nn.Module, x: Tensor, tensors: dict[str, Any]) -> Tensor:
        """s * m_c^T h_hat: the plain ETF over all classes."""
        return self.generic_head(self.feature_readout(model, x, tensors), tensors)

    def personal_readout(self, model: nn.Module, x: Tensor, tensors: dict[str, Any]) -> Tensor:
        """s * phi_k,c * m_c^T h_hat, -inf for the classes the client lacks."""
        return self.personal_head(self.feature_readout(model, x, tensors), tensors)

    def feature_readout(self, model: nn.Module, x: Tensor, tensors: dict[str, Any]) -> Tensor:
        """h_hat of the backbone (and projection): what the ETF classifies."""
        return self.embed(model, x, tensors["proj"])

    def generic_head(self, h_hat: Tensor, tensors: dict[str, Any]) -> Tensor:
        return self.logits(h_hat, tensors["etf"])

    def personal_head(self, h_hat: Tensor, tensors: dict[str, Any]) -> Tensor:
        z = self.logits(h_hat, tensors["etf"], tensors["phi"])
        return z.masked_fill(~tensors["present"].to(z.device), float("-inf"))


@ALGORITHMS.register("fedge")
@dataclass
class FedGE(FedGELA):
    """FedGE (ablation, paper Table 4): FedGELA with phi = 1, i.e. FedAvg with the fixed ETF classifier.

    No local adaptation at all: every class enters the loss and personal inference, so ``softmax`` and ``q``
    have no effect. Its presets are FedGELA's settings."""

    presets: ClassVar[dict[str, Preset]] = FedGELA.presets

    def local_adaptation(self, label_counts: Tensor) -> tuple[Tensor, Tensor]:
        return no_adaptation(label_counts)

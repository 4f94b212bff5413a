"""What every algorithm sees: the run context, a client's data, the registry and state-dict arithmetic.

The algorithm contract (docs/design.md section 3) is implemented by
:class:`fedpcd.algorithms.fedavg.FedAvg`; every other algorithm subclasses it and overrides only the hooks
its paper changes. Hooks exchange plain dicts whose leaves are tensors, numbers or strings, so the same
class runs in the local simulator and over Flower.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedpcd.data.transforms import random_crop_flip
from fedpcd.models import head_keys
from fedpcd.params import LocalTraining
from fedpcd.registry import Registry

StateDict = dict[str, Tensor]

ALGORITHMS: Registry[type] = Registry("algorithm")

Weighting = Literal["samples", "uniform"]  # aggregation weights: n_k or 1 per reply


# The reply fields the engine reads (every algorithm's reply has them; the rest is the algorithm's own):
MODEL = "model"  # the client's model tensors (DP clipping and SecAgg+ work on these)
NUM_SAMPLES = "num_samples"  # n_k, the client's training samples
TRAIN_LOSS = "train_loss"  # the mean training loss of the update (None: not measured)
CLASSES = "classes"  # the classes a per-class upload's rows belong to (absent: one row per class)

UploadKind = Literal["model", "rows", "counts", "fixed", "classes", "public"]
UPLOAD_KINDS: dict[str, str] = {  # how privacy.clip bounds and noises each kind (docs/privacy.md's table)
    "model": "update clipped with the model's (one L2 bound C); noise std sigma*C/m on the server's mean",
    "rows": "each class row clipped to L2 norm privacy.stats_clip; rows of all C classes (zeros for those "
    "not held); noise std sigma*stats_clip*sqrt(C) per client",
    "counts": "the per-class counts of all C classes clipped to L2 norm privacy.count_clip; noise std "
    "sigma*count_clip per client, then clamped at 0",
    "fixed": "replaced by 1 (fixed weights, as num_samples)",
    "classes": "replaced by all C classes (hides which classes the client holds)",
    "public": "released as is",
}


@dataclass(frozen=True)
class Upload:
    """What a client uploads under reply key ``key`` beyond model, num_samples and train_loss, for
    ``privacy.clip`` (each kind's bound and noise: :data:`UPLOAD_KINDS`) and ``aggregation.robust`` (the
    server averages the ``model`` kind like the model and the ``rows`` kind per class). ``note``: what it is,
    and for ``public`` why releasing it is no leak."""

    key: str
    kind: UploadKind
    note: str


def made_public(uploads: Sequence[Upload], key: str, note: str) -> tuple[Upload, ...]:
    """``uploads`` with ``key``'s declared ``public`` (``note``: why), e.g. a scale sent back unchanged."""
    return tuple(Upload(key, "public", note) if u.key == key else u for u in uploads)


# what a class-mean upload (class_means_reply) sends, as the algorithms that send it declare it
CLASS_MEAN_UPLOADS = (
    Upload("classes", "classes", "the held classes the class means belong to"),
    Upload("class_counts", "counts", "n_k^c, the samples of each held class"),
    Upload("class_means", "rows", "the per-class means of the local features (FD: of the logits)"),
)


def row_classes(reply: Mapping[str, Any], num_classes: int, device: torch.device) -> Tensor:
    """The classes of a per-class upload's rows: the reply's ``classes``, else those of its bool ``mask``
    (rows of all C classes, FedSSA's zero-filled upload: only the masked ones count), else all C."""
    if CLASSES in reply:
        return reply[CLASSES]
    if "mask" in reply:
        return torch.nonzero(reply["mask"]).flatten()
    return torch.arange(num_classes, device=device)


@dataclass(frozen=True)
class Context:
    """Facts about the run that server and clients both know (identical on every backend)."""

    num_clients: int
    num_classes: int
    rounds: int
    seed: int
    local: LocalTraining = field(default_factory=LocalTraining)
    heterogeneous: bool = False  # clients have different architectures (config model.name is a list/map)
    input_shape: tuple[int, int, int] | None = None  # (channels, height, width) of one sample
    # state-dict keys of the reference model (client 0's architecture) that are parameters, not buffers
    parameter_names: tuple[str, ...] = ()


@dataclass
class ClientData:
    """One client's view of the in-memory dataset: index tensors into shared tensors, never copies."""

    id: int
    x: Tensor  # the whole training set, float and normalised (shared by all clients)
    y: Tensor
    train_idx: Tensor  # this client's training indices
    test_x: Tensor  # the whole official test set (shared)
    test_y: Tensor
    local_test_idx: Tensor  # this client's local test split, indices into the test set
    num_classes: int
    augment: bool = False

    @property
    def num_samples(self) -> int:
        return int(self.train_idx.numel())

    @property
    def label_counts(self) -> Tensor:
        """Training samples per class, shape [C] (the client's label distribution, unnormalised)."""
        return torch.bincount(self.y[self.train_idx], minlength=self.num_classes)

    def batches(self, batch_size: int, generator: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
        """One shuffled pass over the client's samples (last batch may be smaller), augmented if set.

        The permutation is drawn from ``generator`` (a CPU one: the same batches on every device)."""
        perm = torch.randperm(self.num_samples, generator=generator).to(self.train_idx.device)
        order = self.train_idx[perm]
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            xb = self.x[idx]
            if self.augment:
                xb = random_crop_flip(xb, generator)
            yield xb, self.y[idx]


def clone_state(model: nn.Module, keys: Sequence[str] | None = None) -> StateDict:
    """A detached copy of the model's state (parameters and buffers), optionally only ``keys``."""
    state = model.state_dict()
    names = state.keys() if keys is None else keys
    return {k: state[k].detach().clone() for k in names}


def backbone_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All parameters but the linear head's."""
    heads = set(head_keys(model))
    return [p for name, p in model.named_parameters() if name not in heads]


def load_backbone(model: nn.Module, backbone: Mapping[str, Tensor]) -> None:
    """Load every non-head tensor of ``model`` from ``backbone``, which must hold no head tensor.

    For methods whose classifier is not the model's linear head (fixed ETF, prototypes, personal heads).
    """
    heads = set(head_keys(model))
    if heads & set(backbone):
        raise ValueError(f"a backbone state must not hold head weights, got {sorted(heads & set(backbone))}")
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    if unexpected or set(missing) != heads:
        raise ValueError(
            f"backbone state does not match the model: missing {sorted(set(missing) - heads)}, "
            f"unexpected {sorted(unexpected)}"
        )


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> StateDict:
    """sum_i w_i s_i / sum_i w_i for every key; integer buffers (BatchNorm counters) are rounded back."""
    if not states:
        raise ValueError("weighted_average needs at least one state")
    total = float(sum(weights))
    out: StateDict = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            acc = torch.zeros_like(first)
            for state, w in zip(states, weights, strict=True):
                acc.add_(state[key], alpha=w / total)
        else:
            acc64 = sum(state[key].double() * (w / total) for state, w in zip(states, weights, strict=True))
            acc = torch.round(acc64).to(first.dtype)
        out[key] = acc
    return out


def coordinate_median(states: Sequence[Mapping[str, Tensor]]) -> StateDict:
    """The coordinate-wise median of the states (the mean of the two middle values for an even count; Yin et
    al., "Byzantine-Robust Distributed Learning", ICML 2018, Def. 1); integer buffers are rounded back."""
    return _per_coordinate(states, lambda s: _middle_mean(s, (len(s) - 1) // 2, len(s) // 2 + 1))


def trimmed_mean(states: Sequence[Mapping[str, Tensor]], trim: float) -> StateDict:
    """The coordinate-wise beta-trimmed mean (Yin et al., ICML 2018, Def. 2): per coordinate, the mean of the
    values left after dropping the floor(trim * n) largest and as many smallest of the n states."""
    k = math.floor(trim * len(states))
    if len(states) - 2 * k < 1:
        raise ValueError(f"a trimmed mean dropping {k} from each end needs more than {2 * k} states")
    return _per_coordinate(states, lambda s: _middle_mean(s, k, len(s) - k))


def _middle_mean(sorted_values: Tensor, start: int, stop: int) -> Tensor:
    return sorted_values[start:stop].mean(dim=0)


def _per_coordinate(states: Sequence[Mapping[str, Tensor]], reduce: Any) -> StateDict:
    """``reduce`` applied to each key's values sorted along a leading state dimension (float64 for integer
    buffers, rounded back)."""
    if not states:
        raise ValueError("a robust mean needs at least one state")
    out: StateDict = {}
    for key, first in states[0].items():
        stacked = torch.stack([state[key] for state in states])
        if first.is_floating_point():
            out[key] = reduce(stacked.sort(dim=0).values)
        else:
            out[key] = torch.round(reduce(stacked.double().sort(dim=0).values)).to(first.dtype)
    return out


def tensor_bytes(obj: Any) -> int:
    """Bytes of all tensors in a nested dict/list (what a message would carry)."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


# ----- helpers shared by algorithms ------------------------------------------------------------


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's parameters: the run's device (``engine.device``), where the engine puts
    every model; tensors an algorithm creates to meet the model's belong there."""
    return next(model.parameters()).device


def param_names(model: nn.Module) -> list[str]:
    """Names of the model's floating-point parameters (state-dict keys; buffers excluded)."""
    return [name for name, p in model.named_parameters() if p.is_floating_point()]


def zeros_like_params(model: nn.Module) -> StateDict:
    """A zero tensor per parameter (the initial control variates, gradient states and drifts)."""
    return {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters() if p.is_floating_point()}


def sq_distance(model: nn.Module, reference: Mapping[str, Tensor]) -> Tensor:
    """sum over parameters of ||w - reference||^2, differentiable in the model's parameters."""
    total = torch.zeros((), device=device_of(model))
    for name, p in model.named_parameters():
        if p.is_floating_point():
            total = total + (p - reference[name].detach()).pow(2).sum()
    return total


def local_steps(num_samples: int, local: LocalTraining) -> int:
    """K = ceil(n_k / B) * E, the number of local SGD steps (the shared loop keeps the last short batch)."""
    return math.ceil(num_samples / local.batch_size) * local.epochs


def round_lr(local: LocalTraining, rnd: int) -> float:
    """The local learning rate in round ``rnd`` (1..R), as the shared loop computes it."""
    return local.lr * local.lr_decay ** max(rnd - 1, 0)


def reply_weights(replies: Sequence[Mapping[str, Any]], weighting: Weighting) -> list[float]:
    """Aggregation weights: n_k ("samples", the library's FedAvg) or 1 per reply ("uniform")."""
    if weighting == "samples":
        return [float(r["num_samples"]) for r in replies]
    return [1.0] * len(replies)


def average_dicts(dicts: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> StateDict:
    """sum_i w_i d_i / sum_i w_i for float tensors (control variates, gradient states)."""
    total = float(sum(weights))
    out: StateDict = {}
    for key, first in dicts[0].items():
        acc = torch.zeros_like(first)
        for d, w in zip(dicts, weights, strict=True):
            acc.add_(d[key], alpha=w / total)
        out[key] = acc
    return out


class _FeaturesAndLogits(nn.Module):
    """A view of a FedModel whose forward returns (features, logits); holds a reference, copies nothing."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = self.model.features(x)
        return z, self.model.head(z)


def frozen_forward(model: nn.Module, state: Mapping[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    """(z, logits) of ``model``'s architecture with the weights ``state``: eval mode, no gradient.

    The shared model object's own weights and mode are untouched afterwards; ``state`` is only read (eval
    mode keeps BatchNorm from writing its running statistics into it). Shared helper for the methods with a
    frozen teacher or reference model (MOON, FedNTD).
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            view = _FeaturesAndLogits(model)
            z, logits = functional_call(view, {f"model.{k}": v for k, v in state.items()}, (x,))
    finally:
        model.train(was_training)
    return z, logits


def log_prior(label_counts: Tensor) -> Tensor:
    """log(n_c / n) per class, -inf for classes with no sample."""
    counts = label_counts.double()
    out = torch.full_like(counts, -torch.inf)
    held = counts > 0
    out[held] = torch.log(counts[held] / counts.sum())
    return out.float()


def balanced_softmax_loss(logits: Tensor, y: Tensor, log_p: Tensor) -> Tensor:
    """Balanced softmax (Ren et al. 2020; FedRoD's BSM): CE(logits + log p(c), y)."""
    return F.cross_entropy(logits + log_p, y)


# ----- helpers several algorithms share ---------------------------------------------------------------------


class ClassSums:
    """Per-class sums of rows (features, class means, gradient rows) and per-class counts or weights.

    :meth:`add` puts row j of each tensor in ``rows`` into class ``classes[j]``'s sums (times ``weights[j]``)
    and ``weights[j]`` (1 without weights) into its count: one ``index_add`` per tensor, accumulating in call
    order. Out of place, so it also runs inside autograd and ``torch.func.vmap``.
    """

    def __init__(
        self,
        num_classes: int,
        *row_shapes: Sequence[int],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        count_dtype: torch.dtype = torch.long,
    ) -> None:
        self.sums = [torch.zeros(num_classes, *shape, dtype=dtype, device=device) for shape in row_shapes]
        self.counts = torch.zeros(num_classes, dtype=count_dtype, device=device)

    def add(self, classes: Tensor, *rows: Tensor, weights: Tensor | None = None) -> None:
        """Add the rows of each tensor in ``rows`` (one per sum, rows aligned with ``classes``)."""
        if weights is None:
            weights = torch.ones(len(classes), dtype=self.counts.dtype, device=self.counts.device)
            self.sums = [s.index_add(0, classes, r) for s, r in zip(self.sums, rows, strict=True)]
        else:
            self.sums = [
                s.index_add(0, classes, weights.view(-1, *[1] * (r.dim() - 1)) * r)
                for s, r in zip(self.sums, rows, strict=True)
            ]
        self.counts = self.counts.index_add(0, classes, weights)

    @property
    def held(self) -> Tensor:
        """[C] bool: the classes with a positive count."""
        return self.counts > 0

    def mean(self, which: int = 0) -> Tensor:
        """Sum ``which`` divided by the counts, in the rows of the :attr:`held` classes only."""
        held, sums = self.held, self.sums[which]
        return sums[held] / self.counts[held].view(-1, *[1] * (sums.dim() - 1))

    def held_means(self) -> tuple[Tensor, Tensor, Tensor]:
        """(held classes ascending, their counts, their means of the first sum): a class-mean upload."""
        held = torch.nonzero(self.counts > 0).flatten()
        return held, self.counts[held], self.sums[0][held] / self.counts[held, None]


def linear_init(
    out_features: int,
    in_features: int,
    bias: bool,
    generator: torch.Generator,
    draw: Literal["rand_affine", "nn_init"] = "rand_affine",
) -> tuple[Tensor, Tensor | None]:
    """Seeded initial (weight [out, in], bias [out] or None) of ``nn.Linear(in_features, out_features)``,
    weight drawn first, on the generator's device: U(-1/sqrt(in), 1/sqrt(in)) for both. ``draw`` is how the
    uniform numbers are made (other floats from the same generator state): ``"rand_affine"``,
    (torch.rand * 2 - 1) / sqrt(in); ``"nn_init"``, ``nn.init.kaiming_uniform_(a=sqrt(5))`` and ``uniform_``,
    the calls of ``nn.Linear.reset_parameters``."""
    device, bound = generator.device, 1.0 / math.sqrt(in_features)
    if draw == "rand_affine":
        w = (torch.rand(out_features, in_features, generator=generator, device=device) * 2.0 - 1.0) * bound
        if not bias:
            return w, None
        return w, (torch.rand(out_features, generator=generator, device=device) * 2.0 - 1.0) * bound
    if draw != "nn_init":
        raise ValueError(f"unknown draw {draw!r}")
    w = torch.empty(out_features, in_features, device=device)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
    if not bias:
        return w, None
    return w, torch.empty(out_features, device=device).uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def raw_class_means(
    model: nn.Module, data: ClientData, chunk: int = 512, output: Literal["features", "logits"] = "features"
) -> tuple[Tensor, Tensor, Tensor]:
    """(held classes, counts n_c, class means g_c) of the client's training samples, in eval mode: the mean
    representation ``model.features(x)`` (prototypes) or the mean output ``model(x)`` (FD's logits)."""
    was_training = model.training
    model.eval()
    embed = model.features if output == "features" else model
    width = model.feature_dim if output == "features" else data.num_classes
    sums = ClassSums(data.num_classes, (width,), device=data.x.device)
    idx = data.train_idx
    for start in range(0, len(idx), chunk):
        part = idx[start : start + chunk]
        sums.add(data.y[part], embed(data.x[part]).float())
    model.train(was_training)
    return sums.held_means()


def class_means_reply(
    model: nn.Module, data: ClientData, output: Literal["features", "logits"] = "features"
) -> dict[str, Tensor]:
    """The reply fields of a class-mean upload: held ``classes``, their ``class_counts`` and ``class_means``
    (:func:`raw_class_means`), what :func:`aggregate_prototypes` reads."""
    classes, counts, means = raw_class_means(model, data, output=output)
    return {"classes": classes, "class_counts": counts, "class_means": means}


def aggregate_prototypes(
    prototypes: Tensor, known: Tensor, replies: Sequence[Mapping[str, Any]]
) -> tuple[Tensor, Tensor]:
    """Sec. 3.3: g_c = sum_k N_k^c g_k^c / sum_k N_k^c over the replies that carry class means and hold c.

    Replies without ``class_means`` (non-submitters) are skipped; unreported classes keep their prototype.
    Returns (prototypes, known) with known |= reported. Computed in float64, returned in the input dtype.
    """
    protos = prototypes.double().clone()
    f64 = {"dtype": torch.float64, "device": protos.device}
    sums = ClassSums(protos.shape[0], protos.shape[1:], **f64, count_dtype=torch.float64)
    for r in replies:
        if "class_means" in r:
            sums.add(r["classes"], r["class_means"].double(), weights=r["class_counts"].double())
    protos[sums.held] = sums.mean()
    return protos.to(prototypes.dtype), known | sums.held

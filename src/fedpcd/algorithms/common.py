"""Pieces several algorithms share: local step counts and learning rates, aggregation weights, frozen
forward passes, label priors, per-class sums and class-mean uploads."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedpcd.algorithms.context import ClientData
from fedpcd.params import LocalTraining

Weighting = Literal["samples", "uniform"]  # aggregation weights: n_k or 1 per reply


def local_steps(data: ClientData, local: LocalTraining) -> int:
    """K = ceil(n_k / B) * E, the number of local SGD steps (the shared loop keeps the last short batch, but
    one of a single sample where the model has BatchNorm layers: ``ClientData.batches_per_pass``)."""
    return data.batches_per_pass(local.batch_size) * local.epochs


def round_lr(local: LocalTraining, rnd: int) -> float:
    """The local learning rate in round ``rnd`` (1..R), as the shared loop computes it."""
    return local.lr * local.lr_decay ** max(rnd - 1, 0)


def reply_weights(replies: Sequence[Mapping[str, Any]], weighting: Weighting) -> list[float]:
    """Aggregation weights: n_k ("samples", the library's FedAvg) or 1 per reply ("uniform")."""
    if weighting == "samples":
        return [float(r["num_samples"]) for r in replies]
    return [1.0] * len(replies)


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

"""What every algorithm sees: the run's context, a client's data, the reply fields the engine reads and the
declarations of what a client uploads.

Hooks exchange plain dicts whose leaves are tensors, numbers or strings, so the same class runs in the local
simulator and over Flower.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from fedpcd.data.transforms import random_crop_flip
from fedpcd.params import LocalTraining

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
    # the client's model has BatchNorm layers, which cannot normalise a batch of one sample in training
    batchnorm: bool = False

    @property
    def num_samples(self) -> int:
        return int(self.train_idx.numel())

    @property
    def label_counts(self) -> Tensor:
        """Training samples per class, shape [C] (the client's label distribution, unnormalised)."""
        return torch.bincount(self.y[self.train_idx], minlength=self.num_classes)

    def batches_per_pass(self, batch_size: int, training: bool = True) -> int:
        """The batches of one pass: ceil(n_k / B), less, in training, a last batch of one sample where the
        model has BatchNorm layers (left out, as a data loader's ``drop_last`` would, but only that one)."""
        full, rest = divmod(self.num_samples, batch_size)
        return full + int(rest > 1 or (rest == 1 and not (training and self.batchnorm)))

    def batches(
        self, batch_size: int, generator: torch.Generator, training: bool = True
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """One shuffled pass over the client's samples (last batch may be smaller), augmented if set:
        :meth:`batches_per_pass` batches (``training=False``: every sample, for a pass in eval mode).

        The permutation is drawn from ``generator`` (a CPU one: the same batches on every device)."""
        perm = torch.randperm(self.num_samples, generator=generator).to(self.train_idx.device)
        order = self.train_idx[perm]
        for start in range(0, self.batches_per_pass(batch_size, training) * batch_size, batch_size):
            idx = order[start : start + batch_size]
            xb = self.x[idx]
            if self.augment:
                xb = random_crop_flip(xb, generator)
            yield xb, self.y[idx]

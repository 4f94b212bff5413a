"""A dataset held in memory: ``Dataset`` (uint8 image or token tensors, int64 labels), the ``Loader`` type of
the dataset registry (``fedpcd.data.datasets``), channel statistics and class-stratified subsets.

Clients are index tensors into a ``Dataset`` (see ``fedpcd.data.partition``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedpcd.data.transforms import normalize
from fedpcd.errors import UserError


@dataclass(eq=False)
class Dataset:
    """One dataset held in memory: uint8 images ``[N, C, H, W]`` and int64 labels for train and test.

    ``vocab_size`` > 0: the samples are not images but token sequences, uint8 ids ``[N, L]`` below
    ``vocab_size`` (Shakespeare's characters); models see them as int64 ids and ``in_channels`` is 0.
    ``train_groups`` / ``test_groups``: the dataset's own clients (LEAF's writers and speaking roles,
    FLamby's centres), an int64 group id per sample; the ``natural`` partition scheme keeps them.
    ``eq=False``: datasets compare by identity (element-wise tensor equality has no single truth value).
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False
    vocab_size: int = 0
    train_groups: torch.Tensor | None = None
    test_groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if self.vocab_size:
                if x.dtype != torch.uint8 or x.dim() != 2:
                    raise ValueError(f"{self.name} {split}_x must be uint8 token ids [N, L], got {x.dtype}")
                if x.numel() and int(x.max()) >= self.vocab_size:
                    raise ValueError(f"{self.name} {split}_x holds ids >= vocab_size {self.vocab_size}")
            elif x.dtype != torch.uint8 or x.dim() != 4 or x.shape[2] != x.shape[3]:
                got = f"{x.dtype} {tuple(x.shape)}"
                raise ValueError(f"{self.name} {split}_x must be uint8 [N, C, H, H], got {got}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                got = f"{y.dtype} {tuple(y.shape)}"
                raise ValueError(f"{self.name} {split}_y must be int64 [{x.shape[0]}], got {got}")
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise ValueError(f"{self.name}: train and test images differ in shape")
        if len(self.mean) != self.in_channels or len(self.std) != self.in_channels:
            raise ValueError(f"{self.name}: mean/std need {self.in_channels} entries")
        if (self.train_groups is None) != (self.test_groups is None):
            raise ValueError(f"{self.name}: train_groups and test_groups come together")
        if self.train_groups is not None and self.test_groups is not None:
            pairs = (("train", self.train_groups, self.train_y), ("test", self.test_groups, self.test_y))
            for split, g, y in pairs:
                if g.dtype != torch.int64 or g.shape != y.shape:
                    raise ValueError(f"{self.name} {split}_groups must be int64 [{len(y)}]")

    @property
    def groups(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The natural clients of the train and test samples (a group id per sample), None without them: what
        ``make_partition`` gives the ``natural`` scheme."""
        if self.train_groups is None or self.test_groups is None:
            return None
        return self.train_groups.numpy(), self.test_groups.numpy()

    @property
    def in_channels(self) -> int:
        """Image channels; 0 for token sequences."""
        return 0 if self.vocab_size else int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        """Image side; the sequence length for token sequences."""
        return int(self.train_x.shape[1] if self.vocab_size else self.train_x.shape[2])

    @property
    def num_groups(self) -> int:
        """How many natural clients the dataset has (0: none)."""
        if self.train_groups is None or self.test_groups is None:
            return 0
        both = torch.cat([self.train_groups, self.test_groups])
        return int(both.max()) + 1 if len(both) else 0

    def normalized(self, split: str) -> torch.Tensor:
        """Float32 ``(x / 255 - mean) / std`` of the "train" or "test" images, computed once per instance
        (int64 token ids for token sequences)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        # Cached in the instance __dict__, not as a dataclass field: never compared, printed or replaced.
        cache: dict[str, torch.Tensor] = self.__dict__.setdefault("_normalized_cache", {})
        if split not in cache:
            x = self.train_x if split == "train" else self.test_x
            cache[split] = x.long() if self.vocab_size else normalize(x, self.mean, self.std)
        return cache[split]

    def __repr__(self) -> str:
        if self.vocab_size:
            shape = f"tokens={self.image_size}x{self.vocab_size}"
        else:
            c, h, w = self.train_x.shape[1:]
            shape = f"images={c}x{h}x{w}"
        groups = f", groups={self.num_groups}" if self.num_groups else ""
        return (
            f"Dataset({self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
            f"{shape}, classes={self.num_classes}{groups}, augment={self.augment})"
        )


def channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std on the [0, 1] scale of uint8 images ``[N, C, H, W]`` (in float64, channel by
    channel): the normalisation of the datasets whose statistics are measured when loaded."""
    means, stds = [], []
    for c in range(x.shape[1]):
        v = x[:, c].double() / 255.0
        means.append(round(float(v.mean()), 4) if v.numel() else 0.0)
        stds.append(round(max(float(v.std()), 1e-3), 4) if v.numel() > 1 else 1.0)
    return tuple(means), tuple(stds)


Loader = Callable[[Path | None, bool], Dataset]


def stratified_subset(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted int64 indices keeping ``round(n_c * fraction)`` (at least 1) random samples of each class c."""
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"fraction must be in (0, 1], got {fraction!r}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    parts = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        k = min(len(idx), max(1, round(len(idx) * fraction)))
        parts.append(rng.choice(idx, size=k, replace=False))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(parts)).astype(np.int64)

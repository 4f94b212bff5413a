"""CIFAR-10 / CIFAR-100 (python pickle batches): parsing with a restricted unpickler, official checksums.

A batch is unpickled by :class:`_PlainUnpickler`, which resolves numpy's array constructors and builtin
containers only: a crafted batch cannot run code.
"""

from __future__ import annotations

import codecs
import io
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct, scalar
    from numpy._core.numeric import _frombuffer
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct, scalar
    from numpy.core.numeric import _frombuffer

from fedpcd.data.files import verify_md5
from fedpcd.errors import UserError, clip

# The official archives and their MD5s, checked while downloading
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"
# (images, MD5) of the official batch files
CIFAR_OFFICIAL = {
    "cifar10": {
        "data_batch_1": (10000, "c99cafc152244af753f735de768cd75f"),
        "data_batch_2": (10000, "d4bba439e000b95fd0a9bffe97cbabec"),
        "data_batch_3": (10000, "54ebc095f3ab1f0389bbae665268c751"),
        "data_batch_4": (10000, "634d18415352ddfa80567beed471001a"),
        "data_batch_5": (10000, "482c414d41f54cd18b22e5b47cb7c3cb"),
        "test_batch": (10000, "40351d587109b95175f43aff81a1287e"),
    },
    "cifar100": {
        "train": (50000, "16019d7e3df5f24257cddd939b257f8d"),
        "test": (10000, "f0ef6b0ae62326f3e7ffdfab6717acfc"),
    },
}


# FC100 (Oreshkin et al., NeurIPS 2018, "TADAM"): CIFAR-100's 20 superclasses split 12 / 4 / 4 into
# train / validation / test classes; the superclass of each fine class 0..99 is CIFAR-100's own (its
# batches' coarse_labels).
CIFAR100_COARSE = (
    4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11,
    6, 11, 5, 10, 7, 6, 13, 15, 3, 15, 0, 11, 1, 10, 12, 14, 16, 9, 11, 5,
    5, 19, 8, 8, 15, 13, 14, 17, 18, 10, 16, 4, 17, 4, 2, 0, 17, 4, 18, 17,
    10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16, 12, 9, 13, 15, 13,
    16, 19, 2, 4, 6, 19, 5, 5, 8, 19, 18, 1, 2, 15, 6, 0, 17, 8, 14, 13,
)  # fmt: skip
FC100_SUPERCLASSES = {
    "train": (1, 2, 3, 4, 5, 6, 9, 10, 15, 17, 18, 19),
    "val": (8, 11, 13, 16),
    "test": (0, 7, 12, 14),
}


def fc100_classes(split: str = "train") -> list[int]:
    """The CIFAR-100 fine classes of FC100's ``split``, superclass by superclass (fine ids ascending within
    one): new label i is the i-th of them, so each superclass's five classes are contiguous."""
    return [f for sc in FC100_SUPERCLASSES[split] for f in range(100) if CIFAR100_COARSE[f] == sc]


# What a CIFAR batch may refer to: numpy's array, dtype and scalar constructors (under numpy 1's and 2's
# module names), bytes from Python 2 text (``_codecs.encode``) and builtin containers. Nothing else is
# ever looked up, so a crafted batch cannot run code.
_PLAIN = {
    **{(f"numpy.{core}.multiarray", "_reconstruct"): _reconstruct for core in ("core", "_core")},
    **{(f"numpy.{core}.multiarray", "scalar"): scalar for core in ("core", "_core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): _frombuffer for core in ("core", "_core")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
    **{(b, t.__name__): t for b in ("builtins", "__builtin__") for t in (set, frozenset, bytearray, complex)},
}


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and plain data only: any other global is a UserError naming the file."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> object:
        found = _PLAIN.get((module, name))
        if found is None:
            raise UserError(
                f"{self.path} is not a plain CIFAR batch: it refers to {clip(module, 40)}.{clip(name, 40)} "
                "(only numpy arrays and plain data are loaded, never code); delete it and download again"
            )
        return found


def read_cifar_batch(
    path: Path, label_key: bytes, num_classes: int, official: tuple[int, str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One batch file, parsed by :class:`_PlainUnpickler`. A file large enough to hold the official file's
    images must be the official file: its checksum is verified before it is parsed."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read CIFAR batch {path}: {exc.strerror or exc}") from None
    if official is not None and len(raw) >= official[0] * 3 * 32 * 32:
        verify_md5(path, raw, official[1])
    try:
        batch = _PlainUnpickler(io.BytesIO(raw), path).load()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated, corrupt, not a pickle: all one answer
        raise UserError(f"cannot read CIFAR batch {path}: {type(exc).__name__}: {clip(str(exc))}") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise UserError(f"{path} is not a CIFAR batch (needs keys b'data' and {label_key!r})")
    try:
        data = np.asarray(batch[b"data"])
        labels = np.asarray(batch[label_key], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{path} is not a CIFAR batch (b'data' or {label_key!r} is not an array)") from None
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise UserError(f"{path}: data must be uint8 [N, 3072], got {data.dtype} {data.shape}")
    if labels.shape != (len(data),) or (len(labels) and (labels.min() < 0 or labels.max() >= num_classes)):
        raise UserError(f"{path}: expected {len(data)} labels in 0..{num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels


def read_cifar(
    name: str, folder: Path, train: Sequence[str], test: str, label_key: bytes, num_classes: int
) -> dict[str, torch.Tensor]:
    """``train_x``, ``train_y``, ``test_x``, ``test_y`` from the ``train`` batches and the ``test`` batch in
    ``folder`` (uint8 images ``[N, 3, 32, 32]``, int64 labels); ``name`` picks the official checksums."""
    known = CIFAR_OFFICIAL.get(name, {})
    parts = [read_cifar_batch(folder / f, label_key, num_classes, known.get(f)) for f in train]
    test_x, test_y = read_cifar_batch(folder / test, label_key, num_classes, known.get(test))
    return {
        "train_x": torch.from_numpy(np.concatenate([p[0] for p in parts])),
        "train_y": torch.from_numpy(np.concatenate([p[1] for p in parts])),
        "test_x": torch.from_numpy(np.ascontiguousarray(test_x)),
        "test_y": torch.from_numpy(test_y),
    }

"""The dataset registry ``DATASETS``, the built-in loaders registered in it, and ``load_dataset``.

Every dataset is loaded once into a ``fedpcd.data.tensors.Dataset`` (uint8 image tensors ``[N, C, H, W]``
and int64 label tensors). The file formats have their own modules (``idx``, ``cifar``, ``svhn``, ``leaf``,
``jpeg_sets``); where files are looked up is ``fedpcd.data.sources``, how they are downloaded
``fedpcd.data.files``.
"""

from __future__ import annotations

import importlib
import numbers
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedpcd.catalog import HF_CHOICE, HF_PREFIX  # dataset names hf:<hub name>: fedpcd.data.hf
from fedpcd.data.cifar import CIFAR10_MD5, CIFAR10_URL, CIFAR100_MD5, CIFAR100_URL, fc100_classes, read_cifar
from fedpcd.data.files import download_and_extract, find_or_download
from fedpcd.data.idx import FMNIST_URLS, MNIST_URLS, idx_fetch, load_idx_tensors
from fedpcd.data.jpeg_sets import ISIC_CLASSES, TINY_MD5, read_isic, read_tiny
from fedpcd.data.leaf import (
    FEMNIST_CLASSES,
    SHAKESPEARE_LETTERS,
    class_ids,
    femnist_x,
    read_leaf,
    shakespeare_x,
    shakespeare_y,
)
from fedpcd.data.sources import (
    CIFAR10_DIR,
    CIFAR10_TRAIN,
    CIFAR100_DIR,
    SOURCES,
    SVHN_FILES,
    TINY_DIR,
    TINY_URL,
)
from fedpcd.data.svhn import SVHN_URL, read_svhn, svhn_fetch
from fedpcd.data.tensors import Dataset, Loader, channel_stats, stratified_subset
from fedpcd.errors import UserError
from fedpcd.registry import Registry

if TYPE_CHECKING:
    from fedpcd.config import Config


HF_MODULE = "fedpcd.data.hf"


class DatasetRegistry(Registry[Loader]):
    """The dataset registry; it also knows every ``hf:<hub name>`` without registering it: ``get`` returns
    that Hugging Face dataset's loader (``fedpcd.data.hf.hf_loader``), which also takes the image and label
    columns."""

    def get(self, name: str) -> Loader:
        if isinstance(name, str) and name.startswith(HF_PREFIX):  # loaded on demand, as a plugin's entry
            # point is (the module needs the optional datasets package)
            hf_loader = importlib.import_module(HF_MODULE).hf_loader
            return hf_loader(name)
        try:
            return super().get(name)
        except UserError as exc:
            raise UserError(f"{exc}, or {HF_CHOICE}") from None

    def __contains__(self, name: object) -> bool:
        return (isinstance(name, str) and name.startswith(HF_PREFIX)) or super().__contains__(name)


DATASETS = DatasetRegistry("dataset")


_keeping = False  # keep_datasets(True): load_dataset keeps _kept
_kept: tuple[tuple, Dataset] | None = None  # the dataset loaded last, with its load's key


def keep_datasets(keep: bool) -> None:
    """``True``: :func:`load_dataset` keeps the dataset it loaded last, and a load with the same name, root,
    download flag and columns gets it without reading its files again (the runs of a sweep, which load one
    dataset run after run; its tensors are never changed in place); ``False``: it keeps none."""
    global _keeping, _kept
    _keeping, _kept = keep, None


def load_configured(config: Config) -> Dataset:
    """The dataset of a run's config: its ``dataset`` section, drawn with its ``seed``."""
    section = config.dataset
    return load_dataset(
        section.name,
        section.root,
        section.train_fraction,
        config.seed,
        section.download,
        image_column=section.image_column,
        label_column=section.label_column,
    )


def load_dataset(
    name: str,
    root: str | Path | None = None,
    train_fraction: float = 1.0,
    seed: int = 0,
    download: bool = True,
    *,
    image_column: str | None = None,
    label_column: str | None = None,
) -> Dataset:
    """Load dataset ``name`` (see ``DATASETS.names()``, or ``hf:<hub name>``).

    ``train_fraction`` < 1 keeps a class-stratified subset of the TRAIN split chosen by ``seed``; the test
    split is always whole. ``download=False`` never touches the network. ``image_column`` and
    ``label_column`` name the columns of an ``hf:`` dataset where they are not the usual ones.
    """
    loader = DATASETS.get(name)
    if (
        isinstance(train_fraction, bool)
        or not isinstance(train_fraction, numbers.Real)
        or not 0.0 < train_fraction <= 1.0
    ):
        raise UserError(f"train_fraction must be in (0, 1], got {train_fraction!r}")
    columns = {k: v for k, v in (("image_column", image_column), ("label_column", label_column)) if v}
    if columns and not name.startswith(HF_PREFIX):
        raise UserError(
            f"dataset.{next(iter(columns))} applies to {HF_PREFIX}<hub name> datasets only, not {name!r}"
        )
    global _kept
    where = Path(root).expanduser() if root is not None else None
    key = (name, where, download, tuple(columns.items()))
    if _kept is not None and _kept[0] == key:
        ds = _kept[1]
    else:
        ds = loader(where, download, **columns)  # type: ignore[call-arg]
        if _keeping:
            _kept = (key, ds)
    if train_fraction < 1.0:
        keep = torch.from_numpy(stratified_subset(ds.train_y.numpy(), train_fraction, seed))
        groups = None if ds.train_groups is None else ds.train_groups[keep]
        ds = replace(ds, train_x=ds.train_x[keep], train_y=ds.train_y[keep], train_groups=groups)
    return ds


# ---------------------------------------------------------------------------------------------------------
# Datasets from files (URL and MD5 names are looked up when a loader runs, so tests can point them elsewhere)


@DATASETS.register("fmnist")
def load_fmnist(root: Path | None, download: bool) -> Dataset:
    """Fashion-MNIST (Xiao et al., arXiv:1708.07747, 2017): 60000/10000 1x28x28 grayscale images,
    10 classes."""
    folder = find_or_download(SOURCES["fmnist"], root, download, idx_fetch(FMNIST_URLS))
    tensors = load_idx_tensors("fmnist", folder)
    return Dataset(name="fmnist", num_classes=10, mean=(0.2860,), std=(0.3530,), **tensors)


@DATASETS.register("mnist")
def load_mnist(root: Path | None, download: bool) -> Dataset:
    """MNIST (LeCun et al., Proc. IEEE 1998): 60000/10000 1x28x28 grayscale digits, 10 classes."""
    folder = find_or_download(SOURCES["mnist"], root, download, idx_fetch(MNIST_URLS))
    tensors = load_idx_tensors("mnist", folder)
    return Dataset(name="mnist", num_classes=10, mean=(0.1307,), std=(0.3081,), **tensors)


@DATASETS.register("cifar10")
def load_cifar10(root: Path | None, download: bool) -> Dataset:
    """CIFAR-10 (Krizhevsky, tech. report 2009): 50000/10000 3x32x32 colour images, 10 classes (augmented
    at train time)."""
    folder = find_or_download(
        SOURCES["cifar10"],
        root,
        download,
        lambda dest: download_and_extract(CIFAR10_URL, dest, CIFAR10_DIR, CIFAR10_MD5),
    )
    tensors = read_cifar("cifar10", folder, CIFAR10_TRAIN, "test_batch", b"labels", 10)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    return Dataset(name="cifar10", num_classes=10, mean=mean, std=std, augment=True, **tensors)


@DATASETS.register("cifar100")
def load_cifar100(root: Path | None, download: bool) -> Dataset:
    """CIFAR-100 (Krizhevsky, tech. report 2009): 50000/10000 3x32x32 colour images, 100 fine classes
    (augmented at train time)."""
    folder = find_or_download(
        SOURCES["cifar100"],
        root,
        download,
        lambda dest: download_and_extract(CIFAR100_URL, dest, CIFAR100_DIR, CIFAR100_MD5),
    )
    tensors = read_cifar("cifar100", folder, ("train",), "test", b"fine_labels", 100)
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    return Dataset(name="cifar100", num_classes=100, mean=mean, std=std, augment=True, **tensors)


@DATASETS.register("svhn")
def load_svhn(root: Path | None, download: bool) -> Dataset:
    """SVHN, cropped digits (Netzer et al., NIPS Workshop 2011): 73257/26032 3x32x32 colour images,
    10 classes, label 10 mapped to 0."""
    folder = find_or_download(SOURCES["svhn"], root, download, lambda dest: svhn_fetch(SVHN_URL, dest))
    train_x, train_y = read_svhn(folder / SVHN_FILES[0])
    test_x, test_y = read_svhn(folder / SVHN_FILES[1])
    return Dataset(
        name="svhn",
        train_x=torch.from_numpy(train_x),
        train_y=torch.from_numpy(train_y),
        test_x=torch.from_numpy(test_x),
        test_y=torch.from_numpy(test_y),
        num_classes=10,
        mean=(0.4377, 0.4438, 0.4728),
        std=(0.1980, 0.2010, 0.1970),
        augment=True,
    )


@DATASETS.register("fc100")
def load_fc100(root: Path | None, download: bool) -> Dataset:
    """FC100 (Oreshkin et al., NeurIPS 2018): 30000/6000 3x32x32 images of CIFAR-100's 60 classes in FC100's
    12 training superclasses, read from the CIFAR-100 files (augmented at train time)."""
    full = load_cifar100(root, download)
    fine = torch.tensor(fc100_classes("train"), dtype=torch.int64)
    relabel = torch.full((100,), -1, dtype=torch.int64)
    relabel[fine] = torch.arange(len(fine))
    parts = {}
    for split, x, y in (("train", full.train_x, full.train_y), ("test", full.test_x, full.test_y)):
        keep = relabel[y] >= 0
        parts[f"{split}_x"], parts[f"{split}_y"] = x[keep], relabel[y[keep]]
    return Dataset(name="fc100", num_classes=len(fine), mean=full.mean, std=full.std, augment=True, **parts)


@DATASETS.register("tinyimagenet")
def load_tinyimagenet(root: Path | None, download: bool) -> Dataset:
    """Tiny-ImageNet (Stanford CS231n): 100000/10000 3x64x64 colour JPEGs, 200 classes, the labelled val
    split as test (augmented at train time)."""
    folder = find_or_download(
        SOURCES["tinyimagenet"],
        root,
        download,
        lambda dest: download_and_extract(TINY_URL, dest, TINY_DIR, TINY_MD5),
    )
    tensors, classes = read_tiny(folder)
    mean, std = channel_stats(tensors["train_x"])
    return Dataset(name="tinyimagenet", num_classes=classes, mean=mean, std=std, augment=True, **tensors)


@DATASETS.register("femnist")
def load_femnist(root: Path | None, download: bool) -> Dataset:
    """FEMNIST, LEAF JSON (Caldas et al., 2018): 1x28x28 handwritten characters, 62 classes, one writer per
    natural client (LEAF's full set: 3,550 writers, 805,263 images)."""
    folder = find_or_download(SOURCES["femnist"], root, download)
    tensors = read_leaf(folder, femnist_x, class_ids(FEMNIST_CLASSES, "FEMNIST"))
    mean, std = channel_stats(tensors["train_x"])
    return Dataset(name="femnist", num_classes=FEMNIST_CLASSES, mean=mean, std=std, **tensors)


@DATASETS.register("shakespeare")
def load_shakespeare(root: Path | None, download: bool) -> Dataset:
    """Shakespeare, LEAF JSON (Caldas et al., 2018): next character of 80-character lines, 80 symbols, one
    speaking role per natural client (LEAF's full set: 1,129 roles, 4,226,158 lines)."""
    folder = find_or_download(SOURCES["shakespeare"], root, download)
    tensors = read_leaf(folder, shakespeare_x, shakespeare_y)
    k = len(SHAKESPEARE_LETTERS)
    return Dataset(name="shakespeare", num_classes=k, mean=(), std=(), vocab_size=k, **tensors)


@DATASETS.register("isic2019")
def load_isic2019(root: Path | None, download: bool) -> Dataset:
    """Fed-ISIC2019 (FLamby, NeurIPS 2022): 18597/4650 3x200x200 dermoscopy images, 8 classes, 6 centres
    as natural clients (FLamby's preprocessed layout; Ogier du Terrail et al.).

    The classes are far from balanced, and FLamby's metric for this dataset (``fed_isic2019/metric.py``) is
    balanced accuracy, the mean per-class recall (scikit-learn's ``balanced_accuracy_score``): compare runs
    on ``global_balanced_acc``, which is that, rather than on GA (``global_acc``)."""
    folder = find_or_download(SOURCES["isic2019"], root, download)
    tensors = read_isic(folder)
    mean, std = channel_stats(tensors["train_x"])
    return Dataset(name="isic2019", num_classes=ISIC_CLASSES, mean=mean, std=std, augment=True, **tensors)


# ---------------------------------------------------------------------------------------------------------
# Built-in datasets: no files


@DATASETS.register("digits")
def load_digits(root: Path | None = None, download: bool = True) -> Dataset:
    """scikit-learn's 8x8 digits (UCI optical digits, Alpaydin and Kaynak 1998): 1797 images, 10 classes,
    split 80/20 stratified with a fixed seed."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = (bunch.images.astype(np.int64) * 255 // 16).astype(np.uint8)[:, None]  # 0..16 -> 0..255
    y = bunch.target.astype(np.int64)
    train = stratified_subset(y, 0.8, seed=0)  # fixed: the split never depends on the run seed
    test = np.setdiff1d(np.arange(len(y)), train)
    return Dataset(
        name="digits",
        train_x=torch.from_numpy(x[train]),
        train_y=torch.from_numpy(y[train]),
        test_x=torch.from_numpy(x[test]),
        test_y=torch.from_numpy(y[test]),
        num_classes=10,
        # Measured on the train split (1437 images); tests/test_datasets.py checks they still match.
        mean=(0.3046,),
        std=(0.3761,),
    )


SYNTHETIC_CLASSES = 10
SYNTHETIC_PER_CLASS = (100, 20)  # train, test


def _synthetic(name: str, upscale: int, mean: float, std: float) -> Dataset:
    """10 classes of 1x(8 upscale)x(8 upscale) images: a fixed random 8x8 on/off pattern per class, each
    pixel repeated upscale x upscale times, plus per-pixel noise. Deterministic (its own fixed seed),
    balanced: 1000 train / 200 test images in shuffled order."""
    rng = np.random.default_rng(20240601)
    templates = rng.random((SYNTHETIC_CLASSES, 8, 8)) < 0.5  # [K, 8, 8] on/off pixels
    templates = np.kron(templates, np.ones((upscale, upscale), dtype=bool))

    def split(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = rng.permutation(np.repeat(np.arange(SYNTHETIC_CLASSES), per_class))
        base = np.where(templates[y], 180.0, 60.0)
        x = np.clip(base + rng.normal(0.0, 50.0, size=base.shape), 0, 255).round().astype(np.uint8)
        return torch.from_numpy(x[:, None]), torch.from_numpy(y.astype(np.int64))

    train_x, train_y = split(SYNTHETIC_PER_CLASS[0])
    test_x, test_y = split(SYNTHETIC_PER_CLASS[1])
    return Dataset(
        name=name,
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=SYNTHETIC_CLASSES,
        mean=(mean,),  # measured on the train split; tests/test_datasets.py checks they still match
        std=(std,),
    )


@DATASETS.register("synthetic")
def load_synthetic(root: Path | None = None, download: bool = True) -> Dataset:
    """A tiny learnable set for tests: 10 classes of 1x8x8 images (a fixed pattern per class + noise)."""
    return _synthetic("synthetic", 1, 0.4758, 0.2908)


@DATASETS.register("synthetic16")
def load_synthetic16(root: Path | None = None, download: bool = True) -> Dataset:
    """``synthetic`` at 1x16x16 (each pattern pixel 2x2): large enough for the conv models (cnn1..cnn5)."""
    return _synthetic("synthetic16", 2, 0.4762, 0.2902)

"""Where each dataset's files are looked for and how they are recognised, without torch.

A :class:`Source` names a dataset's usual folder names, system folders, the probe that recognises its files
and what to tell a user who lacks them. Files are looked up in the configured root, then ``$FEDPCD_DATA``,
then the system folders, then the download cache ``~/.cache/fedpcd``; in each of those the folder itself,
``<folder>/<name>`` and ``<folder>/<usual sub-folder>`` are tried. :func:`check_files` tells a run whose
files are missing and cannot be downloaded the loader's own line before torch is imported; downloading is
``fedpcd.data.files``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedpcd.errors import UserError

ENV_VAR = "FEDPCD_DATA"


@dataclass(frozen=True)
class Source:
    """A dataset's files: ``probe(folder)`` returns the folder holding them (``folder`` or a fixed
    sub-folder of it) or None; ``what`` names them in the error; ``downloadable=False``: nothing can be
    downloaded (the files need the publisher's licence or preprocessing), ``url`` says where to get them."""

    name: str
    probe: Callable[[Path], Path | None]
    what: str
    subdirs: tuple[str, ...] = ()
    system: tuple[str, ...] = ()
    downloadable: bool = True
    url: str = ""


def cache_dir() -> Path:
    """The download cache: ``$XDG_CACHE_HOME/fedpcd`` or ``~/.cache/fedpcd``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fedpcd"


def download_base(root: Path | None) -> Path:
    """The folder downloads go under: ``root``, else ``$FEDPCD_DATA``, else the cache."""
    env = os.environ.get(ENV_VAR)
    if root is not None:
        return root
    return Path(env).expanduser() if env else cache_dir()


def candidates(source: Source, root: Path | None) -> list[Path]:
    """Folders to try, in order: each base, base/<name>, base/<usual sub-folders>; the system folders come
    after ``$FEDPCD_DATA``, before the cache."""
    env = os.environ.get(ENV_VAR)
    bases = [*([root] if root is not None else []), *([Path(env).expanduser()] if env else []), cache_dir()]
    out: list[Path] = []
    for i, base in enumerate(bases):
        if i == len(bases) - 1:
            out.extend(Path(s) for s in source.system)
        for sub in ("", source.name, *source.subdirs):
            p = base / sub if sub else base
            if p not in out:
                out.append(p)
    return out


def locate(source: Source, root: Path | None) -> tuple[Path | None, list[Path]]:
    """The folder ``source.probe`` finds in the first candidate that has one (None if none), and the
    candidates looked in."""
    looked = candidates(source, root)
    return next((found for p in looked if (found := source.probe(p)) is not None), None), looked


def missing_line(source: Source, looked: Sequence[Path], why: str = "") -> str:
    """The one line for files not found in ``looked``; ``why``: why they were not downloaded."""
    places = ", ".join(str(p) for p in looked)
    get = f" (get them from {source.url})" if source.url else ""
    because = f"; {why}" if why else ""
    return (
        f"{source.name} files not found in {places}{because}; put {source.what} under one of those folders "
        f"or set {ENV_VAR}{get}"
    )


def find_local(source: Source, root: Path | None, download: bool) -> Path | None:
    """The folder holding ``source``'s files; None when there is none but they may be downloaded; else
    UserError (not downloadable, or ``download`` off)."""
    found, looked = locate(source, root)
    if found is None and not (download and source.downloadable):
        raise UserError(missing_line(source, looked, "download disabled" if source.downloadable else ""))
    return found


def check_files(name: str, root: str | Path | None, download: bool) -> None:
    """UserError with the loader's line if the built-in dataset ``name`` has files, none are found and
    they cannot be downloaded (not downloadable, or ``download`` off); nothing for other names."""
    source = SOURCES.get(name)
    if source is not None and not (download and source.downloadable):
        find_local(source, Path(root).expanduser() if root is not None else None, download)


# ----- the probes


def files_probe(folder_name: str, files: Sequence[str]) -> Callable[[Path], Path | None]:
    """Looks for ``files`` in ``<candidate>/<folder_name>/``, then in the candidate itself."""

    def probe(base: Path) -> Path | None:
        for folder in (base / folder_name, base):
            if all((folder / f).is_file() for f in files):
                return folder
        return None

    return probe


IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def idx_path(folder: Path, stem: str) -> Path | None:
    """``folder/stem`` or ``folder/stem.gz``, whichever is a file (None if neither)."""
    return next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)


def has_idx(folder: Path) -> Path | None:
    """``folder`` if it holds the four IDX files (raw or .gz), else None."""
    return folder if all(idx_path(folder, stem) is not None for stem in IDX_FILES.values()) else None


CIFAR10_DIR = "cifar-10-batches-py"
CIFAR100_DIR = "cifar-100-python"
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")
TINY_DIR = "tiny-imagenet-200"
TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
ISIC_IMAGES = "ISIC_2019_Training_Input_preprocessed"
ISIC_SPLIT = "train_test_split"
ISIC_URL = "https://github.com/owkin/FLamby/tree/main/flamby/datasets/fed_isic2019"
LEAF_SPLITS = ("train", "test")
LEAF_URL = "https://github.com/TalwalkarLab/leaf"


def has_tiny(folder: Path) -> Path | None:
    """The ``tiny-imagenet-200`` folder under ``folder`` (or ``folder`` itself) if it has wnids.txt, train/
    and val/val_annotations.txt."""
    for base in (folder / TINY_DIR, folder):
        if (
            (base / "wnids.txt").is_file()
            and (base / "train").is_dir()
            and (base / "val" / "val_annotations.txt").is_file()
        ):
            return base
    return None


def isic_split_file(folder: Path) -> Path | None:
    """FLamby's train_test_split file in ``folder`` (with or without .csv), or None."""
    return next((p for p in (folder / ISIC_SPLIT, folder / f"{ISIC_SPLIT}.csv") if p.is_file()), None)


def has_isic(folder: Path) -> Path | None:
    """``folder`` if it holds FLamby's preprocessed image folder and its train_test_split CSV."""
    return folder if (folder / ISIC_IMAGES).is_dir() and isic_split_file(folder) is not None else None


def has_leaf(folder: Path) -> Path | None:
    """``folder`` if it has ``train/`` and ``test/`` sub-folders holding ``*.json`` files."""
    ok = all((folder / s).is_dir() and any((folder / s).glob("*.json")) for s in LEAF_SPLITS)
    return folder if ok else None


_IDX_WHAT = "train-images-idx3-ubyte.gz and the other three IDX files"
_LEAF_WHAT = "LEAF's train/ and test/ folders of *.json files"
_FMNIST_DIRS = ("fashion-mnist", "fashion_mnist", "FashionMNIST", "FashionMNIST/raw", "fashion")

# the built-in datasets that read files (fc100 reads CIFAR-100's)
SOURCES = {
    "fmnist": Source("fmnist", has_idx, _IDX_WHAT, _FMNIST_DIRS, ("/usr/share/datasets/fashion-mnist",)),
    "mnist": Source("mnist", has_idx, _IDX_WHAT, ("MNIST", "MNIST/raw"), ("/usr/share/datasets/mnist",)),
    "cifar10": Source(
        "cifar10",
        files_probe(CIFAR10_DIR, (*CIFAR10_TRAIN, "test_batch")),
        f"{CIFAR10_DIR}/",
        ("cifar-10", "CIFAR10"),
    ),
    "cifar100": Source(
        "cifar100",
        files_probe(CIFAR100_DIR, ("train", "test")),
        f"{CIFAR100_DIR}/",
        ("cifar-100", "CIFAR100"),
    ),
    "svhn": Source("svhn", files_probe("", SVHN_FILES), " and ".join(SVHN_FILES), ("SVHN",)),
    "tinyimagenet": Source(
        "tinyimagenet",
        has_tiny,
        f"{TINY_DIR}/ (wnids.txt, train/, val/)",
        ("tiny-imagenet", "TinyImageNet"),
        url=TINY_URL,
    ),
    "femnist": Source(
        "femnist",
        has_leaf,
        _LEAF_WHAT,
        ("femnist/data", "leaf/data/femnist/data", "FEMNIST"),
        downloadable=False,
        url=LEAF_URL,
    ),
    "shakespeare": Source(
        "shakespeare",
        has_leaf,
        _LEAF_WHAT,
        ("shakespeare/data", "leaf/data/shakespeare/data"),
        downloadable=False,
        url=LEAF_URL,
    ),
    "isic2019": Source(
        "isic2019",
        has_isic,
        f"{ISIC_IMAGES}/ and FLamby's {ISIC_SPLIT} file",
        ("fed_isic2019", "ISIC2019"),
        downloadable=False,
        url=ISIC_URL,
    ),
}
SOURCES["fc100"] = SOURCES["cifar100"]

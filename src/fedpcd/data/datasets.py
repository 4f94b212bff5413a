"""Datasets as in-memory tensors: loaders for the standard files, file lookup and download, subsetting.

Every dataset is loaded once into uint8 image tensors ``[N, C, H, W]`` and int64 label tensors; clients
are index tensors into it (see ``fedpcd.data.partition``). Files are looked up in the configured root,
then ``$FEDPCD_DATA``, then system locations, then the download cache; when nothing is found they are
downloaded from the official source (if allowed), otherwise a UserError says where to put them.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import hashlib
import io
import numbers
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct, scalar
    from numpy._core.numeric import _frombuffer
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct, scalar
    from numpy.core.numeric import _frombuffer

from fedpcd.data.transforms import normalize
from fedpcd.errors import UserError, clip
from fedpcd.registry import Registry
from fedpcd.utils import current_umask

DOWNLOAD_TIMEOUT_S = 10.0
ENV_VAR = "FEDPCD_DATA"
SKIP_CHECKSUMS_VAR = "FEDPCD_SKIP_CHECKSUMS"  # set to 1 to use a modified copy of an official file


@dataclass(eq=False)
class Dataset:
    """One dataset held in memory: uint8 images ``[N, C, H, W]`` and int64 labels for train and test.

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

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[2] != x.shape[3]:
                got = f"{x.dtype} {tuple(x.shape)}"
                raise ValueError(f"{self.name} {split}_x must be uint8 [N, C, H, H], got {got}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                got = f"{y.dtype} {tuple(y.shape)}"
                raise ValueError(f"{self.name} {split}_y must be int64 [{x.shape[0]}], got {got}")
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise ValueError(f"{self.name}: train and test images differ in shape")
        if len(self.mean) != self.in_channels or len(self.std) != self.in_channels:
            raise ValueError(f"{self.name}: mean/std need {self.in_channels} entries")

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[2])

    def normalized(self, split: str) -> torch.Tensor:
        """Float32 ``(x / 255 - mean) / std`` of the "train" or "test" images, computed once per instance."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        # Cached in the instance __dict__, not as a dataclass field: never compared, printed or replaced.
        cache: dict[str, torch.Tensor] = self.__dict__.setdefault("_normalized_cache", {})
        if split not in cache:
            x = self.train_x if split == "train" else self.test_x
            cache[split] = normalize(x, self.mean, self.std)
        return cache[split]

    def __repr__(self) -> str:
        c, h, w = self.train_x.shape[1:]
        return (
            f"Dataset({self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
            f"images={c}x{h}x{w}, classes={self.num_classes}, augment={self.augment})"
        )


Loader = Callable[[Path | None, bool], Dataset]
DATASETS: Registry[Loader] = Registry("dataset")


def load_dataset(
    name: str,
    root: str | Path | None = None,
    train_fraction: float = 1.0,
    seed: int = 0,
    download: bool = True,
) -> Dataset:
    """Load dataset ``name`` (see ``DATASETS.names()``).

    ``train_fraction`` < 1 keeps a class-stratified subset of the TRAIN split chosen by ``seed``; the test
    split is always whole. ``download=False`` never touches the network.
    """
    loader = DATASETS.get(name)
    if (
        isinstance(train_fraction, bool)
        or not isinstance(train_fraction, numbers.Real)
        or not 0.0 < train_fraction <= 1.0
    ):
        raise UserError(f"train_fraction must be in (0, 1], got {train_fraction!r}")
    ds = loader(Path(root).expanduser() if root is not None else None, download)
    if train_fraction < 1.0:
        keep = torch.from_numpy(stratified_subset(ds.train_y.numpy(), train_fraction, seed))
        ds = replace(ds, train_x=ds.train_x[keep], train_y=ds.train_y[keep])
    return ds


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


# ---------------------------------------------------------------------------------------------------------
# File lookup and download


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fedpcd"


def _search_bases(root: Path | None) -> list[Path]:
    """Top-level folders to search, in order: root, $FEDPCD_DATA, then the download cache."""
    bases = []
    if root is not None:
        bases.append(root)
    env = os.environ.get(ENV_VAR)
    if env:
        bases.append(Path(env).expanduser())
    bases.append(_cache_dir())
    return bases


def _download_base(root: Path | None) -> Path:
    env = os.environ.get(ENV_VAR)
    if root is not None:
        return root
    return Path(env).expanduser() if env else _cache_dir()


def _candidates(name: str, subdirs: Sequence[str], root: Path | None, system: Sequence[str]) -> list[Path]:
    """Folders to try: each base, base/<name>, base/<usual sub-folders>; system folders after $FEDPCD_DATA."""
    bases = _search_bases(root)
    out: list[Path] = []
    for i, base in enumerate(bases):
        if i == len(bases) - 1:  # the cache comes after the system locations
            out.extend(Path(s) for s in system)
        for sub in ("", name, *subdirs):
            p = base / sub if sub else base
            if p not in out:
                out.append(p)
    return out


def _find_or_download(
    name: str,
    root: Path | None,
    download: bool,
    subdirs: Sequence[str],
    system: Sequence[str],
    probe: Callable[[Path], Path | None],
    fetch: Callable[[Path], None],
    what: str,
) -> Path:
    """The data folder ``probe`` finds in the first candidate that has one; else download, or fail clearly.

    ``probe(candidate)`` returns the folder holding the files (the candidate or a fixed sub-folder of it)
    or None. Downloads go to ``<root | $FEDPCD_DATA | ~/.cache/fedpcd>/<name>``.
    """
    looked = _candidates(name, subdirs, root, system)
    for folder in looked:
        found = probe(folder)
        if found is not None:
            return found
    places = ", ".join(str(p) for p in looked)
    if not download:
        raise UserError(
            f"{name} files not found in {places}; download disabled; put {what} under one of those folders "
            f"or set {ENV_VAR}"
        )
    dest = _download_base(root) / name
    new_dirs = [d for d in (dest, *dest.parents) if not d.exists()]  # innermost first
    try:
        dest.mkdir(parents=True, exist_ok=True)
        fetch(dest)
    except Exception as exc:  # network, HTTP, disk: all end in the same advice
        for d in new_dirs:  # leave no empty folders behind
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(exc, UserError):
            raise
        reason = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        raise UserError(
            f"{name} files not found in {places}; download failed ({reason}); put {what} under one of those "
            f"folders or set {ENV_VAR}"
        ) from None
    found = probe(dest)
    if found is None:
        raise UserError(f"{name}: downloaded into {dest} but the expected files are not there")
    return found


def _download_file(urls: Sequence[str], target: Path) -> None:
    """Fetch the first URL that works into ``target`` atomically (temp file beside it, then rename)."""
    errors = []
    for url in urls:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        os.fchmod(fd, 0o666 & ~current_umask())  # a normal file, not mkstemp's 0600
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                shutil.copyfileobj(resp, out, length=1 << 20)
            os.replace(tmp, target)
            return
        except Exception as exc:
            errors.append(f"{url}: {exc}")
        finally:
            Path(tmp).unlink(missing_ok=True)
    raise OSError("; ".join(errors))


def _download_and_extract(url: str, dest: Path, folder: str) -> None:
    """Download a .tar.gz, extract it into a staging folder, then move ``folder`` (or its missing files) in.

    Every file lands by rename, so an interrupted download or extraction never leaves a partial file.
    """
    archive = dest / url.rsplit("/", 1)[-1]
    _download_file([url], archive)
    staging = Path(tempfile.mkdtemp(prefix=".extract.", dir=dest))
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, filter="data")
            else:  # pragma: no cover - Python without extraction filters
                for member in tar.getmembers():
                    if member.name.startswith(("/", "..")) or ".." in Path(member.name).parts:
                        raise OSError(f"unsafe path {member.name!r} in {archive.name}")
                tar.extractall(staging)
        if not (staging / folder).is_dir():
            raise OSError(f"{archive.name} does not contain {folder}/")
        if not (dest / folder).exists():
            os.replace(staging / folder, dest / folder)
        else:  # an incomplete earlier copy: keep what is there, add what is missing
            for f in (staging / folder).iterdir():
                if not (dest / folder / f.name).exists():
                    os.replace(f, dest / folder / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        archive.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------
# Checksums of the official files
#
# A file whose shape (or sample count) is that of an official file must also have its content: MD5 below;
# a CIFAR batch large enough to hold the official file's images is checked before it is parsed. Files of
# other shapes (subsets, test fixtures, other data in the same format) are not checked. For IDX
# files the MD5 is of the uncompressed content, so a re-compressed .gz (Debian's dataset-fashion-mnist)
# matches too. Sources: the publishers' pages as mirrored by torchvision; the Fashion-MNIST values were
# checked against /usr/share/datasets/fashion-mnist.


def _md5(data: bytes | bytearray | Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    if isinstance(data, Path):
        with data.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    else:
        digest.update(data)
    return digest.hexdigest()


def verify_md5(path: Path, data: bytes | bytearray | Path, expected: str) -> None:
    """UserError naming ``path`` if the MD5 of ``data`` is not ``expected`` ($FEDPCD_SKIP_CHECKSUMS: skip)."""
    if os.environ.get(SKIP_CHECKSUMS_VAR, "").strip() not in ("", "0"):
        return
    got = _md5(data)
    if got != expected:
        raise UserError(
            f"{path} is corrupt: it has the official file's shape but not its content (MD5 {got}, expected "
            f"{expected}); delete it so that it is downloaded again, or set {SKIP_CHECKSUMS_VAR}=1 to use a "
            "modified copy"
        )


# ---------------------------------------------------------------------------------------------------------
# IDX (MNIST, Fashion-MNIST)

_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}

FMNIST_URLS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
)
# (dims, MD5 of the uncompressed file) of the official files
_IDX_DIMS = {
    "train_x": (60000, 28, 28),
    "train_y": (60000,),
    "test_x": (10000, 28, 28),
    "test_y": (10000,),
}
IDX_MD5 = {
    "fmnist": {
        "train_x": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train_y": "9018921c3c673c538a1fc5bad174d6f9",
        "test_x": "8181f5470baa50b63fa0f6fddb340f0a",
        "test_y": "15d484375f8d13e6eb1aabb0c3f46965",
    },
    "mnist": {
        "train_x": "6bbc9ace898e44ae57da46a324031adb",
        "train_y": "a25bea736e30d166cdddb491f175f624",
        "test_x": "2646ac647ad5339dbf082846283269ea",
        "test_y": "27ae3e4e09519cfbb04c329615203637",
    },
}

MNIST_URLS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)


def _idx_path(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _has_idx(folder: Path) -> Path | None:
    return folder if all(_idx_path(folder, stem) is not None for stem in _IDX_FILES.values()) else None


def _read_bytes(path: Path) -> bytearray:
    """The file's (decompressed) bytes in a writable buffer, so torch can wrap it without copying again."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return bytearray(fh.read())
        buf = bytearray(path.stat().st_size)
        with path.open("rb") as fh:
            n = fh.readinto(buf)
        return buf[:n] if n != len(buf) else buf
    except (OSError, EOFError, zlib.error) as exc:
        raise UserError(f"cannot read {path}: {exc}; delete it and download again") from None


def read_idx(path: Path, ndim: int, official: tuple[tuple[int, ...], str] | None = None) -> np.ndarray:
    """Parse an uint8 IDX file (raw or gzipped) with ``ndim`` dimensions; any inconsistency -> UserError.

    ``official``: (dims, MD5) of the official file: a file with those dims must have that content."""
    buf = _read_bytes(path)
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise UserError(f"{path} is truncated: {len(buf)} bytes, shorter than the IDX header")
    magic = bytes(buf[:4])
    if magic != bytes((0, 0, 0x08, ndim)):
        raise UserError(
            f"{path} is not an uint8 IDX file with {ndim} dimension(s): magic number {magic.hex()}, "
            f"expected 000008{ndim:02x}"
        )
    dims = tuple(int(d) for d in np.frombuffer(buf, dtype=">u4", count=ndim, offset=4))
    if 0 in dims:
        raise UserError(f"{path} holds no data: its header says {'x'.join(map(str, dims))}")
    expected = int(np.prod(dims, dtype=np.int64))
    if len(buf) - header != expected:
        raise UserError(
            f"{path} is truncated or corrupt: header says {'x'.join(map(str, dims))} = {expected} bytes "
            f"of data, file has {len(buf) - header}"
        )
    if official is not None and dims == official[0]:
        verify_md5(path, buf, official[1])
    return np.frombuffer(buf, dtype=np.uint8, offset=header).reshape(dims)


def _load_idx_dataset(name: str, folder: Path, mean: tuple[float, ...], std: tuple[float, ...]) -> Dataset:
    arrays = {}
    for key, stem in _IDX_FILES.items():
        path = _idx_path(folder, stem)
        assert path is not None
        known = IDX_MD5.get(name, {}).get(key)
        official = (_IDX_DIMS[key], known) if known else None
        arrays[key] = (read_idx(path, 3 if key.endswith("x") else 1, official), path)
    tensors = {}
    for split in ("train", "test"):
        (x, x_path), (y, y_path) = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.shape[1] != x.shape[2]:
            raise UserError(
                f"{x_path} holds {x.shape[1]}x{x.shape[2]} images; only square ones are supported"
            )
        if len(x) != len(y):
            raise UserError(f"{x_path} has {len(x)} images but {y_path} has {len(y)} labels")
        if len(y) and y.max() >= 10:
            raise UserError(f"{y_path} has label {int(y.max())}; expected 0..9")
        tensors[f"{split}_x"] = torch.from_numpy(x).unsqueeze(1)
        tensors[f"{split}_y"] = torch.from_numpy(y).to(torch.int64)
    return Dataset(name=name, num_classes=10, mean=mean, std=std, **tensors)


def _idx_fetch(urls: Sequence[str]) -> Callable[[Path], None]:
    def fetch(dest: Path) -> None:
        for stem in _IDX_FILES.values():
            if _idx_path(dest, stem) is None:
                _download_file([u + stem + ".gz" for u in urls], dest / f"{stem}.gz")

    return fetch


@DATASETS.register("fmnist")
def load_fmnist(root: Path | None, download: bool) -> Dataset:
    """Fashion-MNIST: 60000/10000 1x28x28 grayscale images, 10 classes."""
    folder = _find_or_download(
        "fmnist",
        root,
        download,
        subdirs=("fashion-mnist", "fashion_mnist", "FashionMNIST", "FashionMNIST/raw", "fashion"),
        system=("/usr/share/datasets/fashion-mnist",),
        probe=_has_idx,
        fetch=_idx_fetch(FMNIST_URLS),
        what="train-images-idx3-ubyte.gz and the other three IDX files",
    )
    return _load_idx_dataset("fmnist", folder, (0.2860,), (0.3530,))


@DATASETS.register("mnist")
def load_mnist(root: Path | None, download: bool) -> Dataset:
    """MNIST: 60000/10000 1x28x28 grayscale digits, 10 classes."""
    folder = _find_or_download(
        "mnist",
        root,
        download,
        subdirs=("MNIST", "MNIST/raw"),
        system=("/usr/share/datasets/mnist",),
        probe=_has_idx,
        fetch=_idx_fetch(MNIST_URLS),
        what="train-images-idx3-ubyte.gz and the other three IDX files",
    )
    return _load_idx_dataset("mnist", folder, (0.1307,), (0.3081,))


# ---------------------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python pickle batches)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
_CIFAR10_DIR = "cifar-10-batches-py"
_CIFAR100_DIR = "cifar-100-python"
_CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
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


def _read_cifar_batch(
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


def _cifar_dataset(
    name: str,
    folder: Path,
    train: Sequence[str],
    test: str,
    label_key: bytes,
    num_classes: int,
    stats: tuple[tuple[float, ...], tuple[float, ...]],
) -> Dataset:
    known = CIFAR_OFFICIAL.get(name, {})
    parts = [_read_cifar_batch(folder / f, label_key, num_classes, known.get(f)) for f in train]
    test_x, test_y = _read_cifar_batch(folder / test, label_key, num_classes, known.get(test))
    return Dataset(
        name=name,
        train_x=torch.from_numpy(np.concatenate([p[0] for p in parts])),
        train_y=torch.from_numpy(np.concatenate([p[1] for p in parts])),
        test_x=torch.from_numpy(np.ascontiguousarray(test_x)),
        test_y=torch.from_numpy(test_y),
        num_classes=num_classes,
        mean=stats[0],
        std=stats[1],
        augment=True,
    )


def _files_probe(folder_name: str, files: Sequence[str]) -> Callable[[Path], Path | None]:
    """Looks for ``files`` in ``<candidate>/<folder_name>/``, then in the candidate itself."""

    def probe(base: Path) -> Path | None:
        for folder in (base / folder_name, base):
            if all((folder / f).is_file() for f in files):
                return folder
        return None

    return probe


@DATASETS.register("cifar10")
def load_cifar10(root: Path | None, download: bool) -> Dataset:
    """CIFAR-10: 50000/10000 3x32x32 colour images, 10 classes (augmented at train time)."""
    files = (*_CIFAR10_TRAIN, "test_batch")
    folder = _find_or_download(
        "cifar10",
        root,
        download,
        subdirs=("cifar-10", "CIFAR10"),
        system=(),
        probe=_files_probe(_CIFAR10_DIR, files),
        fetch=lambda dest: _download_and_extract(CIFAR10_URL, dest, _CIFAR10_DIR),
        what=f"{_CIFAR10_DIR}/",
    )
    stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    return _cifar_dataset("cifar10", folder, _CIFAR10_TRAIN, "test_batch", b"labels", 10, stats)


@DATASETS.register("cifar100")
def load_cifar100(root: Path | None, download: bool) -> Dataset:
    """CIFAR-100: 50000/10000 3x32x32 colour images, 100 fine classes (augmented at train time)."""
    folder = _find_or_download(
        "cifar100",
        root,
        download,
        subdirs=("cifar-100", "CIFAR100"),
        system=(),
        probe=_files_probe(_CIFAR100_DIR, ("train", "test")),
        fetch=lambda dest: _download_and_extract(CIFAR100_URL, dest, _CIFAR100_DIR),
        what=f"{_CIFAR100_DIR}/",
    )
    stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    return _cifar_dataset("cifar100", folder, ("train",), "test", b"fine_labels", 100, stats)


# ---------------------------------------------------------------------------------------------------------
# SVHN (.mat)

SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"
_SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")
SVHN_OFFICIAL = {  # (images, MD5) of the official files
    "train_32x32.mat": (73257, "e26dedcc434d2e4c54c9b2d4a06d8373"),
    "test_32x32.mat": (26032, "eb5a983be6a315427106f1b164d9cef3"),
}


def _read_svhn(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import scipy.io

    try:
        mat = scipy.io.loadmat(str(path))
    except Exception as exc:
        raise UserError(f"cannot read SVHN file {path}: {type(exc).__name__}: {exc}") from None
    if "X" not in mat or "y" not in mat:
        raise UserError(f"{path} is not an SVHN file (needs variables X and y)")
    x, y = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.shape[3] != len(y):
        raise UserError(f"{path}: X must be uint8 [32, 32, 3, N] with N = len(y), got {x.dtype} {x.shape}")
    official = SVHN_OFFICIAL.get(path.name)
    if official is not None and len(y) == official[0]:
        verify_md5(path, path, official[1])
    y = y.astype(np.int64)
    if len(y) and (y.min() < 1 or y.max() > 10):
        raise UserError(f"{path}: labels must be 1..10 (10 = digit 0), got {int(y.min())}..{int(y.max())}")
    y[y == 10] = 0
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), y


@DATASETS.register("svhn")
def load_svhn(root: Path | None, download: bool) -> Dataset:
    """SVHN (cropped digits): 73257/26032 3x32x32 colour images, 10 classes, label 10 mapped to 0."""

    def fetch(dest: Path) -> None:
        for f in _SVHN_FILES:
            if not (dest / f).is_file():
                _download_file([SVHN_URL + f], dest / f)

    folder = _find_or_download(
        "svhn",
        root,
        download,
        subdirs=("SVHN",),
        system=(),
        probe=lambda p: p if all((p / f).is_file() for f in _SVHN_FILES) else None,
        fetch=fetch,
        what=" and ".join(_SVHN_FILES),
    )
    train_x, train_y = _read_svhn(folder / _SVHN_FILES[0])
    test_x, test_y = _read_svhn(folder / _SVHN_FILES[1])
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


# ---------------------------------------------------------------------------------------------------------
# Built-in datasets: no files


@DATASETS.register("digits")
def load_digits(root: Path | None = None, download: bool = True) -> Dataset:
    """scikit-learn's 8x8 digits (1797 images, 10 classes), split 80/20 stratified with a fixed seed."""
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

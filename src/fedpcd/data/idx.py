"""IDX files (MNIST, Fashion-MNIST): download, parsing and the official files' checksums.

The MD5 of an IDX file is that of its uncompressed content, so a re-compressed .gz (Debian's
dataset-fashion-mnist) matches too; the Fashion-MNIST values were checked against
/usr/share/datasets/fashion-mnist.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from fedpcd.data.files import download_file, verify_md5
from fedpcd.data.sources import IDX_FILES, idx_path
from fedpcd.errors import UserError

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


def load_idx_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    """``train_x``, ``train_y``, ``test_x``, ``test_y`` of the four IDX files in ``folder`` (uint8 images
    ``[N, 1, H, H]``, int64 labels 0..9); ``name`` picks the official checksums (IDX_MD5)."""
    arrays = {}
    for key, stem in IDX_FILES.items():
        path = idx_path(folder, stem)
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
    return tensors


def idx_fetch(urls: Sequence[str]) -> Callable[[Path], None]:
    """A ``find_or_download`` fetch: the missing IDX files (.gz) from the first of ``urls`` that works.

    No MD5 for the .gz itself: mirrors re-compress it, so only the uncompressed content is checked
    (``read_idx``).
    """

    def fetch(dest: Path) -> None:
        for stem in IDX_FILES.values():
            if idx_path(dest, stem) is None:
                download_file([u + stem + ".gz" for u in urls], dest / f"{stem}.gz")

    return fetch

"""SVHN (cropped digits, .mat files): parsing, download and the official files' checksums."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedpcd.data.files import download_file, verify_md5
from fedpcd.data.sources import SVHN_FILES
from fedpcd.errors import UserError

SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"
SVHN_OFFICIAL = {  # (images, MD5) of the official files
    "train_32x32.mat": (73257, "e26dedcc434d2e4c54c9b2d4a06d8373"),
    "test_32x32.mat": (26032, "eb5a983be6a315427106f1b164d9cef3"),
}


def read_svhn(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One .mat file's images ``[N, 3, 32, 32]`` (uint8) and labels 0..9 (int64; the file's 10 is 0)."""
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


def svhn_fetch(url: str, dest: Path) -> None:
    """Download the missing SVHN files from ``url`` (the folder holding them) into ``dest``; each lands
    only if it has its official MD5 (``SVHN_OFFICIAL``)."""
    for f in SVHN_FILES:
        if not (dest / f).is_file():
            download_file([url + f], dest / f, SVHN_OFFICIAL[f][1])

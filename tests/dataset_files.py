"""Writers of the datasets' real on-disk formats (IDX, CIFAR pickle batches, SVHN .mat) with random images,
shared by the tests that need dataset files."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import scipy.io


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> Path:
    data = bytes((0, 0, 0x08, arr.ndim)) + np.asarray(arr.shape, dtype=">u4").tobytes() + arr.tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_idx_set(folder: Path, gz: bool, n_train: int = 30, n_test: int = 12, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for stem, arr in arrays.items():
        write_idx(folder / stem, arr, gz)
    return arrays


def make_cifar(
    base: Path, hundred: bool, per_batch: int = 4, seed: int = 0, n_test: int | None = None
) -> tuple[np.ndarray, ...]:
    """CIFAR-10's five train batches of ``per_batch`` images (CIFAR-100: one file of 5 x ``per_batch``) and
    a test file of ``n_test`` (default ``per_batch``); returns (train_x, train_y, test_x, test_y)."""
    rng = np.random.default_rng(seed)
    folder = base / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True, exist_ok=True)
    k = 100 if hundred else 10
    names = ["train"] if hundred else [f"data_batch_{i}" for i in range(1, 6)]
    train_x, train_y = [], []
    for name in [*names, "test"] if hundred else [*names, "test_batch"]:
        n = per_batch * (5 if hundred and name == "train" else 1)
        if name.startswith("test") and n_test is not None:
            n = n_test
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, k, n)]
        batch = {b"batch_label": b"x", b"data": data}
        if hundred:
            batch[b"fine_labels"], batch[b"coarse_labels"] = labels, [v // 5 for v in labels]
        else:
            batch[b"labels"] = labels
        (folder / name).write_bytes(pickle.dumps(batch))
        if name.startswith("test"):
            test_x, test_y = data, np.array(labels)
        else:
            train_x.append(data)
            train_y.append(np.array(labels))
    return np.concatenate(train_x), np.concatenate(train_y), test_x, test_y


def make_svhn(folder: Path, n_train: int, n_test: int, seed: int = 0) -> dict:
    """SVHN's train_32x32.mat and test_32x32.mat (X uint8 [32, 32, 3, n], y 1..10 cycling, 10 = digit 0);
    returns {split: (X, y)}."""
    rng = np.random.default_rng(seed)
    mats = {}
    for split, n in (("train", n_train), ("test", n_test)):
        # drawn as [n, 3, 32, 32] and transposed: column-major as MATLAB stores it, so savemat need not
        # reorder the array (seconds at SVHN's train size)
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8).T
        y = (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)
        scipy.io.savemat(folder / f"{split}_32x32.mat", {"X": x, "y": y})
        mats[split] = (x, y)
    return mats


def fmnist_test_slice(source: Path, folder: Path, fraction: float) -> Path:
    """``folder``/fashion-mnist: the real Fashion-MNIST train files of ``source`` (linked) and a
    class-stratified ``fraction`` of its test set, for tests whose point is not the test set's size."""
    from fedpcd.data.datasets import load_dataset
    from fedpcd.data.tensors import stratified_subset

    fmnist = folder / "fashion-mnist"
    fmnist.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        (fmnist / name).symlink_to(source / name)
    test = load_dataset("fmnist", root=source, download=False)
    keep = stratified_subset(test.test_y.numpy(), fraction, seed=0)
    write_idx(fmnist / "t10k-images-idx3-ubyte", test.test_x[keep, 0].numpy(), gz=True)
    write_idx(fmnist / "t10k-labels-idx1-ubyte", test.test_y[keep].numpy().astype(np.uint8), gz=True)
    return folder

"""Dataset loaders on small files written in the real formats, lookup/download rules, subsetting."""

from __future__ import annotations

import dataclasses
import gzip
import os
import pickle
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import requires_fmnist
from fedpcd.data import datasets as dsmod
from fedpcd.data.datasets import DATASETS, Dataset, load_dataset, stratified_subset
from fedpcd.errors import UserError

_ORIGINAL_FEDPCD_DATA = os.environ.get("FEDPCD_DATA")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path_factory):
    """No $FEDPCD_DATA, a private download cache, and no network unless a test installs its own URLs."""
    monkeypatch.delenv("FEDPCD_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))

    def no_network(url, *args, **kwargs):
        if str(url).startswith("file:"):
            return _real_urlopen(url, *args, **kwargs)
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)


_real_urlopen = urllib.request.urlopen


# ---------------------------------------------------------------------------------------------------------
# Writers for the real file formats


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


def make_cifar(base: Path, hundred: bool, per_batch: int = 4, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    folder = base / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True, exist_ok=True)
    k = 100 if hundred else 10
    names = ["train"] if hundred else [f"data_batch_{i}" for i in range(1, 6)]
    train_x, train_y = [], []
    for name in [*names, "test"] if hundred else [*names, "test_batch"]:
        n = per_batch * (5 if hundred and name == "train" else 1)
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


# ---------------------------------------------------------------------------------------------------------
# IDX: MNIST / Fashion-MNIST


@pytest.mark.parametrize("name", ["mnist", "fmnist"])
@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
def test_idx_round_trip(tmp_path, name, gz):
    arrays = make_idx_set(tmp_path, gz)
    ds = load_dataset(name, root=str(tmp_path), download=False)
    assert ds.name == name and ds.num_classes == 10 and not ds.augment
    assert ds.train_x.dtype == torch.uint8 and ds.train_x.shape == (30, 1, 28, 28)
    assert ds.test_x.shape == (12, 1, 28, 28)
    assert ds.train_y.dtype == torch.int64 and ds.test_y.dtype == torch.int64
    assert ds.in_channels == 1 and ds.image_size == 28
    np.testing.assert_array_equal(ds.train_x[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.train_y.numpy(), arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(ds.test_x[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.test_y.numpy(), arrays["t10k-labels-idx1-ubyte"])
    assert ds.mean == ((0.1307,) if name == "mnist" else (0.2860,))


@pytest.mark.parametrize("sub", ["mnist", "MNIST/raw"])
def test_idx_found_in_usual_subfolders(tmp_path, sub):
    make_idx_set(tmp_path / sub, gz=True)
    assert len(load_dataset("mnist", root=tmp_path, download=False).train_y) == 30


def test_truncated_idx_names_the_file(tmp_path):
    make_idx_set(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match="train-images-idx3-ubyte.*truncated"):
        load_dataset("mnist", root=tmp_path, download=False)


def test_truncated_gzip_names_the_file(tmp_path):
    make_idx_set(tmp_path, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(UserError, match="t10k-images-idx3-ubyte.gz"):
        load_dataset("fmnist", root=tmp_path, download=False)


def test_wrong_magic_names_the_file(tmp_path):
    make_idx_set(tmp_path, gz=False)
    path = tmp_path / "train-labels-idx1-ubyte"
    raw = bytearray(path.read_bytes())
    raw[2] = 0x0D  # float32 type code
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="train-labels-idx1-ubyte.*magic"):
        load_dataset("mnist", root=tmp_path, download=False)


def test_idx_image_label_count_mismatch(tmp_path):
    make_idx_set(tmp_path, gz=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(29, dtype=np.uint8), gz=False)
    with pytest.raises(UserError, match="30 images.*29 labels"):
        load_dataset("mnist", root=tmp_path, download=False)


def test_raw_preferred_over_gz_when_both_exist(tmp_path):
    arrays = make_idx_set(tmp_path, gz=False, seed=1)
    make_idx_set(tmp_path, gz=True, seed=2)
    ds = load_dataset("mnist", root=tmp_path, download=False)
    np.testing.assert_array_equal(ds.test_x[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"])


# ---------------------------------------------------------------------------------------------------------
# CIFAR, SVHN


@pytest.mark.parametrize("hundred", [False, True], ids=["cifar10", "cifar100"])
def test_cifar_round_trip(tmp_path, hundred):
    name = "cifar100" if hundred else "cifar10"
    train_x, train_y, test_x, test_y = make_cifar(tmp_path, hundred)
    ds = load_dataset(name, root=tmp_path, download=False)
    assert ds.augment and ds.num_classes == (100 if hundred else 10)
    assert ds.train_x.dtype == torch.uint8 and ds.train_x.shape == (20, 3, 32, 32)
    assert ds.test_x.shape == (4, 3, 32, 32)
    assert ds.train_y.dtype == torch.int64
    np.testing.assert_array_equal(ds.train_x.reshape(20, -1).numpy(), train_x)
    np.testing.assert_array_equal(ds.train_y.numpy(), train_y)
    np.testing.assert_array_equal(ds.test_x.reshape(4, -1).numpy(), test_x)
    np.testing.assert_array_equal(ds.test_y.numpy(), test_y)
    # CIFAR rows are channel-major: the first 1024 bytes are the red plane, row by row.
    np.testing.assert_array_equal(ds.train_x[0, 0].numpy().ravel(), train_x[0, :1024])
    np.testing.assert_array_equal(ds.train_x[0, 2, 31].numpy(), train_x[0, 3072 - 32 :])
    assert len(ds.mean) == 3 and len(ds.std) == 3


def test_cifar_root_pointing_at_batches_folder(tmp_path):
    make_cifar(tmp_path, hundred=False)
    ds = load_dataset("cifar10", root=tmp_path / "cifar-10-batches-py", download=False)
    assert len(ds.train_y) == 20


def test_corrupt_cifar_batch_names_the_file(tmp_path):
    make_cifar(tmp_path, hundred=False)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="data_batch_3"):
        load_dataset("cifar10", root=tmp_path, download=False)


def test_svhn_round_trip_and_label_10_is_digit_0(tmp_path):
    rng = np.random.default_rng(0)
    mats = {}
    for split, n in (("train", 12), ("test", 5)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)  # 1..10
        scipy.io.savemat(tmp_path / f"{split}_32x32.mat", {"X": x, "y": y})
        mats[split] = (x, y)
    ds = load_dataset("svhn", root=tmp_path, download=False)
    assert ds.augment and ds.num_classes == 10
    assert ds.train_x.shape == (12, 3, 32, 32) and ds.test_x.shape == (5, 3, 32, 32)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    x, y = mats["train"]
    np.testing.assert_array_equal(ds.train_x.numpy(), x.transpose(3, 2, 0, 1))
    assert ds.train_x[2, 1, 5, 9].item() == x[5, 9, 1, 2]
    expected = y.ravel().astype(np.int64) % 10  # 10 -> 0
    np.testing.assert_array_equal(ds.train_y.numpy(), expected)
    assert ds.test_y.tolist() == [1, 2, 3, 4, 5]
    assert ds.train_y.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]


# ---------------------------------------------------------------------------------------------------------
# Lookup, errors and downloads


def test_unknown_dataset_lists_choices():
    with pytest.raises(UserError, match="unknown dataset 'imagenet'.*cifar10.*fmnist.*synthetic"):
        load_dataset("imagenet")
    assert set(DATASETS.names()) == {
        "fmnist",
        "mnist",
        "cifar10",
        "cifar100",
        "svhn",
        "digits",
        "synthetic",
        "synthetic16",
    }


def test_missing_dataset_without_download_names_places(tmp_path):
    with pytest.raises(UserError) as info:
        load_dataset("cifar10", root=tmp_path, download=False)
    msg = str(info.value)
    assert "cifar10 files not found" in msg and str(tmp_path) in msg and str(tmp_path / "cifar10") in msg
    assert "cifar-10-batches-py/" in msg and "FEDPCD_DATA" in msg and "\n" not in msg


def test_failed_download_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"svhn files not found in .*download failed \(.*network disabled"):
        load_dataset("svhn", root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no empty folders


def test_fedpcd_data_env_lookup(tmp_path, monkeypatch):
    make_idx_set(tmp_path / "mnist", gz=True)
    monkeypatch.setenv("FEDPCD_DATA", str(tmp_path))
    assert len(load_dataset("mnist", download=False).train_y) == 30
    # The configured root comes first.
    make_idx_set(tmp_path / "other", gz=True, n_train=20)
    assert len(load_dataset("mnist", root=tmp_path / "other", download=False).train_y) == 20
    # ... and an empty root falls through to $FEDPCD_DATA.
    (tmp_path / "empty").mkdir()
    assert len(load_dataset("mnist", root=tmp_path / "empty", download=False).train_y) == 30


def test_idx_download_uses_mirror_list(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    arrays = make_idx_set(mirror, gz=True)
    monkeypatch.setattr(dsmod, "MNIST_URLS", ((tmp_path / "nowhere").as_uri() + "/", mirror.as_uri() + "/"))
    root = tmp_path / "data"
    ds = load_dataset("mnist", root=root)
    np.testing.assert_array_equal(ds.train_y.numpy(), arrays["train-labels-idx1-ubyte"])
    assert sorted(p.name for p in (root / "mnist").iterdir()) == sorted(f"{s}.gz" for s in arrays)


def test_cifar_download_extracts_atomically_into_cache(tmp_path, monkeypatch):
    src = tmp_path / "src"
    train_x, *_ = make_cifar(src, hundred=False)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    monkeypatch.setattr(dsmod, "CIFAR10_URL", archive.as_uri())
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "fedpcd"
    ds = load_dataset("cifar10")  # no root, no $FEDPCD_DATA: downloads into the cache
    np.testing.assert_array_equal(ds.train_x.reshape(20, -1).numpy(), train_x)
    # Only the extracted folder is left: no archive, no temp files.
    assert sorted(p.name for p in (cache / "cifar10").iterdir()) == ["cifar-10-batches-py"]
    # Found in the cache next time, without a download.
    monkeypatch.setattr(dsmod, "CIFAR10_URL", (tmp_path / "gone.tar.gz").as_uri())
    assert len(load_dataset("cifar10", download=False).train_y) == 20


# ---------------------------------------------------------------------------------------------------------
# train_fraction and stratified_subset


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), "half", True])
def test_bad_train_fraction(bad):
    with pytest.raises(UserError, match="train_fraction"):
        load_dataset("synthetic", train_fraction=bad)


def test_train_fraction_subsets_train_only():
    full = load_dataset("synthetic")
    ds = load_dataset("synthetic", train_fraction=0.3, seed=4)
    assert len(ds.train_y) == 300 and torch.bincount(ds.train_y).tolist() == [30] * 10
    assert torch.equal(ds.test_x, full.test_x) and torch.equal(ds.test_y, full.test_y)
    again = load_dataset("synthetic", train_fraction=0.3, seed=4)
    assert torch.equal(ds.train_x, again.train_x)
    other = load_dataset("synthetic", train_fraction=0.3, seed=5)
    assert not torch.equal(ds.train_y, other.train_y) or not torch.equal(ds.train_x, other.train_x)


def test_stratified_subset_proportions_and_determinism():
    labels = np.repeat(np.arange(4), [100, 50, 10, 1])
    np.random.default_rng(0).shuffle(labels)
    idx = stratified_subset(labels, 0.2, seed=3)
    assert np.bincount(labels[idx], minlength=4).tolist() == [20, 10, 2, 1]  # at least one per class
    assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)  # sorted, unique
    np.testing.assert_array_equal(idx, stratified_subset(labels, 0.2, seed=3))
    assert not np.array_equal(idx, stratified_subset(labels, 0.2, seed=4))
    np.testing.assert_array_equal(stratified_subset(labels, 1.0, seed=0), np.arange(len(labels)))
    with pytest.raises(UserError):
        stratified_subset(labels, 0.0, seed=0)


@settings(max_examples=60, deadline=None)
@given(
    labels=st.lists(st.integers(0, 6), min_size=1, max_size=80),
    fraction=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**31),
)
def test_stratified_subset_property(labels, fraction, seed):
    labels = np.array(labels)
    idx = stratified_subset(labels, fraction, seed)
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < len(labels)
    for c in np.unique(labels):
        n_c = int((labels == c).sum())
        assert int((labels[idx] == c).sum()) == max(1, round(n_c * fraction))


# ---------------------------------------------------------------------------------------------------------
# Built-in and real datasets


def test_digits():
    ds = load_dataset("digits")
    assert ds.train_x.shape[1:] == (1, 8, 8) and ds.train_x.dtype == torch.uint8
    assert len(ds.train_y) + len(ds.test_y) == 1797 and abs(len(ds.test_y) - 0.2 * 1797) < 10
    assert ds.num_classes == 10 and int(ds.train_x.max()) == 255 and int(ds.train_x.min()) == 0
    assert torch.bincount(ds.test_y, minlength=10).min() >= 34  # stratified
    assert torch.equal(load_dataset("digits", seed=9).test_y, ds.test_y)  # split independent of the seed
    x = ds.train_x.double() / 255
    assert abs(x.mean().item() - ds.mean[0]) < 1e-3 and abs(x.std().item() - ds.std[0]) < 1e-3


@pytest.mark.parametrize(("name", "side"), [("synthetic", 8), ("synthetic16", 16)])
def test_synthetic(name, side):
    ds = load_dataset(name)
    assert ds.train_x.shape == (1000, 1, side, side) and ds.test_x.shape == (200, 1, side, side)
    assert ds.num_classes == 10 and torch.bincount(ds.train_y).tolist() == [100] * 10
    assert torch.equal(load_dataset(name).train_x, ds.train_x)  # deterministic
    x = ds.train_x.double() / 255
    assert abs(x.mean().item() - ds.mean[0]) < 1e-3 and abs(x.std().item() - ds.std[0]) < 1e-3
    # Learnable: nearest class mean already separates the classes.
    centroids = torch.stack([ds.train_x[ds.train_y == c].float().mean(0) for c in range(10)]).flatten(1)
    pred = torch.cdist(ds.test_x.float().flatten(1), centroids).argmin(1)
    assert (pred == ds.test_y).float().mean().item() > 0.9


@requires_fmnist
def test_real_fmnist(monkeypatch):
    if _ORIGINAL_FEDPCD_DATA:
        monkeypatch.setenv("FEDPCD_DATA", _ORIGINAL_FEDPCD_DATA)
    ds = load_dataset("fmnist", download=False)
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_x.dtype == torch.uint8 and ds.num_classes == 10
    assert torch.bincount(ds.train_y).tolist() == [6000] * 10
    assert torch.bincount(ds.test_y).tolist() == [1000] * 10


# ---------------------------------------------------------------------------------------------------------
# The Dataset object


def _tiny() -> Dataset:
    x = torch.tensor([[[[0, 255], [51, 102]], [[255, 255], [0, 0]]]], dtype=torch.uint8)  # [1, 2, 2, 2]
    y = torch.tensor([1])
    return Dataset("tiny", x, y, x.flip(-1).contiguous(), y, 2, mean=(0.2, 0.5), std=(0.5, 0.25))


def test_normalized_matches_formula_and_is_cached():
    ds = _tiny()
    out = ds.normalized("train")
    expected = torch.tensor([[[[-0.4, 1.6], [0.0, 0.4]], [[2.0, 2.0], [-2.0, -2.0]]]])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    assert ds.normalized("train") is out
    torch.testing.assert_close(ds.normalized("test"), expected.flip(-1))
    with pytest.raises(ValueError):
        ds.normalized("val")
    assert "_normalized_cache" not in {f.name for f in dataclasses.fields(ds)}
    assert repr(ds) == "Dataset('tiny', train=1, test=1, images=2x2x2, classes=2, augment=False)"
    # A subset made with dataclasses.replace starts with an empty cache.
    subset = dataclasses.replace(ds, train_x=ds.train_x[:0], train_y=ds.train_y[:0])
    assert subset.normalized("train").shape[0] == 0


def test_dataset_rejects_wrong_dtypes():
    ds = _tiny()
    with pytest.raises(ValueError, match="uint8"):
        dataclasses.replace(ds, train_x=ds.train_x.float())
    with pytest.raises(ValueError, match="int64"):
        dataclasses.replace(ds, test_y=ds.test_y.int())

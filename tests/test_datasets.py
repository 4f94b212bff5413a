"""Dataset loaders on small files written in the real formats, lookup/download rules, subsetting."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import io
import os
import tarfile
import threading
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import requires_fmnist
from dataset_files import make_cifar, make_idx_set, make_svhn, write_idx
from fedpcd.cli import main
from fedpcd.data import datasets as dsmod
from fedpcd.data import files, svhn
from fedpcd.data.datasets import DATASETS, load_dataset
from fedpcd.data.sources import SOURCES, Source, check_files
from fedpcd.data.tensors import Dataset, stratified_subset
from fedpcd.errors import UserError
from fedpcd.utils import current_umask

_ORIGINAL_FEDPCD_DATA = os.environ.get("FEDPCD_DATA")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path_factory):
    """No $FEDPCD_DATA, a private download cache, and no network but this machine's (``served``)."""
    monkeypatch.delenv("FEDPCD_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    send = requests.adapters.HTTPAdapter.send

    def loopback_only(adapter, request, *args, **kwargs):
        if urllib.parse.urlsplit(request.url).hostname == "127.0.0.1":
            return send(adapter, request, *args, **kwargs)
        raise requests.ConnectionError("network disabled in tests")

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", loopback_only)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request log on stderr
        pass


@pytest.fixture
def served(tmp_path):
    """``(folder, url)``: an HTTP server on 127.0.0.1 serving the files put in ``folder``."""
    folder = tmp_path / "www"
    folder.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


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
    mats = make_svhn(tmp_path, n_train=12, n_test=5)
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
    # the built-in ones (a benchmark run in this process may have registered its own, e.g. synthetic32)
    built_in = {n for n in DATASETS.names() if DATASETS.get(n).__module__.startswith("fedpcd.")}
    assert built_in == {
        "fmnist",
        "mnist",
        "cifar10",
        "cifar100",
        "svhn",
        "digits",
        "synthetic",
        "synthetic16",
        "fc100",
        "tinyimagenet",
        "femnist",
        "shakespeare",
        "isic2019",
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


def test_idx_download_uses_mirror_list(tmp_path, served, monkeypatch):
    www, url = served
    arrays = make_idx_set(www / "mirror", gz=True)
    monkeypatch.setattr(dsmod, "MNIST_URLS", (url + "nowhere/", url + "mirror/"))  # the first: 404s
    root = tmp_path / "data"
    ds = load_dataset("mnist", root=root)
    np.testing.assert_array_equal(ds.train_y.numpy(), arrays["train-labels-idx1-ubyte"])
    assert sorted(p.name for p in (root / "mnist").iterdir()) == sorted(f"{s}.gz" for s in arrays)
    for stem in arrays:  # byte for byte, and a normal file (not the temporary file's 0600)
        got = root / "mnist" / f"{stem}.gz"
        assert got.read_bytes() == (www / "mirror" / f"{stem}.gz").read_bytes()
        assert got.stat().st_mode & 0o777 == 0o666 & ~current_umask()


def _tar(archive: Path, members: dict[str, bytes | str]) -> Path:
    """A .tar.gz of regular files (bytes) and symbolic links (str: the link's target)."""
    with tarfile.open(archive, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return archive


def test_cifar_download_extracts_atomically_into_cache(served, monkeypatch):
    www, url = served
    train_x, *_ = make_cifar(www / "src", hundred=False)
    with tarfile.open(www / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(www / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    monkeypatch.setattr(dsmod, "CIFAR10_URL", url + "cifar-10-python.tar.gz")
    monkeypatch.setattr(dsmod, "CIFAR10_MD5", files.md5(www / "cifar-10-python.tar.gz"))
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "fedpcd"
    ds = load_dataset("cifar10")  # no root, no $FEDPCD_DATA: downloads into the cache
    np.testing.assert_array_equal(ds.train_x.reshape(20, -1).numpy(), train_x)
    # Only the extracted folder is left: no archive, no temp files.
    assert sorted(p.name for p in (cache / "cifar10").iterdir()) == ["cifar-10-batches-py"]
    # Found in the cache next time, without a download.
    monkeypatch.setattr(dsmod, "CIFAR10_URL", url + "gone.tar.gz")
    assert len(load_dataset("cifar10", download=False).train_y) == 20


def test_download_with_a_wrong_checksum_is_one_line_and_leaves_nothing(tmp_path, served):
    www, url = served
    (www / "f.bin").write_bytes(b"not the official content")
    dest = tmp_path / "data"
    dest.mkdir()
    files.download_file([url + "f.bin"], dest / "f.bin", md5=files.md5(www / "f.bin"))  # the right one
    assert (dest / "f.bin").read_bytes() == b"not the official content"
    wrong = "0" * 32

    def fetch(folder: Path) -> None:
        files.download_file([url + "f.bin"], folder / "f.bin", md5=wrong)

    with pytest.raises(UserError) as info:
        files.find_or_download(Source("demo", lambda p: None, "f.bin"), tmp_path / "root", True, fetch)
    msg = str(info.value)
    assert f"download failed ({url}f.bin: not the official file (its MD5 is not {wrong}))" in msg
    assert msg.startswith("demo files not found in ") and "put f.bin under" in msg and "\n" not in msg
    assert not (tmp_path / "root").exists()  # no partial file, no temporary file, no empty folder


@pytest.mark.parametrize("hundred", [False, True], ids=["cifar10", "cifar100"])
def test_cifar_archive_not_the_official_one_is_refused(tmp_path, served, monkeypatch, capsys, hundred):
    name, folder = ("cifar100", "cifar-100-python") if hundred else ("cifar10", "cifar-10-batches-py")
    www, url = served
    make_cifar(www / "src", hundred)  # a well-formed archive, but not the official bytes
    with tarfile.open(www / "c.tar.gz", "w:gz") as tar:
        tar.add(www / "src" / folder, arcname=folder)
    monkeypatch.setattr(dsmod, "CIFAR100_URL" if hundred else "CIFAR10_URL", url + "c.tar.gz")
    official = dsmod.CIFAR100_MD5 if hundred else dsmod.CIFAR10_MD5
    root = tmp_path / "data"
    assert main(["partition", f"dataset.name={name}", f"dataset.root={root}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fedpcd: error: {name} files not found in ")
    assert f"download failed ({url}c.tar.gz: not the official file (its MD5 is not {official}))" in err
    assert not root.exists()  # nothing extracted, no archive, no temporary file, no empty folder


def test_svhn_download_checks_the_official_md5(tmp_path, served, monkeypatch):
    www, url = served
    mats = make_svhn(www, n_train=12, n_test=5)
    monkeypatch.setattr(dsmod, "SVHN_URL", url)
    root = tmp_path / "data"
    with pytest.raises(UserError) as info:  # served files are not the official ones
        load_dataset("svhn", root=root)
    msg = str(info.value)
    official = svhn.SVHN_OFFICIAL["train_32x32.mat"][1]
    assert msg.startswith("svhn files not found in ") and "\n" not in msg
    assert f"download failed ({url}train_32x32.mat: not the official file (its MD5 is not {official}))" in msg
    assert not root.exists()  # no partial file, no temporary file, no empty folder
    for f, (count, _) in svhn.SVHN_OFFICIAL.items():  # with these files' MD5s the same download lands
        monkeypatch.setitem(svhn.SVHN_OFFICIAL, f, (count, files.md5(www / f)))
    ds = load_dataset("svhn", root=root)
    np.testing.assert_array_equal(ds.test_x.numpy(), mats["test"][0].transpose(3, 2, 0, 1))
    assert sorted(p.name for p in (root / "svhn").iterdir()) == ["test_32x32.mat", "train_32x32.mat"]


@pytest.mark.parametrize(
    "evil",
    [
        {"cifar-10-batches-py/data_batch_1": "/etc/passwd"},  # a link out of the data folder
        {"cifar-10-batches-py/batches.meta": "data_batch_1"},  # a link inside: still no links
        {"../escaped": b"x"},
        {"/tmp/escaped-absolute": b"x"},
    ],
    ids=["symlink-out", "symlink-in", "dotdot", "absolute"],
)
def test_archive_with_links_or_paths_leaving_it_is_refused(tmp_path, served, monkeypatch, evil):
    www, url = served
    _tar(www / "c.tar.gz", {"cifar-10-batches-py/test_batch": b"x", **evil})
    monkeypatch.setattr(dsmod, "CIFAR10_URL", url + "c.tar.gz")
    monkeypatch.setattr(dsmod, "CIFAR10_MD5", files.md5(www / "c.tar.gz"))
    root = tmp_path / "data"
    with pytest.raises(UserError, match=rf"download failed \(c.tar.gz holds '{list(evil)[0]}', not a plain"):
        load_dataset("cifar10", root=root)
    assert not root.exists() and not (tmp_path / "escaped").exists()  # nothing extracted, nothing left


def test_extraction_never_writes_through_a_symlinked_folder(tmp_path, served, monkeypatch):
    www, url = served
    _tar(www / "c.tar.gz", {"cifar-10-batches-py/test_batch": b"x"})
    monkeypatch.setattr(dsmod, "CIFAR10_URL", url + "c.tar.gz")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "data" / "cifar10").mkdir(parents=True)
    (tmp_path / "data" / "cifar10" / "cifar-10-batches-py").symlink_to(elsewhere)
    with pytest.raises(UserError, match="cifar-10-batches-py is a symbolic link; not writing through it"):
        load_dataset("cifar10", root=tmp_path / "data")
    assert list(elsewhere.iterdir()) == []


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


def test_kept_datasets_are_read_once_per_process_and_equal_a_fresh_load(monkeypatch, tmp_path, capsys):
    """keep_datasets(True): a second load of the same dataset (any train_fraction and seed) does not read its
    files again and gives the tensors of a fresh load; another root loads again; a sweep's runs in this
    process load their dataset once, and the sweep leaves nothing kept."""
    datasets = dsmod
    calls = []
    synthetic = datasets.DATASETS.get("synthetic")

    def counted(root, download):
        calls.append(root)
        return synthetic(root, download)

    monkeypatch.setitem(datasets.DATASETS._items, "synthetic", counted)
    fresh = datasets.load_dataset("synthetic", None, 0.5, seed=3)
    datasets.keep_datasets(True)
    try:
        first = datasets.load_dataset("synthetic", None, 1.0)
        again = datasets.load_dataset("synthetic", None, 0.5, seed=3)
        assert len(calls) == 2 and datasets.load_dataset("synthetic", None, 1.0) is first
        assert torch.equal(again.train_x, fresh.train_x) and torch.equal(again.test_y, fresh.test_y)
        datasets.load_dataset("synthetic", tmp_path, 1.0)
        assert calls[-1] == tmp_path and len(calls) == 3
    finally:
        datasets.keep_datasets(False)
    datasets.load_dataset("synthetic", None, 1.0)
    assert len(calls) == 4
    spec = {"dataset": {"name": "synthetic"}, "model": {"name": "mlp", "hidden": 8}, "clients": 2,
            "rounds": 1, "output_dir": str(tmp_path / "grid"), "sweep": {"seed": [0, 1, 2]}}  # fmt: skip
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    assert main(["sweep", "--config", str(tmp_path / "sweep.yaml"), "--jobs", "1"]) == 0
    capsys.readouterr()
    assert len(calls) == 5 and datasets._kept is None


def test_missing_files_are_told_before_loading_in_the_loaders_line(tmp_path, monkeypatch):
    """``check_files`` (no torch; ``fedpcd run`` and ``partition`` call it first) says what the loader says
    when a built-in dataset's files are missing and cannot be downloaded, and nothing when they can be."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPCD_DATA", raising=False)
    told = 0
    for name, source in SOURCES.items():
        if any(Path(folder).is_dir() for folder in source.system):  # e.g. Debian's Fashion-MNIST
            continue
        with pytest.raises(UserError) as checked:
            check_files(name, tmp_path, download=False)
        with pytest.raises(UserError) as loaded:
            load_dataset(name, tmp_path, download=False)
        assert str(checked.value) == str(loaded.value)
        told += 1
    assert told >= len(SOURCES) - 2
    check_files("cifar10", tmp_path, download=True)  # the loader downloads it
    check_files("digits", tmp_path, download=False)  # no files to find
    with pytest.raises(
        UserError, match="^femnist files not found in .*get them from https://github.com/Talw"
    ):
        check_files("femnist", tmp_path, download=True)  # cannot be downloaded

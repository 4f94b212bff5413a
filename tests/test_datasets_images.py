"""Tiny-ImageNet (folder tree + val annotations), Fed-ISIC2019 (FLamby's layout) and FC100 (from CIFAR-100's
pickles): round trips of small files in the real formats, the offline errors, the zip download path, and a
2-round FedAvg run on each."""

from __future__ import annotations

import shutil
import zipfile

import numpy as np
import pytest
from PIL import Image

from dataset_files import make_cifar
from dataset_files_more import make_isic, make_tiny
from fedpcd import run
from fedpcd.data import files
from fedpcd.data.cifar import CIFAR100_COARSE, FC100_SUPERCLASSES
from fedpcd.data.datasets import load_dataset
from fedpcd.data.jpeg_sets import ISIC_SIDE, TINY_MD5
from fedpcd.data.partition import make_partition
from fedpcd.data.sources import ISIC_URL, TINY_URL
from fedpcd.errors import UserError


def _pixels(path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB")).transpose(2, 0, 1)


def test_tinyimagenet_round_trip_reads_val_labels_from_annotations(tmp_path):
    wnids = make_tiny(tmp_path, classes=4, per_class=3, val=8)
    ds = load_dataset("tinyimagenet", root=tmp_path, download=False)
    root = tmp_path / "tiny-imagenet-200"
    assert ds.num_classes == 4 and ds.train_x.shape == (12, 3, 8, 8) and ds.test_x.shape == (8, 3, 8, 8)
    order = sorted(wnids)
    assert ds.train_y.tolist() == [c for c in range(4) for _ in range(3)]  # sorted wnids, files in order
    assert np.array_equal(
        ds.train_x[3].numpy(), _pixels(root / "train" / order[1] / "images" / f"{order[1]}_0.JPEG")
    )
    lines = (root / "val" / "val_annotations.txt").read_text().splitlines()
    assert ds.test_y.tolist() == [order.index(line.split("\t")[1]) for line in lines]
    assert np.array_equal(ds.test_x[5].numpy(), _pixels(root / "val" / "images" / "val_5.JPEG"))


def test_tinyimagenet_offline_error_names_folder_and_url(tmp_path):
    with pytest.raises(UserError) as info:
        load_dataset("tinyimagenet", root=tmp_path, download=False)
    msg = str(info.value)
    assert msg.startswith("tinyimagenet files not found in ") and str(tmp_path / "tinyimagenet") in msg
    assert "tiny-imagenet-200/" in msg and TINY_URL in msg and "\n" not in msg


def test_tinyimagenet_download_extracts_the_zip(tmp_path, monkeypatch):
    make_tiny(tmp_path / "src", classes=2, per_class=2, val=2)
    archive = tmp_path / "tiny-imagenet-200.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for f in sorted((tmp_path / "src").rglob("*")):
            zf.write(f, f.relative_to(tmp_path / "src"))
    got = []

    def fake_download(urls, target, md5=None):
        got.append((list(urls), md5))
        shutil.copy(archive, target)

    monkeypatch.setattr(files, "download_file", fake_download)
    ds = load_dataset("tinyimagenet", root=tmp_path / "data", download=True)
    assert got == [([TINY_URL], TINY_MD5)]  # the official zip's MD5 is checked while downloading
    assert (
        len(ds.train_y) == 4
        and (tmp_path / "data" / "tinyimagenet" / "tiny-imagenet-200" / "wnids.txt").is_file()
    )
    assert not (tmp_path / "data" / "tinyimagenet" / "tiny-imagenet-200.zip").exists()


def test_isic2019_round_trip_keeps_centres(tmp_path):
    rows = make_isic(tmp_path / "isic2019")
    ds = load_dataset("isic2019", root=tmp_path, download=False)
    assert ds.num_classes == 8 and ds.train_x.shape[1:] == (3, ISIC_SIDE, ISIC_SIDE) and ds.num_groups == 6
    for fold, y, groups in (("train", ds.train_y, ds.train_groups), ("test", ds.test_y, ds.test_groups)):
        mine = [r for r in rows if r["fold"] == fold]
        assert y.tolist() == [r["target"] for r in mine] and groups.tolist() == [r["center"] for r in mine]
    # 30x24 image: scaled so its shorter side is 200 (250x200), centre-cropped
    src = Image.open(
        tmp_path / "isic2019" / "ISIC_2019_Training_Input_preprocessed" / f"{rows[0]['image']}.jpg"
    )
    big = src.convert("RGB").resize((250, 200), Image.BILINEAR).crop((25, 0, 225, 200))
    assert np.array_equal(ds.train_x[0].numpy(), np.asarray(big).transpose(2, 0, 1))
    part = make_partition(ds.train_y.numpy(), ds.test_y.numpy(), 6, "natural", {}, 0, 8, ds.groups)
    for k in range(6):  # one centre per client, its own test images
        assert set(ds.train_groups.numpy()[part.train[k]]) == {k} and set(
            ds.test_groups.numpy()[part.test[k]]
        ) == {k}


def test_isic2019_offline_error_names_folder_and_flamby(tmp_path):
    with pytest.raises(UserError) as info:
        load_dataset("isic2019", root=tmp_path, download=True)
    msg = str(info.value)
    assert (
        str(tmp_path / "isic2019") in msg
        and ISIC_URL in msg
        and "train_test_split" in msg
        and "\n" not in msg
    )


def test_fc100_is_cifar100s_training_superclasses(tmp_path):
    train_x, train_y, test_x, test_y = make_cifar(tmp_path, hundred=True, per_batch=40)
    ds = load_dataset("fc100", root=tmp_path, download=False)
    fine = [f for sc in FC100_SUPERCLASSES["train"] for f in range(100) if CIFAR100_COARSE[f] == sc]
    assert ds.num_classes == 60 and len(fine) == 60
    keep = np.isin(train_y, fine)
    assert np.array_equal(ds.train_x.numpy(), train_x[keep].reshape(-1, 3, 32, 32))
    assert ds.train_y.tolist() == [fine.index(v) for v in train_y[keep]]
    assert ds.test_y.tolist() == [fine.index(v) for v in test_y[np.isin(test_y, fine)]]
    # superclass by superclass: labels 5s .. 5s + 4 share one superclass
    assert all(len({CIFAR100_COARSE[fine[5 * s + i]] for i in range(5)}) == 1 for s in range(12))


@pytest.mark.parametrize(
    ("name", "scheme", "clients"),
    [("tinyimagenet", "dirichlet", 3), ("isic2019", "natural", 6), ("fc100", "iid", 3)],
)
def test_two_rounds_of_fedavg(tmp_path, name, scheme, clients):
    data = tmp_path / "data"
    if name == "tinyimagenet":
        make_tiny(data, classes=4, per_class=6, val=8, side=16)
    elif name == "isic2019":
        make_isic(data / "isic2019")
    else:
        make_cifar(data, hundred=True, per_batch=40)
    extra = {"partition__min_size": 0} if scheme == "dirichlet" else {}
    settings = dict(rounds=2, local__epochs=1, local__batch_size=8, engine__threads=1, engine__workers=1)
    result = run(dataset__name=name, dataset__root=str(data), dataset__download=False,
                 model__name="simplecnn",
                 partition__scheme=scheme, clients=clients, output_dir=str(tmp_path / "run"),
                 **settings, **extra)  # fmt: skip
    assert result.summary["final"]["round"] == 2 and np.isfinite(result.summary["final"]["train_loss"])


def test_the_guides_loader_runs_as_written(tmp_path, monkeypatch):
    """docs/adding-a-dataset.md's code block, imported as a module, loads two .npz files."""
    import importlib.util
    import re
    from pathlib import Path

    from fedpcd.data.datasets import DATASETS

    text = (Path(__file__).parent.parent / "docs" / "adding-a-dataset.md").read_text()
    code = re.search(r"<!-- dataset guide: npz_loader.py -->\n```python\n(.*?)```", text, re.S).group(1)
    module = tmp_path / "npz_loader.py"
    module.write_text(code)
    monkeypatch.setattr(DATASETS, "_items", dict(DATASETS._items))  # the registration ends with the test
    spec = importlib.util.spec_from_file_location("npz_loader", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = np.random.default_rng(0)
    folder = tmp_path / "data" / "npz_digits"
    folder.mkdir(parents=True)
    for s, n in (("train", 20), ("test", 6)):
        np.savez(folder / f"{s}.npz", x=rng.integers(0, 256, (n, 8, 8), dtype=np.uint8), y=np.arange(n) % 4)
    ds = load_dataset("npz_digits", root=tmp_path / "data", download=False)
    assert (
        ds.num_classes == 4 and ds.train_x.shape == (20, 1, 8, 8) and ds.test_y.tolist() == [0, 1, 2, 3, 0, 1]
    )
    with pytest.raises(UserError, match=r"npz_digits files not found in .*example.org/npz-digits/"):
        load_dataset("npz_digits", root=tmp_path / "empty", download=False)

"""Hugging Face datasets (``hf:<hub name>``, fedpcd.data.hf) and Flower Datasets' partitioners
(``flwr:<name>``, fedpcd.data.flwr_schemes), on tiny saved datasets: never the network."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from PIL import Image  # noqa: E402

import fedpcd  # noqa: E402
from fedpcd.cli import main  # noqa: E402
from fedpcd.data import hf  # noqa: E402
from fedpcd.data.datasets import load_dataset  # noqa: E402
from fedpcd.data.flwr_schemes import flwr_split  # noqa: E402
from fedpcd.data.partition import PARTITIONERS, make_partition  # noqa: E402
from fedpcd.data.tensors import channel_stats  # noqa: E402
from fedpcd.errors import UserError  # noqa: E402
from fedpcd.resolve import load_config  # noqa: E402
from fedpcd.run_format import RunFiles  # noqa: E402

TRAIN_PER_CLASS = (10, 10, 10)
TEST_PER_CLASS = (6, 4, 2)  # unbalanced: balanced accuracy and accuracy differ in general
FLWR_SCHEMES = [n for n in PARTITIONERS.names() if n.startswith("flwr:")]


def _images(labels: list[int], rng: np.random.Generator, grey: bool = False) -> list[np.ndarray]:
    """8x8 images, brighter for higher labels (learnable), uint8 HWC (HW when grey)."""
    shape = (8, 8) if grey else (8, 8, 3)
    return [np.clip(rng.normal(60 + 60 * y, 30, shape), 0, 255).astype(np.uint8) for y in labels]


def _split(per_class: tuple[int, ...], rng: np.random.Generator, grey: bool = False):
    labels = [c for c, n in enumerate(per_class) for _ in range(n)]
    order = rng.permutation(len(labels))
    labels = [labels[i] for i in order]
    return _images(labels, rng, grey), labels


def save_tiny(folder: Path, grey: bool = False) -> dict[str, tuple[list[np.ndarray], list[int]]]:
    """A DatasetDict of PIL images and ClassLabel labels (columns img, label), saved under ``folder``;
    returns the arrays it holds per split."""
    rng = np.random.default_rng(0)
    raw = {"train": _split(TRAIN_PER_CLASS, rng, grey), "test": _split(TEST_PER_CLASS, rng, grey)}
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])}
    )
    parts = {
        split: datasets.Dataset.from_dict(
            {"img": [Image.fromarray(a) for a in x], "label": y}, features=features
        )
        for split, (x, y) in raw.items()
    }
    datasets.DatasetDict(parts).save_to_disk(str(folder))
    return raw


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """fedpcd's cache (the decoded images) and an empty Hugging Face cache under tmp_path; no $FEDPCD_DATA."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("FEDPCD_DATA", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "xdg" / "fedpcd" / "hf"


@pytest.fixture
def tiny(tmp_path: Path, cache: Path) -> tuple[Path, dict]:
    """(data root, the saved arrays): the dataset saved at <root>/me/tiny, i.e. hf:me/tiny."""
    root = tmp_path / "data"
    return root, save_tiny(root / "me" / "tiny")


def test_saved_dataset_round_trips_into_the_usual_tensors_and_is_cached(tiny, cache, monkeypatch):
    root, raw = tiny
    ds = load_dataset("hf:me/tiny", root=root, download=False)
    assert ds.name == "hf:me/tiny" and ds.num_classes == 3 and ds.augment  # colour: augmented like CIFAR
    for split, x, y in (("train", ds.train_x, ds.train_y), ("test", ds.test_x, ds.test_y)):
        assert x.dtype == torch.uint8 and x.shape == (len(raw[split][1]), 3, 8, 8)
        assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), np.stack(raw[split][0]))
        assert y.dtype == torch.int64 and y.tolist() == raw[split][1]
    assert (ds.mean, ds.std) == channel_stats(ds.train_x)
    assert ds.normalized("train").dtype == torch.float32  # what the models see, as for every image set
    files = sorted(p.name.split("-")[0] for p in (cache / "me___tiny").iterdir())
    assert files == ["test", "train"]  # one .pt per split, named by split and fingerprint

    def no_decoding(*args):
        raise AssertionError("decoded again")

    monkeypatch.setattr(hf, "_decode", no_decoding)
    again = load_dataset("hf:me/tiny", root=root / "me" / "tiny", download=False)  # root = the folder itself
    assert torch.equal(again.train_x, ds.train_x) and torch.equal(again.test_x, ds.test_x)
    assert torch.equal(again.train_y, ds.train_y) and (again.mean, again.std) == (ds.mean, ds.std)
    half = load_dataset("hf:me/tiny", root=root, train_fraction=0.5, download=False)
    assert half.train_y.bincount().tolist() == [5, 5, 5] and len(half.test_y) == sum(TEST_PER_CLASS)


def test_fedpcd_data_and_a_damaged_cache_file(tiny, cache, monkeypatch):
    root, _ = tiny
    monkeypatch.setenv("FEDPCD_DATA", str(root))  # found at $FEDPCD_DATA/me/tiny, no root given
    ds = load_dataset("hf:me/tiny", download=False)
    for f in (cache / "me___tiny").iterdir():
        f.write_bytes(b"not a torch file")
    again = load_dataset("hf:me/tiny", download=False)  # decoded again, the file rewritten
    assert torch.equal(again.train_x, ds.train_x)
    assert torch.load(next((cache / "me___tiny").glob("train-*.pt")), weights_only=True)["x"].shape[0] == 30


def test_a_ctrl_c_while_the_cache_is_read_is_no_damaged_file(tiny, cache, monkeypatch):
    root, _ = tiny
    load_dataset("hf:me/tiny", root=root, download=False)  # decoded and cached

    def cut_read(path, **kwargs):  # how torch reports a Ctrl-C raised in its zip reader's read
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise SystemError("<class 'super'> returned a result with an exception set") from None

    monkeypatch.setattr(torch, "load", cut_read)
    monkeypatch.setattr(hf, "_decode", lambda *args: pytest.fail("the Ctrl-C was taken for a damaged cache"))
    with pytest.raises(KeyboardInterrupt):
        load_dataset("hf:me/tiny", root=root, download=False)


def test_grey_images_text_labels_and_arrays(tmp_path, cache):
    rng = np.random.default_rng(1)
    grey = _images([0, 1, 2, 1], rng, grey=True)
    parts = {
        "train": datasets.Dataset.from_dict(
            {"image": [Image.fromarray(a) for a in grey], "labels": ["cat", "dog", "emu", "dog"]},
            features=datasets.Features({"image": datasets.Image(), "labels": datasets.Value("string")}),
        ),
        "validation": datasets.Dataset.from_dict(  # the test split's other name
            {"image": [Image.fromarray(grey[0])], "labels": ["emu"]},
            features=datasets.Features({"image": datasets.Image(), "labels": datasets.Value("string")}),
        ),
    }
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "grey"))
    ds = load_dataset("hf:grey", root=tmp_path, download=False)
    assert ds.train_x.shape == (4, 1, 8, 8) and not ds.augment  # grey: not augmented, like (F)MNIST
    assert np.array_equal(ds.train_x[:, 0].numpy(), np.stack(grey))
    assert ds.train_y.tolist() == [0, 1, 2, 1] and ds.test_y.tolist() == [2] and ds.num_classes == 3
    # arrays instead of Image features: [C, H, W] floats in [0, 1] and [H, W, C] integers, integer labels
    chw = rng.random((3, 3, 6, 6)).astype(np.float32)
    parts = {
        "train": datasets.Dataset.from_dict({"img": list(chw), "label": [4, 0, 1]}),
        "test": datasets.Dataset.from_dict({"img": list(chw[:1]), "label": [2]}),
    }
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "arrays"))
    ds = load_dataset("hf:arrays", root=tmp_path, download=False)
    assert torch.equal(ds.train_x, torch.from_numpy(np.rint(chw * 255).astype(np.uint8)))
    assert ds.num_classes == 5 and ds.train_y.tolist() == [4, 0, 1]
    hwc = (chw * 255).astype(np.int64).transpose(0, 2, 3, 1)
    parts = {s: datasets.Dataset.from_dict({"img": list(hwc), "label": [0, 1, 1]}) for s in ("train", "test")}
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "hwc"))
    assert torch.equal(
        load_dataset("hf:hwc", root=tmp_path, download=False).train_x,
        torch.from_numpy(hwc.transpose(0, 3, 1, 2).astype(np.uint8)),
    )


def _save(folder: Path, columns: dict, features: dict | None = None, splits=("train", "test")) -> None:
    feats = datasets.Features(features) if features else None
    part = datasets.Dataset.from_dict(columns, features=feats)
    datasets.DatasetDict({s: part for s in splits}).save_to_disk(str(folder))


def test_columns_detected_or_chosen_and_one_line_errors(tmp_path, cache):
    img = [Image.fromarray(a) for a in _images([0, 1], np.random.default_rng(2))]
    label = datasets.ClassLabel(names=["x", "y", "z"])
    _save(  # CIFAR-100's layout: fine_label is the label
        tmp_path / "c100",
        {"img": img, "fine_label": [0, 1], "coarse_label": [1, 2]},
        {"img": datasets.Image(), "fine_label": label, "coarse_label": label},
    )
    assert load_dataset("hf:c100", root=tmp_path, download=False).train_y.tolist() == [0, 1]
    chosen = load_dataset("hf:c100", root=tmp_path, download=False, label_column="coarse_label")
    assert chosen.train_y.tolist() == [1, 2]
    _save(
        tmp_path / "two",
        {"left": img, "right": img, "a": [0, 1], "b": [1, 0]},
        {"left": datasets.Image(), "right": datasets.Image(), "a": label, "b": label},
    )
    with pytest.raises(UserError) as err:
        load_dataset("hf:two", root=tmp_path, download=False)
    assert str(err.value) == (
        "hf:two: several image columns (left, right); choose one with dataset.image_column=<column> "
        "(its columns: left, right, a, b)"
    )
    with pytest.raises(
        UserError, match=r"several label columns \(a, b\); choose one with dataset.label_column"
    ):
        load_dataset("hf:two", root=tmp_path, download=False, image_column="right")
    assert load_dataset("hf:two", root=tmp_path, download=False, image_column="right", label_column="b")
    with pytest.raises(
        UserError, match=r"^hf:two has no column 'pic' \(dataset.image_column\); its columns: left"
    ):
        load_dataset("hf:two", root=tmp_path, download=False, image_column="pic")
    with pytest.raises(
        UserError, match="dataset.label_column applies to hf:<hub name> datasets only, not 'digits'"
    ):
        load_dataset("digits", label_column="label")
    _save(tmp_path / "nolabel", {"img": img, "target": [0, 1]}, {"img": datasets.Image(), "target": label})
    _save(tmp_path / "nothing", {"img": img, "what": [0.5, 1.5]})
    with pytest.raises(UserError, match=r"no label column found \(looked for label, fine_label, labels\)"):
        load_dataset("hf:nothing", root=tmp_path, download=False)
    assert load_dataset("hf:nolabel", root=tmp_path, download=False).num_classes == 3  # the only ClassLabel
    _save(
        tmp_path / "notest",
        {"img": img, "label": [0, 1]},
        {"img": datasets.Image(), "label": label},
        ["train"],
    )
    with pytest.raises(
        UserError, match="hf:notest has the splits train; fedpcd needs 'train' and one of test"
    ):
        load_dataset("hf:notest", root=tmp_path, download=False)
    odd = [Image.fromarray(np.zeros((8, 6), np.uint8)), Image.fromarray(np.zeros((8, 6), np.uint8))]
    _save(tmp_path / "odd", {"img": odd, "label": [0, 1]}, {"img": datasets.Image(), "label": label})
    with pytest.raises(UserError, match=r"images are 6x8 \(width x height\); fedpcd needs square images"):
        load_dataset("hf:odd", root=tmp_path, download=False)
    mixed = [Image.fromarray(np.zeros((8, 8), np.uint8)), Image.fromarray(np.zeros((6, 6), np.uint8))]
    _save(tmp_path / "mixed", {"img": mixed, "label": [0, 1]}, {"img": datasets.Image(), "label": label})
    with pytest.raises(UserError, match=r"split 'train' mixes image sizes .* from sample 1 on"):
        load_dataset("hf:mixed", root=tmp_path, download=False)
    _save(tmp_path / "neg", {"img": img, "label": [0, -1]}, {"img": datasets.Image(), "label": label})
    with pytest.raises(UserError, match="holds label -1, outside 0..2"):
        load_dataset("hf:neg", root=tmp_path, download=False)
    small = [Image.fromarray(np.zeros((6, 6), np.uint8))] * 2
    train = datasets.Dataset.from_dict({"img": img, "label": [0, 1]})
    other = {
        "renamed": datasets.Dataset.from_dict({"img": img, "target": [0, 1]}),
        "smaller": datasets.Dataset.from_dict({"img": small, "label": [0, 1]}),
    }
    for name, test in other.items():
        datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / name))
    with pytest.raises(
        UserError, match="^hf:renamed: split 'test' has no column 'label'; its columns: img, target$"
    ):
        load_dataset("hf:renamed", root=tmp_path, download=False)
    with pytest.raises(
        UserError, match="^hf:smaller: train images are 3x8x8 but test images 3x6x6; fedpcd needs"
    ):
        load_dataset("hf:smaller", root=tmp_path, download=False)


def test_names_are_checked_when_the_config_loads(tiny):
    assert load_config(None, ["dataset.name=hf:uoft-cs/cifar10"]).dataset.name == "hf:uoft-cs/cifar10"
    for bad in ("hf:a/b/c", "hf:-x", "hf:a b"):
        with pytest.raises(UserError, match=r"^bad Hugging Face dataset name .*expected hf:<owner>/<name>"):
            load_config(None, [f"dataset.name={bad}"])
    with pytest.raises(UserError, match=r"^bad Hugging Face dataset name 'hf:'"):
        load_dataset("hf:")
    with pytest.raises(UserError, match=r"valid choices: cifar10, .*, or hf:<owner>/<name> \(a Hugging Face"):
        load_dataset("imagenet")
    assert "hf:me/tiny" in fedpcd.describe("hf:me/tiny").splitlines()[0]


def test_missing_offline_is_one_line_naming_where_to_put_it(tmp_path, cache, capsys):
    with pytest.raises(UserError) as err:
        load_dataset("hf:me/absent", root=tmp_path / "data", download=False)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"hf:me/absent files not found in {tmp_path / 'data'}, ")
    assert f"{tmp_path / 'data' / 'me' / 'absent'}, {tmp_path / 'data' / 'me___absent'}" in text
    assert "put the folder that datasets' save_to_disk writes" in text
    assert text.endswith(f"nor is it in the Hugging Face cache {tmp_path / 'hf-cache'} (download disabled)")
    assert not datasets.config.HF_HUB_OFFLINE  # offline only for that call
    out = tmp_path / "run"
    args = ["run", "--quiet", "dataset.name=hf:me/absent", "dataset.download=false", f"output_dir={out}"]
    assert main(args) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "hf:me/absent files not found" in err_lines[0]


def test_the_hugging_face_cache_is_read_offline_when_download_is_off(tmp_path, cache, monkeypatch):
    save_tiny(tmp_path / "saved")
    stored = datasets.load_from_disk(str(tmp_path / "saved"))
    seen = []

    def cached_only(name):  # datasets.load_dataset as the Hugging Face cache answers it
        seen.append((name, datasets.config.HF_HUB_OFFLINE))
        return stored

    monkeypatch.setattr(datasets, "load_dataset", cached_only)
    ds = load_dataset("hf:uoft-cs/tiny", root=tmp_path / "elsewhere", download=False)
    assert seen == [("uoft-cs/tiny", True)] and len(ds.train_y) == sum(TRAIN_PER_CLASS)
    load_dataset("hf:uoft-cs/tiny", root=tmp_path / "elsewhere", download=True)
    assert seen[-1] == ("uoft-cs/tiny", False) and not datasets.config.HF_HUB_OFFLINE


def test_the_guides_offline_recipe_runs_as_written(tmp_path, cache, monkeypatch):
    """docs/adding-a-dataset.md: the save_to_disk block (the Hub answered by a tiny dataset), then its
    config, loaded with the Hub out of reach."""
    text = (Path(__file__).parent.parent / "docs" / "adding-a-dataset.md").read_text()
    code = re.search(r"<!-- dataset guide: save_hf.py -->\n```python\n(.*?)```", text, re.S).group(1)
    config = re.search(r"<!-- dataset guide: hf.yaml -->\n```yaml\n(.*?)```", text, re.S).group(1)
    save_tiny(tmp_path / "hub")
    hub = {"uoft-cs/cifar10": datasets.load_from_disk(str(tmp_path / "hub"))}
    monkeypatch.setattr(datasets, "load_dataset", hub.__getitem__)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "save_hf.py", "exec"), {})
    monkeypatch.setattr(datasets, "load_dataset", {}.__getitem__)  # from now on the Hub has nothing
    (tmp_path / "hf.yaml").write_text(config)
    cfg = load_config("hf.yaml", [])
    ds = load_dataset(cfg.dataset.name, cfg.dataset.root, download=cfg.dataset.download)
    assert ds.name == "hf:uoft-cs/cifar10" and len(ds.train_y) == sum(TRAIN_PER_CLASS) and ds.num_classes == 3


def test_missing_packages_name_the_extra(tmp_path, monkeypatch):
    for module in ("flwr_datasets", "flwr_datasets.partitioner"):
        monkeypatch.setitem(sys.modules, module, None)  # an import of it fails
    with pytest.raises(
        UserError, match=r"^partition scheme 'flwr:linear' needs the flwr_datasets package: pip"
    ):
        fedpcd.partition(np.repeat(np.arange(3), 4), "flwr:linear", clients=2)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(
        UserError, match=r'^dataset \'hf:me/x\' needs the datasets package: pip install "fedpcd\[hf\]"$'
    ):
        load_config(None, ["dataset.name=hf:me/x"])


def test_fedavg_runs_two_rounds_on_an_hf_dataset_with_balanced_accuracy(tiny, tmp_path):
    root, _ = tiny
    result = fedpcd.run(
        dataset__name="hf:me/tiny",
        dataset__root=str(root),
        dataset__download=False,
        clients=2,
        rounds=2,
        partition__scheme="flwr:pathological",
        partition__num_classes_per_partition=2,
        model__name="mlp",
        model__hidden=16,
        local__batch_size=8,
        output_dir=str(tmp_path / "run"),
    )
    records = [json.loads(line) for line in RunFiles(result.run_dir).metrics.read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        present = [a for a in r["global_class_acc"] if a is not None]
        assert len(present) == 3 and r["global_balanced_acc"] == pytest.approx(sum(present) / 3, abs=1e-15)
        assert 0.0 <= r["global_acc"] <= 1.0
    assert result.summary["final"]["global_balanced_acc"] == records[-1]["global_balanced_acc"]
    partition = json.loads(RunFiles(result.run_dir).partition.read_text())
    assert [sum(c > 0 for c in client["train_counts"]) for client in partition["clients"]] == [2, 2]


# ---------------------------------------------------------------------------------------------------------
# Flower Datasets' partitioners


@pytest.mark.parametrize("scheme", FLWR_SCHEMES)
def test_every_flwr_scheme_partitions_the_hf_labels_disjointly_and_by_seed(tiny, scheme):
    root, _ = tiny
    ds = load_dataset("hf:me/tiny", root=root, download=False)
    y, test_y = ds.train_y.numpy(), ds.test_y.numpy()
    part = make_partition(y, test_y, 3, scheme, {}, seed=5, num_classes=3)
    joined = np.concatenate(part.train)
    assert len(part.train) == 3 and all(len(p) for p in part.train)
    assert len(np.unique(joined)) == len(joined) and set(joined.tolist()) <= set(range(len(y)))
    again = make_partition(y, test_y, 3, scheme, {}, seed=5, num_classes=3)
    assert all(np.array_equal(a, b) for a, b in zip(part.train, again.train, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(part.test, again.test, strict=True))


def test_flwr_size_skew_schemes_give_flowers_sizes_exactly():
    labels = np.repeat(np.arange(3), 10)  # 30 samples, 3 clients
    sizes = {s: [len(p) for p in fedpcd.partition(labels, f"flwr:{s}", 3, 0)] for s in ("linear", "square")}
    assert sizes == {"linear": [5, 10, 15], "square": [2, 8, 20]}  # 1:2:3 and 1:4:9, floor, rest to the last
    e = [math.e**k for k in (1, 2, 3)]
    floors = [math.floor(30 * v / sum(e)) for v in e]  # 2, 7, 19
    assert [len(p) for p in fedpcd.partition(labels, "flwr:exponential", 3, 0)] == [
        *floors[:2],
        30 - sum(floors[:2]),
    ]
    shards = fedpcd.partition(labels, "flwr:shard", 3, 0, num_shards_per_partition=1)
    assert [np.unique(labels[p]).tolist() for p in sorted(shards, key=lambda p: labels[p][0])] == [
        [0],
        [1],
        [2],
    ]
    inner = fedpcd.partition(labels, "flwr:inner_dirichlet", 3, 0, partition_sizes=[4, 6, 20], alpha=0.3)
    assert [len(p) for p in inner] == [4, 6, 20]


def test_flwr_pathological_deterministic_classes():
    labels = np.repeat(np.arange(5), 6)
    parts = fedpcd.partition(
        labels, "flwr:pathological", 5, 1, num_classes_per_partition=2, class_assignment_mode="deterministic"
    )
    assert [sorted(np.unique(labels[p]).tolist()) for p in parts] == [[0, 1], [1, 2], [2, 3], [3, 4], [0, 4]]


def test_flwr_scheme_parameters_are_validated():
    labels = np.repeat(np.arange(3), 10)
    cases = [
        (
            {"alpha": 0},
            "bad value for 'partition.alpha' of partition scheme 'flwr:inner_dirichlet' (0): expected",
        ),
        (
            {"beta": 1},
            "unknown parameter 'beta' for partition scheme 'flwr:inner_dirichlet'; valid parameters",
        ),
        ({"partition_sizes": [1, 2]}, "flwr:inner_dirichlet partition_sizes lists 2 sizes for 3 clients"),
        (
            {"partition_sizes": [10, 10, 11]},
            "flwr:inner_dirichlet partition_sizes add up to 31, more than the 30 samples",
        ),
    ]
    for params, message in cases:
        with pytest.raises(UserError, match=f"^{re.escape(message)}"):
            fedpcd.partition(labels, "flwr:inner_dirichlet", 3, 0, **params)
    with pytest.raises(UserError, match="set num_shards_per_partition or shard_size"):
        fedpcd.partition(labels, "flwr:shard", 3, 0, num_shards_per_partition=None)
    with pytest.raises(UserError, match="valid choices: random, deterministic, first-deterministic"):
        fedpcd.partition(labels, "flwr:pathological", 3, 0, class_assignment_mode="fixed")
    with pytest.raises(
        UserError, match="num_classes_per_partition must be at most the 3 classes present, got 4"
    ):
        fedpcd.partition(labels, "flwr:pathological", 3, 0, num_classes_per_partition=4)
    with pytest.raises(UserError) as err:  # Flower's own refusal, as one line
        fedpcd.partition(labels, "flwr:exponential", 8, 0)
    assert str(err.value).startswith("partition scheme 'flwr:exponential': ") and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# flwr's DirichletPartitioner and fedpcd's dirichlet: the same label statistics (not the same split)


def _statistics(parts: list[np.ndarray], labels: np.ndarray) -> tuple[float, float]:
    """Mean over clients of (the number of classes held, the entropy of the label distribution in nats)."""
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts]).astype(float)
    p = counts / counts.sum(axis=1, keepdims=True)
    entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0).sum(axis=1)
    return float((counts > 0).sum(axis=1).mean()), float(entropy.mean())


def _per_seed(alpha: float, seeds: range, flower: bool) -> np.ndarray:
    labels = np.repeat(np.arange(10), 100)
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        if flower:

            def make(flwr, s):
                return flwr.DirichletPartitioner(10, "label", alpha, min_partition_size=10, seed=s)

            parts = flwr_split("flwr-dirichlet", make, labels, 10, rng)
        else:
            parts = fedpcd.partition(labels, "dirichlet", 10, seed, beta=alpha, min_size=10)
        out.append(_statistics(parts, labels))
    return np.array(out)  # [seeds, 2]


def test_flowers_dirichlet_partitioner_matches_ours_in_label_statistics():
    """Both draw each class's client shares from Dir(alpha) and redraw until every client holds >= 10
    samples, so per-client class counts and label entropy follow one distribution. The difference of the
    two means over the seeds is within 4 standard errors (sqrt(var_ours / n_ours + var_flwr / n_flwr), from
    the per-seed values; a false alarm has probability < 1e-4 under normality), and a different alpha is
    detected. Flower's partitioner is the slow side (~0.1 s a split): fewer seeds for it."""
    ours = _per_seed(0.3, range(60), flower=False)
    for alpha, seeds, same in ((0.3, range(20), True), (3.0, range(6), False)):
        flwr = _per_seed(alpha, seeds, flower=True)
        se = np.sqrt(ours.var(axis=0, ddof=1) / len(ours) + flwr.var(axis=0, ddof=1) / len(flwr))
        within = np.abs(ours.mean(axis=0) - flwr.mean(axis=0)) <= 4 * se
        assert within.all() if same else not within.any(), (alpha, ours.mean(axis=0), flwr.mean(axis=0), se)

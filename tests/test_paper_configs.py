"""Every configs/paper/*.yaml starts and runs: 2 rounds on a 1% train subset, so that a user with a GPU can
launch any of them without a config error.

Shrunk for one CPU thread (each a dotted override, applied to every run of the sweep file):
``dataset.train_fraction=0.01``, ``rounds=2``, ``local.epochs=1`` (the papers' 5-10),
``personal_test=split`` (the personal models on their clients' test splits, not each on the whole test set:
that pass took most of a ResNet-10 smoke's time, and tests/test_metrics.py covers it), and ResNet-18 and the
wide ResNet replaced by ``simplecnn`` where the model section names nothing else (a 2-round ResNet-18 run on
1% of CIFAR-10 takes about 100 s here; the other models are kept), and a Dirichlet ``min_size`` scaled by
the same fraction; four CIFAR-100 files need 2-5%, and the stand-ins of the new formats 20-100% (``LARGER``).
Of each file's grid, the first run of the paper's own method (the file name's prefix) at the first seed;
``FEDPCD_PAPER_CONFIGS=all`` runs every cell of the first seed (every partition, setting and baseline: 562
runs). Every cell's values are checked when the grid is expanded (test_shipped_configs.py).

CIFAR-10/100 and SVHN are stand-ins in the official file formats with the official train sizes (random
images, so the 1% subset has the paper's sample counts per client) and small test sets; Fashion-MNIST is the
real train set with a class-stratified 500-image slice of its test set. FEMNIST and Shakespeare (LEAF JSON,
50 writers / roles), Tiny-ImageNet (20 classes of 16x16 JPEGs) and Fed-ISIC2019 (FLamby's layout, 6 centres)
are small random stand-ins in their real formats; FC100 is read from the CIFAR-100 stand-in.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import FMNIST_DIR, requires_fmnist
from dataset_files import fmnist_test_slice, make_cifar, make_svhn
from dataset_files_more import make_femnist, make_isic, make_shakespeare, make_tiny
from fedpcd.backends import run_experiment
from fedpcd.config import Config
from fedpcd.data.files import SKIP_CHECKSUMS_VAR
from fedpcd.resolve import config_from_dict
from fedpcd.sweep.grid import expand_sweep

PAPER = sorted((Path(__file__).parent.parent / "configs" / "paper").glob("*.yaml"))
ALL_CELLS = os.environ.get("FEDPCD_PAPER_CONFIGS") == "all"
FRACTION = 0.01
# 1% of CIFAR-100 is 5 images per class: too few for a class's holders under these partitions (P10C30 and
# P10C50 give a class up to 6-8 holders; FedSSA's split gives each of 50-100 clients a share of its classes)
LARGER = {
    "fedmr-cifar100-p10c30": 0.02,
    "fedmr-cifar100-p10c50": 0.02,
    "fedssa-cifar100-n50": 0.05,
    "fedssa-cifar100-n100": 0.05,
    # stand-ins of the LEAF / FLamby sets hold just enough writers, roles or centres: kept whole
    "fedgela-femnist": 1.0,
    "fedgela-shakespeare": 1.0,
    "fedgela-isic2019": 1.0,
    # 20 classes x 100 images: 20% gives FedNH's 100 clients their (scaled) 2 samples each
    "fednh-tinyimagenet": 0.2,
    "fedsc-tinyimagenet": 0.2,
}
# replaced by simplecnn (WRN-28-10 is 36M weights; a ResNet-10 or EfficientNet-B0 batch takes seconds on one
# core): the models themselves train in tests/test_models_more.py
SMALLER_MODELS = ("resnet10", "resnet18", "wrn", "efficientnet_b0")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """The official train sizes (so checksums are skipped: same shape, not the official content)."""
    root = tmp_path_factory.mktemp("paper-data")
    make_cifar(root, hundred=False, per_batch=10000, n_test=200)
    make_cifar(root, hundred=True, per_batch=10000, n_test=500)
    make_svhn(root, n_train=73257, n_test=200)
    # the LEAF, Tiny-ImageNet and FLamby formats (fc100 reads the CIFAR-100 files above)
    make_femnist(root / "femnist", writers=50, per_writer=(4, 2))
    make_shakespeare(root / "shakespeare", roles=50, per_role=(3, 2))
    make_tiny(root, classes=20, per_class=100, val=40, side=16)
    make_isic(root / "isic2019", per_center=(6, 2))
    return fmnist_test_slice(FMNIST_DIR, root, 0.05)


def smoke_runs(path: Path, root: Path, out: Path) -> list:
    raw = yaml.safe_load(path.read_text())
    fraction = LARGER.get(path.stem, FRACTION)
    overrides = [
        f"dataset.train_fraction={fraction}",
        "rounds=2",
        "local.epochs=1",
        "engine.threads=1",
        "personal_test=split",
        "dataset.download=false",
        f"dataset.root={root}",
        f"output_dir={out}",
    ]
    model = raw.get("model", {})
    if model.get("name") in SMALLER_MODELS and set(model) == {"name"}:
        overrides.append("model.name=simplecnn")
    first_seed = raw["sweep"]["seed"][0] if "seed" in raw["sweep"] else raw.get("seed", 0)
    cells = [c for c in expand_sweep(path, overrides) if c.seed == first_seed]
    if not ALL_CELLS:
        method = path.name.split("-")[0]
        cells = [next(c for c in cells if c.algorithm.name == method)]
    return [scaled_min_size(c, fraction) for c in cells]


def scaled_min_size(config: Config, fraction: float) -> Config:
    """A Dirichlet minimum client size is one of the full train set: scaled by the subset's fraction (FedNH's
    10 samples for 100 clients cannot be met by 1% of CIFAR)."""
    data = config.to_dict()
    if data["partition"].get("min_size"):
        data["partition"]["min_size"] = max(1, math.ceil(data["partition"]["min_size"] * fraction))
    return config_from_dict(data)


def test_every_paper_file_is_covered():
    assert len(PAPER) == 54
    for path in PAPER:
        raw = yaml.safe_load(path.read_text())
        assert "sweep" in raw, path.name
        names = [a["name"] for a in raw["sweep"].get("algorithm", [raw.get("algorithm")])]
        assert path.name.split("-")[0] in names, path.name  # the paper's own method is in the grid


@requires_fmnist
@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_config_runs_two_rounds_on_a_one_percent_subset(path, data_root, tmp_path, monkeypatch):
    monkeypatch.setenv(SKIP_CHECKSUMS_VAR, "1")
    runs = smoke_runs(path, data_root, tmp_path)
    assert runs
    for config in runs:
        summary = run_experiment(config, progress=False)
        assert summary["final"]["round"] == 2, config.output_dir
        loss = summary["final"]["train_loss"]
        assert loss is None or np.isfinite(loss), config.output_dir

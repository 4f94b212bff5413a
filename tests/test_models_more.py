"""ResNet-10, ResNet-18 with GroupNorm, WRN-depth-width and EfficientNet-B0: sizes, the features / head split,
and one round of FedAvg, FedGELA and FedNH (fixed classifiers over the head) with each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedpcd import run
from fedpcd.errors import UserError
from fedpcd.models import build_model, head_keys


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts_match_the_reference_architectures():
    assert _params(build_model("resnet10", 3, 10, 32)) == 4_903_242  # FedSC's ResNet-10 for C = 10
    assert (
        _params(build_model("efficientnet_b0", 3, 1000, 224)) == 5_288_548
    )  # EfficientNet-B0, ImageNet head
    # LEAF's LSTM: embedding 80 x 8, LSTM 8 -> 256 and 256 -> 256 (4 gates, two biases), head 256 -> 80
    lstm = 80 * 8 + 4 * (256 * (8 + 256) + 2 * 256) + 4 * (256 * 512 + 2 * 256) + 256 * 80 + 80
    assert _params(build_model("lstm", 0, 80, 80)) == lstm


@pytest.mark.parametrize(
    ("name", "params", "dim"),
    [
        ("resnet10", {}, 512),
        ("resnet18", {"norm": "group"}, 512),
        ("resnet10", {"norm": "group"}, 512),
        ("wrn", {"depth": 10, "width": 2}, 128),
        ("wrn", {}, 640),
        ("efficientnet_b0", {}, 1280),
    ],
)
def test_features_and_head_split(name, params, dim):
    torch.manual_seed(0)
    model = build_model(name, 3, 7, 16, **params).eval()
    x = torch.randn(2, 3, 16, 16)
    z = model.features(x)
    assert z.shape == (2, dim) and model.feature_dim == dim
    assert torch.allclose(model(x), model.head(z))
    assert head_keys(model) == ["head.weight", "head.bias"]


def test_group_norm_has_no_running_statistics():
    model = build_model("resnet18", 3, 10, 32, norm="group")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert all(m.num_groups == 2 for m in model.modules() if isinstance(m, nn.GroupNorm))
    assert not list(model.buffers())


def test_bad_sizes_are_one_line():
    with pytest.raises(UserError, match=r"depth must be 6n \+ 4.*got 27"):
        build_model("wrn", 3, 10, 32, depth=27)
    with pytest.raises(UserError, match="reads token sequences but this dataset holds images"):
        build_model("lstm", 3, 10, 32)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedgela", "fednh"])
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("resnet10", {}),
        ("resnet18", {"norm": "group"}),
        ("wrn", {"depth": 10, "width": 1}),
        ("efficientnet_b0", {}),
    ],
)
def test_each_model_trains_one_round(tmp_path, name, params, algorithm):
    extra = {f"model__{k}": v for k, v in params.items()}
    # the personal models' full-test passes (2000 images each) would be most of the time: split only
    settings = dict(rounds=1, local__epochs=1, local__batch_size=10, engine__threads=1, engine__workers=1,
                    personal_test="split")  # fmt: skip
    result = run(dataset__name="synthetic16", dataset__train_fraction=0.04, partition__scheme="iid",
                 clients=2, model__name=name, algorithm__name=algorithm, output_dir=str(tmp_path / "run"),
                 **settings, **extra)  # fmt: skip
    final = result.summary["final"]
    assert final["round"] == 1 and np.isfinite(final["train_loss"]) and final["global_acc"] is not None

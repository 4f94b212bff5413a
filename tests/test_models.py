"""Models: shapes, the features/head contract, exact parameter counts, key split, seeding and user errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedpcd.errors import UserError
from fedpcd.models import MODELS, FedModel, backbone_keys, build_model, head_keys

ALL = ["conv2cifar", "simplecnn", "resnet18", "mlp", "cnn1", "cnn2", "cnn3", "cnn4", "cnn5"]
MORE = ["resnet10", "wrn", "efficientnet_b0", "lstm"]  # tests/test_models_more.py
BN = ["simplecnn_bn", "mlp_bn"]  # tests/test_baselines_fedbn_apfl_perfedavg.py
INPUTS = [(1, 28), (3, 32)]
FEATURE_DIM = {
    "conv2cifar": 192,
    "simplecnn": 84,
    "resnet18": 512,
    "mlp": 200,
    **{f"cnn{i}": 500 for i in range(1, 6)},
}

# FedSSA Table 4's models (the counts computed from its layer sizes), input 3x32x32: {model: (S=10, S=100)}.
ZOO_COUNTS = {
    "cnn1": (2_621_558, 2_666_648),
    "cnn2": (1_815_142, 1_860_232),
    "cnn3": (1_320_558, 1_365_648),
    "cnn4": (1_060_358, 1_105_448),
    "cnn5": (670_058, 715_148),
}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_names() -> None:
    assert sorted([*ALL, *MORE, *BN]) == MODELS.names()


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("in_channels,size", INPUTS)
@pytest.mark.parametrize("num_classes", [10, 100])
def test_shapes_and_features_head_contract(name: str, in_channels: int, size: int, num_classes: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, in_channels, num_classes, size)
    assert isinstance(model, FedModel)
    assert isinstance(model.head, nn.Linear)
    assert model.feature_dim == FEATURE_DIM[name]
    assert model.head.in_features == model.feature_dim
    assert model.head.out_features == num_classes
    x = torch.randn(3, in_channels, size, size)
    model.eval()
    with torch.no_grad():
        logits = model(x)
        z = model.features(x)
        assert logits.shape == (3, num_classes)
        assert z.shape == (3, model.feature_dim)
        assert torch.equal(logits, model.head(z))


@pytest.mark.parametrize("name", ALL)
def test_backward_in_train_mode(name: str) -> None:
    model = build_model(name, 1, 10, 28)
    model.train()
    loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", sorted(ZOO_COUNTS))
def test_fedssa_zoo_parameter_counts(name: str) -> None:
    c10, c100 = ZOO_COUNTS[name]
    assert n_params(build_model(name, 3, 10, 32)) == c10
    assert n_params(build_model(name, 3, 100, 32)) == c100
    # the header is 5,010 (S=10) or 50,100 (S=100) parameters
    assert n_params(build_model(name, 3, 10, 32).head) == 5_010


def test_simplecnn_parameter_count() -> None:
    conv1 = 3 * 6 * 25 + 6
    conv2 = 6 * 16 * 25 + 16
    fc1 = 16 * 5 * 5 * 120 + 120
    fc2 = 120 * 84 + 84
    head = 84 * 10 + 10
    assert n_params(build_model("simplecnn", 3, 10, 32)) == conv1 + conv2 + fc1 + fc2 + head
    # 28x28 with one channel flattens 16*4*4
    assert build_model("simplecnn", 1, 10, 28).fc1.in_features == 16 * 4 * 4


def test_simplecnn_feature_relu_option() -> None:
    torch.manual_seed(0)
    relu = build_model("simplecnn", 1, 10, 28)
    linear = build_model("simplecnn", 1, 10, 28, feature_relu=False)
    linear.load_state_dict(relu.state_dict())  # same parameters: only the last activation differs
    x = torch.randn(16, 1, 28, 28)
    z = linear.features(x)
    assert (z < 0).any()  # FC2's raw output keeps negative values
    assert torch.equal(relu.features(x), torch.relu(z))
    with pytest.raises(UserError, match=r"'model.feature_relu' of model 'simplecnn' \('no'\): expected true"):
        build_model("simplecnn", 1, 10, 28, feature_relu="no")


def test_zoo_flatten_dims_follow_input() -> None:
    assert build_model("cnn1", 3, 10, 32).fc1.in_features == 32 * 5 * 5
    assert build_model("cnn1", 1, 10, 28).fc1.in_features == 32 * 4 * 4
    assert build_model("cnn2", 1, 10, 28).fc1.in_features == 16 * 4 * 4


def test_resnet18_parameter_count() -> None:
    # the usual CIFAR ResNet-18 (3x3 stem, no max-pool) with 10 classes
    assert n_params(build_model("resnet18", 3, 10, 32)) == 11_173_962


def test_mlp_hidden_param_and_small_inputs() -> None:
    model = build_model("mlp", 1, 10, 8, hidden=32)
    assert model.feature_dim == 32
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert n_params(model) == (64 * 32 + 32) + (32 * 32 + 32) + (32 * 10 + 10)
    # resnet18 also takes 8x8 (global average pooling)
    assert build_model("resnet18", 1, 10, 8).eval()(torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("name", ["simplecnn", "resnet18", "cnn3"])
def test_head_and_backbone_keys_partition_state_dict(name: str) -> None:
    model = build_model(name, 3, 10, 32)
    keys = list(model.state_dict())
    head, backbone = head_keys(model), backbone_keys(model)
    assert head == ["head.weight", "head.bias"]
    assert all(k.startswith("head.") for k in head)
    assert not any(k.startswith("head.") for k in backbone)
    assert set(head).isdisjoint(backbone)
    assert sorted(head + backbone) == sorted(keys)
    if name == "resnet18":  # BatchNorm buffers belong to the backbone
        assert "bn1.running_mean" in backbone and "bn1.num_batches_tracked" in backbone


@pytest.mark.parametrize("name", ["simplecnn", "resnet18", "mlp", "cnn5"])
def test_same_seed_same_initial_weights(name: str) -> None:
    torch.manual_seed(123)
    a = build_model(name, 3, 10, 32).state_dict()
    torch.manual_seed(123)
    b = build_model(name, 3, 10, 32).state_dict()
    torch.manual_seed(124)
    c = build_model(name, 3, 10, 32).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.weight"], c["head.weight"])


def test_functional_call_matches_forward() -> None:
    model = build_model("cnn5", 3, 10, 32).eval()
    x = torch.randn(2, 3, 32, 32)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = torch.func.functional_call(model, params, (x,))
    assert torch.allclose(out, model(x))


@pytest.mark.parametrize("name", ["simplecnn", "cnn1", "cnn5"])
def test_too_small_input_is_user_error(name: str) -> None:
    too_small = (
        rf"input 1x8x8 is too small for model '{name}'; use one of: efficientnet_b0, mlp, mlp_bn, resnet10"
    )
    with pytest.raises(UserError, match=too_small):
        build_model(name, 1, 10, 8)
    with pytest.raises(UserError, match="too small"):
        build_model(name, 3, 10, 15)
    build_model(name, 3, 10, 16)  # the smallest size that fits


def test_too_small_message_lists_accepting_models() -> None:
    with pytest.raises(UserError) as info:
        build_model("simplecnn", 1, 10, 8)
    assert str(info.value).endswith(
        "use one of: efficientnet_b0, mlp, mlp_bn, resnet10, resnet18, wrn"
    )  # not lstm


def test_unknown_name_is_user_error() -> None:
    with pytest.raises(UserError, match=r"unknown model 'vgg'; valid choices: cnn1, .*simplecnn"):
        build_model("vgg", 3, 10, 32)


def test_unknown_param_is_user_error() -> None:
    with pytest.raises(
        UserError, match=r"unknown parameter 'width' for model 'mlp'; valid parameters: hidden"
    ):
        build_model("mlp", 1, 10, 28, width=3)
    with pytest.raises(UserError, match=r"unknown parameter 'hidden' for model 'cnn1'"):
        build_model("cnn1", 3, 10, 32, hidden=3)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_sizes_are_user_errors(bad: object) -> None:
    with pytest.raises(UserError):
        build_model("mlp", 1, bad, 28)  # type: ignore[arg-type]
    with pytest.raises(UserError):
        build_model("mlp", 1, 10, 28, hidden=bad)


def test_conv2cifar_matches_fednh_listing() -> None:
    """FedNH App. Listing 1: conv 3->64, 64->64 (5x5), FC 1600 -> 384 -> 192, head 192 -> C without bias."""
    model = build_model("conv2cifar", 3, 10, 32)
    expected = (3 * 64 * 25 + 64) + (64 * 64 * 25 + 64) + (1600 * 384 + 384) + (384 * 192 + 192) + 192 * 10
    assert n_params(model) == expected
    assert model.head.bias is None and model.feature_dim == 192

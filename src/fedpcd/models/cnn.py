"""Small CNNs and the MLP: the papers' Simple-CNN and the FedSSA CNN zoo (Yi et al., IJCAI 2024, Table 4).

All conv models here share one shape: conv 5x5 (stride 1, no padding) -> ReLU -> max-pool 2x2, twice, then
flatten -> FC1 -> ReLU -> FC2 -> ReLU (= z) -> linear head. Flatten sizes are computed from the input size.
Simple-CNN's ``feature_relu: false`` drops the last ReLU (z = FC2's output): a ReLU feature can switch whole
dimensions off, which feature-space losses like FedMR's decorrelation reward (docs/results/fedmr.md).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedpcd.models.base import FedModel, register_model
from fedpcd.models.fast_convnet import batched_features, convnet_features, convnet_logits

KERNEL = 5
# the MLP's widest hidden layer: 8192 units keep it under the config's 1e8 weights for 3x32x32 inputs
MLP_MAX_HIDDEN = 8192


def conv_side(image_size: int) -> int:
    """Spatial side after two (conv 5x5 valid -> max-pool 2x2) stages; 0 if the input is too small."""
    side = image_size
    for _ in range(2):
        side = side - KERNEL + 1
        if side < 2:
            return 0
        side //= 2
    return side


def _accepts_conv(in_channels: int, image_size: int) -> bool:
    return conv_side(image_size) >= 1


class ConvNet(FedModel):
    """Two conv/pool stages and two hidden FC layers (LeNet-5 shape); z is the second FC's output."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        c1: int,
        c2: int,
        fc1: int,
        fc2: int,
        feature_relu: bool = True,
    ) -> None:
        super().__init__()
        self.feature_relu = feature_relu
        side = conv_side(image_size)
        self.conv1 = nn.Conv2d(in_channels, c1, KERNEL)
        self.conv2 = nn.Conv2d(c1, c2, KERNEL)
        self.fc1 = nn.Linear(c2 * side * side, fc1)
        self.fc2 = nn.Linear(fc1, fc2)
        self.feature_dim = fc2
        self.head = nn.Linear(fc2, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        z = self.fc2(F.relu(self.fc1(x)))
        return F.relu(z) if self.feature_relu else z

    def inference_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`~fedpcd.models.fast_convnet.convnet_logits`: a faster max-pool, the same logits bit for
        bit; a subclass, which may change the forward, gets the model itself."""
        if type(self) is not ConvNet:
            return super().inference_forward()
        return functools.partial(convnet_logits, self)

    def inference_features(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`~fedpcd.models.fast_convnet.convnet_features`: ``features`` with the faster max-pool, bit
        for bit; a subclass gets its own ``features``."""
        if type(self) is not ConvNet:
            return super().inference_features()
        return functools.partial(convnet_features, self)

    def vmap_copy(self) -> nn.Module:
        """A deep copy whose ``features`` is :func:`~fedpcd.models.fast_convnet.batched_features` (per-client
        convolution kernels under vmap); a subclass's copy keeps its own ``features``."""
        twin = super().vmap_copy()
        if type(self) is ConvNet:
            twin.features = types.MethodType(batched_features, twin)  # type: ignore[method-assign]
        return twin


@register_model("simplecnn", accepts=_accepts_conv)
def simplecnn(in_channels: int, num_classes: int, image_size: int, feature_relu: bool = True) -> FedModel:
    """Simple-CNN of MOON (Li et al., CVPR 2021) as used by FedGELA and FedMR: 6/16 conv channels,
    FC 120 -> 84; feature_dim 84. ``feature_relu``: whether z is ReLU(FC2) (MOON's) or FC2's output."""
    return ConvNet(
        in_channels, num_classes, image_size, c1=6, c2=16, fc1=120, fc2=84, feature_relu=feature_relu
    )


class ConvNetBN(ConvNet):
    """ConvNet with BatchNorm after each convolution and each hidden FC layer (before the ReLU), the layout of
    FedBN's digits CNN (Li et al., ICLR 2021, its official code's DigitModel); its own class, so the ConvNet
    fast paths (which know no BatchNorm) stay off."""

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, c1: int, c2: int, fc1: int, fc2: int
    ) -> None:
        super().__init__(in_channels, num_classes, image_size, c1=c1, c2=c2, fc1=fc1, fc2=fc2)
        self.bn1 = nn.BatchNorm2d(c1)
        self.bn2 = nn.BatchNorm2d(c2)
        self.bn3 = nn.BatchNorm1d(fc1)
        self.bn4 = nn.BatchNorm1d(fc2)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.fc1(torch.flatten(x, 1))))
        return F.relu(self.bn4(self.fc2(x)))


@register_model("simplecnn_bn", accepts=_accepts_conv)
def simplecnn_bn(in_channels: int, num_classes: int, image_size: int) -> FedModel:
    """Simple-CNN (6/16 conv channels, FC 120 -> 84) with BatchNorm after each conv and hidden FC layer, for
    FedBN's local BatchNorm; feature_dim 84."""
    return ConvNetBN(in_channels, num_classes, image_size, c1=6, c2=16, fc1=120, fc2=84)


@register_model("conv2cifar", accepts=_accepts_conv)
def conv2cifar(in_channels: int, num_classes: int, image_size: int) -> FedModel:
    """FedNH's CNN (Dai et al., AAAI 2023, App. Listing 1): 64/64 conv channels, FC 384 -> 192, head without
    bias; feature_dim 192."""
    model = ConvNet(in_channels, num_classes, image_size, c1=64, c2=64, fc1=384, fc2=192)
    model.head = nn.Linear(192, num_classes, bias=False)
    return model


# FedSSA (Yi et al., IJCAI 2024) App. B, Table 4: (conv1 out, conv2 out, FC1 out); FC2 -> 500 is z.
CNN_ZOO: dict[str, tuple[int, int, int]] = {
    "cnn1": (16, 32, 2000),
    "cnn2": (16, 16, 2000),
    "cnn3": (16, 32, 1000),
    "cnn4": (16, 32, 800),
    "cnn5": (16, 32, 500),
}
ZOO_FEATURE_DIM = 500


def _zoo(name: str, in_channels: int, num_classes: int, image_size: int) -> FedModel:
    c1, c2, fc1 = CNN_ZOO[name]
    return ConvNet(in_channels, num_classes, image_size, c1=c1, c2=c2, fc1=fc1, fc2=ZOO_FEATURE_DIM)


@register_model("cnn1", accepts=_accepts_conv)
def cnn1(in_channels: int, num_classes: int, image_size: int) -> FedModel:
    """FedSSA CNN-1 (Table 4): conv 16/32, FC 800 -> 2000 -> 500; 2,621,558 params for 3x32x32, S=10."""
    return _zoo("cnn1", in_channels, num_classes, image_size)


@register_model("cnn2", accepts=_accepts_conv)
def cnn2(in_channels: int, num_classes: int, image_size: int) -> FedModel:
    """FedSSA CNN-2 (Table 4): conv 16/16, FC 400 -> 2000 -> 500; 1,815,142 params for 3x32x32, S=10."""
    return _zoo("cnn2", in_channels, num_classes, image_size)


@register_model("cnn3", accepts=_accepts_conv)
def cnn3(in_channels: int, num_classes: int, image_size: int) -> FedModel:
    """FedSSA CNN-3 (Table 4): conv 16/32, FC 800 -> 1000 -> 500; 1,320,558 params for 3x32x32, S=10."""
    return _zoo("cnn3", in_channels, num_classes, image_size)


@register_model("cnn4", accepts=_accepts_conv)
def cnn4(in_channels: int, num_classes: int, image_size: int) -> FedModel:
    """FedSSA CNN-4 (Table 4): conv 16/32, FC 800 -> 800 -> 500; 1,060,358 params for 3x32x32, S=10."""
    return _zoo("cnn4", in_channels, num_classes, image_size)


@register_model("cnn5", accepts=_accepts_conv)
def cnn5(in_channels: int, num_classes: int, image_size: int) -> FedModel:
    """FedSSA CNN-5 (Table 4; FML/FedKD's shared small model): conv 16/32, FC 800 -> 500 -> 500;
    670,058 params for 3x32x32, S=10."""
    return _zoo("cnn5", in_channels, num_classes, image_size)


class MLP(FedModel):
    """flatten -> Linear(in*H*W, hidden) -> ReLU -> Linear(hidden, hidden) -> ReLU (= z) -> head."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_channels * image_size * image_size, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))))


@register_model("mlp")
def mlp(
    in_channels: int,
    num_classes: int,
    image_size: int,
    hidden: Annotated[int, Field(ge=1, le=MLP_MAX_HIDDEN)] = 200,
) -> FedModel:
    """Two-hidden-layer MLP (the "2NN" of McMahan et al., AISTATS 2017, ``hidden`` units); any input size."""
    return MLP(in_channels, num_classes, image_size, hidden)


class MLPBN(MLP):
    """The MLP with BatchNorm after each hidden layer (before the ReLU)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, hidden: int) -> None:
        super().__init__(in_channels, num_classes, image_size, hidden)
        self.bn1 = nn.BatchNorm1d(hidden)
        self.bn2 = nn.BatchNorm1d(hidden)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.fc2(F.relu(self.bn1(self.fc1(torch.flatten(x, 1)))))))


@register_model("mlp_bn")
def mlp_bn(
    in_channels: int,
    num_classes: int,
    image_size: int,
    hidden: Annotated[int, Field(ge=1, le=MLP_MAX_HIDDEN)] = 200,
) -> FedModel:
    """``mlp`` with BatchNorm after each hidden layer (a small model for FedBN's local BatchNorm)."""
    return MLPBN(in_channels, num_classes, image_size, hidden)

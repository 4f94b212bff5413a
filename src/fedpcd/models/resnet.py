"""ResNets in their CIFAR form and wide ResNets.

ResNet-10 / ResNet-18 (He et al., CVPR 2016; the 3x3-stem variant used by MOON, FedNH, FedGELA, FedSC):
stem 3x3 conv, stride 1, padding 1, 64 channels, norm, ReLU, no max-pool. Four stages of BasicBlocks
([1, 1, 1, 1] for ResNet-10, [2, 2, 2, 2] for ResNet-18) with 64/128/256/512 channels and strides 1/2/2/2,
then global average pooling: z has 512 dims. ``norm: group`` replaces every BatchNorm by GroupNorm with 2
groups (FedNH's Tiny-ImageNet ResNet-18); no running statistics, so nothing but weights is averaged.

WRN-d-k (Zagoruyko and Komodakis, BMVC 2016; the form of meliketoy/wide-resnet.pytorch that FedMR uses):
3x3 stem with 16 channels, three stages of (d - 4) / 6 pre-activation wide blocks (BN, ReLU, conv 3x3,
dropout, BN, ReLU, conv 3x3; 1x1 conv shortcut when the shape changes) with 16k/32k/64k channels and strides
1/2/2, then BN, ReLU and global average pooling: z has 64k dims (640 for WRN-28-10). Convolutions have
biases, as in that code.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedpcd.errors import UserError
from fedpcd.models.base import FedModel, register_model

Norm = Literal["batch", "group"]


def norm_layer(kind: Norm, channels: int) -> nn.Module:
    """BatchNorm2d, or GroupNorm with 2 groups (FedNH's choice)."""
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(2, channels)


class BasicBlock(nn.Module):
    """Two 3x3 conv-norm layers plus a shortcut (1x1 conv + norm when the shape changes)."""

    def __init__(self, in_planes: int, planes: int, stride: int, norm: Norm = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm_layer(norm, planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), norm_layer(norm, planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(FedModel):
    """CIFAR-style ResNet built from BasicBlocks; ``blocks`` gives the number of blocks per stage."""

    def __init__(
        self, in_channels: int, num_classes: int, blocks: tuple[int, int, int, int], norm: Norm = "batch"
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = norm_layer(norm, 64)
        layers: list[nn.Sequential] = []
        in_planes = 64
        for planes, stride, n in zip((64, 128, 256, 512), (1, 2, 2, 2), blocks, strict=True):
            stage = []
            for i in range(n):
                stage.append(BasicBlock(in_planes, planes, stride if i == 0 else 1, norm))
                in_planes = planes
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.feature_dim = 512
        self.head = nn.Linear(512, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


@register_model("resnet18")
def resnet18(in_channels: int, num_classes: int, image_size: int, norm: Norm = "batch") -> FedModel:
    """ResNet-18, CIFAR form (BasicBlocks [2, 2, 2, 2]); any input size (global average pooling)."""
    return ResNet(in_channels, num_classes, (2, 2, 2, 2), norm)


@register_model("resnet10")
def resnet10(in_channels: int, num_classes: int, image_size: int, norm: Norm = "batch") -> FedModel:
    """ResNet-10, CIFAR form (BasicBlocks [1, 1, 1, 1]; FedSC's backbone); any input size."""
    return ResNet(in_channels, num_classes, (1, 1, 1, 1), norm)


class WideBlock(nn.Module):
    """Pre-activation wide block: BN-ReLU-conv3x3-dropout-BN-ReLU-conv3x3 plus a (1x1 conv) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, padding=1, bias=True)
        self.dropout = nn.Dropout(dropout)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride=stride, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dropout(self.conv1(F.relu(self.bn1(x))))
        out = self.conv2(F.relu(self.bn2(out)))
        return out + self.shortcut(x)


class WideResNet(FedModel):
    """WRN-depth-width; z = the pooled 64 * width channels."""

    def __init__(self, in_channels: int, num_classes: int, depth: int, width: int, dropout: float) -> None:
        super().__init__()
        n = (depth - 4) // 6
        widths = (16, 16 * width, 32 * width, 64 * width)
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=True)
        stages: list[nn.Sequential] = []
        in_planes = widths[0]
        for planes, stride in zip(widths[1:], (1, 2, 2), strict=True):
            blocks = []
            for i in range(n):
                blocks.append(WideBlock(in_planes, planes, stride if i == 0 else 1, dropout))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = nn.BatchNorm2d(widths[3], momentum=0.9)  # the reference code's final BN momentum
        self.feature_dim = widths[3]
        self.head = nn.Linear(widths[3], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        x = F.relu(self.bn(x))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


@register_model("wrn")
def wrn(
    in_channels: int,
    num_classes: int,
    image_size: int,
    depth: Annotated[int, Field(ge=10, le=100)] = 28,
    width: Annotated[int, Field(ge=1, le=16)] = 10,
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.3,
) -> FedModel:
    """Wide ResNet WRN-depth-width, depth = 6n + 4 (default WRN-28-10, dropout 0.3: FedMR's CIFAR-100 one)."""
    if (depth - 4) % 6:
        raise UserError(f"model 'wrn': depth must be 6n + 4 (10, 16, 22, 28, 34, 40, ...), got {depth}")
    return WideResNet(in_channels, num_classes, depth, width, dropout)

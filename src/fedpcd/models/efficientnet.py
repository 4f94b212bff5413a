"""EfficientNet-B0 (Tan and Le, ICML 2019, Table 1), built without pretrained weights.

Stem 3x3 conv stride 2 (32 channels), BN, SiLU; seven stages of MBConv blocks (expansion, kernel, stride,
channels, repeats): (1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
(6, 5, 2, 192, 4), (6, 3, 1, 320, 1). An MBConv block is 1x1 expansion conv (skipped for expansion 1), BN,
SiLU, depthwise k x k conv, BN, SiLU, squeeze-and-excitation (reduction to a quarter of the block's input
channels, SiLU, sigmoid gate), 1x1 projection conv, BN, plus the identity when stride 1 and the channels
match. Then a 1x1 conv to 1280 channels, BN, SiLU, global average pooling and dropout: z has 1280 dims.
Not included: stochastic depth (drop-connect) inside the blocks. FLamby's Fed-ISIC2019 baseline starts from
ImageNet weights; this one trains from scratch (as FedGELA's code does).
"""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedpcd.models.base import FedModel, register_model

B0_STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
             (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))  # fmt: skip
STEM, FEATURES = 32, 1280


def conv_bn(
    cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True
) -> nn.Sequential:
    """Conv (no bias, 'same' padding) -> BN (eps 1e-3, momentum 0.01 as the reference) -> SiLU if ``act``."""
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01),
    ]
    if act:
        layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class MBConv(nn.Module):
    """Mobile inverted bottleneck with squeeze-and-excitation."""

    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int) -> None:
        super().__init__()
        mid = cin * expand
        self.expand = conv_bn(cin, mid, 1) if expand != 1 else nn.Identity()
        self.depthwise = conv_bn(mid, mid, kernel, stride, groups=mid)
        squeezed = max(1, cin // 4)
        self.se_reduce = nn.Conv2d(mid, squeezed, 1)
        self.se_expand = nn.Conv2d(squeezed, mid, 1)
        self.project = conv_bn(mid, cout, 1, act=False)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.depthwise(self.expand(x))
        gate = torch.sigmoid(self.se_expand(F.silu(self.se_reduce(F.adaptive_avg_pool2d(out, 1)))))
        out = self.project(out * gate)
        return out + x if self.residual else out


class EfficientNetB0(FedModel):
    """EfficientNet-B0's backbone (z: 1280 dims after pooling and dropout) and a linear head."""

    def __init__(self, in_channels: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        blocks: list[nn.Module] = [conv_bn(in_channels, STEM, 3, 2)]
        cin = STEM
        for expand, kernel, stride, cout, repeats in B0_STAGES:
            for i in range(repeats):
                blocks.append(MBConv(cin, cout, expand, kernel, stride if i == 0 else 1))
                cin = cout
        blocks.append(conv_bn(cin, FEATURES, 1))
        self.body = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self.feature_dim = FEATURES
        self.head = nn.Linear(FEATURES, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.flatten(F.adaptive_avg_pool2d(self.body(x), 1), 1))


@register_model("efficientnet_b0")
def efficientnet_b0(
    in_channels: int,
    num_classes: int,
    image_size: int,
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.2,
) -> FedModel:
    """EfficientNet-B0 from scratch (no pretrained weights), z = 1280 dims; any input size (global pool)."""
    return EfficientNetB0(in_channels, num_classes, dropout)

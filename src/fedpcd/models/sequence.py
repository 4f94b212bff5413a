"""Sequence models: LEAF's next-character LSTM for Shakespeare.

Input: token ids ``[B, L]`` (the dataset's ``vocab_size`` > 0; models see ``in_channels`` 0). Embedding of
``embed_dim`` per token, a ``layers``-layer LSTM of ``hidden`` units (batch first), and z = the top layer's
output at the last step (``hidden`` dims), then the linear head over the vocabulary (Caldas et al., LEAF,
arXiv:1812.01097: embedding 8, two LSTM layers of 256; FedGELA's code: the same).
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field
from torch import nn

from fedpcd.models.base import FedModel, register_model


class CharLSTM(FedModel):
    """Embedding -> LSTM -> last step's output (z) -> linear head."""

    def __init__(self, vocab: int, num_classes: int, embed_dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(len(x), -1).long()  # [B, L]
        out, _ = self.lstm(self.embed(tokens))
        return out[:, -1]


@register_model("lstm", tokens=True)
def lstm(
    in_channels: int,
    num_classes: int,
    image_size: int,
    embed_dim: Annotated[int, Field(ge=1, le=4096)] = 8,
    hidden: Annotated[int, Field(ge=1, le=8192)] = 256,
    layers: Annotated[int, Field(ge=1, le=8)] = 2,
    vocab: Annotated[int, Field(ge=0, le=1_000_000)] = 0,
) -> FedModel:
    """LEAF's 2-layer LSTM over token sequences (embedding 8, hidden 256); ``vocab`` 0: the class count."""
    return CharLSTM(vocab or num_classes, num_classes, embed_dim, hidden, layers)

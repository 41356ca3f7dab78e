"""A one-MLP model named as a decoder layer is (model.layers.0.mlp.{up,down}_proj), so the
low-precision recipe's name rules cover its linears: the trainer-format tests' smallest model."""

from __future__ import annotations

import torch
from torch import nn


class DecoderNamedMlp(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.up_proj = nn.Linear(width, 2 * width, bias=False)
        layer.mlp.down_proj = nn.Linear(2 * width, width, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.model.layers[0].mlp
        return mlp.down_proj(torch.relu(mlp.up_proj(x)))

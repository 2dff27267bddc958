"""Small modules several test files build their models from."""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    """x + dropout(tanh(W x)): one sublayer with a residual add, and dropout where a test needs random draws."""

    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))

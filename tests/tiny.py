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


# --- the small models the feature files (test_analysis, test_plan, test_model, ...) share ---

D = 8


class Mlp(nn.Module):
    """A pre-norm residual MLP block: token-wise, one residual add."""

    def __init__(self, d: int = D, dropout: float = 0.0):
        super().__init__()
        self.norm, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc(self.norm(x)))


class Tokens(nn.Module):
    """(B, N, 3) tokens in, through a Linear embedding and a stack of blocks."""

    def __init__(self, depth: int = 4, block=Mlp):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


class Patches(nn.Module):
    """An image in, through a 2×2 patch convolution and a stack of blocks."""

    def __init__(self, depth: int = 3, block=Mlp):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, 2)
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, image):
        h = self.embed(image).flatten(2).transpose(1, 2)
        for block in self.blocks:
            h = block(h)
        return h


def tokens(batch: int = 2, n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, n, 3, generator=torch.Generator().manual_seed(seed))


def built(cls, *args, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args, **kwargs)


def train_out(model: nn.Module, *inputs, seed: int = 0):
    model.train()
    torch.manual_seed(seed)
    return model(*inputs)


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return x + h, h.square().mean()


class Registers(nn.Module):
    """A 4×6 patch grid with two learned tokens before it, joined by a cat of a tuple a leaf returns (the graph
    does not show which tokens are the grid's: analysis measures them)."""

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.registers = nn.Parameter(torch.randn(1, 2, D))

        def forward(self, patches):
            return self.registers.expand(patches.shape[0], -1, -1), patches

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, 2)
        self.join = nn.ModuleList([Registers.Join()])
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))
        self.head = nn.Linear(D, 3)

    def forward(self, image):
        patches = self.embed(image).flatten(2).transpose(1, 2)
        h = torch.cat(self.join[0](patches), dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def image(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 12, generator=torch.Generator().manual_seed(seed))

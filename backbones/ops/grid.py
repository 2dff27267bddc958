"""2-D token orders for blocks that see their tokens as a grid (N // W rows of W tokens).

A block stores only the grid width W. The number of rows comes from the token count, so a block
that a routekit row route feeds with N' = H'·W tokens (whole rows) still sees a valid, smaller grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grid_rows(tokens: int, width: int) -> int:
    """Rows H' of the grid formed by `tokens` tokens in rows of `width`; refuses partial rows."""
    if tokens % width:
        raise ValueError(
            f"this block got {tokens} tokens, which do not fill whole rows of its {width}-token-wide "
            f"grid; it reshapes its tokens to (N // {width}, {width}), so a route into it must keep whole "
            "rows (selector='row' or 'window')")
    return tokens // width


def shift_2d(x: torch.Tensor, width: int) -> torch.Tensor:
    """Vision-RWKV's quad-directional token shift, zero padded at the grid's edges.

    Each quarter of the channels of x (B, N, D) is taken from one neighbour: from the left, the
    right, above and below. Channels past 4·(D // 4) are left unshifted.
    """
    batch, tokens, dim = x.shape
    q = dim // 4
    img = x.reshape(batch, grid_rows(tokens, width), width, dim)
    parts = [
        F.pad(img[:, :, :-1, :q], (0, 0, 1, 0)),  # value of the left neighbour
        F.pad(img[:, :, 1:, q:2 * q], (0, 0, 0, 1)),  # right neighbour
        F.pad(img[:, :-1, :, 2 * q:3 * q], (0, 0, 0, 0, 1, 0)),  # neighbour above
        F.pad(img[:, 1:, :, 3 * q:4 * q], (0, 0, 0, 0, 0, 1)),  # neighbour below
        img[..., 4 * q:],
    ]
    return torch.cat(parts, dim=-1).reshape(batch, tokens, dim)


def snake(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zig-zag (boustrophedon) order of x (B, N, D): every odd grid row reversed.

    Consecutive tokens stay spatial neighbours at the row ends. The permutation is its own inverse.
    """
    batch, tokens, dim = x.shape
    rows = grid_rows(tokens, width)
    img = x.reshape(batch, rows, width, dim)
    odd = (torch.arange(rows, device=x.device) % 2 == 1).view(1, rows, 1, 1)
    return torch.where(odd, img.flip(2), img).reshape(batch, tokens, dim)

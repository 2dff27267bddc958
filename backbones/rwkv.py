"""Diffusion-RWKV style backbone (Fei et al. 2024) in plain PyTorch, with no routing code.

Each block is a Vision-RWKV layer (Duan et al. 2024) under adaLN-Zero conditioning: a spatial mix
(2-D token shift, then receptance-gated bidirectional WKV over the patch sequence) and a channel
mix (token shift, squared-ReLU key, sigmoid receptance). The token shift needs the token grid: a
block stores the grid width W and takes H' = N' // W rows from its token count, so it stays valid
when a routekit row route hands it whole rows only.

Sizes. The official code's sizes (width × depth) are S 384×13, B 384×25, M 512×25, L 768×37,
H 1024×37, in a U-ViT layout (long skips from the first half of the blocks into the second half).
Here the blocks form one plain chain (routekit routes over a chain of blocks), so the sizes follow
DiT's widths and depths: S/2 = 384×12 (35 M parameters, like DiT-S/2), B/2 = 768×12 (137 M, like
DiT-B/2) and L/2 = 768×18 (205 M), the ~200 M size, at the official L's width. A block has about
19·D² parameters (spatial mix 4·D², channel mix 9·D², adaLN 6·D²), a DiT block 18·D².

WKV implementations (`backbones.ops.wkv`): the chunked fp32 form on CPU, the whole-kernel batched
matmul on CUDA (in bf16 under autocast, about 50 GFLOP per block at B/2, batch 256, N = 256). We do
not use flash-linear-attention: it has no kernel for this constant-decay bidirectional WKV, and its
Triton kernels took minutes to compile on our H200. Set `WKV_IMPL` to force one path.
"""

from __future__ import annotations

import torch
from torch import nn

from .dit import PatchDenoiser, modulate
from .dit import example_inputs as example_inputs
from .dit import grid as grid
from .ops.grid import grid_rows, shift_2d
from .ops.wkv import wkv_chunked, wkv_matmul, wkv_reference

SIZES: dict[str, dict] = {
    "S/2": dict(depth=12, hidden=384, patch=2),
    "B/2": dict(depth=12, hidden=768, patch=2),
    "L/2": dict(depth=18, hidden=768, patch=2),
}

WKV_IMPLS = {"reference": wkv_reference, "chunked": wkv_chunked, "matmul": wkv_matmul}
WKV_IMPL: str | None = None  # None: "matmul" for CUDA tensors, "chunked" otherwise


def wkv_impl(cuda: bool) -> str:
    """The WKV implementation a mix on CUDA (or CPU) tensors runs."""
    return WKV_IMPL or ("matmul" if cuda else "chunked")


def wkv(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional WKV by the implementation WKV_IMPL names, or the one that suits k's device."""
    name = wkv_impl(k.is_cuda)
    if name not in WKV_IMPLS:
        raise ValueError(f"unknown WKV_IMPL {name!r}; valid: {', '.join(WKV_IMPLS)} or None (by device)")
    return WKV_IMPLS[name](w, u, k, v)


class SpatialMix(nn.Module):
    """Token mixing: each of k, v, r interpolates the token and its 2-D shift, then
    out = W_o(sigmoid(r) * BiWKV(k, v)) with per-channel decay w = exp(decay) / N' and bonus u.

    Dividing the decay by the token count N' makes a channel's reach a fraction of the sequence,
    as in Vision-RWKV, so it means the same on a routed (shorter) sequence.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.mix_k = nn.Parameter(torch.full((hidden,), 0.5))
        self.mix_v = nn.Parameter(torch.full((hidden,), 0.5))
        self.mix_r = nn.Parameter(torch.full((hidden,), 0.5))
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.value = nn.Linear(hidden, hidden, bias=False)
        self.receptance = nn.Linear(hidden, hidden, bias=False)
        self.output = nn.Linear(hidden, hidden, bias=False)
        # exp(decay) from e^-1 (the whole sequence within reach) to e^4 (a few rows of a 16x16 grid).
        self.decay = nn.Parameter(torch.linspace(-1.0, 4.0, hidden))
        self.bonus = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor, width: int) -> torch.Tensor:
        shifted = shift_2d(x, width)
        k = self.key(torch.lerp(x, shifted, self.mix_k))
        v = self.value(torch.lerp(x, shifted, self.mix_v))
        r = self.receptance(torch.lerp(x, shifted, self.mix_r))
        mixed = wkv(self.decay.exp() / x.shape[1], self.bonus, k, v)
        return self.output(torch.sigmoid(r) * mixed)


class ChannelMix(nn.Module):
    """RWKV's feed-forward: W_v(relu(W_k x_k)²) gated by sigmoid(W_r x_r), on token-shifted inputs."""

    def __init__(self, hidden: int, mlp_ratio: float):
        super().__init__()
        inner = int(hidden * mlp_ratio)
        self.mix_k = nn.Parameter(torch.full((hidden,), 0.5))
        self.mix_r = nn.Parameter(torch.full((hidden,), 0.5))
        self.key = nn.Linear(hidden, inner, bias=False)
        self.value = nn.Linear(inner, hidden, bias=False)
        self.receptance = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, width: int) -> torch.Tensor:
        shifted = shift_2d(x, width)
        k = torch.relu(self.key(torch.lerp(x, shifted, self.mix_k))).square()
        r = self.receptance(torch.lerp(x, shifted, self.mix_r))
        return torch.sigmoid(r) * self.value(k)


class RWKVBlock(nn.Module):
    """Bi-RWKV layer conditioned on c (B, D) through adaLN-Zero; two gated residual adds.

    x is (B, N', D) with N' = H'·W for any H': the block only knows the grid width W.
    """

    def __init__(self, hidden: int, width: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.width = width
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.spatial = SpatialMix(hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.channel = ChannelMix(hidden, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        grid_rows(x.shape[1], self.width)  # refuse partial rows before any work
        mod = self.adaLN_modulation(c).unsqueeze(1).chunk(6, dim=-1)  # each (B, 1, D)
        shift_s, scale_s, gate_s, shift_c, scale_c, gate_c = mod
        x = x + gate_s * self.spatial(modulate(self.norm1(x), shift_s, scale_s), self.width)
        x = x + gate_c * self.channel(modulate(self.norm2(x), shift_c, scale_c), self.width)
        return x


class DiffusionRWKV(PatchDenoiser):
    """Class-conditional Diffusion-RWKV: DiT's embedders and output layer around RWKV blocks, each of
    which knows the grid width W and works on whole rows."""

    def __init__(self, depth: int, hidden: int, patch: int, mlp_ratio: float = 4.0, **common):
        super().__init__(lambda i, grid: RWKVBlock(hidden, grid[1], mlp_ratio), depth, hidden, patch, **common)


def build(size: str = "S/2", **overrides) -> DiffusionRWKV:
    """Diffusion-RWKV of a named size ("S/2", "B/2", "L/2"); overrides replace any constructor argument."""
    if size not in SIZES:
        raise ValueError(f"unknown Diffusion-RWKV size {size!r}; valid sizes: {', '.join(SIZES)}")
    return DiffusionRWKV(**{**SIZES[size], **overrides})


def DRWKV_S_2(**overrides) -> DiffusionRWKV:
    """Diffusion-RWKV S/2: ``build("S/2", **overrides)``."""
    return build("S/2", **overrides)


def DRWKV_B_2(**overrides) -> DiffusionRWKV:
    """Diffusion-RWKV B/2: ``build("B/2", **overrides)``."""
    return build("B/2", **overrides)


def DRWKV_L_2(**overrides) -> DiffusionRWKV:
    """Diffusion-RWKV L/2: ``build("L/2", **overrides)``."""
    return build("L/2", **overrides)

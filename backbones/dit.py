"""DiT / SiT backbones (Peebles & Xie 2023; Ma et al. 2024) in plain PyTorch.

SiT is the same network as DiT trained with an interpolant objective, so one family covers both.
There is no routing code here on purpose: routekit rewrites this model's graph unmodified.
Parameter names follow the reference DiT checkpoints (``blocks.0.attn.qkv``, ``final_layer.linear``, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SIZES: dict[str, dict] = {
    f"{name}/{patch}": dict(depth=depth, hidden=hidden, heads=heads, patch=patch)
    for name, (depth, hidden, heads) in {
        "S": (12, 384, 6),
        "B": (12, 768, 12),
        "L": (24, 1024, 16),
        "XL": (28, 1152, 16),
    }.items()
    for patch in (2, 4, 8)
}

# t arrives as continuous time in [0, 1); multiplying by 1000 puts it on the scale of DiT's
# discrete steps 0..999, so the frequency embedding spans the same range as in the paper.
TIME_SCALE = 1000.0
FREQ_DIM = 256  # width of the sinusoidal timestep features before the MLP


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: per-sample shift and scale (B, 1, D) applied to every token of x (B, N, D)."""
    return x * (1 + scale) + shift


def sincos_2d(hidden: int, grid: tuple[int, int]) -> torch.Tensor:
    """Fixed 2-D sin-cos positions (1, h*w, hidden): first half encodes the column, second the row."""
    quarter = hidden // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    parts = []
    for pos in (cols, rows):
        angles = pos.reshape(-1, 1).double() * omega
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1).float().unsqueeze(0)


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> tokens (B, H/p * W/p, D) with one strided convolution."""

    def __init__(self, patch: int, in_channels: int, hidden: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    """Float time t (B,) -> (B, D): sinusoidal features of TIME_SCALE * t, then a two-layer MLP."""

    def __init__(self, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQ_DIM, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = (TIME_SCALE * t.float()).unsqueeze(1) * freqs
        features = torch.cat([angles.cos(), angles.sin()], dim=1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels (B,) -> (B, D); row ``num_classes`` is the null class for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden: int, dropout: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout = dropout
        self.embedding_table = nn.Embedding(num_classes + 1, hidden)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:  # train mode only: replace labels by the null class
            y = y.masked_fill(torch.rand(y.shape, device=y.device) < self.dropout, self.num_classes)
        return self.embedding_table(y)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection; works for any token count N."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # (3, B, heads, N, d)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).flatten(2))


class Mlp(nn.Module):
    """Token-wise feed-forward: Linear, GELU (tanh approximation), Linear."""

    def __init__(self, hidden: int, mlp_ratio: float):
        super().__init__()
        self.fc1 = nn.Linear(hidden, int(hidden * mlp_ratio))
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(int(hidden * mlp_ratio), hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """Transformer block conditioned on c (B, D) through adaLN-Zero; two gated residual adds."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        mod = self.adaLN_modulation(c).unsqueeze(1).chunk(6, dim=-1)  # each (B, 1, D)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm and a Linear from D to patch*patch*out_channels per token."""

    def __init__(self, hidden: int, patch: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, patch * patch * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class PatchDenoiser(nn.Module):
    """What DiT, Diffusion-RWKV and DiM share: patch embedding with fixed 2-D positions, timestep and
    label embedders, a stack of blocks (x, c) -> x, an adaLN output layer. Only the blocks differ, so a
    subclass passes `make_block(index, grid) -> nn.Module`. forward(x, t, y) returns a tensor shaped
    like x (twice the channels when learn_sigma). `compile_blocks`: torch.compile each block on its own
    (regional compilation), the way the official TREAD code and diffusers users compile."""

    def __init__(self, make_block, depth: int, hidden: int, patch: int,
                 input_size: int | tuple[int, int] = 32, in_channels: int = 4, num_classes: int = 1000,
                 learn_sigma: bool = False, class_dropout: float = 0.1, compile_blocks: bool = False):
        super().__init__()
        height, width = (input_size, input_size) if isinstance(input_size, int) else input_size
        if height % patch or width % patch or hidden % 4:
            raise ValueError(f"need input_size ({height}, {width}) divisible by patch {patch} "
                             f"and hidden {hidden} divisible by 4")
        self.depth, self.hidden, self.patch = depth, hidden, patch
        self.input_size = (height, width)
        self.grid = (height // patch, width // patch)
        self.in_channels = in_channels
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        self.num_classes = num_classes

        self.x_embedder = PatchEmbed(patch, in_channels, hidden)
        self.register_buffer("pos_embed", sincos_2d(hidden, self.grid), persistent=True)
        self.t_embedder = TimestepEmbedder(hidden)
        self.y_embedder = LabelEmbedder(num_classes, hidden, class_dropout)
        self.blocks = nn.ModuleList([make_block(i, self.grid) for i in range(depth)])
        self.final_layer = FinalLayer(hidden, patch, self.out_channels)
        self.initialize_weights()
        if compile_blocks:  # each block's forward compiled on its own, as the official TREAD code ships its DiT
            for block in self.blocks:
                block.compile()

    def initialize_weights(self) -> None:
        """DiT's initialisation; the zeros make every block start as the identity (adaLN-Zero).

        Parameters other than Linear layers inside blocks (RWKV's decay, Mamba's A_log) keep the
        values their layers set.
        """
        # Plain transformer default: xavier-uniform linears, zero biases.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # The patch convolution is a linear map on flattened patches: initialise it as one.
        conv = self.x_embedder.proj
        nn.init.xavier_uniform_(conv.weight.view(conv.weight.shape[0], -1))
        nn.init.zeros_(conv.bias)
        # Small normal init for the conditioning embeddings, as in DiT (and ViT's tables).
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: zero modulation makes every gate 0, so each residual branch adds nothing at
        # init; a zero final layer makes the whole model output exactly 0. Training starts stable.
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for layer in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, h*w, p*p*C) -> image (B, C, h*p, w*p), with h, w from the stored grid."""
        (h, w), p, c = self.grid, self.patch, self.out_channels
        x = x.reshape(-1, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(-1, c, h * p, w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        return self.unpatchify(self.final_layer(x, c))


class DiT(PatchDenoiser):
    """Class-conditional diffusion transformer: adaLN-Zero attention + MLP blocks."""

    def __init__(self, depth: int, hidden: int, heads: int, patch: int, mlp_ratio: float = 4.0, **common):
        if hidden % heads:
            raise ValueError(f"hidden {hidden} must be divisible by heads {heads}")
        super().__init__(lambda i, grid: DiTBlock(hidden, heads, mlp_ratio), depth, hidden, patch, **common)
        self.heads = heads


def build(size: str = "S/2", **overrides) -> DiT:
    """DiT of a paper size ("S/2" ... "XL/8"); overrides replace any constructor argument."""
    if size not in SIZES:
        raise ValueError(f"unknown DiT size {size!r}; valid sizes: {', '.join(SIZES)}")
    return DiT(**{**SIZES[size], **overrides})


def example_inputs(model: nn.Module, batch: int, *, device: torch.device | str | None = None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """Random (x, t, y) for model: latents, times in [0, 1), labels; drawn on the generator's device."""
    draw = generator.device if generator is not None else torch.device("cpu")
    x = torch.randn(batch, model.in_channels, *model.input_size, generator=generator, device=draw)
    t = torch.rand(batch, generator=generator, device=draw)
    y = torch.randint(0, model.num_classes, (batch,), generator=generator, device=draw)
    device = device if device is not None else next(model.parameters()).device
    return x.to(device), t.to(device), y.to(device)


def grid(model: nn.Module) -> tuple[int, int]:
    """Token grid (H/patch, W/patch) of model."""
    return model.grid


def _named(size: str):
    def construct(**overrides) -> DiT:
        return build(size, **overrides)

    construct.__name__ = construct.__qualname__ = "DiT_" + size.replace("/", "_")
    construct.__doc__ = f"DiT-{size}: ``build({size!r}, **overrides)``."
    return construct


DiT_S_2, DiT_S_4, DiT_S_8 = _named("S/2"), _named("S/4"), _named("S/8")
DiT_B_2, DiT_B_4, DiT_B_8 = _named("B/2"), _named("B/4"), _named("B/8")
DiT_L_2, DiT_L_4, DiT_L_8 = _named("L/2"), _named("L/4"), _named("L/8")
DiT_XL_2, DiT_XL_4, DiT_XL_8 = _named("XL/2"), _named("XL/4"), _named("XL/8")

"""Hypothesis strategies: random block-stacked models, their example inputs, and valid route plans.

Every model here is built from an `Arch` (plain data, so Hypothesis prints and shrinks it) and is
tiny, so one example traces, routes and runs in milliseconds. The family covers what routekit must
meet in the wild: adaLN-conditioned attention blocks, MLP-only blocks, blocks taking a per-token
side input ((B, N, D) bias or (B, N) mask), blocks returning `(x, aux)`, blocks called with keyword
arguments, stacks in a ModuleList (the owner loops) or an nn.Sequential (the owner calls it), and a
patch-embedding convolution (a token grid exists) or a Linear embedding of (B, N, C) input (no grid).

The owner's forward is split into `embed_stream`, `call_block` and `finish`, so a test can run the
same model by hand with its own gathers and scatters (the reference routekit is held against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import routekit as rk

SELECTORS_WITH_GRID = ("random", "row", "window", "column")
PER_TOKEN_SIDES = ("bias", "mask")  # side inputs carrying the token axis; routes must gather them


@dataclass(frozen=True)
class Arch:
    """Everything that decides a model's structure and its example inputs."""

    depth: int
    hidden: int
    heads: int
    grid: tuple[int, int]  # token grid (H, W); tokens N = H * W
    front: Literal["conv", "linear"]  # patch-embedding convolution (grid found) or Linear on (B, N, C)
    patch: int
    channels: int
    container: Literal["list", "sequential"]
    kinds: tuple[str, ...]  # one block kind per block; see BLOCKS
    tuple_out: bool  # blocks return (x, aux) and the owner takes [0]
    stream_kw: bool  # the owner passes the stream as x=...
    side_kw: bool  # the owner passes side inputs by keyword
    dropout: float  # inside every MLP: model-internal randomness in train mode
    batch: int
    seed: int

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def has_grid(self) -> bool:
        return self.front == "conv"


class Mlp(nn.Module):
    """Token-wise feed-forward with dropout (plain submodules, not a container: no rival block chain)."""

    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Attention(nn.Module):
    """Multi-head self-attention over whatever tokens it is given."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Residual block base: `side` names the one side input a kind takes (None: the stream only)."""

    side: str | None = None

    def __init__(self, hidden: int, heads: int, dropout: float, tuple_out: bool):
        super().__init__()
        self.tuple_out = tuple_out
        self.norm = nn.LayerNorm(hidden)
        self.mlp = Mlp(hidden, dropout)

    def out(self, x: torch.Tensor):
        """The block's result: the stream, or (stream, per-sample aux) like MoE blocks' balance losses."""
        return (x, x.square().mean(dim=(1, 2))) if self.tuple_out else x


class AdaBlock(Block):
    """Attention + MLP with adaLN-style shift/scale/gate from a per-sample vector c (B, D)."""

    side = "c"

    def __init__(self, hidden: int, heads: int, dropout: float, tuple_out: bool):
        super().__init__(hidden, heads, dropout, tuple_out)
        self.attn = Attention(hidden, heads)
        self.ada = nn.Linear(hidden, 3 * hidden)

    def forward(self, x: torch.Tensor, c: torch.Tensor):
        shift, scale, gate = self.ada(F.silu(c)).unsqueeze(1).chunk(3, dim=-1)
        x = x + gate * self.attn(self.norm(x) * (1 + scale) + shift)
        return self.out(x + self.mlp(self.norm(x)))


class AttnBlock(Block):
    """Attention + MLP taking the stream only (fits an nn.Sequential)."""

    def __init__(self, hidden: int, heads: int, dropout: float, tuple_out: bool):
        super().__init__(hidden, heads, dropout, tuple_out)
        self.attn = Attention(hidden, heads)

    def forward(self, x: torch.Tensor):
        x = x + self.attn(self.norm(x))
        return self.out(x + self.mlp(self.norm(x)))


class MlpBlock(Block):
    """MLP only."""

    def forward(self, x: torch.Tensor):
        return self.out(x + self.mlp(self.norm(x)))


class BiasBlock(Block):
    """Adds a per-token bias (B, N, D) before its MLP: it must see the bias rows of its own tokens."""

    side = "bias"

    def forward(self, x: torch.Tensor, bias: torch.Tensor):
        return self.out(x + self.mlp(self.norm(x + bias)))


class MaskBlock(Block):
    """Scales its update by a per-token mask (B, N)."""

    side = "mask"

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        return self.out(x + mask.unsqueeze(-1) * self.mlp(self.norm(x)))


BLOCKS: dict[str, type[Block]] = {"ada": AdaBlock, "attn": AttnBlock, "mlp": MlpBlock, "bias": BiasBlock,
                                  "mask": MaskBlock}
LIST_KINDS = ("ada", "mlp", "bias", "mask")
SEQUENTIAL_KINDS = ("attn", "mlp")  # one input each


class TimeEmbed(nn.Module):
    """Per-sample scalar t (B,) -> conditioning vector (B, D)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(1, hidden), nn.Linear(hidden, hidden)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(t.unsqueeze(-1))))


class Stacked(nn.Module):
    """A block-stacked model of the family: embed, conditioning, block stack, norm and head."""

    def __init__(self, arch: Arch):
        super().__init__()
        self.arch = arch
        d, n, p, c = arch.hidden, arch.tokens, arch.patch, arch.channels
        self.embed = nn.Conv2d(c, d, p, stride=p) if arch.front == "conv" else nn.Linear(c, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, n, d))
        self.time = TimeEmbed(d)
        if "bias" in arch.kinds:
            self.bias_proj = nn.Linear(d, d)
        blocks = [BLOCKS[k](d, arch.heads, arch.dropout, arch.tuple_out) for k in arch.kinds]
        self.blocks = nn.Sequential(*blocks) if arch.container == "sequential" else nn.ModuleList(blocks)
        self.norm_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, p * p * c if arch.front == "conv" else c)

    def embed_stream(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None = None):
        """The stream into block 0 and the side inputs by name (c per-sample; bias, mask per-token)."""
        h = self.embed(x).flatten(2).transpose(1, 2) if self.arch.front == "conv" else self.embed(x)
        c = self.time(t)
        # contiguous: a route's gather returns a contiguous copy, and a strided stream (the transpose above)
        # would make layout-sensitive reductions differ in the last ulp, hiding the exact rate-0 law
        h = (h + self.pos + c.unsqueeze(1)).contiguous()
        sides = {"c": c}
        if "bias" in self.arch.kinds:
            sides["bias"] = self.bias_proj(h)
        if mask is not None:
            sides["mask"] = mask
        return h, sides

    def call_block(self, block: Block, h: torch.Tensor, sides: dict):
        """Call one block the way this owner does (positional or keyword stream and side input)."""
        extra = {} if block.side is None else {block.side: sides[block.side]}
        if self.arch.stream_kw:
            return block(x=h, **extra)
        if self.arch.side_kw:
            return block(h, **extra)
        return block(h, *extra.values())

    def finish(self, h: torch.Tensor, aux):
        """Norm and head; back to an image for a conv front end; (out, aux) when blocks return tuples."""
        out = self.head(self.norm_out(h))
        if self.arch.front == "conv":
            (gh, gw), p, c = self.arch.grid, self.arch.patch, self.arch.channels
            out = out.reshape(-1, gh, gw, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(-1, c, gh * p, gw * p)
        return (out, aux) if self.arch.tuple_out else out

    def forward(self, x: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None = None):
        h, sides = self.embed_stream(x, t, mask)
        aux = 0
        if isinstance(self.blocks, nn.Sequential):
            h = self.blocks(h)
        else:
            for block in self.blocks:
                out = self.call_block(block, h, sides)
                if self.arch.tuple_out:
                    h, a = out
                    aux = aux + a
                else:
                    h = out
        return self.finish(h, aux)


def build(arch: Arch) -> Stacked:
    """The model of `arch`, its weights drawn from `arch.seed` (the global RNG is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(arch.seed)
        return Stacked(arch)


def example_inputs(arch: Arch, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(x, t) or (x, t, mask) for `arch`: an image for a conv front, (B, N, C) tokens otherwise."""
    g = torch.Generator().manual_seed(seed)
    (gh, gw), b = arch.grid, arch.batch
    if arch.front == "conv":
        x = torch.randn(b, arch.channels, gh * arch.patch, gw * arch.patch, generator=g)
    else:
        x = torch.randn(b, arch.tokens, arch.channels, generator=g)
    t = torch.rand(b, generator=g)
    if "mask" in arch.kinds:
        return x, t, torch.rand(b, arch.tokens, generator=g)
    return x, t


@st.composite
def archs(draw: st.DrawFn, min_depth: int = 2, max_depth: int = 10, container: str | None = None,
          front: str | None = None, kinds: tuple[str, ...] | None = None) -> Arch:
    """A random architecture of the family (restrict container, front end or block kinds to focus a test)."""
    container = container or draw(st.sampled_from(["list", "sequential"]))
    front = front or draw(st.sampled_from(["conv", "linear"]))
    depth = draw(st.integers(min_depth, max_depth))
    grid = (draw(st.integers(2, 6)), draw(st.integers(2, 6)))
    heads = draw(st.integers(1, 4))
    # hidden == tokens (c (B, D) shaped like a float mask (B, N)) is in the family: routekit settles it by probing
    widths = [w for w in range(8, 49, 4) if w % heads == 0]
    pool = kinds or (SEQUENTIAL_KINDS if container == "sequential" else LIST_KINDS)
    list_owner = container == "list"
    return Arch(
        depth=depth, hidden=draw(st.sampled_from(widths)), heads=heads, grid=grid, front=front,
        patch=draw(st.sampled_from([1, 2])) if front == "conv" else 1, channels=draw(st.integers(1, 3)),
        container=container, kinds=tuple(draw(st.sampled_from(pool)) for _ in range(depth)),
        tuple_out=list_owner and draw(st.booleans()), stream_kw=list_owner and draw(st.booleans()),
        side_kw=list_owner and draw(st.booleans()), dropout=draw(st.sampled_from([0.0, 0.1])),
        batch=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def plans(draw: st.DrawFn, depth: int, has_grid: bool, min_routes: int = 1, max_routes: int = 3,
          rate: st.SearchStrategy[float] | None = None, selectors: tuple[str, ...] | None = None) -> list[rk.Route]:
    """1-3 disjoint routes in block order, each start <= end < next start.

    Draw 2n non-decreasing points in [0, depth - n] and shift pair i by i: ends stay below the next start.
    """
    n = draw(st.integers(min_routes, min(max_routes, depth)))
    points = sorted(draw(st.lists(st.integers(0, depth - n), min_size=2 * n, max_size=2 * n)))
    names = selectors or (SELECTORS_WITH_GRID if has_grid else ("random",))
    rates = rate if rate is not None else st.floats(0.0, 0.9)
    return [rk.Route(start=points[2 * i] + i, end=points[2 * i + 1] + i, rate=draw(rates),
                     selector=draw(st.sampled_from(names))) for i in range(n)]


@dataclass
class Case:
    """A model, one call's example inputs and a valid route plan for it, with how to apply it.

    grid: pass to apply (or None); mode: "graph" (rewrite the traced owner) or "boundary" (hooks at blocks).
    """

    arch: Arch
    model: Stacked
    inputs: tuple[torch.Tensor, ...]
    routes: list[rk.Route]
    grid: tuple[int, int] | None
    mode: str


@st.composite
def cases(draw: st.DrawFn, arch: st.SearchStrategy[Arch] | None = None, **plan_options) -> Case:
    """A random model with example inputs and a random valid plan (plan_options go to `plans`).

    Without a patch embedding the grid is sometimes given to `apply`, which opens the grid selectors.
    Both placement modes must obey every law, so each case draws one.
    """
    a = draw(arch if arch is not None else archs())
    given = not a.has_grid and draw(st.booleans())
    routes = draw(plans(a.depth, a.has_grid or given, **plan_options))
    mode = draw(st.sampled_from(["graph", "boundary"]))
    return Case(a, build(a), example_inputs(a, seed=a.seed), routes, a.grid if given else None, mode)


def kept_tokens(route: rk.Route, grid: tuple[int, int]) -> int:
    """How many tokens blocks inside `route` see: N - int(N * rate), or whole rows / columns."""
    (h, w), rate = grid, route.rate
    if route.selector in ("row", "window"):
        return w * (h - int(h * rate))
    if route.selector == "column":
        return h * (w - int(w * rate))
    return h * w - int(h * w * rate)


# ---------------------------------------------------------------------------------------------------------------
# A position-encoded family: blocks that read a position table of random layout.
# ---------------------------------------------------------------------------------------------------------------

POSITION_DIM, TEXT_TOKENS = 8, 3
# How the table reaches the block: (B, N, D); (N, D) with no batch axis; (B, 1, N, D) with a head axis; (1, N, D)
# broadcast over the batch; (TEXT + N, D) or (N + TEXT, D), the text tokens' rows joined to the image's.
POSITION_LAYOUTS = ("batched", "token first", "batched heads", "broadcast", "joint first", "joint last")
POSITION_WRAPS = ("plain", "tuple", "dict")  # the table alone, `(cos, sin)`-style, or `{"table": ...}`


class PositionBlock(nn.Module):
    """Attention-free so that a block's output at a token depends on that token alone: the routed block's
    outputs are then exactly the original block's at the kept tokens. Reads its table in the layout `layout`
    names, and the text tokens' rows where the table is joint (as joint attention reads it)."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.fc = nn.Linear(POSITION_DIM, POSITION_DIM)

    def forward(self, x, pos, text=None):
        table = pos["table"] if isinstance(pos, dict) else pos[0] if isinstance(pos, tuple) else pos
        if self.layout in ("joint first", "joint last"):
            first = self.layout == "joint first"
            joint = torch.cat([text, x], 1) if first else torch.cat([x, text], 1)
            mixed = joint * table
            mine = mixed[:, text.shape[1]:] if first else mixed[:, :x.shape[1]]
            return x + self.fc(mine)
        if self.layout == "batched heads":
            return x + self.fc(x * table[:, 0])
        return x + self.fc(x * table)


class PositionOwner(nn.Module):
    """Builds its table in the forward from the token count, as RoPE owners do, and hands it to every block."""

    def __init__(self, layout: str, wrap: str, depth: int):
        super().__init__()
        self.layout, self.wrap = layout, wrap
        self.blocks = nn.ModuleList(PositionBlock(layout) for _ in range(depth))

    def table(self, x, text):
        batch, tokens, _ = x.shape
        rows = (torch.arange(tokens, dtype=x.dtype)[:, None] * 0.1
                + torch.arange(POSITION_DIM, dtype=x.dtype)[None] * 0.01).cos()
        if self.layout == "token first":
            return rows
        if self.layout == "batched heads":
            return rows[None, None].expand(batch, 1, tokens, POSITION_DIM)
        if self.layout == "broadcast":
            return rows[None]
        if self.layout in ("joint first", "joint last"):
            text_rows = (text[0, :, :1].detach() * 0 + 1).expand(-1, POSITION_DIM)  # (TEXT, D)
            return torch.cat([text_rows, rows] if self.layout == "joint first" else [rows, text_rows])
        return rows[None].expand(batch, tokens, POSITION_DIM) + x.detach() * 0

    def wrapped(self, table):
        return {"table": table} if self.wrap == "dict" else (table, table) if self.wrap == "tuple" else table

    def side(self, x, text):
        """The side inputs every block gets: (pos, text)."""
        return self.wrapped(self.table(x, text)), text

    def side_at(self, x, text, index):
        """The side inputs a block sees inside a route keeping tokens `index` (B, K), gathered by hand."""
        table, layout = self.table(x, text), self.layout
        if layout in ("joint first", "joint last"):
            own = table[TEXT_TOKENS:] if layout == "joint first" else table[:-TEXT_TOKENS]
            rows = torch.stack([own[i] for i in index])
            text_rows = table[:TEXT_TOKENS] if layout == "joint first" else table[-TEXT_TOKENS:]
            text_rows = text_rows[None].expand(index.shape[0], *text_rows.shape)
            table = torch.cat([text_rows, rows] if layout == "joint first" else [rows, text_rows], dim=1)
        elif layout == "token first":
            table = table[index]  # (B, K, D): one table per sample
        elif layout == "batched heads":
            table = torch.stack([t[:, i] for t, i in zip(table, index)])
        elif layout == "broadcast":
            table = table[0][index]
        else:
            table = torch.stack([t[i] for t, i in zip(table, index)])
        return self.wrapped(table), text

    def forward(self, x, text):
        side = self.side(x, text)
        for block in self.blocks:
            x = block(x, *side)
        return x


@dataclass(frozen=True)
class PositionCase:
    """A position-encoded model's recipe (plain data, so Hypothesis prints and shrinks it) and one route."""

    layout: str
    wrap: str
    depth: int
    start: int
    end: int
    batch: int
    tokens: int
    seed: int
    mode: str

    def build(self) -> PositionOwner:
        torch.manual_seed(self.seed)
        return PositionOwner(self.layout, self.wrap, self.depth)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        return (torch.randn(self.batch, self.tokens, POSITION_DIM, generator=g),
                torch.randn(self.batch, TEXT_TOKENS, POSITION_DIM, generator=g))


@st.composite
def position_cases(draw: st.DrawFn) -> PositionCase:
    """A random layout, container, depth, route, batch, token count and placement mode."""
    depth = draw(st.integers(2, 6))
    start = draw(st.integers(0, depth - 1))
    return PositionCase(
        layout=draw(st.sampled_from(POSITION_LAYOUTS)), wrap=draw(st.sampled_from(POSITION_WRAPS)), depth=depth,
        start=start, end=draw(st.integers(start, depth - 1)), batch=draw(st.integers(1, 3)),
        tokens=draw(st.integers(4, 9)), seed=draw(st.integers(0, 999)), mode=draw(st.sampled_from(["graph", "boundary"])))

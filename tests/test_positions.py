"""Per-token side inputs of any layout are routed with the tokens: position tables with the token axis
anywhere, with or without a batch axis, inside tuples and dicts, joined with another sequence's positions;
grid sizes handed to blocks as numbers.

The law, held on a random family of position-encoded models: each routed block computes exactly what the
original block computes on the kept tokens (its inputs gathered at them by hand here, never by routekit).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import routekit as rk

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, TEXT = 8, 3


class Block(nn.Module):
    """Attention-free so that a block's output at a token depends on that token alone: the routed block's
    outputs are then exactly the original block's at the kept tokens. Reads its position table in the layout
    `layout` names, and the text tokens' table rows where the table is joint."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x, pos, text=None):
        table = pos["table"] if isinstance(pos, dict) else pos[0] if isinstance(pos, tuple) else pos
        if self.layout in ("joint first", "joint last"):  # (TEXT + N, D), no batch axis, as joint attention reads it
            first = self.layout == "joint first"
            joint = torch.cat([text, x], 1) if first else torch.cat([x, text], 1)
            mixed = joint * table
            mine = mixed[:, text.shape[1]:] if first else mixed[:, :x.shape[1]]
            return x + self.fc(mine)
        if self.layout == "token first":  # (N, D)
            return x + self.fc(x * table)
        if self.layout == "batched heads":  # (B, 1, N, D): a head axis before the tokens
            return x + self.fc(x * table[:, 0])
        if self.layout == "broadcast":  # (1, N, D)
            return x + self.fc(x * table)
        return x + self.fc(x * table)  # (B, N, D)


class Owner(nn.Module):
    def __init__(self, layout: str, wrap: str, depth: int = 5):
        super().__init__()
        self.layout, self.wrap = layout, wrap
        self.blocks = nn.ModuleList(Block(layout) for _ in range(depth))

    def table(self, x, text):
        batch, tokens, _ = x.shape
        rows = torch.arange(tokens, dtype=x.dtype)[:, None] * 0.1 + torch.arange(DIM, dtype=x.dtype)[None] * 0.01
        if self.layout == "token first":
            return rows.cos()
        if self.layout == "batched heads":
            return rows.cos()[None, None].expand(batch, 1, tokens, DIM)
        if self.layout == "broadcast":
            return rows.cos()[None]
        if self.layout in ("joint first", "joint last"):
            text_rows = text[0, :, :1].detach() * 0 + 1  # (TEXT, 1): the text tokens' rows
            text_rows = text_rows.expand(-1, DIM)
            return torch.cat([text_rows, rows.cos()] if self.layout == "joint first" else [rows.cos(), text_rows])
        return rows.cos()[None].expand(batch, tokens, DIM) + x.detach() * 0

    def forward(self, x, text):
        table = self.table(x, text)
        pos = {"table": table} if self.wrap == "dict" else (table, table) if self.wrap == "tuple" else table
        for block in self.blocks:
            x = block(x, pos, text)
        return x


LAYOUTS = ["batched", "token first", "batched heads", "broadcast", "joint first", "joint last"]


def gathered(table, index, layout):
    """The table a block would read at the kept tokens `index` (B, K), by hand."""
    if layout == "token first":
        return table[index]  # (B, K, D): one table per sample
    if layout == "batched heads":
        return torch.stack([t[:, i] for t, i in zip(table, index)])
    if layout == "broadcast":
        return table[0][index]
    return torch.stack([t[i] for t, i in zip(table, index)])


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), wrap=st.sampled_from(["plain", "tuple", "dict"]), seed=st.integers(0, 999),
       batch=st.integers(1, 3), tokens=st.integers(4, 9), mode=st.sampled_from(["graph", "boundary"]))
def test_a_routed_block_computes_what_the_original_computes_on_the_kept_tokens(layout, wrap, seed, batch, tokens,
                                                                               mode):
    torch.manual_seed(seed)
    model = Owner(layout, wrap)
    x, text = torch.randn(batch, tokens, DIM), torch.randn(batch, TEXT, DIM)
    routed = rk.apply(model, rk.Route(start=1, end=3, rate=0.5), example_inputs=(x, text), mode=mode,
                      generator=torch.Generator().manual_seed(seed))
    plan = rk.report_of(routed)
    assert plan.blocks[1].side_inputs[0].kind == "per-token", plan
    seen = {}

    def record(i):
        def hook(module, args, out):
            seen.setdefault(i, (args, out))
        return hook

    handles = [routed.get_submodule(f"blocks.{i}").register_forward_hook(record(i)) for i in (1, 2)]
    routed.train()
    out = routed(x, text)
    for h in handles:
        h.remove()
    index = rk.report_of(routed).placed[0]
    kept_index = (~rk.last_route_mask(routed)).nonzero()[:, 1].view(batch, -1)
    stream_in = model.blocks[0](x, *model_side(model, x, text))  # the stream entering block 1
    a, got = seen[1]
    want = model.blocks[1](torch.stack([s[i] for s, i in zip(stream_in, kept_index)]), *routed_side(model, x, text,
                                                                                                    kept_index))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert out.shape == x.shape and index.kept == kept_index.shape[1]
    if layout in ("token first", "joint first", "joint last"):  # the consumer broadcasts a per-sample table
        assert not rk.report_of(routed).placed[0].shared


def model_side(model: Owner, x, text):
    table = model.table(x, text)
    pos = {"table": table} if model.wrap == "dict" else (table, table) if model.wrap == "tuple" else table
    return pos, text


def routed_side(model: Owner, x, text, index):
    """The side inputs of a routed block, gathered by hand."""
    table = model.table(x, text)
    layout = model.layout
    if layout in ("joint first", "joint last"):
        own = table[TEXT:] if layout == "joint first" else table[:-TEXT]
        rows = torch.stack([own[i] for i in index])
        text_rows = table[:TEXT] if layout == "joint first" else table[-TEXT:]
        text_rows = text_rows[None].expand(index.shape[0], *text_rows.shape)
        table = torch.cat([text_rows, rows] if layout == "joint first" else [rows, text_rows], dim=1)
    else:
        table = gathered(table, index, layout)
    pos = {"table": table} if model.wrap == "dict" else (table, table) if model.wrap == "tuple" else table
    return pos, text


class SharedOnly(nn.Module):
    """A block whose table must stay unbatched: it reshapes it to (N, D) explicitly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x, table):
        return x + self.fc(x * table.reshape(x.shape[1], DIM))


class SharedOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(SharedOnly() for _ in range(4))

    def forward(self, x):
        table = torch.linspace(0, 1, x.shape[1] * DIM).view(x.shape[1], DIM)
        for block in self.blocks:
            x = block(x, table)
        return x


def test_a_table_the_block_cannot_take_per_sample_gets_one_selection_for_the_batch():
    torch.manual_seed(0)
    model, x = SharedOwner(), torch.randn(3, 8, DIM)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))
    plan = rk.report_of(routed)
    assert plan.placed[0].shared and "one selection for the batch" in str(plan)
    routed.train()
    routed(x)
    mask = rk.last_route_mask(routed)
    assert (mask == mask[:1]).all() and mask.sum(1).tolist() == [4] * 3
    rk.verify(model, routed, (x,))


class GridSized(nn.Module):
    """A block handed the grid's height and width as numbers, which it reshapes its tokens with (as Sana's)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(DIM, DIM, 3, padding=1)

    def forward(self, x, height, width):
        image = x.transpose(1, 2).reshape(x.shape[0], DIM, height, width)
        return x + self.conv(image).flatten(2).transpose(1, 2)


class GridOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.blocks = nn.ModuleList(GridSized() for _ in range(4))

    def forward(self, image):
        x = self.embed(image)
        height, width = x.shape[2], x.shape[3]
        x = x.flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, height, width)
        return x


@pytest.mark.parametrize("mode", ["graph", "boundary"])
@pytest.mark.parametrize("selector", ["row", "column", "window"])
def test_grid_sizes_handed_to_blocks_as_numbers_follow_the_kept_grid(mode, selector):
    torch.manual_seed(0)
    model, image = GridOwner(), torch.randn(2, 3, 12, 16)
    routed = rk.apply(model, rk.Route(start=1, end=2, selector=selector), example_inputs=(image,), mode=mode)
    routed.train()
    assert routed(image).shape == (2, 48, DIM)
    rk.verify(model, routed, (image,))
    with pytest.raises(rk.ConfigError, match="grid's sizes.*selector='row'"):
        rk.apply(model, rk.Route(start=1, end=2, selector="importance"), example_inputs=(image,), mode=mode)

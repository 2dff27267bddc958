"""A block alone, on made-up inputs shaped like the ones it was recorded with: to probe it (probe.py), to find
its residual adds (residuals.py), and to trace it again for a call of other shapes (bind.py).

The inputs are made from what the block was handed (a `findings.BlockInfo`'s side inputs, tensors as
TensorMeta): zeros, or seeded normals, on the model's device; as a route's blocks see them with `tokens`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .calls import bind_arguments
from .findings import BlockInfo, Shrink
from .graphs import Slot
from .routing import gather_tokens, route_side
from .trace import Trace, trace
from .values import TensorMeta


def fake_block_inputs(block: BlockInfo, stream_slot: Slot, stream: TensorMeta, device, tokens: int | None = None,
                      shrink: tuple[int, ...] = (), random: bool = False, shared: bool = True,
                      index: torch.Tensor | None = None) -> tuple[list, dict]:
    """Tensors shaped like `block`'s inputs (zeros, or seeded normals with `random`): to trace or probe a block
    alone. With `tokens`, as a route's blocks see them: the stream and every token-carrying tensor cut to the
    first `tokens` tokens, or to each sample's `index` (batch, tokens) (tables without a batch axis kept so
    where `shared`, else made one per sample), and the grid's sizes along the axes `shrink` names shrunk in
    proportion."""
    generator = torch.Generator().manual_seed(0)

    def fake(meta):
        if not isinstance(meta, TensorMeta):
            return meta
        if random and (meta.dtype.is_floating_point or meta.dtype.is_complex):  # a complex RoPE table too
            return torch.randn(meta.shape, generator=generator, dtype=meta.dtype).to(device)
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)

    values = {stream_slot: fake(stream)}
    for side in block.side_inputs:
        values[side.slot] = pytree.tree_map(fake, side.meta)
    if tokens is not None:
        full = values[stream_slot]
        index = torch.arange(tokens, device=device).expand(full.shape[0], tokens) if index is None else index.to(device)
        values[stream_slot] = gather_tokens(full, index)
        for side in block.side_inputs:
            sizes = tuple(Shrink(path) for path, axis in side.grid if axis in shrink)
            values[side.slot] = route_side(values[side.slot], full, index, side.tokens + sizes, shared=shared)
    args = [values[i] for i in sorted(s for s in values if isinstance(s, int))]
    return args, {k: v for k, v in values.items() if isinstance(k, str)}


def device_of(model: nn.Module):
    param = next(model.parameters(), None)
    return param.device if param is not None else "cpu"


def traced_alone(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, out_index: int | None,
                 tokens: int, shrink: tuple[int, ...] = (), shared: bool = True) -> tuple[Trace, fx.Node, Any]:
    """Trace one block alone on inputs as a route's blocks see them at `tokens` tokens (grid sizes handed as
    numbers shrunk along `shrink`, tables without a batch axis kept so where `shared`: `fake_block_inputs`);
    returns the trace, the stream's placeholder and the output node(s) of the block's stream output."""
    module = model.get_submodule(block.qualname)
    cut = None if tokens == stream.shape[1] else tokens
    args, kwargs = fake_block_inputs(block, stream_slot, stream, device_of(model), cut, shrink, shared=shared)
    tr = trace(module, tuple(args), kwargs)
    bound = bind_arguments(type(module).forward, tuple(args), kwargs)
    name = list(bound.arguments)[stream_slot] if isinstance(stream_slot, int) else stream_slot
    start = next(n for n in tr.graph.nodes if n.op == "placeholder" and n.target == name)
    leaves = next(n for n in tr.graph.nodes if n.op == "output").args[0]
    out = pytree.tree_unflatten(list(leaves), tr.out_spec)
    return tr, start, out if out_index is None else out[out_index]

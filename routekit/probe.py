"""Running one block alone, as a route's blocks would see their inputs: to probe it, or to trace it.

What the owner's graph leaves open about a block (does it still run on fewer tokens? with a side input cut
or whole? what does its own code do with the stream?) is settled by calling the block by itself on
made-up inputs shaped like its recorded ones (`fake_block_inputs`), without lasting side effects.
The side-input analysis, the plan and the rewrite all ask these questions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .calls import bind_arguments
from .findings import BlockInfo
from .graphs import Slot
from .residuals import find_residual_adds
from .routing import Shrink, gather_tokens, route_side
from .state import fresh, preserved_state
from .trace import Trace, trace
from .values import TensorMeta


def fake_block_inputs(block: BlockInfo, stream_slot: Slot, stream: TensorMeta, device, tokens: int | None = None,
                      shrink: tuple[int, ...] = (), random: bool = False, shared: bool = True) -> tuple[list, dict]:
    """Tensors shaped like `block`'s inputs (zeros, or seeded normals with `random`): to trace or probe a block
    alone. With `tokens`, as a route's blocks see them: the stream and every token-carrying tensor cut to the
    first `tokens` tokens (tables without a batch axis kept so where `shared`, else made one per sample), and
    the grid's sizes along the axes `shrink` names shrunk in proportion."""
    generator = torch.Generator().manual_seed(0)

    def fake(meta):
        if not isinstance(meta, TensorMeta):
            return meta
        if random and meta.dtype.is_floating_point:
            return torch.randn(meta.shape, generator=generator, dtype=meta.dtype).to(device)
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)

    values = {stream_slot: fake(stream)}
    for side in block.side_inputs:
        values[side.slot] = pytree.tree_map(fake, side.meta)
    if tokens is not None:
        full = values[stream_slot]
        index = torch.arange(tokens, device=device).expand(full.shape[0], tokens)
        values[stream_slot] = gather_tokens(full, index)
        for side in block.side_inputs:
            sizes = tuple(Shrink(path) for path, axis in side.grid if axis in shrink)
            values[side.slot] = route_side(values[side.slot], full, index, side.tokens + sizes, shared=shared)
    args = [values[i] for i in sorted(s for s in values if isinstance(s, int))]
    return args, {k: v for k, v in values.items() if isinstance(k, str)}


def _device(model: nn.Module):
    param = next(model.parameters(), None)
    return param.device if param is not None else "cpu"


def block_runs(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, tokens: int,
               shrink: tuple[int, ...] = ()) -> bool:
    """Probe: does the block run as a route's block on `tokens` tokens (zeros), with no lasting side effects?"""
    return run_block(model, block, stream_slot, stream, tokens, shrink) is not None


def run_block(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, tokens: int,
              shrink: tuple[int, ...] = (), random: bool = False, shared: bool = True) -> Any:
    """The block's output as a route's block on `tokens` tokens (`fake_block_inputs`), or None where it fails;
    no lasting side effects."""
    args, kwargs = fresh(fake_block_inputs(block, stream_slot, stream, _device(model), tokens, shrink, random, shared))
    with preserved_state(model, [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]):
        torch.manual_seed(0)
        try:
            return model.get_submodule(block.qualname)(*args, **kwargs)
        except Exception:
            return None


def trace_block(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, out_index: int | None,
                tokens: int, shrink: tuple[int, ...] = (), shared: bool = True) -> tuple[Trace, tuple[str, ...], str]:
    """Trace one block alone on inputs as a route's blocks see them at `tokens` tokens (grid sizes handed as
    numbers shrunk along `shrink`, tables without a batch axis kept so where `shared`: `fake_block_inputs`);
    returns the trace, its residual adds (node names) and the stream's placeholder."""
    module = model.get_submodule(block.qualname)
    cut = None if tokens == stream.shape[1] else tokens
    args, kwargs = fake_block_inputs(block, stream_slot, stream, _device(model), cut, shrink, shared=shared)
    tr = trace(module, tuple(args), kwargs)
    bound = bind_arguments(type(module).forward, tuple(args), kwargs)
    name = list(bound.arguments)[stream_slot] if isinstance(stream_slot, int) else stream_slot
    start = next(n for n in tr.graph.nodes if n.op == "placeholder" and n.target == name)
    leaves = next(n for n in tr.graph.nodes if n.op == "output").args[0]
    out = pytree.tree_unflatten(list(leaves), tr.out_spec)
    out = out if out_index is None else out[out_index]
    return tr, tuple(n.name for n in find_residual_adds(tr.graph, start, out)), start.name

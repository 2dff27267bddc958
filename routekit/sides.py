"""Side inputs: a block's inputs other than the stream, and how a route must change each of them.

Other block inputs are per-token (they carry the token axis and must be gathered with a route's indices,
wherever their token axes are), per-sample, or constants; numbers named like the grid's sizes shrink with
grid selectors. Which axes carry the stream's tokens is read off the block's data flow (flow.py): the axes
its code ties to the stream's token axis, never an axis that is merely as long. Where the block does not run
on fake tensors, the shapes propose token axes and probes of the block decide (probe.py): an input the block
takes whole on fewer tokens than the stream's is not per-token, whatever its length. The layout of a joint
table (text and image tokens along one axis) is read off the block's own code.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .errors import RoutekitError
from .findings import BlockInfo, Gather, SideInput
from .flow import UNREAD, Tied
from .graphs import CATS, Slot, meta_of, to_networkx
from .probe import block_runs, trace_block
from .routing import is_opaque, keys
from .trace import Trace
from .values import TensorMeta


def side_input(slot: Slot, arg: Any, names: dict, batch: int, tokens: int, channels: int,
               sequences: set[int], tied: dict[tuple, Tied] | None) -> tuple[SideInput, tuple[Gather, ...]]:
    """Classify a block input: its tensors by the axes the block's data flow ties to the stream's (`tied`:
    {path: Tied}, from `flow.token_axes`), or where that is unknown (None) by their shapes (token axes are those
    as long as the stream, or as the stream joined with another sequence of the block's inputs: `sequences`),
    its numbers by name. Joint tables come back apart, listed as `unordered` until `joint_order` reads their
    layout off the block."""
    node = arg.name if isinstance(arg, fx.Node) else None
    meta = meta_of(arg)
    gathers, grid, joint, sealed = [], [], [], []
    for path, leaf in pytree.tree_flatten_with_path(meta, is_leaf=is_opaque)[0]:
        inside = [m for m in pytree.tree_leaves(leaf) if isinstance(m, TensorMeta)] if is_opaque(leaf) else []
        if any(_token_axes(m, batch, tokens, channels, sequences) for m in inside) and not isinstance(leaf, TensorMeta):
            sealed.append(keys(path))
        if isinstance(leaf, TensorMeta):
            found = tied.get(keys(path)) if tied is not None else UNREAD
            if found is UNREAD:  # no data flow to read (the block does not run on fake tensors, or never reads it
                # on this call): its shape proposes, and probes of the block decide (`resolved`)
                found = _token_axes(leaf, batch, tokens, channels, sequences)
            elif found is not None:
                found = (found.axes, found.batched, found.relation == "joint")
            if found is not None:
                axes, batched, is_joint = found
                (joint if is_joint else gathers).append(Gather(keys(path), axes, batched))
        elif type(leaf) is int:
            axis = _grid_axis(names.get(slot, str(slot)), keys(path))
            if axis is not None:
                grid.append((keys(path), axis))
    return (SideInput(slot, node, meta, tuple(gathers), tuple(grid), tuple(g.path for g in joint), sealed=tuple(sealed),
                      argument=names.get(slot, slot)), tuple(joint))


def _token_axes(meta: TensorMeta, batch: int, tokens: int, channels: int,
                sequences: set[int]) -> tuple[tuple[int, ...], bool, bool] | None:
    """(token axes, batched, joint) of a tensor that carries the stream's tokens, else None.

    Batched: the first axis is the batch (or 1, a table shared by it). Token axes: every later axis as long
    as the stream (an attention mask (B, 1, N, N) has two); the last axis only where it is the only one left
    (a mask (B, N), positions (N,)), or the one before it is a token axis too and it is not as long as the
    stream's features (a mask (B, 1, N, N)), or the tensor is boolean (a key-padding mask (B, 1, 1, N)), for
    elsewhere it holds features;
    failing those, one axis as long as the stream joined with another sequence the block takes (a joint
    text + image table, or a boolean mask over both, whose last axis is the keys': HunyuanVideo's (B, 1, 1, N + L);
    `joint` says so, and where the stream's part lies is read off the block).
    """
    shape = meta.shape
    batched = len(shape) >= 2 and shape[0] in (batch, 1) and any(d in (tokens,) or d - tokens in sequences
                                                                 for d in shape[1:])
    start = 1 if batched else 0
    last = len(shape) - 1
    axes = [a for a in range(start, len(shape)) if shape[a] == tokens]
    if last in axes and last - start >= 1 and meta.dtype != torch.bool and (last - 1 not in axes
                                                                         or shape[last] == channels):
        axes.remove(last)  # a table's last axis holds its features, which may happen to number as many; a
        # boolean mask has none: its last axis holds the keys (a key-padding mask (B, 1, 1, N))
    if axes:
        return tuple(axes), batched, False
    features = last if len(shape) >= 2 and meta.dtype != torch.bool else None  # a mask's last axis holds keys
    joint = [a for a in range(start, len(shape)) if a != features and shape[a] > tokens and shape[a] - tokens in sequences]
    return ((joint[0],), batched, True) if joint else None


_GRID_NAMES = {-1: ("width", "w", "cols", "columns"), -2: ("height", "h", "rows"), -3: ("frames", "num_frames", "t",
                                                                                        "f", "time")}


def _grid_axis(name: str, path: tuple) -> int | None:
    """Which grid size a number handed to a block is, from its argument's (or dict key's) name."""
    for key in reversed([*map(str, path), name]):
        words = key.lower().replace("-", "_").split("_")
        for axis, names in _GRID_NAMES.items():
            if key.lower() in names or any(w in names[:2] for w in words):
                return axis
    return None


def resolved(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, fewer: int,
             decided: dict) -> BlockInfo:
    """Settle by probing the block with `fewer` tokens what its shapes alone proposed, where its data flow is
    unknown (`BlockInfo.flow` False; a block whose data flow was read needs no probe).

    An input proposed as per-token that the block takes whole beside the cut stream is not per-token (a caption
    as long as the stream, read by cross-attention; a (B, D) embedding with D as long): the block would fail if
    its axis met the stream's. A tensor whose last axis is as long as the stream and follows a token axis (an
    attention mask (B, 1, N, N), or a RoPE table (B, N, head_dim) where head_dim happens to equal N) has its last
    axis cut where the block runs that way: every such tensor's two readings are probed together (a block given a
    mask and a RoPE table fails if either is cut wrong), and one combination must run, else each is `collided`.
    `decided` carries the decision from block to block (same class, same inputs).
    """
    if block.flow:
        return block
    tokens = stream.shape[1]
    sides = list(block.side_inputs)
    for i, side in enumerate(sides):
        if not any(side.leaf(g.path).shape[a] == tokens for g in side.tokens for a in g.axes):
            continue
        unchanged = replace(side, tokens=())
        without = replace(block, side_inputs=tuple(sides[:i] + [unchanged] + sides[i + 1:]))
        key = (block.cls, "whole", side.slot, repr(side.meta))
        if key not in decided:  # where the block fails either way (it needs whole grid rows), the shape proposed
            decided[key] = fewer >= 1 and block_runs(model, without, stream_slot, stream, fewer)
        if decided[key]:
            sides[i] = unchanged
    open_ = [(i, j) for i, side in enumerate(sides) for j, g in enumerate(side.tokens)
             if len(g.axes) >= 2 and g.axes[-1] == len(side.leaf(g.path).shape) - 1]
    if not open_ or fewer < 1:
        return replace(block, side_inputs=tuple(sides))

    def read(narrow: tuple[bool, ...]) -> list[SideInput]:
        out = list(sides)
        for (i, j), cut in zip(open_, narrow):
            if cut:
                g = out[i].tokens[j]
                out[i] = replace(out[i], tokens=out[i].tokens[:j] + (g._replace(axes=g.axes[:-1]),) + out[i].tokens[j + 1:])
        return out

    key = (block.cls, tuple((sides[i].node, sides[i].tokens[j].path) for i, j in open_))
    if key not in decided:
        readings = sorted(itertools.product((True, False), repeat=len(open_)), key=lambda r: -sum(r))[:16]
        decided[key] = next((r for r in readings if block_runs(model, replace(block, side_inputs=tuple(read(r))),
                                                                 stream_slot, stream, fewer)), None)
    if decided[key] is not None:
        return replace(block, side_inputs=tuple(read(decided[key])))
    for i, j in open_:
        sides[i] = replace(sides[i], collided=sides[i].collided + (sides[i].tokens[j].path,))
    return replace(block, side_inputs=tuple(sides))


def image_tables(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, special: tuple[int, ...],
                 row: int, decided: dict) -> BlockInfo:
    """`block` with its tables over the image's tokens only cut as the stream is: tensors the shapes left
    unclassified with an axis as long as the stream less its `special` tokens, where those lead the stream.

    DINOv3 hands each block a rotary table over the patches alone, and the block lines it up with the stream's
    last tokens by length, taking the tokens before them for class and registers. Left whole, such a table
    puts every kept token at a wrong position, or fails where the stream gets shorter than the table: so a
    block that runs with the tables whole on fewer tokens than they have rows does not line them up so (a text
    sequence that happens to be as long), and one that runs only with them cut (the kept image tokens' rows:
    the special ones, which every route keeps, lead each sorted index) does. `row`: the grid's last size (1
    without a grid), so the probe keeps whole rows. `decided` carries the answer from block to block.
    """
    batch, tokens, _ = stream.shape
    k = len(special)
    count = tokens - row * (k // row + 1)  # whole rows fewer, the stream shorter than the tables
    if block.flow or not k or tuple(special) != tuple(range(k)) or count <= k:
        return block
    found = {}
    for i, side in enumerate(block.side_inputs):
        taken = {g.path for g in side.tokens}
        for path, leaf in pytree.tree_flatten_with_path(side.meta, is_leaf=is_opaque)[0]:
            axes = _image_axes(leaf, batch, tokens - k) if isinstance(leaf, TensorMeta) else None
            if axes and keys(path) not in taken:
                found.setdefault(i, []).append(Gather(keys(path), *axes))
    if not found:
        return block
    cut = tuple(replace(s, tokens=s.tokens + tuple(found.get(i, ()))) for i, s in enumerate(block.side_inputs))
    key = (block.cls, tuple((block.side_inputs[i].node, tuple(g.path for g in gs)) for i, gs in found.items()))
    if key not in decided:
        decided[key] = (not block_runs(model, block, stream_slot, stream, count)
                        and block_runs(model, replace(block, side_inputs=cut), stream_slot, stream, count))
    return replace(block, side_inputs=cut) if decided[key] else block


def _image_axes(meta: TensorMeta, batch: int, rows: int) -> tuple[tuple[int, ...], bool] | None:
    """(axes as long as `rows`, batched) of a tensor, read as `_token_axes` reads token axes: the first axis is
    the batch's where it is as long (or 1) and a later axis has `rows`, and a last axis after another holds
    features unless the tensor is boolean."""
    shape = meta.shape
    batched = len(shape) >= 2 and shape[0] in (batch, 1) and rows in shape[1:]
    start = 1 if batched else 0
    last = len(shape) - 1
    axes = tuple(a for a in range(start, len(shape)) if shape[a] == rows
                 and not (a == last and last > start and meta.dtype != torch.bool))
    return (axes, batched) if axes else None


def joint_order(model: nn.Module, block: BlockInfo, joint: dict, stream_slot: Slot, stream: TensorMeta) -> BlockInfo:
    """Place the joint tables (`joint`: slot → its Gathers, a token axis holding another sequence and the
    stream): whether the other sequence comes first is read off the block's own code, where it joins the two
    along the token axis (a `cat` of a value made without the stream and one made from it). A table whose
    layout the block does not show stays `unordered`: the plan refuses to route through the block."""
    if not any(joint.values()):
        return block
    try:
        body, _, start = trace_block(model, block, stream_slot, stream, None, stream.shape[1])
        first = _cat_order(body, start)
    except RoutekitError:
        first = None
    if first is None:
        return block
    sides = []
    for side in block.side_inputs:
        placed = tuple(g._replace(rest_first=first) for g in joint.get(side.slot, ()))
        sides.append(replace(side, tokens=side.tokens + placed, unordered=()) if placed else side)
    return replace(block, side_inputs=tuple(sides))


def _cat_order(body: Trace, stream: str) -> bool | None:
    """True when the block joins another input's tokens before the stream's (cat([other, stream]) along some
    axis), False when after, None when it shows no such join. `stream`: the stream's placeholder in `body`."""
    g = to_networkx(body.graph)
    for node in body.graph.nodes:
        is_cat = (node.op == "call_function" and node.target in CATS) or (node.op == "call_method" and node.target == "cat")
        if not is_cat or not isinstance(node.args[0], (list, tuple)) or len(node.args[0]) < 2:
            continue
        parts = [p for p in node.args[0] if isinstance(p, fx.Node)]
        made_from = [nx.ancestors(g, p.name) | {p.name} for p in parts]
        inputs = {n.name for n in body.graph.nodes if n.op == "placeholder"}
        kinds = ["stream" if stream in up else "other" if up & inputs else None for up in made_from]
        if "stream" in kinds and "other" in kinds:
            return kinds.index("other") < kinds.index("stream")
    return None

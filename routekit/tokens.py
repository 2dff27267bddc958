"""Which of the stream's tokens were made from the image, and on what grid.

The token grid is read off the patch embedding the stream comes from; tokens of the stream that do not
come from it (class, register, text tokens) are special, and routes keep them. A traced graph shows both:
each token's origin is read backwards along the token axis (origins.py). A recording shows no
owner code, so there they are measured on the example call (record.py's measurements). Where stacks are
chained (Flux's double-stream blocks, then its single-stream ones), a later stack's tokens are placed by
where the previous stack's output sits in its stream (`join_offset`).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .errors import AnalysisError
from .findings import BlockInfo, CallGrid, Segment, Stack, layout_positions
from .graphs import Slot, slot_value, to_networkx
from .origins import Origins
from .probe import LayoutPerSample, grid_cells, token_offset, tokens_not_from
from .record import Image, grid_image, grid_of_call, image_input, named_sizes
from .trace import Trace
from .values import TensorMeta


def first_stack(tr: Trace, model: nn.Module, chains: dict, name: str, blocks: list[BlockInfo], stream: TensorMeta,
                images: list[Image] | None, call: tuple[tuple, dict] | None) -> dict:
    """The first stack's grid and special tokens: read off the graph, or measured where it does not show them."""
    nodes, (slot, _) = chains[name]
    batch, tokens, _ = stream.shape
    first_in = slot_value(nodes[0], slot)
    grid = grid_node = None
    unknown = None
    try:
        if images is None:
            special = _graph_special(tr.graph, first_in, batch, tokens, chains, model)
        else:
            at = _measure_point(chains, name, batch, tokens)
            grid, grid_node, special = _recorded_grid(model, images, tr, blocks[0], at, batch, tokens, call)
            if not special and grid is None and call is not None:
                special = _recorded_special(model, call, chains, name, at, batch, tokens)
        if special is None:  # what the graph or the recording does not show, measured: conclusive only if it finds some
            at = _measure_point(chains, name, batch, tokens)
            special = _measured(model, call, (at, (nodes[0].target, slot)), batch, tokens) if call is not None else None
            if not special:
                special, unknown = (), (
                    "routekit could not read off the graph which of the stream's tokens were made from the image (a "
                    "join along the token axis, or a write into the tokens, it cannot follow), nor measure any that "
                    "were not" if images is None else
                    "routekit could not measure which of the stream's tokens were not made from the image")
    except LayoutPerSample as err:  # no one set of positions, and no grid of one set of image tokens
        return {"grid": None, "grid_node": None, "call_grid": None, "special": (), "reordered": None,
                "unknown_special": f"{err} (a keep that covers the longest caption a batch can hold keeps every sample's: "
                                  "keep=list(range(L)) for captions of at most L tokens, with a selector that picks single "
                                  "tokens)"}
    if images is None:
        grid, grid_node = _graph_grid(tr.graph, model, first_in, batch, tokens - len(special))
    skipped = {p % tokens for p in special}
    positions = [p for p in range(tokens) if p not in skipped]  # the image's tokens, where the grid's cells go
    at = _measure_point(chains, name, batch, tokens)
    cells, measured, rule = None, False, None
    if grid is None and call is not None:  # no patch embedding shows it: the image patchified by reshaping
        rule, cells, measured = _grid_from_image(model, call, at, batch, positions, bool(special))
        grid = grid_of_call(rule, *call, batch) if rule is not None else None
    if grid is None and call is not None:  # packed latents, their sizes named in the call
        grid = _grid_from_sizes(call, len(positions))
        rule = CallGrid() if grid is not None else None
    module = grid_node if images is not None or grid_node is None else _module_of(tr.graph, grid_node)
    if grid is not None and call is not None and not measured:
        cells = grid_cells(model, *call, *at, grid, positions, module=module,
                           image=None if module is not None else image_input(*call, batch))
    return {"grid": grid, "grid_node": grid_node, "call_grid": rule, "special": special, "unknown_special": unknown,
            "reordered": _broken_lines(cells, grid, positions, at[0], module) if cells is not None else None,
            "layout": _layout(tr.graph, first_in, batch, tokens, chains, special, model=model) if images is None else None}


def _layout(graph: fx.Graph, stream_in: fx.Node, batch: int, tokens: int, chains: dict, special: tuple[int, ...],
            source: fx.Node | None = None, model: nn.Module | None = None) -> tuple[Segment, ...] | None:
    """The stream's layout (`Origins.layout`) where the graph shows one that gives this call's `special` tokens
    (the layout of a stream with nothing from the image is all the image's: the tokens are alike); else None."""
    found = Origins(graph, stream_in, batch, chains, source, model).layout(stream_in, tokens)
    if found is not None and all(s.special for s in found) and not special:
        found = (Segment(False, None),)
    sizes = {n.target: n.meta["rk"].shape for n in graph.nodes
             if n.op == "placeholder" and isinstance(n.meta.get("rk"), TensorMeta)}
    placed = layout_positions(found, tokens, sizes) if found is not None else None
    return found if placed is not None and placed[0] == tuple(special) else None


def joined_stack(graph: fx.Graph, chains: dict, before: str, name: str, previous: Stack, stream: TensorMeta,
                 measure=None) -> dict:
    """A later stack's grid and special tokens: the previous stack's tokens sit at `joined_at` in its stream, in
    order; every other token was joined in by the owner (text in front of Flux's single-stream blocks) and is
    special, as are the previous stack's own special tokens."""
    offset = join_offset(graph, chains, before, name, measure)
    tokens = stream.shape[1]
    special = [True] * tokens
    made = [p % previous.tokens not in {q % previous.tokens for q in previous.special} for p in range(previous.tokens)]
    for p, from_image in enumerate(made):
        special[offset + p] = not from_image
    out, into = _stream_out(chains, before), slot_value(chains[name][0][0], chains[name][1][0])
    layout = None
    if measure is None and isinstance(into, fx.Node):  # the joins around the earlier stack's run, as any call makes them
        layout = _layout(graph, into, stream.shape[0], tokens, chains, _positions([p < offset or p >= offset
                         + previous.tokens for p in range(tokens)]), source=out)
    return {"grid": previous.grid, "grid_node": previous.grid_node, "special": _positions(special),
            "unknown_special": previous.unknown_special, "reordered": previous.reordered, "joined_at": offset,
            "layout": layout}


def _stream_out(chains: dict, name: str) -> fx.Node | None:
    nodes, (_, out_index) = chains[name]
    last = nodes[-1]
    if out_index is None:
        return last
    return next((u for u in last.users if u.target is operator.getitem and u.args[1] == out_index), None)


def join_offset(graph: fx.Graph, chains: dict, before: str, after: str, measure=None) -> int:
    """Where the tokens `before`'s last block hands on sit in the stream entering `after`: all of them, in order,
    at one offset. A recording shows no owner code: there the stream is that output itself, or holds it
    unchanged at an offset `measure(before, after)` finds on the example call (a cat, not a projection).
    AnalysisError where the stacks are not joined so."""
    out, stream = _stream_out(chains, before), slot_value(chains[after][0][0], chains[after][1][0])
    meta, into = getattr(out, "meta", {}).get("rk"), getattr(stream, "meta", {}).get("rk")
    if out is None or not isinstance(meta, TensorMeta) or not isinstance(into, TensorMeta) or len(meta.shape) != 3 \
            or len(into.shape) != 3 or meta.shape[0] != into.shape[0] or meta.shape[2] != into.shape[2]:
        raise AnalysisError(f"{after} does not take {before}'s tokens")
    if stream is out:
        return 0
    if measure is not None:
        offset = measure(before, after)
        if offset is None:
            raise AnalysisError(f"{after}'s stream does not hold {before}'s output unchanged")
        return offset
    made = Origins(graph, stream, into.shape[0], chains, source=out).of(stream, into.shape[1])
    count = meta.shape[1]
    starts = [i for i in range(into.shape[1] - count + 1) if made is not None and all(made[i:i + count])]
    if not starts or sum(made) != count:
        raise AnalysisError(f"{after}'s stream does not hold {before}'s {count} tokens in one run")
    return starts[0]


def grid_of(meta: Any, batch: int) -> tuple[int, ...] | None:
    """The spatial grid of a (batch, C, H, W) or (batch, C, T, H, W) tensor: what a patch embedding makes."""
    if isinstance(meta, TensorMeta) and len(meta.shape) in (4, 5) and meta.shape[0] == batch:
        return tuple(meta.shape[2:])
    return None


_PATCH_EMBEDDINGS = (nn.Conv2d, nn.Conv3d)


def _graph_special(graph: fx.Graph, stream_in: fx.Node, batch: int, tokens: int,
                   chains: dict, model: nn.Module | None = None) -> tuple[int, ...] | None:
    """The special tokens a traced graph shows: those the owner put into the stream from something other than the
    image (`origins.Origins`): text joined in, register and class tokens, with or without a grid; None where
    the graph does not show them."""
    made = Origins(graph, stream_in, batch, chains, model=model).of(stream_in, tokens)
    if made is None:
        return None
    special = _positions([not m for m in made])
    return () if len(special) == tokens else special  # nothing from the first input: it is not the image


def _graph_grid(graph: fx.Graph, model: nn.Module, stream_in: fx.Node, batch: int,
                cells: int) -> tuple[tuple[int, ...] | None, str | None]:
    """(grid, its node): the patch embedding the stream comes from (a Conv2d/Conv3d's output, else the nearest
    (B, C, H, W) or (B, C, T, H, W) ancestor) with `cells` cells, the stream's tokens but the special ones."""
    g = to_networkx(graph)
    ancestors = nx.ancestors(g, stream_in.name) | {stream_in.name}
    nearest = [n for n in reversed(graph.nodes) if n.name in ancestors and grid_of(n.meta["rk"], batch)]
    convs = [n for n in nearest if n.op == "call_module" and isinstance(model.get_submodule(n.target),
                                                                       _PATCH_EMBEDDINGS)]
    for node in convs + nearest:
        grid = grid_of(node.meta["rk"], batch)
        if math.prod(grid) == cells:
            return grid, node.name
    return None, None


def _module_of(graph: fx.Graph, node_name: str) -> str | None:
    """The module a graph node calls (a patch embedding's path); None for a node of another kind."""
    node = next((n for n in graph.nodes if n.name == node_name), None)
    return node.target if node is not None and node.op == "call_module" else None


def _broken_lines(cells: tuple[int, ...], grid: tuple[int, ...], positions: list[int], block: str,
                  source: str | None) -> str | None:
    """Why the stream's grid lines are not the image's, given the cell each image token (at `positions` in the
    stream entering `block`) was measured to come from (`probe.grid_cells`): an owner that reorders the tokens
    after the patch embedding (Hiera's mask units); None where each line of the stream along an axis is a line of
    the image along that axis (raster order, or lines flipped or shuffled whole: what grid selectors keep is still
    whole rows, columns and frames)."""
    where = torch.unravel_index(torch.tensor(cells).reshape(grid), grid)  # per axis: the image's coordinate
    broken = [(axis, other) for axis, coordinate in enumerate(where) for other in range(len(grid))
              if other != axis and not (coordinate == coordinate.narrow(other, 0, 1)).all()]
    if not broken:
        return None
    axis, other = broken[0]  # the image's coordinate along `axis` changes along the stream grid's axis `other`
    coordinates = ("frame", "row", "column")[-len(grid):]  # what an index along each axis counts
    lines = ("tube", "column", "row")[-len(grid):]  # the line of the grid an axis runs along
    moved = (where[axis] != where[axis].narrow(other, 0, 1)).flatten().nonzero()[0, 0].item()
    return (f"the image's tokens enter {block} in an order whose lines are not the image's: within one "
            f"{lines[other]} of the stream's {'×'.join(map(str, grid))} grid the image's {coordinates[axis]} changes "
            f"(token {positions[moved]} comes from {source or 'the image'}'s cell {cells[moved]}, counted row by row)")


def _positions(flags: list[bool]) -> tuple[int, ...]:
    """The flagged token positions: counted from the start before the first unflagged one, from the end after it
    (text before the image keeps its positions at any image size, register tokens after it theirs)."""
    first = next((i for i, f in enumerate(flags) if not f), len(flags))
    return tuple(i if i < first else i - len(flags) for i, f in enumerate(flags) if f)


def _measure_point(chains: dict, chosen: str, batch: int, tokens: int) -> tuple[str, Slot]:
    """Where a recording's special tokens are measured: (block, stream slot) of the first block of the earliest
    chain whose stream is the stack's, as many tokens (U-ViT's in-blocks before its out-blocks: there the blocks
    have not mixed the class token with the image's yet), else of the stack's own first block."""
    nodes, (slot, _) = chains[chosen]
    order = {node: i for i, node in enumerate(nodes[0].graph.nodes)}
    for others, (other_slot, _) in sorted(chains.values(), key=lambda item: order[item[0][0]]):
        meta = getattr(slot_value(others[0], other_slot), "meta", {}).get("rk")
        if order[others[0]] <= order[nodes[0]] and isinstance(meta, TensorMeta) and meta.shape[:2] == (batch, tokens):
            return others[0].target, other_slot
    return nodes[0].target, slot


def _recorded_grid(model: nn.Module, images: list[Image], tr: Trace, first: BlockInfo, at: tuple[str, Slot],
                   batch: int, tokens: int, call: tuple[tuple, dict] | None):
    """(grid, grid module, special positions; None where unmeasured) of a recording: the patch embedding's output
    seen before the first block and, where its H·W is less than the stream's tokens, the tokens not made from it
    (measured at `at`, a block and its stream slot)."""
    first_call = [n.name for n in tr.graph.nodes if n.op == "call_module"].index(first.node)
    image = grid_image(images, first_call, batch, tokens)
    if image is None:
        return None, None, ()
    grid = image.shape[2:]
    special: tuple[int, ...] | None = ()
    if math.prod(grid) < tokens:
        special = tokens_not_from(model, *call, *at, module=image.module) if call else None
        if special is not None and len(special) != tokens - math.prod(grid):
            special = None  # the measurement does not account for the extra tokens
    return grid, image.module, special


def _measured(model: nn.Module, call: tuple[tuple, dict], points: tuple[tuple[str, Slot], ...], batch: int,
              tokens: int) -> tuple[int, ...] | None:
    """The special positions measured where the graph does not show them: the tokens of the stream entering the
    first of `points` (block, stream slot) that the call's image reaches at all, that do not change with that
    image (class and register tokens, text a block did not mix with the image); () where all change, or where
    there is no image to change (token ids in: nothing to tell apart). None where the image reaches none of the
    points (an earlier chain that runs beside the image's path, as GlmImage's prior-token projector does: every
    token there would look special)."""
    image = image_input(*call, batch)
    if image is None:
        return ()
    for block, slot in dict.fromkeys(points):
        special = tokens_not_from(model, *call, block, slot, image=image)
        if len(special) < tokens:
            return special
    return None


def _recorded_special(model: nn.Module, call: tuple[tuple, dict], chains: dict, chosen: str, at: tuple[str, Slot],
                      batch: int, tokens: int) -> tuple[int, ...] | None:
    """The special tokens of a recording with no grid: where the stack joins an earlier chain's tokens with others
    (text joined to a double-stream stack's image tokens), all but the positions holding that chain's output;
    else the tokens that do not change with the image at `at` (`_measure_point`), or at the stack's first block
    where the image does not reach `at`. A call with no image to change (token ids in) has nothing to tell
    apart: (). None where a join is not found, or the image reaches neither point."""
    nodes, (slot, _) = chains[chosen]
    order = {node: i for i, node in enumerate(nodes[0].graph.nodes)}
    earlier = sorted(((n, link) for parent, (n, link) in chains.items() if parent != chosen
                      and order[n[-1]] < order[nodes[0]]), key=lambda item: order[item[0][0]])
    if at[0] == nodes[0].target:
        for others, (_, out_index) in reversed(earlier):
            meta = pytree.tree_leaves(others[-1].meta.get("rk"))
            out = meta[out_index or 0] if len(meta) > (out_index or 0) else None
            length = out.shape[1] if isinstance(out, TensorMeta) and len(out.shape) >= 2 else tokens
            if length < tokens:
                offset = token_offset(model, *call, nodes[0].target, slot, others[-1].target, out_index)
                return None if offset is None else _positions(
                    [not offset <= i < offset + length for i in range(tokens)])
    return _measured(model, call, (at, (nodes[0].target, slot)), batch, tokens)


def _grid_from_sizes(call: tuple[tuple, dict], cells: int) -> tuple[int, ...] | None:
    """Where the latents come packed, (B, tokens, channels), so no patch embedding shows the grid: the latent
    sizes the call names (`record.named_sizes`), if they multiply to the image's tokens (a pixel size does not)."""
    grid = named_sizes(call[1])
    return grid if grid is not None and math.prod(grid) == cells else None


def _grid_from_image(model: nn.Module, call: tuple[tuple, dict], at: tuple[str, Slot], batch: int,
                     positions: list[int], joined: bool) -> tuple[CallGrid | None, tuple[int, ...] | None, bool]:
    """(how the grid follows from the call, the cell of each image token, whether its order was measured) where no
    patch embedding shows the grid (an image patchified by reshaping, as Lumina2's and CogView4's are; video frames
    embedded one by one, with channels before or after the frames): the call's image size over a patch size (one
    for the spatial axes, any for time) that gives as many cells as the stream has image tokens (`positions`),
    taken where measuring its order (`probe.grid_cells`, at `at`) finds every token made from one cell of it.
    Unmeasured (a refiner that mixes the tokens first), it is taken only where the stream joins the image with
    other tokens (`joined`: they were told apart by their origin) and one grid fits: otherwise a sequence as long
    as some grid would be taken for the image's."""
    image = image_input(*call, batch)
    if image is None or image.dim() not in (4, 5) or not positions:
        return None, None, False
    candidates = [CallGrid(patch) for patch in _image_patches(tuple(image.shape[2:]), len(positions))]
    if image.dim() == 5:  # or frames before channels (CogVideoX's (B, T, C, H, W)): measuring tells which
        candidates += [CallGrid(patch, frames_first=True)
                       for patch in _image_patches((image.shape[1], *image.shape[3:]), len(positions))]
    for rule in candidates:
        cells = grid_cells(model, *call, *at, grid_of_call(rule, *call, batch), positions, image=image,
                           frames_first=rule.frames_first)
        if cells is not None:
            return rule, cells, True
    alike = {grid_of_call(rule, *call, batch) for rule in candidates}
    guess = candidates[0] if joined and len(alike) == 1 else None
    return guess, None, guess is not None  # measured already, without an answer


def _image_patches(spatial: tuple[int, ...], cells: int) -> list[tuple[int, ...]]:
    """The patches (one size per axis) that cut an image of these sizes into `cells` cells: one patch size over
    the spatial axes, and for a video any patch size over time; the squarest patches first."""
    *frames, height, width = spatial
    patches = []
    for p in range(1, min(height, width) + 1):
        if height % p or width % p:
            continue
        for t in ([1] if not frames else [d for d in range(1, frames[0] + 1) if frames[0] % d == 0]):
            if math.prod((*(f // t for f in frames), height // p, width // p)) == cells:
                patches.append((abs(t - p) if frames else 0, (*([t] if frames else []), p, p)))
    return [patch for _, patch in sorted(patches)]

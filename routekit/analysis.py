"""What a model is made of: block stack, token stream, side inputs, grid, special tokens, residual adds.

The graph (a traced owner forward, or a recording of block calls) becomes a networkx DiGraph. The
block stack is the longest chain of calls to members of one ModuleList/Sequential in which each
block's stream output feeds the next block's stream input. The token stream is the
(batch, tokens, channels) tensor flowing block to block. Other block inputs are per-token (they carry
the token axis and must be gathered with a route's indices), per-sample, or constants. The token grid
is read off the patch embedding the stream comes from; tokens of the stream that do not come from it
(class, register, text tokens) are special. With `residual=True` each block is also traced alone and
its residual adds are found (what DAR rewrites).

`analyse` returns a frozen `GraphReport`: every fact is settled when it is made, nobody writes into it.
"""

from __future__ import annotations

import inspect
import itertools
import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Literal

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from .errors import AnalysisError, RoutekitError
from .guards import hooked
from .record import Image, grid_image, image_input, token_offset, tokens_not_from
from .routing import Gather, Shrink, gather_tokens, is_opaque, keys, route_side
from .state import fresh, is_compiled
from .trace import TensorMeta, Trace, bind_arguments, preserved_state, trace

Slot = int | str  # a positional index or a keyword name in a block call


@dataclass(frozen=True)
class SideInput:
    """A block input other than the stream, and how a route must change it.

    `meta` is what it holds (tensors as TensorMeta, inside any tuple/list/dict); `tokens` the tensors in it
    that carry the stream's tokens (gathered with a route's indices, wherever their token axes are, with or
    without a batch axis); `grid` the numbers in it that are the token grid's sizes, as (path, grid axis)
    (height and width handed to a block that reshapes its tokens to the grid).
    """

    slot: Slot
    node: str | None  # the node feeding it whole (None for a constant or a container of nodes)
    meta: Any
    tokens: tuple[Gather, ...] = ()
    grid: tuple[tuple[tuple, int], ...] = ()
    unordered: tuple[tuple, ...] = ()  # joint tables whose layout (other tokens first or last) the block hides
    collided: tuple[tuple, ...] = ()  # tensors whose last axis is as long as the stream: tokens or features, untold
    sealed: tuple[tuple, ...] = ()  # objects a route does not look into (see `is_opaque`) that hold per-token tensors

    @property
    def kind(self) -> str:
        if self.tokens:
            return "per-token"
        if self.grid:
            return "grid"
        return "per-sample" if any(isinstance(v, TensorMeta) for v in pytree.tree_leaves(self.meta)) else "constant"

    def describe(self) -> str:
        """One line, whatever it holds: tensors as dtype[shape], containers by their entries, an object (a cache)
        by its class, long values cut."""
        plain = (TensorMeta, tuple, list, dict, int, float, bool, str, type(None))
        meta = self.meta
        text = repr(meta) if isinstance(meta, plain) else type(meta).__name__
        return text if len(text) <= 72 else text[:69] + "..."


@dataclass(frozen=True)
class Stack:
    """One container of blocks the stream passes through. A model may chain several: Flux runs its double-stream
    blocks on the image tokens, then its single-stream blocks, where the owner (or the block) joins the text in
    front. Routes count blocks over the whole chain, and carry their kept tokens across the joins."""

    name: str
    first: int  # the chain index of its first block
    depth: int
    stream_slot: Slot
    stream_out_index: int | None
    stream: TensorMeta
    grid: tuple[int, ...] | None
    grid_node: str | None  # the node (graph mode) or module (boundary mode) the grid was read off
    special: tuple[int, ...]  # tokens not made from the image (text, register, class tokens): routes keep them
    unknown_special: str | None = None  # why the special tokens could not be told (a route must be given `keep`)
    joined_at: int | None = None  # where the previous stack's tokens sit in this one's stream (None: the first)

    @property
    def tokens(self) -> int:
        return self.stream.shape[1]

    @property
    def blocks(self) -> range:
        return range(self.first, self.first + self.depth)


@dataclass(frozen=True)
class BlockInfo:
    """One block of the chain, as its call appears in the graph."""

    index: int
    qualname: str
    cls: str
    node: str  # the call_module node
    stream_out: str  # the node carrying the block's stream output (the call itself or a getitem of it)
    side_inputs: tuple[SideInput, ...] = ()
    escapes: tuple[str, ...] = ()  # the stream output used besides the next block: "out → user"
    aux_escapes: tuple[str, ...] = ()  # other per-token outputs used anywhere
    adds: tuple[str, ...] | None = None  # residual adds in `body` (None: not looked for; (): hidden)
    body: Trace | None = None  # the block traced alone at the stream's token count, when adds were looked for
    checkpointed: bool = False  # the owner runs it under torch.utils.checkpoint
    stack: int = 0  # which stack of the chain it belongs to
    compiled: bool = False  # it runs under torch.compile on its own (its token axes are marked static in a route)


@dataclass(frozen=True)
class GraphReport:
    """What routekit found in a model. `inspect` prints it (with a plan) and draws it. Its stream, grid and
    special tokens are the first stack's; `stacks` has each stack's own."""

    model: str
    mode: Literal["graph", "boundary"]
    stacks: tuple[Stack, ...]
    blocks: tuple[BlockInfo, ...]
    candidates: dict[str, int]
    leafed: dict[str, str]
    specialised: tuple[str, ...]
    requested: str | None = None  # the stack= the analysis was asked for (None: the chain it found)
    fallback: str | None = None  # why the owner forward was not traced (boundary mode)
    residual: str | None = None  # "sublayer", "block" or "mixed" granularity of the adds, or why unknown

    @property
    def stack(self) -> str:
        """The stack's name, or the chain's: "transformer_blocks → single_transformer_blocks"."""
        return " → ".join(s.name for s in self.stacks)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def stack_of(self, block: int) -> Stack:
        return self.stacks[self.blocks[block].stack]

    def __getattr__(self, name: str):  # stream_slot, stream, tokens, grid, special, ...: the first stack's
        if name.startswith("__") or name == "stacks":
            raise AttributeError(name)
        return getattr(self.stacks[0], name)

    def block_listing(self) -> str:
        return ", ".join(f"{b.index}: {b.qualname}" for b in self.blocks)


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """Data-flow graph: an edge from every input node to the node that uses its value. A read of a tensor's
    shape is no use of its values (`head_dim = key.shape[-1] // heads` does not make what it reshapes depend on
    `key`): such a read has no edge from the tensor."""
    g = nx.DiGraph()
    for order, node in enumerate(graph.nodes):
        g.add_node(node.name, op=node.op, target=str(node.target), order=order)
        shape_read = is_shape_read(node)
        for inp in node.all_input_nodes:
            if not (shape_read and inp is node.args[0]):
                g.add_edge(inp.name, node.name)
    return g


_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "ndimension", "get_device", "nelement"})


def is_shape_read(node: fx.Node) -> bool:
    """`x.shape`, `x.size()`, `x.dim()`, `x.numel()`, `x.dtype`...: a node reading what a tensor is, not its values."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return node.args[1] in _SHAPE_ATTRS
    return node.op == "call_method" and node.target in _SHAPE_METHODS


def slots(node: fx.Node):
    """(slot, argument) of every argument of a call."""
    yield from enumerate(node.args)
    yield from node.kwargs.items()


def slot_value(node: fx.Node, slot: Slot) -> Any:
    return node.args[slot] if isinstance(slot, int) else node.kwargs[slot]


def _link(prev: fx.Node, nxt: fx.Node) -> tuple[Slot, int | None] | None:
    """(slot of `nxt` fed by `prev`'s output, tuple index of that output) if they are chained."""
    for slot, arg in slots(nxt):
        if arg is prev:
            return slot, None
        if (isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is operator.getitem
                and arg.args[0] is prev and isinstance(arg.args[1], int)):
            return slot, arg.args[1]
    return None


def _chains(calls: list[fx.Node]):
    """Maximal runs of consecutive calls linked through one consistent (slot, output index)."""
    run, link = [calls[0]], None
    for prev, nxt in zip(calls, calls[1:]):
        this = _link(prev, nxt)
        if this is not None and (link is None or this == link):
            run.append(nxt)
            link = this
        else:
            yield run, link
            run, link = [nxt], None
    yield run, link


def _unchained(nodes: list[fx.Node]) -> str:
    """Why two successive calls of one container do not chain: what stands between the first's output and the
    second's input (an add of the owner's own, `x = x + block(x)`), or that the second does not read it."""
    for prev, nxt in zip(nodes, nodes[1:]):
        users = [u for u in prev.users if u is not nxt]
        between = [u for u in users if any(a is u or (isinstance(a, fx.Node) and u in a.all_input_nodes)
                                          for _, a in slots(nxt))]
        if between:
            return (f"{prev.target}'s output reaches {nxt.target} only through {between[0].name} "
                    f"({getattr(between[0].target, '__name__', between[0].target)}), an op of the owner's between "
                    "the blocks; routekit needs each block's output to be the next block's input (a residual add "
                    "inside the block, as DiT, ViT and LLM blocks have it)")
        if not _link(prev, nxt):
            return f"{nxt.target} does not read {prev.target}'s output"
    return "its members are not called one after another"


def _containers(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict))}


def _listing(counts: dict[str, int]) -> str:
    return ", ".join(f"{k or '<root>'} ({v} calls)" for k, v in counts.items())


def _carries_stream(nodes: list[fx.Node], link: tuple) -> bool:
    """A block chain carries a token stream: (B, N, D) into the first block, the same shape along the chain."""
    meta = getattr(slot_value(nodes[0], link[0]), "meta", {}).get("rk")
    return isinstance(meta, TensorMeta) and len(meta.shape) == 3 and all(
        getattr(n.meta.get("rk"), "shape", None) == meta.shape or link[1] is not None for n in nodes)


def _stack(tr: Trace, model: nn.Module, stack: str | None) -> tuple[str, dict]:
    """The chosen block chain's container, and every chain found: {container: (its calls, (stream slot, stream
    output index))}."""
    containers = _containers(model)
    calls: dict[str, list[fx.Node]] = {}
    for node in tr.graph.nodes:
        if node.op == "call_module":
            parent = node.target.rsplit(".", 1)[0] if "." in node.target else ""
            if parent in containers:
                calls.setdefault(parent, []).append(node)
    chains = {}
    for parent, nodes in calls.items():
        best = max(_chains(nodes), key=lambda rl: len(rl[0]))
        if len(best[0]) >= 2:
            chains[parent] = best
    if stack is not None:
        if not isinstance(stack, str) or stack not in chains:
            raise AnalysisError(
                f"stack {stack!r} is not a chain of blocks in {type(model).__name__}; "
                f"chains found: {_listing({k: len(v[0]) for k, v in chains.items()})}"
            )
        chosen = stack
    elif not chains:
        why = "".join(f"; {_unchained(nodes)}" for nodes in calls.values() if len(nodes) >= 2)
        raise AnalysisError(
            f"no block stack found in {type(model).__name__}: routekit looks for a ModuleList/Sequential "
            "whose members are called one after another, each feeding its output to the next. Containers "
            f"called in the traced forward: {_listing({k: len(v) for k, v in calls.items()}) or 'none'}{why}"
        )
    else:
        token_chains = [k for k in chains if _carries_stream(*chains[k])]
        chosen = max(token_chains or chains, key=lambda k: len(chains[k][0]))
    return chosen, chains


def analyse(tr: Trace, model: nn.Module, *, stack: str | None = None, mode: Literal["graph", "boundary"] = "graph",
            fallback: str | None = None, images: list[Image] | None = None, call: tuple[tuple, dict] | None = None,
            residual: bool = False) -> GraphReport:
    """The report of `tr` (a trace, or with `images` a recording); AnalysisError says what is missing.

    The blocks are those of the chain of stacks the stream passes through (`_chain`), or of `stack` alone.
    `call`: the example call, to measure what the graph does not show (special tokens of a recording).
    `residual`: also trace each block alone and find its residual adds.
    """
    chosen, chains = _stack(tr, model, stack)
    measure = None  # a recording shows no owner code: where it joins two stacks is measured on the example call
    if images is not None and call is not None:
        measure = lambda a, b: token_offset(model, *call, chains[b][0][0].target, chains[b][1][0],  # noqa: E731
                                            chains[a][0][-1].target, chains[a][1][1])
    names = [chosen] if stack is not None else _chain(tr.graph, chains, chosen, measure if images else None)
    by_name = {n.name: n for n in tr.graph.nodes}
    stacks: list[Stack] = []
    blocks: list[BlockInfo] = []
    for k, name in enumerate(names):
        nodes, (slot, out_index) = chains[name]
        first_in = slot_value(nodes[0], slot)
        stream = first_in.meta["rk"] if isinstance(first_in, fx.Node) else None
        if not isinstance(stream, TensorMeta) or len(stream.shape) != 3:
            raise AnalysisError(
                f"the stream into {nodes[0].target} is {stream!r}; routekit routes a (batch, tokens, channels) "
                "stream between blocks"
            )
        these = _blocks(model, nodes, slot, out_index, stream, first=len(blocks), stack=k)
        these = _with_escapes(these, by_name, stream.shape[1], _next_stream_in(chains, names, k))
        if k == 0:
            info = _first_stack(tr, model, chains, name, these, stream, images, call)
        else:
            info = _joined_stack(tr.graph, chains, names[k - 1], name, stacks[-1], stream, measure)
        stacks.append(Stack(name, len(blocks), len(these), slot, out_index, stream, **info))
        blocks.extend(these)
    decided: dict = {}
    blocks = [_resolved(model, b, stacks[b.stack].stream_slot, stacks[b.stack].stream, _fewer(stacks[b.stack]),
                        decided) for b in blocks]
    granularity = None
    if residual:
        blocks, granularity = _with_residual_adds(model, blocks, stacks)
    return GraphReport(
        model=type(model).__name__, mode=mode, stacks=tuple(stacks), blocks=tuple(blocks), candidates=
        {k: len(v[0]) for k, v in chains.items()}, leafed=dict(tr.leafed), specialised=tuple(tr.specialised),
        requested=stack, fallback=fallback, residual=granularity,
    )


def _fewer(stack: Stack) -> int:
    """A token count to probe blocks with: a whole grid row fewer (blocks that reshape to rows still run)."""
    return stack.tokens - (stack.grid[-1] if stack.grid else 1)


def _blocks(model: nn.Module, nodes: list[fx.Node], slot: Slot, out_index: int | None, stream: TensorMeta,
            first: int, stack: int) -> list[BlockInfo]:
    """The blocks of one stack, numbered from `first` in the chain, their side inputs classified."""
    batch, tokens, channels = stream.shape
    blocks = []
    for i, node in enumerate(nodes):
        out = node if out_index is None else next(
            (u for u in node.users if u.target is operator.getitem and u.args[1] == out_index), node)
        module = model.get_submodule(node.target)
        arguments = [(s, a) for s, a in slots(node) if s != slot]
        sequences = {m.shape[1] for _, a in arguments for m in pytree.tree_leaves(_meta_of(a))
                     if isinstance(m, TensorMeta) and len(m.shape) >= 3 and m.shape[0] == batch
                     and m.shape[1] != tokens}
        classified = [_side_input(s, a, parameter_names(module), batch, tokens, channels, sequences)
                      for s, a in arguments]
        info = BlockInfo(first + i, node.target, type(module).__name__, node.name, out.name,
                         tuple(c[0] for c in classified), checkpointed="checkpoint" in node.meta, stack=stack,
                         compiled=is_compiled(module))
        blocks.append(_joint_order(model, info, {c[0].slot: c[1] for c in classified}, slot, stream))
    return blocks


def _first_stack(tr: Trace, model: nn.Module, chains: dict, name: str, blocks: list[BlockInfo], stream: TensorMeta,
                 images: list[Image] | None, call: tuple[tuple, dict] | None) -> dict:
    """The first stack's grid and special tokens: read off the graph, or measured where it does not show them."""
    nodes, (slot, _) = chains[name]
    batch, tokens, _ = stream.shape
    first_in = slot_value(nodes[0], slot)
    grid = grid_node = None
    if images is None:
        special = _graph_special(tr.graph, first_in, batch, tokens, chains)
    else:
        at = _measure_point(chains, name, batch, tokens)
        grid, grid_node, special = _recorded_grid(model, images, tr, blocks[0], at, batch, tokens, call)
        if not special and grid is None and call is not None:
            special = _recorded_special(model, call, chains, name, at, batch, tokens)
    unknown = None
    if special is None:  # what the graph or the recording does not show, measured: conclusive only if it finds some
        at = _measure_point(chains, name, batch, tokens)
        special = _measured(model, call, *at, batch, tokens) if call is not None else None
        if not special:
            special, unknown = (), (
                "the stream joins tokens of several sources along the token axis, and routekit could not tell "
                "which were made from the image" if images is None else
                "routekit could not measure which of the stream's tokens were not made from the image")
    if images is None:
        grid, grid_node = _graph_grid(tr.graph, model, first_in, batch, tokens - len(special))
    if grid is None and special and call is not None:  # the image patchified by reshaping, joined with others
        grid = _grid_from_image(call, batch, tokens - len(special))
    return {"grid": grid, "grid_node": grid_node, "special": special, "unknown_special": unknown}


def _joined_stack(graph: fx.Graph, chains: dict, before: str, name: str, previous: Stack, stream: TensorMeta,
                  measure=None) -> dict:
    """A later stack's grid and special tokens: the previous stack's tokens sit at `joined_at` in its stream, in
    order; every other token was joined in by the owner (text in front of Flux's single-stream blocks) and is
    special, as are the previous stack's own special tokens."""
    offset = _join_offset(graph, chains, before, name, measure)
    tokens = stream.shape[1]
    special = [True] * tokens
    made = [p % previous.tokens not in {q % previous.tokens for q in previous.special} for p in range(previous.tokens)]
    for p, from_image in enumerate(made):
        special[offset + p] = not from_image
    return {"grid": previous.grid, "grid_node": previous.grid_node, "special": _positions(special),
            "unknown_special": previous.unknown_special, "joined_at": offset}


def _chain(graph: fx.Graph, chains: dict, chosen: str, measure=None) -> list[str]:
    """The stacks the stream passes through in order, around `chosen`: each next one's stream holds the previous
    one's output tokens in order, joined with others or not (`_join_offset`)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    carrying = sorted((k for k in chains if _carries_stream(*chains[k])), key=lambda k: order[chains[k][0][0]])
    if chosen not in carrying:
        return [chosen]

    def joined(a: str, b: str) -> bool:
        if order[chains[a][0][-1]] >= order[chains[b][0][0]]:
            return False
        try:
            _join_offset(graph, chains, a, b, measure)
        except AnalysisError:
            return False
        return True

    names = [chosen]
    while True:
        before = [a for a in carrying if a not in names and joined(a, names[0])]
        if not before:
            break
        names.insert(0, before[-1])
    while True:
        after = [b for b in carrying if b not in names and joined(names[-1], b)]
        if not after:
            break
        names.append(after[0])
    return names


def _stream_out(chains: dict, name: str) -> fx.Node | None:
    nodes, (_, out_index) = chains[name]
    last = nodes[-1]
    if out_index is None:
        return last
    return next((u for u in last.users if u.target is operator.getitem and u.args[1] == out_index), None)


def _join_offset(graph: fx.Graph, chains: dict, before: str, after: str, measure=None) -> int:
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
    made = _made_from_image(graph, stream, into.shape[0], into.shape[1], chains, source=out)
    count = meta.shape[1]
    starts = [i for i in range(into.shape[1] - count + 1) if made is not None and all(made[i:i + count])]
    if not starts or sum(made) != count:
        raise AnalysisError(f"{after}'s stream does not hold {before}'s {count} tokens in one run")
    return starts[0]


def _next_stream_in(chains: dict, names: list[str], k: int) -> tuple[fx.Node, fx.Node] | None:
    """(the stream entering the stack after the k-th of the chain, that stack's first block): where the k-th's
    last block's output goes."""
    if k + 1 >= len(names):
        return None
    nodes, (slot, _) = chains[names[k + 1]]
    return slot_value(nodes[0], slot), nodes[0]


def _side_input(slot: Slot, arg: Any, names: dict, batch: int, tokens: int, channels: int,
                sequences: set[int]) -> tuple[SideInput, tuple[Gather, ...]]:
    """Classify a block input: its tensors by their axes (token axes are those as long as the stream, or as
    the stream joined with another sequence of the block's inputs: `sequences`), its numbers by name. Joint
    tables come back apart, listed as `unordered` until `_joint_order` reads their layout off the block."""
    node = arg.name if isinstance(arg, fx.Node) else None
    meta = _meta_of(arg)
    gathers, grid, joint, sealed = [], [], [], []
    for path, leaf in pytree.tree_flatten_with_path(meta, is_leaf=is_opaque)[0]:
        inside = [m for m in pytree.tree_leaves(leaf) if isinstance(m, TensorMeta)] if is_opaque(leaf) else []
        if any(_token_axes(m, batch, tokens, channels, sequences) for m in inside) and not isinstance(leaf, TensorMeta):
            sealed.append(keys(path))
        if isinstance(leaf, TensorMeta):
            found = _token_axes(leaf, batch, tokens, channels, sequences)
            if found is not None:
                axes, batched, is_joint = found
                (joint if is_joint else gathers).append(Gather(keys(path), axes, batched))
        elif type(leaf) is int:
            axis = _grid_axis(names.get(slot, str(slot)), keys(path))
            if axis is not None:
                grid.append((keys(path), axis))
    return (SideInput(slot, node, meta, tuple(gathers), tuple(grid), tuple(g.path for g in joint), sealed=tuple(sealed)),
            tuple(joint))


def parameter_names(module: nn.Module) -> dict:
    """{positional slot: parameter name} of a block's forward (without self), for reading numbers by name."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return {}
    return dict(enumerate(params))


def _meta_of(arg: Any) -> Any:
    """What a call argument holds: fx nodes replaced by their recorded values (tensors as TensorMeta).

    An object registered with pytree (a cache, a context dataclass) is rebuilt around the values where the
    recording put nodes in it: probes of the block need values, and a node handed to a block fails every call.
    """
    def holds_nodes(v: Any) -> bool:
        return any(isinstance(leaf, fx.Node) for leaf in pytree.tree_leaves(v))

    return pytree.tree_map(lambda v: v.meta.get("rk") if isinstance(v, fx.Node) else v, arg,
                           is_leaf=lambda v: isinstance(v, fx.Node) or (is_opaque(v) and not holds_nodes(v)))


def _token_axes(meta: TensorMeta, batch: int, tokens: int, channels: int,
                sequences: set[int]) -> tuple[tuple[int, ...], bool, bool] | None:
    """(token axes, batched, joint) of a tensor that carries the stream's tokens, else None.

    Batched: the first axis is the batch (or 1, a table shared by it). Token axes: every later axis as long
    as the stream (an attention mask (B, 1, N, N) has two); the last axis only where it is the only one left
    (a mask (B, N), positions (N,)) or the one before it is a token axis too and it is not as long as the
    stream's features (a mask (B, 1, N, N)), for elsewhere it holds features;
    failing those, one axis as long as the stream joined with another sequence the block takes (a joint
    text + image table; `joint` says so, and where the stream's part lies is read off the block).
    """
    shape = meta.shape
    batched = len(shape) >= 2 and shape[0] in (batch, 1) and any(d in (tokens,) or d - tokens in sequences
                                                                 for d in shape[1:])
    start = 1 if batched else 0
    last = len(shape) - 1
    axes = [a for a in range(start, len(shape)) if shape[a] == tokens]
    if last in axes and last - start >= 1 and (last - 1 not in axes or shape[last] == channels):
        axes.remove(last)  # a table's last axis holds its features, which may happen to number as many
    if axes:
        return tuple(axes), batched, False
    features = last if len(shape) >= 2 else None
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


def _ambiguous(side: SideInput, batch: int, tokens: int, channels: int) -> bool:
    """A float (B, X) with X == tokens == channels: adaLN's c, or a per-token weight."""
    meta = side.meta
    return (isinstance(meta, TensorMeta) and side.tokens and tokens == channels and len(meta.shape) == 2
            and meta.shape[0] == batch and meta.dtype.is_floating_point)


def _resolved(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, fewer: int,
              decided: dict) -> BlockInfo:
    """Settle what the shapes alone leave open by probing the block with `fewer` tokens.

    An ambiguous side input (`_ambiguous`) is per-sample if the block runs with it unchanged, per-token if only
    with it cut too. A tensor whose last axis is as long as the stream and follows a token axis (an attention
    mask (B, 1, N, N), or a RoPE table (B, N, head_dim) where head_dim happens to equal N) has its last axis cut
    where the block runs that way: every such tensor's two readings are probed together (a block given a mask
    and a RoPE table fails if either is cut wrong), and one combination must run, else each is `collided`.
    `decided` carries the decision from block to block (same class, same inputs).
    """
    batch, tokens, channels = stream.shape
    sides = list(block.side_inputs)
    for i, side in enumerate(sides):
        if not _ambiguous(side, batch, tokens, channels):
            continue
        unchanged = replace(side, tokens=())
        without = replace(block, side_inputs=tuple(sides[:i] + [unchanged] + sides[i + 1:]))
        if fewer < 1 or block_runs(model, without, stream_slot, stream, fewer):
            sides[i] = unchanged
        elif not block_runs(model, block, stream_slot, stream, fewer):
            sides[i] = unchanged
    open_ = [(i, j) for i, side in enumerate(sides) for j, g in enumerate(side.tokens)
             if len(g.axes) >= 2 and g.axes[-1] == len(_leaf_at(side.meta, g.path).shape) - 1]
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


def _leaf_at(meta: Any, path: tuple) -> Any:
    for key in path:
        meta = meta[key]
    return meta


def _joint_order(model: nn.Module, block: BlockInfo, joint: dict, stream_slot: Slot, stream: TensorMeta) -> BlockInfo:
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
        is_cat = (node.op == "call_function" and node.target in _CATS) or (node.op == "call_method" and node.target == "cat")
        if not is_cat or not isinstance(node.args[0], (list, tuple)) or len(node.args[0]) < 2:
            continue
        parts = [p for p in node.args[0] if isinstance(p, fx.Node)]
        made_from = [nx.ancestors(g, p.name) | {p.name} for p in parts]
        inputs = {n.name for n in body.graph.nodes if n.op == "placeholder"}
        kinds = ["stream" if stream in up else "other" if up & inputs else None for up in made_from]
        if "stream" in kinds and "other" in kinds:
            return kinds.index("other") < kinds.index("stream")
    return None


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


def _carries_tokens(meta: Any, tokens: int) -> bool:
    return isinstance(meta, TensorMeta) and len(meta.shape) >= 2 and meta.shape[1] == tokens


def _with_escapes(blocks: list[BlockInfo], by_name: dict[str, fx.Node], tokens: int,
                  next_in: tuple[fx.Node, fx.Node] | None = None) -> list[BlockInfo]:
    """Record per-token values that leave a block other than along the chain.

    `escapes`: the stream output used by something besides the next block (a route may end at such
    a block but not pass through it); the last block's output, where another stack follows (`next_in` is its
    stream), may go only to the owner code that makes that stream. `aux_escapes`: other per-token outputs of
    the block used anywhere (no route may contain the block).
    """
    result = []
    joining = set()
    if next_in is not None:
        out = by_name[blocks[-1].stream_out]
        joining = between(out, next_in[0]) | {next_in[1]}
    for i, block in enumerate(blocks):
        node, out = by_name[block.node], by_name[block.stream_out]
        nxt = by_name[blocks[i + 1].node] if i + 1 < len(blocks) else None
        if nxt is not None:
            escapes = tuple(f"{out.name} → {u.name}" for u in out.users if u is not nxt)
        elif next_in is not None:
            escapes = tuple(f"{out.name} → {u.name}" for u in out.users if u not in joining)
        else:
            escapes = ()
        aux = tuple(f"{a.name} → {u.name}" for a in node.users if a is not out and out is not node
                    and _carries_tokens(a.meta["rk"], tokens) for u in a.users)
        result.append(replace(block, escapes=escapes, aux_escapes=aux))
    return result


def between(out: fx.Node, into: fx.Node) -> set[fx.Node]:
    """The nodes on the owner's path from `out` to `into` (`into` included, unless it is `out`): the code that
    joins two stacks."""
    seen, stack = set(), [into] if into is not out else []
    while stack:
        node = stack.pop()
        if node in seen or node is out:
            continue
        seen.add(node)
        stack.extend(n for n in node.all_input_nodes if descends(n, out))
    return seen


def descends(node: fx.Node, ancestor: fx.Node) -> bool:
    """Whether `node` is `ancestor` or computed from it."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is ancestor:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def grid_of(meta: Any, batch: int) -> tuple[int, ...] | None:
    """The spatial grid of a (batch, C, H, W) or (batch, C, T, H, W) tensor: what a patch embedding makes."""
    if isinstance(meta, TensorMeta) and len(meta.shape) in (4, 5) and meta.shape[0] == batch:
        return tuple(meta.shape[2:])
    return None


_PATCH_EMBEDDINGS = (nn.Conv2d, nn.Conv3d)


def _graph_special(graph: fx.Graph, stream_in: fx.Node, batch: int, tokens: int,
                   chains: dict) -> tuple[int, ...] | None:
    """The special tokens a traced graph shows: those the owner put into the stream from something other than the
    image (`_made_from_image`): text joined in, register and class tokens, with or without a grid; None where
    the graph does not show them."""
    made = _made_from_image(graph, stream_in, batch, tokens, chains)
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


def _positions(flags: list[bool]) -> tuple[int, ...]:
    """The flagged token positions: counted from the start before the first unflagged one, from the end after it
    (text before the image keeps its positions at any image size, register tokens after it theirs)."""
    first = next((i for i, f in enumerate(flags) if not f), len(flags))
    return tuple(i if i < first else i - len(flags) for i, f in enumerate(flags) if f)


_CATS = {torch.cat, torch.concat, torch.concatenate}


def _made_from_image(graph: fx.Graph, stream_in: fx.Node, batch: int, tokens: int, chains: dict,
                     source: fx.Node | None = None) -> tuple[bool, ...] | None:
    """Per token of the stream entering the blocks: whether it was made from the image, the model's first tensor
    input (latents, pixels, token ids) that the stream comes from; None where a `cat` along the token axis does
    not show which of its parts holds which tokens.

    Read backwards along the token axis: a `cat` along it joins its parts' tokens; a chain's block hands on the
    tokens of its stream input, any other op those of its inputs that carry as many tokens (the batched ones
    before a table shared by the batch); a value none of whose inputs carry its tokens (a patch embedding's
    flatten) was made from the image if the image is among its ancestors. Only the tokens' origin counts: text
    tokens that attended to the image in a joint block are still text. With `source`, the origin asked about
    is that node (an earlier stack's stream output) instead of the image.
    """
    inputs = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("rk"), TensorMeta)]
    g = to_networkx(graph)
    ancestors = nx.ancestors(g, stream_in.name)
    image = None if source is not None else next((n for n in inputs if n.name in ancestors or n is stream_in), None)
    stream_of = {}  # a chain block's stream output node -> its stream input
    for nodes, (slot, out_index) in chains.values():
        for node in nodes:
            out = node if out_index is None else next(
                (u for u in node.users if u.target is operator.getitem and u.args[1] == out_index), None)
            if out is not None and isinstance(slot_value(node, slot), fx.Node):
                stream_of[out] = slot_value(node, slot)
    memo: dict[fx.Node, tuple[bool, ...] | None] = {}

    def carries(value: Any, count: int) -> bool:
        meta = getattr(value, "meta", {}).get("rk") if isinstance(value, fx.Node) else None
        return isinstance(meta, TensorMeta) and len(meta.shape) >= 2 and meta.shape[1] == count

    def origin(node: fx.Node, count: int) -> tuple[bool, ...] | None:
        if node in memo:
            return memo[node]
        memo[node] = result = _origin(node, count)
        return result

    order = {n: i for i, n in enumerate(graph.nodes)}

    def _origin(node: fx.Node, count: int) -> tuple[bool, ...] | None:
        writes = sorted((u for u in node.users if u.op == "call_function" and u.target is operator.setitem
                         and u.args[0] is node), key=order.get)
        made = _made(node, count)
        if not writes or made is None:
            return made
        made, written = list(made), set()  # item assignments into the value, in order (a canvas filled per sample)
        for write in writes:
            positions = _token_positions(write.args[1], count)
            value = write.args[2]
            got = of_value(value, len(positions)) if positions is not None and isinstance(value, fx.Node) else None
            if got is None or len(got) != len(positions):
                return None
            for p, m in zip(positions, got):
                made[p] = (made[p] or m) if p in written else m
                written.add(p)
        return tuple(made)

    def whole(node: fx.Node) -> tuple[bool, ...] | None:
        """The origins of all of a tensor's tokens (its axis 1), or None for a tensor with no token axis."""
        meta = node.meta.get("rk")
        return origin(node, meta.shape[1]) if isinstance(meta, TensorMeta) and len(meta.shape) >= 2 else None

    def of_value(value: fx.Node, count: int) -> tuple[bool, ...] | None:
        """The origins of the `count` tokens a value assigned into the stream holds: a slice of some tensor's
        tokens, or a tensor of its own carrying them."""
        if value.op == "call_function" and value.target is operator.getitem \
                and isinstance(value.args[0].meta.get("rk"), TensorMeta):
            return _sliced(value, whole)
        return origin(value, count) if carries(value, count) else None

    def _made(node: fx.Node, count: int) -> tuple[bool, ...] | None:
        if source is not None and node is source:
            return (True,) * count
        if node.op == "placeholder":
            return (node is image,) * count
        if node.op == "get_attr":
            return (False,) * count
        if node in stream_of:
            return origin(stream_of[node], count)
        if _is_token_cat(node):
            if not isinstance(node.args[0], (list, tuple)):  # a cat of a tuple some call returns: parts unseen
                return None
            parts = list(node.args[0])
            if not all(isinstance(p, fx.Node) and carries(p, p.meta["rk"].shape[1]) for p in parts) \
                    or sum(p.meta["rk"].shape[1] for p in parts) != count:
                return None
            made = [origin(p, p.meta["rk"].shape[1]) for p in parts]
            return None if any(m is None for m in made) else sum(made, ())
        if node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0].meta.get("rk"), TensorMeta):  # a slice of a tensor's tokens
            made = _sliced(node, whole)
            if made is not None and len(made) == count:
                return made
        call = node.args[0] if node.op == "call_function" and node.target is operator.getitem else node
        feeding = [a for a in call.all_input_nodes if carries(a, count)]
        batched = [a for a in feeding if a.meta["rk"].shape[0] == batch] or feeding
        if not batched:
            parts = [a.meta["rk"].shape[1] for a in call.all_input_nodes if isinstance(a.meta.get("rk"), TensorMeta)
                     and len(a.meta["rk"].shape) >= 3 and a.meta["rk"].shape[0] == batch]
            if len(parts) > 1 and sum(parts) == count:  # sequences joined inside a call the graph does not open
                return None
            return (image is not None and (image is node or image.name in nx.ancestors(g, node.name)),) * count
        made = [origin(a, count) for a in batched]
        if any(m is None for m in made):
            return None
        return tuple(any(column) for column in zip(*made))

    return origin(stream_in, tokens)


def _token_positions(index: Any, count: int) -> range | None:
    """The token positions an index into a (B, N, ...) tensor picks: `[:, a:b]`, `[i, a:b]` (one sample's) or
    `[i]` (all of one sample's); None for any other index."""
    def value(v):  # a number the trace computed is a node holding it
        return v.meta.get("rk") if isinstance(v, fx.Node) else v

    index = tuple(slice(value(i.start), value(i.stop), value(i.step)) if isinstance(i, slice) else value(i)
                  for i in (index if isinstance(index, tuple) else (index,)))
    if any(isinstance(i, slice) and not all(b is None or type(b) is int for b in (i.start, i.stop, i.step))
           for i in index):
        return None
    if not index or not (index[0] == slice(None) or type(index[0]) is int):
        return None
    if len(index) == 1:
        return range(count) if type(index[0]) is int else None
    return range(count)[index[1]] if isinstance(index[1], slice) else None


def _sliced(node: fx.Node, origin) -> tuple[bool, ...] | None:
    """The origins of the tokens `x[...]` picks (`_token_positions`), from `origin(x)`; None for another index."""
    made = origin(node.args[0])
    positions = None if made is None else _token_positions(node.args[1], len(made))
    return None if positions is None else tuple(made[p] for p in positions)


def _is_token_cat(node: fx.Node) -> bool:
    """A `cat` along the token axis (dim 1 of (B, N, ...), or -2 of (B, N, D))."""
    is_cat = (node.op == "call_function" and node.target in _CATS) or (node.op == "call_method" and node.target == "cat")
    meta = node.meta.get("rk")
    if not is_cat or not isinstance(meta, TensorMeta) or len(meta.shape) < 2:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return isinstance(dim, int) and dim % len(meta.shape) == 1


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


def _measured(model: nn.Module, call: tuple[tuple, dict], block: str, slot: Slot, batch: int,
              tokens: int) -> tuple[int, ...] | None:
    """The special positions measured where the graph does not show them: the tokens of the stream entering
    `block` that do not change with the call's image (class and register tokens, text a block did not mix with
    the image); () where all change, None where there is no image to change."""
    image = image_input(*call, batch)
    if image is None:
        return None
    special = tokens_not_from(model, *call, block, slot, image=image)
    return () if special == tuple(range(tokens)) else special


def _recorded_special(model: nn.Module, call: tuple[tuple, dict], chains: dict, chosen: str, at: tuple[str, Slot],
                      batch: int, tokens: int) -> tuple[int, ...] | None:
    """The special tokens of a recording with no grid: where the stack joins an earlier chain's tokens with others
    (text joined to a double-stream stack's image tokens), all but the positions holding that chain's output;
    else the tokens that do not change with the image at `at` (`_measure_point`). A call with no image to change
    (token ids in) has nothing to tell apart: (). None where a join is not found."""
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
    return _measured(model, call, *at, batch, tokens) or ()


def _grid_from_image(call: tuple[tuple, dict], batch: int, cells: int) -> tuple[int, ...] | None:
    """Where no patch embedding shows the grid (an image patchified by reshaping, as Lumina2's): the call's image
    size over the one patch size that gives `cells` tokens."""
    image = image_input(*call, batch)
    if image is None or cells < 1 or image.dim() not in (4, 5):
        return None
    spatial = image.shape[2:]
    sizes = [tuple(d // p for d in spatial) for p in range(1, max(spatial) + 1)
             if all(d % p == 0 for d in spatial) and math.prod(d // p for d in spatial) == cells]
    return sizes[0] if len(sizes) == 1 else None


# ---- residual adds (what DAR rewrites) -------------------------------------------------------------------

_ADDS = {operator.add, torch.add}
_SUBLAYER_FUNCS = {F.linear, torch.matmul, operator.matmul, torch.bmm, torch.einsum, F.scaled_dot_product_attention,
                   F.conv1d, F.conv2d}


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _ADDS) or (node.op == "call_method" and node.target == "add")


def _is_sublayer(node: fx.Node) -> bool:
    return node.op == "call_module" or (node.op == "call_function" and node.target in _SUBLAYER_FUNCS)


_CASTS = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as"})


def uncast(node: Any) -> Any:
    """`node` without the dtype casts applied to it: blocks that keep the residual in fp32 add to `h.float()`
    or `h.to(torch.float32)` (Wan, Mamba) and cast the sum back with `.type_as(h)`; the stream is `h` still."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _CASTS \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def find_residual_adds(graph: fx.Graph, stream: fx.Node, output: fx.Node | None = None) -> list[fx.Node]:
    """The adds that carry the residual stream: skip operand = the stream so far (or a dtype cast of it,
    `uncast`), the other operand computed from it through a sublayer (a module call or a matmul-like op),
    same shape as the stream.

    Never adaLN's `1 + scale` (a constant operand) nor a bias add (not on the stream). With `output`
    (the block's stream output), the chain must end there: a block whose stream also passes through
    anything else (a bias on the stream, a post-norm, parallel branches) gives [] and is treated as
    one source (block granularity) rather than half-rewritten.
    """
    g = to_networkx(graph)
    by_name = {n.name: n for n in graph.nodes}
    current, adds = stream, []
    for node in graph.nodes:
        if not _is_add(node) or len(node.args) < 2:
            continue
        for skip, branch in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if uncast(skip) is not current or not isinstance(branch, fx.Node):
                continue
            if getattr(node.meta.get("rk"), "shape", None) != getattr(current.meta.get("rk"), "shape", None):
                continue
            between = nx.descendants(g, current.name) & (nx.ancestors(g, branch.name) | {branch.name})
            if any(_is_sublayer(by_name[n]) for n in between):
                adds.append(node)
                current = node
                break
    if output is not None and adds and current is not uncast(output):
        return []
    return adds


def without_residual(model: nn.Module, block: BlockInfo) -> bool:
    """Whether a block's own trace shows no residual connection and hides none: no add of token-carrying values,
    and every module it calls one of torch.nn's plain layers (any other module may add a residual inside)."""
    if block.body is None or block.adds:
        return False
    for node in block.body.graph.nodes:
        if _is_add(node) and len(getattr(node.meta.get("rk"), "shape", ())) >= 3:
            return False
        if node.op == "call_module":
            module = model.get_submodule(block.qualname).get_submodule(node.target)
            if not type(module).__module__.startswith("torch.nn") or next(module.children(), None) is not None:
                return False  # its own code, or torch's composite layers (a TransformerEncoderLayer adds inside)
    return True


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


def _with_residual_adds(model: nn.Module, blocks: list[BlockInfo],
                        stacks: list[Stack]) -> tuple[list[BlockInfo], str]:
    """Each block traced alone with its residual adds, and the granularity: "sublayer" when every block's
    adds were found, "block" when none were (each block is one source, v = output - input), "mixed"
    otherwise; or why the blocks could not be traced. A block with hooks stays one call (its adds hidden), so
    its hooks run."""
    try:
        traced = [trace_block(model, b, stacks[b.stack].stream_slot, stacks[b.stack].stream,
                              stacks[b.stack].stream_out_index, stacks[b.stack].tokens)[:2] for b in blocks]
    except RoutekitError as err:
        return blocks, f"unknown ({err})"
    traced = [(tr, () if hooked(model.get_submodule(b.qualname)) else adds) for b, (tr, adds) in zip(blocks, traced)]
    found = [bool(adds) for _, adds in traced]
    granularity = "sublayer" if all(found) else "block" if not any(found) else "mixed"
    return [replace(b, adds=adds, body=tr) for b, (tr, adds) in zip(blocks, traced)], granularity


# ---- the timestep embedding (DAR's static_t queries) ----------------------------------------------------------

def find_timestep_embedding(graph: fx.Graph, report: GraphReport, name: str | None) -> fx.Node | None:
    """The model's own e(t): a (B, D) node computed from a 1-D float input alone, or the call of the module
    `name`; None when there is none."""
    batch, _, dim = report.stream.shape
    nodes = list(graph.nodes)
    if name is not None:
        hits = [n for n in nodes if n.op == "call_module" and (n.target == name or n.target.startswith(name + "."))]
        hits = [n for n in hits if getattr(n.meta.get("rk"), "shape", None) == (batch, dim)]
        return hits[-1] if hits else None
    g = to_networkx(graph)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for ph in placeholders:
        meta = ph.meta.get("rk")
        if not (isinstance(meta, TensorMeta) and meta.shape == (batch,) and meta.dtype.is_floating_point):
            continue
        others = {p.name for p in placeholders if p is not ph}
        found = [n for n in nodes if n.name in nx.descendants(g, ph.name)
                 and getattr(n.meta.get("rk"), "shape", None) == (batch, dim)
                 and not (nx.ancestors(g, n.name) & others)]
        if found:
            return found[-1]
    return None

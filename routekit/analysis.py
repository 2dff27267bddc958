"""Find the block stack, the token stream and the blocks' side inputs in a traced graph.

The fx graph becomes a networkx DiGraph. The block stack is the longest chain of calls to members
of one ModuleList/Sequential in which each block's stream output feeds the next block's stream
input. The token stream is the (batch, tokens, channels) tensor flowing block to block. Other block
inputs are per-token (they carry the token axis and must be gathered with the route's indices),
per-sample, or constants. The token grid is read off the nearest 4-D (B, C, H, W) ancestor of the
stream with H·W tokens (a patch embedding).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from .errors import AnalysisError
from .keep import find_special_tokens
from .trace import TensorMeta, Trace, preserved_state

Slot = int | str  # a positional index or a keyword name in a block call


@dataclass
class SideInput:
    """A block input other than the stream."""

    slot: Slot
    node: str | None  # the fx node feeding it (None for a constant)
    kind: Literal["per-token", "per-sample", "token-first", "constant", "ambiguous"]
    meta: Any


@dataclass
class BlockInfo:
    index: int
    qualname: str
    cls: str
    node: str  # the call_module node
    stream_out: str  # the node carrying the block's stream output (the call itself or a getitem of it)
    side_inputs: list[SideInput] = field(default_factory=list)
    escapes: list[str] = field(default_factory=list)  # stream output used besides the next block
    aux_escapes: list[str] = field(default_factory=list)  # other per-token outputs used anywhere


@dataclass
class GraphReport:
    """What routekit found in a model: printed by `inspect`, drawn by `.draw(path)`."""

    model: str
    stack: str
    blocks: list[BlockInfo]
    stream_slot: Slot
    stream_out_index: int | None
    stream: TensorMeta
    grid: tuple[int, int] | None
    grid_node: str | None
    candidates: dict[str, int]
    leafed: dict[str, str]
    specialised: list[str]
    mode: str = "graph"
    routes: list = field(default_factory=list)
    residual: Any = None
    residual_adds: dict[int, list[str]] = field(default_factory=dict)
    residual_granularity: str | None = None
    special: tuple[int, ...] = ()  # token positions outside the patch grid (class/register/text tokens)
    fallback: str | None = None  # why the owner forward was not traced (boundary mode)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    @property
    def tokens(self) -> int:
        return self.stream.shape[1]

    def block_listing(self) -> str:
        return ", ".join(f"{b.index}: {b.qualname}" for b in self.blocks)

    def __str__(self) -> str:
        from .report import format_report

        return format_report(self)

    def draw(self, path: str) -> str:
        """Write a PNG of the block graph with routes marked; returns the path."""
        from .report import draw_report

        return draw_report(self, path)


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """Data-flow graph: an edge from every input node to the node that uses it."""
    g = nx.DiGraph()
    for order, node in enumerate(graph.nodes):
        g.add_node(node.name, op=node.op, target=str(node.target), order=order)
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    return g


def _slots(node: fx.Node):
    yield from enumerate(node.args)
    yield from node.kwargs.items()


def slot_value(node: fx.Node, slot: Slot) -> Any:
    return node.args[slot] if isinstance(slot, int) else node.kwargs[slot]


def _link(prev: fx.Node, nxt: fx.Node) -> tuple[Slot, int | None] | None:
    """(slot of `nxt` fed by `prev`'s output, tuple index of that output) if they are chained."""
    for slot, arg in _slots(nxt):
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


def _containers(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict))}


def analyse(tr: Trace, model: nn.Module, stack: str | None = None) -> GraphReport:
    """Find block stack, stream, side inputs and grid; AnalysisError says what is missing."""
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
        raise AnalysisError(
            f"no block stack found in {type(model).__name__}: routekit looks for a ModuleList/Sequential "
            "whose members are called one after another, each feeding its output to the next. Containers "
            f"called in the traced forward: {_listing({k: len(v) for k, v in calls.items()}) or 'none'}"
        )
    else:
        token_chains = [k for k in chains if _carries_stream(*chains[k])]
        chosen = max(token_chains or chains, key=lambda k: len(chains[k][0]))
    nodes, (slot, out_index) = chains[chosen]
    first_in = slot_value(nodes[0], slot)
    stream = first_in.meta["rk"] if isinstance(first_in, fx.Node) else None
    if not isinstance(stream, TensorMeta) or len(stream.shape) != 3:
        raise AnalysisError(
            f"the stream into {nodes[0].target} is {stream!r}; routekit routes a (batch, tokens, channels) "
            "stream between blocks"
        )
    batch, tokens = stream.shape[:2]
    by_name = {n.name: n for n in tr.graph.nodes}
    blocks = []
    for i, node in enumerate(nodes):
        out = node if out_index is None else next(
            (u for u in node.users if u.target is operator.getitem and u.args[1] == out_index), node)
        sides = [_side_input(s, a, batch, tokens, stream.shape[2]) for s, a in _slots(node) if s != slot]
        blocks.append(BlockInfo(i, node.target, type(model.get_submodule(node.target)).__name__,
                                node.name, out.name, sides))
    _mark_escapes(blocks, by_name, tokens)
    grid, grid_node = _find_grid(tr.graph, first_in, batch, tokens)
    special: tuple[int, ...] = ()
    if grid is None:
        grid, grid_node, special = find_special_tokens(tr.graph, first_in, batch, tokens)
    report = GraphReport(
        model=type(model).__name__, stack=chosen, blocks=blocks, stream_slot=slot, stream_out_index=out_index,
        stream=stream, grid=grid, grid_node=grid_node,
        candidates={k: len(v[0]) for k, v in chains.items()}, leafed=dict(tr.leafed),
        specialised=list(tr.specialised), special=special,
    )
    resolve_ambiguous(model, report)
    return report


def _carries_stream(nodes: list[fx.Node], link: tuple) -> bool:
    """A block chain carries a token stream: (B, N, D) into the first block, the same shape along the chain."""
    meta = getattr(slot_value(nodes[0], link[0]), "meta", {}).get("rk")
    return isinstance(meta, TensorMeta) and len(meta.shape) == 3 and all(
        getattr(n.meta.get("rk"), "shape", None) == meta.shape or link[1] is not None for n in nodes)


def _listing(counts: dict[str, int]) -> str:
    return ", ".join(f"{k or '<root>'} ({v} calls)" for k, v in counts.items())


def _side_input(slot: Slot, arg: Any, batch: int, tokens: int, channels: int) -> SideInput:
    """Classify a block input by shape. A float (B, X) with X == tokens == channels is ambiguous: it is
    taken as a per-sample conditioning vector (adaLN's c), while a bool/int (B, N) is a per-token mask."""
    meta = arg.meta["rk"] if isinstance(arg, fx.Node) else arg
    name = arg.name if isinstance(arg, fx.Node) else None
    if not isinstance(meta, TensorMeta):
        return SideInput(slot, name, "constant", meta)
    shape = meta.shape
    if len(shape) == 2 and shape[0] == batch and tokens == channels and meta.dtype.is_floating_point:
        return SideInput(slot, name, "ambiguous", meta)  # settled by probing the block (resolve_ambiguous)
    if len(shape) >= 2 and shape[0] == batch and shape[1] == tokens:
        return SideInput(slot, name, "per-token", meta)
    if len(shape) >= 1 and shape[0] == tokens and batch != tokens:
        return SideInput(slot, name, "token-first", meta)
    return SideInput(slot, name, "per-sample", meta)


def fake_block_inputs(report: GraphReport, block: BlockInfo, tokens: int, device,
                      token_slots: set | None = None) -> tuple[list, dict]:
    """Zero tensors shaped like `block`'s inputs with `tokens` tokens on the stream (and on the side
    inputs in `token_slots`, by default the per-token ones): to trace or probe a block alone."""
    if token_slots is None:
        token_slots = {s.slot for s in block.side_inputs if s.kind == "per-token"}

    def fake(meta, resize):
        if not isinstance(meta, TensorMeta):
            return meta
        shape = list(meta.shape)
        if resize:
            shape[1] = tokens
        return torch.zeros(shape, dtype=meta.dtype, device=device)

    slots = {report.stream_slot: fake(report.stream, True)}
    for side in block.side_inputs:
        slots[side.slot] = fake(side.meta, side.slot in token_slots)
    args = [slots[i] for i in sorted(s for s in slots if isinstance(s, int))]
    return args, {k: v for k, v in slots.items() if isinstance(k, str)}


def block_runs(model: nn.Module, report: GraphReport, block: BlockInfo, tokens: int,
               token_slots: set | None = None) -> bool:
    """Probe: does the block run on `tokens` tokens (zeros), with no lasting side effects?"""
    param = next(model.parameters(), None)
    args, kwargs = fake_block_inputs(report, block, tokens, param.device if param is not None else "cpu", token_slots)
    with preserved_state(model, [a for a in args if isinstance(a, torch.Tensor)]):
        try:
            model.get_submodule(block.qualname)(*args, **kwargs)
        except Exception:
            return False
    return True


def resolve_ambiguous(model: nn.Module, report: GraphReport) -> None:
    """A float (B, X) input with X == tokens == channels is either adaLN's c or a per-token weight.
    Probe with fewer tokens: if the block runs with it unchanged it is per-sample, if only with it cut
    too it is per-token."""
    fewer = report.tokens - (report.grid[1] if report.grid else 1)
    for block in report.blocks:
        for side in block.side_inputs:
            if side.kind != "ambiguous":
                continue
            others = {s.slot for s in block.side_inputs if s.kind == "per-token"}
            if fewer < 1 or block_runs(model, report, block, fewer, others):
                side.kind = "per-sample"
            else:
                side.kind = "per-token" if block_runs(model, report, block, fewer, others | {side.slot}) else "per-sample"


def _carries_tokens(meta: Any, tokens: int) -> bool:
    return isinstance(meta, TensorMeta) and len(meta.shape) >= 2 and meta.shape[1] == tokens


def _mark_escapes(blocks: list[BlockInfo], by_name: dict[str, fx.Node], tokens: int) -> None:
    """Record per-token values that leave a block other than along the chain.

    `escapes`: the stream output used by something besides the next block (a route may end at such
    a block but not pass through it). `aux_escapes`: other per-token outputs of the block used
    anywhere (no route may contain the block).
    """
    for i, block in enumerate(blocks):
        node, out = by_name[block.node], by_name[block.stream_out]
        nxt = by_name[blocks[i + 1].node] if i + 1 < len(blocks) else None
        block.escapes = [f"{out.name} → {u.name}" for u in out.users if u is not nxt] if nxt is not None else []
        for aux in (u for u in node.users if u is not out and out is not node):
            if _carries_tokens(aux.meta["rk"], tokens):
                block.aux_escapes.extend(f"{aux.name} → {u.name}" for u in aux.users)


def _find_grid(graph: fx.Graph, stream_in: fx.Node, batch: int, tokens: int):
    """The (H, W) of the nearest 4-D (B, C, H, W) ancestor with H·W == tokens, if any."""
    g = to_networkx(graph)
    ancestors = nx.ancestors(g, stream_in.name) | {stream_in.name}
    for node in reversed(graph.nodes):
        if node.name not in ancestors:
            continue
        meta = node.meta["rk"]
        if isinstance(meta, TensorMeta) and len(meta.shape) == 4 and meta.shape[0] == batch:
            if meta.shape[2] * meta.shape[3] == tokens:
                return (meta.shape[2], meta.shape[3]), node.name
    return None, None

"""Binding the decision `apply` made to a call of other shapes or another signature: graph mode's one path to
a program for a call it has not met.

`apply` decides once, on the example call, what a route does: which blocks it spans, which of each block's
inputs it cuts and along which axes (read off the blocks' data flow), which of the stream's tokens are special
and how their count follows a call (`findings.Segment`), where the grid comes from. A later call with another
batch size, image size or caption length is traced again (its graph's nodes and every number read off a shape
belong to it), and the decision is bound to that trace: the same blocks found by name, each block input cut
as decided, the special tokens counted for this call's inputs, the kept count worked out for its stream. No
block is classified again and no route is planned again, so no call can change what a route cuts; a call that
the decision does not cover (a block input the example call did not pass, blocks called otherwise) is refused
by name (`ConfigError`), saying what differs; a call that skips a block the decision holds (SD3's
`skip_layers`) raises `Skipped`, which graph mode answers with the original forward.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .blocks import traced_alone
from .calls import parameter_names, slot_named
from .errors import ConfigError
from .findings import BlockInfo, Gather, GraphReport, SideInput, Stack, layout_positions
from .flow import UNREAD
from .graphs import meta_of, slot_value, slots
from .guards import hooked
from .probe import block_flow
from .record import grid_of_call
from .residuals import find_residual_adds
from .routing import is_opaque, kept_tokens, keys, resolve_keep
from .selectors import selector as selector_spec
from .state import eager
from .trace import Trace, trace
from .values import TensorMeta, same


class Skipped(ConfigError):
    """A call that does not run `block`, one the decision holds: there is no route to bind it to."""

    def __init__(self, block: str):
        super().__init__(f"this call skips {block}, which the example call ran; routekit decided its routes on the "
                         "example call: call the model the way the example call did")
        self.block = block


def bind(plan: Any, model: nn.Module, args: tuple, kwargs: dict, *, fresh: bool = False) -> tuple[Trace, Any]:
    """The training trace of `model` on this call, and `plan` (a `plan.Plan`) bound to it. `fresh`: every block
    DAR inlines traced again too (what `verify` compares a program with), not only those whose trace no longer
    holds."""
    with eager():
        tr = trace(model, args, kwargs)
    report = bound_report(plan.report, tr, model, (args, kwargs), fresh)
    return tr, bound_plan(plan, report, model)


def bound_report(decided: GraphReport, tr: Trace, model: nn.Module, call: tuple[tuple, dict],
                 fresh: bool = False) -> GraphReport:
    """`decided` (made on the example call) with its nodes, shapes and per-call counts those of `tr`."""
    graph = tr.graph
    nodes = _block_calls(decided, graph)
    sizes = {n.target: n.meta["rk"].shape for n in graph.nodes
             if n.op == "placeholder" and isinstance(n.meta.get("rk"), TensorMeta)}
    stacks: list[Stack] = []
    for stack in decided.stacks:
        first = nodes[decided.blocks[stack.first].qualname]
        slot = slot_named(model.get_submodule(first.target), [s for s, _ in slots(first)], stack.stream_slot)
        stack = dataclasses.replace(stack, stream_slot=stack.stream_slot if slot is None else slot)
        stream = getattr(slot_value(first, stack.stream_slot), "meta", {}).get("rk") if slot is not None else None
        if not isinstance(stream, TensorMeta) or len(stream.shape) != 3 or stream.shape[2] != stack.stream.shape[2]:
            raise ConfigError(
                f"this call hands {decided.blocks[stack.first].qualname} a stream {stream!r} where the example call "
                f"handed it {stack.stream}: call the model as the example call did")
        stacks.append(_bound_stack(stack, stream, stacks[-1] if stacks else None, graph, sizes, call))
    flows: dict = {}  # the blocks' data flow on this call, read where it met a tensor the example did not pass
    blocks = [_bound_block(block, nodes[block.qualname], stacks[block.stack], decided.stack_of(block.index), model,
                           flows, fresh) for block in decided.blocks]
    by_name = {n.name: n for n in graph.nodes}
    return dataclasses.replace(decided, stacks=tuple(stacks), blocks=tuple(blocks), leafed=dict(tr.leafed),
                               specialised=tuple(tr.specialised),
                               timestep=decided.timestep if decided.timestep in by_name else None)


def _block_calls(decided: GraphReport, graph: fx.Graph) -> dict[str, fx.Node]:
    """{block: its call} in `graph`: each decided block called once, in the decided order, each handing its
    stream on to the next as on the example call."""
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls.setdefault(node.target, []).append(node)
    found = {}
    for block in decided.blocks:
        made = calls.get(block.qualname, [])
        if not made:
            raise Skipped(block.qualname)
        if len(made) != 1:
            raise ConfigError(
                f"this call runs {block.qualname} {len(made)} times, where the example call ran it once; routekit "
                "decided its routes on the example call: call the model the way the example call did")
        found[block.qualname] = made[0]
    return found


def _bound_stack(stack: Stack, stream: TensorMeta, previous: Stack | None, graph: fx.Graph,
                 sizes: dict[str, tuple[int, ...]], call: tuple[tuple, dict]) -> Stack:
    """`stack` on this call's stream: its special tokens and join counted for this call, its grid read again."""
    tokens = stream.shape[1]
    special, joined = stack.special, stack.joined_at
    if stack.layout is not None:
        placed = layout_positions(stack.layout, tokens, sizes)
        if placed is None:
            raise ConfigError(
                f"this call's stream into {stack.name} holds {tokens} tokens, which its inputs do not lay out as the "
                f"example call's did ({_runs(stack)}): call the model as the example call did")
        special, first = placed
        if previous is not None:  # a later stack: the earlier stack's run, its own special tokens within it
            joined = first
            within = {p % previous.tokens for p in previous.special}
            flags = [True] * tokens
            for p in range(previous.tokens):
                flags[first + p] = p in within
            for p in special:
                flags[p] = True
            special = _positions(flags)
    elif tokens != stack.tokens and stack.special:
        special = _fixed(stack, tokens, previous)
    grid = stack.grid
    if stack.grid_node is not None:
        node = next((n for n in graph.nodes if n.name == stack.grid_node), None)
        meta = node.meta.get("rk") if node is not None else None
        grid = tuple(meta.shape[2:]) if isinstance(meta, TensorMeta) and len(meta.shape) in (4, 5) else None
    elif stack.call_grid is not None:
        grid = grid_of_call(stack.call_grid, *call, stream.shape[0])
    elif previous is not None:
        grid = previous.grid
    if stack.grid is not None and grid is not None and math.prod(grid) != tokens - len(special):
        grid = None  # this call's image makes no grid of the stream's image tokens (a padded sequence)
    return dataclasses.replace(stack, stream=stream, special=special, joined_at=joined, grid=grid)


def _fixed(stack: Stack, tokens: int, previous: Stack | None) -> tuple[int, ...]:
    """The special tokens found on the example call (no layout shows how they follow a call: measured, or
    a recording) kept at their positions, where this call's stream leaves as many tokens besides the image's."""
    cells = math.prod(stack.grid) if stack.grid else None
    if previous is None and cells is not None and tokens - cells == len(stack.special):
        return stack.special
    raise ConfigError(
        f"this call's stream into {stack.name} holds {tokens} tokens where the example call's held {stack.tokens}, "
        f"{len(stack.special)} of them special (text, class or register tokens, at {list(stack.special)[:8]}); "
        "routekit found those on the example call and cannot count them for this one: call the model with as "
        "many, or give the route keep=[...] with their positions")


def _runs(stack: Stack) -> str:
    return ", ".join(("special" if s.special else "image") + (
        f" {s.length}" if isinstance(s.length, int) else f" as long as {s.length[0]}" if s.length else " (rest)")
        for s in stack.layout)


def _positions(flags: list[bool]) -> tuple[int, ...]:
    first = next((i for i, f in enumerate(flags) if not f), len(flags))
    return tuple(i if i < first else i - len(flags) for i, f in enumerate(flags) if f)


def _bound_block(block: BlockInfo, node: fx.Node, stack: Stack, decided: Stack, model: nn.Module, flows: dict,
                 fresh: bool = False) -> BlockInfo:
    """`block` as this call makes it: its call and stream output in this graph, each of its inputs cut as decided."""
    out = node if stack.stream_out_index is None else next(
        (u for u in node.users if u.target is operator.getitem and u.args[1] == stack.stream_out_index), node)
    module = model.get_submodule(block.qualname)
    if hooked(module) and block.body is not None and block.adds:  # DAR would inline it, and its hooks not run
        if len(block.adds) > 1:
            raise ConfigError(
                f"{block.qualname} has hooks now, which DAR's graph would not run (it inlines the block to read its "
                f"{len(block.adds)} sublayers' outputs), and as one call (one source, its hooks run) it would change "
                "DAR's aggregation points: remove the hook, or apply DAR again")
        block = dataclasses.replace(block, adds=())  # one sublayer: the block called whole is the same one source
    names = parameter_names(module)
    by_name = {names.get(side.slot, side.slot) if isinstance(side.slot, int) else side.slot: side
               for side in block.side_inputs}
    sides = []
    for slot, arg in slots(node):
        if slot == stack.stream_slot:
            continue
        decided_side = by_name.get(names.get(slot, slot) if isinstance(slot, int) else slot)
        sides.append(_bound_side(block, decided_side, slot, arg, meta_of(arg), lambda: block_flow(
            model, block.qualname, {s: meta_of(a) for s, a in slots(node)}, stack.stream_slot, cache=flows)))
    bound = dataclasses.replace(block, node=node.name, stream_out=out.name, side_inputs=tuple(sides))
    if block.body is None or not block.adds:  # DAR calls it whole (one source, or none): its own trace is not inlined
        return bound
    shaped = block.body.specialised and not same((stack.stream, [(s.slot, s.meta) for s in sides]),
                                                 (decided.stream, [(s.slot, s.meta) for s in block.side_inputs]))
    if fresh or shaped or block.body.assumed.broken(model.get_submodule(block.qualname)) is not None:
        bound = _retraced(bound, stack, model)  # traced at other shapes, or the block changed since (a value it read)
    return bound


def _bound_side(block: BlockInfo, decided: SideInput | None, slot, arg: Any, meta: Any, flow) -> SideInput:
    """A block input on this call, cut as decided. A tensor the example call did not pass (an attention mask a
    transformers LM builds only on some calls: without its cache, with padding) is cut as the block's data flow
    on this call ties it to the stream (`flow()`), never by its shape; where that flow cannot be read, or ties it
    jointly with another sequence, the call is refused by name."""
    node = arg.name if isinstance(arg, fx.Node) else None
    known = {keys(p) for p, leaf in pytree.tree_flatten_with_path(decided.meta, is_leaf=is_opaque)[0]
             if isinstance(leaf, TensorMeta)} if decided is not None else set()
    later = []
    for path, leaf in pytree.tree_flatten_with_path(meta, is_leaf=is_opaque)[0]:
        if isinstance(leaf, TensorMeta) and keys(path) not in known:
            tied = flow()
            # absent from a flow that was read: read and not tied (an IP-adapter's image tokens); UNREAD: not read
            # on this call, so passing it whole changes nothing
            found = None if tied is None else tied.get((slot, keys(path)))
            if tied is not None and (found is None or found.relation != "joint"):  # UNREAD's relation is "same"
                if found is not None and found is not UNREAD:
                    later.append(Gather(keys(path), found.axes, found.batched))
                continue
            name = decided.argument if decided is not None and decided.argument is not None else slot
            where = "".join(f"[{k!r}]" for k in keys(path))
            was = decided.describe() if decided is not None else "nothing"
            raise ConfigError(
                f"{block.qualname} takes a tensor {str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)} as "
                f"{name!r}{where} on this call, where the example call passed {was}, and its data flow does not say "
                "whether it carries the stream's tokens: routekit decides at apply which block inputs a route cuts. "
                "Give apply an example call that passes it too (an attention mask the model builds only for padded "
                "batches: an example batch with padding)")
    if decided is None:
        return SideInput(slot, node, meta, tuple(later), argument=None if isinstance(slot, int) else slot)
    present = {keys(p) for p, leaf in pytree.tree_flatten_with_path(meta, is_leaf=is_opaque)[0]
               if isinstance(leaf, TensorMeta)}
    return dataclasses.replace(decided, slot=slot, node=node, meta=meta,
                               tokens=tuple(g for g in decided.tokens if g.path in present) + tuple(later))


def _retraced(block: BlockInfo, stack: Stack, model: nn.Module, tokens: int | None = None, shrink=(),
              shared: bool = True) -> BlockInfo:
    """A block DAR inlines, traced again as this call hands it its inputs (at `tokens`, a route's kept count, or
    all the stream's): its trace was specialised to the example's shapes, or what it read of the block changed.
    Its residual adds are located in the new trace; as many as decided, or the call is refused (DAR's
    aggregation points were decided on the example call)."""
    count = stack.tokens if tokens is None else tokens
    tr, start, out = traced_alone(model, block, stack.stream_slot, stack.stream, stack.stream_out_index, count,
                                  shrink, shared)
    adds = tuple(n.name for n in find_residual_adds(tr.graph, start, out))
    if len(adds) != len(block.adds):
        raise ConfigError(
            f"{block.qualname}'s own code runs otherwise on {count} tokens: {len(adds)} residual adds where the example "
            f"call's trace had {len(block.adds)} (DAR's aggregation points were decided on the example call); call the "
            "model at the example call's shapes")
    return dataclasses.replace(block, body=tr, adds=adds)


def bound_plan(plan: Any, report: GraphReport, model: nn.Module) -> Any:
    """`plan` on `report` (bound to a call): each route's kept positions and count worked out for this call's
    stream, as the plan's own rules give them; nothing decided again."""
    grid = plan.grid if plan.grid_given else report.grid
    placed = []
    for route in plan.placed:
        stack = report.stack_of(route.start)
        if selector_spec(route.route.selector).needs_grid and grid is None:
            raise ConfigError(
                f"selector {route.route.selector!r} reads the token grid, and this call's stream ({stack.tokens} tokens) "
                f"comes from no grid routekit finds, where the example call's came from a {'×'.join(map(str, plan.grid))} "
                "grid (a model may pad some image sizes into a longer sequence): call it at image sizes like the "
                "example's, or route with a selector that reads no grid (selector='random')")
        keep = resolve_keep(stack.special if route.route.keep is None else route.route.keep, stack.tokens)
        kept = kept_tokens(route.route.selector, route.route.rate, keep, stack.tokens, grid)
        unchanged = kept == route.kept and same(stack.stream, plan.report.stack_of(route.start).stream)
        bodies = route.bodies if unchanged else tuple(
            _retraced(report.blocks[b.index], report.stack_of(b.index), model,
                      report.joined_counts(route.start, route.end, kept)[b.stack - report.blocks[route.start].stack],
                      route.shrink, route.shared) for b in route.bodies)
        placed.append(dataclasses.replace(route, keep=keep, kept=kept, bodies=bodies,
                                          kept_in=report.joined_counts(route.start, route.end, kept),
                                          fixed_in=report.joined_counts(route.start, route.end, len(keep))))
    return dataclasses.replace(plan, report=report, placed=tuple(placed), grid=grid)

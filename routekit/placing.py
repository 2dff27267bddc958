"""Plan → routes in a traced graph: where a route's tokens are chosen, cut, carried and put back.

Each route becomes: select the kept indices before block `start`, gather the stream (and every per-token side
input of the route's blocks) with them, and after block `end` scatter the blocks' output back into the stream
as it was at the route's start. A value that crosses the route's ends other than the stream follows the same
rule by where it is made and read (`place_routes`). DAR, written into the same graph after the routes, is
rewrite.py's.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from .decision import Plan, RoutePlan
from .errors import ConfigError
from .findings import BlockInfo, Gather
from .graphs import between, descends, slot_value, slots
from .routing import every_token, gather_tokens, joined_index, joined_stream, route_side, scatter_tokens, static_tokens

STATE = "routekit"  # the one submodule routekit adds to a model: route selectors, fused ends, DAR's parameters


def place_routes(graph: fx.Graph, plan: Plan, selected: bool, dropping: bool = False) -> dict[int, tuple[fx.Node, fx.Node]]:
    """Insert the plan's routes into `graph` in place; route k calls the module `routekit.routes.k`.

    `selected`: every route, with the tokens its selector keeps (training). Otherwise only the fused routes
    (`Route.fuse`), keeping every token: their end changes the model, so it runs in eval too. `dropping`: the
    fused routes run without their blocks (`routekit.path_drop`), their end fusing mask tokens with the stream.

    A route that crosses from one stack into the next goes on through the owner's code between them, on the kept
    tokens: that code joins them with what it adds (text in front), the next stack's index is the kept positions
    moved past those (`joined_index`), and its full-size stream, where the routed tokens rejoin at the route's
    end, is what the owner joined with the route's full stream in place of the kept tokens (`joined_stream`).
    A block output read outside the chain (a long skip into a later block, hidden states the model returns) is
    the kept tokens where a block of the route reads it, and is put back like the stream elsewhere: its routed
    tokens at their value at the route's start, as TREAD defines what a route hands on.

    Returns, per route placed with its selector, its (index, end) nodes, where DAR hooks its history in.
    """
    report = plan.report
    placed = {}
    by_name = {n.name: n for n in graph.nodes}
    grid_node = by_name.get(report.grid_node) if report.grid_node and not plan.grid_given else None
    for k, route in enumerate(plan.placed):
        fused = route.route.fuse is not None
        if fused and dropping:
            _drop_blocks(graph, k, route, report, by_name)
            continue
        if not selected and not fused:
            continue
        blocks = report.blocks[route.start:route.end + 1]
        first = by_name[blocks[0].node]
        stream_in = slot_value(first, report.stack_of(route.start).stream_slot)
        with graph.inserting_before(first):
            grid = grid_node if grid_node is not None else plan.measured_grid
            if selected:
                index = chosen = graph.call_module(f"{STATE}.routes.{k}", (stream_in, grid, route.keep))
            else:
                index = chosen = graph.call_function(every_token, (stream_in,))
            kept = graph.call_function(gather_tokens, (stream_in, index))
        full, stack = stream_in, blocks[0].stack
        calls = [by_name[b.node] for b in blocks]  # what they return is the route's own: read inside as it is
        inside = set(calls)  # with the owner's code between two stacks, where the route crosses them
        given = {b.node: dict(slots(by_name[b.node])) for b in blocks}  # each block's arguments before the route cuts them
        routed: dict[str, fx.Node] = {}  # one call per side input and route, however many blocks read it
        back: list[tuple[fx.Node, fx.Node, fx.Node]] = []  # (a block's output, the full stream, the index) to put back
        for block in blocks:
            node = by_name[block.node]
            slot = report.stack_of(block.index).stream_slot
            if block is blocks[0]:
                _set_slot(node, slot, kept)
            if block.compiled:  # a block compiled on its own sees two token counts, each compiled static
                with graph.inserting_before(node):
                    _set_slot(node, slot, graph.call_function(static_tokens, (slot_value(node, slot),)))
            if block.stack != stack:  # into the next stack, through the owner's code between them
                before, this = report.stacks[stack], report.stacks[block.stack]
                into = slot_value(node, this.stream_slot)
                last = by_name[report.blocks[before.first + before.depth - 1].stream_out]
                inside |= between(last, into) if isinstance(into, fx.Node) else set()  # the join runs on the kept tokens
                if into is not last:
                    with graph.inserting_before(node):
                        full = graph.call_function(joined_stream, (into, full, index, this.joined_at))
                        index = graph.call_function(joined_index, (index, this.joined_at, before.tokens, this.tokens))
                stack = block.stack
            for side in block.side_inputs:
                cuts = route.cuts(side, stack)
                value = slot_value(node, side.slot)
                if not cuts or any(isinstance(v, fx.Node) and any(descends(v, m) for m in calls)
                                   for v in pytree.tree_leaves(value)):  # made inside the route: its kept tokens
                    continue
                key = repr((stack, fx.node.map_arg(value, lambda n: n.name)))
                if key not in routed:
                    with graph.inserting_before(node):
                        routed[key] = graph.call_function(route_side, (value, full, index, cuts, route.shared))
                        if block.compiled:
                            axes = tuple((g.path, g.axes if g.batched or route.shared else tuple(a + 1 for a in g.axes))
                                         for g in cuts if isinstance(g, Gather))
                            routed[key] = graph.call_function(static_tokens, (routed[key], axes))
                _set_slot(node, side.slot, routed[key])
            if block is not blocks[-1]:
                back.append((by_name[block.stream_out], full, index))
        out = by_name[blocks[-1].stream_out]
        with graph.inserting_after(out):
            if fused:  # SPRINT's end: the deep path at the kept tokens, fused with the stream at the start
                end = graph.call_module(f"{STATE}.sprint.{k}", (full, out, index))
            else:  # TREAD's: the routed tokens rejoin with their value at the start
                end = graph.call_function(scatter_tokens, (full, index, out))
        out.replace_all_uses_with(end, delete_user_cb=lambda user, end=end: user is not end)
        for value, whole, at in back:  # read outside the route: put back like the stream
            readers = [u for u in value.users if u not in inside and not _routed_op(u)]
            if readers:
                with graph.inserting_after(value):
                    restored = graph.call_function(scatter_tokens, (whole, at, value))
                for user in readers:
                    user.replace_input_with(value, restored)
        of_call = {b.node: b for b in blocks}
        for block in blocks:  # an input a block hands on unchanged, read outside the route: the whole value the route cut
            handed = dict(block.handed_on)
            for item in list(by_name[block.node].users):
                if item.op == "call_function" and item.target is operator.getitem and (item.args[1],) in handed:
                    readers = [u for u in item.users if u not in inside and not _routed_op(u)]
                    whole = _whole(block, (item.args[1],), given, of_call) if readers else None
                    for user in readers:
                        user.replace_input_with(item, whole)
        if selected:
            placed[k] = (chosen, end)
    return placed


def _drop_blocks(graph: fx.Graph, k: int, route: RoutePlan, report, by_name: dict[str, fx.Node]) -> None:
    """Fused route `k` without its blocks (`routekit.path_drop`): its end fuses mask tokens with the stream as it
    entered the route, and every node computed from the blocks' calls goes, so they do not run. Refused where
    something else reads what the blocks make (a joint block's text stream, a long skip, hidden states the
    forward returns): without the blocks it does not exist."""
    blocks = report.blocks[route.start:route.end + 1]
    if blocks[0].stack != blocks[-1].stack:
        raise ConfigError(
            f"path_drop runs the model without route {k}'s blocks, and the route crosses from {blocks[0].qualname}'s "
            f"stack into {blocks[-1].qualname}'s, where the owner joins tokens of its own (text) to the stream: "
            "without the blocks that join is not made; Path-Drop Guidance needs a route within one stack")
    first = by_name[blocks[0].node]
    stream_in = slot_value(first, report.stack_of(route.start).stream_slot)
    out = by_name[blocks[-1].stream_out]
    with graph.inserting_after(out):
        end = graph.call_module(f"{STATE}.sprint.{k}", (stream_in,))
    out.replace_all_uses_with(end, delete_user_cb=lambda user: user is not end)
    made = {first}  # what the blocks make: every node computed from the first one's call
    for node in graph.nodes:
        if any(n in made for n in node.all_input_nodes):
            made.add(node)
    for node in reversed(list(graph.nodes)):
        if node in made and not node.users and node.op != "output":
            graph.erase_node(node)
    names = {n.name for n in graph.nodes}
    left = [b.qualname for b in blocks if b.node in names]
    if left:
        raise ConfigError(
            f"path_drop runs the model without route {k}'s blocks ({blocks[0].qualname} … {blocks[-1].qualname}), "
            f"but the forward reads more of {left[0]}'s output than the stream the route's end replaces (a joint "
            "block's text stream, a long skip into a later block, hidden states it returns), which without the "
            "blocks does not exist. SPRINT's path drop replaces the deep path of the stream alone, so its weak pass "
            "is defined for a span whose blocks hand on the stream alone (a joint model's text, processed by the "
            "span in training, would skip it here)")


def _whole(block: BlockInfo, path: tuple, given: dict, routed: dict) -> Any:
    """The value a route's `block` hands on unchanged at `path` of its output, whole: the argument it came in as,
    before the route cut it, followed back through the blocks of the route that handed it on before."""
    slot, within = dict(block.handed_on)[path]
    value = given[block.node][slot]
    for key in within:
        value = value[key]
    if isinstance(value, fx.Node) and value.target is operator.getitem and isinstance(value.args[0], fx.Node):
        before = routed.get(value.args[0].name)
        if before is not None and (value.args[1],) in dict(before.handed_on):
            return _whole(before, (value.args[1],), given, routed)
    return value


def _routed_op(node: fx.Node) -> bool:
    """A node a route inserted (its gathers, scatters, joins), which reads the route's values on purpose."""
    return (node.op == "call_function" and node.target in (gather_tokens, scatter_tokens, route_side, joined_stream,
                                                           joined_index, static_tokens)) or \
        (node.op == "call_module" and node.target.startswith(f"{STATE}.sprint."))


def _set_slot(node: fx.Node, slot, value: fx.Node) -> None:
    if isinstance(slot, int):
        node.update_arg(slot, value)
    else:
        node.update_kwarg(slot, value)

"""Build the training graph: route ops placed around the block stack of the original trace.

The original graph is copied, never edited in place: the eval path stays the original forward.
Each route becomes: select the kept indices before block `start`, gather the stream (and every
per-token side input of the route's blocks) with them, and after block `end` scatter the blocks'
output back into the stream as it was at the route start.
"""

from __future__ import annotations

import copy
import itertools
import linecache

import torch
import torch.fx as fx

from .analysis import GraphReport, slot_value
from .config import Route
from .ops import gather_tokens, scatter_tokens

_counter = itertools.count()


def route_graph(graph: fx.Graph, report: GraphReport, routes: list[Route], grid_fixed: bool):
    """A copy of `graph` with `routes` inserted; route k calls the module `routekit.routes.k`.

    Returns the graph and, per route, its (index, scatter) nodes, where DAR hooks its history in.
    """
    graph = copy.deepcopy(graph)
    placed = {}
    by_name = {n.name: n for n in graph.nodes}
    grid_node = by_name.get(report.grid_node) if report.grid_node and not grid_fixed else None
    for k, route in enumerate(routes):
        blocks = report.blocks[route.start:route.end + 1]
        first = by_name[blocks[0].node]
        stream_in = slot_value(first, report.stream_slot)
        with graph.inserting_before(first):
            args = (stream_in,) if grid_node is None else (stream_in, grid_node)
            index = graph.call_module(f"routekit.routes.{k}", args)
            kept = graph.call_function(gather_tokens, (stream_in, index))
        _set_slot(first, report.stream_slot, kept)
        gathered: dict[str, fx.Node] = {}
        for block in blocks:
            node = by_name[block.node]
            for side in block.side_inputs:
                if side.kind != "per-token":
                    continue
                if side.node not in gathered:
                    with graph.inserting_before(node):
                        gathered[side.node] = graph.call_function(gather_tokens, (by_name[side.node], index))
                _set_slot(node, side.slot, gathered[side.node])
        out = by_name[blocks[-1].stream_out]
        with graph.inserting_after(out):
            full = graph.call_function(scatter_tokens, (stream_in, index, out))
        out.replace_all_uses_with(full, delete_user_cb=lambda user, full=full: user is not full)
        placed[k] = (index, full)
    graph.lint()
    return graph, placed


def _set_slot(node: fx.Node, slot, value: fx.Node) -> None:
    if isinstance(slot, int):
        node.update_arg(slot, value)
    else:
        node.update_kwarg(slot, value)


def constants_to_inputs(graph: fx.Graph, constants: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Turn get_attr nodes of trace-time constants into trailing inputs; returns their values in order."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values = []
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.target in constants:
            anchor = placeholders[-1] if placeholders else None
            with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(None):
                ph = graph.placeholder(f"routekit_constant_{len(values)}")
            placeholders.append(ph)
            node.replace_all_uses_with(ph)
            graph.erase_node(node)
            values.append(constants[node.target])
    return values


def compile_graph(graph: fx.Graph, label: str):
    """Python function `forward(self, *inputs)` for the graph; shows up readably in tracebacks."""
    code = graph.python_code(root_module="self")
    filename = f"<routekit {label} {next(_counter)}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(keepends=True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)
    return namespace["forward"]

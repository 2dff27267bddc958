"""Shared block bodies (`DAR(regions=True)`): a DAR graph torch.compile compiles once per distinct block body.

DAR inlines every block into the owner's graph (rewrite.place_dar), so that one graph carries the history of
sublayer outputs. Compiled whole, that graph makes Dynamo trace and Inductor lower each block's code again for
every block: DiT-XL/2's 28 blocks took a DAR model's first compiled step to 128 s against 78 s for the plain model
on an H200, and most of either is the blocks' code, the same 28 times. So, after the rewrite, each inlined
block's own nodes are cut where DAR's values enter them into segments (before the first aggregation, between two,
after the last); a segment whose code, with modules addressed from the block, is the same in several blocks
becomes one function marked with torch.compiler.nested_compile_region and called with each block. Dynamo traces
it once and stamps the trace out for the other blocks; Inductor compiles it once. Eager, the marker is a plain
call, and the ops run in the same order on the same values. It is an option, not the default: Inductor fuses
nothing across a region's edge, so each step costs more for a shorter first step (`DAR`'s docstring gives the
trade).

A block is left inlined where a segment could not be called as a function safely: an op that writes into its
input (the region would mutate a value the rest of the graph reads), a module outside the block or one with hooks
(an FSDP unit's hooks stop Dynamo, which a region cannot survive: hooks added after the graph was built make
the call run the body unmarked, inlined as before), a checkpoint or autocast boundary traced as nodes, or a value at a
segment's edge that may share memory with another (see `_remade`, `_fresh`).
"""

from __future__ import annotations

import heapq
import inspect
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from . import dar
from .graphs import compile_graph
from .guards import hooked
from .routing import gather_tokens, scatter_tokens

_OPS = ("call_module", "call_function", "call_method")
_HAS_REUSE_LIMIT = "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters
CALLED = "routekit_called"  # a region call's meta entry: the layers it calls
# What makes a new tensor and what may alias its input, by op. Only the values that cross a segment's edge are
# looked up; an op in neither list there keeps its block inlined (correct, just compiled once per block).
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute", "t",
                 "mT", "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "select", "chunk", "split",
                 "unbind", "tensor_split", "movedim", "swapaxes", "swapdims", "diagonal", "as_strided", "detach",
                 "contiguous", "to", "float", "half", "bfloat16", "double", "type", "type_as", "__getitem__",
                 "unfold", "real", "imag"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.flatten, torch.unflatten, torch.transpose,
                   torch.permute, torch.unsqueeze, torch.squeeze, torch.chunk, torch.split, torch.unbind,
                   torch.narrow, torch.select, torch.movedim, torch.swapaxes, torch.t, torch.detach,
                   torch.view_as_real, torch.view_as_complex, torch.tensor_split}
_FRESH_METHODS = {"add", "sub", "mul", "div", "matmul", "bmm", "softmax", "log_softmax", "exp", "sigmoid", "tanh",
                  "pow", "rsqrt", "sqrt", "neg", "mean", "sum", "clone", "masked_fill", "__add__", "__sub__",
                  "__mul__", "__truediv__", "__radd__", "__rsub__", "__rmul__", "__matmul__", "__neg__"}
_FRESH_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.matmul,
                    operator.pow, torch.add, torch.sub, torch.mul, torch.div, torch.matmul, torch.bmm,
                    torch.baddbmm, torch.addmm, torch.cat, torch.stack, torch.exp, torch.tanh, torch.sigmoid,
                    torch.softmax, torch.rsqrt, torch.sqrt, torch.where, torch.clone, torch.layer_norm,
                    torch.nn.functional.linear, torch.nn.functional.layer_norm, torch.nn.functional.group_norm,
                    torch.nn.functional.rms_norm, torch.nn.functional.gelu, torch.nn.functional.silu,
                    torch.nn.functional.relu, torch.nn.functional.softmax,
                    torch.nn.functional.scaled_dot_product_attention,
                    # DAR's mixes, each new (merge_for_norm's a tuple of new tensors; not dar.cast_like or
                    # dar.sum_sources: they may return a source)
                    dar.mix, dar.merge, dar.merge_for_norm, dar.blend,
                    # a route's gather and scatter (out of place; a permuted view of their own new tensor at most)
                    gather_tokens, scatter_tokens}
_FRESH_MODULES = (nn.Linear, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.GELU,
                  nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.ReLU, nn.Embedding)
_INPLACE_OPERATORS = {getattr(operator, f"i{name}") for name in
                      ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
                       "lshift", "rshift", "concat")}


@dataclass
class _Segment:
    """Part of one block's inlined code that runs as one call: its nodes (with copies of the views it reads from
    elsewhere), the values it reads from outside them, and its text as a function of the block (the key)."""

    members: list[fx.Node]
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node] = field(default_factory=list)
    key: tuple = ()
    body: fx.Graph | None = None
    block: frozenset = frozenset()  # every node of the block's inlined code


def share_bodies(graph: fx.Graph, model: torch.nn.Module, bodies: list[tuple[str, list[fx.Node]]]) -> int:
    """Replace the code of each block in `bodies` (its qualified name and the nodes its inlined code made in
    `graph`) by calls of compile regions, where every segment of it is shared with another block and can be
    called without aliasing (in place); returns how many blocks were replaced."""
    live = set(graph.nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    blocks = []
    for qualname, nodes in bodies:
        members = sorted((n for n in nodes if n in live and n.op in _OPS), key=order.__getitem__)
        if members and _callable(members, qualname, model):
            segments = _cut(graph, members, order, qualname, model)
            if segments is not None:
                blocks.append((qualname, members, segments))
    while True:  # a block is shared whole or not at all: one unshared segment takes its block out
        uses = Counter(s.key for _, _, segments in blocks for s in segments)
        shared = [b for b in blocks if all(uses[s.key] > 1 for s in b[2])]
        if len(shared) == len(blocks):
            break
        blocks = shared
    first = {}
    for qualname, _, segments in blocks:
        for s in segments:
            first.setdefault(s.key, (s, qualname))
    functions = {key: _region(*first[key], count) for key, count in uses.items()}
    now: dict[fx.Node, fx.Node] = {}  # a segment's output -> what stands for it once its segment is a call
    for qualname, members, segments in blocks:
        for segment in segments:
            now.update(_call(graph, functions[segment.key], qualname, segment, now))
        for node in reversed(members):
            graph.erase_node(node)
    if blocks:
        for node in list(reversed(graph.nodes)):  # what the regions make again themselves, if nothing else reads it
            if not node.users and _remade(node):
                graph.erase_node(node)
        _topological_order(graph)
    return len(blocks)


def _callable(members: list[fx.Node], qualname: str, model: torch.nn.Module) -> bool:
    """Whether every node of a block's inlined code can run inside a function of the block (see the module's
    docstring for why each exclusion)."""
    prefix = qualname + "."
    for node in members:
        target = node.target
        if node.kwargs.get("inplace") is True:
            return False
        if node.op == "call_module":
            module = model.get_submodule(target) if str(target).startswith(prefix) else None
            if module is None or getattr(module, "inplace", False) is True or hooked(module):
                return False
        elif node.op == "call_method":
            if target.endswith("_") and not target.endswith("__"):
                return False
        else:
            name = getattr(target, "__name__", "")
            if (name.endswith("_") and not name.endswith("__")) or target in _INPLACE_OPERATORS \
                    or "checkpoint" in name or "autocast" in name or "grad_enabled" in name:
                return False
    return True


def _segments(graph: fx.Graph, members: list[fx.Node], member: frozenset[fx.Node],
              order: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """A block's nodes (`members` in graph order, `member` as a set) by how many times the data flow that reaches
    them left the block and came back (through DAR's aggregations): each level can run as one call, after
    everything it reads."""
    first, last = order[members[0]], order[members[-1]]
    level: dict[fx.Node, int] = {}
    for node in graph.nodes:
        i = order[node]
        if i < first:
            continue
        if i > last:
            break
        known = [n for n in node.all_input_nodes if n in level]
        if node in member:
            level[node] = max((level[n] + (n not in member) for n in known), default=0)
        elif known:  # DAR's values made from the block's: a member reading one starts the next level
            level[node] = max(level[n] for n in known)
    segments: dict[int, list[fx.Node]] = {}
    for node in members:
        segments.setdefault(level[node], []).append(node)
    return [segments[k] for k in sorted(segments)]


def _cut(graph: fx.Graph, members: list[fx.Node], order: dict[fx.Node, int], qualname: str,
         model: torch.nn.Module) -> list[_Segment] | None:
    """A block's segments, each with its inputs, outputs and text; None where one could not be called as a
    function: a value it takes or gives might share memory with another (torch.compile's regions refuse
    aliasing). A view a segment reads is made again inside it from what it views, so views never cross."""
    member = frozenset(members)
    segments = []
    for nodes in _segments(graph, members, member, order):
        inside, views = set(nodes), set()
        stack = [n for node in nodes for n in node.all_input_nodes if n not in inside]
        while stack:
            n = stack.pop()
            if n not in inside and n not in views and _remade(n):
                views.add(n)
                stack.extend(n.all_input_nodes)
        ordered = sorted(inside | views, key=order.__getitem__)
        taken = set(ordered)
        inputs = list(dict.fromkeys(n for node in ordered for n in node.all_input_nodes if n not in taken))
        if not all(_fresh(n, model) for n in inputs):
            return None
        segments.append(_Segment(nodes, ordered, inputs, block=member))
    read = {n for s in segments for n in s.inputs}
    for s in segments:
        s.outputs = [n for n in s.members if n in read or any(u not in member for u in n.users)]
        if not all(_fresh(n, model) for n in s.outputs):
            return None
        s.body = _segment_graph(s, qualname)
        code = s.body.python_code(root_module="self")
        s.key = (code.src, tuple(sorted((k, id(v)) for k, v in code.globals.items())))
    return segments


def _segment_graph(segment: _Segment, qualname: str) -> fx.Graph:
    """A segment as a graph of its own: its inputs become placeholders, modules are addressed from the block,
    and every name is positional, so two blocks with the same code give the same text."""
    body = fx.Graph()
    env = {n: body.placeholder(f"a{i}") for i, n in enumerate(segment.inputs)}
    for i, node in enumerate(segment.nodes):
        args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        target = node.target[len(qualname) + 1:] if node.op == "call_module" else node.target
        env[node] = body.create_node(node.op, target, args, kwargs, name=f"n{i}")
    body.output(tuple(env[n] for n in segment.outputs))
    return body


def _remade(node: fx.Node) -> bool:
    """Whether a segment that reads the node's value makes it again itself, from what the node reads: a value that
    may be a view of (or the same tensor as) another, which a region may not take beside it, and the pointwise
    end of a LayerNorm folded into a DAR merge, which fuses with what the block does with it only there."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and (node.target in _VIEW_FUNCTIONS or node.target is dar.norm_of_merge)


def _fresh(node: fx.Node, model: torch.nn.Module) -> bool:
    """Whether the node's value is memory of its own (what a compile region may take or give): an input of the
    program, a parameter, or the result of an op known to make a new tensor. Anything else keeps its block
    inlined, as it was."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op == "call_module":
        return isinstance(model.get_submodule(node.target), _FRESH_MODULES)
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    return node.op == "call_function" and node.target in _FRESH_FUNCTIONS


def _region(segment: _Segment, qualname: str, uses: int):
    """The segment's function, called with the block: marked as a compile region under torch.compile, unless one of
    the layers it calls has hooks by then (an FSDP unit's, added after the graph was built: they stop Dynamo, which
    a region cannot survive), when Dynamo inlines it as it would the block's own code. The reuse cache holds an
    entry per input signature (a route's kept count is a second one); room for several per block, so blocks that
    differ in what Dynamo guards on are traced again, as unmarked code would be, instead of raising."""
    body = compile_graph(segment.body, "block body")
    # torch 2.11 has no cache limit (nor raises); later versions raise past it
    limit = {"max_reuse_entries": 4 * uses} if _HAS_REUSE_LIMIT else {}
    region = torch.compiler.nested_compile_region(body, **limit)
    layers = [n.target[len(qualname) + 1:] for n in segment.nodes if n.op == "call_module"]

    def block_body(block: nn.Module, *inputs):
        if torch.compiler.is_compiling() and not any(hooked(block.get_submodule(name)) for name in layers):
            return region(block, *inputs)
        return body(block, *inputs)

    # fx writes a function into generated code by import path where it can, a local one under its own name
    block_body.__module__ = __name__
    block_body.body = body  # the code, for a reader (tests, a traceback's file)
    return block_body


def _call(graph: fx.Graph, function, qualname: str, segment: _Segment,
          now: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    """Put one call of `function` with the block after the segment's last node and let every reader outside the
    block read its outputs from it; returns what stands for each output now. The block's nodes are erased by
    the caller, once every segment of it is a call."""
    with graph.inserting_after(segment.members[-1]):
        block = graph.get_attr(qualname)
    with graph.inserting_after(block):
        call = graph.call_function(function, (block, *(now.get(n, n) for n in segment.inputs)))
    # the layers the call runs, by their names in the model, for what reads a graph's module calls (sharding)
    call.meta[CALLED] = frozenset(n.target for n in segment.nodes if n.op == "call_module")
    anchor, made = call, {}
    for i, node in enumerate(segment.outputs):
        with graph.inserting_after(anchor):
            anchor = made[node] = graph.call_function(operator.getitem, (call, i))
        node.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in segment.block)
    return made


def _topological_order(graph: fx.Graph) -> None:
    """Reorder the nodes so each follows what it reads, keeping the old order where data flow allows: a call put
    after its segment's last node may be read by a node that stood between the segment's nodes."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    ready = [index[n] for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    ordered = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        ordered.append(node)
        for user in node.users:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, index[user])
    if len(ordered) != len(nodes):
        raise RuntimeError("routekit bug: sharing block bodies left a cycle in the graph")
    output = ordered[-1]
    for node in ordered[:-1]:
        output.prepend(node)

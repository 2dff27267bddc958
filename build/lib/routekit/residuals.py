"""Residual adds: where a block adds a sublayer's output onto the stream (what DAR rewrites), and e(t).

DAR replaces each add that carries the residual stream by an aggregation over every earlier source, so it
must find them in a block's own trace: an add whose one operand is the stream so far and whose other is
computed from it through a sublayer. These are patterns read off a graph, nothing more; tracing the block
to get that graph is probe.py's, and deciding per block is the analysis's. DAR's `static_t` queries also
need the model's own timestep embedding, found here by the same kind of reading.
"""

from __future__ import annotations

import operator
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .findings import BlockInfo
from .graphs import to_networkx
from .values import TensorMeta

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


def plain_layer(module: nn.Module) -> bool:
    """One of torch.nn's plain layers (a Linear, a Dropout, an activation): no residual inside and no block of a
    stack. torch's composite layers (a TransformerEncoderLayer, which adds inside) and the user's own are not."""
    return type(module).__module__.startswith("torch.nn.") and next(module.children(), None) is None


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
            if not plain_layer(module):
                return False  # its own code, or torch's composite layers (a TransformerEncoderLayer adds inside)
    return True


# ---- the timestep embedding (DAR's static_t queries) ----------------------------------------------------------

def timestep_embeddings(graph: fx.Graph, batch: int, dim: int) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """The model's own e(t) as analysis records it: the last (batch, dim) node computed from a 1-D float input
    alone (None where there is none), and (module, node) of every module call giving a (batch, dim) value,
    where `DAR(timestep="name")` looks (`GraphReport.embedding`)."""
    nodes = list(graph.nodes)
    calls = tuple((n.target, n.name) for n in nodes
                  if n.op == "call_module" and getattr(n.meta.get("rk"), "shape", None) == (batch, dim))
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
            return found[-1].name, calls
    return None, calls

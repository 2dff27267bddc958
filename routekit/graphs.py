"""Reading a torch.fx graph as data flow: the helpers every part of the analysis and the rewrite share.

An fx graph lists nodes in execution order; what routekit asks of it is which values are computed from
which (`to_networkx`, `descends`, `between`) and which argument of a call a value feeds (`slots`). They sit
apart from the analysis so that its parts (side inputs, tokens, residual adds) and the rewrite can all read
graphs the same way without importing one another. `compile_graph` turns a graph into the Python function
that runs it (a routed program, a shared block body).
"""

from __future__ import annotations

import itertools
import linecache
import sys
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .values import TensorMeta

Slot = int | str  # a positional index or a keyword name in a block call


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """Data-flow graph: an edge from every input node to the node that uses its value. A read of what a tensor
    is rather than what it holds is no use of its values (`head_dim = key.shape[-1] // heads` does not make what
    it reshapes depend on `key`, nor does OmniGen's `time_proj(t).type_as(hidden_states)` make its time token
    from the image): such a read has no edge from the tensor (`is_shape_read`, `kind_only`)."""
    g = nx.DiGraph()
    for order, node in enumerate(graph.nodes):
        g.add_node(node.name, op=node.op, target=str(node.target), order=order)
        shape_read = is_shape_read(node)
        kinds = kind_only(node)
        for inp in node.all_input_nodes:
            if not (shape_read and inp is node.args[0]) and inp not in kinds:
                g.add_edge(inp.name, node.name)
    return g


_LIKE = frozenset({torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                   torch.randn_like, torch.randint_like})
_NEW = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})


def kind_only(node: fx.Node) -> set[fx.Node]:
    """The inputs of `node` whose values it does not read, only their shape, dtype or device: the tensor
    `x.type_as(y)` and `x.to(y)` take the dtype of, `x.expand_as(y)` the shape of (`view_as`, `reshape_as`), the
    one `torch.zeros_like(y)` takes the shape of, the one `y.new_zeros(...)` is called on."""
    args = node.args
    if node.op == "call_method" and node.target in ("type_as", "to", "expand_as", "view_as", "reshape_as") \
            and len(args) >= 2:
        return {args[1]} if isinstance(args[1], fx.Node) and _is_tensor(args[1]) else set()
    if node.op == "call_method" and node.target in _NEW and args:
        return {args[0]} if isinstance(args[0], fx.Node) else set()
    if node.op == "call_function" and node.target in _LIKE and args:
        return {args[0]} if isinstance(args[0], fx.Node) else set()
    return set()


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("rk"), TensorMeta) or isinstance(node.meta.get("value"), torch.Tensor)


_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "ndimension", "get_device", "nelement"})


def is_shape_read(node: fx.Node) -> bool:
    """`x.shape`, `x.size()`, `x.dim()`, `x.numel()`, `x.dtype`...: a node reading what a tensor is, not its values."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return node.args[1] in _SHAPE_ATTRS
    return node.op == "call_method" and node.target in _SHAPE_METHODS


_SIZE_READS = frozenset({"shape", "size", "numel", "nelement"})  # the shape reads a route's token count changes


def reads_kind(node: fx.Node) -> bool:
    """`x.device`, `x.dtype`, `x.dim()`...: a shape read (`is_shape_read`) that neither a tensor's values nor its
    token count change, so it may read a routed block's output (HiDream takes `hidden_states.device` after each
    block)."""
    if not is_shape_read(node):
        return False
    return (node.args[1] if node.op == "call_function" else node.target) not in _SIZE_READS


def slots(node: fx.Node):
    """(slot, argument) of every argument of a call."""
    yield from enumerate(node.args)
    yield from node.kwargs.items()


def meta_of(arg: Any) -> Any:
    """What a call argument holds: fx nodes replaced by their recorded values (tensors as TensorMeta).

    An object registered with pytree (a cache, a context dataclass) is rebuilt around the values where the
    recording put nodes in it: probes of the block need values, and a node handed to a block fails every call.
    """
    def holds_nodes(v: Any) -> bool:
        return any(isinstance(leaf, fx.Node) for leaf in pytree.tree_leaves(v))

    def leaf(v: Any) -> bool:  # a node, or an object a route does not look into (`routing.is_opaque`) holding none
        return isinstance(v, fx.Node) or (not isinstance(v, (tuple, list, dict)) and not holds_nodes(v))

    return pytree.tree_map(lambda v: v.meta.get("rk") if isinstance(v, fx.Node) else v, arg, is_leaf=leaf)


def slot_value(node: fx.Node, slot: Slot) -> Any:
    return node.args[slot] if isinstance(slot, int) else node.kwargs[slot]


CATS = {torch.cat, torch.concat, torch.concatenate}  # the ops that join tensors along an axis


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


_counter = itertools.count()  # each compiled graph's own file name in tracebacks


def compile_graph(graph: fx.Graph, label: str):
    """Python function `forward(self, *inputs)` for the graph; shows up readably in tracebacks."""
    code = graph.python_code(root_module="self")
    filename = f"<routekit {label} {next(_counter)}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(keepends=True), filename)
    namespace = dict(code.globals)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # numpy 2 writes a numpy scalar constant as `np.float64(...)` (DINOv3's log-scale draw)
        namespace.setdefault("np", numpy)
    exec(compile(code.src, filename, "exec"), namespace)
    return namespace["forward"]

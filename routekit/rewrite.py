"""Plan → fx graph: the routes and DAR written into a copy of the traced owner graph.

The traced graph is copied, never edited in place. The routes go in first (placing.py: the kept
indices chosen before block `start`, the stream and every per-token side input gathered with them, the
blocks' output scattered back after block `end`). DAR inlines the blocks (each block's own trace from the
analysis) so one graph carries the history of sublayer outputs across blocks as plain data flow, and
replaces every residual add by an aggregation over that history; the schedule of which sources each
aggregation sees is static.

With routes and DAR together: entering a route, every history source is gathered to the kept tokens;
sources made inside the route are scattered back at its end with zeros for the routed tokens (the
branch they skipped contributes nothing to the value, as in a plain residual network, but a zero
source still takes softmax weight: its logit is 0 whatever the query, so it dilutes those tokens'
mix), or, for a chunk summary begun before the route, with its pre-route part; sources from before
the route are restored at full size.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn

from . import dar
from .calls import bind_arguments, call_inputs
from .decision import Plan, RoutePlan
from .errors import ConfigError
from .findings import BlockInfo
from .graphs import descends, is_shape_read, reads_kind, slot_value
from .guards import Assumptions
from .placing import STATE, place_routes
from .regions import share_bodies
from .residuals import uncast
from .routing import gather_tokens, scatter_tokens

if TYPE_CHECKING:
    from .trace import Trace

@dataclass
class Rewritten:
    """A rewritten graph, the trace-time constants it reads, its specialisations and what it assumed about
    the model (the traces it was made of, the owner's and, with DAR, each inlined block's)."""

    graph: fx.Graph
    constants: dict[str, torch.Tensor]
    specialised: list[str] = field(default_factory=list)
    assumed: Assumptions = field(default_factory=Assumptions)


def rewrite(tr: Trace, plan: Plan, model: nn.Module, training: bool, dropping: bool = False) -> Rewritten:
    """The graph a routed model runs: with the plan's routes when `training` (else its fused routes alone, keeping
    every token), DAR's aggregations if planned; `dropping`: fused routes without their blocks (`path_drop`)."""
    graph = copy.deepcopy(tr.graph)
    first = next(n for n in graph.nodes if n.name == plan.report.blocks[0].node)
    v0 = slot_value(first, plan.report.stream_slot)  # the stream entering the first block, before any route
    routes = plan.placed if training else ()
    placed = place_routes(graph, plan, training, dropping)
    result = Rewritten(graph, dict(tr.constants), list(tr.specialised), tr.assumed)
    if plan.dar is not None:
        place_dar(result, plan, model, v0, routes, placed)
    keep_checkpoints(graph)
    graph.lint()
    return result


def keep_checkpoints(graph: fx.Graph) -> None:
    """A block the owner's forward runs under torch.utils.checkpoint (the trace marked its call) is called the
    same way in the rewritten graph, with the same options: its activations are recomputed in backward, as
    the user asked, instead of silently kept."""
    for node in list(graph.nodes):
        options = node.meta.get("checkpoint") if node.op == "call_module" else None
        if options is None:
            continue
        with graph.inserting_before(node):
            module = graph.get_attr(node.target)
            call = graph.call_function(torch.utils.checkpoint.checkpoint, (module, *node.args),
                                       {**node.kwargs, **options})
        node.replace_all_uses_with(call)
        graph.erase_node(node)


# ---- DAR -------------------------------------------------------------------------------------------------

@dataclass
class _Item:
    node: fx.Node
    inside: bool = False  # made inside the current route
    full: fx.Node | None = None  # its full-size value, for items that existed when the route began
    bases: list = field(default_factory=list)  # full-size parts of a summary begun before the route


class _History:
    """The static schedule: which graph nodes are the sources at each point."""

    def __init__(self, graph: fx.Graph, v0: fx.Node, chunk: int | None):
        self.graph, self.items, self.chunk = graph, [_Item(v0)], chunk
        self.raw_count = 0
        self.unified = False  # sources made before the first sublayer output are cast to its dtype
        self.index: fx.Node | None = None
        self.route_stream: fx.Node | None = None

    def append(self, node: fx.Node) -> None:
        if not self.unified:
            for item in self.items:
                item.node = self.graph.call_function(dar.cast_like, (item.node, node))
                if item.full is not None:
                    item.full = self.graph.call_function(dar.cast_like, (item.full, node))
            self.unified = True
        self.items.append(_Item(node, inside=self.index is not None))
        self.raw_count += 1
        if self.chunk and self.raw_count % self.chunk == 0:
            parts = self.items[-self.chunk:]
            del self.items[-self.chunk:]
            summary = self.graph.call_function(dar.sum_sources, ([p.node for p in parts],))
            inside = any(p.inside for p in parts)
            bases = [b for p in parts for b in ([p.full] if p.full is not None else p.bases)]
            self.items.append(_Item(summary, inside=inside, bases=bases if inside else []))

    def sources(self) -> list[fx.Node]:
        return [item.node for item in self.items]

    def enter(self, index: fx.Node, stream: fx.Node) -> None:
        self.index, self.route_stream = index, stream
        for item in self.items:
            item.full = item.node
            item.node = self.graph.call_function(gather_tokens, (item.node, index))

    def exit(self) -> None:
        zeros = None
        for item in self.items:
            if not item.inside:
                item.node, item.full = item.full, None
                continue
            if item.bases:
                base = self.graph.call_function(dar.sum_sources, (list(item.bases),))
            else:
                if zeros is None:
                    zeros = self.graph.call_function(torch.zeros_like, (self.route_stream,))
                base = zeros
            item.node = self.graph.call_function(scatter_tokens, (base, self.index, item.node))
            item.inside, item.full, item.bases = False, None, []
        self.index = self.route_stream = None


def place_dar(result: Rewritten, plan: Plan, model: nn.Module, v0: fx.Node, routes: tuple[RoutePlan, ...],
              route_nodes: dict[int, tuple[fx.Node, fx.Node]]) -> None:
    """Inline the blocks into `result.graph` and replace every residual add by an aggregation over the history
    that starts with `v0` (in place)."""
    graph, report, config = result.graph, plan.report, plan.dar.config
    by_name = {n.name: n for n in graph.nodes}
    temb = by_name[plan.dar.timestep] if plan.dar.timestep else None
    first = by_name[report.blocks[0].node]
    if temb is not None:
        _compute_before(graph, temb, first, v0)
    with graph.inserting_before(first):
        dynamic = config.query == "dynamic"
        query = graph.get_attr(f"{STATE}.dar.{'dynamic' if dynamic else 'query'}")
        if temb is not None:
            temb = graph.call_method("unsqueeze", (temb, 1))
    history = _History(graph, v0, config.chunk)
    starts = {r.start: k for k, r in enumerate(routes)}
    ends = {r.end: k for k, r in enumerate(routes)}
    route_of = {i: r for r in routes for i in r.blocks}
    two_phase = dict(plan.dar.two_phase if routes else plan.dar.two_phase_unrouted)
    point = 0
    chunk = None  # the current two-phase chunk: (first point, its shared sources, mixes node, state node)
    options = {"eps": config.eps, "kernel": config.kernel}
    readers: dict[fx.Node, tuple[fx.Node, list[int]]] = {}  # source -> (its logits node, the points reading it)
    bodies: list[tuple[str, list[fx.Node]]] = []  # each inlined block's nodes, for share_bodies

    def logits_for(shared: list[fx.Node], first: int, size: int) -> fx.Node:
        offsets = []
        for node in shared:
            if node not in readers:
                with graph.inserting_after(node):
                    readers[node] = graph.call_function(dar.history_logits, (node, query, (), temb, config.eps)), []
            offsets.append(len(readers[node][1]))
            readers[node][1].extend(range(first, first + size))
        return graph.call_function(dar.chunk_logits, (tuple(readers[n][0] for n in shared), tuple(offsets), size))

    def aggregate(v: fx.Node) -> fx.Node:
        nonlocal point, chunk
        history.append(v)
        q = graph.call_function(operator.getitem, (query, point))  # w_l, or W_l for dynamic queries
        if dynamic:
            q = graph.call_function(dar.dynamic_query, (v, q))
        elif config.query == "static_t":
            q = graph.call_function(operator.add, (q, temb))
        if point in two_phase:  # a chunk begins: its shared sources, once for all its queries
            shared = history.sources()[:-1]
            logits = logits_for(shared, point, two_phase[point])
            parts = graph.call_function(dar.shared_part, (shared, logits), {"kernel": config.kernel})
            chunk = (point, shared, *(graph.call_function(operator.getitem, (parts, i)) for i in (0, 1)))
        point += 1
        sources = history.sources()
        if chunk is None or point > chunk[0] + two_phase[chunk[0]]:
            return graph.call_function(dar.mix, (sources, q), options)
        first, shared, mixes, states = chunk
        if sources[:len(shared)] != shared:  # the plan admits no route boundary inside a chunk
            raise RuntimeError(f"routekit bug: the shared sources of the chunk at point {first} changed inside it")
        mix, state = (graph.call_function(operator.getitem, (part, point - 1 - first)) for part in (mixes, states))
        return graph.call_function(dar.merge, (sources[len(shared):], q, mix, state), options)

    gate = None
    if config.preserve:
        with graph.inserting_before(first):
            gate = graph.get_attr(f"{STATE}.dar.gate")

    def blended(add: fx.Node, h: fx.Node) -> fx.Node:
        """With `DAR(preserve=True)`, the aggregation blended into the add it replaces (`dar.blend`)."""
        if gate is None:
            return h
        return graph.call_function(dar.blend, (add, h, graph.call_function(operator.getitem, (gate, point - 1))))

    for i, info in enumerate(report.blocks):
        call = by_name[info.node]
        if i in starts:
            index, _ = route_nodes[starts[i]]
            with graph.inserting_before(call):
                history.enter(index, index.args[0])
        if info.adds:
            body, adds = _body(info, route_of.get(i))
            result.specialised.extend(body.specialised)
            # the block's forward no longer runs (its hooks would not), and what its code read is baked in
            result.assumed += body.assumed.under(info.qualname) + Assumptions(traced_through=(info.qualname,))
            forward = type(model.get_submodule(info.qualname)).forward
            env = _inline(graph, call, body, info.qualname, forward, result.constants)
            bodies.append((info.qualname, list(env.values())))
            for add_name in adds:
                add = env[add_name]
                skip, branch = add.args[0], add.args[1]
                if not descends(branch, uncast(skip)):  # the skip may be a cast of the stream (`h.float()`)
                    skip, branch = branch, skip
                with graph.inserting_before(add.next):
                    h = blended(add, aggregate(branch))
                add.replace_all_uses_with(h, delete_user_cb=lambda user, h=h: user is not h)
                if not add.users:
                    graph.erase_node(add)
        else:  # adds hidden inside the block: one source per block, v = output - input
            out = by_name[info.stream_out]
            stream_in = slot_value(call, report.stack_of(i).stream_slot)
            with graph.inserting_before(out.next):
                v = graph.call_function(operator.sub, (out, stream_in))
                h = blended(out, aggregate(v))
            out.replace_all_uses_with(h, delete_user_cb=lambda user, v=v, h=h: user is not v and user is not h)
        if i in ends:
            _, scatter = route_nodes[ends[i]]
            with graph.inserting_before(scatter.next):
                history.exit()
    for node, (logits, points) in readers.items():  # every reader is known now
        logits.args = (node, query, tuple(points), temb, config.eps)
    fold_norms(graph, model)
    if config.regions:
        share_bodies(graph, model, bodies)


def _compute_before(graph: fx.Graph, temb: fx.Node, first: fx.Node, stream: fx.Node) -> None:
    """Make `temb` (static_t's e(t), which every aggregation reads, the first inside the first block) before
    `first`, the first block's call, in place: an owner may compute its embedding after the blocks (diffusers'
    DiT calls block 0's embedder after the stack, for the output layer's conditioning); the nodes that make it
    move before the first block. A dtype or device read of the blocks' output among them (diffusers' DiT casts
    the time features to `hidden_states.dtype`) reads `stream`, the stream entering the first block, instead: a
    residual stack gives what it takes. Refused, saying why, where e(t) is made from the blocks' values or
    shapes, or by an in-place op the move could reorder."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    late, reads, stack = set(), set(), [temb]
    while stack:
        node = stack.pop()
        if node in late or node in reads or order[node] < order[first]:
            continue
        if is_shape_read(node) and reads_kind(node) and isinstance(node.args[0], fx.Node) and descends(node.args[0], first):
            reads.add(node)
            continue
        if node is first:
            raise ConfigError(
                f"DAR(query='static_t') reads the timestep embedding in every block from the first on, and the one "
                f"chosen ({temb.name}) is computed from the blocks' output; name a module the model calls on the "
                "timestep alone with DAR(timestep='t_embedder')")
        if node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__"):
            raise ConfigError(
                f"DAR(query='static_t') reads the timestep embedding from the first block on; the model computes "
                f"{temb.name} after it, with an in-place {node.target} that moving it before the first block could "
                "reorder; name a module the model calls on the timestep before the blocks with DAR(timestep=...)")
        late.add(node)
        stack.extend(node.all_input_nodes)
    for read in reads:
        with graph.inserting_before(first):
            again = graph.node_copy(read, lambda n, read=read: stream if n is read.args[0] else n)
        for user in list(read.users):
            if user in late:
                user.replace_input_with(read, again)
    for node in sorted(late, key=order.__getitem__):
        first.prepend(node)


def _body(info: BlockInfo, route: RoutePlan | None) -> tuple[Trace, tuple[str, ...]]:
    """The block's own trace as it runs: the analysis' one, unless `route` gives the block fewer tokens and
    that trace was specialised to its shapes; then the one the plan holds, traced as the route hands the block
    its inputs (the kept count, grid sizes shrunk, tables as the route cuts them)."""
    again = next((b for b in route.bodies if b.index == info.index), None) if route is not None else None
    return (info.body, info.adds) if again is None else (again.body, again.adds)


def _inline(graph: fx.Graph, call: fx.Node, tr: Trace, qualname: str, forward, constants: dict) -> dict[str, fx.Node]:
    """Replace the call of a block by the block's own traced nodes; returns block-node-name → new node."""
    module_args = bind_arguments(forward, call.args, call.kwargs)
    env: dict[fx.Node, fx.Node] = {}
    names: dict[str, fx.Node] = {}
    outputs = None
    with graph.inserting_before(call):
        inputs = iter(call_inputs(module_args, tr.spec, step=lambda value, key: _item(graph, value, key)))
        for node in tr.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
                continue
            if node.op == "output":
                outputs = [env[a] if isinstance(a, fx.Node) else a for a in node.args[0]]
                continue
            new = graph.node_copy(node, lambda n: env[n])
            if node.op in ("call_module", "get_attr"):
                new.target = f"{qualname}.{node.target}"
                if node.op == "get_attr" and node.target in tr.constants:
                    constants[new.target] = tr.constants[node.target]
            env[node], names[node.name] = new, new
    result = pytree.tree_unflatten(outputs, tr.out_spec)
    if isinstance(result, fx.Node):
        call.replace_all_uses_with(result)
    else:
        for user in list(call.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise ConfigError(f"DAR cannot inline {qualname}: its tuple output is used whole by {user.name}")
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(call)
    return names


def _item(graph: fx.Graph, value, key):
    """One step into a block call's argument: a container of nodes is indexed here, a node that holds a
    container (a leaf's tuple output) gets a getitem node."""
    if isinstance(value, fx.Node):
        return graph.call_function(operator.getitem, (value, getattr(key, "idx", getattr(key, "key", key))))
    return key.get(value)


def _plain_layer_norm(module: nn.Module | None) -> bool:
    """An nn.LayerNorm over the last dim without parameters, running torch's own forward (not a subclass's,
    e.g. one that casts to fp32) and no hooks: what `dar.merge_for_norm` and `dar.norm_of_merge` compute in its
    place. Norms with a weight or bias stay modules: an FSDP unit around one must still run its forward."""
    return (isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward
            and len(module.normalized_shape) == 1 and not any(True for _ in module.parameters())
            and not (module._forward_hooks or module._forward_pre_hooks))


def fold_norms(graph: fx.Graph, model: nn.Module) -> int:
    """Fold each plain LayerNorm (`_plain_layer_norm`) that is the only reader of a two-phase merge into
    it (`dar.merge_for_norm`, then `dar.norm_of_merge`); returns how many."""
    folded = 0
    for node in list(graph.nodes):
        if node.target is not dar.merge or len(node.users) != 1:
            continue
        norm = next(iter(node.users))
        module = model.get_submodule(norm.target) if norm.op == "call_module" else None
        if not (_plain_layer_norm(module) and norm.args == (node,) and not norm.kwargs):
            continue
        with graph.inserting_before(norm):
            merged = graph.call_function(dar.merge_for_norm, (*node.args, module.eps), dict(node.kwargs))
            fused = graph.call_function(dar.norm_of_merge, (merged, module.eps))
        norm.replace_all_uses_with(fused)
        graph.erase_node(norm)
        graph.erase_node(node)
        folded += 1
    return folded


# ---- from graph to function -------------------------------------------------------------------------------

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

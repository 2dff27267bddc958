"""DAR: residual adds become learned softmax aggregations over the history of sublayer outputs.

Sources: v_0 = the stream entering the first block, v_i = each sublayer output (the branch operand
of each residual add). Every residual add l is replaced by h = Σ_i softmax_i(q_l·RMSNorm(v_i)/√d) v_i
over the history so far, which is what flows on to the next sublayer (and, after the last block, to
the output layer: the final aggregation). Blocks are inlined into the owner graph so one graph
carries the history across blocks as plain data flow; the schedule of which sources each
aggregation sees is static and built here.

Dtypes: sources keep the dtype their sublayers give (bf16 under autocast: half the bytes each
aggregation reads and half the memory the history holds), v_0 is cast to it once, and every mix
comes out in that dtype too. A residual stream is an accumulator (x + f(x), 56 times in DiT-XL/2),
so it is kept in fp32; a mix is not: each one is made afresh from the bf16 sources, so an fp32 mix
would carry one rounding less, never a compounding one, and the LayerNorm it feeds runs in fp32
under autocast and rounds to bf16 for its Linear anyway. In bf16 the mixes halve the bytes that the
aggregations write and their backward reads, the sublayers' norms read, and the step keeps for
backward (DiT-XL/2 b256: 56 mixes of 151 MB instead of 302 MB).

Chunking (chunk=S): once S sublayer outputs have accumulated, they are replaced in the history by
their sum (the chunk summary), so a sublayer sees v_0, earlier chunks' summaries and its own chunk's
raw outputs. With static queries a chunk's shared part (v_0 and the summaries) is computed once for
its S sublayers: each shared source's logits for all later chunk queries come from one GEMM right
after the source is made (``history_logits``, filled in once the whole schedule is known), and the
chunk takes a weighted sum of its shared sources (``streamed_history``); each sublayer then merges its
own chunk's outputs in.

With routes: entering a route, every history source is gathered to the kept tokens; sources made
inside the route are scattered back at its end with zeros for the routed tokens (the branch they
skipped contributes nothing to the value, as in a plain residual network, but a zero source still
takes softmax weight — its logit is 0 whatever the query — so it dilutes those tokens' mix) — or,
for a chunk summary begun before the route, with its pre-route part; sources from before the route are restored at full size.
`static_t` adds the model's own e(t) to a zero-initialised w_l, so only `static` and `dynamic` start as
the exact uniform average.
"""

from __future__ import annotations

import functools
import operator
import os
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from .analysis import GraphReport, fake_block_inputs, slot_value, to_networkx
from .config import DAR
from .errors import ConfigError
from .kernels import dar_aggregate, dar_merge_stats, dar_prefix, dar_weighted_sum, source_logits
from .ops import gather_tokens, scatter_tokens
from .trace import TensorMeta, Trace, bind_arguments, trace

_ADDS = {operator.add, torch.add}
_SUBLAYER_FUNCS = {F.linear, torch.matmul, operator.matmul, torch.bmm, torch.einsum, F.scaled_dot_product_attention,
                   F.conv1d, F.conv2d}


def sum_sources(sources: list[torch.Tensor]) -> torch.Tensor:
    """A chunk summary: the sum of the chunk's sublayer outputs, added in fp32, kept in their dtype."""
    if len(sources) == 1:
        return sources[0]
    return functools.reduce(operator.add, [s.float() for s in sources]).to(sources[0].dtype)


def cast_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x in like's dtype and contiguous: the embedding joins the history in the sublayer outputs'
    dtype, laid out once as the kernel reads it (a patch embedding's (B, N, D) is often a transposed
    view, which every aggregation would otherwise copy, forward and backward)."""
    return x.to(like.dtype).contiguous()


def _in_dtype(sources: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [s if s.dtype == dtype else s.to(dtype) for s in sources]


def mix_history(sources: list[torch.Tensor], query: torch.Tensor, eps: float, kernel: str) -> torch.Tensor:
    """One aggregation, in the dtype the newest sublayer gives (see the module docstring)."""
    return dar_aggregate(_in_dtype(sources, sources[-1].dtype), query, eps, kernel)


def mix_history_after(sources: list[torch.Tensor], query: torch.Tensor, prefix_mix: torch.Tensor,
                      prefix_lse: torch.Tensor, eps: float, kernel: str) -> torch.Tensor:
    """One aggregation of a two-phase chunk: its own chunk's sources, continuing the shared part."""
    return dar_aggregate(_in_dtype(sources, prefix_mix.dtype), query, eps, kernel, prefix=(prefix_mix, prefix_lse))


def layer_norm_of_mix(sources: list[torch.Tensor], query: torch.Tensor, prefix_mix: torch.Tensor,
                      prefix_lse: torch.Tensor, norm_eps: float, eps: float, kernel: str) -> torch.Tensor:
    """F.layer_norm (no affine) of ``mix_history_after``: the norm that read the aggregation, folded in by
    ``fold_norms``. Where the merge kernel gives its rows' mean and 1/std (under torch.compile) the norm
    is pointwise and fuses with what follows; a LayerNorm of its own reads the stored mix twice in a
    reduction kernel (Inductor's at D=1152: ~0.35 ms a call for DiT-XL/2 b256, under 1 TB/s)."""
    merged = dar_merge_stats(_in_dtype(sources, prefix_mix.dtype), query, eps, kernel, prefix=(prefix_mix, prefix_lse),
                             norm_eps=norm_eps)
    if merged is None:
        h = mix_history_after(sources, query, prefix_mix, prefix_lse, eps, kernel)
        return F.layer_norm(h, h.shape[-1:], eps=norm_eps)
    h, stats = merged
    # in the dtype F.layer_norm would give here (under CUDA autocast fp32, else the input's), read off an
    # empty call: a trace-time constant, the call itself dead code
    dtype = F.layer_norm(h.new_empty((0, h.shape[-1])), h.shape[-1:]).dtype
    return ((h.float() - stats[..., :1]) * stats[..., 1:]).to(dtype)


def _plain_layer_norm(module: nn.Module | None) -> bool:
    """An nn.LayerNorm over the last dim without parameters, running torch's own forward (not a subclass's,
    e.g. one that casts to fp32) and no hooks: what ``layer_norm_of_mix`` computes in its place. Norms with
    a weight or bias stay modules: an FSDP unit around one must still run its forward."""
    return (isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward
            and len(module.normalized_shape) == 1 and not any(True for _ in module.parameters())
            and not (module._forward_hooks or module._forward_pre_hooks))


def fold_norms(graph: fx.Graph, model: nn.Module) -> int:
    """Fold each plain LayerNorm (``_plain_layer_norm``) that is the only reader of a two-phase merge into
    it (``layer_norm_of_mix``); returns how many."""
    folded = 0
    for node in list(graph.nodes):
        if node.target is not mix_history_after or len(node.users) != 1:
            continue
        norm = next(iter(node.users))
        module = model.get_submodule(norm.target) if norm.op == "call_module" else None
        if not (_plain_layer_norm(module) and norm.args == (node,) and not norm.kwargs):
            continue
        with graph.inserting_before(norm):
            fused = graph.call_function(layer_norm_of_mix, (*node.args, module.eps), dict(node.kwargs))
        norm.replace_all_uses_with(fused)
        graph.erase_node(norm)
        graph.erase_node(node)
        folded += 1
    return folded


def shared_history(sources: list[torch.Tensor], queries: torch.Tensor, eps: float,
                   kernel: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Phase one of a chunk: the sources all of its sublayers see (v_0 and earlier chunks'
    summaries), read once for all of the chunk's queries."""
    return dar_prefix(_in_dtype(sources, sources[-1].dtype), queries, eps, kernel)


def history_logits(v: torch.Tensor, query: torch.Tensor, points: tuple[int, ...], temb: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """One shared source's logits (B, N, F) for the F aggregations at ``points`` that will read it, from
    one GEMM when the source is made (static queries are known in advance)."""
    return source_logits(v, query[list(points)], temb, eps)


def chunk_logits(logits: tuple[torch.Tensor, ...], offsets: tuple[int, ...], k: int) -> torch.Tensor:
    """A chunk's (S, B, N, K) logits: from each shared source's logits, the K columns of this chunk."""
    return torch.stack([z[..., o:o + k] for z, o in zip(logits, offsets)])


def streamed_history(sources: list[torch.Tensor], logits: torch.Tensor, kernel: str) -> tuple[list[torch.Tensor],
                                                                                           torch.Tensor]:
    """Phase one of a chunk from its shared sources' logits: a weighted sum, each source read once."""
    return dar_weighted_sum(_in_dtype(sources, sources[-1].dtype), logits, kernel)


def timestep_queries(w: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """(K, B, 1, D) queries w_k + e(t) for a chunk's K static_t aggregations."""
    return w[:, None, None, :] + temb[None]


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _ADDS) or (node.op == "call_method" and node.target == "add")


def find_residual_adds(graph: fx.Graph, stream: fx.Node, output: fx.Node | None = None) -> list[fx.Node]:
    """The adds that carry the residual stream: skip operand = the stream so far, the other operand
    computed from it through a sublayer (a module call or a matmul-like op), same shape as the stream.

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
            if skip is not current or not isinstance(branch, fx.Node):
                continue
            if getattr(node.meta.get("rk"), "shape", None) != getattr(current.meta.get("rk"), "shape", None):
                continue
            between = nx.descendants(g, current.name) & (nx.ancestors(g, branch.name) | {branch.name})
            if any(_is_sublayer(by_name[n]) for n in between):
                adds.append(node)
                current = node
                break
    if output is not None and adds and current is not output:
        return []
    return adds


def _is_sublayer(node: fx.Node) -> bool:
    return node.op == "call_module" or (node.op == "call_function" and node.target in _SUBLAYER_FUNCS)


@dataclass
class BlockTrace:
    """A block traced on its own, with the residual adds found in it."""

    trace: Trace
    adds: list[str]  # node names in trace.graph


def trace_block(model: nn.Module, report: GraphReport, index: int, tokens: int) -> BlockTrace:
    """Trace one block on inputs of the size it will see; find its residual adds."""
    block = model.get_submodule(report.blocks[index].qualname)
    param = next(model.parameters(), None)
    args, kwargs = fake_block_inputs(report, report.blocks[index], tokens, param.device if param is not None else "cpu")
    tr = trace(block, tuple(args), kwargs)
    bound = bind_arguments(type(block).forward, tuple(args), kwargs)
    stream_name = list(bound.arguments)[report.stream_slot] if isinstance(report.stream_slot, int) else report.stream_slot
    stream = next(n for n in tr.graph.nodes if n.op == "placeholder" and n.target == stream_name)
    leaves = next(n for n in tr.graph.nodes if n.op == "output").args[0]
    out = pytree.tree_unflatten(list(leaves), tr.out_spec)
    out = out if report.stream_out_index is None else out[report.stream_out_index]
    return BlockTrace(tr, [n.name for n in find_residual_adds(tr.graph, stream, out)])


class DarState(nn.Module):
    """DAR's parameters, one query per aggregation point: the only parameters routekit adds."""

    def __init__(self, config: DAR, points: int, dim: int):
        super().__init__()
        self.config, self.points, self.dim = config, points, dim
        # zero-initialised queries: every aggregation starts as the uniform average of its history
        self.query = nn.Parameter(torch.zeros(points, dim))
        if config.query == "dynamic":
            self.dynamic = nn.Parameter(torch.zeros(points, dim, dim))

    def extra_repr(self) -> str:
        c = self.config
        return f"query={c.query!r}, chunk={c.chunk}, points={self.points}, dim={self.dim}, kernel={c.kernel!r}"


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
                item.node = self.graph.call_function(cast_like, (item.node, node))
                if item.full is not None:
                    item.full = self.graph.call_function(cast_like, (item.full, node))
            self.unified = True
        self.items.append(_Item(node, inside=self.index is not None))
        self.raw_count += 1
        if self.chunk and self.raw_count % self.chunk == 0:
            parts = self.items[-self.chunk:]
            del self.items[-self.chunk:]
            summary = self.graph.call_function(sum_sources, ([p.node for p in parts],))
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
                base = self.graph.call_function(sum_sources, (list(item.bases),))
            else:
                if zeros is None:
                    zeros = self.graph.call_function(torch.zeros_like, (self.route_stream,))
                base = zeros
            item.node = self.graph.call_function(scatter_tokens, (base, self.index, item.node))
            item.inside, item.full, item.bases = False, None, []
        self.index = self.route_stream = None


def shared_part_from_env() -> str:
    """How two-phase chunks make their shared part: "stream" (default: each shared source's logits from
    one GEMM when it is made, then a weighted sum per chunk) or "fused" (logits computed inside the
    chunk's prefix kernel), from ROUTEKIT_DAR_SHARED; for A/B measurements."""
    value = os.environ.get("ROUTEKIT_DAR_SHARED", "stream")
    if value not in ("stream", "fused"):
        raise ConfigError(f"ROUTEKIT_DAR_SHARED={value!r}: expected 'stream' or 'fused'")
    return value


def find_timestep_embedding(graph: fx.Graph, report: GraphReport, name: str | None) -> fx.Node:
    """The model's own e(t): a (B, D) node computed from a 1-D float input alone (or the named module)."""
    batch, _, dim = report.stream.shape
    nodes = list(graph.nodes)
    if name is not None:
        hits = [n for n in nodes if n.op == "call_module" and (n.target == name or n.target.startswith(name + "."))]
        hits = [n for n in hits if getattr(n.meta.get("rk"), "shape", None) == (batch, dim)]
        if not hits:
            raise ConfigError(f"DAR(timestep={name!r}): no call of that module yields a (batch, {dim}) embedding")
        return hits[-1]
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
    raise ConfigError(
        "DAR(query='static_t') needs the model's timestep embedding: no (batch, channels) value computed from a "
        "1-D float input alone was found; name the module with DAR(timestep='t_embedder')"
    )


def dar_graph(graph: fx.Graph, model: nn.Module, report: GraphReport, blocks: list[BlockTrace], config: DAR, routes,
              route_nodes: dict[int, tuple[fx.Node, fx.Node]], v0_name: str) -> dict[str, torch.Tensor]:
    """Rewrite `graph` in place: inline blocks, aggregations for residual adds. Returns new constants."""
    by_name = {n.name: n for n in graph.nodes}
    temb = find_timestep_embedding(graph, report, config.timestep) if config.query == "static_t" else None
    first = by_name[report.blocks[0].node]
    with graph.inserting_before(first):
        query = graph.get_attr("routekit.dar.query")
        dynamic = graph.get_attr("routekit.dar.dynamic") if config.query == "dynamic" else None
        if temb is not None:
            temb = graph.call_method("unsqueeze", (temb, 1))
    v0 = by_name[v0_name]
    history = _History(graph, v0, config.chunk)
    starts = {r.start: k for k, r in enumerate(routes)}
    ends = {r.end: k for k, r in enumerate(routes)}
    constants: dict[str, torch.Tensor] = {}
    point = 0
    two_phase = _two_phase_chunks(blocks, starts, ends, config)
    chunk = None  # the current two-phase chunk: (first point, its shared sources, mixes node, lses node)
    options = {"eps": config.eps, "kernel": config.kernel}
    streamed = shared_part_from_env() == "stream"
    readers: dict[fx.Node, tuple[fx.Node, list[int]]] = {}  # source -> (its logits node, the points reading it)

    def logits_for(shared: list[fx.Node], first: int, size: int) -> fx.Node:
        offsets = []
        for node in shared:
            if node not in readers:
                with graph.inserting_after(node):
                    readers[node] = graph.call_function(history_logits, (node, query, (), temb, config.eps)), []
            offsets.append(len(readers[node][1]))
            readers[node][1].extend(range(first, first + size))
        return graph.call_function(chunk_logits, (tuple(readers[n][0] for n in shared), tuple(offsets), size))

    def aggregate(v: fx.Node) -> fx.Node:
        nonlocal point, chunk
        history.append(v)
        q = graph.call_function(operator.getitem, (query, point))
        if config.query == "static_t":
            q = graph.call_function(operator.add, (q, temb))
        elif config.query == "dynamic":
            w = graph.call_function(operator.getitem, (dynamic, point))
            q = graph.call_function(F.linear, (v, w))
        if point in two_phase:  # a chunk begins: its shared sources, once for all its queries
            shared = history.sources()[:-1]
            if streamed:
                logits = logits_for(shared, point, two_phase[point])
                parts = graph.call_function(streamed_history, (shared, logits), {"kernel": config.kernel})
            else:
                queries = graph.call_function(operator.getitem, (query, slice(point, point + two_phase[point])))
                if config.query == "static_t":
                    queries = graph.call_function(timestep_queries, (queries, temb))
                parts = graph.call_function(shared_history, (shared, queries), options)
            chunk = (point, shared, *(graph.call_function(operator.getitem, (parts, i)) for i in (0, 1)))
        point += 1
        sources = history.sources()
        if chunk is None or point > chunk[0] + two_phase[chunk[0]]:
            return graph.call_function(mix_history, (sources, q), options)
        first, shared, mixes, lses = chunk
        if sources[:len(shared)] != shared:  # _two_phase_chunks admits no route boundary inside a chunk
            raise RuntimeError(f"routekit bug: the shared sources of the chunk at point {first} changed inside it")
        mix, lse = (graph.call_function(operator.getitem, (part, point - 1 - first)) for part in (mixes, lses))
        return graph.call_function(mix_history_after, (sources[len(shared):], q, mix, lse), options)

    for i, info in enumerate(report.blocks):
        call = by_name[info.node]
        if i in starts:
            index, _ = route_nodes[starts[i]]
            with graph.inserting_before(call):
                history.enter(index, index.args[0])
        bt = blocks[i]
        if bt.adds:
            forward = type(model.get_submodule(info.qualname)).forward
            env = _inline(graph, call, bt.trace, info.qualname, forward, constants)
            for add_name in bt.adds:
                add = env[add_name]
                skip, branch = add.args[0], add.args[1]
                if not _descends(branch, skip):
                    skip, branch = branch, skip
                with graph.inserting_before(add.next):
                    h = aggregate(branch)
                add.replace_all_uses_with(h)
                graph.erase_node(add)
        else:  # adds hidden inside the block: one source per block, v = output - input
            out = by_name[info.stream_out]
            stream_in = slot_value(call, report.stream_slot)
            with graph.inserting_before(out.next):
                v = graph.call_function(operator.sub, (out, stream_in))
                h = aggregate(v)
            out.replace_all_uses_with(h, delete_user_cb=lambda user, v=v: user is not v)
        if i in ends:
            _, scatter = route_nodes[ends[i]]
            with graph.inserting_before(scatter.next):
                history.exit()
    for node, (logits, points) in readers.items():  # every reader is known now
        logits.args = (node, query, tuple(points), temb, config.eps)
    fold_norms(graph, model)
    graph.lint()
    return constants


def _two_phase_chunks(blocks: list[BlockTrace], starts: dict, ends: dict, config: DAR) -> dict[int, int]:
    """{first point: points} of the chunks computed in two phases: static queries (known before the
    chunk runs), chunks of two or more points, and no route boundary inside the chunk (its shared
    sources must keep their tokens throughout)."""
    if config.query == "dynamic" or (config.chunk or 0) < 2:
        return {}
    first = [0]
    for bt in blocks:
        first.append(first[-1] + (len(bt.adds) or 1))
    total = first[-1]
    boundaries = {first[i] for i in starts} | {first[i + 1] for i in ends}
    chunks = {}
    for p in range(0, total, config.chunk):
        size = min(config.chunk, total - p)
        if size >= 2 and not any(b in boundaries for b in range(p + 1, p + size)):
            chunks[p] = size
    return chunks


def _descends(node: fx.Node, ancestor: fx.Node) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is ancestor:
            return True
        if n.name in seen:
            continue
        seen.add(n.name)
        stack.extend(n.all_input_nodes)
    return False


def _inline(graph: fx.Graph, call: fx.Node, tr: Trace, qualname: str, forward, constants: dict) -> dict[str, fx.Node]:
    """Replace the call of a block by the block's own traced nodes; returns block-node-name → new node."""
    module_args = bind_arguments(forward, call.args, call.kwargs)
    env: dict[fx.Node, fx.Node] = {}
    names: dict[str, fx.Node] = {}
    outputs = None
    with graph.inserting_before(call):
        for node in tr.graph.nodes:
            if node.op == "placeholder":
                env[node] = module_args.arguments[node.target]
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


def residual_plan(model: nn.Module, report: GraphReport, routes) -> tuple[list[BlockTrace], int]:
    """Trace every block at the token count it will see; record its residual adds; count aggregation points.

    Granularity: "sublayer" when every block's adds were found, "block" when none were (each block is
    one source, v = output - input), "mixed" otherwise.
    """
    from .keep import kept_tokens

    kept = {i: kept_tokens(r, report.tokens, report.grid) for r in routes for i in range(r.start, r.end + 1)}
    blocks = [trace_block(model, report, i, kept.get(i, report.tokens)) for i in range(report.depth)]
    found = [bool(b.adds) for b in blocks]
    report.residual_granularity = "sublayer" if all(found) else "block" if not any(found) else "mixed"
    report.residual_adds = {i: b.adds for i, b in enumerate(blocks)}
    return blocks, sum(len(b.adds) or 1 for b in blocks)

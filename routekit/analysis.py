"""What a model is made of: the chain of block stacks the token stream passes through, and the report of it.

The graph (a traced owner forward, or a recording of block calls) becomes a networkx DiGraph. The
block stack is the longest chain of calls to members of one ModuleList/Sequential in which each
block's stream output feeds the next block's stream input. The token stream is the
(batch, tokens, channels) tensor flowing block to block; a model may chain several stacks (Flux).

`analyse` finds the stacks and their blocks here and hands each other question to the module that answers
it: what each block's other inputs are (sides.py), which tokens were made from the image and on what grid
(tokens.py), and with `residual=True` each block traced alone (probe.py), its residual adds found
(residuals.py, what DAR rewrites) and the model's timestep embedding e(t) (DAR's static_t queries). It
returns a frozen `GraphReport` (findings.py): every fact is settled when it is made, nobody writes into it.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Literal

import networkx as nx
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .calls import parameter_names
from .errors import AnalysisError, RoutekitError
from .findings import AuxRead, BlockInfo, GraphReport, Stack
from .flow import OUTPUT, UNREAD
from .graphs import Slot, between, meta_of, reads_kind, slot_value, slots, to_networkx
from .guards import hooked
from .probe import block_flow, token_offset, trace_block
from .record import Image
from .residuals import plain_layer, timestep_embeddings, without_residual
from .sides import image_tables, joint_order, resolved, side_input
from .state import is_compiled
from .tokens import first_stack, join_offset, joined_stack
from .trace import Trace
from .values import TensorMeta


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
    """Maximal runs of consecutive calls linked through one consistent (slot, output index), each block handing
    on the stream in the shape it took it (`_steady`)."""
    run, link = [calls[0]], None
    for prev, nxt in zip(calls, calls[1:]):
        this = _link(prev, nxt)
        if this is not None and (link is None or this == link):
            run.append(nxt)
            link = this
        else:
            yield from _steady(run, link)
            run, link = [nxt], None
    yield from _steady(run, link)


def _steady(run: list[fx.Node], link: tuple | None):
    """`run` split around the blocks that change the stream's shape (Hiera's pooling blocks, which start its
    stages with fewer tokens and more channels): a route's blocks all see one stream, and its scatter puts their
    output back in the stream it cut."""
    if link is None:
        yield run, link
        return
    piece = []
    for node in run:
        inp = getattr(slot_value(node, link[0]), "meta", {}).get("rk")
        out = node.meta.get("rk")
        out = out[link[1]] if link[1] is not None and isinstance(out, (tuple, list)) else out
        if isinstance(inp, TensorMeta) and isinstance(out, TensorMeta) and inp.shape != out.shape:
            if piece:
                yield piece, link
            yield [node], None
            piece = []
        else:
            piece.append(node)
    if piece:
        yield piece, link if len(piece) > 1 else None


def _single_blocks(calls: dict[str, list[fx.Node]], chains: dict, model: nn.Module) -> dict:
    """Containers called once whose block hands its stream to the next container's first block, as chains of one
    (diffusers' tiny Flux: one double-stream block, then one single-stream block): {container: ([call], link)}.

    One call shows no link of its own; the next container's first block shows which output it reads and in which
    slot. The block's own stream slot is its parameter of that slot's name (the blocks of a chain of stacks name
    their stream alike), else the one input shaped like that output; a last block of one hands on, of its
    outputs, the one shaped like its stream input (the earlier block's index where several are)."""
    if not calls:
        return {}
    graph_order = {n: i for i, n in enumerate(next(iter(calls.values()))[0].graph.nodes)}
    firsts = sorted(((parent, nodes[0]) for parent, nodes in calls.items() if parent in chains or len(nodes) == 1
                     and not plain_layer(model.get_submodule(nodes[0].target))), key=lambda item: graph_order[item[1]])
    found: dict = {}
    for (a, node), (b, nxt) in zip(firsts, firsts[1:]):
        link = _link(node, nxt)
        if link is None or a in chains:
            continue
        out = node.meta.get("rk")
        out = out[link[1]] if link[1] is not None and isinstance(out, (tuple, list)) else out
        names = parameter_names(model.get_submodule(node.target))
        wanted = parameter_names(model.get_submodule(nxt.target)).get(link[0], link[0])
        own = [s for s, _ in slots(node) if (names.get(s, s) if isinstance(s, int) else s) == wanted] or [
            s for s, a in slots(node) if isinstance(a, fx.Node) and a.meta.get("rk") == out]
        if len(own) != 1:
            continue
        found[a] = ([node], (own[0], link[1]))
        if b not in chains and b not in found:
            into = slot_value(nxt, link[0]).meta.get("rk")
            outs = nxt.meta.get("rk")
            index = None
            if isinstance(outs, (tuple, list)):
                shaped = [i for i, o in enumerate(outs) if o == into]
                index = link[1] if link[1] in shaped else shaped[0] if len(shaped) == 1 else None
                if index is None:
                    continue
            found[b] = ([nxt], (link[0], index))
    return found


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
        link = _link(prev, nxt)
        if not link:
            return f"{nxt.target} does not read {prev.target}'s output"
        inp = getattr(slot_value(prev, link[0]), "meta", {}).get("rk")
        out = prev.meta.get("rk")
        out = out[link[1]] if link[1] is not None and isinstance(out, (tuple, list)) else out
        if isinstance(inp, TensorMeta) and isinstance(out, TensorMeta) and inp.shape != out.shape:
            return (f"{prev.target} changes the stream's shape ({inp} → {out}), as a stage "
                    "does, and no two members in a row keep it: a stack is a run of blocks that hand on the stream "
                    "as they took it")
    return "its members are not called one after another"


def _inside_a_member(stack: str, calls: dict[str, list[fx.Node]]) -> str | None:
    """Why a container never shows in the trace: it runs inside a member of another container (Swin's
    `layers.1.blocks` inside stage `layers.1`), and the trace calls members whole, never tracing into them."""
    member = next((n.target for nodes in calls.values() for n in nodes
                   if stack == n.target or stack.startswith(f"{n.target}.")), None)
    if member is None:
        return None
    where = "it is" if member == stack else f"it runs inside {member}, which is"
    return (f"{where} called whole, as one member of {member.rsplit('.', 1)[0] or '<root>'}: routekit routes the "
            "blocks of an outermost container")


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
    chains, layers = {}, {}
    for parent, nodes in calls.items():
        best = max(_chains(nodes), key=lambda rl: len(rl[0]))
        # a FeedForward's list of torch layers (GlmImage's prior projector, run on a side input) chains like
        # blocks but is no stack to route
        layer = next((m for n in best[0] if plain_layer(m := model.get_submodule(n.target))), None)
        if len(best[0]) >= 2 and layer is not None:
            layers[parent] = f"{parent}'s members include torch's own {type(layer).__name__}: layers, not blocks"
        elif len(best[0]) >= 2:
            chains[parent] = best
    chains.update(_single_blocks(calls, chains, model))
    if stack is not None:
        if not isinstance(stack, str) or stack not in chains:
            named = isinstance(stack, str)
            why = named and (layers.get(stack) or (_unchained(calls[stack]) if len(calls.get(stack, ())) >= 2 else None)
                             or _inside_a_member(stack, calls))
            raise AnalysisError(
                f"stack {stack!r} is not a chain of blocks in {type(model).__name__}"
                + (f" ({why})" if why else "")
                + f"; chains found: {_listing({k: len(v[0]) for k, v in chains.items()}) or 'none'}"
            )
        chosen = stack
    elif not chains:
        why = "".join(f"; {layers.get(k) or _unchained(nodes)}" for k, nodes in calls.items() if len(nodes) >= 2)
        raise AnalysisError(
            f"no block stack found in {type(model).__name__}: routekit looks for a ModuleList/Sequential "
            "whose members are called one after another, each feeding its output to the next. Containers "
            f"called in the traced forward: {_listing({k: len(v) for k, v in calls.items()}) or 'none'}{why}"
        )
    else:
        token_chains = [k for k in chains if _carries_stream(*chains[k])]
        chosen = max(token_chains or chains, key=lambda k: len(chains[k][0]))
        broken = [k for k in token_chains if len(calls[k]) > len(chains[chosen][0]) > len(chains[k][0])]
        if broken:  # a longer stack cut into pieces by the owner's code: the longest piece may be a side branch
            k = max(broken, key=lambda k: len(calls[k]))
            raise AnalysisError(
                f"the longest block chain in {type(model).__name__} is {chosen} ({len(chains[chosen][0])} blocks), but "
                f"{k} has {len(calls[k])} blocks that chain only {len(chains[k][0])} at a time: {_unchained(calls[k])}. "
                f"{chosen} may be a side branch (a control network's blocks beside the model's own); pass "
                f"stack={chosen!r} to route it, or stack={k!r} to route one of {k}'s chained runs")
    return chosen, chains


def analyse(tr: Trace, model: nn.Module, *, stack: str | None = None, mode: Literal["graph", "boundary"] = "graph",
            fallback: str | None = None, images: list[Image] | None = None, call: tuple[tuple, dict] | None = None,
            residual: bool = False) -> GraphReport:
    """The report of `tr` (a trace, or with `images` a recording); AnalysisError says what is missing.

    The blocks are those of the chain of stacks the stream passes through (`_chain`), or of `stack` alone.
    `call`: the call traced, to measure what the graph does not show (special tokens of a recording, a grid no
    patch embedding shows, the grid's order).
    `residual`: also trace each block alone and find its residual adds, and (graph mode) the model's e(t).
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
    batch = _call_batch(tr.graph)
    for k, name in enumerate(names):
        nodes, (slot, out_index) = chains[name]
        first_in = slot_value(nodes[0], slot)
        stream = first_in.meta["rk"] if isinstance(first_in, fx.Node) else None
        if not isinstance(stream, TensorMeta) or len(stream.shape) != 3:
            raise AnalysisError(
                f"the stream into {nodes[0].target} is {stream!r}; routekit routes a (batch, tokens, channels) "
                "stream between blocks"
            )
        if batch is not None and stream.shape[0] != batch and stream.shape[1] == batch:
            raise AnalysisError(
                f"the stream into {nodes[0].target} is {stream!r}, with the batch ({batch}, as the model's inputs "
                "have it) on its second axis: the blocks run sequence-first, (tokens, batch, channels). routekit "
                "routes a (batch, tokens, channels) stream; here it would set whole samples aside, not tokens"
            )
        these = _blocks(model, nodes, slot, out_index, stream, first=len(blocks), stack=k)
        these = _with_escapes(these, by_name, stream.shape[1], _next_stream_in(chains, names, k))
        if k == 0:
            info = first_stack(tr, model, chains, name, these, stream, images, call)
        else:
            info = joined_stack(tr.graph, chains, names[k - 1], name, stacks[-1], stream, measure)
        stacks.append(Stack(name, len(blocks), len(these), slot, out_index, stream, **info))
        blocks.extend(these)
    decided: dict = {}
    blocks = [image_tables(model, b, stacks[b.stack].stream_slot, stacks[b.stack].stream, stacks[b.stack].special,
                           stacks[b.stack].grid[-1] if stacks[b.stack].grid else 1, decided) for b in blocks]
    blocks = [resolved(model, b, stacks[b.stack].stream_slot, stacks[b.stack].stream, _fewer(stacks[b.stack]),
                       decided) for b in blocks]
    granularity, timestep, embeddings = None, None, ()
    if residual:
        blocks, granularity = _with_residual_adds(model, blocks, stacks)
        if mode == "graph":  # e(t), for DAR's static_t queries: read off the owner's graph, so the plan needs none
            timestep, embeddings = timestep_embeddings(tr.graph, stacks[0].stream.shape[0], stacks[0].stream.shape[2])
    return GraphReport(
        model=type(model).__name__, mode=mode, stacks=tuple(stacks), blocks=tuple(blocks), candidates=
        {k: len(v[0]) for k, v in chains.items()}, leafed=dict(tr.leafed), specialised=tuple(tr.specialised),
        requested=stack, fallback=fallback, residual=granularity, timestep=timestep, embeddings=embeddings,
    )


def _call_batch(graph: fx.Graph) -> int | None:
    """The batch of the call: the first axis most of the model's tensor inputs share (latents, timesteps,
    captions), the first input's where they tie; None without tensor inputs."""
    firsts = [m.shape[0] for n in graph.nodes if n.op == "placeholder"
              and isinstance(m := n.meta.get("rk"), TensorMeta) and m.shape]
    return max(dict.fromkeys(firsts), key=firsts.count) if firsts else None


def _fewer(stack: Stack) -> int:
    """A token count to probe blocks with: a whole grid row fewer (blocks that reshape to rows still run)."""
    return stack.tokens - (stack.grid[-1] if stack.grid else 1)


def _blocks(model: nn.Module, nodes: list[fx.Node], slot: Slot, out_index: int | None, stream: TensorMeta,
            first: int, stack: int) -> list[BlockInfo]:
    """The blocks of one stack, numbered from `first` in the chain, their side inputs classified."""
    batch, tokens, channels = stream.shape
    blocks, flows = [], {}
    for i, node in enumerate(nodes):
        out = node if out_index is None else next(
            (u for u in node.users if u.target is operator.getitem and u.args[1] == out_index), node)
        module = model.get_submodule(node.target)
        arguments = [(s, a) for s, a in slots(node) if s != slot]
        sequences = {m.shape[1] for _, a in arguments for m in pytree.tree_leaves(meta_of(a))
                     if isinstance(m, TensorMeta) and len(m.shape) >= 3 and m.shape[0] == batch
                     and m.shape[1] != tokens}
        tied = block_flow(model, node.target, {s: meta_of(a) for s, a in slots(node)}, slot, cache=flows)
        classified = [side_input(s, a, parameter_names(module), batch, tokens, channels, sequences,
                                 None if tied is None else {p: t for (s2, p), t in tied.items() if s2 == s})
                      for s, a in arguments]
        outputs = None if tied is None else tuple(p for (s2, p), t in tied.items() if s2 == OUTPUT and t is not UNREAD)
        handed_on = () if tied is None else tuple((p, t.source) for (s2, p), t in tied.items()
                                                  if s2 == OUTPUT and t is not UNREAD and t.source is not None)
        info = BlockInfo(first + i, node.target, type(module).__name__, node.name, out.name,
                         tuple(c[0] for c in classified), checkpointed="checkpoint" in node.meta, stack=stack,
                         compiled=is_compiled(module), flow=tied is not None, per_token_outputs=outputs,
                         handed_on=handed_on)
        blocks.append(joint_order(model, info, {c[0].slot: c[1] for c in classified}, slot, stream))
    return blocks


def _chain(graph: fx.Graph, chains: dict, chosen: str, measure=None) -> list[str]:
    """The stacks the stream passes through in order, around `chosen`: each next one's stream holds the previous
    one's output tokens in order, joined with others or not (`join_offset`)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    carrying = sorted((k for k in chains if _carries_stream(*chains[k])), key=lambda k: order[chains[k][0][0]])
    if chosen not in carrying:
        return [chosen]

    def joined(a: str, b: str) -> bool:
        if order[chains[a][0][-1]] >= order[chains[b][0][0]]:
            return False
        try:
            join_offset(graph, chains, a, b, measure)
        except AnalysisError:
            return False
        return True

    # where several stacks join into the next (Flux3's noisy latent and its reference image, each through stacks of
    # its own), the chain goes on through the one whose stream the image made, the model's first tensor input;
    # the last to join where the graph does not show it (a recording)
    image = None if measure is not None else next(
        (n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("rk"), TensorMeta)), None)

    def made(candidates: list[str]) -> list[str]:
        """Those of `candidates` whose stream the image made (asked only where there is a choice)."""
        if image is None or len(candidates) < 2:
            return []
        flow = to_networkx(graph)
        ins = [slot_value(chains[a][0][0], chains[a][1][0]) for a in candidates]
        return [a for a, i in zip(candidates, ins)
                if isinstance(i, fx.Node) and (i is image or image.name in nx.ancestors(flow, i.name))]

    names = [chosen]
    while True:
        before = [a for a in carrying if a not in names and joined(a, names[0])]
        if not before:
            break
        names.insert(0, (made(before) or before)[-1])
    while True:
        after = [b for b in carrying if b not in names and joined(names[-1], b)]
        if not after:
            break
        names.append(after[0])
    return names


def _next_stream_in(chains: dict, names: list[str], k: int) -> tuple[fx.Node, fx.Node] | None:
    """(the stream entering the stack after the k-th of the chain, that stack's first block): where the k-th's
    last block's output goes."""
    if k + 1 >= len(names):
        return None
    nodes, (slot, _) = chains[names[k + 1]]
    return slot_value(nodes[0], slot), nodes[0]


def _per_token_output(block: BlockInfo, item: fx.Node, tokens: int) -> bool:
    """Whether a block's output `item` (a getitem of its call) holds the stream's tokens: as the block's data flow
    ties its axes (a joint block's text output holds the text's, however many), else where its second axis is as
    long as the stream."""
    if block.per_token_outputs is not None and item.op == "call_function" and item.target is operator.getitem:
        return (item.args[1],) in block.per_token_outputs
    meta = item.meta.get("rk")
    return isinstance(meta, TensorMeta) and len(meta.shape) >= 2 and meta.shape[1] == tokens


def _with_escapes(blocks: list[BlockInfo], by_name: dict[str, fx.Node], tokens: int,
                  next_in: tuple[fx.Node, fx.Node] | None = None) -> list[BlockInfo]:
    """Record per-token values that leave a block other than along the chain.

    `escapes`: the stream output used by something besides the next block (a route may end at such
    a block but not pass through it); the last block's output, where another stack follows (`next_in` is its
    stream), may go only to the owner code that makes that stream. `aux_escapes`: the reads of the block's other
    per-token outputs, anywhere (the plan tells which a route can carry).
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
            escapes = tuple(f"{out.name} → {_named(u)}" for u in out.users if u is not nxt and not reads_kind(u))
        elif next_in is not None:
            escapes = tuple(f"{out.name} → {_named(u)}" for u in out.users if u not in joining and not reads_kind(u))
        else:
            escapes = ()
        aux = tuple(AuxRead(a.name, (a.args[1],) if a.target is operator.getitem else (), u.name)
                    for a in node.users if a is not out and out is not node
                    and _per_token_output(block, a, tokens) for u in a.users)
        result.append(replace(block, escapes=escapes, aux_escapes=aux))
    return result


def _named(node: fx.Node) -> str:
    """A node as a user reads it: a module call by the module's path (`blocks.4`), anything else by its name."""
    return node.target if node.op == "call_module" else node.name


def _with_residual_adds(model: nn.Module, blocks: list[BlockInfo], stacks: list[Stack]) -> tuple[list[BlockInfo], str]:
    """Each block traced alone with its residual adds, and the
    granularity: "sublayer" when every block's adds were found, "block" when none were (each block is one source,
    v = output - input), "mixed" otherwise; or why the blocks could not be traced. A block with hooks stays one
    call (its adds hidden), so its hooks run."""
    try:
        traced = [trace_block(model, b, stacks[b.stack].stream_slot, stacks[b.stack].stream,
                              stacks[b.stack].stream_out_index, stacks[b.stack].tokens)[:2] for b in blocks]
    except RoutekitError as err:
        return blocks, f"unknown ({err})"
    traced = [(tr, () if hooked(model.get_submodule(b.qualname)) else adds) for b, (tr, adds) in zip(blocks, traced)]
    found = [bool(adds) for _, adds in traced]
    granularity = "sublayer" if all(found) else "block" if not any(found) else "mixed"
    blocks = [replace(b, adds=adds, body=tr) for b, (tr, adds) in zip(blocks, traced)]
    return [replace(b, residual_free=without_residual(model, b)) for b in blocks], granularity

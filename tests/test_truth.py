"""routekit held to ground truth it did not derive: the zoo's declarations (tests/truth.py, read off each model's
code) and a route made by hand, with hooks, from those declarations alone.

For each declared model: routekit's decisions (its stacks, their special tokens, and which arguments of the
routed blocks it cuts, where and along which axes) equal the declarations; and a routed training forward, some
tokens force-kept, equals the same route made by hand on a copy of the model: a pre-hook on block `start` takes the
stream at the kept positions routekit chose, pre-hooks on the route's blocks cut the declared per-token inputs
there, a forward hook on block `end` puts the routed-around tokens back with their value at the route start.
Then the same at sizes Hypothesis chooses to collide: a caption as long as the image's tokens, a grid side, the
frames, the heads, the head size or the channels; a batch as large as the tokens; tokens as many as the
channels; and a later call of the routed model at such a shape, where the example's did not collide.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from truth import TRUTHS, Sizes, Stack, Truth  # noqa: E402
from zoo import Missing  # noqa: E402

import routekit as rk  # noqa: E402
from routekit.model import routing_of  # noqa: E402

# ---- routekit's decisions: the one adapter to its internals -------------------------------------------------------


@dataclass(frozen=True)
class Decisions:
    """What a route does to a model's call, as comparable data: the chain's stacks, each stack's special positions
    (sorted, non-negative), per routed block (by qualified name) the tensors it cuts as (argument, path, axes) and
    the grid sizes it shrinks as (argument, path, grid axis), and whether the route selects once for the batch."""

    stacks: tuple[str, ...]
    special: tuple[tuple[int, ...], ...]
    per_token: dict[str, frozenset]
    grid: dict[str, frozenset]
    shared: bool


def decisions(routed: nn.Module, args: tuple, kwargs: dict) -> Decisions:
    """routekit's decisions for this call of `routed` (in graph mode the plan its program for this call holds,
    specialised where the call's shapes differ from the example's). The one place that reads routekit's internals:
    update it, not the tests, when they move."""
    from routekit.model import report_of

    plan = report_of(routed)
    executor = routing_of(routed).executor
    if hasattr(executor, "program"):  # graph mode: one program per call signature (and shapes)
        was = routed.training
        routed.train()
        plan = executor.program(routed, args, kwargs)[1].plan
        routed.train(was)
    report, placed = plan.report, plan.placed[0]
    blocks = report.blocks[placed.start:placed.end + 1]
    return Decisions(
        stacks=tuple(s.name for s in report.stacks),
        special=tuple(tuple(sorted(p % s.tokens for p in s.special)) for s in report.stacks),
        per_token={b.qualname: frozenset((s.argument, tuple(g.path), tuple(g.axes)) for s in b.side_inputs
                                         for g in s.tokens) for b in blocks},
        grid={b.qualname: frozenset((s.argument, tuple(path), axis % len(report.stack_of(b.index).grid))
                                    for s in b.side_inputs for path, axis in s.grid) for b in blocks},
        shared=placed.shared)


def difference(got: Decisions, want: Decisions) -> str:
    """Where routekit's decisions depart from the declarations, in a line or a few: per-token inputs it cuts that
    the code passes whole, ones it passes whole that the code reads per token (blocks alike merged)."""
    lines = [f"{field}: routekit {getattr(got, field)}, declared {getattr(want, field)}"
             for field in ("stacks", "special", "shared") if getattr(got, field) != getattr(want, field)]
    for field, what in (("per_token", "cut"), ("grid", "shrunk")):
        changes: dict[tuple, list[str]] = {}
        for block in sorted(set(getattr(got, field)) | set(getattr(want, field))):
            g, w = getattr(got, field).get(block, frozenset()), getattr(want, field).get(block, frozenset())
            key = (tuple(sorted(g - w, key=repr)), tuple(sorted(w - g, key=repr)))
            if any(key):
                changes.setdefault(key, []).append(block)
        for (extra, missing), blocks in changes.items():
            where = blocks[0] if len(blocks) == 1 else f"{blocks[0]} … {blocks[-1]}"
            if extra:
                lines.append(f"{where}: routekit {what} {list(extra)}, which the code does not read per token")
            if missing:
                lines.append(f"{where}: routekit left whole {list(missing)}, which the code reads per token")
    return "routekit's decisions are not the declared ones: " + "; ".join(lines)


# ---- the declarations' side -------------------------------------------------------------------------------------


def chain(model: nn.Module, truth: Truth) -> list[tuple[int, str]]:
    """Every block of the declared stacks, in order: (stack index, qualified name)."""
    return [(k, f"{stack.name}.{name}") for k, stack in enumerate(truth.stacks)
            for name, _ in model.get_submodule(stack.name).named_children()]


def route_of(model: nn.Module, truth: Truth) -> tuple[int, int]:
    depth = len(chain(model, truth))
    return tuple(i % depth for i in truth.route)


def declared(model: nn.Module, truth: Truth, s: Sizes, present: dict[str, set]) -> Decisions:
    """The declarations as routekit's decisions would say them, for the routed blocks; a per-token input counts
    where the call gave the block a tensor there (`present`: per block, the (argument, path) that were)."""
    blocks = chain(model, truth)
    start, end = route_of(model, truth)
    per_token, grid = {}, {}
    for k, name in blocks[start:end + 1]:
        stack = truth.stacks[k]
        per_token[name] = frozenset((p.argument, p.path, p.axes) for p in stack.per_token
                                    if (p.argument, p.path) in present[name])
        grid[name] = frozenset((argument, (), axis) for argument, axis in stack.grid)
    return Decisions(tuple(stack.name for stack in truth.stacks),
                     tuple(tuple(sorted(stack.special(s))) for stack in truth.stacks), per_token, grid,
                     shared(model, truth))


def shared(model: nn.Module, truth: Truth) -> bool:
    """Whether the route must select once for the whole batch: a routed block takes a per-token table without a
    batch axis (every such block in the zoo broadcasts its table against the batch, so a table per sample breaks
    it or, where batch and heads agree, mixes the samples)."""
    blocks = chain(model, truth)
    start, end = route_of(model, truth)
    return any(not p.batched for k in {k for k, _ in blocks[start:end + 1]} for p in truth.stacks[k].per_token)


def passed(model: nn.Module, truth: Truth, args: tuple, kwargs: dict) -> dict[str, set]:
    """Per routed block, the (argument, path) of the declared per-token inputs this call passes as tensors (an
    attention mask is None where attention is causal alone, or full): one forward of the unrouted model."""
    blocks = chain(model, truth)
    start, end = route_of(model, truth)
    found: dict[str, set] = {}

    def record(k: int, name: str):
        def hook(block, a, kw):
            found[name] = set()
            for p in truth.stacks[k].per_token:
                at = where(block, a, kw, p.argument)
                value = None if at is None else (a if at[0] == "args" else kw)[at[1]]
                if at is not None and isinstance(get(value, p.path), torch.Tensor):
                    found[name].add((p.argument, p.path))
        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(record(k, name), with_kwargs=True)
               for k, name in blocks[start:end + 1]]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return found


# ---- the route by hand ------------------------------------------------------------------------------------------


def where(block: nn.Module, args: tuple, kwargs: dict, name: str):
    """Where argument `name` of a block call sits: ("args", i), ("kwargs", name), or None where not passed."""
    if name in kwargs:
        return "kwargs", name
    params = list(inspect.signature(block.forward).parameters.values())
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY):
            break
        if p.name == name:
            return ("args", i) if i < len(args) else None
    return None


def get(value, path: tuple):
    for key in path:
        value = value[key]
    return value


def put(value, path: tuple, leaf):
    """`value` with the leaf at `path` replaced (tuples and lists rebuilt, dicts copied)."""
    if not path:
        return leaf
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: put(value[head], rest, leaf)}
    items = list(value)
    items[head] = put(items[head], rest, leaf)
    return type(value)(items)


def take(x: torch.Tensor, axis: int, index: torch.Tensor, batched: bool) -> torch.Tensor:
    """x at the positions `index` (B, K) along `axis`, sample by sample (a table without a batch axis: the one
    selection all samples share)."""
    if not batched:
        assert (index == index[0]).all(), "a table without a batch axis, but the samples kept different tokens"
        return x.index_select(axis, index[0])
    x = x.expand(index.shape[0], *x.shape[1:]) if x.shape[0] == 1 else x
    return torch.stack([x[b].index_select(axis - 1, index[b]) for b in range(index.shape[0])])


def cut(x: torch.Tensor, p, index: torch.Tensor, tokens: int) -> torch.Tensor:
    """A declared per-token tensor at the kept positions `index` of a stream of `tokens`, as its layout says."""
    for axis in p.axes:
        rows = x.shape[axis]
        if p.layout == "stream":
            assert rows == tokens, f"{p.argument}{list(p.path)}: {rows} rows along axis {axis}, the stream {tokens}"
            at = index
        elif p.layout == "image":  # the stream's last `rows` tokens; the ones before, special, are all kept
            lead = tokens - rows
            assert 0 < rows < tokens and (index[:, :lead] == torch.arange(lead)).all(), (p, rows, tokens)
            at = index[:, lead:] - lead
        else:  # joined with another sequence of `rest` rows, all kept
            rest = rows - tokens
            assert rest > 0, f"{p.argument}{list(p.path)}: {rows} rows, the stream {tokens}"
            other = torch.arange(rest).expand(index.shape[0], rest)
            at = torch.cat([other, index + rest] if p.layout == "text first" else [index, other + tokens], dim=1)
        x = take(x, axis, at, p.batched)
    return x


def lines(index: torch.Tensor, lead: int, grid: tuple[int, ...], axis: int) -> int:
    """How many lines of the grid along `axis` the kept image tokens (after `lead` special ones) touch: the kept
    grid's size there, one count for the batch."""
    cells = index[:, lead:] - lead
    stride = 1
    for size in grid[axis + 1:]:
        stride *= size
    counts = {len(torch.unique((row // stride) % grid[axis])) for row in cells}
    assert len(counts) == 1, f"samples keep grids of different sizes along axis {axis}: {counts}"
    return counts.pop()


def by_hand(model: nn.Module, truth: Truth, s: Sizes, kept: torch.Tensor, args: tuple, kwargs: dict):
    """The model's training forward with the declared route placed by hooks: the first stack's stream kept at
    `kept` (B, K), sorted."""
    blocks = chain(model, truth)
    start, end = route_of(model, truth)
    first = blocks[start][0]
    index = {first: kept}
    offset = {first: 0}  # where the first stack's tokens sit in each later stack's stream
    for k in range(first + 1, blocks[end][0] + 1):
        stack, inner = truth.stacks[k], truth.stacks[k - 1].tokens(s)
        joined, tokens = stack.joined(s), stack.tokens(s)
        batch = kept.shape[0]
        index[k] = torch.cat([torch.arange(joined).expand(batch, joined), index[k - 1] + joined,
                              torch.arange(joined + inner, tokens).expand(batch, tokens - joined - inner)], dim=1)
        offset[k] = offset[k - 1] + joined
    saved: dict[str, torch.Tensor] = {}

    def before(k: int, name: str, is_start: bool):
        stack: Stack = truth.stacks[k]

        def hook(block, a, kw):
            a, kw = list(a), dict(kw)
            values = {"args": a, "kwargs": kw}
            if is_start:
                at = where(block, a, kw, stack.stream)
                saved["stream"] = values[at[0]][at[1]]
                assert saved["stream"].shape[1] == stack.tokens(s), "the declared stream length is not the call's"
                values[at[0]][at[1]] = take(saved["stream"], 1, index[k], True)
            for p in stack.per_token:
                at = where(block, a, kw, p.argument)
                if at is None or not isinstance(get(values[at[0]][at[1]], p.path), torch.Tensor):
                    continue
                leaf = cut(get(values[at[0]][at[1]], p.path), p, index[k], stack.tokens(s))
                values[at[0]][at[1]] = put(values[at[0]][at[1]], p.path, leaf)
            for argument, axis in stack.grid:
                at = where(block, a, kw, argument)
                lead = len(stack.special(s))
                values[at[0]][at[1]] = lines(index[k], lead, truth.grid(s), axis)
            return tuple(a), kw
        return hook

    def after(k: int):
        stack: Stack = truth.stacks[k]

        def hook(block, a, kw, out):
            stream = out if stack.out is None else out[stack.out]
            full = stream.new_zeros(stream.shape[0], stack.tokens(s), *stream.shape[2:])
            full[:, offset[k]:offset[k] + saved["stream"].shape[1]] = saved["stream"]
            full = full.scatter(1, index[k].reshape(*index[k].shape, *[1] * (stream.dim() - 2)).expand(stream.shape),
                                stream)
            return full if stack.out is None else put(out, (stack.out,), full)
        return hook

    handles = []
    for i in range(start, end + 1):
        k, name = blocks[i]
        block = model.get_submodule(name)
        handles.append(block.register_forward_pre_hook(before(k, name, i == start), with_kwargs=True))
        if i == end:
            handles.append(block.register_forward_hook(after(k), with_kwargs=True))
    try:
        return model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


def tensors(out) -> list[torch.Tensor]:
    """Every tensor of a model's output (tuples, lists, and dict-like outputs: diffusers' and transformers')."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    return []


# ---- one case ---------------------------------------------------------------------------------------------------


def build(truth: Truth, s: Sizes):
    torch.manual_seed(0)
    try:
        return truth.build(**s)
    except Missing as err:
        pytest.skip(str(err))


def forced(stack: Stack, s: Sizes, batch: int, special: bool = True) -> torch.Tensor:
    """Tokens a route must keep: one or two besides the special ones, other ones in each sample, fewer than a
    route at rate 0.5 keeps; and, with `special`, the special tokens (which force_keep may otherwise displace:
    tested apart)."""
    tokens, lead = stack.tokens(s), len(stack.special(s))
    mask = torch.zeros(batch, tokens, dtype=torch.bool)
    for b in range(batch):
        for j in range(min(2, max(1, (tokens - lead) // 4))):
            mask[b, lead + (3 * b + 5 * j) % (tokens - lead)] = True
    mask[:, list(stack.special(s))] = special
    return mask


def route(name: str, example: dict, call: dict | None = None, *, hand: bool = True) -> None:
    """Apply the declared route to the model built at the `example` sizes, run a training forward at the `call`
    sizes (the example's by default), and hold routekit's decisions for that call to the declarations and, with
    `hand`, its output to the route made by hand."""
    truth = TRUTHS[name]
    torch.set_num_threads(1)
    s = truth.sizes(**example)
    model, args, kwargs = build(truth, s)
    twin = copy.deepcopy(model)  # before apply: the routed model may be the model itself
    start, end = truth.route
    routed = rk.apply(model, rk.Route(start=start, end=end, rate=0.5, selector=truth.selector),
                      example_inputs=args, example_kwargs=kwargs, generator=torch.Generator().manual_seed(0),
                      **truth.options)
    if call is not None:
        s = truth.sizes(**call)
        _, args, kwargs = build(truth, s)
    routed.train()
    twin.train()
    batch = len(args[0]) if args else next(iter(kwargs.values())).shape[0]
    first = [k for k, _ in chain(twin, truth)[route_of(twin, truth)[0]:]][0]
    force = None if shared(twin, truth) or truth.selector != "random" else forced(truth.stacks[first], s, batch)
    torch.manual_seed(1)
    if force is None:
        out = routed(*args, **kwargs)
    else:
        with rk.force_keep(routed, force):
            out = routed(*args, **kwargs)
    keep = ~rk.last_route_mask(routed)
    assert keep.shape == (batch, truth.stacks[first].tokens(s)), f"route mask {tuple(keep.shape)}"
    special = list(truth.stacks[first].special(s))
    assert keep[:, special].all(), f"special tokens {special} routed around: {(~keep[:, special]).nonzero().tolist()}"
    assert force is None or keep[force].all(), "force-kept tokens routed around"
    counts = keep.sum(1)
    assert (counts == counts[0]).all() and counts[0] < keep.shape[1], f"kept counts {counts.tolist()}"
    kept = keep.nonzero()[:, 1].reshape(batch, -1)
    got = decisions(routed, args, kwargs)
    want = declared(twin, truth, s, passed(twin, truth, args, kwargs))
    assert got == want, difference(got, want)
    if hand:
        torch.manual_seed(1)
        expected = by_hand(twin, truth, s, kept, args, kwargs)
        for g, e in zip(tensors(out), tensors(expected), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [name for name, t in TRUTHS.items() if t.stacks[0].special(t.sizes())])
def test_force_keep_never_routes_a_special_token(name: str) -> None:
    """force_keep adds tokens a route keeps; the special ones stay kept too, whichever the selector picked."""
    truth = TRUTHS[name]
    torch.set_num_threads(1)
    s = truth.sizes()
    model, args, kwargs = build(truth, s)
    start, end = truth.route
    routed = rk.apply(model, rk.Route(start=start, end=end, rate=0.5), example_inputs=args, example_kwargs=kwargs,
                      generator=torch.Generator().manual_seed(0), **truth.options).train()
    if shared(model, truth):
        pytest.skip("one selection for the batch: force_keep refuses it")
    force = forced(truth.stacks[0], s, s.batch, special=False)
    special = list(truth.stacks[0].special(s))
    for _ in range(4):
        with rk.force_keep(routed, force):
            routed(*args, **kwargs)
        routed_around = rk.last_route_mask(routed)
        assert not routed_around[force].any(), "a force-kept token was routed around"
        assert not routed_around[:, special].any(), \
            f"special tokens routed around: {routed_around[:, special].nonzero().tolist()} (sample, position)"


# ---- the tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TRUTHS))
def test_routekit_decides_what_the_model_code_says(name: str) -> None:
    """At the zoo's sizes: the stacks, their special tokens, and the per-token inputs routekit cuts in the routed
    blocks are the declared ones, and nothing else is cut."""
    route(name, {}, hand=False)


@pytest.mark.parametrize("name", list(TRUTHS))
def test_a_routed_training_forward_is_the_route_made_by_hand(name: str) -> None:
    """At the zoo's sizes, some tokens force-kept: the routed forward's outputs are those of the route placed by
    hooks from the declarations, at the positions routekit kept."""
    route(name, {})


def stream_tokens(truth: Truth, s: Sizes) -> int:
    return truth.stacks[0].tokens(s)


def spatial(truth: Truth) -> list[dict]:
    """Every combination of the image's (or sequence's) sizes the collisions may use."""
    names = list(truth.spatial)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*truth.spatial.values())]


def targets(truth: Truth, kind: str) -> list[dict]:
    """The sizes (all but the batch) that make `kind` hold for this model; [] where it cannot."""
    text = "text" in truth.sizes()
    found = []
    for sp in spatial(truth):
        s = truth.sizes(**sp)
        grid = truth.grid(s) if truth.grid else ()
        if kind.startswith("caption = ") and text:
            value = {"caption = image tokens": truth.image_tokens(s), "caption = frames": grid[0] if len(grid) == 3
                     else None, "caption = heads": truth.heads, "caption = head_dim": truth.head_dim,
                     "caption = channels": truth.width}.get(kind)
            values = [value] if value is not None else []
            if kind == "caption = a grid side":
                values = sorted(set(grid[-2:]))
            found += [sp | {"text": v} for v in values]
        elif kind.startswith("tokens = "):
            want = {"tokens = channels": truth.width, "tokens = heads": truth.heads,
                    "tokens = head_dim": truth.head_dim, "tokens = time embedding": truth.temb}[kind]
            if want is None:
                break
            texts = range(3, 33) if text else [None]
            for t in texts:
                size = sp | ({"text": t} if t is not None else {})
                if stream_tokens(truth, truth.sizes(**size)) == want:
                    found.append(size)
                    break
        elif kind == "batch = tokens" and stream_tokens(truth, s) <= 24:
            found.append(sp | {"batch": stream_tokens(truth, s)})
    return found


KINDS = ("caption = image tokens", "caption = a grid side", "caption = frames", "caption = heads",
         "caption = head_dim", "caption = channels", "batch = tokens", "tokens = channels", "tokens = heads",
         "tokens = head_dim", "tokens = time embedding")
CASES = [(name, kind) for name, truth in TRUTHS.items() for kind in KINDS if targets(truth, kind)]
LATER = ("caption = image tokens", "tokens = channels", "tokens = time embedding", "batch = tokens")


@pytest.mark.parametrize(("name", "kind"), CASES)
@settings(max_examples=1, deadline=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_sizes_that_collide_change_neither_the_decisions_nor_the_route(name: str, kind: str, data) -> None:
    """A caption as long as the image's tokens (or a grid side, the frames, the heads, the head size, the
    channels), a batch as large as the tokens, tokens as many as the channels: the decisions are the declared
    ones and the route is the one made by hand."""
    route(name, data.draw(st.sampled_from(targets(TRUTHS[name], kind)), label="sizes"))


# The collisions reported against routekit, exactly as reported: (model, the example's sizes, a later call's).
REPORTED = [
    ("diffusers Wan", {"text": 48, "frames": 3}, None),  # a caption of 48 tokens over 3×4×4 image tokens
    ("diffusers PixArt", {"text": 16}, None),  # 16 caption tokens over 4×4 image tokens
    ("diffusers Wan", {}, {"text": 32}),  # applied with 5 caption tokens, then a batch whose caption is N long
    ("diffusers Flux", {}, {"text": 16}),  # a later batch whose caption is as long as the image's tokens
    ("diffusers PixArt", {"height": 24, "width": 32}, None),  # 12×16 tokens, as many as its (B, 6·D) timestep's width
    ("transformers Gemma2 (eager attention)", {"tokens": 32}, None),  # a causal LM: sequence as long as its width
    ("diffusers DiT", {"batch": 16}, None),  # the example's batch as large as its 16 tokens
]


@pytest.mark.parametrize(("name", "example", "call"), REPORTED,
                         ids=[f"{n} {e}" + (f" then {c}" if c else "") for n, e, c in REPORTED])
def test_the_reported_collisions_route_as_declared(name: str, example: dict, call: dict | None) -> None:
    """The collisions reported against routekit, at the sizes reported (the properties above draw their own)."""
    route(name, example, call)


def later(truth: Truth, kind: str) -> list[dict]:
    """The sizes of a later call that make `kind` hold, the sizes the model is built for kept."""
    defaults = truth.sizes()
    return [t for t in targets(truth, kind) if all(t.get(f, defaults[f]) == defaults[f] for f in truth.fixed)]


@pytest.mark.parametrize(("name", "kind"), [(n, k) for n, k in CASES if k in LATER and later(TRUTHS[n], k)])
@settings(max_examples=1, deadline=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_later_call_that_collides_changes_neither_the_decisions_nor_the_route(name: str, kind: str, data) -> None:
    """Applied at the zoo's sizes, where nothing collides, then called at sizes that do: the call's decisions are
    the declared ones and its route the one made by hand."""
    route(name, {}, data.draw(st.sampled_from(later(TRUTHS[name], kind)), label="call sizes"))

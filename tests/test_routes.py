"""Laws of routed models, held on random block-stacked models (tests/strategies.py) and on a tiny DiT.

Eval is the original forward bit for bit; train keeps the output structure; blocks in a route see
exactly the kept tokens and everything else is a gather before the route and a scatter after it,
which a hand-written reference (torch.gather / Tensor.scatter here, never routekit.ops) reproduces
in values and gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import (
    PER_TOKEN_SIDES,
    SELECTORS_WITH_GRID,
    Arch,
    Case,
    archs,
    build,
    cases,
    example_inputs,
    kept_tokens,
)
from torch import nn

import routekit as rk
from backbones import dit
from routekit.model import report_of, routing_of
from routekit.routing import gather_tokens
from routekit.selectors import selector as selector_spec

# building a model is part of drawing an example, so generation may be slow on a loaded CI box
FEW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=300, deadline=None)  # pure selector calls: microseconds each


# --- helpers: routing a case, running it, and the hand-written reference ---------------------------


def route(case: Case) -> nn.Module:
    """The case's model routed with its plan; selections drawn from a seeded generator, not the global RNG."""
    return rk.apply(case.model, routes=case.routes, example_inputs=case.inputs, grid=case.grid,
                    generator=torch.Generator().manual_seed(case.arch.seed), mode=case.mode)


def run(model: nn.Module, inputs: tuple, train: bool, seed: int = 0):
    """One forward in the given mode; the seed fixes model-internal randomness (dropout)."""
    model.train(train)
    torch.manual_seed(seed)
    return model(*inputs)


def identical(a, b) -> bool:
    """Same structure, and every tensor leaf torch.equal."""
    (la, sa), (lb, sb) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def indices_of(routed: nn.Module) -> list[torch.Tensor]:
    """The kept indices (B, K) each route used in the last training forward."""
    return [select.last_index for select in routed.routekit.routes]


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Reference gather: rows `index` (B, K) of x (B, N, ...) per sample."""
    expanded = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return torch.gather(x, 1, expanded)


def put(full: torch.Tensor, index: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Reference scatter: `full` with rows `index` replaced by `kept`."""
    expanded = index.view(*index.shape, *([1] * (kept.dim() - 2))).expand(kept.shape)
    return full.scatter(1, expanded, kept)


def kept_mask(index: torch.Tensor, tokens: int) -> torch.Tensor:
    """Bool (B, N), True at the kept indices."""
    mask = torch.zeros(index.shape[0], tokens, dtype=torch.bool)
    mask[torch.arange(index.shape[0]).unsqueeze(1), index] = True
    return mask


def reference_forward(model: nn.Module, inputs: tuple, routes: list[rk.Route], indices: list[torch.Tensor]):
    """The family's forward with routes done by hand: gather stream and per-token sides, scatter back."""
    h, sides = model.embed_stream(*inputs)
    starts = {r.start: i for r, i in zip(routes, indices)}
    ends = {r.end for r in routes}
    inside, aux = sides, 0
    for b, block in enumerate(model.blocks):
        if b in starts:
            index = starts[b]
            full, h = h, take(h, index)
            inside = {k: take(v, index) if k in PER_TOKEN_SIDES else v for k, v in sides.items()}
        out = model.call_block(block, h, inside)
        if model.arch.tuple_out:
            h, a = out
            aux = aux + a
        else:
            h = out
        if b in ends:
            h, inside = put(full, index, h), sides
    return model.finish(h, aux)


@contextlib.contextmanager
def block_inputs(routed: nn.Module):
    """Record every block call's bound arguments (by parameter name), its stream output, and norm_out's input.

    Hooks go on the routed model's own modules: in boundary mode those are private copies of the model's.
    """
    calls: list[tuple[int, dict]] = []
    outputs: list[torch.Tensor] = []
    after: list[torch.Tensor] = []

    def hook(b: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            calls.append((b, dict(bound.arguments)))

        return record

    def output(module: nn.Module, args: tuple, out) -> None:
        outputs.append(out[0] if isinstance(out, tuple) else out)

    handles = [block.register_forward_pre_hook(hook(b), with_kwargs=True) for b, block in enumerate(routed.blocks)]
    handles += [block.register_forward_hook(output) for block in routed.blocks]
    handles.append(routed.norm_out.register_forward_pre_hook(lambda m, args: after.append(args[0])))
    try:
        yield calls, outputs, after
    finally:
        for handle in handles:
            handle.remove()


# --- the laws on the random family -----------------------------------------------------------------


@FEW
@given(cases())
def test_eval_output_is_bit_identical_to_the_original(case: Case) -> None:
    routed = route(case)
    rk.verify(case.model, routed, case.inputs)
    assert identical(run(routed, case.inputs, train=False), run(case.model, case.inputs, train=False))


@FEW
@given(cases())
def test_train_output_has_the_original_structure_shapes_and_dtypes(case: Case) -> None:
    routed = route(case)
    got, want = run(routed, case.inputs, train=True), run(case.model, case.inputs, train=True)
    (lg, sg), (lw, sw) = pytree.tree_flatten(got), pytree.tree_flatten(want)
    assert sg == sw
    assert [(t.shape, t.dtype) for t in lg] == [(t.shape, t.dtype) for t in lw]


@FEW
@given(cases(rate=st.just(0.0)))
def test_rate_zero_reproduces_the_original_exactly_in_train_mode(case: Case) -> None:
    routed = route(case)
    assert identical(run(routed, case.inputs, train=True, seed=7), run(case.model, case.inputs, train=True, seed=7))


@SOME
@given(cases(max_routes=1))
def test_routed_tokens_leave_the_route_with_their_route_start_value(case: Case) -> None:
    (r,) = case.routes
    routed = route(case)
    with block_inputs(routed) as (calls, outputs, after):
        run(routed, case.inputs, train=True)
    # one route: the stream is full before its start and after its end
    start_value = outputs[r.start - 1] if r.start > 0 else case.model.embed_stream(*case.inputs)[0]
    end_value = calls[r.end + 1][1]["x"] if r.end + 1 < case.arch.depth else after[0]
    (index,) = indices_of(routed)
    assert bool((index[:, 1:] > index[:, :-1]).all()), "kept indices sorted and unique: sequence order survives"
    assert torch.equal(calls[r.start][1]["x"], take(start_value, index)), "the route's first block sees the kept tokens"
    kept = kept_mask(index, case.arch.tokens)
    assert end_value.shape == start_value.shape
    assert torch.equal(end_value[~kept], start_value[~kept])


@SOME
@given(cases())
def test_blocks_inside_a_route_see_the_kept_count_and_blocks_outside_see_every_token(case: Case) -> None:
    routed = route(case)
    with block_inputs(routed) as (calls, _, _):
        run(routed, case.inputs, train=True)
    grid = case.arch.grid
    want = [case.arch.tokens] * case.arch.depth
    for r in case.routes:
        want[r.start:r.end + 1] = [kept_tokens(r, grid)] * (r.end - r.start + 1)
    assert [args["x"].shape[1] for _, args in calls] == want
    assert [calls[r.start][1]["x"].shape[1] for r in case.routes] == [i.shape[1] for i in indices_of(routed)]


@FEW
@given(cases())
def test_forward_and_gradients_equal_a_hand_written_gather_scatter_reference(case: Case) -> None:
    routed = route(case)
    params = list(case.model.parameters())

    def loss_and_grads(forward) -> tuple:
        inputs = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in case.inputs)
        torch.manual_seed(3)
        out = forward(inputs)
        weights = torch.Generator().manual_seed(1)
        loss = sum((leaf * torch.randn(leaf.shape, generator=weights)).sum() for leaf in pytree.tree_leaves(out))
        return out, torch.autograd.grad(loss, params + list(inputs), allow_unused=True)

    routed.train()
    out, grads = loss_and_grads(lambda inputs: routed(*inputs))
    indices = indices_of(routed)
    ref_out, ref_grads = loss_and_grads(lambda inputs: reference_forward(case.model, inputs, case.routes, indices))
    assert identical(out, ref_out)
    for g, want in zip(grads, ref_grads):
        assert (g is None) == (want is None)
        if g is not None:
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


@MANY
@given(name=st.sampled_from(SELECTORS_WITH_GRID), batch=st.integers(1, 4), height=st.integers(1, 8),
       width=st.integers(1, 8), rate=st.floats(0.0, 0.99), seed=st.integers(0, 2**16))
def test_selectors_return_sorted_unique_in_range_indices_of_the_kept_count(
        name: str, batch: int, height: int, width: int, rate: float, seed: int) -> None:
    tokens = height * width
    select = selector_spec(name).fn
    index = select(batch, tokens, rate, grid=(height, width), generator=torch.Generator().manual_seed(seed),
                   device=torch.device("cpu"))
    keep = kept_tokens(rk.Route(start=0, end=0, rate=rate, selector=name), (height, width))
    assert index.dtype == torch.long and index.shape == (batch, keep)
    assert bool((index[:, 1:] > index[:, :-1]).all()), "sorted and unique"
    assert bool((index >= 0).all() and (index < tokens).all())
    if name in ("row", "window"):
        rows = index.view(batch, -1, width)
        assert torch.equal(rows % width, torch.arange(width).expand_as(rows)), "whole rows"
        assert bool((rows // width == rows[..., :1] // width).all())
    if name == "window":
        first = index[:, ::width] // width
        assert torch.equal(first - first[:, :1], torch.arange(first.shape[1]).expand_as(first)), "contiguous rows"
    again = select(batch, tokens, rate, grid=(height, width), generator=torch.Generator().manual_seed(seed),
                   device=torch.device("cpu"))
    assert torch.equal(index, again), "a seeded generator makes the selection reproducible"


@FEW
@given(cases())
def test_state_dict_keys_are_the_originals_and_an_original_checkpoint_loads_strictly(case: Case) -> None:
    routed = route(case)
    assert list(routed.state_dict()) == list(case.model.state_dict())
    other = build(dataclasses.replace(case.arch, seed=case.arch.seed + 1))
    routed.load_state_dict(other.state_dict(), strict=True)
    assert identical(run(routed, case.inputs, train=False), run(other, case.inputs, train=False))


@SOME
@given(cases())
def test_last_route_mask_marks_exactly_the_tokens_each_route_did_not_keep(case: Case) -> None:
    routed = route(case)
    run(routed, case.inputs, train=True)
    tokens = case.arch.tokens
    masks = [~kept_mask(index, tokens) for index in indices_of(routed)]
    for k, mask in enumerate(masks):
        assert torch.equal(rk.last_route_mask(routed, route=k), mask)
    assert torch.equal(rk.last_route_mask(routed), torch.stack(masks).any(0))


@SOME
@given(cases(arch=archs(container="list", kinds=("bias", "mask"))))
def test_per_token_side_inputs_are_gathered_with_the_routes_indices(case: Case) -> None:
    routed = route(case)
    with block_inputs(routed) as (calls, _, _):
        run(routed, case.inputs, train=True)
    full = case.model.embed_stream(*case.inputs)[1]
    index_at = {b: index for r, index in zip(case.routes, indices_of(routed)) for b in range(r.start, r.end + 1)}
    for b, args in calls:
        side = case.model.blocks[b].side
        want = take(full[side], index_at[b]) if b in index_at else full[side]
        assert torch.equal(args[side], want), f"block {b} ({side})"


@FEW
@given(cases(min_routes=2))
def test_several_routes_compose_as_successive_gather_scatter_pairs(case: Case) -> None:
    routed = route(case)
    out = run(routed, case.inputs, train=True, seed=5)
    case.model.train()
    torch.manual_seed(5)
    assert identical(out, reference_forward(case.model, case.inputs, case.routes, indices_of(routed)))


@FEW
@given(cases())
def test_strip_returns_the_original_class_computing_the_original_outputs(case: Case) -> None:
    plain = rk.strip(route(case))
    assert type(plain) is type(case.model) and routing_of(plain) is None
    assert list(plain.state_dict()) == list(case.model.state_dict())
    for train in (False, True):
        assert identical(run(plain, case.inputs, train, seed=2), run(case.model, case.inputs, train, seed=2))


# --- a tiny DiT ------------------------------------------------------------------------------------


def tiny_dit(input_size: int = 8, depth: int = 6, class_dropout: float = 0.1) -> dit.DiT:
    """DiT with hidden 64, 2 heads; weights nudged off adaLN-Zero so blocks and output are not trivial."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = dit.build("S/2", depth=depth, hidden=64, heads=2, input_size=input_size, num_classes=10,
                          class_dropout=class_dropout)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
    return model


def dit_reference(model: dit.DiT, x, t, y, route: rk.Route, index: torch.Tensor) -> torch.Tensor:
    """DiT.forward with one route done by hand."""
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    for b, block in enumerate(model.blocks):
        if b == route.start:
            full, h = h, take(h, index)
        h = block(h, c)
        if b == route.end:
            h = put(full, index, h)
    return model.unpatchify(model.final_layer(h, c))


@pytest.mark.parametrize("depth, routes", [(6, rk.Route(start=2, end=2, rate=0.5)), (7, "default")])
def test_dit_routed_eval_is_the_original_and_train_matches_the_reference(depth: int, routes) -> None:
    model = tiny_dit(depth=depth)
    x, t, y = dit.example_inputs(model, 3, generator=torch.Generator().manual_seed(0))
    routed = rk.apply(model, routes=routes, example_inputs=(x, t, y), generator=torch.Generator().manual_seed(0))
    rk.verify(model, routed, (x, t, y))
    assert torch.equal(run(routed, (x, t, y), train=False), run(model, (x, t, y), train=False))
    (r,) = routed.routekit.routes
    assert (r.route.start, r.route.end) == (2, depth - 4)

    x = x.clone().requires_grad_()
    out = run(routed, (x, t, y), train=True, seed=4)
    assert out.shape == x.shape and r.last_index.shape == (3, 8)
    grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    model.train()
    torch.manual_seed(4)  # the same label dropout draw
    ref = dit_reference(model, x, t, y, r.route, r.last_index)
    assert torch.equal(out, ref)
    for g, want in zip(grads, torch.autograd.grad(ref.square().sum(), [x, *model.parameters()])):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_the_block_stack_is_the_longest_chain_carrying_a_token_stream() -> None:
    """DiT of depth 3: t_embedder.mlp (Linear, SiLU, Linear) is as long a chain as the 3 blocks, but carries
    a (B, 256) vector, not a (B, N, D) stream; routekit picks it and fails instead of picking `blocks`."""
    model = tiny_dit(depth=3)
    x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(0))
    explicit = rk.apply(model, routes=rk.Route(start=0, end=1), example_inputs=(x, t, y), stack="blocks")
    assert report_of(explicit).stack == "blocks"
    routed = rk.apply(model, routes=rk.Route(start=0, end=1), example_inputs=(x, t, y))
    assert report_of(routed).stack == "blocks"


def test_per_token_float_mask_as_wide_as_the_channels_is_gathered() -> None:
    """The converse of the test below: a float (B, N) mask with N == D (16 tokens, hidden 16) is per-token.

    Shape and dtype cannot tell it from adaLN's c (B, D); only how the block uses it can.
    """
    arch = Arch(depth=3, hidden=16, heads=2, grid=(4, 4), front="conv", patch=1, channels=1, container="list",
                kinds=("mask", "mask", "mask"), tuple_out=False, stream_kw=False, side_kw=False, dropout=0.0,
                batch=2, seed=0)
    model, inputs = build(arch), example_inputs(arch)
    routed = rk.apply(model, routes=rk.Route(start=0, end=1), example_inputs=inputs,
                      generator=torch.Generator().manual_seed(0))
    with block_inputs(routed) as (calls, _, _):
        run(routed, inputs, train=True)
    (index,) = indices_of(routed)
    assert torch.equal(calls[1][1]["mask"], take(inputs[2], index))


def test_per_sample_condition_as_wide_as_the_token_count_is_not_gathered() -> None:
    """DiT at input 16, patch 2, hidden 64: 64 tokens and c (B, 64). c is per-sample, never per-token.

    Classified by shape alone, c (B, D) with D == N would be taken as per-token (B, N) and gathered to (B, K).
    """
    model = tiny_dit(input_size=16)
    x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(0))
    report = rk.inspect(model, (x, t, y))
    assert report.tokens == 64 and [s.kind for s in report.blocks[0].side_inputs] == ["per-sample"]
    routed = rk.apply(model, routes=rk.Route(start=2, end=3, rate=0.5), example_inputs=(x, t, y))
    assert run(routed, (x, t, y), train=True).shape == x.shape


def test_a_table_shared_by_the_batch_is_gathered_per_sample():
    for count, index in ((5, torch.tensor([[0, 2], [1, 4], [3, 4]])), (3, torch.tensor([[0], [2], [1]]))):
        table = torch.arange(float(count))[None, :, None].expand(1, count, 2)
        assert torch.equal(gather_tokens(table, index)[..., 0], index.float())

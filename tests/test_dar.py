"""DAR (routekit/dar.py) held against DAR written out by hand, on tiny block-stacked models.

The models here are pre-norm stacks whose blocks expose their sublayers (`Block.branches`), so a test can
run DAR's forward as a plain loop: history = [v_0]; for each sublayer v = branch(h), history gets v (with
chunk=S every S outputs become their sum), h = softmax-mix of the history keyed by q·RMSNorm(v)/√D; after
the last block h goes to the output layer. Nothing here calls routekit's aggregation or its route ops.
The laws at the end hold DAR with routes against the same loop written out by hand on tests/tiny.py's models, and
the layer norm DAR folds into a merge against F.layer_norm of the merge.
"""

from __future__ import annotations

import copy
import linecache
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import zoo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import D, Mlp, Tokens, TupleBlock, built, tokens, train_out
from torch import nn

import routekit as rk
from backbones import dit, mamba, rwkv
from routekit import dar as rk_dar
from routekit.kernels import naive
from routekit.model import report_of, routing_of

FEW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = dict(atol=1e-5, rtol=0)
CHUNKS = (None, 1, 2, 3, 4)
RATES = st.floats(0.0, 0.8)


# --- a tiny pre-norm family with known sublayers -----------------------------------------------------


class Ffn(nn.Module):
    """Token-wise feed-forward whose bias adds (inside the branch) are not residual adds."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)
        self.b1, self.b2 = nn.Parameter(0.1 * torch.randn(2 * d)), nn.Parameter(0.1 * torch.randn(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h) + self.b1)) + self.b2


class Attn(nn.Module):
    """Single-head self-attention: mixes tokens."""

    def __init__(self, d: int):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v))


SUBLAYERS = {"ffn": Ffn, "attn": Attn}


class Block(nn.Module):
    """x = x + gate_j * sub_j(norm_j(x) * (1 + scale_j) + shift_j) for each sublayer j (no gate/shift/scale
    without adaLN). `1 + scale`, `+ shift` and the c-bias add are adds that are not residual adds."""

    def __init__(self, d: int, kinds: tuple[str, ...], ada: bool):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in kinds)
        self.subs = nn.ModuleList(SUBLAYERS[k](d) for k in kinds)
        self.ada = nn.Linear(d, 3 * len(kinds) * d) if ada else None
        self.cbias = nn.Parameter(0.1 * torch.randn(d)) if ada else None

    def modulation(self, c: torch.Tensor):
        if self.ada is None:
            return None
        return self.ada(F.silu(c + self.cbias)).unsqueeze(1).chunk(3 * len(self.subs), dim=-1)

    def branch(self, j: int, x: torch.Tensor, mod) -> torch.Tensor:
        """The branch operand of residual add j: what DAR calls the sublayer output v."""
        h = self.norms[j](x)
        if mod is None:
            return self.subs[j](h)
        return mod[3 * j + 2] * self.subs[j](h * (1 + mod[3 * j + 1]) + mod[3 * j])

    def branches(self, c: torch.Tensor) -> list:
        mod = self.modulation(c)
        return [lambda x, j=j: self.branch(j, x, mod) for j in range(len(self.subs))]

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        mod = self.modulation(c)
        for j in range(len(self.subs)):
            x = x + self.branch(j, x, mod)
        return x


class Residual(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.sub = nn.LayerNorm(d), Ffn(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.sub(self.norm(x))


class HiddenBlock(nn.Module):
    """Its residual adds live inside container members (leaves when the block is traced): DAR sees the
    block as one sublayer whose output is v = block(x) - x."""

    def __init__(self, d: int, kinds: tuple[str, ...], ada: bool):
        super().__init__()
        self.inner = nn.ModuleList(Residual(d) for _ in kinds)

    def branches(self, c: torch.Tensor) -> list:
        return [lambda x: self(x, c) - x]

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for layer in self.inner:
            x = layer(x)
        return x


@dataclass(frozen=True)
class Spec:
    kinds: tuple[tuple[str, ...], ...]  # per block, its sublayers
    ada: tuple[bool, ...]
    hidden: int
    tokens: int
    batch: int
    seed: int
    hidden_blocks: tuple[int, ...] = ()  # indices of HiddenBlocks

    @property
    def sublayers(self) -> int:
        return sum(len(k) for k in self.kinds)


class Net(nn.Module):
    """Linear token embedding + positions, timestep MLP c = e(t), the block stack, norm and head."""

    CHANNELS = 3

    def __init__(self, spec: Spec):
        super().__init__()
        d = spec.hidden
        self.embed = nn.Linear(self.CHANNELS, d)
        self.pos = nn.Parameter(0.1 * torch.randn(1, spec.tokens, d))
        self.t1, self.t2 = nn.Linear(1, d), nn.Linear(d, d)
        self.blocks = nn.ModuleList(
            (HiddenBlock if i in spec.hidden_blocks else Block)(d, kinds, ada)
            for i, (kinds, ada) in enumerate(zip(spec.kinds, spec.ada)))
        self.norm_out, self.head = nn.LayerNorm(d), nn.Linear(d, self.CHANNELS)

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) + self.pos

    def cond(self, t: torch.Tensor) -> torch.Tensor:
        return self.t2(F.silu(self.t1(t.unsqueeze(-1))))

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm_out(h))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, c = self.stream(x), self.cond(t)
        for block in self.blocks:
            h = block(h, c)
        return self.output(h)


class Untimed(Net):
    """Conditioned on integer labels, not on a float timestep: static_t has nothing to use."""

    def __init__(self, spec: Spec):
        super().__init__(spec)
        self.labels = nn.Embedding(4, spec.hidden)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, c = self.stream(x), self.labels(y)
        for block in self.blocks:
            h = block(h, c)
        return self.output(h)


def build(spec: Spec, cls=Net) -> Net:
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        return cls(spec)


def inputs(spec: Spec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.batch, spec.tokens, Net.CHANNELS, generator=g), torch.rand(spec.batch, generator=g)


@st.composite
def specs(draw, min_depth: int = 2, max_depth: int = 4, max_sublayers: int = 3, kinds=("ffn", "attn")) -> Spec:
    # depth >= 2: a stack is a chain of at least two block calls
    depth = draw(st.integers(min_depth, max_depth))
    blocks = tuple(tuple(draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=max_sublayers)))
                   for _ in range(depth))
    return Spec(kinds=blocks, ada=tuple(draw(st.booleans()) for _ in range(depth)),
                hidden=draw(st.sampled_from([8, 12, 16])), tokens=draw(st.integers(2, 6)),
                batch=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)))


# --- DAR by hand --------------------------------------------------------------------------------------


def mean_mix(sources: list[torch.Tensor], query=None) -> torch.Tensor:
    return torch.stack(sources).mean(0)


def softmax_mix(sources: list[torch.Tensor], query: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Σ_i softmax_i(q·RMSNorm(v_i)/√D) v_i, the obvious way."""
    values = torch.stack(sources)
    d = values.shape[-1]
    keys = values / torch.sqrt(values.square().mean(-1, keepdim=True) + eps)
    weights = torch.softmax((keys * query).sum(-1) / math.sqrt(d), dim=0)
    return (weights.unsqueeze(-1) * values).sum(0)


def dar_by_hand(model: Net, x, t, *, chunk=None, mix=mean_mix, query=None, mode="static", dynamic=None,
                spans=()) -> torch.Tensor:
    """DAR's forward as a loop. spans: (start, end, routed (B, N) bool) per route, for token-wise models: a
    routed token's sublayer outputs inside the route are 0 and its stream stays at its route-start value."""
    h, c = model.stream(x), model.cond(t)
    closed, current = [h], []  # v_0 and chunk summaries; the open chunk's raw outputs
    point, frozen = 0, None
    for i, block in enumerate(model.blocks):
        routed = next((m.unsqueeze(-1) for s, e, m in spans if s <= i <= e), None)
        if any(s == i for s, _, _ in spans):
            frozen = h
        for branch in block.branches(c):
            v = branch(h)
            if routed is not None:
                v = torch.where(routed, torch.zeros_like(v), v)
            current.append(v)
            if chunk is not None and len(current) == chunk:
                closed.append(sum(current[1:], current[0]))
                current = []
            q = None
            if mode == "dynamic" and dynamic is not None:
                q = v @ dynamic[point].T
            elif query is not None:
                q = query[point]
                if mode == "static_t":
                    q = q + c.unsqueeze(1)
            point += 1
            h = mix(closed + current, q)
            if routed is not None:
                h = torch.where(routed, frozen, h)
    return model.output(h)


def dar(model: nn.Module, example, routes=None, generator_seed=0, stack=None, **config) -> nn.Module:
    """A copy of the model with DAR (kernel="torch" unless given), routes drawn from a seeded generator: apply
    routes the model it is given, and these tests compare several DAR models built from one original."""
    config.setdefault("kernel", "torch")
    return rk.apply(copy.deepcopy(model), routes=routes, residual=rk.DAR(**config), example_inputs=example, stack=stack,
                    generator=torch.Generator().manual_seed(generator_seed))


def run(model: nn.Module, example, train: bool):
    model.train(train)
    with torch.no_grad():
        return model(*example)


def randomise_queries(routed: nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    state = routed.routekit.dar
    with torch.no_grad():
        if hasattr(state, "query"):
            state.query.copy_(scale * torch.randn(state.query.shape, generator=g))
        if hasattr(state, "dynamic"):
            state.dynamic.copy_(0.5 * torch.randn(state.dynamic.shape, generator=g))


def program_source(routed: nn.Module, train: bool) -> str:
    """The generated Python of the routed model's program for its one call signature in that mode."""
    (bucket,) = [b for (mode, _, _), b in routing_of(routed).executor.programs.items() if mode == train]
    (program,) = bucket.values()
    return "".join(linecache.getlines(program.fn.__code__.co_filename))


# --- 1, 2: the forward is DAR's loop -------------------------------------------------------------------


@FEW
@given(spec=specs(), chunk=st.sampled_from(CHUNKS), query=st.sampled_from(["static", "dynamic"]))
def test_zero_queries_average_the_history_uniformly(spec, chunk, query):
    model = build(spec)
    example = inputs(spec)
    routed = dar(model, example, chunk=chunk, query=query)
    with torch.no_grad():
        expected = dar_by_hand(model, *example, chunk=chunk)
    for train in (True, False):
        torch.testing.assert_close(run(routed, example, train), expected, **TOL)


@FEW
@given(spec=specs(), chunk=st.sampled_from(CHUNKS), mode=st.sampled_from(["static", "static_t", "dynamic"]),
       seed=st.integers(0, 2**16))
def test_learned_queries_softmax_mix_the_history(spec, chunk, mode, seed):
    if mode == "dynamic" and chunk not in (None, 1):
        chunk = None  # see test_dynamic_query_reads_the_newest_output_under_chunking
    model = build(spec)
    example = inputs(spec)
    routed = dar(model, example, chunk=chunk, query=mode)
    randomise_queries(routed, seed)
    state = routed.routekit.dar
    with torch.no_grad():
        expected = dar_by_hand(model, *example, chunk=chunk, mix=softmax_mix, query=getattr(state, "query", None),
                               mode=mode,
                               dynamic=getattr(state, "dynamic", None))
        assert not torch.allclose(expected, dar_by_hand(model, *example, chunk=chunk), **TOL)  # not the mean
    for train in (True, False):
        torch.testing.assert_close(run(routed, example, train), expected, **TOL)


def test_dynamic_query_reads_the_newest_output_under_chunking():
    spec = Spec(kinds=(("ffn", "ffn"), ("ffn",), ("ffn", "ffn")), ada=(True, False, True), hidden=8, tokens=4,
                batch=2, seed=3)
    model, example = build(spec), inputs(spec)
    routed = dar(model, example, chunk=2, query="dynamic")
    randomise_queries(routed, 0)
    state = routed.routekit.dar
    with torch.no_grad():
        expected = dar_by_hand(model, *example, chunk=2, mix=softmax_mix, mode="dynamic", dynamic=state.dynamic)
    torch.testing.assert_close(run(routed, example, True), expected, **TOL)


@FEW
@given(spec=specs(max_depth=4), chunk=st.sampled_from(CHUNKS), data=st.data())
def test_blocks_with_hidden_residual_adds_are_one_source_each(spec, chunk, data):
    hidden = tuple(data.draw(st.sets(st.integers(0, len(spec.kinds) - 1), min_size=1)))
    spec = Spec(**{**spec.__dict__, "hidden_blocks": hidden})
    model, example = build(spec), inputs(spec)
    routed = dar(model, example, chunk=chunk)
    report = report_of(routed)
    assert [b.index for b in report.blocks if not b.adds] == sorted(hidden)
    assert report.residual == ("block" if len(hidden) == len(spec.kinds) else "mixed")
    randomise_queries(routed, spec.seed)
    with torch.no_grad():
        expected = dar_by_hand(model, *example, chunk=chunk, mix=softmax_mix, query=routed.routekit.dar.query)
    torch.testing.assert_close(run(routed, example, True), expected, **TOL)


def test_auto_kernel_on_cpu_is_the_reference():
    spec = Spec(kinds=(("attn", "ffn"),) * 3, ada=(True,) * 3, hidden=8, tokens=5, batch=2, seed=0)
    model, example = build(spec), inputs(spec)
    torch_kernel, auto = dar(model, example, chunk=2), dar(model, example, chunk=2, kernel="auto")
    randomise_queries(torch_kernel, 1)
    auto.load_state_dict(torch_kernel.state_dict())
    assert torch.equal(run(auto, example, True), run(torch_kernel, example, True))


# --- 3: residual-add discovery -------------------------------------------------------------------------


@SOME
@given(spec=specs(max_depth=6), query=st.sampled_from(["static", "dynamic"]))
def test_one_aggregation_per_sublayer(spec, query):
    model = build(spec)
    routed = dar(model, inputs(spec), query=query)
    report = report_of(routed)
    assert [len(b.adds) for b in report.blocks] == [len(k) for k in spec.kinds]
    assert report.residual == "sublayer"
    assert routed.routekit.dar.points == spec.sublayers
    if query == "dynamic":  # q_l = W_l v: no static w_l, so every DAR parameter gets a gradient (DDP)
        assert routed.routekit.dar.dynamic.shape == (spec.sublayers, spec.hidden, spec.hidden)
        assert not hasattr(routed.routekit.dar, "query")
    else:
        assert routed.routekit.dar.query.shape == (spec.sublayers, spec.hidden)


class StreamBiasBlock(Block):
    """A learned bias added to the stream between the two sublayers: not a residual add."""

    def __init__(self, d: int, kinds, ada):
        super().__init__(d, kinds, ada)
        self.stream_bias = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x, c):
        mod = self.modulation(c)
        x = x + self.branch(0, x, mod)
        x = x + self.stream_bias
        return x + self.branch(1, x, mod)


class ParallelBlock(Block):
    """GPT-J style: both sublayers read the block input, x + f(x) + g(x)."""

    def forward(self, x, c):
        mod = self.modulation(c)
        return x + self.branch(0, x, mod) + self.branch(1, x, mod)


class PostNormBlock(Block):
    """Post-norm (original Transformer): x = norm_j(x + sub_j(x))."""

    def forward(self, x, c):
        for j in range(len(self.subs)):
            x = self.norms[j](x + self.subs[j](x))
        return x


@pytest.mark.parametrize("cls", [StreamBiasBlock, ParallelBlock, PostNormBlock])
def test_every_residual_add_is_found_or_the_block_is_one_source(cls):
    spec = Spec(kinds=(("ffn", "ffn"),) * 3, ada=(True,) * 3, hidden=8, tokens=4, batch=2, seed=0)
    model = build(spec)
    model.blocks = nn.ModuleList(cls(8, ("ffn", "ffn"), True) for _ in range(3))
    report = report_of(dar(model, inputs(spec)))
    assert all(len(b.adds) in (0, 2) for b in report.blocks), [b.adds for b in report.blocks]


class CastBackBlock(Block):
    """Wan's fp32 residual: x = (x.float() + v).type_as(x), the branch written first in the second add."""

    def forward(self, x, c):
        mod = self.modulation(c)
        x = (x.float() + self.branch(0, x, mod)).type_as(x)
        return (self.branch(1, x, mod) + x.float()).type_as(x)


class Fp32ResidualBlock(Block):
    """Mamba's residual_in_fp32: the skip is x.to(torch.float32) and the sum stays fp32."""

    def forward(self, x, c):
        mod = self.modulation(c)
        for j in range(len(self.subs)):
            x = x.to(torch.float32) + self.branch(j, x, mod)
        return x


@pytest.mark.parametrize("cls", [CastBackBlock, Fp32ResidualBlock])
def test_residual_adds_onto_a_cast_of_the_stream_are_found_and_rewritten_as_plain_ones(cls):
    """In fp32 the casts change nothing, so DAR over blocks that add onto `x.float()` (and cast back) computes
    what DAR over the same blocks written as `x + v` computes: one aggregation per sublayer, not one per block."""
    spec = Spec(kinds=(("ffn", "ffn"),) * 3, ada=(True,) * 3, hidden=8, tokens=4, batch=2, seed=0)
    plain, cast = build(spec), build(spec)
    cast.blocks = nn.ModuleList(cls(8, ("ffn", "ffn"), True) for _ in range(3))
    cast.load_state_dict(plain.state_dict())
    routed = dar(cast, inputs(spec), query="dynamic")
    report = report_of(routed)
    assert report.residual == "sublayer" and [len(b.adds) for b in report.blocks] == [2, 2, 2]
    reference = dar(plain, inputs(spec), query="dynamic")
    with torch.no_grad():
        reference.routekit.dar.dynamic.normal_()
        routed.routekit.dar.dynamic.copy_(reference.routekit.dar.dynamic)
    for train in (False, True):
        torch.testing.assert_close(run(routed, inputs(spec), train), run(reference, inputs(spec), train))


class MixedDtypeBlock(Block):
    """Wan's pattern in a bf16 model: an fp32 residual for the first sublayer (its branch gated in fp32, the sum
    cast back), a plain bf16 one for the second. A chunk then holds sources of two dtypes."""

    def forward(self, x, c):
        mod = self.modulation(c)
        x = (x.float() + self.branch(0, x, mod).float()).type_as(x)
        return x + self.branch(1, x, mod)


@pytest.mark.parametrize("chunk", [None, 2, 3])
def test_a_bf16_model_whose_sublayers_give_two_dtypes_runs_with_every_chunking(chunk):
    """Each mix comes out in the dtype of the newest sublayer output, chunk summaries included, so what reads
    it (a Linear holding bf16 weights, behind a `type_as` of the mix) gets the dtype it got from the add."""
    spec = Spec(kinds=(("ffn", "ffn"),) * 3, ada=(True,) * 3, hidden=8, tokens=4, batch=2, seed=0)
    model = build(spec)
    model.blocks = nn.ModuleList(MixedDtypeBlock(8, ("ffn", "ffn"), True) for _ in range(3))
    model = model.to(torch.bfloat16)
    example = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs(spec))
    routed = dar(model, example, routes=[rk.Route(start=1, end=1)], chunk=chunk)
    assert report_of(routed).residual == "sublayer"
    out = routed.train()(*example)
    out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(routed.routekit.dar.query.grad).all()


# --- 4: with routes -----------------------------------------------------------------------------------


@st.composite
def route_plans(draw, depth: int, rate: st.SearchStrategy[float] = RATES) -> list[rk.Route]:
    """1-2 disjoint routes in block order (each start <= end < next start)."""
    n = draw(st.integers(1, min(2, depth)))
    points = sorted(draw(st.lists(st.integers(0, depth - n), min_size=2 * n, max_size=2 * n)))
    return [rk.Route(start=points[2 * i] + i, end=points[2 * i + 1] + i, rate=draw(rate)) for i in range(n)]


@FEW
@given(spec=specs(), chunk=st.sampled_from(CHUNKS), data=st.data())
def test_routes_with_dar(spec, chunk, data):
    routes = data.draw(route_plans(len(spec.kinds)))
    model, example = build(spec), inputs(spec)
    routed = dar(model, example, routes=routes, chunk=chunk)
    plain = dar(model, example, chunk=chunk)
    randomise_queries(routed, spec.seed)
    plain.load_state_dict(routed.state_dict())
    # eval: no routes, deterministic, DAR without routes
    first, second = run(routed, example, False), run(routed, example, False)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, run(plain, example, False), **TOL)
    # train: the original's shape, and the queries learn
    routed.train()
    out = routed(*example)
    assert out.shape == model(*example).shape
    out.square().mean().backward()
    grad = routed.routekit.dar.query.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@FEW
@given(spec=specs(kinds=("ffn",)), chunk=st.sampled_from(CHUNKS), data=st.data())
def test_routed_tokens_contribute_zeros_and_keep_their_stream(spec, chunk, data):
    """Token-wise sublayers: each token's output is DAR by hand with its own route masks."""
    routes = data.draw(route_plans(len(spec.kinds)))
    model, example = build(spec), inputs(spec)
    routed = dar(model, example, routes=routes, chunk=chunk, generator_seed=spec.seed)
    randomise_queries(routed, spec.seed)
    out = run(routed, example, True)
    spans = [(r.start, r.end, rk.last_route_mask(routed, route=k)) for k, r in enumerate(routes)]
    with torch.no_grad():
        expected = dar_by_hand(model, *example, chunk=chunk, mix=softmax_mix, query=routed.routekit.dar.query,
                               spans=spans)
    torch.testing.assert_close(out, expected, **TOL)


@FEW
@given(spec=specs(), chunk=st.sampled_from(CHUNKS), data=st.data())
def test_a_route_keeping_every_token_changes_nothing(spec, chunk, data):
    """Rate 0 keeps all tokens in a random order; attention and token-wise sublayers do not mind."""
    routes = data.draw(route_plans(len(spec.kinds), rate=st.just(0.0)))
    model, example = build(spec), inputs(spec)
    routed, plain = dar(model, example, routes=routes, chunk=chunk), dar(model, example, chunk=chunk)
    randomise_queries(routed, spec.seed)
    plain.load_state_dict(routed.state_dict())
    torch.testing.assert_close(run(routed, example, True), run(plain, example, True), **TOL)


# --- 5: the eval graph is the same graph every time it is built ----------------------------------------


@FEW
@given(spec=specs(max_depth=4), chunk=st.sampled_from(CHUNKS), query=st.sampled_from(["static", "static_t",
                                                                                      "dynamic"]))
def test_eval_program_is_stable_across_traces(spec, chunk, query):
    model, example = build(spec), inputs(spec)
    one, two = dar(model, example, chunk=chunk, query=query), dar(model, example, chunk=chunk, query=query)
    randomise_queries(one, spec.seed)
    two.load_state_dict(one.state_dict())
    out_one, out_two = run(one, example, False), run(two, example, False)
    assert program_source(one, False) == program_source(two, False)
    assert torch.equal(out_one, out_two)
    source = program_source(one, False)
    routing_of(one).executor.programs.clear()  # traced again on the next call
    assert torch.equal(run(one, example, False), out_one)
    assert program_source(one, False) == source


def test_deepcopy_keeps_the_dar_forward():
    spec = Spec(kinds=(("attn", "ffn"),) * 3, ada=(True,) * 3, hidden=8, tokens=5, batch=2, seed=1)
    model, example = build(spec), inputs(spec)
    routed = dar(model, example, chunk=2)
    randomise_queries(routed, 0)
    clone = copy.deepcopy(routed)
    assert torch.equal(run(clone, example, False), run(routed, example, False))
    assert torch.equal(run(clone, example, True), run(routed, example, True))


# --- 6: static_t and config errors ---------------------------------------------------------------------


def tiny_dit(depth: int = 2) -> dit.DiT:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return dit.build("S/2", depth=depth, hidden=32, heads=2, input_size=8, num_classes=10, class_dropout=0.0)


def test_static_t_query_follows_the_dit_timestep():
    """Zero adaLN weights with nonzero biases: the DiT itself ignores t, so any t-dependence is the query's."""
    model = tiny_dit()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for layer in [b.adaLN_modulation[-1] for b in model.blocks] + [model.final_layer.adaLN_modulation[-1]]:
            layer.weight.zero_()
    x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    other_t = (t + 0.37) % 1.0
    static_t = dar(model, (x, t, y), query="static_t", stack="blocks")
    static = dar(model, (x, t, y), query="static", stack="blocks")
    named = dar(model, (x, t, y), query="static_t", timestep="t_embedder", stack="blocks")
    randomise_queries(static_t, 0, scale=0.5)
    static.load_state_dict(static_t.state_dict())
    named.load_state_dict(static_t.state_dict())
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            assert torch.equal(model(x, t, y), model(x, other_t, y))
        assert torch.allclose(run(static, (x, t, y), train), run(static, (x, other_t, y), train), **TOL)
        a, b = run(static_t, (x, t, y), train), run(static_t, (x, other_t, y), train)
        assert not torch.allclose(a, b, atol=1e-4)
        torch.testing.assert_close(run(named, (x, t, y), train), a, **TOL)


def test_every_aggregation_reads_contiguous_sources(monkeypatch):
    """DiT's patch embedding is a transposed (B, N, D) view; it joins the history contiguous once, or
    the fused kernel would copy it at every aggregation, forward and backward (57 ms of a compiled
    DiT-XL/2 step on the H200)."""
    import routekit.dar

    model = tiny_dit()
    x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    assert not model.x_embedder(x).is_contiguous()
    routed = dar(model, (x, t, y), query="static", chunk=2)
    layouts, mix = [], routekit.dar.aggregate

    def recording(sources, *args, **kwargs):
        layouts.append([v.is_contiguous() for v in sources])
        return mix(sources, *args, **kwargs)

    monkeypatch.setattr(routekit.dar, "aggregate", recording)
    run(routed, (x, t, y), train=True)
    assert len(layouts) == 4 and all(all(found) for found in layouts), layouts


class CastingLayerNorm(nn.LayerNorm):
    """A LayerNorm in fp32 whatever its input, as some diffusion code writes it: not torch's forward (and a
    branch on a value, so the trace keeps it a module call, as it does any block it cannot see through)."""

    def forward(self, x):
        if bool(torch.isnan(x).any()):
            raise ValueError("NaN input")
        return super().forward(x.float()).to(x.dtype)


@pytest.mark.parametrize("norm", ["plain", "affine", "subclass", "hooked"])
def test_a_plain_norm_that_reads_a_merge_is_folded_into_it(monkeypatch, norm):
    """DiT's LayerNorms (no weight or bias) that read a two-phase chunk's merges are folded into the merge
    (``merge_for_norm`` then ``norm_of_merge``: under torch.compile the merge kernel gives the norm its rows'
    statistics), which on the reference path is exactly the module's LayerNorm of the merge. Norms with parameters (an
    FSDP unit around one must still run its forward), a subclass's forward or hooks stay modules."""
    import routekit.dar

    model = tiny_dit(depth=3)
    calls = []
    for block in model.blocks:
        if norm == "affine":
            block.norm1, block.norm2 = nn.LayerNorm(32, eps=1e-6), nn.LayerNorm(32, eps=1e-6)
        elif norm == "subclass":
            block.norm1 = CastingLayerNorm(32, eps=1e-6, elementwise_affine=False)
            block.norm2 = CastingLayerNorm(32, eps=1e-6, elementwise_affine=False)
        elif norm == "hooked":
            block.norm2.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(4))
    folded = dar(model, (x, t, y), query="static", chunk=2)
    randomise_queries(folded, 1)
    source = program_source(folded, True)
    # of the 6 norms after merges (the last one, norm_final, stays plain: traced through, a subclass is ops)
    assert source.count("dar_norm_of_merge(") == {"plain": 6, "affine": 1, "subclass": 1, "hooked": 3}[norm], source
    monkeypatch.setattr(routekit.rewrite, "fold_norms", lambda graph, model: 0)
    unfolded = dar(model, (x, t, y), query="static", chunk=2)
    unfolded.load_state_dict(folded.state_dict())
    for train in (True, False):
        assert torch.equal(run(folded, (x, t, y), train), run(unfolded, (x, t, y), train))
    calls.clear()  # each mode's program is built now: a run calls each norm2 once
    run(folded, (x, t, y), True)
    assert len(calls) == (3 if norm == "hooked" else 0)


@pytest.mark.parametrize("chunk", [None, 2])  # one aggregation per sublayer; two-phase chunks
def test_mixes_come_out_in_the_sublayers_dtype_under_autocast(monkeypatch, chunk):
    """Under bf16 autocast the sublayers give bf16 and so does every mix, though DiT's stream (patch
    embedding plus fp32 positions) is fp32: a mix is made afresh from the sources, not accumulated
    (routekit/dar.py). The train step still runs forward and backward to finite gradients."""
    import routekit.dar

    model = tiny_dit()
    x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(2))
    routed = dar(model, (x, t, y), query="static", chunk=chunk)
    dtypes, mix = [], routekit.dar.aggregate

    def recording(sources, *args, **kwargs):
        out = mix(sources, *args, **kwargs)
        dtypes.append((sources[0].dtype, out.dtype))
        return out

    monkeypatch.setattr(routekit.dar, "aggregate", recording)
    routed.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = routed(x, t, y)
    out.float().square().mean().backward()
    assert dtypes and all(pair == (torch.bfloat16, torch.bfloat16) for pair in dtypes), dtypes
    grads = [p.grad for p in routed.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("units", ["blocks", "leaf layers", "whole model"])
def test_fsdp_units_dar_cannot_reach_are_refused_with_what_to_do(tmp_path, units):
    """DAR inlines the blocks, so FSDP units around blocks would never gather their parameters: a
    routekit error says how to shard instead; leaf-layer or whole-model units train as unsharded."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = tiny_dit()
    x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    reference = dar(model, (x, t, y), chunk=2)
    randomise_queries(reference, 3)
    expected = run(reference, (x, t, y), train=True)
    sharded = dar(model, (x, t, y), chunk=2)  # applied before sharding, as accelerate.prepare comes after
    sharded.load_state_dict(reference.state_dict())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        if units == "blocks":
            for block in sharded.blocks:
                fully_shard(block)
        elif units == "leaf layers":
            for layer in [m for m in sharded.blocks.modules() if isinstance(m, nn.Linear)]:
                fully_shard(layer)
        fully_shard(sharded)
        sharded.train()
        if units == "blocks":
            with pytest.raises(rk.ConfigError, match=r"blocks\.0 is an FSDP unit.*Shard the whole model"):
                sharded(x, t, y)
            return
        out = sharded(x, t, y)
        out.float().pow(2).mean().backward()
        torch.testing.assert_close(out.detach(), expected, **TOL)
    finally:
        dist.destroy_process_group()


@FEW
@given(spec=specs(max_depth=3), seed=st.integers(0, 2**16))
def test_static_t_query_is_w_plus_the_timestep_embedding(spec, seed):
    model, example = build(spec), inputs(spec)
    routed = dar(model, example, query="static_t")
    randomise_queries(routed, seed)
    with torch.no_grad():
        expected = dar_by_hand(model, *example, mix=softmax_mix, query=routed.routekit.dar.query, mode="static_t")
    torch.testing.assert_close(run(routed, example, True), expected, **TOL)


def test_static_t_without_a_timestep_is_a_config_error():
    spec = Spec(kinds=(("ffn",),) * 3, ada=(True,) * 3, hidden=8, tokens=4, batch=2, seed=0)
    model = build(spec, Untimed)
    example = (inputs(spec)[0], torch.tensor([0, 3]))
    with pytest.raises(rk.ConfigError, match="timestep"):
        dar(model, example, query="static_t")
    dar(model, example, query="static")  # the model itself is fine
    with pytest.raises(rk.ConfigError, match="nowhere"):
        dar(build(spec), inputs(spec), query="static_t", timestep="nowhere")


@pytest.mark.parametrize("fields", [
    dict(chunk=0), dict(chunk=-2), dict(query="learned"), dict(query=None), dict(kernel="cuda"),
    dict(chunks=2), dict(chunk="two"),
])
def test_invalid_dar_config_is_a_config_error(fields):
    with pytest.raises(rk.ConfigError, match="DAR"):
        rk.DAR(**fields)


def test_residual_must_be_a_dar():
    spec = Spec(kinds=(("ffn",),) * 2, ada=(False,) * 2, hidden=8, tokens=4, batch=1, seed=0)
    with pytest.raises(rk.ConfigError, match="residual"):
        rk.apply(build(spec), residual="static", example_inputs=inputs(spec))


# --- 7: other backbones --------------------------------------------------------------------------------


@pytest.mark.parametrize("backbone, overrides, per_block", [
    (rwkv, {}, 2),
    (mamba, dict(d_state=8, headdim=16), 1),
    (mamba, dict(d_state=8, headdim=16, mlp_ratio=2.0), 2),
])
@pytest.mark.parametrize("chunk", [None, 3])
def test_dar_on_rwkv_and_mamba(backbone, overrides, per_block, chunk):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = backbone.build("S/2", depth=2, hidden=32, input_size=8, num_classes=10, **overrides)
    example = backbone.example_inputs(model, 2, generator=torch.Generator().manual_seed(0))
    routed = dar(model, example, chunk=chunk, stack="blocks")
    report = report_of(routed)
    assert [len(b.adds) for b in report.blocks] == [per_block, per_block]
    assert report.residual == "sublayer"
    assert routed.routekit.dar.query.shape == (2 * per_block, 32)
    routed.train()
    out = routed(*example)
    assert out.shape == example[0].shape
    out.square().mean().backward()
    assert routed.routekit.dar.query.grad is not None
    assert run(routed, example, False).shape == example[0].shape


# --- 8: state_dict ------------------------------------------------------------------------------------


@FEW
@given(spec=specs(max_depth=3), query=st.sampled_from(["static", "static_t", "dynamic"]))
def test_state_dict_is_the_models_plus_dar(spec, query):
    model, example = build(spec), inputs(spec)
    routed = dar(model, example, query=query)
    extra = {"routekit.dar.dynamic" if query == "dynamic" else "routekit.dar.query"}
    assert set(routed.state_dict()) == set(model.state_dict()) | extra
    randomise_queries(routed, spec.seed)
    queries = {k: v.clone() for k, v in routed.state_dict().items() if k in extra}
    # an original checkpoint loads strictly (DAR's keys are optional in it); the queries stay as they were
    original = build(Spec(**{**spec.__dict__, "seed": spec.seed + 1}))
    result = routed.load_state_dict(original.state_dict(), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in original.state_dict().items():
        assert torch.equal(routed.state_dict()[k], v)
    for k, v in queries.items():
        assert torch.equal(routed.state_dict()[k], v)
    # a DAR checkpoint round-trips, queries included
    again = dar(model, example, query=query)
    again.load_state_dict(routed.state_dict(), strict=True)
    assert torch.equal(run(again, example, False), run(routed, example, False))
    # a wrong key still raises
    wrong = dict(original.state_dict())
    wrong["blocks.0.not_a_weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="not_a_weight"):
        routed.load_state_dict(wrong, strict=True)
    missing = dict(original.state_dict())
    del missing["head.weight"]
    with pytest.raises(RuntimeError, match="head.weight"):
        routed.load_state_dict(missing, strict=True)


@FEW
@given(spec=specs(), chunk=st.sampled_from([2, 3, 4]), mode=st.sampled_from(["static", "static_t"]),
       seed=st.integers(0, 2**16))
def test_two_phase_chunks_give_the_gradients_of_dar_by_hand(spec, chunk, mode, seed):
    """Static queries are known before a chunk runs, so each chunk reads its shared sources once for
    all of its sublayers (a weighted sum from each shared source's logits, made once for every later
    chunk: shared_part) and each sublayer merges its own outputs in. The gradients of every model
    parameter and query are those of the plain loop."""
    model = build(spec)
    example = inputs(spec)
    routed = dar(model, example, chunk=chunk, query=mode)
    randomise_queries(routed, seed)
    state = routed.routekit.dar
    routed.train()
    if spec.sublayers >= 2:
        assert "shared_part" in program_source(routed, True)
    named = [(n, p) for n, p in routed.named_parameters() if not n.startswith("routekit.")]
    params = [p for _, p in named]
    got = torch.autograd.grad(routed(*example).square().sum(), [*params, state.query], allow_unused=True)
    loss = dar_by_hand(routed, *example, chunk=chunk, mix=softmax_mix, query=state.query, mode=mode).square().sum()
    want = torch.autograd.grad(loss, [*params, state.query], allow_unused=True)
    for (name, _), g, w in zip([*named, ("query", None)], got, want):
        if w is None:
            assert g is None or not g.any(), name
        else:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_two_phase_chunks_are_those_no_route_boundary_crosses():
    """DiT-XL/2's schedule: 28 blocks of 2 sublayers, chunks of 4, TREAD's route 2→24. Entering at block 2
    starts chunk 4..7 (allowed: the prefix is taken after the gather); leaving after block 24 falls inside
    chunk 48..51 (point 50), which keeps one aggregation per sublayer."""
    from routekit.decision import RoutePlan
    from routekit.plan import two_phase_chunks

    sizes = [2] * 28
    route = RoutePlan(rk.Route(start=2, end=24), start=2, end=24, keep=(), kept=128)
    chunks = two_phase_chunks(sizes, [route], rk.DAR(chunk=4))
    assert chunks == {p: 4 for p in range(0, 56, 4) if p != 48}
    assert two_phase_chunks(sizes, [], rk.DAR(chunk=3))[54] == 2  # a short last chunk of two points
    assert two_phase_chunks(sizes, [], rk.DAR(chunk=4, query="dynamic")) == {}
    assert two_phase_chunks(sizes, [], rk.DAR(chunk=1)) == {}


# --- DAR and the model it came from ---------------------------------------------------------------------------

def _pretrained_dit():
    """A DiT off its adaLN-Zero init (a trained model's branches are not gated to zero)."""
    torch.manual_seed(0)
    model = dit.build("S/2", depth=4, hidden=32, heads=2, input_size=8, num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model, dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("config", [{}, {"chunk": 2}, {"query": "static_t", "chunk": 3}, {"query": "dynamic"}])
def test_dar_preserve_starts_from_the_pretrained_model_bit_for_bit_and_learns_its_gates(config):
    """The paper's zero-init queries start at the uniform average, not at the residual sum a pretrained model was
    trained with: its output changes at step 0. DAR(preserve=True) blends each aggregation into its add by a gate
    that starts at 0, so at step 0 the model computes exactly what it did; the gates get gradients."""
    model, args = _pretrained_dit()
    plain = rk.apply(copy.deepcopy(model), residual=rk.DAR(**config), example_inputs=args).eval()
    kept = rk.apply(copy.deepcopy(model), residual=rk.DAR(preserve=True, **config), example_inputs=args)
    with torch.no_grad():
        want = model.eval()(*args)
        assert not torch.equal(plain(*args), want)  # what preserve is for (pre-norm blocks hide most of it)
        assert torch.equal(kept.eval()(*args), want)
    model.train()
    torch.manual_seed(5)
    want = model(*args)
    kept.train()
    torch.manual_seed(5)
    got = kept(*args)
    assert torch.equal(got, want)
    got.square().mean().backward()
    assert kept.routekit.dar.gate.grad.abs().sum() > 0


def test_strip_of_a_dar_model_refuses_unless_told_to_drop_what_it_learned():
    model, args = _pretrained_dit()
    routed = rk.apply(model, routes=rk.Route(start=1, end=2), residual=rk.DAR(), example_inputs=args)
    with pytest.raises(rk.ConfigError, match=r"has DAR .*drop_learned=True"):
        rk.strip(routed)
    assert rk.strip(routed, drop_learned=True) is model
    assert rk.strip(rk.apply(model, routes=rk.Route(start=1, end=2), example_inputs=args)) is model  # routes only


def test_dar_on_blocks_with_no_residual_add_is_refused_by_name():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return torch.tanh(self.fc(self.norm(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Plain() for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.raises(rk.ConfigError, match=r"blocks\.0 \(and 3 more blocks\) has none: its output is not its input"):
        rk.apply(Net(), residual=rk.DAR(), example_inputs=(torch.randn(2, 6, 8),))


class TwoSublayers(nn.Module):
    """Two token-wise residual sublayers: DAR's aggregation points."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.fcs = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def branch(self, j, x):
        return self.fcs[j](self.norms[j](x))

    def forward(self, x):
        for j in range(2):
            x = x + self.branch(j, x)
        return x


def dar_mean_by_hand(model: Tokens, x, chunk, spans) -> torch.Tensor:
    """DAR with zero queries (each aggregation the mean of its sources), token-wise blocks; per route (start,
    end, routed (B, N) bool): a routed token's sublayer outputs inside the route are 0 and its stream keeps its
    route-start value."""
    h = model.embed(x)
    closed, current, frozen = [h], [], None
    for i, block in enumerate(model.blocks):
        routed = next((m[..., None] for s, e, m in spans if s <= i <= e), None)
        if any(s == i for s, _, _ in spans):
            frozen = h
        for j in range(2):
            v = block.branch(j, h)
            if routed is not None:
                v = torch.where(routed, torch.zeros_like(v), v)
            current.append(v)
            if chunk and len(current) == chunk:
                closed.append(sum(current[1:], current[0]))
                current = []
            h = torch.stack(closed + current).mean(0)
            if routed is not None:
                h = torch.where(routed, frozen, h)
    return h


@pytest.mark.parametrize("chunk", [None, 3])
def test_dar_with_two_routes_gives_routed_tokens_zero_sources_and_keeps_every_other_source(chunk):
    """Sources made before a route (v_0 included) and between routes come back whole after it; a chunk begun
    before a route keeps its pre-route part for the routed tokens."""
    model, x = built(Tokens, 4, TwoSublayers), tokens(n=8)
    routes = [rk.Route(start=0, end=0, rate=0.5), rk.Route(start=2, end=2, rate=0.5)]
    routed = rk.apply(model, routes, residual=rk.DAR(chunk=chunk, kernel="torch"), example_inputs=x,
                      generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = train_out(routed, x)
        spans = [(r.start, r.end, rk.last_route_mask(routed, route=k)) for k, r in enumerate(routes)]
        assert all(m.any() for _, _, m in spans)
        torch.testing.assert_close(out, dar_mean_by_hand(model, x, chunk, spans), atol=1e-5, rtol=0)


class Positional(Mlp):
    """Specialised to its token count: a position ramp made from the count as a Python int (a trace-time
    constant inside the block)."""

    def forward(self, x):
        n = int(x.shape[1])
        ramp = torch.arange(n, dtype=torch.float32)[:, None] / n
        return x + self.fc(self.norm(x)) * (1 + ramp)


def test_dar_retraces_a_block_specialised_to_its_token_count_at_the_count_a_route_gives_it():
    model, x = built(Tokens, 4, Positional), tokens(n=2 * D)  # the route keeps D tokens: as many as the channels
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), residual=rk.DAR(kernel="torch"), example_inputs=x,
                      generator=torch.Generator().manual_seed(0))
    assert report_of(routed).placed[0].kept == D
    out = train_out(routed, x)
    assert out.shape == (2, 2 * D, D) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert routed.routekit.dar.query.grad.abs().sum() > 0


def test_dar_inlines_blocks_that_return_tuples():
    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, D)
            self.blocks = nn.ModuleList(TupleBlock() for _ in range(3))

        def forward(self, x):
            h, aux = self.embed(x), 0
            for block in self.blocks:
                h, a = block(h)
                aux = aux + a
            return h, aux

    model, x = built(Owner), tokens()
    routed = rk.apply(model, residual=rk.DAR(kernel="torch"), example_inputs=x)
    assert rk.verify(model, routed, x).outputs == 2
    with torch.no_grad():  # zero queries: each of the three aggregations is the mean of its sources
        h = model.embed(x)
        sources = [h]
        for block in model.blocks:
            sources.append(block.fc(h))
            h = torch.stack(sources).mean(0)
        torch.testing.assert_close(train_out(routed, x)[0], h, atol=1e-5, rtol=0)


def test_the_norm_folded_into_a_merge_is_the_layer_norm_of_the_merge_where_the_kernel_gives_the_statistics(
        monkeypatch):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 5, D, generator=g) for _ in range(3)]
    query, mix, lse = torch.randn(D, generator=g), torch.randn(2, 5, D, generator=g), torch.randn(2, 5, generator=g)
    want = F.layer_norm(rk_dar.merge(sources, query, mix, lse, 1e-6, "torch"), (D,), eps=1e-5)
    monkeypatch.setattr(rk_dar, "merge_with_stats", lambda s, q, eps, kernel, prefix, norm_eps: naive.merge_with_stats(
        s, q, eps, prefix=prefix, norm_eps=norm_eps))
    got = rk_dar.layer_norm_of_merge(sources, query, mix, lse, 1e-5, 1e-6, "torch")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- 9: every dtype a model trains in, and e(t) where the model computes it ------------------------------------

def _diffusers_dit(batch: int = 2):
    """diffusers' DiTTransformer2DModel from a tiny config, called with float timesteps (as samplers do)."""
    try:
        model, (x,), kwargs = zoo.diffusers_dit()
    except zoo.Missing as err:
        pytest.skip(str(err))
    kwargs = {"timestep": torch.tensor([3.0, 7.0])[:batch], "class_labels": kwargs["class_labels"][:batch],
              "return_dict": False}
    return model, (x[:batch],), kwargs


def _backbone(name: str, batch: int = 2):
    """(model, args, kwargs) of a repository backbone or of diffusers' DiT, small, with random weights."""
    if name == "diffusers_dit":
        return _diffusers_dit(batch)
    module = {"dit": dit, "mamba": mamba, "rwkv": rwkv}[name]
    extra = dict(heads=2) if module is dit else dict(d_state=8, headdim=16) if module is mamba else {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = module.build("S/2", depth=3, hidden=32, input_size=8, num_classes=10, **extra)
        with torch.no_grad():  # off adaLN-Zero's init, so every sublayer's output counts
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape))
    return model, module.example_inputs(model, batch, generator=torch.Generator().manual_seed(1)), {}


def _cast(value, dtype: torch.dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _call(routed: nn.Module, args, kwargs, train: bool) -> torch.Tensor:
    routed.train(train)
    torch.manual_seed(7)  # the same label dropout in every call that draws one
    out = routed(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("query", ["static", "static_t", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["dit", "mamba", "rwkv", "diffusers_dit"])
def test_dar_on_a_model_cast_before_apply_runs_in_its_dtype_and_computes_what_fp32_does(name, dtype, query):
    """A model cast to bf16 or fp64 before `apply` (as users cast a model for training) gets DAR's parameters in its
    dtype and trains in it, every query kind; the math agrees with the same model in fp32 to the dtype's precision
    (the logits and softmax run in fp32, fp64 for an fp64 model)."""
    model, args, kwargs = _backbone(name)
    reference = rk.apply(copy.deepcopy(model), residual=rk.DAR(query=query, chunk=2), example_inputs=args,
                         example_kwargs=kwargs)
    cast_args, cast_kwargs = [_cast(a, dtype) for a in args], {k: _cast(v, dtype) for k, v in kwargs.items()}
    routed = rk.apply(model.to(dtype), residual=rk.DAR(query=query, chunk=2), example_inputs=cast_args,
                      example_kwargs=cast_kwargs)
    assert {p.dtype for p in routed.routekit.dar.parameters()} == {dtype}
    randomise_queries(routed, 0, scale=0.5)
    with torch.no_grad():
        for mine, theirs in zip(routed.routekit.dar.parameters(), reference.routekit.dar.parameters()):
            mine.mul_(0.5)  # dynamic queries: W_l v is larger than w_l
            theirs.copy_(mine)
    tolerance = 1e-5 if dtype == torch.float64 else 5e-2
    for train in (True, False):
        got = _call(routed, cast_args, cast_kwargs, train)
        assert got.dtype == dtype
        with torch.no_grad():
            want = _call(reference, args, kwargs, train)
        assert (got.detach().double() - want.double()).norm() <= tolerance * want.double().norm()
    got.float().square().mean().backward()
    grads = [p.grad for p in routed.routekit.dar.parameters()]
    assert all(g is not None and g.dtype == dtype and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def _static_t_is_static_plus(model: nn.Module, args, kwargs, embedding: torch.Tensor) -> None:
    """At batch 1 the static_t query w_l + e(t) is a static one: DAR(static_t) with queries w equals DAR(static)
    with queries w + e(t) when `embedding` is the model's e(t), in training and in eval."""
    timed = rk.apply(copy.deepcopy(model), residual=rk.DAR(query="static_t", chunk=2), example_inputs=args,
                     example_kwargs=kwargs)
    plain = rk.apply(copy.deepcopy(model), residual=rk.DAR(query="static", chunk=2), example_inputs=args,
                     example_kwargs=kwargs)
    randomise_queries(timed, 0, scale=0.5)
    with torch.no_grad():
        plain.routekit.dar.query.copy_(timed.routekit.dar.query + embedding)
        for train in (True, False):
            torch.testing.assert_close(_call(timed, args, kwargs, train), _call(plain, args, kwargs, train),
                                       atol=1e-5, rtol=1e-5)


def test_static_t_on_diffusers_dit_reads_the_embedding_it_computes_after_the_stack():
    """diffusers' DiT embeds the timestep inside each block, and at its own level only after the stack (block 0's
    embedder, for the output layer's conditioning, cast to the blocks' output dtype): DAR computes that e(t)
    before the first block, reading the dtype off the stream entering it."""
    model, args, kwargs = _diffusers_dit(batch=1)
    emb = model.transformer_blocks[0].norm1.emb
    with torch.no_grad():
        embedding = emb.timestep_embedder(emb.time_proj(kwargs["timestep"]))[0]
    assert embedding.abs().max() > 0.1
    _static_t_is_static_plus(model, args, kwargs, embedding)


class LateTime(Net):
    """Computes a second timestep embedding after its blocks, for its output layer; `in_place` scales it in place."""

    def __init__(self, spec: Spec, in_place: bool = False):
        super().__init__(spec)
        self.t3, self.in_place = nn.Linear(1, spec.hidden), in_place

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, c = self.stream(x), self.cond(t)
        for block in self.blocks:
            h = block(h, c)
        e = self.t3(t.unsqueeze(-1))
        if self.in_place:
            e = e.mul_(2.0)
        return self.output(h * (1 + e.unsqueeze(1)))


class PooledHead(Net):
    """Conditions its output layer on a (batch, channels) embedding of the blocks' pooled output."""

    def __init__(self, spec: Spec):
        super().__init__(spec)
        self.pool = nn.Linear(spec.hidden, spec.hidden)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, c = self.stream(x), self.cond(t)
        for block in self.blocks:
            h = block(h, c)
        return self.output(h + self.pool(h.mean(1)).unsqueeze(1))


def test_static_t_takes_an_embedding_made_after_the_stack_or_refuses_naming_why():
    spec = Spec(kinds=(("attn", "ffn"),) * 3, ada=(True,) * 3, hidden=8, tokens=4, batch=1, seed=0)
    example = inputs(spec)
    model = build(spec, LateTime)  # e(t) found: the last (batch, channels) value made from t alone
    with torch.no_grad():
        embedding = model.t3(example[1].unsqueeze(-1))[0]
    _static_t_is_static_plus(model, example, {}, embedding)
    with pytest.raises(rk.ConfigError, match="in-place mul_"):
        dar(build(spec, lambda s: LateTime(s, in_place=True)), example, query="static_t")
    with pytest.raises(rk.ConfigError, match="computed from the blocks' output"):
        dar(build(spec, PooledHead), example, query="static_t", timestep="pool")

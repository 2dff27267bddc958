"""Laws of the route core that the rest of the suite left unheld: each one here kills mutants that survived
benchmarks/mutation.py (benchmarks/results/mutation.md lists which), grouped by the module whose law it is.

Small deterministic cases, no Hypothesis: each test states one behaviour of the code as its users meet it
(what analysis finds, what a plan refuses, what a routed model computes), never the shape of a mutant.
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import routekit as rk
from routekit import dar as rk_dar
from routekit.calls import bind_arguments, call_spec
from routekit.errors import ConfigError, InferenceChanged, InputError, SelectorError
from routekit.kernels import naive
from routekit.model import observe
from routekit.plan import checked_grid, make_plan
from routekit.probe import Probe
from routekit.residuals import find_residual_adds
from routekit.routing import gather_tokens, select_tokens, with_forced
from routekit.selectors import checked, get_selector, importance, keeps_rows, selector
from routekit.sides import _grid_axis, _token_axes
from routekit.trace import trace
from routekit.values import TensorMeta
from routekit.verify import _compare

pytestmark = pytest.mark.usefixtures("one_thread")

D = 8


class Mlp(nn.Module):
    """A pre-norm residual MLP block: token-wise, one residual add."""

    def __init__(self, d: int = D, dropout: float = 0.0):
        super().__init__()
        self.norm, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc(self.norm(x)))


class Mixer(nn.Module):
    """A block that mixes tokens (each output token reads the mean of all): where a token comes from is
    lost after it."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(x).mean(1, keepdim=True)


class Tokens(nn.Module):
    """(B, N, 3) tokens in, through a Linear embedding and a stack of blocks."""

    def __init__(self, depth: int = 4, block=Mlp):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


class Patches(nn.Module):
    """An image in, through a 2×2 patch convolution and a stack of blocks."""

    def __init__(self, depth: int = 3, block=Mlp):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, 2)
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, image):
        h = self.embed(image).flatten(2).transpose(1, 2)
        for block in self.blocks:
            h = block(h)
        return h


def tokens(batch: int = 2, n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, n, 3, generator=torch.Generator().manual_seed(seed))


def built(cls, *args, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args, **kwargs)


def train_out(model: nn.Module, *inputs, seed: int = 0):
    model.train()
    torch.manual_seed(seed)
    return model(*inputs)


# ==== trace ========================================================================================================


def test_dtypes_slices_and_generators_passed_to_a_forward_are_constants_not_graph_inputs():
    class Casts(nn.Module):
        def forward(self, x, dtype, part, generator):
            return x[part].to(dtype)

    bound = bind_arguments(Casts.forward, (torch.ones(4, 2), torch.float16, slice(0, 2), torch.Generator()), {})
    spec = call_spec(bound)
    assert spec.names == ("x",)
    assert set(spec.constants) == {"dtype", "part", "generator"}


def test_every_graph_input_gets_its_own_identifier_however_the_names_of_leaves_collide():
    class Many(nn.Module):
        def forward(self, a, a_0, a_0_0, a_0_1, x, x_a):
            return a[0] + a_0 + a_0_0 + a_0_1 + x["a_b"] + x_a["b"]

    t = torch.ones(2)
    spec = call_spec(bind_arguments(Many.forward, ([t], t, t, t, {"a_b": t}, {"b": t}), {}))
    assert len(spec.names) == len(set(spec.names)) == 6
    assert all(name.isidentifier() for name in spec.names), spec.names


class Store:
    """An object the forward writes into (a cache): a graph input, not a constant."""

    def __init__(self):
        self.items = {}

    def __setitem__(self, key, value):
        self.items[key] = value


def test_item_assignment_into_an_object_passed_in_is_recorded_without_specialising():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x, store):
            store["h"] = self.fc(x)
            return x + 1

    tr = trace(built(Writes), (torch.randn(2, D), Store()))
    assert tr.specialised == []
    assert any(n.target is operator.setitem for n in tr.graph.nodes)


class Counter:
    """An object passed in whose state the forward advances (a cache's length)."""

    def __init__(self):
        self.n = 1

    def bump(self):
        self.n += 1


def test_an_attribute_keeps_the_value_it_had_when_the_forward_read_it():
    class Reads(nn.Module):
        def forward(self, x, counter):
            n = counter.n
            y = x * n  # n is a graph value now
            counter.bump()
            return y * {1: 10.0, 2: 20.0}[n]  # eager: n is still 1

    tr = trace(Reads(), (torch.ones(2), Counter()))
    assert any(s.startswith("bool() = True") for s in tr.specialised), tr.specialised


def test_the_forward_sees_fx_tracing_throughout_the_trace_as_under_fx():
    class Peeks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.seen = nn.Linear(D, D), []

        def forward(self, x):
            self.seen.append(torch.fx._symbolic_trace.is_fx_symbolic_tracing())
            h = self.fc(x) + 1
            self.seen.append(torch.fx._symbolic_trace.is_fx_symbolic_tracing())
            return h

    model = built(Peeks)
    trace(model, (torch.randn(2, D),))
    assert model.seen == [True, True]
    assert not torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def test_shape_arithmetic_the_graph_does_not_use_is_dropped():
    class Square(nn.Module):
        def forward(self, x):
            b, n, d = x.shape
            side = int(n ** 0.5)
            return x.reshape(b, side, side, d).sum(2)

    tr = trace(Square(), (torch.randn(2, 9, 4),))
    unused = [n.name for n in tr.graph.nodes if n.op in ("call_function", "call_method") and not n.users]
    assert unused == []
    assert any("int()" in s for s in tr.specialised)


# ==== analysis =====================================================================================================


def test_a_side_input_holding_a_tensor_among_numbers_is_per_sample():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x, cond):
            c, weight = cond
            return x + weight * self.fc(x + c[:, None])

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Scaled() for _ in range(3))

        def forward(self, x, c):
            for block in self.blocks:
                x = block(x, (c, 0.5))
            return x

    report = rk.inspect(built(Owner), (torch.randn(2, 5, D), torch.randn(2, D)))
    (side,) = report.blocks[0].side_inputs
    assert side.kind == "per-sample", side


def test_the_report_is_frozen():
    report = rk.inspect(built(Tokens), tokens()).report
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.stack = "elsewhere"


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return x + h, h.square().mean()


def test_the_stack_is_the_chain_carrying_the_tokens_even_when_a_longer_chain_of_other_modules_exists():
    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.cond = nn.ModuleList(nn.Linear(D, D) for _ in range(4))  # a longer chain, on a (B, D) vector
            self.blocks = nn.ModuleList(TupleBlock() for _ in range(3))

        def forward(self, x, c):
            for layer in self.cond:
                c = layer(c)
            aux = 0
            for block in self.blocks:
                x, a = block(x)
                aux = aux + a
            return x + c[:, None], aux

    report = rk.inspect(built(Owner), (torch.randn(2, 5, D), torch.randn(2, D)))
    assert (report.stack, report.depth, report.stream_out_index) == ("blocks", 3, 0)


def test_a_stack_nested_two_modules_deep_is_found():
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Mlp() for _ in range(3))

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.body = nn.Linear(3, D), Body()

        def forward(self, x):
            h = self.embed(x)
            for block in self.body.blocks:
                h = block(h)
            return h

    report = rk.inspect(built(Owner), tokens())
    assert (report.stack, report.depth) == ("body.blocks", 3)


def test_a_stack_of_image_blocks_is_refused_with_an_analysis_error_naming_its_stream():
    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.raises(rk.AnalysisError, match="batch, tokens, channels"):
        rk.inspect(built(Convs), (torch.randn(2, 4, 6, 6),))


def test_the_stream_out_of_a_tuple_block_is_its_stream_item_whatever_else_reads_the_tuple():
    class Tap(nn.Module):
        """A leaf the owner hands a block's whole output to, with an axis."""

        def forward(self, out, axis):
            return out[1].sum() * 0 + axis

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, D)
            self.blocks = nn.ModuleList(TupleBlock() for _ in range(3))
            self.taps = nn.ModuleList([Tap()])

        def forward(self, x):
            h, aux = self.embed(x), 0
            for block in self.blocks:
                out = block(h)
                aux = aux + out[1]  # the aux item read first
                aux = aux + self.taps[0](out, 0)
                h = out[0]
            return h, aux

    model, x = built(Owner), tokens(n=8)
    routed = rk.apply(model, rk.Route(start=1, end=1, rate=0.5), example_inputs=x,
                      generator=torch.Generator().manual_seed(0))
    assert rk.verify(model, routed, x)["outputs"] == 2
    assert train_out(routed, x)[0].shape == (2, 8, D)


def test_a_zero_dimensional_tensor_handed_to_the_blocks_is_a_per_sample_input():
    class Scaled(Mlp):
        def forward(self, x, scale):
            return x + scale * self.fc(self.norm(x))

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Scaled() for _ in range(3))

        def forward(self, x, scale):
            for block in self.blocks:
                x = block(x, scale)
            return x

    report = rk.inspect(built(Owner), (torch.randn(2, 5, D), torch.tensor(0.5)))
    assert [s.kind for s in report.blocks[0].side_inputs] == ["per-sample"]


def test_a_table_as_long_as_the_stream_joined_with_another_input_is_a_joint_table():
    assert _token_axes(TensorMeta((2, 3 + 6, D), torch.float32), 2, 6, D, {3}) == ((1,), True, True)
    assert _token_axes(TensorMeta((2, 6, D), torch.float32), 2, 6, D, {3}) == ((1,), True, False)


@pytest.mark.parametrize(("name", "axis"), [("rows", -2), ("cols", -1), ("columns", -1), ("t", -3), ("time", -3),
                                            ("height", -2), ("grid_w", -1), ("num_frames", -3), ("scale", None)])
def test_numbers_handed_to_blocks_are_grid_sizes_by_their_names(name, axis):
    assert _grid_axis(name, ()) == axis


class JointBlock(nn.Module):
    """MMDiT-like: joins text tokens before the stream, reads a joint (B, text + N, D) table. Rotates half of
    the stream's features first (a cat of the stream with itself, as rotary embeddings do)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, text, table, c):
        rotated = torch.cat([x[..., D // 2:], x[..., :D // 2]], -1)
        joint = torch.cat([text, x + rotated], 1) * table
        return x + self.fc(joint)[:, text.shape[1]:] * c[:, None]


def test_a_joint_table_is_ordered_from_the_blocks_own_join_beside_other_side_inputs():
    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(JointBlock() for _ in range(3))

        def forward(self, x, text, table, c):
            for block in self.blocks:
                x = block(x, text, table, c)
            return x

    inputs = (torch.randn(2, 6, D), torch.randn(2, 3, D), torch.randn(2, 9, D), torch.randn(2, D))
    report = rk.inspect(built(Owner), inputs)
    table = report.blocks[0].side_inputs[1]
    assert table.unordered == ()
    assert [(g.axes, g.rest_first) for g in table.tokens] == [((1,), True)]


class Registers(nn.Module):
    """A 4×6 patch grid with two learned tokens before it, joined by a cat of a tuple a leaf returns (the graph
    does not show which tokens are the grid's: analysis measures them)."""

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.registers = nn.Parameter(torch.randn(1, 2, D))

        def forward(self, patches):
            return self.registers.expand(patches.shape[0], -1, -1), patches

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, 2)
        self.join = nn.ModuleList([Registers.Join()])
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))
        self.head = nn.Linear(D, 3)

    def forward(self, image):
        patches = self.embed(image).flatten(2).transpose(1, 2)
        h = torch.cat(self.join[0](patches), dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def image(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 12, generator=torch.Generator().manual_seed(seed))


def test_tokens_not_made_from_the_image_are_measured_special_and_the_grid_is_the_image_over_the_patch():
    model = built(Registers)
    head_runs = []
    model.head.register_forward_hook(lambda *_: head_runs.append(1))
    report = rk.inspect(model, (image(),))
    assert (report.special, report.grid) == ((0, 1), (4, 6))
    assert head_runs == [1]  # in the trace; measuring runs the model up to the first block, no further


def test_a_model_whose_patch_grid_holds_every_token_is_not_run_again_to_measure():
    model = built(Patches)
    embeds = []
    model.embed.register_forward_hook(lambda *_: embeds.append(1))
    report = rk.inspect(model, (image(),))
    assert (report.grid, report.special) == ((4, 6), ())
    assert embeds == [1]  # in the trace, and no more


def test_without_a_patch_embedding_or_special_tokens_no_grid_is_guessed():
    class Patchify(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(12, D)
            self.blocks = nn.ModuleList(Mlp() for _ in range(3))

        def forward(self, image):
            b = image.shape[0]
            patches = image.reshape(b, 3, 4, 2, 6, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, 24, 12)
            h = self.embed(patches)
            for block in self.blocks:
                h = block(h)
            return h

    report = rk.inspect(built(Patchify), (image(),))
    assert (report.grid, report.special) == (None, ())
    with pytest.raises(ConfigError, match="grid"):
        rk.inspect(built(Patchify), (image(),), routes=rk.Route(start=0, end=1, selector="row"))


class OnePatch(nn.Module):
    """Boundary mode: one patch token (a 1×1 grid) after two learned tokens, a second image input (a control
    image: the call has no one image), a number, and blocks that mix tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 4, 4)
        self.registers = nn.Parameter(torch.randn(1, 2, D))
        self.blocks = nn.ModuleList(Mixer() for _ in range(3))

    def forward(self, image, control, scale):
        patch = self.embed(image).flatten(2).transpose(1, 2) * scale + control.mean()
        h = torch.cat([self.registers.expand(image.shape[0], -1, -1), patch], 1)
        for block in self.blocks:
            h = block(h)
        return h


def test_a_recording_measures_the_tokens_not_made_from_its_patch_embedding_at_the_first_block():
    inputs = (torch.randn(2, 3, 4, 4), torch.randn(2, 1, 4, 4), 2.0)
    report = rk.inspect(built(OnePatch), inputs, mode="boundary")
    assert (report.mode, report.grid, report.grid_node, report.special) == ("boundary", (1, 1), "embed", (0, 1))


class GatedBlock(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how, self.norm, self.fc = how, nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        branch = self.fc(self.norm(x))
        if self.how == "times":
            return x * branch
        if self.how == "mul":
            return x.mul(branch)
        if self.how == "add":
            return x.add(branch)
        return x + branch


def residual_adds(block: nn.Module, with_output: bool = True) -> list[str]:
    tr = trace(block, (torch.randn(2, 5, D),))
    start = next(n for n in tr.graph.nodes if n.op == "placeholder")
    (out,) = next(n for n in tr.graph.nodes if n.op == "output").args[0]
    return [n.target.__name__ if callable(n.target) else n.target
            for n in find_residual_adds(tr.graph, start, out if with_output else None)]


@pytest.mark.parametrize(("how", "adds"), [("times", []), ("mul", []), ("add", ["add"]), ("plus", ["add"])])
def test_residual_adds_are_sums_with_the_stream_in_any_spelling_and_never_products(how, adds):
    assert residual_adds(built(GatedBlock, how)) == adds


def test_residual_adds_without_an_output_to_end_at_are_the_chain_found():
    class PostNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(D, D), nn.LayerNorm(D)

        def forward(self, x):
            return self.norm(x + self.fc(x))

    block = built(PostNorm)
    assert residual_adds(block, with_output=True) == []  # the chain does not end at the output
    assert residual_adds(block, with_output=False) == ["add"]


# ==== plan =========================================================================================================


def test_the_flop_fraction_counts_routed_blocks_at_their_kept_tokens():
    plan = rk.inspect(built(Tokens), tokens(n=10), routes=rk.Route(start=1, end=2, rate=0.5))
    assert plan.route_at() == {1: 0, 2: 0}
    assert plan.block_flop_fraction() == pytest.approx((2 * 10 + 2 * 5) / (4 * 10))


def test_a_call_that_changes_the_number_of_dar_aggregations_is_refused():
    class Cut(Tokens):
        def forward(self, x, depth: int = 4):
            h = self.embed(x)
            for block in self.blocks[:depth]:
                h = block(h)
            return h

    model = built(Cut)
    routed = rk.apply(model, residual=rk.DAR(kernel="torch"), example_inputs=tokens(), example_kwargs={"depth": 4})
    routed.train()
    with pytest.raises(ConfigError, match="aggregation points"):
        routed(tokens(), depth=3)


def test_a_user_grid_may_be_a_video_grid():
    assert checked_grid((2, 2, 3), 12) == (2, 2, 3)
    assert checked_grid([3, 4], 12) == (3, 4)


def test_a_grid_selector_takes_a_keep_of_exactly_the_tokens_outside_the_grid_where_analysis_found_none():
    model = built(Registers)
    report = rk.inspect(model, (image(),)).report
    report = dataclasses.replace(report, stacks=(dataclasses.replace(report.stacks[0], special=()),))
    plan = make_plan(report, [rk.Route(start=0, end=1, selector="row", keep=[0, 1])], None, Probe(model, report))
    assert plan.placed[0].keep == (0, 1)


def test_a_block_that_reshapes_its_tokens_to_rows_of_two_needs_a_row_selector():
    class Rows(Mlp):
        def forward(self, x):
            b, n, d = x.shape
            rows = x.reshape(b, n // 2, 2, d)  # fails on an odd count
            return x + self.fc(self.norm(rows.flatten(1, 2)))

    model, inputs = built(Patches, 3, Rows), (torch.randn(2, 3, 8, 4),)  # a 4×2 grid
    with pytest.raises(ConfigError, match="whole grid rows"):
        rk.inspect(model, inputs, routes=rk.Route(start=0, end=1, selector="random"))
    assert rk.inspect(model, inputs, routes=rk.Route(start=0, end=1, selector="row")).placed[0].kept == 4


def test_a_route_shares_one_selection_where_a_block_cannot_take_a_table_per_sample_beside_a_batched_mask():
    class Rope(Mlp):
        def forward(self, x, mask, rope):
            return x + mask[..., None] * self.fc(self.norm(torch.einsum("bnd,nd->bnd", x, rope)))

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Rope() for _ in range(3))

        def forward(self, x, mask, rope):
            for block in self.blocks:
                x = block(x, mask, rope)
            return x

    inputs = (torch.randn(2, 6, D), torch.rand(2, 6), torch.randn(6, D))
    plan = rk.inspect(built(Owner), inputs, routes=rk.Route(start=0, end=1, rate=0.5))
    assert [s.tokens[0].batched for s in plan.blocks[0].side_inputs] == [True, False]
    assert plan.placed[0].shared


def test_dar_on_a_report_whose_blocks_were_not_traced_alone_is_a_config_error():
    model = built(Tokens)
    _, report = observe(model, (tokens(),), {}, residual=False)
    with pytest.raises(ConfigError, match="traced alone"):
        make_plan(report, [], rk.DAR(kernel="torch"), Probe(model, report))


# ==== rewrite (DAR) ================================================================================================


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
    assert rk.report_of(routed).placed[0].kept == D
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
    assert rk.verify(model, routed, x)["outputs"] == 2
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


# ==== model ========================================================================================================


def test_the_training_graph_keeps_the_owners_dropout():
    class Dropped(Tokens):
        def forward(self, x):
            h = F.dropout(self.embed(x), 0.5, self.training)  # traced as the mode it is traced in
            for block in self.blocks:
                h = block(h)
            return h

    model, x = built(Dropped), tokens()
    model.eval()  # apply traces the training graph whatever mode the model is in
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=x)
    assert rk.verify(model, routed, x)["train"] == "rate 0 bit-identical"


def test_a_routed_model_runs_a_call_of_another_batch_size():
    model = built(Tokens)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens(batch=2))
    assert train_out(routed, tokens(batch=3)).shape == (3, 6, D)


def test_loading_a_checkpoint_copies_into_the_routed_models_own_parameters():
    model = built(Tokens)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    weight = routed.embed.weight
    checkpoint = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    routed.load_state_dict(checkpoint)
    assert routed.embed.weight is weight and model.embed.weight is weight
    checkpoint["embed.weight"].zero_()
    assert torch.equal(weight, model.state_dict()["embed.weight"]) and weight.abs().sum() > 0


def test_a_dar_model_loads_the_original_checkpoint_strictly_keeping_its_queries():
    model = built(Tokens)
    routed = rk.apply(model, residual=rk.DAR(kernel="torch"), example_inputs=tokens())
    with torch.no_grad():
        routed.routekit.dar.query.fill_(0.5)
    result = routed.load_state_dict(model.state_dict())
    assert result.unexpected_keys == [] and [k for k in result.missing_keys] == ["routekit.dar.query"]
    assert (routed.routekit.dar.query == 0.5).all()


def test_a_routed_forward_returns_non_finite_outputs_unless_asked_to_check():
    model = built(Tokens)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    bad = tokens()
    bad[0, 0, 0] = float("nan")
    assert train_out(routed, bad).isnan().any()
    checking = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens(), check_finite=True)
    with pytest.raises(rk.NonFiniteError):
        train_out(checking, bad)


def test_example_kwargs_keyed_by_anything_but_names_are_refused_saying_so():
    with pytest.raises(InputError, match="keyword arguments by name"):
        rk.apply(built(Tokens), example_inputs=tokens(), example_kwargs={1: tokens()})


def test_a_route_that_would_change_the_training_output_shapes_is_refused():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            return x + self.fc(x), x.flatten(1)  # a per-sample value whose size is the token count's

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Flat() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x, flat = block(x)
            return x, flat

    with pytest.raises(ConfigError, match="output shapes"):
        rk.apply(built(Owner), rk.Route(start=1, end=2, rate=0.5), example_inputs=torch.randn(2, 6, D))


def test_force_keep_refuses_a_mask_that_is_not_batch_by_tokens_at_once():
    routed = rk.apply(built(Tokens), rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    with pytest.raises(InputError, match="bool"):
        with rk.force_keep(routed, torch.ones(6, dtype=torch.bool)):
            pass


# ==== routing ======================================================================================================


def test_a_table_shared_by_the_batch_is_gathered_per_sample():
    for count, index in ((5, torch.tensor([[0, 2], [1, 4], [3, 4]])), (3, torch.tensor([[0], [2], [1]]))):
        table = torch.arange(float(count))[None, :, None].expand(1, count, 2)
        assert torch.equal(gather_tokens(table, index)[..., 0], index.float())


def test_at_rate_zero_a_force_keep_mask_changes_nothing_whatever_the_selector():
    model = built(Registers)
    routed = rk.apply(model, rk.Route(start=0, end=1, rate=0.0, selector="row", keep=[0, 1]), example_inputs=image())
    with rk.force_keep(routed, torch.ones(2, 26, dtype=torch.bool)):
        train_out(routed, image())
    assert not rk.last_route_mask(routed).any()


def test_a_force_keep_mask_must_be_bool_and_cover_the_stream():
    index = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(SelectorError, match="bool"):
        with_forced(index, torch.ones(2, 4), "random", None, 4)
    with pytest.raises(SelectorError, match=r"here \(2, 4\); got torch.bool \(2, 5\)"):
        with_forced(index, torch.ones(2, 5, dtype=torch.bool), "random", None, 4)


# ==== selectors ====================================================================================================


def test_register_selector_hands_back_the_function_it_decorates():
    def halves(batch, n, rate, **kw):
        return torch.arange(n - n // 2).expand(batch, -1)

    assert rk.register_selector("t_halves_decorated", override=True)(halves) is halves


def test_which_selectors_keep_whole_rows():
    assert [keeps_rows(name) for name in ("row", "window", "frame", "column", "random")] == [True] * 3 + [False] * 2


def test_a_selector_returning_something_other_than_a_tensor_is_refused_naming_the_contract():
    rk.register_selector("t_list", override=True)(lambda batch, n, rate, **kw: [[0, 1]] * batch)
    with pytest.raises(SelectorError, match="LongTensor"):
        select_tokens("t_list", 2, 4, 0.5, grid=None, generator=None, device="cpu")


def test_a_selection_of_one_token_per_sample_is_valid():
    one = torch.zeros(3, 1, dtype=torch.long)
    assert checked("random", one, 3, 4) is one


def test_a_custom_selector_returning_a_valid_selection_routes_and_one_index_past_the_end_is_refused():
    rk.register_selector("t_last_two", override=True)(lambda batch, n, rate, **kw: torch.arange(n - 2, n).expand(
        batch, -1))
    rk.register_selector("t_past_end", override=True)(lambda batch, n, rate, **kw: torch.arange(n - 1, n + 1).expand(
        batch, -1))
    assert select_tokens("t_last_two", 2, 5, 0.5, grid=None, generator=None, device="cpu").tolist() == [[3, 4]] * 2
    with pytest.raises(SelectorError, match="sorted, unique and within"):
        select_tokens("t_past_end", 2, 5, 0.5, grid=None, generator=None, device="cpu")


def test_importance_by_default_mixes_half_chance_and_at_full_chance_is_random():
    stream = torch.randn(3, 10, D, generator=torch.Generator().manual_seed(0))

    def picks(fn, **kw):
        return fn(3, 10, 0.5, generator=torch.Generator().manual_seed(7), device="cpu", **kw)

    assert torch.equal(picks(importance(), stream=stream), picks(importance(0.5), stream=stream))
    assert torch.equal(picks(importance(1.0), stream=stream), picks(get_selector("random")))


def test_the_column_selector_keeps_a_share_of_the_columns():
    assert selector("column").kept_grid((4, 6), 0.5) == (4, 3)
    assert selector("column").kept_grid((2, 4, 6), 0.25) == (2, 4, 5)


def test_a_grid_selector_without_a_grid_asks_for_one():
    with pytest.raises(ConfigError, match="grid="):
        get_selector("row")(2, 16, 0.5, grid=None)


# ==== verify =======================================================================================================


def test_verify_holds_the_routed_model_to_the_original_forward_over_its_own_current_weights():
    class Shifted(Tokens):
        def __init__(self):
            super().__init__()
            self.shift = nn.Parameter(torch.zeros(D))  # the owner's own: not in a module the copies share

        def forward(self, x):
            h = self.embed(x) + self.shift
            for block in self.blocks:
                h = block(h)
            return h

    model = built(Shifted)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    routed.shift = nn.Parameter(torch.ones(D))  # the routed model's own parameter now differs from the model's
    assert rk.verify(model, routed, tokens())["outputs"] == 1


def test_verify_reports_a_tensor_output_that_became_another_value():
    with pytest.raises(InferenceChanged, match="output 0"):
        _compare((torch.ones(2),), (3,), "original", "routed")


def test_verify_compares_output_objects_by_their_own_equality_where_they_have_one():
    class Meta:
        def __init__(self, n, note):
            self.n, self.note = n, note

        def __eq__(self, other):
            return self.n == other.n

    _compare((Meta(1, "a"),), (Meta(1, "b"),), "original", "routed")
    with pytest.raises(InferenceChanged):
        _compare((Meta(1, "a"),), (Meta(2, "a"),), "original", "routed")

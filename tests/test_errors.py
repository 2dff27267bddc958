"""Invalid plans, models and inputs raise routekit errors whose messages say what was wrong and what is valid.

Every failure must be a `RoutekitError` subclass (ConfigError, TraceError, AnalysisError, InputError):
never a bare TypeError, pydantic ValidationError or fx traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zoo
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import Arch, MlpBlock, build, example_inputs
from torch import nn

import routekit as rk
from routekit.model import report_of
from routekit.routing import gather_tokens
from routekit.selectors import selector_names

DEPTH = 4
LINEAR = Arch(depth=DEPTH, hidden=24, heads=2, grid=(3, 4), front="linear", patch=1, channels=3, container="list",
              kinds=("ada", "mlp", "bias", "ada"), tuple_out=False, stream_kw=False, side_kw=False, dropout=0.0,
              batch=2, seed=0)
CONV = dataclasses.replace(LINEAR, front="conv", patch=2)


def apply(arch: Arch = LINEAR, routes=None, **options) -> nn.Module:
    """Route a fresh model of `arch` on its example inputs."""
    return rk.apply(build(arch), routes=routes, example_inputs=example_inputs(arch), **options)


def mlp_blocks(depth: int, hidden: int) -> nn.ModuleList:
    return nn.ModuleList([MlpBlock(hidden, 1, 0.0, False) for _ in range(depth)])


# --- route plans -----------------------------------------------------------------------------------


def test_positional_config_arguments_are_refused_with_the_keywords_to_use() -> None:
    with pytest.raises(rk.ConfigError, match=r"Route takes keyword arguments only \(Route\(start=\.\.\., end=\.\.\."):
        rk.Route(1, 3, 0.5)
    with pytest.raises(rk.ConfigError, match=r"DAR takes keyword arguments only"):
        rk.DAR("static")


def test_start_after_end_is_refused_naming_both() -> None:
    with pytest.raises(rk.ConfigError, match=r"start \(3\) must be <= end \(1\)"):
        rk.Route(start=3, end=1)
    with pytest.raises(rk.ConfigError, match="start"):
        apply(routes=[{"start": 3, "end": 1}])


def test_a_route_past_the_last_block_lists_the_valid_block_indices_and_names() -> None:
    with pytest.raises(rk.ConfigError) as err:
        apply(routes=rk.Route(start=1, end=DEPTH))
    message = str(err.value)
    assert "outside the stack" in message and f"0..{DEPTH - 1}" in message
    assert all(f"{i}: blocks.{i}" in message for i in range(DEPTH))


def test_overlapping_routes_are_refused_with_where_the_next_may_start() -> None:
    with pytest.raises(rk.ConfigError) as err:
        apply(routes=[rk.Route(start=0, end=2), rk.Route(start=2, end=3)])
    assert "overlaps" in str(err.value) and "disjoint" in str(err.value) and "block 3 or later" in str(err.value)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, math.nan, math.inf])
def test_a_rate_outside_zero_to_one_is_refused(rate: float) -> None:
    with pytest.raises(rk.ConfigError, match=r"rate.*\[0, 1\)"):
        rk.Route(start=0, end=1, rate=rate)


def test_an_unknown_selector_lists_the_registered_ones() -> None:
    with pytest.raises(rk.ConfigError) as err:
        rk.Route(start=0, end=1, selector="nope")
    assert "unknown selector 'nope'" in str(err.value)
    assert all(name in str(err.value) for name in selector_names())
    assert {"random", "row", "window", "column"} <= set(selector_names())


@pytest.mark.parametrize("selector", ["row", "window", "column"])
def test_a_grid_selector_without_a_grid_asks_for_one(selector: str) -> None:
    with pytest.raises(rk.ConfigError) as err:
        apply(LINEAR, routes=rk.Route(start=0, end=1, selector=selector))
    assert "needs the token grid" in str(err.value) and "grid=(H, W)" in str(err.value)
    apply(LINEAR, routes=rk.Route(start=0, end=1, selector=selector), grid=LINEAR.grid)  # given: fine


def test_a_grid_that_does_not_tile_the_tokens_is_refused() -> None:
    with pytest.raises(rk.ConfigError, match="does not match the stream's 12 tokens"):
        apply(LINEAR, routes=rk.Route(start=0, end=1), grid=(4, 4))


@pytest.mark.parametrize("grid", [(2.5, 4.8), (-3, -4), (12,)])
def test_a_grid_must_be_two_positive_ints_tiling_the_tokens(grid: tuple) -> None:
    """(2.5, 4.8) and (-3, -4) multiply to the 12 tokens; neither is a grid."""
    with pytest.raises(rk.ConfigError, match="grid"):
        apply(LINEAR, routes=rk.Route(start=0, end=1), grid=grid)


def test_the_default_route_needs_seven_blocks() -> None:
    with pytest.raises(rk.ConfigError, match="at least 7 blocks, the stack has 4"):
        apply(routes="default")


@pytest.mark.parametrize("routes", [5, "everything"])
def test_routes_of_the_wrong_kind_are_refused(routes) -> None:
    with pytest.raises(rk.ConfigError, match="routes must be a Route"):
        apply(routes=routes)


# --- models routekit cannot route ------------------------------------------------------------------


class NoStack(nn.Module):
    """Two Linears as plain attributes: no container, so no block stack."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Parallel(nn.Module):
    """A ModuleList whose members all read the same input: called, but not a chain."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(head(x) for head in self.heads)


@pytest.mark.parametrize("model, called", [(NoStack(), "none"), (Parallel(), "heads (3 calls)")])
def test_a_model_without_a_block_stack_raises_analysis_error(model: nn.Module, called: str) -> None:
    with pytest.raises(rk.AnalysisError) as err:
        rk.apply(model, routes=rk.Route(start=0, end=1), example_inputs=torch.randn(2, 4, 8))
    assert "no block stack found" in str(err.value) and called in str(err.value)


def test_an_unknown_stack_name_lists_the_chains_found() -> None:
    with pytest.raises(rk.AnalysisError, match=r"'trunk'.*chains found: blocks \(4 calls\)"):
        apply(routes=rk.Route(start=0, end=1), stack="trunk")


class DataDependent(nn.Module):
    """An owner that branches on a tensor's values."""

    def __init__(self):
        super().__init__()
        self.blocks = mlp_blocks(3, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if x.mean() > 0:  # data-dependent: the branch taken depends on the values
            x = -x
        return x


def test_data_dependent_control_flow_raises_trace_error_naming_file_and_line() -> None:
    """In graph mode; mode="auto" falls back to boundary mode and reports the same reason."""
    lines, first = inspect.getsourcelines(DataDependent.forward)
    where = f"{__file__}:{first + next(i for i, text in enumerate(lines) if 'if x.mean()' in text)}"
    x = torch.randn(2, 4, 8)
    with pytest.raises(rk.TraceError) as err:
        rk.apply(DataDependent(), routes=rk.Route(start=0, end=1), example_inputs=x, mode="graph")
    assert where in str(err.value) and "control flow depends on" in str(err.value)
    fallback = report_of(rk.apply(DataDependent(), routes=rk.Route(start=0, end=1), example_inputs=x)).fallback
    assert where in fallback


class Rows(nn.Module):
    """Blocks that mix along grid rows: they reshape the tokens to (B, H, W, D) and so need whole rows."""

    def __init__(self, width: int, hidden: int = 8):
        super().__init__()
        self.width = width
        self.embed = nn.Conv2d(3, hidden, 1)
        self.blocks = nn.ModuleList([RowMix(width, hidden) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            h = block(h)
        return h


class RowMix(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.width, self.mix = width, nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], -1, self.width, x.shape[-1])
        return x + self.mix(rows.transpose(2, 3)).transpose(2, 3).reshape(x.shape)


def test_a_block_that_needs_whole_rows_refuses_token_selectors_and_takes_row_selectors() -> None:
    model, x = Rows(width=5), torch.randn(2, 3, 4, 5)
    with pytest.raises(rk.ConfigError) as err:
        rk.apply(model, routes=rk.Route(start=0, end=1, selector="random"), example_inputs=x)
    assert "blocks.0 (RowMix)" in str(err.value) and "selector='row'" in str(err.value)
    routed = rk.apply(model, routes=rk.Route(start=0, end=1, selector="row"), example_inputs=x)
    assert routed.train()(x).shape == (2, 20, 8)


@pytest.mark.parametrize("selector", ["random", "row"])
def test_a_block_that_takes_no_fewer_tokens_is_refused_without_suggesting_a_selector(selector: str) -> None:
    """BEiT with a relative position bias per layer adds an (N, N) table of its own to the attention: no
    selector helps, and the refusal must not send the user to 'row' (it did: any failure on one token fewer was
    read as a block that reshapes to rows). Its twin: BEiT as configured by default routes (the zoo)."""
    try:
        model, args, _ = zoo.transformers_beit(bias_per_layer=True)
    except zoo.Missing as err:
        pytest.skip(str(err))
    with pytest.raises(rk.ConfigError, match="no selector can route it") as err:
        rk.apply(model, routes=rk.Route(start=1, end=4, selector=selector), example_inputs=args)
    assert "layers.1 (BeitLayer)" in str(err.value) and "selector='row'" not in str(err.value)
    assert "so does every block of the route: no route can hold them" in str(err.value)  # not "end it before"


class SequenceFirst(nn.Module):
    """Blocks that run on a (tokens, batch, channels) stream, as ErnieImage's do (torch's own default layout)."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Conv2d(3, 16, 2, 2)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=batch_first)
                                    for _ in range(4))

    def forward(self, image):
        x = self.embed(image).flatten(2).transpose(1, 2)
        x = x if self.batch_first else x.transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_sequence_first_stream_is_refused_not_routed_by_samples() -> None:
    """A (tokens, batch, channels) stream read as (batch, tokens, channels) had its routes set whole samples
    aside (ErnieImage's: verify passed, the routed sample skipped blocks 1-4 whole). Its twin, batch first,
    routes."""
    image = torch.randn(2, 3, 8, 8)
    with pytest.raises(rk.AnalysisError, match=r"float32\[16, 2, 16\], with the batch \(2.*sequence-first"):
        rk.inspect(SequenceFirst(batch_first=False), (image,))
    routed = rk.apply(SequenceFirst(batch_first=True), rk.Route(start=1, end=2), example_inputs=(image,))
    assert report_of(routed).tokens == 16


class LongSkip(nn.Module):
    """U-ViT-like: block 1's output also feeds the head, so no route may pass through block 1."""

    def __init__(self):
        super().__init__()
        self.blocks = mlp_blocks(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return x + outs[1]


def test_a_block_output_read_outside_the_chain_is_put_back_like_the_stream_and_refused_where_it_cannot_be() -> None:
    """Block 1's output feeds the head too (a long skip). A route through it hands that reader the stream as TREAD
    defines a route's output: the kept tokens as block 1 made them, the routed ones as the route began. Boundary
    mode places routes at block calls and sees no reader but the blocks: the reader gets the kept tokens alone,
    and apply's dry run refuses the route, saying where it failed."""
    x = torch.randn(2, 6, 8)
    torch.manual_seed(0)
    model = LongSkip()
    routed = rk.apply(model, routes=rk.Route(start=0, end=2), example_inputs=x)
    routed.train()
    out = routed(x)
    index = (~rk.last_route_mask(routed)).nonzero()[:, 1].view(2, -1)
    with torch.no_grad():
        h1 = model.blocks[1](model.blocks[0](gather_tokens(x, index)))
        after = x.scatter(1, index[..., None].expand(-1, -1, 8), model.blocks[2](h1))
        skip = x.scatter(1, index[..., None].expand(-1, -1, 8), h1)
        torch.testing.assert_close(out, model.blocks[3](after) + skip)
    with pytest.raises(rk.ConfigError, match="the routed training forward failed on the example inputs"):
        rk.apply(LongSkip(), routes=rk.Route(start=0, end=2), example_inputs=x, mode="boundary")
    routed = rk.apply(LongSkip(), routes=rk.Route(start=0, end=1), example_inputs=x, mode="boundary")
    assert routed.train()(x).shape == x.shape


class LongSkipProjected(LongSkip):
    """Block 1's output also feeds a projection of the owner's, a module at a dotted path."""

    def __init__(self):
        super().__init__()
        self.skips = nn.ModuleDict({"proj": nn.Linear(8, 8)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return x + self.skips["proj"](outs[1])


def test_a_module_the_escaping_output_feeds_is_named_by_its_path() -> None:
    """With DAR (which does not put block outputs back), the refusal names the module a user knows
    (`skips.proj`), not the fx node (`skips_proj`, HunyuanDiT's `blocks_4`)."""
    with pytest.raises(rk.ConfigError, match=r"its output is also used by skips\.proj, outside the chain"):
        rk.apply(LongSkipProjected(), routes=rk.Route(start=0, end=2), residual=rk.DAR(kernel="torch"),
                 example_inputs=torch.randn(2, 6, 8))


class PerTokenAux(nn.Module):
    """Blocks return (x, per-token score (B, N)) and the owner sums the scores: they escape the blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Scored() for _ in range(3)])

    def forward(self, x: torch.Tensor):
        total = 0
        for block in self.blocks:
            x, score = block(x)
            total = total + score
        return x, total


class Scored(nn.Module):
    def forward(self, x: torch.Tensor):
        return 2 * x, x.sum(-1)


@pytest.mark.parametrize("model, words", [
    (PerTokenAux(), ["route 0 cannot contain blocks.0", "returns a per-token value"]),
])
def test_blocks_whose_per_token_values_cannot_be_gathered_are_refused(model: nn.Module, words: list[str]) -> None:
    with pytest.raises(rk.ConfigError) as err:
        rk.apply(model, routes=rk.Route(start=0, end=1), example_inputs=torch.randn(2, 6, 8))
    assert all(w in str(err.value) for w in words), str(err.value)


# --- models and inputs of the wrong kind -----------------------------------------------------------


def test_applying_again_replaces_the_routes_and_a_dar_model_says_to_strip_first() -> None:
    routed = apply(routes=rk.Route(start=0, end=1))
    again = rk.apply(routed, routes=rk.Route(start=2, end=3), example_inputs=example_inputs(LINEAR))
    assert again is routed and [(r.start, r.end) for r in report_of(again).placed] == [(2, 3)]
    with pytest.raises(rk.ConfigError):  # a refused apply leaves the routes as they were
        rk.apply(routed, routes=rk.Route(start=2, end=99), example_inputs=example_inputs(LINEAR))
    assert [(r.start, r.end) for r in report_of(routed).placed] == [(2, 3)]
    dar = rk.apply(routed, residual=rk.DAR(kernel="torch"), example_inputs=example_inputs(LINEAR))
    with pytest.raises(rk.ConfigError, match=r"has DAR.*strip\(model, drop_learned=True\)"):
        rk.apply(dar, routes=rk.Route(start=0, end=1), example_inputs=example_inputs(LINEAR))
    rk.apply(rk.strip(dar, drop_learned=True), routes=rk.Route(start=2, end=3), example_inputs=example_inputs(LINEAR))


@pytest.mark.parametrize("args, kwargs, words", [
    ((torch.randn(2, 12, 3), torch.rand(2), None, torch.rand(2)), {}, ["do not fit", "forward(x"]),
    ((torch.randn(2, 12, 3),), {"t": torch.rand(2), "time": torch.rand(2)}, ["do not fit", "'time'"]),
    ((), {}, ["example_inputs are required"]),
    ((torch.randn(2, 12, 3, device="meta"), torch.rand(2, device="meta")), {}, ["on meta", "share a device"]),
    (([torch.randn(2, 12, 3)], torch.rand(2)), {}, ["failed on the example inputs", "list"]),
])
def test_example_inputs_that_do_not_fit_the_signature_raise_input_error(args: tuple, kwargs: dict,
                                                                         words: list[str]) -> None:
    with pytest.raises(rk.InputError) as err:
        rk.apply(build(LINEAR), routes=rk.Route(start=0, end=1), example_inputs=args, example_kwargs=kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_the_other_verbs_refuse_models_routekit_did_not_route() -> None:
    model, inputs = build(LINEAR), example_inputs(LINEAR)
    with pytest.raises(rk.InputError, match="takes an nn.Module"):
        rk.apply(lambda x: x, routes=rk.Route(start=0, end=1), example_inputs=inputs)
    for verb in (rk.strip, report_of, rk.last_route_mask):
        with pytest.raises(rk.InputError):
            verb(model)
    with pytest.raises(rk.InputError, match="verify checks a model routed"):
        rk.verify(model, model, inputs)
    routed = apply(routes=rk.Route(start=0, end=1))
    with pytest.raises(rk.InputError, match="no routed forward has run yet"):
        rk.last_route_mask(routed)
    routed.train()(*inputs)
    with pytest.raises(rk.InputError, match=r"route 1 does not exist; valid routes are 0\.\.0"):
        rk.last_route_mask(routed, route=1)


# --- random invalid plans --------------------------------------------------------------------------


def plan_is_valid(routes: list[dict], depth: int, has_grid: bool) -> bool:
    """The rules a plan of numeric routes must meet (what `apply` checks)."""
    spans = []
    for r in routes:
        if set(r) - {"start", "end", "rate", "selector"}:
            return False
        if not all(-depth <= r[k] < depth for k in ("start", "end")):
            return False
        start, end = r["start"] % depth, r["end"] % depth  # negative indices count from the end
        if not (start <= end and 0 <= r["rate"] < 1 and r["selector"] in selector_names()):
            return False
        if r["selector"] in ("row", "window", "column") and not has_grid:
            return False
        spans.append((start, end))
    spans.sort()
    return all(a[1] < b[0] for a, b in zip(spans, spans[1:]))


route_dicts = st.fixed_dictionaries(
    {"start": st.integers(-2, DEPTH + 1), "end": st.integers(-2, DEPTH + 1),
     "rate": st.one_of(st.floats(-0.5, 1.5), st.sampled_from([math.nan, math.inf, 0.0, 0.5])),
     "selector": st.sampled_from(["random", "row", "window", "column", "nope", ""])},
    optional={"stride": st.integers(0, 2)},
)


@settings(max_examples=30, deadline=None)
@given(arch=st.sampled_from([LINEAR, CONV]), routes=st.lists(route_dicts, min_size=1, max_size=3))
def test_random_plans_route_when_valid_and_raise_routekit_error_when_not(arch: Arch, routes: list[dict]) -> None:
    if plan_is_valid(routes, arch.depth, arch.has_grid):
        apply(arch, routes=routes)
    else:
        with pytest.raises(rk.RoutekitError):
            apply(arch, routes=routes)


junk = st.one_of(st.none(), st.integers(-3, 3), st.floats(), st.text(max_size=3), st.lists(st.integers(0, 3), max_size=2))


@settings(max_examples=30, deadline=None)
@given(routes=st.one_of(junk, st.lists(st.one_of(junk, st.dictionaries(st.sampled_from(["start", "end", "rate"]), junk)),
                                       min_size=1, max_size=2)))
def test_any_malformed_plan_raises_only_routekit_errors(routes) -> None:
    try:
        apply(LINEAR, routes=routes)
    except rk.RoutekitError:
        pass


@settings(max_examples=15, deadline=None)
@given(grid=st.one_of(st.tuples(st.integers(-1, 12), st.integers(-1, 12)), junk))
def test_any_malformed_grid_raises_only_routekit_errors(grid) -> None:
    try:
        apply(LINEAR, routes=rk.Route(start=0, end=1, selector="row"), grid=grid)
    except rk.RoutekitError:
        pass


# --- what a new user meets first ------------------------------------------------------------------------------

def test_a_rope_lm_whose_token_count_equals_its_head_dim_routes():
    """Llama with head_dim 16 on 16 tokens: its RoPE table (1, 16, 16) has two axes as long as the stream, and the
    block itself tells which holds the tokens (it was cut along both and failed to apply)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2)
    model, ids = transformers.LlamaModel(config), torch.randint(0, 64, (2, 16))
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(ids,))
    table = report_of(routed).blocks[1].side_inputs
    assert [g.axes for s in table if s.slot == "position_embeddings" for g in s.tokens] == [(1,), (1,)]
    rk.verify(model, routed, (ids,))


def test_a_moe_loss_over_routed_router_logits_fails_at_apply_naming_where_and_why():
    """Qwen3-MoE asked for its router logits with a padding mask: its load-balancing loss joins every layer's logits
    with the mask, but the routed layers' logits hold only the kept tokens (boundary mode). apply's dry run says where
    it failed and why; the twin with the logits off (transformers' default) routes and verifies with the same mask."""
    transformers = pytest.importorskip("transformers")
    model, (ids,), _ = zoo.transformers_qwen3_moe()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.warns(rk.FallbackWarning), pytest.raises(rk.ConfigError) as err:
        rk.apply(model, rk.Route(start=1, end=3), example_inputs=(ids,), example_kwargs={"attention_mask": mask})
    assert all(w in str(err.value) for w in ("in load_balancing_loss_func", "kept tokens", "output_router_logits"))
    model.config.output_router_logits = False
    routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=(ids,), example_kwargs={"attention_mask": mask})
    assert isinstance(routed, transformers.Qwen3MoeForCausalLM)
    rk.verify(model, routed, (ids,), {"attention_mask": mask})


def test_a_force_keep_mask_of_another_token_count_is_named():
    routed = apply(routes=[rk.Route(start=1, end=2)]).train()
    with pytest.raises(rk.SelectorError, match=r"over the stream the route starts on, here \(2, 12\); got torch\.bool "
                                               r"\(2, 5\)"), rk.force_keep(routed, torch.ones(2, 5, dtype=torch.bool)):
        routed(*example_inputs(LINEAR))


@pytest.mark.one_end
def test_the_command_line_runs_as_a_module_and_answers_bad_input_without_a_traceback():
    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "routekit", *argv], capture_output=True, text=True)

    assert cli("--help").returncode == 0
    for argv, said in ((("inspect", "no_such_module:Model"), "cannot import 'no_such_module'"),
                       (("inspect", "backbones.dit:DiT_S_2", "--routes", "2:8:abc"), "rate a number in [0, 1)"),
                       (("inspect", "backbones.dit:DiT_S_2", "--grid", "16by16"), "H,W or T,H,W"),
                       (("inspect", "backbones.dit:DiT_S_2", "--dar", "fancy"), "static, static_t, dynamic")):
        done = cli(*argv)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.one_end
def test_the_demo_runs_from_the_command_line_and_draws_no_bar_off_a_terminal():
    """`make demo`'s command, as a fresh user runs it: every stage says what it found, and with the output piped
    (no terminal) the timing loops draw no progress bar, only the result line."""
    # as from an installed routekit: the repository's backbones cannot be imported
    run = "import sys; sys.modules['backbones'] = None; from routekit.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", run, "demo", "--steps", "5", "--batch", "1"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "route 0: blocks 2→8, rate 0.5" in done.stdout and "outputs bit-identical" in done.stdout
    assert "measured speed-up" in done.stdout and "FLOP limit" in done.stdout and "(medians of 5)" in done.stdout
    assert any(said in done.stdout for said in ("too noisy to read", "of the FLOP limit", "above the FLOP limit"))


@pytest.mark.one_end
def test_inspect_takes_a_model_from_the_current_folder_with_an_example_shape_or_factory(tmp_path):
    """The README's first model, saved as ./tiny.py, inspected from that folder by the installed script's code: the
    model's file has no example_inputs, so the command asks for a shape or a factory, and takes either."""
    (tmp_path / "tiny.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.norm, self.linear = nn.LayerNorm(16), nn.Linear(16, 16)\n\n"
        "    def forward(self, x):\n"
        "        return x + self.linear(self.norm(x))\n\n"
        "class Tiny(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed = nn.Conv2d(3, 16, 4, 4)\n"
        "        self.blocks = nn.ModuleList(Block() for _ in range(8))\n\n"
        "    def forward(self, image):\n"
        "        x = self.embed(image).flatten(2).transpose(1, 2)\n"
        "        for block in self.blocks:\n"
        "            x = block(x)\n"
        "        return x\n\n"
        "def images(model, batch):\n"
        "    return torch.randn(batch, 3, 32, 32)\n")
    script = "import sys; sys.path.remove(''); from routekit.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(Path(rk.__file__).parents[1])}

    def cli(*argv):
        return subprocess.run([sys.executable, "-c", script, "inspect", "tiny:Tiny", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True)

    asked = cli()
    assert asked.returncode == 2 and "--shape 4,3,32,32" in asked.stderr and "--inputs" in asked.stderr, asked.stderr
    for argv in (("--shape", "2,3,32,32"), ("--inputs", "tiny:images"), ("--inputs", "tiny:images", "--batch", "3")):
        done = cli(*argv, "--routes", "2:5")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "blocks (8 blocks)" in done.stdout and "token grid  : 8×8" in done.stdout, done.stdout
    assert "float32[3, 64, 16]" in done.stdout
    bad = cli("--shape", "2,3,x")
    assert bad.returncode == 2 and "--shape" in bad.stderr and "Traceback" not in bad.stderr
    assert "it/s" not in done.stderr and "\r" not in done.stderr


def test_blocks_in_stages_and_adds_between_blocks_are_named_as_such():
    class Stages(nn.Module):  # two stages of blocks with a token merge between them, as Swin's patch merging
        def __init__(self):
            super().__init__()
            self.stage1 = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(3))
            self.stage2 = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(2))

        def forward(self, x):
            for block in self.stage1:
                x = block(x)
            x = x[:, ::2]
            for block in self.stage2:
                x = block(x)
            return x

    with pytest.raises(rk.ConfigError, match=r"block 4 is outside the stack.*other chains of blocks: \{'stage2': 2\}.*"
                                             r"one chain per stage.*stack='\.\.\.'"):
        rk.apply(Stages(), rk.Route(start=2, end=4), example_inputs=(torch.randn(2, 8, 8),))

    class AddsOutside(nn.Module):  # x = x + block(x) in the owner: no block's output is the next one's input
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    with pytest.raises(rk.AnalysisError, match=r"blocks\.0's output reaches blocks\.1 only through add.*residual add "
                                               r"inside the block"):
        rk.apply(AddsOutside(), "default", example_inputs=(torch.randn(2, 8, 8),))


def test_inspect_of_a_transformers_lm_fits_a_terminal_and_lists_its_specialisations():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2)
    text = str(rk.inspect(transformers.LlamaModel(config), (torch.randint(0, 64, (2, 12)),),
                          routes=rk.Route(start=1, end=2)))
    assert max(map(len, text.splitlines())) <= 120, max(text.splitlines(), key=len)
    assert text.count("constant   DynamicCache") == 1 and "side inputs : (every block)" in text
    assert "specialised to the example's shapes (" in text and "masking_utils.py:" in text


@pytest.mark.parametrize("routes, said", [(rk.Route(start=2, end=5, rate=0), "rate=0"),
                                          (rk.Route(start=0, end=-1), "covers the whole stack of 8 blocks"),
                                          ({"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0,
                                                        "end_layer_idx": 7}]}, "covers the whole stack")])
def test_a_route_that_routes_nothing_or_the_whole_stack_is_warned_of(routes, said):
    arch = dataclasses.replace(LINEAR, depth=8, kinds=LINEAR.kinds * 2)
    with pytest.warns(rk.RouteWarning, match=said):
        rk.apply(build(arch), routes=routes, example_inputs=example_inputs(arch))


def test_a_usual_route_gets_no_warning(recwarn):
    arch = dataclasses.replace(LINEAR, depth=8, kinds=LINEAR.kinds * 2)
    rk.apply(build(arch), routes=[rk.Route(start=1, end=3), rk.Route(start=4, end=-2)], example_inputs=example_inputs(arch))
    assert not [w for w in recwarn if issubclass(w.category, rk.RouteWarning)]


def test_report_cells_are_cut_and_wrapped_at_word_boundaries():
    from routekit.report import _cut

    said = "the forward compares or passes on .type = 'cpu' while tracing"
    cut = _cut(said, 40)
    assert len(cut) <= 40 and cut.endswith("...") and said.startswith(cut[:-3]) and said[len(cut) - 3] == " "
    assert _cut("x" * 50, 20) == "x" * 17 + "..."  # one word longer than the width is cut inside it
    assert _cut(said, 200) == said


def test_a_leafed_submodule_shows_its_whole_reason_wrapped_and_long_notes_wrap():
    class Picky(nn.Module):
        def forward(self, x):
            if x.device.type == "cpu" and x.sum() > -1e30:  # data-dependent: cannot be traced
                return x
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.picky = Picky()
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(6))

        def forward(self, x):
            x = self.picky(x)
            for block in self.blocks:
                x = block(x)
            return x

    report = str(rk.inspect(Model(), (torch.randn(2, 5, 8),), routes=rk.Route(start=1, end=3)))
    lines = report.splitlines()
    assert all(len(line) <= 125 for line in lines), max(lines, key=len)
    leaf = next(i for i, line in enumerate(lines) if line.startswith("    picky: "))
    assert not lines[leaf].endswith("...") and "..." not in lines[leaf]

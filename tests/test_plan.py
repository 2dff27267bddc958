"""Laws of the plan (routekit/plan.py): what a route costs, which grids and keeps it takes, which blocks force a
row selector or one shared selection, and which DAR requests it refuses before anything runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import D, Mlp, Patches, Registers, Tokens, built, image, tokens
from torch import nn

import routekit as rk
from routekit.errors import ConfigError
from routekit.model import observe
from routekit.plan import checked_grid, make_plan
from routekit.probe import Probe


def test_the_flop_fraction_counts_routed_blocks_at_their_kept_tokens():
    plan = rk.inspect(built(Tokens), tokens(n=10), routes=rk.Route(start=1, end=2, rate=0.5))
    assert plan.route_at() == {1: 0, 2: 0}
    assert plan.block_flop_fraction() == pytest.approx((2 * 10 + 2 * 5) / (4 * 10))


def test_a_call_that_runs_other_blocks_than_the_example_call_is_refused_naming_the_block():
    """DAR's aggregation points (and any route) were decided on the example call's blocks: with DAR, a call that
    skips one is refused (routes alone run it unrouted: test_dropin)."""
    class Cut(Tokens):
        def forward(self, x, depth: int = 4):
            h = self.embed(x)
            for block in self.blocks[:depth]:
                h = block(h)
            return h

    model = built(Cut)
    routed = rk.apply(model, residual=rk.DAR(kernel="torch"), example_inputs=tokens(), example_kwargs={"depth": 4})
    routed.train()
    with pytest.raises(ConfigError, match="this call skips blocks.3, which the example call ran"):
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

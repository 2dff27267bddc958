"""Laws of the probe stage (routekit/probe.py) and of specialising a plan to a new call (routekit/specialise.py).

What only running the model can tell is asked of a probe; planning judges the answers and runs nothing itself;
the rewrite reads every block trace it inlines off the plan; and a call of a new signature plans the same
request again, carrying over what running the model found where the call feeds the blocks the same.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import routekit as rk
from routekit import rewrite as rk_rewrite
from routekit.model import observe, report_of, routing_of
from routekit.plan import make_plan
from routekit.probe import Probe, RouteAnswer

D = 8


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Positional(Mlp):
    """Its code reads the token count as a number, so its own trace is specialised to it."""

    def forward(self, x):
        n = int(x.shape[1])
        return x + self.fc(self.norm(x)) * (1 + torch.arange(n, dtype=torch.float32)[:, None] / n)


class Owner(nn.Module):
    def __init__(self, block=Mlp, depth: int = 4):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.scale = 1.0

    def forward(self, x, shift: float = 0.0):
        h = self.embed(x) * self.scale + shift
        for block in self.blocks:
            h = block(h)
        return h


def tokens(batch: int = 2, n: int = 6) -> torch.Tensor:
    return torch.randn(batch, n, 3, generator=torch.Generator().manual_seed(0))


def built(*args) -> nn.Module:
    torch.manual_seed(0)
    return Owner(*args)


class Counted:
    """Counts the questions a probe is asked (`Probe.route`) while in place."""

    def __init__(self, monkeypatch):
        self.asked = 0
        route = Probe.route

        def counted(probe, *args, **kwargs):
            self.asked += 1
            return route(probe, *args, **kwargs)

        monkeypatch.setattr(Probe, "route", counted)


def test_planning_runs_no_block_and_takes_the_kept_count_and_the_shared_selection_from_the_probe():
    model = built()
    _, report = observe(model, (tokens(),), {})

    class Answers:
        def route(self, route, start, end, keep, grid, shrink, bodies=False):
            return RouteAnswer(kept=4, shared=True)

    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: pytest.fail("planning ran a block"))
    plan = make_plan(report, [rk.Route(start=1, end=2, rate=0.5)], None, Answers())
    assert (plan.placed[0].kept, plan.placed[0].shared, plan.placed[0].kept_in) == (4, True, (4,))


def test_a_block_the_probe_finds_failing_on_partial_rows_is_refused_by_the_plan():
    model = built()
    _, report = observe(model, (tokens(),), {})

    class Answers:
        def route(self, route, start, end, keep, grid, shrink, bodies=False):
            return RouteAnswer(kept=3, rows=(start,))

    with pytest.raises(rk.RoutekitError, match="not whole grid rows"):
        make_plan(report, [rk.Route(start=1, end=2, rate=0.5)], None, Answers())


def test_the_plan_carries_a_shape_bound_block_traced_at_the_kept_count_for_the_rewrite_to_inline():
    model, x = built(Positional), tokens(n=2 * D)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), residual=rk.DAR(kernel="torch"), example_inputs=x)
    placed = report_of(routed).placed[0]
    assert [b.index for b in placed.bodies] == [1, 2] and all(b.body.specialised for b in placed.bodies)
    assert {n.meta["rk"].shape[1] for b in placed.bodies for n in b.body.graph.nodes if n.op == "placeholder"} == {D}
    assert not hasattr(rk_rewrite, "trace_block")  # the rewrite reads them off the plan: it has nothing to trace with


def test_the_timestep_embedding_is_in_the_report_not_looked_up_on_the_graph():
    class Timed(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.t_embedder = nn.Linear(3, D), nn.Linear(1, D)
            self.blocks = nn.ModuleList(Mlp() for _ in range(3))

        def forward(self, x, t):
            e = self.t_embedder(t[:, None])
            h = self.embed(x) + e[:, None]
            for block in self.blocks:
                h = block(h)
            return h

    torch.manual_seed(0)
    model, inputs = Timed(), (tokens(), torch.rand(2))
    plan = rk.inspect(model, inputs, residual=rk.DAR(query="static_t", kernel="torch"))
    assert plan.report.timestep == plan.dar.timestep
    assert plan.report.embedding("t_embedder") == dict(plan.report.embeddings)["t_embedder"]


class Decided:
    """While in place: analysing, classifying a block's inputs, planning or probing raises. A routed model binds
    the decision `apply` made to any later call; it decides nothing again."""

    def __init__(self, monkeypatch):
        import routekit.analysis
        import routekit.flow
        import routekit.plan

        def refused(*args, **kwargs):
            raise AssertionError("a later call analysed, classified, planned or probed again")

        for module, name in ((routekit.analysis, "analyse"), (routekit.plan, "make_plan"), (Probe, "route"),
                             (routekit.flow, "token_axes"), (routekit.analysis, "side_input")):
            monkeypatch.setattr(module, name, refused)


def test_a_call_of_a_new_signature_decides_nothing_again_and_equals_a_fresh_program(monkeypatch):
    model, x = built(), tokens()
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=x)
    Decided(monkeypatch)
    routed.train()
    torch.manual_seed(0)
    got = routed(x, shift=0.5)
    torch.manual_seed(0)
    want = routing_of(routed).executor.run_fresh(routed, (x,), {"shift": 0.5})
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_broken_assumption_traces_again_and_decides_nothing_again(monkeypatch):
    model, x = built(), tokens()
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=x)
    routed.train()
    routed(x)
    Decided(monkeypatch)
    model.scale = 2.0  # read as a plain number by the traced forward: the program's assumption breaks
    routed(x)
    assert routing_of(routed).executor.retraced


def test_a_call_whose_blocks_see_other_shapes_binds_the_decision_to_them(monkeypatch):
    class Measured(Owner):
        def forward(self, x, shift: float = 0.0):
            return super().forward(x, shift) * (int(x.shape[1]) / 6)  # a number read off a shape: a program per count

    torch.manual_seed(0)
    model = Measured()
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    routed.train()
    Decided(monkeypatch)
    out = routed(tokens(n=8))
    assert out.shape == (2, 8, D) and (~rk.last_route_mask(routed)).sum(1).tolist() == [4, 4]
    assert report_of(routed).placed[0].kept == 3  # the plan apply made stays the example's


def test_a_new_signature_after_a_block_changed_traces_that_block_again_not_the_plans_stale_trace():
    class Gained(Positional):
        def __init__(self):
            super().__init__()
            self.gain = 1.0  # read as a plain number by the block's own trace, which DAR inlines

        def forward(self, x):
            n = int(x.shape[1])
            return x + self.fc(self.norm(x)) * self.gain * (1 + torch.arange(n, dtype=torch.float32)[:, None] / n)

    model, x = built(Gained), tokens(n=2 * D)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), residual=rk.DAR(kernel="torch"), example_inputs=x)
    assert [b.index for b in report_of(routed).placed[0].bodies] == [1, 2]
    routed.train()
    for block in model.blocks:
        block.gain = 2.0
    torch.manual_seed(0)
    got = routed(x, shift=0.5)
    torch.manual_seed(0)
    want = routing_of(routed).executor.run_fresh(routed, (x,), {"shift": 0.5})
    torch.testing.assert_close(got, want, rtol=0, atol=0)

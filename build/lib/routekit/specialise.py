"""Specialising a plan to a call: the one path a routed model takes when it meets a call it has no program for.

A plan is made on the example call, and graph mode's programs are traced per call signature (and per set of
shapes where a trace baked a number in). A call of another signature or other shapes needs the owner's graph
traced again: its nodes, its constants and every number read off a shape belong to that call. What the
plan drew from the model rather than from the graph need not be found again: each block's own trace (DAR),
where the block sees inputs of the same shapes, and each route's probe answer, where the route's blocks do.
`specialise` traces and analyses the call, and plans the same request on it with every check `make_plan`
makes, asking the model only what the earlier plan cannot answer (`Recalled`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .analysis import analyse
from .config import Route
from .findings import GraphReport
from .plan import Plan, Prober
from .probe import Probe, RouteAnswer
from .state import eager
from .trace import Trace, trace
from .values import same


def specialise(plan: Plan, model: nn.Module, args: tuple, kwargs: dict, *, carry: bool = True) -> tuple[Trace, Plan]:
    """The training trace of `model` on this call, and `plan`'s request planned on it (ConfigError where the
    call breaks it, as `Plan.with_report` says).

    What the graph does not show is measured on this call, as on the example's (a grid no patch embedding
    shows, special tokens, the grid's order): its shapes may be others.
    `carry`: take over what the earlier plan found by running the model (blocks' own traces, route answers)
    where this call gives it the same inputs. False traces everything afresh: where an assumption of the
    earlier program broke (the model changed under it), and where the caller asks for a fresh program."""
    with eager():
        tr = trace(model, args, kwargs)
        report = analyse(tr, model, stack=plan.report.requested, residual=plan.dar is not None,
                         call=(args, kwargs), known=plan.report if carry else None)
    probe = Probe(model, report)
    return tr, plan.with_report(report, Recalled(plan, report, probe, model) if carry else probe)


class Recalled:
    """A `plan.Prober` that answers a route's question from an earlier plan of the same request where the
    route's blocks see the same inputs in both reports (and what the blocks' traces it holds assumed about
    `model` still holds), and asks `probe` otherwise: what a block does with inputs of the same shapes does not
    depend on the call that fed them."""

    def __init__(self, earlier: Plan, report: GraphReport, probe: Prober, model: nn.Module):
        self.earlier, self.report, self.probe, self.model = earlier, report, probe, model

    def route(self, route: Route, start: int, end: int, keep: tuple[int, ...], grid, shrink: tuple[int, ...],
              bodies: bool = False) -> RouteAnswer:
        for placed in self.earlier.placed:
            asked = (route, start, end, keep, grid, shrink, bodies)
            answered = (placed.route, placed.start, placed.end, placed.keep, self.earlier.grid, placed.shrink,
                        self.earlier.dar is not None)
            if asked == answered and same(_inputs(self.earlier.report, start, end), _inputs(self.report, start, end)) \
                    and not any(b.body.assumed.broken(self.model.get_submodule(b.qualname)) for b in placed.bodies):
                return RouteAnswer(placed.kept, shared=placed.shared, bodies=placed.bodies)
        return self.probe.route(route, start, end, keep, grid, shrink, bodies)


def _inputs(report: GraphReport, start: int, end: int) -> Any:
    """What a probe of blocks `start..end` is made of, names of graph nodes left out: the blocks, the stream and
    side inputs they are fed (slots, shapes, how a route cuts them), the token counts of their stacks, and the
    residual adds of their own traces."""
    rows = []
    for block in report.blocks[start:end + 1]:
        stack = report.stack_of(block.index)
        sides = tuple((s.slot, s.meta, s.tokens, s.grid) for s in block.side_inputs)
        body = block.body.specialised if block.body is not None else None
        rows.append((block.qualname, stack.stream_slot, stack.stream, stack.stream_out_index, stack.tokens, sides,
                     block.adds, bool(body)))
    return report.stack_of(start).tokens, tuple(rows)

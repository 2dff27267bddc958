"""The decision `apply` makes, as frozen records: each route resolved against the chain and the stream
(`RoutePlan`), DAR resolved against the blocks (`DarPlan`), and the whole `Plan`, which the rewrite, the hooks,
`bind` and `inspect` read and nobody writes. `plan.make_plan` makes one, with every check; `bind.bind` binds one
to a call of other shapes without deciding anything again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import DAR, Route
from .errors import ConfigError
from .findings import BlockInfo, GraphReport, Shrink
from .report import draw_plan, format_plan
from .selectors import selector


@dataclass(frozen=True)
class RoutePlan:
    """One route, resolved against the chain and the stream: its first and last block (non-negative), the
    positions it always keeps, its kept count; per stack it crosses, the tokens its blocks see there (a later
    stack's stream also holds the tokens the owner joined in, all kept)."""

    route: Route
    start: int
    end: int
    keep: tuple[int, ...]  # sorted non-negative positions every selection contains (in the first stack's stream)
    kept: int  # tokens the route's blocks see (in its first stack)
    shared: bool = False  # one selection for the whole batch: a block reads a table without a batch axis
    shrink: tuple[int, ...] = ()  # the grid axes whose sizes, handed to the blocks as numbers, shrink
    stacks: tuple[int, ...] = (0,)  # the stacks the route runs through, in order
    kept_in: tuple[int, ...] = ()  # tokens its blocks see in each of them
    fixed_in: tuple[int, ...] = ()  # of those, the always-kept ones (its keep, and what each join adds)
    bodies: tuple[BlockInfo, ...] = ()  # DAR: its blocks whose own trace was shape-bound, traced at its kept count

    @property
    def blocks(self) -> range:
        return range(self.start, self.end + 1)

    def kept_at(self, stack: int) -> int:
        return self.kept_in[self.stacks.index(stack)] if self.kept_in else self.kept

    def cuts(self, side, stack: int | None = None) -> tuple:
        """What this route changes in a block's side input (a `findings.SideInput`) in `stack` (its first by
        default): its token-carrying tensors (gathered) and the grid sizes the selector shrinks; () where it
        passes unchanged."""
        fixed = self.fixed_in[self.stacks.index(stack)] if stack is not None and self.fixed_in else len(self.keep)
        return side.tokens + tuple(Shrink(path, fixed) for path, axis in side.grid if axis in self.shrink)


@dataclass(frozen=True)
class DarPlan:
    """DAR resolved against the blocks: aggregation points, the timestep embedding's node, two-phase chunks."""

    config: DAR
    points: int  # one aggregation per residual add (or per block whose adds are hidden)
    timestep: str | None  # the node of e(t) for static_t queries
    two_phase: tuple[tuple[int, int], ...]  # (first point, points) of the chunks computed in two phases
    two_phase_unrouted: tuple[tuple[int, int], ...]  # the same without the routes (DAR's eval graph)


@dataclass(frozen=True)
class Plan:
    """The analysis with the routes and DAR placed on it. It prints as a table and draws as a PNG; its
    report's fields read as its own (`plan.stack` is `plan.report.stack`)."""

    report: GraphReport
    placed: tuple[RoutePlan, ...]  # the routes resolved against the stream
    dar: DarPlan | None
    grid: tuple[int, int] | None  # the token grid selectors see (given, or the report's)
    grid_given: bool  # True: fixed by the user; False: read at run time off the grid node/module
    flops: tuple[tuple[int, int, int], ...] = ()  # (block, tokens its stack's stream has there, forward FLOPs), measured

    @property
    def measured_grid(self) -> tuple[int, ...] | None:
        """The grid the analysis found with nothing to read it off at run time (packed latents whose sizes the call
        named, an image patchified by reshaping): fixed for the shapes this plan serves (another shape is
        planned again)."""
        return self.grid if self.grid and not self.grid_given and not self.report.grid_node else None

    @property
    def routes_shape_bound(self) -> bool:
        """Whether the routes hold for this plan's shapes alone: a grid measured on the call, or positions every
        selection keeps (resolved against this stream's length, and special tokens found on this call: a caption
        of another length moves the image's tokens). A program with them is planned again for other shapes."""
        return self.measured_grid is not None or any(p.keep for p in self.placed)

    @property
    def fused(self) -> tuple[int, ...]:
        """The routes (by number) that end with SPRINT's fusion (`Route.fuse`), not TREAD's restore."""
        return tuple(k for k, r in enumerate(self.placed) if r.route.fuse is not None)

    @property
    def changes_model(self) -> bool:
        """Whether the routed model computes something else than the original in eval too: DAR's aggregations, or
        a fused route's end (both hold parameters the model trains). Its eval runs a program of its own."""
        return self.dar is not None or bool(self.fused)

    @property
    def routes(self) -> list[Route]:
        """The routes as the user gave them."""
        return [p.route for p in self.placed]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.report, name)

    def __str__(self) -> str:
        return format_plan(self)

    def draw(self, path: str) -> str:
        """Write a PNG of the block stack with the routes marked; returns the path."""
        return draw_plan(self, path)

    def route_at(self) -> dict[int, int]:
        """{block index: route number} for every routed block."""
        return {i: k for k, r in enumerate(self.placed) for i in r.blocks}

    def uncompiled_by_dar(self) -> list[str]:
        """The blocks compiled on their own that DAR inlines (every block whose residual adds it rewrites: its
        aggregations read sublayer outputs across blocks), so that in training their code runs uncompiled."""
        return [b.qualname for b in self.report.blocks if self.dar and b.compiled and b.adds]

    def block_flop_fraction(self) -> float:
        """Fraction of block compute left with the routes: each block's forward FLOPs at the tokens it sees, routed
        and not, as counted when the plan was made (`flops_measured`: every token a block reads counts, a joint
        stack's text too, and attention's quadratic share), else compute linear in the stream's tokens."""
        report, kept = self.report, {}
        for r in self.placed:
            kept.update({i: r.kept_at(report.blocks[i].stack) for i in r.blocks})
        tokens = [report.stack_of(i).tokens for i in range(report.depth)]
        if self.flops_measured:
            counted = {(b, n): f for b, n, f in self.flops}
            return sum(counted[i, kept.get(i, n)] for i, n in enumerate(tokens)) / sum(
                counted[i, n] for i, n in enumerate(tokens))
        return sum(kept.get(i, n) for i, n in enumerate(tokens)) / sum(tokens)

    @property
    def flops_measured(self) -> bool:
        return bool(self.flops)

    def check_grid_found(self, tokens: int, grid: tuple[int, ...] | None) -> None:
        """Refuse a call whose stream of `tokens` comes from no grid (`grid` None) or from one of other cells, where
        the example inputs' came from a grid a route's selector reads."""
        reads = [r.selector for r in self.routes if selector(r.selector).needs_grid]
        if reads and (grid is None or math.prod(grid) + len(self.report.special) != tokens):
            found = (f"this call's image makes a {'×'.join(map(str, grid))} grid, {math.prod(grid)} cells for a stream "
                     f"of {tokens} tokens" if grid else f"this call's stream ({tokens} tokens) comes from no grid "
                     "routekit finds")
            raise ConfigError(
                f"selector {reads[0]!r} reads the token grid, and {found}, where the example inputs' stream came from "
                f"a {'×'.join(map(str, self.grid))} grid (a model may "
                "pad some image sizes into a longer sequence, as HiDream does images that are not square): call it "
                "at image sizes like the example's, or route with a selector that reads no grid (selector='random')"
            )

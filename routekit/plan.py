"""The plan: what routekit will do to one model, checked once, frozen.

`make_plan` takes the analysis and the user's request (routes, DAR, grid) and either refuses with a
`ConfigError` that says what was wrong and what would be valid, or returns a `Plan` that the graph
rewrite and the block-call hooks read and nobody writes. Every check lives here: routes against the
stack, `keep` against the stream and its special tokens, blocks a route cannot contain or pass
through, selectors against the grid and the blocks (whole rows), DAR's sources and chunks.

Planning runs nothing: what only running the model can tell (how many tokens a selector keeps, which blocks
fail on them) it asks a `Prober` (probe.py's `Probe`), one question per route, and judges the answer here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

from .config import DAR, Route
from .decision import DarPlan, Plan, RoutePlan
from .errors import ConfigError
from .findings import BlockInfo, GraphReport
from .routing import resolve_keep
from .selectors import selector, selector_names

if TYPE_CHECKING:
    from .probe import RouteAnswer


class Prober(Protocol):
    """What the plan asks of a model: one question per route (probe.py's `Probe` answers it by running blocks)."""

    def route(self, route: Route, start: int, end: int, keep: tuple[int, ...], grid, shrink: tuple[int, ...],
              bodies: bool = False) -> RouteAnswer: ...

    def block_flops(self, block: int, tokens: int, shrink: tuple[int, ...] = ()) -> int | None: ...


def make_plan(report: GraphReport, routes: list[Route], residual: DAR | None, probe: Prober, *,
              grid: tuple[int, int] | None = None) -> Plan:
    """Check the request against the analysis and freeze it; ConfigError names what is wrong and what would be valid.

    `probe` answers what the report cannot (`Prober`): `probe.Probe(model, report)` for the model analysed.
    """
    given = grid is not None
    grid = checked_grid(grid, report.tokens, len(report.special)) if given else report.grid
    try:
        spans = resolve_blocks(routes, [b.qualname for b in report.blocks])
    except ConfigError as err:
        others = {k: v for k, v in report.candidates.items() if k not in {s.name for s in report.stacks}}
        if not others or "outside the stack" not in str(err):
            raise
        raise ConfigError(
            f"{err}. The stack routed is {report.stack!r}; other chains of blocks: {others}. A model "
            "whose blocks sit in stages (Swin's windowed stages joined by patch merging, a U-Net's levels) has one "
            "chain per stage, with another token count in each: a route lives in one, named with stack='...'"
        ) from None
    planned = []
    for k, (route, (start, end)) in enumerate(zip(routes, spans)):
        keep = _checked_keep(k, route, report.stack_of(start), grid)
        _check_image_tables(k, route, report.blocks[start:end + 1], report, keep)
        shrink = _shrink(k, route, report.blocks[start:end + 1], grid)
        _check_blocks_of(k, route, report.blocks[start:end + 1], report, grid, given, residual is not None)
        answer = probe.route(route, start, end, keep, grid, shrink, bodies=residual is not None)
        _check_answer(k, route, report.blocks[start:end + 1], answer, grid)
        stacks = tuple(range(report.blocks[start].stack, report.blocks[end].stack + 1))
        planned.append(RoutePlan(route, start, end, keep, answer.kept, shared=answer.shared, shrink=shrink,
                                 stacks=stacks, kept_in=report.joined_counts(start, end, answer.kept),
                                 fixed_in=report.joined_counts(start, end, len(keep)), bodies=answer.bodies))
    _check_fused(report, routes, residual)
    dar = _dar_plan(residual, report, planned) if residual is not None else None
    return Plan(report, tuple(planned), dar, grid, given, _block_flops(report, planned, probe))


def _check_fused(report: GraphReport, routes: list[Route], residual: DAR | None) -> None:
    """Fused routes (`Route.fuse`, SPRINT's end) need graph mode, and do not go with DAR."""
    fused = [k for k, r in enumerate(routes) if r.fuse is not None]
    if not fused:
        return
    k = fused[0]
    if residual is not None:
        raise ConfigError(
            f"route {k} ends with SPRINT's fusion (fuse=...), and residual=DAR(...) aggregates every sublayer output "
            "across the route's end, which the fusion replaces: use one of them (routes with fuse=None, TREAD's end, "
            "go with DAR)")
    if report.mode != "graph":
        raise ConfigError(
            f"route {k} ends with SPRINT's fusion (fuse=...), which runs in eval as well as in training and needs "
            f"graph mode, but {report.model}.forward does not trace ({report.fallback or 'mode=boundary was asked for'}); "
            "route it with fuse=None (TREAD's end runs in boundary mode), or make the forward traceable")


def _block_flops(report: GraphReport, planned: list[RoutePlan], probe: Prober) -> tuple[tuple[int, int, int], ...]:
    """Each block's forward FLOPs at its stack's tokens, and each routed block's at its kept count, as the probe
    counts them; () where any is unknown (the estimate is then token-linear)."""
    if not planned or not hasattr(probe, "block_flops"):
        return ()
    asked = [(b.index, report.stack_of(b.index).tokens, ()) for b in report.blocks]
    asked += [(i, r.kept_at(report.blocks[i].stack), r.shrink) for r in planned for i in r.blocks]
    out = []
    for block, tokens, shrink in asked:
        flops = probe.block_flops(block, tokens, shrink)
        if flops is None:
            return ()
        out.append((block, tokens, flops))
    return tuple(out)


def checked_grid(grid, tokens: int, special: int = 0) -> tuple[int, ...]:
    """A user's grid=(H, W) or (T, H, W): positive ints whose product is the stream's tokens, or its tokens but
    the `special` ones (text, register, class tokens joined to the image's)."""
    if not (isinstance(grid, (tuple, list)) and len(grid) in (2, 3) and all(type(g) is int and g > 0 for g in grid)):
        raise ConfigError(f"grid is (H, W) or (T, H, W), positive ints, got {grid!r:.80}")
    if math.prod(grid) not in (tokens, tokens - special):
        others = f" or, without its {special} special tokens, {tokens - special}" if special else ""
        raise ConfigError(f"grid {tuple(grid)} does not match the stream's {tokens} tokens{others} (the grid's "
                          "product must equal it)")
    return tuple(int(g) for g in grid)


def resolve_blocks(routes: list[Route], block_names: list[str]) -> list[tuple[int, int]]:
    """Each route's (start, end) as non-negative block indices (negative ones count from the end); refuses
    routes that do not fit a stack with these blocks, listing the valid blocks, and routes that overlap."""
    depth = len(block_names)
    listing = ", ".join(f"{i}: {n}" for i, n in enumerate(block_names))
    spans = []
    for k, r in enumerate(routes):
        ends = [_named_block(k, r, e, block_names) if isinstance(e, str) else e for e in (r.start, r.end)]
        bad = [i for i in ends if not -depth <= i < depth]
        if bad:
            raise ConfigError(
                f"route {k} ({r.start}→{r.end}): block {bad[0]} is outside the stack: valid block indices are "
                f"0..{depth - 1}, or -{depth}..-1 counting from the end ({listing})"
            )
        start, end = ends[0] % depth, ends[1] % depth
        if start > end:
            raise ConfigError(f"route {k} ({r.start}→{r.end}) starts at block {start}, after its end at block {end}; "
                              "the route covers blocks start..end")
        spans.append((start, end))
    ordered = sorted(range(len(spans)), key=lambda k: spans[k][0])
    for i, j in zip(ordered, ordered[1:]):
        (a_start, a_end), (b_start, b_end) = spans[i], spans[j]
        if b_start <= a_end:
            raise ConfigError(
                f"route {j} ({b_start}→{b_end}) overlaps route {i} ({a_start}→{a_end}): routes must be disjoint; "
                f"a route after route {i} can start at block {a_end + 1} or later"
            )
    return spans


def _named_block(k: int, route: Route, name: str, block_names: list[str]) -> int:
    """The chain index of a block named by its stack and its index in it ("single_transformer_blocks.-2")."""
    container, _, index = name.rpartition(".")
    members = [i for i, n in enumerate(block_names) if n.rpartition(".")[0] == container]
    stacks = list(dict.fromkeys(n.rpartition(".")[0] for n in block_names))
    if not members or not index.lstrip("-").isdigit() or not -len(members) <= int(index) < len(members):
        raise ConfigError(
            f"route {k} ({route.start}→{route.end}): {name!r} names no block of the chain; name one as "
            f"'<stack>.<index>' with a stack of {stacks} and an index within it (negative ones count from its end)"
        )
    return members[int(index)]


def suggestion(special: tuple[int, ...]) -> str:
    return f"keep={list(special)}"


def _checked_keep(k: int, route: Route, report, grid) -> tuple[int, ...]:
    """The route's resolved keep: the positions given, or with `keep=None` the special tokens analysis found
    (class, register, text tokens: a route never sets them aside unless `keep=[]` says to); refuses keeps
    that do not fit the stream. `report`: the stack the route starts in (its stream, special tokens)."""
    tokens = report.tokens
    if route.keep is None and report.unknown_special:
        raise ConfigError(
            f"route {k}: {report.unknown_special}, so it cannot keep them by itself: pass keep=[...] with the "
            "positions of the tokens that are not the image's (text, register, class tokens; negative positions "
            "count from the end), or keep=[] to route every token alike"
        )
    try:
        keep = resolve_keep(report.special if route.keep is None else route.keep, tokens)
    except ConfigError as err:
        raise ConfigError(f"route {k}: {err}") from None
    if selector(route.selector).needs_grid and grid is not None:
        special = resolve_keep(report.special, tokens)
        if tokens - len(keep) != math.prod(grid) or (special and keep != special):
            fix = f"; keep exactly the special tokens: {suggestion(report.special)}" if report.special else ""
            raise ConfigError(
                f"route {k}: selector {route.selector!r} picks from the {'×'.join(map(str, grid))} grid, but with "
                f"keep={list(keep)} {tokens - len(keep)} of the {tokens} tokens are left to pick from{fix}"
            )
    return keep


def _check_image_tables(k: int, route: Route, blocks: tuple[BlockInfo, ...], report: GraphReport,
                        keep: tuple[int, ...]) -> None:
    """Refuse a keep without the special tokens where a block of the route takes a table over the image's tokens
    only (`sides.image_tables`): the block lines it up with the stream's last tokens, so the special ones must
    all stay before them."""
    special = resolve_keep(report.stack_of(blocks[0].index).special, report.stack_of(blocks[0].index).tokens)
    if set(special) <= set(keep):
        return
    for block in blocks:
        tokens = report.stack_of(block.index).tokens
        for side in block.side_inputs:
            short = next((g for g in side.tokens if side.leaf(g.path).shape[g.axes[0]] < tokens), None)
            if short is not None:
                where = "".join(f"[{p!r}]" for p in short.path)
                raise ConfigError(
                    f"route {k}: keep={list(route.keep)} sets aside special tokens, but {block.qualname}'s input "
                    f"{side.slot!r}{where} ({side.describe()}) is a table over the image's tokens only, which the "
                    f"block lines up with the stream's last tokens: every token before them must stay. Leave keep "
                    f"unset to keep the special tokens ({suggestion(report.special)}), or keep them all"
                )


def _check_blocks_of(k: int, route: Route, blocks: tuple[BlockInfo, ...], report: GraphReport, grid,
                     given: bool, dar: bool = False) -> None:
    """Refuse blocks the route cannot contain or pass through, as the report shows them, and a grid selector
    without a grid, or with a found one (not `given`) whose lines the stream breaks up."""
    for block in blocks:
        hidden = [s for s in block.side_inputs if s.unordered]
        if hidden:
            raise ConfigError(
                f"route {k} cannot contain {block.qualname}: its input {hidden[0].slot!r} holds a table over the "
                f"stream's tokens joined with another input's ({hidden[0].describe()}), and the block's code does not "
                "show which come first (routekit reads that off a cat of the two inside the block); end the route "
                "before this block"
            )
        sealed = [s for s in block.side_inputs if s.sealed]
        if sealed:
            side = sealed[0]
            where = "".join(f"[{k!r}]" for k in side.sealed[0])
            raise ConfigError(
                f"route {k} cannot contain {block.qualname}: its input {side.slot!r}{where} is an object "
                f"({side.describe()}) holding a tensor over the stream's tokens, and a route does not cut inside "
                "objects (state such as a cache is the blocks' own); pass that tensor to the block as an argument "
                "or inside a tuple/list/dict, or end the route before this block"
            )
        collided = [s for s in block.side_inputs if s.collided]
        if collided:
            side = collided[0]
            where = "".join(f"[{k!r}]" for k in side.collided[0])
            raise ConfigError(
                f"route {k} cannot contain {block.qualname}: its input {side.slot!r}{where} ({side.describe()}) has "
                f"a last axis as long as the stream's {report.stack_of(block.index).tokens} tokens, and the block "
                "runs neither with that axis cut nor with it kept when the stream is cut, so routekit cannot tell "
                "whether it holds tokens or features; trace with example inputs of another token count (one no "
                "feature axis is as long as)"
            )
        uncarried = _uncarried(block, blocks, report.mode == "graph" and not dar)
        if uncarried:
            raise ConfigError(
                f"route {k} cannot contain {block.qualname}: it returns a per-token value used elsewhere "
                f"({uncarried[0]}), which would have only the kept tokens"
            )
    for block in blocks[:-1]:  # graph mode puts such outputs back like the stream; boundary mode where the forward
        # returns them (hidden states per layer), not where the owner's code reads them (a long skip)
        read = [e for e in block.escapes if report.mode != "boundary" or e.split(" → ")[1] != "output"]
        if read and (report.mode == "boundary" or dar):
            why = "boundary mode places routes at block calls and cannot put back" if report.mode == "boundary" \
                else "with DAR, routekit does not put back"
            raise ConfigError(
                f"route {k} cannot pass through {block.qualname}: its output is also used by "
                f"{read[0].split(' → ')[1]}, outside the chain, and {why} a block output read outside the "
                f"chain; end the route at block {block.index} or start it after"
            )
    if selector(route.selector).needs_grid and grid is None:
        raise ConfigError(
            f"route {k}: selector {route.selector!r} needs the token grid, and none was found (no 4-D patch "
            "embedding output upstream of the stream); pass grid=(H, W) to routekit.apply"
        )
    reordered = report.stack_of(blocks[0].index).reordered
    if selector(route.selector).needs_grid and not given and reordered:
        raise ConfigError(
            f"route {k}: selector {route.selector!r} keeps runs of tokens as lines of the grid, but {reordered}: "
            "use a selector that reads no grid (selector='random'), or pass grid= only if the stream's own order is "
            "a grid's"
        )


def _uncarried(block: BlockInfo, blocks: tuple[BlockInfo, ...], rewritten: bool) -> list:
    """The reads of `block`'s per-token outputs besides its stream that a route over `blocks` cannot carry. A later
    block of the route reads what the route made, its kept tokens, as it is. Any other reader of an output the
    block hands on unchanged from its inputs (T5's position bias, made once and passed from layer to layer) reads
    the whole value the route cut, which a rewritten graph (graph mode without DAR) can hand it."""
    later = {b.node for b in blocks if b.index > block.index}
    return [read for read in block.aux_escapes
            if read.reader not in later and not (rewritten and read.path in dict(block.handed_on))]


def _check_answer(k: int, route: Route, blocks: tuple[BlockInfo, ...], answer: RouteAnswer, grid) -> None:
    """Refuse the selector where the probe found a block of the route that cannot take what it keeps."""
    stuck = [b for b in blocks if b.index in answer.stuck]
    if stuck:
        block = stuck[0]
        fix = ("and so does every block of the route: no route can hold them" if len(stuck) == len(blocks) else
               f"start the route after block {block.index}" if block is blocks[0] else
               f"end the route before block {block.index}")
        raise ConfigError(
            f"route {k}: {block.qualname} ({block.cls}) fails on fewer tokens than the stream's, whole grid rows "
            "fewer too, so no selector can route it: it holds or is handed something as long as the stream that a "
            f"route does not cut (a position bias of its own, say); {fix}"
        )
    for block in blocks:
        if block.index in answer.fails:
            raise ConfigError(
                f"route {k}: {block.qualname} ({block.cls}) fails on the {answer.kept} tokens selector "
                f"{route.selector!r} keeps of the {'×'.join(map(str, grid))} grid; try another grid selector "
                "('row', 'column', 'window', 'frame') or end the route before this block"
            )
        if block.index in answer.rows:
            raise ConfigError(
                f"route {k}: {block.qualname} ({block.cls}) fails on a token count that is not whole grid rows, "
                f"so selector {route.selector!r} would break it; use selector='row' (or 'window')"
            )


def _shrink(k: int, route: Route, blocks, grid) -> tuple[int, ...]:
    """The grid axes (negative) whose sizes the route's blocks are handed and its selector shrinks; refuses a
    selector whose kept tokens form no grid, where a block takes the grid's sizes."""
    takers = [b for b in blocks if any(s.grid for s in b.side_inputs)]
    if not takers or grid is None:
        return ()
    spec = selector(route.selector)
    kept = spec.kept_grid(grid, route.rate) if spec.kept_grid else None
    if kept is None:
        names = [s.slot if s.argument is None else s.argument for s in takers[0].side_inputs if s.grid]
        fitting = [n for n in selector_names() if (f := selector(n).kept_grid) and f(grid, route.rate) is not None]
        raise ConfigError(
            f"route {k}: {takers[0].qualname} is handed the token grid's sizes as numbers (arguments "
            f"{', '.join(map(repr, names))}), so the tokens it keeps must form a grid smaller than the "
            f"{'×'.join(map(str, grid))} one, which selector {route.selector!r}'s do not; selectors that keep such a "
            f"grid on this one: {', '.join(map(repr, fitting)) or 'none'}"
        )
    return tuple(axis - len(grid) for axis in range(len(grid)) if kept[axis] != grid[axis])


def _dar_plan(config: DAR, report: GraphReport, routes: list[RoutePlan]) -> DarPlan:
    if report.mode != "graph":
        raise ConfigError(
            "residual=DAR(...) rewrites the residual adds of a traced graph and needs graph mode, but "
            f"{report.model}.forward does not trace ({report.fallback or 'mode=boundary was asked for'})"
        )
    checkpointed = [b.qualname for b in report.blocks if b.checkpointed and b.adds]
    if checkpointed:
        raise ConfigError(
            f"residual=DAR(...) inlines the blocks into one graph, and the forward runs {checkpointed[0]} under "
            "torch.utils.checkpoint, which DAR would silently drop (activation memory would come back); turn "
            "activation checkpointing off for DAR (model.disable_gradient_checkpointing() in diffusers)"
        )
    if report.residual is None or report.residual.startswith("unknown"):
        raise ConfigError(
            f"residual=DAR(...) needs each block of {report.stack} traced alone to find its residual adds: "
            f"{report.residual or 'the blocks were not analysed'}"
        )
    joined = [s for s in report.stacks[1:] if s.tokens != report.stacks[0].tokens]
    if joined:
        raise ConfigError(
            f"residual=DAR(...) aggregates sublayer outputs of one shape, and the stream of {joined[0].name} also "
            f"holds the {joined[0].tokens - report.stacks[0].tokens} tokens the model joins in before it; give DAR "
            f"one stack: stack={report.stacks[0].name!r} or stack={joined[0].name!r}"
        )
    plain = [b.qualname for b in report.blocks if b.residual_free]
    if plain:
        more = f" (and {len(plain) - 1} more blocks)" if len(plain) > 1 else ""
        raise ConfigError(
            f"residual=DAR(...) replaces residual adds, and {plain[0]}{more} has none: its output is not its input "
            "plus a sublayer's output, so there is no history for DAR to aggregate over; DAR applies to residual "
            "networks (DiT, ViT, LLM blocks)"
        )
    timestep = None
    if config.query == "static_t":
        timestep = report.embedding(config.timestep)
        if timestep is None and config.timestep is not None:
            raise ConfigError(f"DAR(timestep={config.timestep!r}): no call of that module yields a "
                              f"(batch, {report.stream.shape[2]}) embedding")
        if timestep is None:
            raise ConfigError(
                "DAR(query='static_t') needs the model's timestep embedding: no (batch, channels) value computed "
                "from a 1-D float input alone was found; name the module with DAR(timestep='t_embedder')"
            )
    for route in routes:
        for body in route.bodies:
            stack, adds = report.stack_of(body.index), report.blocks[body.index].adds
            if len(body.adds) != len(adds):
                raise ConfigError(
                    f"DAR: {body.qualname} has {len(body.adds)} residual adds on the route's {route.kept_at(body.stack)} "
                    f"tokens but {len(adds)} on all {stack.tokens}; its code branches on the token count, so DAR "
                    "cannot be combined with this route"
                )
    sizes = [len(b.adds) or 1 for b in report.blocks]
    return DarPlan(config, sum(sizes), timestep, tuple(sorted(two_phase_chunks(sizes, routes, config).items())),
                   tuple(sorted(two_phase_chunks(sizes, [], config).items())))


def two_phase_chunks(sizes: list[int], routes: list[RoutePlan], config: DAR) -> dict[int, int]:
    """{first point: points} of the chunks computed in two phases, for blocks of `sizes` aggregation points:
    static queries (known before the chunk runs), chunks of two or more points, and no route boundary
    inside the chunk (its shared sources must keep their tokens throughout)."""
    if config.query == "dynamic" or (config.chunk or 0) < 2:
        return {}
    first = [0]
    for size in sizes:
        first.append(first[-1] + size)
    total = first[-1]
    boundaries = {first[r.start] for r in routes} | {first[r.end + 1] for r in routes}
    chunks = {}
    for p in range(0, total, config.chunk):
        size = min(config.chunk, total - p)
        if size >= 2 and not any(b in boundaries for b in range(p + 1, p + size)):
            chunks[p] = size
    return chunks

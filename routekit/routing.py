"""The operations a route inserts: choose the kept tokens, gather them, scatter them back.

Both executors call exactly these (the rewritten graph as nodes, boundary mode from hooks), so a
route computes the same thing whichever places it. Plain torch ops, so torch.compile sees through them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .config import Route
from .errors import ConfigError, SelectorError
from .findings import Shrink
from .selectors import checked, uniform
from .selectors import selector as selector_spec


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...) → (B, K, ...): the tokens `index` (B, K) of each sample, laid out in memory as `x` is.

    A side input shared by the batch as (1, N, ...) (a position table traced at batch 1, say) is
    gathered per sample: each sample gets the rows of its own kept tokens.
    """
    if x.shape[0] != index.shape[0] and x.shape[0] == 1:
        x = x.expand(index.shape[0], *x.shape[1:])
    return _gather(x, 1, index)


def _gather(x: torch.Tensor, axis: int, index: torch.Tensor) -> torch.Tensor:
    """x (B, ..., N at `axis`, ...) → the same with K at `axis`: each sample's positions `index` (B, K).

    Where every token is kept (K = N: a route at rate 0, a fused route in eval), laid out in the order of `x`'s
    strides: a block's kernels may take another path for another memory layout (oneDNN's convolution rounds
    differently for a channels-last input on some CPUs), so the blocks see the stream laid out as they would
    without the route, and the route reproduces the original bit for bit. Where tokens are dropped, contiguous,
    as a hand-written gather gives them: the blocks see a new tensor either way, and a transposed stream (a patch
    embedding's `flatten(2).transpose(1, 2)`, which DiM's scan blocks read) runs its matmuls and convolutions
    slower than a contiguous one."""
    order = _kept_layout(x, axis, index)
    if order is None:
        return _take(x, axis, index, 0)
    inverse = sorted(range(x.dim()), key=order.__getitem__)
    return _take(x.permute(order), order.index(axis), index, order.index(0)).permute(inverse)


def _take(x: torch.Tensor, axis: int, index: torch.Tensor, batch: int) -> torch.Tensor:
    """`x.gather` along `axis` with `index` (B, K) laid on x's axes `batch` (B) and `axis` (K)."""
    shape = [1] * x.dim()
    shape[batch], shape[axis] = index.shape
    expanded = list(x.shape)
    expanded[axis] = index.shape[1]
    return x.gather(axis, (index if batch < axis else index.t()).reshape(shape).expand(expanded))


def _kept_layout(x: torch.Tensor, axis: int, index: torch.Tensor) -> list[int] | None:
    """The axis order a route lays `x` out in, gathered or scattered back at `index` (B, K) along `axis`: x's own
    (`_dense_order`) where every token is kept, where the bits must be the original's; else None, contiguous."""
    return _dense_order(x) if index.shape[1] == x.shape[axis] else None


def _dense_order(x: torch.Tensor) -> list[int] | None:
    """The axis order in which a dense, non-contiguous `x` is contiguous (a transposed view, a channels-last
    image): None for a contiguous tensor, or one that is not dense (an expanded table). None as well inside a
    compiled graph: there the compiler lays tensors out, eager kernels' rounding is not at stake, and a permuted
    gather would only hold the routed blocks to the stream's strided layout."""
    if torch.compiler.is_compiling() or x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return order if x.permute(order).is_contiguous() else None


def every_token(stream: torch.Tensor) -> torch.Tensor:
    """The index (B, N) of every token of `stream`: a fused route's selection in eval, where it keeps them all
    and only its end (SPRINT's fusion) changes what the model computes."""
    return torch.arange(stream.shape[1], device=stream.device).expand(stream.shape[0], -1)


def static_tokens(value: Any, axes: tuple[tuple[tuple, tuple[int, ...]], ...] = (((), (1,)),)) -> Any:
    """`value` with its token axes marked static for torch.compile (`axes`: (path, axes) of each tensor in it): a
    block compiled on its own meets two token counts, all and the kept ones, and Dynamo would otherwise compile
    it again for any count (automatic dynamic shapes), slower kernels for both. Outside a compiled region."""
    if torch.compiler.is_compiling():
        return value
    for path, marked in axes:
        leaf = value
        for key in path:
            leaf = leaf[key]
        if isinstance(leaf, torch.Tensor):
            torch._dynamo.mark_static(leaf, list(marked))
    return value


def joined_index(index: torch.Tensor, offset: int, inner: int, tokens: int) -> torch.Tensor:
    """A route's kept positions (B, K) of a stack's `inner` tokens, in the next stack's stream of `tokens`, where
    the owner's code put those at `offset` and joined others around them (text in front): the others, all
    kept, and the kept ones moved past those before them; sorted as `index` is."""
    batch = index.shape[0]
    before = torch.arange(offset, device=index.device).expand(batch, offset)
    after = torch.arange(offset + inner, tokens, device=index.device).expand(batch, tokens - offset - inner)
    return torch.cat([before, index + offset, after], dim=1)


def joined_stream(joint: torch.Tensor, full: torch.Tensor, index: torch.Tensor, start: int) -> torch.Tensor:
    """The full-size stream of a route's next stack: the owner's join of the kept tokens with its own (`joint`:
    text in front at `start`, in front of the kept tokens), with the route's full stream in place of the kept
    run, so that its routed tokens rejoin with their value at the route's start."""
    kept = index.shape[1]
    return torch.cat([joint[:, :start], full.to(joint.dtype), joint[:, start + kept:]], dim=1)


def route_side(value: Any, stream: torch.Tensor, index: torch.Tensor, cuts: tuple, shared: bool) -> Any:
    """A block argument as the route's blocks see it: every `Gather`ed tensor at the kept tokens of `index`
    (B, K) (`stream` gives the token count), every `Shrink`ed number the kept count, the rest as it is.

    A table without a batch axis becomes one per sample (B, ...) unless the route's selection is `shared` by
    the batch (every row of `index` alike): then it is gathered once and stays one table.
    """
    by_path = {cut.path: cut for cut in cuts}
    tokens = stream.shape[1]

    def cut(path, leaf):
        rule = by_path.get(keys(path))
        if isinstance(rule, Shrink):
            return leaf * (index.shape[1] - rule.fixed) // (tokens - rule.fixed)
        if rule is None or not isinstance(leaf, torch.Tensor):
            return leaf
        for axis in rule.axes:
            leaf = _gather_axis(leaf, index, axis, tokens, rule.batched, rule.rest_first, shared)
        return leaf

    return pytree.tree_map_with_path(cut, value, is_leaf=is_opaque)


def is_opaque(value: Any) -> bool:
    """Values a route never looks into: anything but a tuple, list or dict. An object such as a generation
    cache is state the blocks update, not an input a route cuts (even where it registers itself with pytree)."""
    return not isinstance(value, (tuple, list, dict))


def keys(path: tuple) -> tuple:
    """A pytree key path as plain keys: sequence indices, mapping keys and attribute names."""
    return tuple(getattr(k, "idx", getattr(k, "key", getattr(k, "name", k))) for k in path)


def _gather_axis(x: torch.Tensor, index: torch.Tensor, axis: int, tokens: int, batched: bool, rest_first: bool,
                 shared: bool) -> torch.Tensor:
    rest = x.shape[axis] - tokens
    if rest < 0:  # a table over the stream's tokens less its first -rest, special ones every route keeps (the plan
        # refuses a keep without them), so they lead every row of the sorted index: the rest index the table
        return _gather_axis(x, index[:, -rest:] + rest, axis, tokens + rest, batched, False, shared)
    if rest:  # a joint table: the other tokens stay, the stream's part is gathered
        own = x.narrow(axis, rest if rest_first else 0, tokens)
        other = x.narrow(axis, 0 if rest_first else tokens, rest)
        mine = _gather_axis(own, index, axis, tokens, batched, False, shared)
        if mine.dim() > other.dim():  # the table gained a batch axis
            other = other.unsqueeze(0).expand(mine.shape[0], *other.shape)
            axis += 1
        return torch.cat([other, mine] if rest_first else [mine, other], dim=axis)
    if not batched:
        if shared:
            return x.index_select(axis, index[0])
        x, axis = x.unsqueeze(0), axis + 1
    if x.shape[0] != index.shape[0]:  # shared by the batch as (1, ...): each sample gets its own rows
        x = x.expand(index.shape[0], *x.shape[1:])
    return _gather(x, axis, index)


def scatter_tokens(full: torch.Tensor, index: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`full` with the tokens `index` replaced by `kept`: routed tokens keep their route-start value. Laid out as
    `_gather` lays out its tokens (`_kept_layout`): as `full` is where every token comes back from the blocks,
    contiguous where some were routed around, as a hand-written scatter gives it (handed DiM's transposed stream
    back, the blocks after the route copied their gradients in the backward where the hand-written route's did
    not)."""
    full = full.to(kept.dtype)
    order = _kept_layout(full, 1, index)
    if order is not None:
        inverse = sorted(range(full.dim()), key=order.__getitem__)
        return _put(full.permute(order), order.index(1), index, kept.permute(order), order.index(0)).permute(inverse)
    return _put(full, 1, index, kept, 0)


def _put(full: torch.Tensor, axis: int, index: torch.Tensor, kept: torch.Tensor, batch: int) -> torch.Tensor:
    """`full.scatter` along `axis` of `kept` at `index` (B, K) laid on the axes `batch` and `axis`."""
    shape = [1] * full.dim()
    shape[batch], shape[axis] = index.shape
    return full.scatter(axis, (index if batch < axis else index.t()).reshape(shape).expand(kept.shape), kept)


def kept_tokens(selector: str, rate: float, keep: tuple[int, ...], tokens: int, grid) -> int:
    """How many tokens a route's blocks see: the kept positions plus the selector's share of the others. Asked of
    the selector itself (once, on CPU), for a selector of the user's may keep any count it likes."""
    others = tokens - len(keep)
    if selector_spec(selector).needs_grid and (grid is None or math.prod(grid) != others):
        return len(keep) + others - int(others * rate)
    index = select_tokens(selector, 1, tokens, rate, keep, grid=grid, generator=torch.Generator().manual_seed(0),
                          device="cpu", stream=torch.zeros(1, tokens, 1))
    return index.shape[1]


def resolve_keep(keep: tuple[int, ...] | None, tokens: int) -> tuple[int, ...]:
    """`keep` as sorted non-negative positions in a stream of `tokens` tokens; ConfigError if out of range."""
    if not keep:
        return ()
    bad = [i for i in keep if not -tokens <= i < tokens]
    if bad:
        raise ConfigError(
            f"keep={list(keep)}: position {bad[0]} is outside the stream's {tokens} tokens "
            f"(valid positions are {-tokens}..{tokens - 1}; negative ones count from the end)"
        )
    resolved = tuple(sorted({i % tokens for i in keep}))
    if len(resolved) == tokens:
        raise ConfigError(f"keep={list(keep)} keeps all {tokens} tokens of the stream, so the route would skip nothing")
    return resolved


class RouteSelect(nn.Module):
    """Chooses the tokens one route keeps, per forward, and remembers them (for `last_route_mask`).

    `keep`: the route's `keep` resolved against the stream (sorted non-negative positions): every
    selection contains them and the selector picks among the other tokens. `grid`: a fixed grid, else
    the grid is read off `grid_source` at each call. Holds no parameters, so the state_dict is the model's.
    """

    def __init__(self, route: Route, keep: tuple[int, ...] = (), grid: tuple[int, ...] | None = None,
                 shared: bool = False):
        super().__init__()
        self.route, self.keep, self.grid, self.shared = route, tuple(keep), grid, shared
        self.generator: torch.Generator | None = None
        self.force: torch.Tensor | None = None  # (batch, tokens) bool: tokens this call must keep (`force_keep`)
        self.last_index: torch.Tensor | None = None
        self.last_tokens = 0

    def forward(self, stream: torch.Tensor, grid_source: torch.Tensor | tuple[int, ...] | None = None,
                keep: tuple[int, ...] | None = None) -> torch.Tensor:
        """`keep`: the positions this call keeps, where its plan resolved them again (a stream of another length:
        another caption, another image size), else this route's."""
        batch, tokens = stream.shape[0], stream.shape[1]
        keep = self.keep if keep is None else keep
        grid = self.grid
        if grid is None and isinstance(grid_source, tuple):  # this call's grid, as boundary mode reads it, or as
            # this plan's shapes measured it (Plan.measured_grid)
            grid = grid_source
        elif grid is None and grid_source is not None:  # the patch embedding's (B, C, H, W) or (B, C, T, H, W) in a graph
            grid = tuple(grid_source.shape[2:])
        rows = 1 if self.shared else batch  # one selection for the whole batch (see Plan: shared)
        index = select_tokens(self.route.selector, rows, tokens, self.route.rate, keep, grid=grid,
                              generator=self.generator, device=stream.device, stream=stream[:rows]).expand(batch, -1)
        if self.force is not None and self.route.rate > 0:
            if self.shared:
                raise SelectorError("a force-keep mask picks tokens per sample, but this route shares one selection "
                                    "by the batch (a block reads a table without a batch axis): it cannot honour it")
            index = with_forced(index, self.force, self.route.selector, self.generator, tokens, keep)
        self.last_index, self.last_tokens = index, tokens
        return index

    def extra_repr(self) -> str:
        r = self.route
        keep = f", keep={list(r.keep)}" if r.keep else ""
        return f"route {r.start}→{r.end}, rate={r.rate}, selector={r.selector!r}{keep}"


def select_tokens(selector: str, batch: int, tokens: int, rate: float, keep: tuple[int, ...] = (), *, grid, generator,
                  device, stream: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, kept) sorted unique indices: the positions `keep` always, the selector's choice among the others.

    At rate 0 every token is kept and no selector runs: nothing is drawn from the RNG, so a model with
    dropout makes the same draws as without the route.
    """
    if rate == 0:
        return torch.arange(tokens, device=device).expand(batch, tokens)
    spec = selector_spec(selector)
    fixed = set(keep)
    others = [i for i in range(tokens) if i not in fixed]
    extra = {}
    if spec.needs_stream:
        extra["stream"] = stream[:, others] if keep else stream
    picked = checked(selector, spec.fn(batch, len(others), rate, grid=grid, generator=generator, device=device,
                                       **extra), batch, len(others))
    if not keep:
        return picked
    positions = torch.tensor(others, dtype=torch.long, device=picked.device)[picked]
    fixed = torch.tensor(keep, dtype=torch.long, device=picked.device).expand(batch, len(keep))
    return torch.cat([fixed, positions], dim=1).sort(dim=1).values


def with_forced(index: torch.Tensor, force: torch.Tensor, selector: str, generator, tokens: int,
                keep: tuple[int, ...] = ()) -> torch.Tensor:
    """`index` changed so that every sample keeps its `force`d tokens (bool (batch, tokens)) as well as the
    positions every selection keeps (`keep`: special tokens first of all): a forced token replaces one the
    selector picked, never a kept one, and where a sample has more than the route keeps, every sample keeps
    that many (one count per batch, so the routed blocks see one shape). The count is read on the host: a
    route with a force mask waits for it."""
    batch, kept = index.shape
    if force.dim() != 2 or tuple(force.shape) != (batch, tokens) or force.dtype != torch.bool:
        raise SelectorError(f"a force-keep mask is a bool (batch, tokens) tensor over the stream the route starts "
                            f"on, here ({batch}, {tokens}); got {force.dtype} {tuple(force.shape)}")
    if selector_spec(selector).keeps_rows or selector_spec(selector).needs_grid:
        raise SelectorError(f"selector {selector!r} keeps whole lines of the grid; a force-keep mask picks single "
                            "tokens, so use it with a selector that does too (random, importance)")
    force = force.to(index.device)
    if keep:
        force = force.clone()
        force[:, list(keep)] = True
    chosen = torch.zeros(force.shape, device=index.device).scatter_(1, index, 1.0)
    scores = 4.0 * force + 2.0 * chosen + uniform(*force.shape, generator=generator, device=index.device)
    count = max(kept, int(force.sum(1).max()))
    return scores.topk(count, dim=1, sorted=False).indices.sort(dim=1).values

"""Token selectors: which tokens a route keeps.

A selector maps (batch, tokens, rate, grid, generator, device[, stream]) to a LongTensor
(batch, kept) of sorted, unique token indices: the tokens that go through the route's blocks.
Sorted indices keep sequence order, which scan backbones (RWKV, Mamba) need. The grid is (H, W), or
(T, H, W) for video. Register your own with `@register_selector("name")`; what a selector returns is
checked at every call (`checked`), so a selector that breaks the contract raises instead of routing
the wrong tokens.

Built in: `random` (TREAD's: an independent uniform subset per sample), `importance` (tokens ranked by
the L1 norm of their features, mixed with chance), and grid selectors that keep whole lines of the
grid: `row`, `window` (a contiguous band of rows), `column`, and for video `frame` (whole frames) and
`tube` (the same spatial positions in every frame). `structured_with_random_offset` (SPRINT's) keeps the same
share of every small cell of the grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import ConfigError, SelectorError

Grid = tuple[int, ...]
Selector = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class SelectorSpec:
    """A registered selector and what routekit must know about it.

    needs_grid: it reads the token grid. keeps_rows: the kept tokens are whole grid rows (W
    consecutive tokens), so a block that reshapes to rows stays valid. needs_stream: it reads the
    stream's values (`stream=` (batch, tokens, channels)). kept_grid: (grid, rate) → the grid the kept
    tokens form, for blocks that are handed the grid's sizes as numbers; None where they form none.
    """

    fn: Selector
    needs_grid: bool = False
    keeps_rows: bool = False
    needs_stream: bool = False
    kept_grid: Callable[[Grid, float], Grid | None] | None = None
    trusted: bool = False  # routekit's own: held to the contract by its tests, not at every call


_REGISTRY: dict[str, SelectorSpec] = {}


def register_selector(name: str, *, needs_grid: bool = False, keeps_rows: bool = False, needs_stream: bool = False,
                      kept_grid: Callable[[Grid, float], Grid | None] | None = None, override: bool = False):
    """Decorator adding a selector under `name` (see `SelectorSpec` for the flags).

    `override`: replace a selector already registered under `name` (otherwise that is an error).
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a selector's name is a non-empty string, got {name!r}")
    if name in _REGISTRY and not override:
        raise ConfigError(f"selector {name!r} is already registered; pass override=True to replace it, or pick "
                          f"another name (registered: {', '.join(sorted(_REGISTRY))})")

    def add(fn: Selector) -> Selector:
        _REGISTRY[name] = SelectorSpec(fn, needs_grid, keeps_rows, needs_stream, kept_grid)
        return fn

    return add


def _builtin(name: str, **flags):
    """Register one of routekit's own selectors (trusted: see `checked`)."""

    def add(fn: Selector) -> Selector:
        _REGISTRY[name] = SelectorSpec(fn, trusted=True, **flags)
        return fn

    return add


def selector(name: str) -> SelectorSpec:
    """The selector registered as `name`, or a ConfigError listing the registered names."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown selector {name!r}; registered selectors: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def selector_names() -> list[str]:
    """The registered selectors' names, sorted: the choices `Route(selector=...)` takes."""
    return sorted(_REGISTRY)


def checked(name: str, index, batch: int, tokens: int) -> torch.Tensor:
    """`index` if it is what a route can use: a LongTensor (batch, kept) with 1 <= kept <= tokens, each row
    sorted, unique and within 0..tokens-1. Shape and dtype are checked on every call; values too for
    selectors routekit does not ship (on CUDA with a device-side assert, so no step waits on the check)."""
    if not isinstance(index, torch.Tensor) or index.dtype != torch.long or index.dim() != 2:
        got = f"{index.dtype} {tuple(index.shape)}" if isinstance(index, torch.Tensor) else type(index).__name__
        raise SelectorError(f"selector {name!r} returned {got}; a selector returns a LongTensor (batch, kept)")
    if index.shape[0] != batch or not 1 <= index.shape[1] <= tokens:
        raise SelectorError(f"selector {name!r} returned indices of shape {tuple(index.shape)} for {batch} samples of "
                            f"{tokens} tokens; expected ({batch}, kept) with 1 <= kept <= {tokens}")
    if selector(name).trusted:
        return index
    ok = (index.diff(dim=1) > 0).all() & (index[:, 0] >= 0).all() & (index[:, -1] < tokens).all()
    if index.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(ok, f"selector {name!r} returned indices that are not sorted, unique and in 0..tokens-1")
    elif not ok:
        raise SelectorError(
            f"selector {name!r} returned indices that are not sorted, unique and within 0..{tokens - 1} in every "
            f"row (first rows: {index[:2].tolist()}); sort them, drop duplicates, keep them in range"
        )
    return index


def _drawn_from(generator: torch.Generator | None) -> dict:
    """The keyword arguments that make a torch draw use `generator`: none at all where it is None, for
    torch.compile's fake tensors refuse an explicit `generator=None` once the batch size is symbolic (torch
    2.13 and 2.14), which the second batch size a compiled model meets makes it."""
    return {} if generator is None else {"generator": generator}


def uniform(*size: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """`torch.rand(*size)` from `generator` (`_drawn_from`): compiles at any batch size. Selectors of your own
    can draw through it too."""
    return torch.rand(*size, device=device, **_drawn_from(generator))


def kept_count(count: int, rate: float) -> int:
    """How many of `count` things a route keeps at `rate` (the fraction routed around)."""
    return count - int(count * rate)


def _keep_sorted(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` largest scores per row, in ascending index order."""
    return scores.topk(keep, dim=1, sorted=False).indices.sort(dim=1).values


@_builtin("random")
def random_tokens(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                  generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """TREAD's selection: each sample keeps an independent uniform subset of tokens."""
    scores = uniform(batch, tokens, generator=generator, device=device)
    return _keep_sorted(scores, kept_count(tokens, rate))


def importance(mix: float = 0.5) -> Selector:
    """A selector keeping the tokens with the largest L1 norm of their features, mixed with chance: each
    token's score is (1 - mix) · its L1 norm scaled to [0, 1] within its sample + mix · a uniform draw.
    mix=0 keeps the top tokens by norm, mix=1 is `random`. Register a mix of your own with
    `register_selector("importance_30", needs_stream=True)(importance(0.3))`."""
    if not 0.0 <= mix <= 1.0:
        raise ConfigError(f"importance(mix=...) is the share of chance in the score, in [0, 1]; got {mix}")

    def select(batch: int, tokens: int, rate: float, *, stream: torch.Tensor, grid: Grid | None = None,
               generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        norm = stream.detach().float().abs().sum(-1)  # (batch, tokens): the selection is not trained
        low, high = norm.amin(1, keepdim=True), norm.amax(1, keepdim=True)
        scaled = (norm - low) / (high - low).clamp_min(torch.finfo(torch.float32).tiny)
        scores = (1 - mix) * scaled
        if mix:
            scores = scores + mix * uniform(batch, tokens, generator=generator, device=device)
        return _keep_sorted(scores, kept_count(tokens, rate))

    return select


_builtin("importance", needs_stream=True)(importance(0.5))


def _rows_to_tokens(rows: torch.Tensor, width: int) -> torch.Tensor:
    cols = torch.arange(width, device=rows.device)
    return (rows[:, :, None] * width + cols).flatten(1)


def _rows(grid: Grid) -> tuple[int, int]:
    """(rows, width) of a grid: a video's rows are those of every frame, one after another."""
    return math.prod(grid[:-1]), grid[-1]


def _fewer_rows(grid: Grid, rate: float) -> Grid | None:
    return (kept_count(grid[0], rate), grid[1]) if len(grid) == 2 else None


@_builtin("row", needs_grid=True, keeps_rows=True, kept_grid=_fewer_rows)
def random_rows(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Whole rows of the grid per sample (of every frame, for video): on an H×W grid the kept tokens form a
    smaller (H', W) grid."""
    height, width = _rows(_checked_grid(grid, tokens, "row"))
    rows = _keep_sorted(uniform(batch, height, generator=generator, device=device), kept_count(height, rate))
    return _rows_to_tokens(rows, width)


@_builtin("window", needs_grid=True, keeps_rows=True, kept_grid=_fewer_rows)
def random_window(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                  generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """A contiguous band of whole rows per sample: scans see one unbroken stretch of the image."""
    height, width = _rows(_checked_grid(grid, tokens, "window"))
    keep_rows = kept_count(height, rate)
    first = torch.randint(0, height - keep_rows + 1, (batch, 1), device=device, **_drawn_from(generator))
    rows = first + torch.arange(keep_rows, device=first.device)
    return _rows_to_tokens(rows, width)


def _fewer_columns(grid: Grid, rate: float) -> Grid:
    return (*grid[:-1], kept_count(grid[-1], rate))


@_builtin("column", needs_grid=True, kept_grid=_fewer_columns)
def random_columns(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                   generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Whole columns per sample (the same columns in every frame), for blocks that scan vertically."""
    height, width = _rows(_checked_grid(grid, tokens, "column"))
    cols = _keep_sorted(uniform(batch, width, generator=generator, device=device), kept_count(width, rate))
    rows = torch.arange(height, device=cols.device)
    return (rows[None, :, None] * width + cols[:, None, :]).flatten(1)


def _fewer_frames(grid: Grid, rate: float) -> Grid | None:
    return (kept_count(grid[0], rate), *grid[1:]) if len(grid) == 3 else None  # frames of a video only


@_builtin("frame", needs_grid=True, keeps_rows=True, kept_grid=_fewer_frames)
def random_frames(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                  generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Whole frames of a T×H×W video grid per sample: the kept tokens form a shorter (T', H, W) video."""
    frames, height, width = _checked_grid(grid, tokens, "frame", rank=3)
    kept = _keep_sorted(uniform(batch, frames, generator=generator, device=device), kept_count(frames, rate))
    return _rows_to_tokens(kept, height * width)


@_builtin("tube", needs_grid=True)
def random_tubes(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                 generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """The same spatial positions in every frame of a T×H×W video grid, per sample: each kept position is a
    tube through time, so the routed blocks still see every frame of it."""
    frames, height, width = _checked_grid(grid, tokens, "tube", rank=3)
    area = height * width
    spots = _keep_sorted(uniform(batch, area, generator=generator, device=device), kept_count(area, rate))
    starts = torch.arange(frames, device=spots.device) * area
    return (starts[None, :, None] + spots[:, None, :]).flatten(1)


def cell_of(grid: Grid, rate: float) -> tuple[int, int] | None:
    """(side, kept) of `structured_with_random_offset`'s cells on `grid` at `rate`: the smallest side from 2 that
    divides every axis of the grid and whose cell (side along every axis) keeps a whole number of its tokens, 1 or
    more, adding up to the route's kept count; None where no side does."""
    for side in range(2, min(grid) + 1):
        volume = side ** len(grid)
        kept = volume * (1 - rate)
        cells = math.prod(grid) // volume
        if all(g % side == 0 for g in grid) and round(kept) >= 1 and abs(kept - round(kept)) < 1e-6 \
                and cells * round(kept) == kept_count(math.prod(grid), rate):
            return side, round(kept)
    return None


@_builtin("structured_with_random_offset", needs_grid=True)
def structured_with_random_offset(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                                  generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """SPRINT's structured selection: the grid cut into cells of side g along every axis (g×g on an image's grid,
    g×g×g on a video's), each cell keeping k = g^d·(1 − rate) of its tokens, drawn uniformly without replacement,
    independently per cell and per sample (each cell's own random offset). g is the smallest side from 2 that
    divides every axis and leaves k a whole number (`cell_of`): at rate 0.75 one token of every 2×2 cell (SPRINT's
    setting), at 0.5 two of every 2×2, at 0.875 two of every 4×4. Every region of the image keeps the same share of
    its tokens, where `random` may leave a patch with none; the kept tokens form no smaller grid. A grid and rate
    with no such cell are refused."""
    grid = _checked_grid(grid, tokens, "structured_with_random_offset")
    found = cell_of(grid, rate)
    if found is None:
        raise ConfigError(
            f"selector 'structured_with_random_offset' keeps a whole number of tokens in every cell of side g along "
            f"each axis of the {'×'.join(map(str, grid))} grid, and at rate {rate} no side from 2 that divides every "
            "axis does (rate 0.75 keeps one token of every 2×2 cell); pick such a rate (0.5, 0.75, 0.875), or "
            "selector='random'")
    side, kept = found
    cells = [g // side for g in grid]
    rank = len(grid)
    # each cell's tokens by their index in the stream: axes (c0, side, c1, side, ...) → (cells, side^d)
    position = torch.arange(tokens, device=device).reshape([n for c in cells for n in (c, side)])
    position = position.permute([2 * a for a in range(rank)] + [2 * a + 1 for a in range(rank)])
    position = position.reshape(math.prod(cells), side ** rank)
    draws = uniform(batch, *position.shape, generator=generator, device=device)
    picked = draws.topk(kept, dim=2, sorted=False).indices  # (batch, cells, kept): each cell's offsets
    chosen = position.expand(batch, *position.shape).gather(2, picked)
    return chosen.flatten(1).sort(dim=1).values


def _checked_grid(grid: Grid | None, tokens: int, name: str, rank: int | None = None) -> Grid:
    if grid is None:
        raise ConfigError(f"selector {name!r} needs the token grid; pass grid=(H, W) (or (T, H, W)) to routekit.apply")
    if rank is not None and len(grid) != rank:
        raise ConfigError(f"selector {name!r} needs a {'T×H×W video' if rank == 3 else 'H×W'} grid, the stream's is "
                          f"{'×'.join(map(str, grid))}")
    if math.prod(grid) != tokens:
        raise ConfigError(f"selector {name!r}: grid {'×'.join(map(str, grid))} has {math.prod(grid)} tokens, the "
                          f"stream has {tokens}")
    return tuple(grid)

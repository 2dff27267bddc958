"""Token selectors: which tokens a route keeps.

A selector maps (batch, tokens, rate, grid, generator, device) to a LongTensor (batch, keep) of
sorted, unique token indices: the tokens that go through the route's blocks. Sorted indices keep
sequence order, which scan backbones (RWKV, Mamba) need. Register your own with
`@register_selector("name")`; what a selector returns is checked at every call (`checked`), so a
selector that breaks the contract raises instead of routing the wrong tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import ConfigError, SelectorError

Grid = tuple[int, int]
Selector = Callable[..., torch.Tensor]

_REGISTRY: dict[str, Selector] = {}
_NEEDS_GRID: set[str] = set()
_KEEPS_ROWS: set[str] = set()
_TRUSTED: set[str] = set()  # routekit's own, held to the contract by its tests rather than at every call


def register_selector(name: str, *, needs_grid: bool = False, keeps_rows: bool = False, override: bool = False):
    """Decorator adding a selector under `name`.

    `needs_grid`: the selector reads the (H, W) token grid. `keeps_rows`: the kept tokens are whole
    grid rows, so a block that reshapes to (N // W, W) stays valid (the route check relies on it).
    `override`: replace a selector already registered under `name` (otherwise that is an error).
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a selector's name is a non-empty string, got {name!r}")
    if name in _REGISTRY and not override:
        raise ConfigError(f"selector {name!r} is already registered; pass override=True to replace it, or pick "
                          f"another name (registered: {', '.join(sorted(_REGISTRY))})")

    def add(fn: Selector) -> Selector:
        _REGISTRY[name] = fn
        _TRUSTED.discard(name)
        (_NEEDS_GRID.add if needs_grid else _NEEDS_GRID.discard)(name)
        (_KEEPS_ROWS.add if keeps_rows else _KEEPS_ROWS.discard)(name)
        return fn

    return add


def get_selector(name: str) -> Selector:
    """The selector registered as `name`, or a ConfigError listing the registered names."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown selector {name!r}; registered selectors: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def selector_names() -> list[str]:
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
    if name in _TRUSTED:
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


def needs_grid(name: str) -> bool:
    return name in _NEEDS_GRID


def keeps_rows(name: str) -> bool:
    return name in _KEEPS_ROWS


def _keep_sorted(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` largest scores per row, in ascending index order."""
    return scores.topk(keep, dim=1, sorted=False).indices.sort(dim=1).values


@register_selector("random")
def random_tokens(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                  generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """TREAD's selection: each sample keeps an independent uniform subset of tokens."""
    keep = tokens - int(tokens * rate)
    scores = torch.rand(batch, tokens, generator=generator, device=device)
    return _keep_sorted(scores, keep)


def _rows_to_tokens(rows: torch.Tensor, width: int) -> torch.Tensor:
    cols = torch.arange(width, device=rows.device)
    return (rows[:, :, None] * width + cols).flatten(1)


@register_selector("row", needs_grid=True, keeps_rows=True)
def random_rows(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Whole rows of the H×W grid per sample, so the kept tokens form a smaller (H', W) grid."""
    height, width = _checked_grid(grid, tokens, "row")
    keep_rows = height - int(height * rate)
    rows = _keep_sorted(torch.rand(batch, height, generator=generator, device=device), keep_rows)
    return _rows_to_tokens(rows, width)


@register_selector("window", needs_grid=True, keeps_rows=True)
def random_window(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                  generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """A contiguous band of whole rows per sample: scans see one unbroken stretch of the image."""
    height, width = _checked_grid(grid, tokens, "window")
    keep_rows = height - int(height * rate)
    first = torch.randint(0, height - keep_rows + 1, (batch, 1), generator=generator, device=device)
    rows = first + torch.arange(keep_rows, device=first.device)
    return _rows_to_tokens(rows, width)


@register_selector("column", needs_grid=True)
def random_columns(batch: int, tokens: int, rate: float, *, grid: Grid | None = None,
                   generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Whole columns per sample, for blocks that scan vertically (column-major order)."""
    height, width = _checked_grid(grid, tokens, "column")
    keep_cols = width - int(width * rate)
    cols = _keep_sorted(torch.rand(batch, width, generator=generator, device=device), keep_cols)
    rows = torch.arange(height, device=cols.device)
    return (rows[None, :, None] * width + cols[:, None, :]).flatten(1)


_TRUSTED.update(_REGISTRY)


def _checked_grid(grid: Grid | None, tokens: int, name: str) -> Grid:
    if grid is None:
        raise ConfigError(f"selector {name!r} needs the token grid (H, W); pass grid=(H, W) to routekit.apply")
    height, width = grid
    if height * width != tokens:
        raise ConfigError(f"selector {name!r}: grid {height}x{width} has {height * width} tokens, the stream has {tokens}")
    return height, width

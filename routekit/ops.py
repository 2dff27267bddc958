"""The operations a route inserts into the training graph.

`RouteSelect` picks the kept tokens (and remembers them for masked losses); `gather_tokens` and
`scatter_tokens` move the stream and per-token side inputs in and out of the route. Plain torch
ops, so torch.compile sees through them.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Route
from .keep import select_with_keep
from .selectors import get_selector


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...) → (B, K, ...): the tokens `index` (B, K) of each sample."""
    shape = (*index.shape, *x.shape[2:])
    index = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(shape)
    return x.gather(1, index)


def scatter_tokens(full: torch.Tensor, index: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`full` with the tokens `index` replaced by `kept`: routed tokens keep their route-start value."""
    index = index.reshape(*index.shape, *([1] * (kept.dim() - 2))).expand(kept.shape)
    return full.to(kept.dtype).scatter(1, index, kept)


class RouteSelect(nn.Module):
    """Chooses the tokens a route keeps, per forward; holds no parameters (state_dict unchanged)."""

    def __init__(self, route: Route, grid: tuple[int, int] | None = None):
        super().__init__()
        self.route, self.grid = route, grid
        self.select = get_selector(route.selector)
        self.generator: torch.Generator | None = None
        self.last_index: torch.Tensor | None = None
        self.last_tokens = 0

    def forward(self, stream: torch.Tensor, grid_source: torch.Tensor | None = None) -> torch.Tensor:
        batch, tokens = stream.shape[0], stream.shape[1]
        grid = self.grid
        if grid is None and grid_source is not None:
            grid = (grid_source.shape[-2], grid_source.shape[-1])
        if self.route.keep:
            index = select_with_keep(self.route, batch, tokens, grid=grid, generator=self.generator,
                                     device=stream.device)
        else:
            index = self.select(batch, tokens, self.route.rate, grid=grid, generator=self.generator,
                                device=stream.device)
        self.last_index, self.last_tokens = index, tokens
        return index

    def extra_repr(self) -> str:
        r = self.route
        keep = f", keep={list(r.keep)}" if r.keep else ""
        return f"blocks {r.start}→{r.end}, rate={r.rate}, selector={r.selector!r}{keep}"

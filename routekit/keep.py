"""Special tokens a route must never set aside: class and register tokens, text tokens in a joint stream.

A route's `keep` lists token positions (negative ones count from the end, as in Python) that every
selection contains. The selector picks the rest from the other tokens, and the route's `rate`
applies to those other tokens only: with keep=[0] and rate 0.5, a 1 + 196 token ViT stream sends
1 + 98 tokens through the route. When the other tokens are exactly a patch grid, grid selectors
(`row`, `window`, `column`) see that grid.

Analysis finds special tokens where the graph shows them: the stream is a `cat` along the token
axis of a patch embedding's H·W tokens and k other tokens, so those k positions are suggested.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx
import torch
import torch.fx as fx

from .errors import ConfigError
from .selectors import get_selector, needs_grid
from .trace import TensorMeta

if TYPE_CHECKING:
    from .analysis import GraphReport
    from .config import Route

_CATS = {torch.cat, torch.concat, torch.concatenate}


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


def select_with_keep(route: Route, batch: int, tokens: int, *, grid, generator, device) -> torch.Tensor:
    """(batch, kept) sorted unique indices: `route.keep` always, the selector's choice among the other tokens."""
    select = get_selector(route.selector)
    keep = resolve_keep(route.keep, tokens)
    if not keep:
        return select(batch, tokens, route.rate, grid=grid, generator=generator, device=device)
    others = [i for i in range(tokens) if i not in set(keep)]
    picked = select(batch, len(others), route.rate, grid=grid, generator=generator, device=device)
    positions = torch.tensor(others, dtype=torch.long, device=picked.device)[picked]
    fixed = torch.tensor(keep, dtype=torch.long, device=picked.device).expand(batch, len(keep))
    return torch.cat([fixed, positions], dim=1).sort(dim=1).values


def kept_tokens(route: Route, tokens: int, grid: tuple[int, int] | None) -> int:
    """How many tokens the route's blocks see: the kept positions plus the selector's share of the others."""
    keep = resolve_keep(route.keep, tokens)
    others = tokens - len(keep)
    if needs_grid(route.selector) and (grid is None or grid[0] * grid[1] != others):
        return len(keep) + others - int(others * route.rate)
    index = get_selector(route.selector)(1, others, route.rate, grid=grid, generator=torch.Generator().manual_seed(0),
                                         device="cpu")
    return len(keep) + index.shape[1]


def suggestion(special: tuple[int, ...]) -> str:
    return f"keep={list(special)}"


def check_keep(routes: list[Route], report: GraphReport) -> None:
    """Refuse keeps that do not fit the stream, and routes that would set aside detected special tokens."""
    tokens = report.tokens
    for k, route in enumerate(routes):
        try:
            keep = resolve_keep(route.keep, tokens)
        except ConfigError as err:
            raise ConfigError(f"route {k}: {err}") from None
        if report.special and route.keep is None:
            raise ConfigError(
                f"route {k}: the stream has {len(report.special)} token(s) besides its "
                f"{report.grid[0]}×{report.grid[1]} patch grid (positions {list(report.special)}: class, register or "
                f"text tokens) and the route would set them aside too; pass Route(..., {suggestion(report.special)}) to "
                "always keep them, or keep=[] to route them like patch tokens"
            )
        if needs_grid(route.selector) and report.grid is not None:
            height, width = report.grid
            special = resolve_keep(report.special, tokens)
            if tokens - len(keep) != height * width or (special and keep != special):
                fix = f"; keep exactly the special tokens: {suggestion(report.special)}" if report.special else ""
                raise ConfigError(
                    f"route {k}: selector {route.selector!r} picks from the {height}×{width} grid, but with "
                    f"keep={list(route.keep or [])} {tokens - len(keep)} of the {tokens} tokens are left to pick from"
                    f"{fix}"
                )


def find_special_tokens(graph: fx.Graph, stream_in: fx.Node, batch: int, tokens: int):
    """(grid, grid node, special positions) when the stream is a patch grid joined with other tokens.

    Looks for the nearest 4-D (batch, C, H, W) ancestor of the stream with H·W < tokens, and a `cat`
    along the token axis between it and the stream whose other operands hold the extra tokens.
    Returns (None, None, ()) when the graph does not show it.
    """
    g = nx.DiGraph()
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    g.add_node(stream_in.name)
    ancestors = nx.ancestors(g, stream_in.name) | {stream_in.name}
    by_name = {n.name: n for n in graph.nodes}
    order = {name: i for i, name in enumerate(by_name)}
    for node in reversed(graph.nodes):
        meta = node.meta.get("rk")
        if node.name not in ancestors or not isinstance(meta, TensorMeta) or len(meta.shape) != 4:
            continue
        height, width = meta.shape[2], meta.shape[3]
        if meta.shape[0] != batch or not 0 < height * width < tokens:
            continue
        below = nx.descendants(g, node.name) & ancestors
        for name in sorted(below, key=order.get, reverse=True):
            split = _cat_split(by_name[name], node.name, g, tokens, height * width)
            if split is not None:
                before, after = split
                return (height, width), node.name, tuple(range(before)) + tuple(range(-after, 0))
        return None, None, ()
    return None, None, ()


def _cat_split(node: fx.Node, grid_node: str, g: nx.DiGraph, tokens: int, grid_tokens: int):
    """(tokens before, tokens after) the grid operand of a token-axis `cat` producing the stream, else None."""
    is_cat = (node.op == "call_function" and node.target in _CATS) or (node.op == "call_method" and node.target == "cat")
    meta = node.meta.get("rk")
    if not is_cat or not isinstance(meta, TensorMeta) or len(meta.shape) != 3 or meta.shape[1] != tokens:
        return None
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or dim not in (1, -2):
        return None
    sizes, grid_part = [], None
    for i, part in enumerate(parts):
        part_meta = part.meta.get("rk") if isinstance(part, fx.Node) else None
        if not isinstance(part_meta, TensorMeta) or len(part_meta.shape) != 3:
            return None
        sizes.append(part_meta.shape[1])
        if part.name == grid_node or grid_node in nx.ancestors(g, part.name):
            grid_part = i
    if grid_part is None or sizes[grid_part] != grid_tokens:
        return None
    return sum(sizes[:grid_part]), sum(sizes[grid_part + 1:])

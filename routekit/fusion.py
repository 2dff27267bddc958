"""SPRINT's route end: the mask token, the path drop and the sparse-dense fusion of one fused route.

A route ends with TREAD's restore (`routing.scatter_tokens`: the routed tokens rejoin with their value at the
route's start) or, with `Route(fuse=...)` (`config.Fusion`), with `FusedEnd`: the route's output, the *deep* path,
is put back at the kept positions of a sequence of mask tokens; in training the whole of it is replaced by mask
tokens for a share of the samples (the path drop); and `Linear(cat([deep, dense]))` fuses it with the stream as
it entered the route, the *dense* path, for every token. The rewritten graph calls it in three ways: after the
kept tokens (training), after every token (eval: a fused model evaluates with its route keeping every token) and
with no deep path at all (`routekit.path_drop`: the route's blocks do not run).

Each fused route's end is the module `routekit.sprint.<k>` of the model (parameters `mask`, `fuse.weight`,
`fuse.bias`), so it trains, saves, loads and shards with the model.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Fusion
from .dar import placement
from .routing import scatter_tokens
from .selectors import uniform


class FusedEnd(nn.Module):
    """One fused route's end (see the module docstring): `mask` (D,), the learned token the set-aside and the
    dropped positions get, and `fuse`, the Linear(2D → D) over cat([deep, dense]).

    Made on the device and in the dtype of `like`'s parameters (`dar.placement`). `path_drop` is the share of
    samples whose deep path is dropped in training (the route's `Fusion.path_drop`); `generator` draws which
    (the route selector's, so that `apply(generator=...)` makes both reproducible)."""

    def __init__(self, config: Fusion, dim: int, like: nn.Module | None = None):
        super().__init__()
        device, dtype = placement(like)
        self.init, self.path_drop = config.init, config.path_drop
        self.generator: torch.Generator | None = None
        self.mask = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.fuse = nn.Linear(2 * dim, dim, device=device, dtype=dtype)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The mask token N(0, 0.02²), as SPRINT draws it; the fusion as SPRINT pre-trains it (xavier-uniform
        weight, zero bias), or with init "preserve" the identity on the deep path (weight [I | 0]), which hands
        the deep output on exactly: each output element sums one product by 1 and products by 0."""
        nn.init.normal_(self.mask, std=0.02)
        nn.init.zeros_(self.fuse.bias)
        if self.init == "preserve":
            dim = self.mask.shape[0]
            self.fuse.weight.zero_()
            self.fuse.weight[:, :dim].copy_(torch.eye(dim))
        else:
            nn.init.xavier_uniform_(self.fuse.weight)

    def forward(self, dense: torch.Tensor, deep: torch.Tensor | None = None,
                index: torch.Tensor | None = None) -> torch.Tensor:
        """The fused stream (B, N, D), in the deep path's dtype (the stream's after the route, which the blocks
        after it read as they would without the fusion).

        dense: the stream as it entered the route (where the route crosses into a stack whose owner joins other
        tokens in, the joined stream with the route's full stream in place of the kept run). deep: the route's
        last block's output at the kept tokens `index` (B, K), or at every token where `index` is None; None
        where the route's blocks did not run (`routekit.path_drop`)."""
        dtype = deep.dtype if deep is not None else dense.dtype
        filled = self.mask.to(dtype).expand(dense.shape)
        if deep is None:
            deep = filled
        elif index is not None:
            deep = scatter_tokens(filled, index, deep)
        if self.training and self.path_drop > 0:
            dropped = uniform(dense.shape[0], generator=self.generator, device=dense.device) < self.path_drop
            deep = torch.where(dropped[:, None, None], filled, deep)
        both = torch.cat([deep, dense.to(dtype)], dim=-1)
        if not torch.is_autocast_enabled(both.device.type):  # a bf16 stream of an fp32 model: as its Linears take it
            both = both.to(self.fuse.weight.dtype)
        return self.fuse(both).to(dtype)

    def extra_repr(self) -> str:
        return f"dim={self.mask.shape[0]}, path_drop={self.path_drop}, init={self.init!r}"

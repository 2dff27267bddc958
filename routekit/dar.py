"""DAR's layer: its parameters, and the functions the rewritten training graph calls.

DAR (Diffusion-Adaptive Routing) replaces every residual add l by
h_l = Σ_i softmax_i(q_l·RMSNorm(v_i)/√d) v_i over the history of sources: v_0 = the stream entering
the first block and v_i = each sublayer output (the branch operand of each residual add). The graph
rewrite (routekit/rewrite.py) places calls of the functions below; they compute through the kernels
in routekit/kernels/.

Dtypes: sources keep the dtype their sublayers give (bf16 under autocast: half the bytes each
aggregation reads and half the memory the history holds), v_0 is cast to it once, and every mix
comes out in that dtype too. A residual stream is an accumulator (x + f(x), 56 times in DiT-XL/2),
so it is kept in fp32; a mix is not: each one is made afresh from the bf16 sources, so an fp32 mix
would carry one rounding less, never a compounding one, and the LayerNorm it feeds runs in fp32
under autocast and rounds to bf16 for its Linear anyway.

Chunking (chunk=S): once S sublayer outputs have accumulated, they are replaced in the history by
their sum (the chunk summary). With static queries a chunk's shared part (v_0 and the summaries) is
computed once for its S sublayers, in two phases: each shared source's logits for every later chunk
query come from one GEMM right after the source is made (`history_logits`), the chunk takes one
weighted sum of its shared sources (`shared_part`), and each sublayer then merges its own chunk's
outputs in (`merge`).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F
from torch import nn

from .config import DAR
from .kernels import aggregate, merge_with_stats, source_logits, weighted_sum


class DarState(nn.Module):
    """DAR's parameters, one query per aggregation point: the only parameters routekit adds.

    static / static_t: `query` (points, dim), the w_l (static_t adds the model's e(t) to it). dynamic:
    `dynamic` (points, dim, dim), the W_l of q_l = W_l v. Every parameter is read by every step, so DDP
    needs no find_unused_parameters.

    The parameters are made on the device and in the dtype of `like`'s parameters (`placement`): a model cast
    to bf16 or fp64 before `apply` gets DAR's parameters in that dtype, as it would by a cast after `apply`, and
    its optimiser sees one dtype. Whatever their dtype, the logits and the softmax are computed in fp32 (fp64
    for fp64 sources) by every kernel.
    """

    def __init__(self, config: DAR, points: int, dim: int, like: nn.Module | None = None):
        super().__init__()
        self.config, self.points, self.dim = config, points, dim
        device, dtype = placement(like)
        # zero-initialised: every aggregation starts as the uniform average of its history
        if config.query == "dynamic":
            self.dynamic = nn.Parameter(torch.zeros(points, dim, dim, device=device, dtype=dtype))
        else:
            self.query = nn.Parameter(torch.zeros(points, dim, device=device, dtype=dtype))
        if config.preserve:  # each aggregation's share against the residual add it replaces: none at step 0
            self.gate = nn.Parameter(torch.zeros(points, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        c = self.config
        return f"query={c.query!r}, chunk={c.chunk}, points={self.points}, dim={self.dim}, kernel={c.kernel!r}"


def placement(model: nn.Module | None) -> tuple[torch.device | None, torch.dtype | None]:
    """The device of `model`'s first parameter and the floating dtype most of its parameter elements have
    (a bf16 model that keeps a few norms in fp32 is a bf16 model); (None, None) for none, the defaults."""
    params = list(model.parameters()) if model is not None else []
    counts: dict[torch.dtype, int] = {}
    for p in params:
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    dtype = max(counts, key=counts.__getitem__) if counts else None
    return (params[0].device if params else None), dtype


def dynamic_query(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A dynamic query q_l = W_l v, in the dtype of the output `v` it reads (a bf16 sublayer of an fp32 model, an
    fp32-gated one of a bf16 model): as a Linear of the block would compute it (autocast, where on, casts both)."""
    return F.linear(v, weight.to(v.dtype))


def blend(add: torch.Tensor, mix: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`DAR(preserve=True)`: the residual add's value `add` moved by `gate` (0 at step 0) towards DAR's `mix`,
    in the add's dtype; at gate 0 exactly the add (a zero times a finite difference adds nothing)."""
    return add + (gate * (mix - add)).to(add.dtype)


def sum_sources(sources: list[torch.Tensor]) -> torch.Tensor:
    """A chunk summary: the sum of the chunk's sublayer outputs, added in fp32 (fp64 for fp64 ones), kept in the
    newest one's dtype (the mix that first reads the summary comes out in the newest sublayer's dtype, as every
    mix does)."""
    if len(sources) == 1:
        return sources[0]
    wide = functools.reduce(torch.promote_types, [s.dtype for s in sources], torch.float32)
    return functools.reduce(operator.add, [s.to(wide) for s in sources]).to(sources[-1].dtype)


def cast_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x in like's dtype and contiguous: the embedding joins the history in the sublayer outputs'
    dtype, laid out once as the kernel reads it (a patch embedding's (B, N, D) is often a transposed
    view, which every aggregation would otherwise copy, forward and backward)."""
    return x.to(like.dtype).contiguous()


def _in_dtype(sources: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [s if s.dtype == dtype else s.to(dtype) for s in sources]


def mix(sources: list[torch.Tensor], query: torch.Tensor, eps: float, kernel: str) -> torch.Tensor:
    """One aggregation over the whole history, in the dtype the newest sublayer gives."""
    return aggregate(_in_dtype(sources, sources[-1].dtype), query, eps, kernel)


def merge(sources: list[torch.Tensor], query: torch.Tensor, shared_mix: torch.Tensor, shared_lse: torch.Tensor,
          eps: float, kernel: str) -> torch.Tensor:
    """One aggregation of a two-phase chunk: its own chunk's sources, continuing the chunk's shared part;
    computed in the shared part's dtype, coming out, as every mix does, in the newest sublayer's (a block
    whose sublayers give different dtypes, as Wan's fp32-gated ones in a bf16 model, reads each mix in the
    dtype its plain residual add would have had)."""
    h = aggregate(_in_dtype(sources, shared_mix.dtype), query, eps, kernel, prefix=(shared_mix, shared_lse))
    return h if h.dtype == sources[-1].dtype else h.to(sources[-1].dtype)


def merge_for_norm(sources: list[torch.Tensor], query: torch.Tensor, shared_mix: torch.Tensor,
                   shared_lse: torch.Tensor, norm_eps: float, eps: float, kernel: str) -> tuple:
    """`merge`, for the LayerNorm (no affine) that reads it, which the rewrite folds in: (the merge, its rows' mean
    and 1/std where the merge kernel gives them (under torch.compile), else None, and the dtype F.layer_norm
    gives on `merge`'s output (under CUDA autocast fp32, else the newest source's), read off an empty call: a
    trace-time constant, the call itself dead code). `norm_of_merge` finishes the norm: apart, so that the
    pointwise part can sit with what reads it (a shared block body, regions.py) and fuse with it."""
    dtype = F.layer_norm(sources[-1].new_empty((0, sources[-1].shape[-1])), sources[-1].shape[-1:]).dtype
    merged = merge_with_stats(_in_dtype(sources, shared_mix.dtype), query, eps, kernel, prefix=(shared_mix, shared_lse),
                              norm_eps=norm_eps)
    if merged is None:
        return merge(sources, query, shared_mix, shared_lse, eps, kernel), None, dtype
    return (*merged, dtype)


def norm_of_merge(merged: tuple, norm_eps: float) -> torch.Tensor:
    """F.layer_norm (no affine) of the merge `merge_for_norm` gave. Where the merge kernel gave its rows' mean and
    1/std the norm is pointwise and fuses with what follows; a LayerNorm of its own would read the stored mix twice
    in a reduction kernel."""
    h, stats, dtype = merged
    if stats is None:
        return F.layer_norm(h, h.shape[-1:], eps=norm_eps)
    return ((h.float() - stats[..., :1]) * stats[..., 1:]).to(dtype)


def layer_norm_of_merge(sources: list[torch.Tensor], query: torch.Tensor, shared_mix: torch.Tensor,
                        shared_lse: torch.Tensor, norm_eps: float, eps: float, kernel: str) -> torch.Tensor:
    """F.layer_norm (no affine) of `merge`, in the two steps the rewrite places."""
    return norm_of_merge(merge_for_norm(sources, query, shared_mix, shared_lse, norm_eps, eps, kernel), norm_eps)


def history_logits(v: torch.Tensor, query: torch.Tensor, points: tuple[int, ...], temb: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """One shared source's logits (B, N, F) for the F aggregations at `points` that will read it, from
    one GEMM when the source is made (static queries are known in advance)."""
    return source_logits(v, query[list(points)], temb, eps)


def chunk_logits(logits: tuple[torch.Tensor, ...], offsets: tuple[int, ...], k: int) -> torch.Tensor:
    """A chunk's (S, B, N, K) logits: from each shared source's logits, the K columns of this chunk."""
    return torch.stack([z[..., o:o + k] for z, o in zip(logits, offsets)])


def shared_part(sources: list[torch.Tensor], logits: torch.Tensor, kernel: str) -> tuple[list[torch.Tensor],
                                                                                      torch.Tensor]:
    """Phase one of a chunk from its shared sources' logits: a weighted sum, each source read once."""
    return weighted_sum(_in_dtype(sources, sources[-1].dtype), logits, kernel)

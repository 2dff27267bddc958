"""Kernels behind routekit's graph rewrites, each with a plain PyTorch reference beside it.

``dar_aggregate`` is the one entry point for DAR's softmax-over-sources residual; it picks
the fused Triton kernel where it can run and the reference otherwise.  Triton is imported
only when the Triton kernel is chosen, so this package imports on machines without it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routekit.errors import ConfigError
from routekit.kernels.dar_logits import source_logits
from routekit.kernels.dar_reference import (
    DarInputError,
    Sources,
    check_dar_inputs,
    dar_aggregate_reference,
    dar_prefix_reference,
    prefix_queries,
    weighted_sum_reference,
)

__all__ = ["DarInputError", "UnknownKernelError", "dar_aggregate", "dar_aggregate_reference", "dar_merge_stats",
           "dar_prefix", "dar_prefix_reference", "dar_weighted_sum", "source_logits", "weighted_sum_reference",
           "KERNELS"]

KERNELS = ("auto", "triton", "torch")
"""Valid ``kernel`` names for ``dar_aggregate``."""


class UnknownKernelError(ConfigError):
    """Raised when ``kernel`` names no implementation."""


def _use_triton(sources: Sources, query: Tensor, d: int, kernel: str) -> bool:
    """Whether ``kernel`` means the Triton kernel for these inputs ("auto": where it can run)."""
    if kernel not in KERNELS:
        raise UnknownKernelError(f"unknown kernel {kernel!r}; valid kernels are {', '.join(KERNELS)}")
    if kernel != "auto":
        return kernel == "triton"
    if not query.is_cuda:
        return False
    try:
        from routekit.kernels import dar_triton
    except ImportError:
        return False
    dtype = sources.dtype if isinstance(sources, Tensor) else sources[0].dtype
    return d <= dar_triton.MAX_D and dtype in dar_triton.SUPPORTED_DTYPES


def _triton(module: str = "dar_triton"):
    """The Triton kernels' module ``module``, or an ImportError saying what to install. (A plain
    import: torch.compile traces through it, not through importlib.)"""
    try:
        from routekit.kernels import dar_stream, dar_triton
    except ImportError as exc:
        raise ImportError("kernel='triton' needs the triton package: pip install 'routekit[gpu]'") from exc
    return dar_stream if module == "dar_stream" else dar_triton


def dar_aggregate(sources: Sources, query: Tensor, eps: float = 1e-6, kernel: str = "auto", *,
                  out_dtype: torch.dtype | None = None, prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """DAR aggregation: sum_s softmax_s(query . RMSNorm(v_s) / sqrt(D)) v_s.

    ``sources``: a stacked (S, B, N, D) tensor or a sequence of S (B, N, D) tensors;
    ``query`` broadcasts to (B, N, D).  ``kernel``: "triton" (fused), "torch" (reference),
    or "auto": the Triton kernel for CUDA tensors it supports (fp32/bf16/fp16, D <= 2048)
    when triton imports, the reference otherwise.  ``out_dtype``: the result's dtype (default
    the sources'), e.g. an fp32 residual stream mixed from bf16 sources.  ``prefix``: one
    (mix, lse) pair of ``dar_prefix`` with the same ``kernel``: the mix then covers its sources too.
    """
    d = check_dar_inputs(sources, query)[3]
    if _use_triton(sources, query, d, kernel):
        return _triton().dar_aggregate_triton(sources, query, eps, out_dtype=out_dtype, prefix=prefix)
    return dar_aggregate_reference(sources, query, eps, out_dtype=out_dtype, prefix=prefix)


def dar_merge_stats(sources: Sources, query: Tensor, eps: float, kernel: str, *, prefix: tuple[Tensor, Tensor],
                    norm_eps: float) -> tuple[Tensor, Tensor] | None:
    """``dar_aggregate(sources, query, eps, kernel, prefix=prefix)`` and its rows' LayerNorm statistics
    (mean, 1/sqrt(var + norm_eps)) as (B, N, 2) fp32, where the merge kernel computes them from the rows
    it holds (Triton, under torch.compile); None elsewhere, where a LayerNorm of the result costs the same."""
    d = check_dar_inputs(sources, query)[3]
    if not _use_triton(sources, query, d, kernel):
        return None
    return _triton().merge_with_stats(sources, query, eps, prefix, norm_eps)


def dar_prefix(sources: Sources, queries: Tensor, eps: float = 1e-6, kernel: str = "auto",
               ) -> tuple[list[Tensor], Tensor]:
    """The part K aggregations share: their common ``sources`` read once for all K ``queries``
    ((K, D) or broadcasting to (K, B, N, D)). Returns K partial mixes and their log-sum-exps
    (K, B, N); aggregation k is then ``dar_aggregate(own_sources, queries[k], kernel=kernel,
    prefix=(mixes[k], lse[k]))``. Both must use the same kernel: the Triton pair passes each
    other a backward shortcut that the reference does not (dar_triton's docstring)."""
    d = check_dar_inputs(sources, prefix_queries(queries)[0])[3]
    if _use_triton(sources, queries[0], d, kernel):
        return _triton().dar_prefix_triton(sources, queries, eps)
    return dar_prefix_reference(sources, queries, eps)


def dar_weighted_sum(sources: Sources, logits: Tensor, kernel: str = "auto") -> tuple[list[Tensor], Tensor]:
    """``dar_prefix`` from the sources' logits, given as fp32 (S, B, N, K) (``source_logits`` of each
    source for the K queries): K mixes and their log-sum-exps (K, B, N), merged as ``dar_prefix``'s
    by ``dar_aggregate(..., kernel=kernel, prefix=(mixes[k], lse[k]))`` with the same kernel. The
    Triton kernel returns a (K, B, N, 2) state instead ([..., 0] the log-sum-exps; the other slot
    carries the merges' values back in backward: ``dar_stream``), passed on the same way."""
    like = sources[0] if not isinstance(sources, Tensor) else sources
    if _use_triton(sources, like, like.shape[-1], kernel):
        return _triton("dar_stream").weighted_sum_triton(list(sources), logits)
    return weighted_sum_reference(sources, logits)

# transitional names (replaced when the kernels' restructure lands)
aggregate, merge_with_stats, weighted_sum = dar_aggregate, dar_merge_stats, dar_weighted_sum

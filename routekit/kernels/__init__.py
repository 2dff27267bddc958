"""The kernels behind DAR's graph rewrite: each public entry point picks its Triton kernel or its plain
PyTorch reference (``naive``).

``kernel``: "triton", "torch" (the reference), or "auto": the Triton kernel for CUDA tensors it
supports (fp32/bf16/fp16, D <= 2048) when triton imports, the reference otherwise. Triton is imported
only when a Triton kernel is chosen, so this package imports on machines without it. Ops that pass
each other state (a weighted sum and the merges that continue it) must use the same kernel.

Modules: ``aggregation`` (the fused aggregation op), ``merge`` (a two-phase chunk's merge),
``weighted_sums`` (a chunk's shared part), ``logits`` (``source_logits``), ``naive`` (the references),
``tables`` (the pointer tables every kernel reads its sources through, and their cache), ``launch``
(every launch default and the parser for overrides). docs/kernels.md tells the design and the
measurements behind it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routekit.errors import ConfigError
from routekit.kernels import naive
from routekit.kernels.logits import source_logits
from routekit.kernels.naive import DarInputError, Sources, check_dar_inputs

__all__ = ["KERNELS", "DarInputError", "UnknownKernelError", "aggregate", "merge_with_stats", "source_logits",
           "weighted_sum"]

KERNELS = ("auto", "triton", "torch")
"""Valid ``kernel`` names."""


class UnknownKernelError(ConfigError):
    """Raised when ``kernel`` names no implementation."""


def _width(sources: Sources) -> int:
    """D of the sources, 0 for none (which every implementation's check then refuses)."""
    if isinstance(sources, Tensor):
        return sources.shape[-1] if sources.dim() else 0
    return sources[0].shape[-1] if len(sources) and isinstance(sources[0], Tensor) and sources[0].dim() else 0


def _use_triton(sources: Sources, query: Tensor, d: int, kernel: str) -> bool:
    """Whether ``kernel`` means the Triton kernel for these inputs ("auto": where it can run)."""
    if kernel not in KERNELS:
        raise UnknownKernelError(f"unknown kernel {kernel!r}; valid kernels are {', '.join(KERNELS)}")
    if kernel != "auto":
        return kernel == "triton"
    if not query.is_cuda:
        return False
    try:
        from routekit.kernels import aggregation
    except ImportError:
        return False
    dtype = sources.dtype if isinstance(sources, Tensor) else sources[0].dtype
    return d <= aggregation.MAX_D and dtype in aggregation.SUPPORTED_DTYPES


def _aggregation():
    """The Triton aggregation's module, or an ImportError saying what to install. (A plain import:
    torch.compile traces through it, not through importlib.)"""
    try:
        from routekit.kernels import aggregation
    except ImportError as exc:
        raise ImportError("kernel='triton' needs the triton package: pip install triton") from exc
    return aggregation


def _weighted_sums():
    """The Triton weighted sums' module (``_aggregation``'s error when triton is missing)."""
    _aggregation()
    from routekit.kernels import weighted_sums

    return weighted_sums


def aggregate(sources: Sources, query: Tensor, eps: float = 1e-6, kernel: str = "auto", *,
              out_dtype: torch.dtype | None = None, prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """DAR aggregation: sum_s softmax_s(query . RMSNorm(v_s) / sqrt(D)) v_s.

    ``sources``: a stacked (S, B, N, D) tensor or a sequence of S (B, N, D) tensors; ``query``
    broadcasts to (B, N, D). ``out_dtype``: the result's dtype (default the sources'), e.g. an fp32
    residual stream mixed from bf16 sources. ``prefix``: one (mix, lse) pair of ``weighted_sum`` with
    the same ``kernel``: the aggregation continues it (a two-phase chunk's merge), and its result
    covers the weighted sum's sources too.
    """
    if _use_triton(sources, query, _width(sources), kernel):  # each implementation checks its inputs
        return _aggregation().aggregate_triton(sources, query, eps, out_dtype=out_dtype, prefix=prefix)
    return naive.aggregate(sources, query, eps, out_dtype=out_dtype, prefix=prefix)


def merge_with_stats(sources: Sources, query: Tensor, eps: float, kernel: str, *, prefix: tuple[Tensor, Tensor],
                     norm_eps: float) -> tuple[Tensor, Tensor] | None:
    """``aggregate(sources, query, eps, kernel, prefix=prefix)`` and its rows' LayerNorm statistics
    (mean, 1/sqrt(var + norm_eps)) as (B, N, 2) fp32, where the merge kernel computes them from the rows
    it holds (Triton, under torch.compile); None elsewhere, where a LayerNorm of the result costs the same."""
    if not _use_triton(sources, query, _width(sources), kernel):
        check_dar_inputs(sources, query)
        return None
    return _aggregation().merge_with_stats_triton(sources, query, eps, prefix, norm_eps)


def weighted_sum(sources: Sources, logits: Tensor, kernel: str = "auto") -> tuple[list[Tensor], Tensor]:
    """A two-phase chunk's shared part: from the sources' fp32 logits (S, B, N, K) (``source_logits`` of
    each source for the chunk's K queries), K mixes and their log-sum-exps (K, B, N); mix k is continued
    by ``aggregate(own_sources, queries[k], kernel=kernel, prefix=(mixes[k], lse[k]))``, with the same
    kernel. The Triton kernel returns a (K, B, N, 2) state instead ([..., 0] the log-sum-exps; the other
    slot carries the merges' values back in backward: ``weighted_sums``), passed on the same way."""
    like = sources[0] if not isinstance(sources, Tensor) else sources
    if _use_triton(sources, like, like.shape[-1], kernel):
        return _weighted_sums().weighted_sum_triton(list(sources), logits)
    return naive.weighted_sum(sources, logits)

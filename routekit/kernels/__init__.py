"""Kernels behind routekit's graph rewrites, each with a plain PyTorch reference beside it.

``dar_aggregate`` is the one entry point for DAR's softmax-over-sources residual; it picks
the fused Triton kernel where it can run and the reference otherwise.  Triton is imported
only when the Triton kernel is chosen, so this package imports on machines without it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routekit.errors import ConfigError
from routekit.kernels.dar_reference import (
    DarInputError,
    Sources,
    check_dar_inputs,
    dar_aggregate_reference,
)

__all__ = ["DarInputError", "UnknownKernelError", "dar_aggregate", "dar_aggregate_reference", "KERNELS"]

KERNELS = ("auto", "triton", "torch")
"""Valid ``kernel`` names for ``dar_aggregate``."""


class UnknownKernelError(ConfigError):
    """Raised when ``kernel`` names no implementation."""


def _fused_kernel(sources: Sources, query: Tensor, d: int):
    """The Triton kernel if it can run these inputs here, else None."""
    if not query.is_cuda:
        return None
    try:
        from routekit.kernels import dar_triton
    except ImportError:
        return None
    dtype = sources.dtype if isinstance(sources, Tensor) else sources[0].dtype
    if d > dar_triton.MAX_D or dtype not in dar_triton.SUPPORTED_DTYPES:
        return None
    return dar_triton.dar_aggregate_triton


def dar_aggregate(sources: Sources, query: Tensor, eps: float = 1e-6, kernel: str = "auto", *,
                  out_dtype: torch.dtype | None = None) -> Tensor:
    """DAR aggregation: sum_s softmax_s(query . RMSNorm(v_s) / sqrt(D)) v_s.

    ``sources``: a stacked (S, B, N, D) tensor or a sequence of S (B, N, D) tensors;
    ``query`` broadcasts to (B, N, D).  ``kernel``: "triton" (fused), "torch" (reference),
    or "auto": the Triton kernel for CUDA tensors it supports (fp32/bf16/fp16, D <= 2048)
    when triton imports, the reference otherwise.  ``out_dtype``: the result's dtype (default
    the sources'), e.g. an fp32 residual stream mixed from bf16 sources.
    """
    if kernel not in KERNELS:
        raise UnknownKernelError(f"unknown kernel {kernel!r}; valid kernels are {', '.join(KERNELS)}")
    d = check_dar_inputs(sources, query)[3]
    if kernel == "auto":
        return (_fused_kernel(sources, query, d) or dar_aggregate_reference)(sources, query, eps, out_dtype=out_dtype)
    if kernel == "torch":
        return dar_aggregate_reference(sources, query, eps, out_dtype=out_dtype)
    try:
        from routekit.kernels.dar_triton import dar_aggregate_triton
    except ImportError as exc:
        raise ImportError("kernel='triton' needs the triton package: pip install 'routekit[gpu]'") from exc
    return dar_aggregate_triton(sources, query, eps, out_dtype=out_dtype)

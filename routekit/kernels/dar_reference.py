"""Reference DAR aggregation: the plain PyTorch path and the oracle for the fused kernel.

DAR (Diffusion-Adaptive Routing) replaces the residual sum by a softmax-weighted mix of
every earlier source: h = sum_s softmax_s(q . RMSNorm(v_s) / sqrt(D)) v_s.  This module
keeps the obvious implementation (stack, normalise, softmax, weighted sum) so the kernel
in ``dar_triton`` has something simple to be held against.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from routekit.errors import InputError

Sources = Tensor | Sequence[Tensor]


class DarInputError(InputError):
    """Sources or query of a DAR aggregation that no implementation can use."""


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The A/B setting ``name`` from the environment (``default`` when unset or empty), refused unless it
    is one of ``choices``: the kernels' switches between measured alternatives."""
    value = os.environ.get(name) or default
    if value not in choices:
        raise DarInputError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def check_dar_inputs(sources: Sources, query: Tensor) -> tuple[int, int, int, int]:
    """Validate ``sources`` and ``query``; return (S, B, N, D).

    Shared by every implementation so that all of them reject the same inputs with the
    same message.
    """
    if isinstance(sources, Tensor):
        if sources.dim() != 4:
            raise DarInputError(f"stacked sources must be 4-D (S, B, N, D), got shape {tuple(sources.shape)}")
        shape, device = tuple(sources.shape), sources.device
    else:
        sources = list(sources)
        if not sources:
            raise DarInputError("sources is empty: DAR needs at least one source")
        first = sources[0]
        for i, src in enumerate(sources):
            if not isinstance(src, Tensor) or src.dim() != 3:
                got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
                raise DarInputError(f"source {i} must be a 3-D (B, N, D) tensor, got {got}")
            if src.shape != first.shape or src.dtype != first.dtype or src.device != first.device:
                raise DarInputError(
                    f"source {i} is {tuple(src.shape)} {src.dtype} on {src.device}, but source 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: all sources must match"
                )
        shape, device = (len(sources), *first.shape), first.device
    s, b, n, d = shape
    if s == 0 or d == 0:
        raise DarInputError(f"sources (S, B, N, D) = {shape} must have S >= 1 and D >= 1")
    if not isinstance(query, Tensor) or query.dim() == 0 or query.dim() > 3 or query.shape[-1] != d:
        got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise DarInputError(
            f"query must end in D={d} and broadcast to (B, N, D)=({b}, {n}, {d}), e.g. ({d},), "
            f"({b}, 1, {d}) or ({b}, {n}, {d}); got {got}"
        )
    try:
        broadcast = torch.broadcast_shapes(query.shape, (b, n, d))
    except RuntimeError:
        broadcast = None
    if broadcast != (b, n, d):
        raise DarInputError(
            f"query of shape {tuple(query.shape)} does not broadcast to (B, N, D)=({b}, {n}, {d})"
        )
    if query.device != device:
        raise DarInputError(f"query is on {query.device} but the sources are on {device}")
    return s, b, n, d


def _logits(values: Tensor, query: Tensor, eps: float) -> Tensor:
    """q . RMSNorm(v) / sqrt(D) over the last dim: values (..., S, B, N, D) in fp32."""
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    return (keys * query.float()).sum(-1) / math.sqrt(values.shape[-1])


def dar_aggregate_reference(sources: Sources, query: Tensor, eps: float = 1e-6, *,
                            out_dtype: torch.dtype | None = None,
                            prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Softmax-over-sources mix of ``sources`` keyed by their RMS-normalised values.

    ``sources`` is a stacked (S, B, N, D) tensor or a sequence of S (B, N, D) tensors and
    ``query`` broadcasts to (B, N, D).  Math is fp32; the result has ``out_dtype``, by default
    the sources' dtype.  ``prefix``: a (mix, lse) pair from ``dar_prefix_reference``, which
    joins the softmax as one more source of value ``mix`` and logit ``lse``.
    """
    check_dar_inputs(sources, query)
    stacked = sources if isinstance(sources, Tensor) else torch.stack(list(sources))
    values = stacked.float()
    logits = _logits(values, query, eps)
    if prefix is not None:
        mix, lse = prefix
        if lse.shape != mix.shape[:-1]:
            raise DarInputError(f"prefix lse of shape {tuple(lse.shape)} must be (B, N) = {tuple(mix.shape[:-1])}; a "
                                "Triton weighted sum's (B, N, 2) state merges only with kernel='triton'")
        values = torch.cat([mix.float()[None], values])
        logits = torch.cat([lse.float()[None], logits])
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * values).sum(0).to(out_dtype or stacked.dtype)


def prefix_queries(queries: Tensor) -> Tensor:
    """A chunk's K queries as (K, B, N, D) or broadcasting to it: (K, D) gains two unit axes; any
    other shape but 4-D is refused, as is K = 0."""
    if not isinstance(queries, Tensor) or queries.dim() not in (2, 4) or queries.shape[0] < 1:
        got = tuple(queries.shape) if isinstance(queries, Tensor) else type(queries).__name__
        raise DarInputError(f"queries must be (K, D) or (K, B, N, D) with K >= 1, got {got}")
    return queries[:, None, None, :] if queries.dim() == 2 else queries


def dar_prefix_reference(sources: Sources, queries: Tensor, eps: float = 1e-6) -> tuple[list[Tensor], Tensor]:
    """The part of K aggregations that their shared ``sources`` make: per query the mix over those
    sources (in their dtype) and its log-sum-exp (K, B, N); ``queries`` (K, D) or broadcasting to
    (K, B, N, D). Merged by ``dar_aggregate_reference(..., prefix=(mixes[k], lse[k]))``, the result
    equals the aggregation over all sources at once."""
    queries = prefix_queries(queries)
    check_dar_inputs(sources, queries[0])
    stacked = sources if isinstance(sources, Tensor) else torch.stack(list(sources))
    values = stacked.float()
    logits = _logits(values[None], queries[:, None], eps)  # (K, S, B, N)
    mixes = (torch.softmax(logits, dim=1).unsqueeze(-1) * values[None]).sum(1).to(stacked.dtype)
    return list(mixes.unbind(0)), torch.logsumexp(logits, dim=1)


def check_logits(s: int, b: int, n: int, logits: Tensor) -> None:
    """Refuse logits that are not (S, B, N, K) for S sources of (B, N, D)."""
    if logits.dim() != 4 or tuple(logits.shape[:3]) != (s, b, n):
        raise DarInputError(f"logits must be (S, B, N, K) = ({s}, {b}, {n}, K) for these sources, "
                            f"got {tuple(logits.shape)}")


def weighted_sum_reference(sources: Sources, logits: Tensor) -> tuple[list[Tensor], Tensor]:
    """The K mixes sum_s softmax_s(logits) v_s over S sources (in their dtype) and their log-sum-exps
    (K, B, N), from given fp32 ``logits`` (S, B, N, K); what ``dar_prefix_reference`` returns when
    the logits are those of its queries."""
    stacked = sources if isinstance(sources, Tensor) else torch.stack(list(sources))
    check_logits(stacked.shape[0], *stacked.shape[1:3], logits)
    weights = torch.softmax(logits.float(), dim=0)
    mixes = torch.einsum("sbnk,sbnd->kbnd", weights, stacked.float()).to(stacked.dtype)
    return list(mixes.unbind(0)), torch.logsumexp(logits.float(), dim=0).permute(2, 0, 1)

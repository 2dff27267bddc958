"""Reference DAR aggregation: the plain PyTorch path and the oracle for the fused kernel.

DAR (Diffusion-Adaptive Routing) replaces the residual sum by a softmax-weighted mix of
every earlier source: h = sum_s softmax_s(q . RMSNorm(v_s) / sqrt(D)) v_s.  This module
keeps the obvious implementation (stack, normalise, softmax, weighted sum) so the kernel
in ``dar_triton`` has something simple to be held against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from routekit.errors import InputError

Sources = Tensor | Sequence[Tensor]


class DarInputError(InputError):
    """Sources or query of a DAR aggregation that no implementation can use."""


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


_LOW = (torch.bfloat16, torch.float16)


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with fp32 accuracy and output, where one side may be a large bf16/fp16 tensor (a source)
    and the other a small fp32 one (queries, logit gradients). On CUDA the fp32 side is split into a
    high and a low half in the other's dtype (together ~16 mantissa bits) and one GEMM with fp32
    output takes both, so the large side is never copied to fp32; elsewhere both are cast. (2-D
    ``torch.mm``: torch's FlopCounterMode fails on ``bmm`` with ``out_dtype``.)"""
    if a.is_cuda and (a.dtype in _LOW) != (b.dtype in _LOW):
        if a.dtype in _LOW:  # split b's columns
            hi = b.to(a.dtype)
            both = torch.mm(a, torch.cat([hi, (b - hi.float()).to(a.dtype)], 1), out_dtype=torch.float32)
            return both[:, :b.shape[1]] + both[:, b.shape[1]:]
        hi = a.to(b.dtype)  # split a's rows
        both = torch.mm(torch.cat([hi, (a - hi.float()).to(b.dtype)], 0), b, out_dtype=torch.float32)
        return both[:a.shape[0]] + both[a.shape[0]:]
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return a.to(dtype) @ b.to(dtype)


class _SourceLogits(torch.autograd.Function):
    """``source_logits`` with a hand-written backward: only the source itself (already kept for the
    aggregations), the queries and per-row factors are saved, and the source is never copied to fp32
    on CUDA (302 MB at DiT-XL/2 batch 256, for each of 15 sources)."""

    @staticmethod
    def forward(ctx, v: Tensor, w: Tensor, temb: Tensor | None, eps: float) -> Tensor:
        with torch.autocast(v.device.type, enabled=False):  # logits in fp32 whatever the caller's autocast
            return _SourceLogits._forward(ctx, v, w, temb, eps)

    @staticmethod
    def _forward(ctx, v: Tensor, w: Tensor, temb: Tensor | None, eps: float) -> Tensor:
        b, n, d = v.shape
        wide = torch.promote_types(v.dtype, torch.float32)
        r = torch.rsqrt(v.to(wide).pow(2).mean(-1, keepdim=True) + eps) / math.sqrt(d)  # RMSNorm and 1/sqrt(D)
        dots = _mm_fp32(v.reshape(-1, d), w.t()).view(b, n, -1)
        if temb is not None:  # (w_f + e) . v = w_f . v + e . v
            dots = dots + (v.to(wide) * temb.to(wide)).sum(-1, keepdim=True)
        z = dots * r
        ctx.save_for_backward(v, w, temb, r, z)
        return z

    @staticmethod
    def backward(ctx, dz: Tensor):
        with torch.autocast(dz.device.type, enabled=False):
            return _SourceLogits._backward(ctx, dz)

    @staticmethod
    def _backward(ctx, dz: Tensor):
        v, w, temb, r, z = ctx.saved_tensors
        d = v.shape[-1]
        dzr = dz * r  # d z / d (q . v) = r
        along_q = (dzr.flatten(0, 1) @ w.to(dzr.dtype)).view(v.shape)
        if temb is not None:
            along_q = along_q + dzr.sum(-1, keepdim=True) * temb.to(dzr.dtype)
        # z = r (q . v) with r = (mean(v^2) + eps)^-1/2 / sqrt(D): d r / d v = -r^3 v, so
        # d z / d v = r q - z r^2 v
        dv = along_q - (dz * z).sum(-1, keepdim=True) * (r * r) * v.to(dzr.dtype)
        dw = _mm_fp32(dzr.flatten(0, 1).t(), v.reshape(-1, d)) if ctx.needs_input_grad[1] else None
        dtemb = None
        if temb is not None and ctx.needs_input_grad[2]:
            dtemb = (dzr.sum(-1, keepdim=True) * v.to(dzr.dtype)).sum(1, keepdim=True).to(temb.dtype)
        return dv.to(v.dtype), dw.to(w.dtype) if dw is not None else None, dtemb, None


def source_logits(v: Tensor, queries: Tensor, temb: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """One source's logits for F static queries at once, as the aggregations compute them:
    (q_f + e) . RMSNorm(v) / sqrt(D), an fp32 (B, N, F) tensor. ``queries`` (F, D); ``temb`` the
    timestep embedding e(t), (B, 1, D), or None. With static queries a source's logits for every
    later aggregation are known when it is made, so one GEMM gives them all (two-phase chunks then
    only weight their shared sources: ``weighted_sum_reference``)."""
    return _SourceLogits.apply(v, queries, temb, eps)


def weighted_sum_reference(sources: Sources, logits: Tensor) -> tuple[list[Tensor], Tensor]:
    """The K mixes sum_s softmax_s(logits) v_s over S sources (in their dtype) and their log-sum-exps
    (K, B, N), from given fp32 ``logits`` (S, B, N, K); what ``dar_prefix_reference`` returns when
    the logits are those of its queries."""
    stacked = sources if isinstance(sources, Tensor) else torch.stack(list(sources))
    if logits.dim() != 4 or logits.shape[:3] != (stacked.shape[0], *stacked.shape[1:3]):
        raise DarInputError(f"logits must be (S, B, N, K) = ({stacked.shape[0]}, {stacked.shape[1]}, "
                            f"{stacked.shape[2]}, K) for these sources, got {tuple(logits.shape)}")
    weights = torch.softmax(logits.float(), dim=0)
    mixes = torch.einsum("sbnk,sbnd->kbnd", weights, stacked.float()).to(stacked.dtype)
    return list(mixes.unbind(0)), torch.logsumexp(logits.float(), dim=0).permute(2, 0, 1)

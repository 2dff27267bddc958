"""One source's DAR logits for many static queries at once, as a GEMM.

With static queries (``static``, ``static_t``) a source's logits for every later aggregation that
reads it are known when the source is made, so two-phase chunks take them from one GEMM per shared
source (``source_logits``) and only weight their shared sources per chunk (``weighted_sum``).
The backward sends the logits' gradients to the source, the queries and e(t), without copying the
source to fp32: on CUDA the fp32 factors are split into high and low halves of the source's dtype, so
its GEMMs run on tensor cores with ~16 bits of mantissa (``_mm_fp32``, ``_mm_split``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _source_grad(dzr: Tensor, w: Tensor, temb: Tensor | None, c: Tensor, v: Tensor) -> Tensor:
    """dv = dzr @ w (+ rowsum(dzr) e(t)) - c v, in v's dtype: the logits' gradient back to the source
    (dzr = dz r, c = rowsum(dz z) r^2, both per row)."""
    if dzr.is_cuda and v.dtype in _LOW:
        # dv is rounded to v's dtype: ~16-bit halves of both factors suffice, and so does the GEMM's output in
        # v's dtype (one rounding more before ``- c v``; an fp32 output is twice the bytes written and read back)
        along_q = _mm_split(dzr.flatten(0, 1), w.to(dzr.dtype), v.dtype, v.dtype).view(v.shape)
    else:
        along_q = (dzr.flatten(0, 1) @ w.to(dzr.dtype)).view(v.shape)
    if temb is not None:
        along_q = along_q + dzr.sum(-1, keepdim=True) * temb.to(dzr.dtype)
    return (along_q - c * v.to(dzr.dtype)).to(v.dtype)


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


def _mm_split(a: Tensor, b: Tensor, dtype: torch.dtype, out: torch.dtype = torch.float32) -> Tensor:
    """a @ b for two fp32 matrices as one ``dtype`` GEMM with ``out`` output: each split into a high and a
    low half, a_hi b_hi + a_hi b_lo + a_lo b_hi (the dropped a_lo b_lo is ~2^-16 of the product) stacked
    along the inner dimension. On tensor cores instead of an fp32 FFMA GEMM (the source gradient's
    dzr @ w, K = the source's later queries, took 0.24 ms per source at DiT-XL/2 b256)."""
    a_hi, b_hi = a.to(dtype), b.to(dtype)
    a_lo, b_lo = (a - a_hi.float()).to(dtype), (b - b_hi.float()).to(dtype)
    a3, b3 = torch.cat([a_hi, a_hi, a_lo], 1), torch.cat([b_hi, b_lo, b_hi], 0)
    if a.is_cuda:
        return torch.mm(a3, b3) if out == dtype else torch.mm(a3, b3, out_dtype=out)
    return (a3.float() @ b3.float()).to(out)  # the same products (exact in fp32) where mm has no out_dtype: tests


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
        # z = r (q . v) with r = (mean(v^2) + eps)^-1/2 / sqrt(D): d r / d v = -r^3 v, so
        # d z / d v = r q - z r^2 v
        dv = _source_grad(dzr, w, temb, (dz * z).sum(-1, keepdim=True) * (r * r), v)
        dw = _mm_fp32(dzr.flatten(0, 1).t(), v.reshape(-1, d)) if ctx.needs_input_grad[1] else None
        dtemb = None
        if temb is not None and ctx.needs_input_grad[2]:
            dtemb = (dzr.sum(-1, keepdim=True) * v.to(dzr.dtype)).sum(1, keepdim=True).to(temb.dtype)
        return dv, dw.to(w.dtype) if dw is not None else None, dtemb, None


def source_logits(v: Tensor, queries: Tensor, temb: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """One source's logits for F static queries at once, as the aggregations compute them:
    (q_f + e) . RMSNorm(v) / sqrt(D), an fp32 (B, N, F) tensor. ``queries`` (F, D); ``temb`` the
    timestep embedding e(t), (B, 1, D), or None. With static queries a source's logits for every
    later aggregation are known when it is made, so one GEMM gives them all (two-phase chunks then
    only weight their shared sources: ``weighted_sum``)."""
    return _SourceLogits.apply(v, queries, temb, eps)

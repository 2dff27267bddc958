"""Fused DAR aggregation in Triton: each source is read once forward and once backward.

The naive path (``dar_reference``) stacks the sources, then materialises fp32 copies,
normalised keys, logits and weighted products, several times the size of the sources.
Here one program owns a block of rows (b, n) and walks the sources, a tile of BLOCK_S at a
time, with an online softmax (running max and sum, rescaled accumulator), so only the output
and a per-row log-sum-exp are kept for backward; backward recomputes keys and weights from
the sources.

Sources are addressed through an int64 table of data pointers, so a list of tensors is
read in place (no ``torch.stack`` copy). The kernels sit behind ``torch.library`` custom
ops, so ``torch.compile`` keeps them in its graph (one opaque call) instead of breaking
around them; in eager mode one aggregation runs the same bodies through a plain autograd.Function
(``_EagerMix``), which spares the host the custom-op dispatch. (Holding each row as a
power-of-two head and tail instead of padding D=1152 to 2048 lanes made these bandwidth-bound
kernels slower on the H200, in both directions: benchmarks/results/dar_kernel_headtail.md; the
issue-bound prefix forward below uses it.)

Two-phase chunks. The K sublayers of a chunk share the sources before it (v_0 and earlier
chunks' summaries). By default their shared part is a weighted sum from logits made by one GEMM per
source (``dar_stream``); with ROUTEKIT_DAR_SHARED=fused, ``dar_prefix_fused`` mixes those once
per query and leaves, per query, a partial mix and its log-sum-exp; each sublayer then merges its
partial with its own chunk's outputs (``dar_fused`` with a prefix: the partial enters the online softmax as its initial
state). The prefix forward runs one program per (row block, query), the K programs of a row
block side by side so the shared sources come from DRAM once and from L2 K-1 times (DiT-XL/2 b256
step: 26.0 ms with K queries per program at 939003a, 23.4 ms at f088e76); its backward walks the
sources once for all K queries. (A backward in two passes, whole-row sums then 128-column gradient tiles, measured
1.5-3x slower: benchmarks/results/dar_schedule_51bce40.md.) Prefix and merge are a pair in
backward: the merge hands the prefix p_A g (the gradient of the partial mix, p_A its share of
the softmax) and, in place of the
gradient of the partial's log-sum-exp, the row factor -p_A (g . o); with these the prefix's
logit gradients are p(g . v - g . o) without the partial mix itself, so it is never kept for
backward. A prefix is only correct under a merge of the same kernel (the graph rewrite
guarantees it; the composite is tested against the reference).

With few sources (a chunk's merges, the prefix) backward programs walk several row tiles of
one sample and sum a broadcast query's gradient in registers, so one (D,) partial per program
is written instead of a (B, N, D) fp32 gradient per aggregation (``_sample_split``).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from routekit.kernels.dar_reference import DarInputError, Sources, check_dar_inputs, prefix_queries

MAX_D = 2048
"""Largest feature size: a whole row of a source lives in registers."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _tile_ptrs(table_ptr, s0, S, like_ptr, offs, mask, BLOCK_S: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers (BLOCK_S, BLOCK_R, BLOCK_D) into sources s0 .. s0+BLOCK_S-1 (read from the pointer
    table; indices past S point at source S-1 and are masked off), and that mask."""
    idx = s0 + tl.arange(0, BLOCK_S)
    ok = idx < S
    base = tl.load(table_ptr + tl.minimum(idx, S - 1)).to(tl.pointer_type(like_ptr.dtype.element_ty))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    return base[:, None, None] + offs[None, :, :], ok[:, None, None] & mask[None, :, :]


@triton.jit
def _load_tile(table_ptr, s0, S, like_ptr, offs, mask, BLOCK_S: tl.constexpr, ALIGNED: tl.constexpr):
    ptrs, ok = _tile_ptrs(table_ptr, s0, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _row_block(block, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row block ``block`` of the flattened (B*N, D) problem: indices, row and element masks, and
    element offsets into a contiguous (B, N, D) tensor (int64: B*N*D may pass 2**31)."""
    return _sample_rows(0, block * BLOCK_R, R, D, BLOCK_R, BLOCK_D)


@triton.jit
def _sample_rows(b, n0, N, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows n0 .. n0+BLOCK_R-1 of sample b (masked past N), as ``_row_block`` gives them."""
    ns = n0 + tl.arange(0, BLOCK_R)
    row_ok = ns < N
    rows = b * N + ns
    cols = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    return rows, row_ok, mask, offs


@triton.jit
def _load_queries(ptr, ks, k_ok, rows, mask, N, stride_k, stride_b, stride_n, stride_d, BLOCK_D: tl.constexpr):
    """K queries for these rows, (BLOCK_K, BLOCK_R, BLOCK_D) fp32, from a strided (K, B, N, D) view."""
    rows64 = rows.to(tl.int64)
    row_offs = (rows64 // N) * stride_b + (rows64 % N) * stride_n
    cols = tl.arange(0, BLOCK_D)
    offs = ks.to(tl.int64)[:, None, None] * stride_k + row_offs[None, :, None] + cols[None, None, :] * stride_d
    return tl.load(ptr + offs, mask=k_ok[:, None, None] & mask[None, :, :], other=0.0).to(tl.float32)


@triton.jit
def _load_rows(ptr, rows, mask, N, stride_b, stride_n, stride_d, BLOCK_D: tl.constexpr):
    """The rows of a strided (B, N, D) tensor (the query may broadcast, strides 0), in fp32."""
    rows64 = rows.to(tl.int64)
    row_offs = (rows64 // N) * stride_b + (rows64 % N) * stride_n
    cols = tl.arange(0, BLOCK_D)
    return tl.load(ptr + row_offs[:, None] + cols[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _online_mix(table_ptr, like_ptr, S, q, m, denom, acc, offs, mask, D, eps, scale,
                BLOCK_S: tl.constexpr, ALIGNED: tl.constexpr, FUSED_REDUCE: tl.constexpr):
    """Carry an online softmax (running max ``m``, sum ``denom``, unnormalised mix ``acc``) over S
    sources. They go BLOCK_S at a time (one reduction serves them all) and the next tile is in
    flight while this one is reduced, to hide memory latency."""
    v_next = _load_tile(table_ptr, 0, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
    for s0 in range(0, S, BLOCK_S):
        v = v_next.to(tl.float32)
        v_next = _load_tile(table_ptr, s0 + BLOCK_S, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
        if FUSED_REDUCE:
            ss, qv = tl.reduce((v * v, q[None, :, :] * v), 2, _add2)
        else:
            ss, qv = tl.sum(v * v, 2), tl.sum(q[None, :, :] * v, 2)
        valid = (s0 + tl.arange(0, BLOCK_S)) < S
        logit = tl.where(valid[:, None], qv * tl.rsqrt(ss / D + eps) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(logit, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logit - m_new[None, :])
        denom = denom * alpha + tl.sum(p, 0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, 0)
        m = m_new
    return m, denom, acc


@triton.jit
def _dar_fwd_kernel(
    table_ptr, like_ptr, q_ptr, out_ptr, o32_ptr, lse_ptr, prefix_ptr, prefix_lse_ptr,
    S, R, N, D, stride_qb, stride_qn, stride_qd, eps, scale,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    STORE_O32: tl.constexpr, FUSED_REDUCE: tl.constexpr, HAS_PREFIX: tl.constexpr, PAIRED: tl.constexpr,
):  # fmt: skip
    rows, row_ok, mask, offs = _row_block(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    q = _load_rows(q_ptr, rows, mask, N, stride_qb, stride_qn, stride_qd, BLOCK_D)
    if HAS_PREFIX:  # the chunk's shared part, already mixed: the online softmax's starting state
        m = tl.load(prefix_lse_ptr + rows * (2 if PAIRED else 1), mask=row_ok, other=0.0)
        denom = tl.full([BLOCK_R], 1.0, tl.float32)
        acc = tl.load(prefix_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    m, denom, acc = _online_mix(table_ptr, like_ptr, S, q, m, denom, acc, offs, mask, D, eps, scale,
                                BLOCK_S, ALIGNED, FUSED_REDUCE)
    out = acc / denom[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_O32:
        tl.store(o32_ptr + offs, out, mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(denom), mask=row_ok)


@triton.jit
def _dar_bwd_kernel(
    table_ptr, grad_table_ptr, like_ptr, q_ptr, g_ptr, o_ptr, lse_ptr, dq_ptr, prefix_lse_ptr, dprefix_ptr, y_ptr,
    S, R, N, D, stride_qb, stride_qn, stride_qd, stride_gb, stride_gn, stride_gd, eps, scale, SPLITS, ITERS,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, HAS_PREFIX: tl.constexpr, DQ_PER_ROW: tl.constexpr, PAIRED: tl.constexpr,
):  # fmt: skip
    # this program: ITERS row tiles of sample b (the query gradient of a query shared by those
    # rows is summed here, one (D,) row per program, unless DQ_PER_ROW)
    pid = tl.program_id(0)
    b, split = pid // SPLITS, pid % SPLITS
    dq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for it in range(ITERS):
        rows, row_ok, mask, offs = _sample_rows(b, (split * ITERS + it) * BLOCK_R, N, D, BLOCK_R, BLOCK_D)
        q = _load_rows(q_ptr, rows, mask, N, stride_qb, stride_qn, stride_qd, BLOCK_D)
        g = _load_rows(g_ptr, rows, mask, N, stride_gb, stride_gn, stride_gd, BLOCK_D)
        o = tl.load(o_ptr + offs, mask=mask, other=0.0)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        g_dot_o = tl.sum(g * o, 1)
        if HAS_PREFIX and PAIRED:  # a weighted sum's state: g . o and this merge's lse less the mix's (dar_stream)
            tl.store(y_ptr + rows * 2, g_dot_o, mask=row_ok)
            tl.store(y_ptr + rows * 2 + 1, lse - tl.load(prefix_lse_ptr + rows * 2, mask=row_ok, other=0.0), mask=row_ok)
        elif HAS_PREFIX:  # what the fused prefix's backward needs (see the module docstring)
            p_a = tl.where(row_ok, tl.exp(tl.load(prefix_lse_ptr + rows, mask=row_ok, other=0.0) - lse), 0.0)
            tl.store(dprefix_ptr + offs, (p_a[:, None] * g).to(dprefix_ptr.dtype.element_ty), mask=mask)
            tl.store(y_ptr + rows, -p_a * g_dot_o, mask=row_ok)
        if DQ_PER_ROW:
            dq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)

        v_next = _load_tile(table_ptr, 0, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
        for s0 in range(0, S, BLOCK_S):
            v = v_next.to(tl.float32)
            v_next = _load_tile(table_ptr, s0 + BLOCK_S, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
            if FUSED_REDUCE:
                ss, qv, gv = tl.reduce((v * v, q[None, :, :] * v, g[None, :, :] * v), 2, _add3)
            else:
                ss, qv, gv = tl.sum(v * v, 2), tl.sum(q[None, :, :] * v, 2), tl.sum(g[None, :, :] * v, 2)
            r = tl.rsqrt(ss / D + eps)
            # logit = scale * r * (q . v), dr/dv = -r^3 v / D; padded sources load as zeros and are
            # zeroed here too (with eps=0 their r is inf), so they add nothing to dq
            live = ((s0 + tl.arange(0, BLOCK_S)) < S)[:, None] & row_ok[None, :]
            w = tl.where(live, tl.exp(qv * r * scale - lse[None, :]), 0.0)
            c = tl.where(live, w * (gv - g_dot_o[None, :]) * scale * r, 0.0)
            dv = w[:, :, None] * g[None, :, :] + c[:, :, None] * (q[None, :, :] - (qv * r * r / D)[:, :, None] * v)
            dv_ptrs, ok = _tile_ptrs(grad_table_ptr, s0, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
            tl.store(dv_ptrs, dv.to(like_ptr.dtype.element_ty), mask=ok)
            dq += tl.sum(c[:, :, None] * v, 0)
        if DQ_PER_ROW:
            tl.store(dq_ptr + offs, dq, mask=mask)
    if not DQ_PER_ROW:
        cols = tl.arange(0, BLOCK_D)
        tl.store(dq_ptr + pid.to(tl.int64) * D + cols, tl.sum(dq, 0), mask=cols < D)


@triton.jit
def _online_mix_split(table_ptr, like_ptr, S, q, q_t, offs, mask, offs_t, mask_t, D, eps, scale,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, ALIGNED: tl.constexpr):
    """``_online_mix`` from scratch, one source at a time, for rows held as a power-of-two head
    (BLOCK_D lanes) and tail (BLOCK_T): 1024 + 128 lanes at D=1152 instead of 2048 padded ones."""
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    acc_t = tl.zeros([BLOCK_R, BLOCK_T], tl.float32)
    v_next = _load_tile(table_ptr, 0, S, like_ptr, offs, mask, 1, ALIGNED)
    t_next = _load_tile(table_ptr, 0, S, like_ptr, offs_t, mask_t, 1, ALIGNED)
    for s in range(0, S):
        v, t = v_next.to(tl.float32), t_next.to(tl.float32)  # (1, BLOCK_R, BLOCK_D or BLOCK_T)
        v_next = _load_tile(table_ptr, s + 1, S, like_ptr, offs, mask, 1, ALIGNED)
        t_next = _load_tile(table_ptr, s + 1, S, like_ptr, offs_t, mask_t, 1, ALIGNED)
        ss = tl.sum(v * v, 2) + tl.sum(t * t, 2)
        qv = tl.sum(q[None, :, :] * v, 2) + tl.sum(q_t[None, :, :] * t, 2)
        logit = qv * tl.rsqrt(ss / D + eps) * scale  # (1, BLOCK_R)
        m_new = tl.maximum(m, tl.max(logit, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logit - m_new[None, :])
        denom = denom * alpha + tl.sum(p, 0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, 0)
        acc_t = acc_t * alpha[:, None] + tl.sum(p[:, :, None] * t, 0)
        m = m_new
    return m, denom, acc, acc_t


@triton.jit
def _dar_prefix_fwd_kernel(
    table_ptr, like_ptr, q_ptr, mix_table_ptr, lse_ptr,
    S, K, R, N, D, stride_qk, stride_qb, stride_qn, stride_qd, eps, scale,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """One aggregation per program, as ``_dar_fwd_kernel``; the K programs of a row block are
    neighbours in the launch, so they run side by side and K-1 of them find its sources in L2.
    BLOCK_T > 0: rows as a head of BLOCK_D lanes and a tail of BLOCK_T (``_online_mix_split``)."""
    pid = tl.program_id(0)
    k = pid % K
    rows, row_ok, mask, offs = _row_block(pid // K, R, D, BLOCK_R, BLOCK_D)
    q_row = q_ptr + k.to(tl.int64) * stride_qk
    q = _load_rows(q_row, rows, mask, N, stride_qb, stride_qn, stride_qd, BLOCK_D)
    mix_ptr = tl.load(mix_table_ptr + k).to(tl.pointer_type(like_ptr.dtype.element_ty))
    if ALIGNED:
        mix_ptr = tl.multiple_of(mix_ptr, 16)
    if BLOCK_T == 0:
        m, denom, acc = _online_mix(table_ptr, like_ptr, S, q, tl.full([BLOCK_R], float("-inf"), tl.float32),
                                    tl.zeros([BLOCK_R], tl.float32), tl.zeros([BLOCK_R, BLOCK_D], tl.float32),
                                    offs, mask, D, eps, scale, BLOCK_S, ALIGNED, FUSED_REDUCE)
    else:
        tail = BLOCK_D + tl.arange(0, BLOCK_T)
        mask_t = row_ok[:, None] & (tail < D)[None, :]
        offs_t = rows.to(tl.int64)[:, None] * D + tail[None, :]
        q_t = _load_rows(q_row + BLOCK_D * stride_qd, rows, mask_t, N, stride_qb, stride_qn, stride_qd, BLOCK_T)
        m, denom, acc, acc_t = _online_mix_split(table_ptr, like_ptr, S, q, q_t, offs, mask, offs_t, mask_t, D, eps,
                                                 scale, BLOCK_R, BLOCK_D, BLOCK_T, ALIGNED)
        tl.store(mix_ptr + offs_t, (acc_t / denom[:, None]).to(like_ptr.dtype.element_ty), mask=mask_t)
    tl.store(mix_ptr + offs, (acc / denom[:, None]).to(like_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + k.to(tl.int64) * R + rows, m + tl.log(denom), mask=row_ok)


@triton.jit
def _dar_prefix_bwd_kernel(
    table_ptr, grad_table_ptr, like_ptr, q_ptr, dmix_table_ptr, y_ptr, lse_ptr, dq_ptr,
    S, K, R, N, D, stride_qk, stride_qb, stride_qn, stride_qd, eps, scale, SPLITS, ITERS,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    DQ_PER_ROW: tl.constexpr, FUSED_REDUCE: tl.constexpr, RELOAD_Q: tl.constexpr,
):  # fmt: skip
    """Each source's gradient from all K queries at once, written once."""
    pid = tl.program_id(0)
    b, split = pid // SPLITS, pid % SPLITS
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    dq = tl.zeros([BLOCK_K, BLOCK_R, BLOCK_D], tl.float32)
    for it in range(ITERS):
        rows, row_ok, mask, offs = _sample_rows(b, (split * ITERS + it) * BLOCK_R, N, D, BLOCK_R, BLOCK_D)
        q = _load_queries(q_ptr, ks, k_ok, rows, mask, N, stride_qk, stride_qb, stride_qn, stride_qd, BLOCK_D)
        dmix = _load_tile(dmix_table_ptr, 0, K, like_ptr, offs, mask, BLOCK_K, ALIGNED).to(tl.float32)
        kr = ks[:, None].to(tl.int64) * R + rows[None, :]
        live = k_ok[:, None] & row_ok[None, :]
        y = tl.load(y_ptr + kr, mask=live, other=0.0)
        lse = tl.load(lse_ptr + kr, mask=live, other=0.0)
        if DQ_PER_ROW:
            dq = tl.zeros([BLOCK_K, BLOCK_R, BLOCK_D], tl.float32)

        v_next = _load_tile(table_ptr, 0, S, like_ptr, offs, mask, 1, ALIGNED)
        for s in range(0, S):
            v = v_next.to(tl.float32)  # (1, BLOCK_R, BLOCK_D)
            v_next = _load_tile(table_ptr, s + 1, S, like_ptr, offs, mask, 1, ALIGNED)
            if RELOAD_Q:
                q = _load_queries(q_ptr, ks, k_ok, rows, mask, N, stride_qk, stride_qb, stride_qn, stride_qd,
                                  BLOCK_D)
            if FUSED_REDUCE:  # one cross-thread reduction for the three row sums
                ss, qv, hv = tl.reduce((tl.broadcast_to(v * v, (BLOCK_K, BLOCK_R, BLOCK_D)), q * v, dmix * v), 2,
                                       _add3)
            else:
                ss, qv, hv = tl.sum(v * v, 2), tl.sum(q * v, 2), tl.sum(dmix * v, 2)
            r = tl.rsqrt(ss / D + eps)  # (1 or BLOCK_K, BLOCK_R); qv, hv: (BLOCK_K, BLOCK_R)
            p = tl.where(live, tl.exp(qv * r * scale - lse), 0.0)
            c = tl.where(live, p * (hv + y) * scale * r, 0.0)
            rr = tl.max(r, 0)  # (BLOCK_R,): the same in every row of r
            dv = tl.sum(p[:, :, None] * dmix + c[:, :, None] * q, 0)[None, :, :] \
                - (tl.sum(c * qv, 0) * rr * rr / D)[None, :, None] * v
            dv_ptrs, ok = _tile_ptrs(grad_table_ptr, s, S, like_ptr, offs, mask, 1, ALIGNED)
            tl.store(dv_ptrs, dv.to(like_ptr.dtype.element_ty), mask=ok)
            dq += c[:, :, None] * v
        if DQ_PER_ROW:
            tl.store(dq_ptr + ks[:, None, None].to(tl.int64) * R * D + offs[None, :, :], dq,
                     mask=k_ok[:, None, None] & mask[None, :, :])
    if not DQ_PER_ROW:
        cols = tl.arange(0, BLOCK_D)
        programs = tl.num_programs(0)
        tl.store(dq_ptr + (ks[:, None].to(tl.int64) * programs + pid) * D + cols[None, :], tl.sum(dq, 1),
                 mask=k_ok[:, None] & (cols < D)[None, :])


@dataclass(frozen=True)
class Launch:
    """How the kernels are launched: rows per program, and per direction the sources reduced
    together (one cross-thread reduction serves BLOCK_S sources) and the warps per program."""

    block_rows: int
    fwd_sources: int
    fwd_warps: int
    bwd_sources: int
    bwd_warps: int
    fused_reduce: bool = True  # one tl.reduce for all of a tile's row sums, or a tl.sum each

    def __post_init__(self) -> None:
        for name in ("block_rows", "fwd_sources", "bwd_sources"):  # Triton tile sizes: powers of two
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise DarInputError(f"launch.{name} must be a power of two, got {value}")
        for name in ("fwd_warps", "bwd_warps"):
            if getattr(self, name) < 1:
                raise DarInputError(f"launch.{name} must be at least 1, got {getattr(self, name)}")

    def as_list(self) -> list[int]:
        """The form the custom ops take (their schema allows a list of ints, not this class)."""
        return [self.block_rows, self.fwd_sources, self.fwd_warps, self.bwd_sources, self.bwd_warps,
                int(self.fused_reduce)]

    @classmethod
    def from_list(cls, values: list[int]) -> Launch:
        return cls(*values[:5], bool(values[5]))


def _from_env(name: str, build, count: int, form: str):
    """The launch an environment variable of ``count`` comma-separated integers names (built by
    ``build`` from their list), None when it is unset, or a DarInputError giving the expected ``form``."""
    override = os.environ.get(name)
    if not override:
        return None
    try:
        values = [int(v) for v in override.split(",")]
        if len(values) != count:
            raise ValueError(f"got {len(values)} values")
        return build(values)
    except ValueError as exc:  # DarInputError is a ValueError too
        words = {5: "five", 6: "six"}
        raise DarInputError(f"{name}={override!r}: expected {words.get(count, count)} integers {form} ({exc})") from None


def launch_config(d: int, rows: int) -> Launch:
    """Row tiles of about 2K elements (one row per program at D=1152); sources per tile and
    warps from the H200 sweep at D=1152 (benchmarks/results/dar_kernel_launch_sweep.md), kept at the same
    elements per thread for other widths. ROUTEKIT_DAR_LAUNCH="rows,fwd_sources,fwd_warps,
    bwd_sources,bwd_warps,fused_reduce" overrides it, for tuning on another GPU."""
    override = _from_env("ROUTEKIT_DAR_LAUNCH", Launch.from_list, 6,
                         "rows,fwd_sources,fwd_warps,bwd_sources,bwd_warps,fused_reduce (rows and sources powers of "
                         "two, warps >= 1), e.g. 1,1,1,2,4,1")
    if override:
        return override
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(2048 // block_d, triton.next_power_of_2(rows)))
    size = block_r * block_d

    def warps(sources: int, per_thread: int) -> int:
        return max(1, min(16, sources * size // (32 * per_thread)))

    # Triton 3.6 fails to compile the fused reduction for some small tiles ("operand does not
    # dominate this use", seen at D=3); it is used only for the row shape measured on the H200
    fused = FUSED_REDUCE and block_d == 2048 and block_r == 1
    return Launch(block_r, FWD_SOURCES, warps(FWD_SOURCES, FWD_PER_THREAD), BWD_SOURCES,
                  warps(BWD_SOURCES, BWD_PER_THREAD), fused)


# From the H200 sweep at D=1152, batch 32 and 256 (benchmarks/results/dar_kernel_launch_sweep.md): forward one
# source per tile on one warp, backward two sources per tile on four warps.
FWD_SOURCES, FWD_PER_THREAD = 1, 64
BWD_SOURCES, BWD_PER_THREAD = 2, 32
# Triton's CPU interpreter runs a multi-operand tl.reduce element by element (far slower than
# separate tl.sum calls: it made the CPU kernel tests take minutes); compiled, one fused reduction
# saved ~10% of the backward at D=1152 (dar_kernel_launch_sweep.md, row "both")
FUSED_REDUCE = os.environ.get("TRITON_INTERPRET") != "1"


# Backward programs per launch: several per SM to hide memory latency, few enough that each sums
# its query gradient over many rows.
BWD_PROGRAMS = 4096
ROW_LOOP_MAX_SOURCES = 8


# Pointer tables by (device, pointers): in a training loop the caching allocator hands the same
# addresses back every step, and a backward reads the same sources as its forward, so building a
# table (a host tensor, pinned, copied to the device) becomes a dictionary lookup. A table's content
# depends only on its key, so a hit is always right, whatever tensor now lives at those addresses.
_TABLES: dict[tuple, tuple[Tensor, bool]] = {}
TABLE_CACHE_SIZE = 1024
# What CUDA graphs read, kept for the life of the process: the cached tables a captured kernel reads,
# and the pinned host copy of a table built during a capture (the graph replays that copy into a
# temporary of its own pool). Freed, either could be handed out again and a replay would read its
# pointers from someone else's data. A few hundred bytes per table a captured step uses.
_GRAPH_TABLES: list[Tensor] = []
_HELPER: concurrent.futures.ThreadPoolExecutor | None = None


def _cached_table_storage(n: int, device: torch.device) -> Tensor:
    """An int64 device tensor for a cached table, allocated on a helper thread: while a thread warms up
    or captures a CUDA graph (torch.compile's reduce-overhead mode, torch.cuda.graph) its allocations
    go to that graph's memory pool, which must hold nothing that outlives the graph's own outputs;
    a cached table does."""
    global _HELPER
    if _HELPER is None:
        _HELPER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="routekit-tables")
    table = _HELPER.submit(torch.empty, (n,), dtype=torch.int64, device=device).result()
    stream = torch.cuda.current_stream(device)
    if stream != torch.cuda.default_stream(device):  # allocated for the default stream's order
        stream.wait_stream(torch.cuda.default_stream(device))
        table.record_stream(stream)
    return table


def _table_of(ptrs: list[int], device: torch.device) -> tuple[Tensor, bool]:
    """Int64 tensor of ``ptrs`` on ``device``, and whether all are 16-byte aligned."""
    key = (device, *ptrs)
    hit = _TABLES.get(key)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if hit is not None:
        if capturing:  # the graph will read this table: it must outlive an eviction
            _GRAPH_TABLES.append(hit[0])
        return hit
    aligned = all(p % 16 == 0 for p in ptrs)
    table = torch.tensor(ptrs, dtype=torch.int64)
    if device.type == "cuda":
        host = table.pin_memory()
        if capturing:  # a temporary of the graph, not cached: its copy runs when the graph does
            _GRAPH_TABLES.append(host)
            return host.to(device, non_blocking=True), aligned
        table = _cached_table_storage(len(ptrs), device).copy_(host, non_blocking=True)
    if len(_TABLES) >= TABLE_CACHE_SIZE:
        del _TABLES[next(iter(_TABLES))]  # the oldest
    _TABLES[key] = table, aligned
    return _TABLES[key]


def _pointer_table(tensors: list[Tensor]) -> tuple[Tensor, bool]:
    """The data pointers of ``tensors`` as an int64 tensor on their device, and whether all are
    16-byte aligned."""
    return _table_of([t.data_ptr() for t in tensors], tensors[0].device)


def _contiguous(tensors: list[Tensor]) -> list[Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


# Sources up to this size get their gradients in one (S, B, N, D) allocation, unbound into views:
# their kernels are short and S allocations are a large part of a backward's host work (batch 32,
# 57 sources: 19 MB each). Larger ones get a tensor each, freed as soon as autograd has consumed it
# (a view would hold the whole allocation until every other view is gone).
SHARED_GRAD_MAX_BYTES = 32 << 20


def _shared_grads(sources: list[Tensor]) -> bool:
    return len(sources) > 1 and sources[0].numel() * sources[0].element_size() <= SHARED_GRAD_MAX_BYTES


def _grad_buffers(sources: list[Tensor]) -> tuple[list[Tensor], Tensor, bool]:
    """Gradient storage for ``sources`` as the backward op returns it (one stacked tensor or one
    each, ``_shared_grads``), with its pointer table and whether all are 16-byte aligned."""
    like = sources[0]
    if not _shared_grads(sources):
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sources]
        return grads, *_pointer_table(grads)
    stacked = torch.empty((len(sources), *like.shape), dtype=like.dtype, device=like.device)
    base, step = stacked.data_ptr(), stacked.stride(0) * stacked.element_size()
    return [stacked], *_table_of([base + i * step for i in range(len(sources))], like.device)


def _query_gradient(dq: Tensor, shape: torch.Size, b: int, n: int, splits: int, per_row: bool) -> Tensor:
    """A backward kernel's query gradient, (K, rows or programs, D) or without K, summed to the
    query's broadcast ``shape``: over the programs of each sample, and over samples where the query
    is shared (one reduction for a (D,) or (K, D) query)."""
    lead = dq.shape[:-2]
    d = dq.shape[-1]
    if per_row:
        return dq.view(*lead, b, n, d).sum_to_size(shape)
    if math.prod(shape[len(lead):-1]) == 1:  # the same query for every sample
        return dq.sum(-2).view(shape)
    return dq.view(*lead, b, splits, d).sum(-2, keepdim=True).sum_to_size(shape)


def _sample_split(b: int, n: int, block_r: int, sources: int = 1, programs: int = BWD_PROGRAMS) -> tuple[int, int]:
    """(programs per sample, row tiles per program) for a backward grid of about ``programs``.
    Walking several row tiles per program saves the query-gradient bytes (one fp32 row per row tile
    otherwise) but leaves fewer programs to hide latency: worth it for a few sources (a chunk's
    merges, the prefix), not for many, where those bytes are a few percent of the sources' (57
    sources, batch 256: 7% slower with the loop, dar_kernel_rowloop.md vs dar_kernel_ffad90b.md)."""
    tiles = triton.cdiv(n, block_r)
    if sources > ROW_LOOP_MAX_SOURCES:
        return tiles, 1
    splits = min(tiles, max(1, triton.cdiv(programs, b)))
    iters = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, iters), iters


@dataclass(frozen=True)
class PrefixLaunch:
    """How a chunk's shared part runs: at most ``queries`` queries per op (a chunk of more is split
    into groups, each reading the shared sources once more), warps per program for each direction,
    and, in backward, whether the row sums share one tl.reduce and whether the queries are reloaded
    (from cache) at every source rather than held in registers; in forward, whether a row is held as
    a power-of-two head and tail rather than padded (``_head_tail``)."""

    queries: int
    fwd_warps: int
    bwd_warps: int
    fused_reduce: bool
    reload_query: bool = False
    split_rows: bool = False

    def as_list(self) -> list[int]:
        """The form the custom ops take, as ``Launch.as_list``."""
        return [self.queries, self.fwd_warps, self.bwd_warps, int(self.fused_reduce), int(self.reload_query),
                int(self.split_rows)]

    @classmethod
    def from_list(cls, values: list[int]) -> PrefixLaunch:
        return cls(*values[:3], bool(values[3]), bool(values[4]), bool(values[5]))

    def __post_init__(self) -> None:
        if self.queries < 1:
            raise DarInputError(f"prefix launch queries must be at least 1, got {self.queries}")
        for name in ("fwd_warps", "bwd_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise DarInputError(f"prefix launch {name} must be a power of two, got {value}")


def prefix_launch_config(d: int) -> PrefixLaunch:
    """Defaults for the prefix kernels; ROUTEKIT_DAR_PREFIX="queries,fwd_warps,bwd_warps,fused_reduce,
    reload_query,split_rows" overrides them (benchmarks/dar_schedule.py --sweep measures the choices)."""
    override = _from_env("ROUTEKIT_DAR_PREFIX", PrefixLaunch.from_list, 6,
                         "queries,fwd_warps,bwd_warps,fused_reduce,reload_query,split_rows (queries >= 1, warps "
                         "powers of two), e.g. 4,1,4,1,0,1")
    if override:
        return override
    fused = FUSED_REDUCE and triton.next_power_of_2(d) == 2048
    return PrefixLaunch(PREFIX_QUERIES, PREFIX_FWD_WARPS, PREFIX_BWD_WARPS, fused, PREFIX_RELOAD_QUERY, PREFIX_SPLIT_ROWS)


# From the H200 sweeps of benchmarks/results/dar_schedule*.md (DiT-XL/2's 14 chunks of 4, batch 256): a
# chunk's 4 queries in one backward kernel on 4 warps with the queries in registers (reloading them from
# cache at each source: bwd +6 ms; 2 or 8 warps: +69 and +20 ms, dar_schedule_f088e76.md, dar_schedule_57c68d6.md); forward
# programs of one warp, as the per-aggregation forward (2 and 4 warps: +7% and +14%,
# dar_schedule_51bce40.md), rows held as 1024 + 128 lanes rather than 2048 padded ones (the forward is
# issue-bound, ncu_prefix_858fd6a.txt: -3.6 ms in dar_schedule.md, prefix forward 24.1 -> 19.7 ms in the
# step). Measured and dropped (dar_schedule_57c68d6.md): two sources in flight instead of one (fwd +6.5 ms,
# bwd +4 ms) and the mixes' gradients held in bf16 (no change).
PREFIX_QUERIES, PREFIX_FWD_WARPS, PREFIX_BWD_WARPS, PREFIX_RELOAD_QUERY, PREFIX_SPLIT_ROWS = 4, 1, 4, False, True


def _dar_merge():
    """The merges' kernels module (imported on use: it builds on this one)."""
    from routekit.kernels import dar_merge

    return dar_merge


def _per_row(q: Tensor) -> bool:
    """Whether a query broadcast to (B, N, D) differs between a sample's rows."""
    return q.shape[1] > 1 and q.stride(1) != 0


def _merge_launch(direction: str, prefix_lse: Tensor | None, q: Tensor, sources: int):
    """``dar_merge``'s launch for a merge (a prefix, one query per sample, few own sources), or None
    where the generic kernel runs (or ROUTEKIT_DAR_MERGE_<direction>=generic asks for it)."""
    dar_merge = _dar_merge()
    if prefix_lse is None or _per_row(q) or not dar_merge.fits(sources):
        return None
    return dar_merge.merge_launch(direction)


def _mix(sources: list[Tensor], query: Tensor, eps: float, out_dtype: torch.dtype, keep_o32: bool,
         launch: list[int], prefix: Tensor | None, prefix_lse: Tensor | None, norm_eps: float | None = None,
         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward of ``dar_fused``, callable without the custom-op dispatch."""
    sources = _contiguous(sources)
    like = sources[0]
    b, n, d = like.shape
    cfg = Launch.from_list(launch)
    q = torch.broadcast_to(query, (b, n, d))
    out = torch.empty((b, n, d), dtype=out_dtype, device=like.device)
    o32 = torch.empty((b, n, d) if keep_o32 else (0,), dtype=torch.float32, device=like.device)
    lse = torch.empty((b, n), dtype=torch.float32, device=like.device)
    has_prefix = prefix is not None
    merge = None if keep_o32 else _merge_launch("FWD", prefix_lse, q, len(sources))
    if norm_eps is not None and merge is None:
        raise DarInputError("row statistics come only from a merge's kernel (dar_triton.merge_with_stats)")
    stats = torch.empty((b, n, 2) if norm_eps is not None else (0,), dtype=torch.float32, device=like.device)
    if b * n and merge is not None:  # a two-phase chunk's merge: its own kernel
        _dar_merge().merge_forward(_pointer_table(sources)[0], like, q, prefix.contiguous(), prefix_lse.contiguous(),
                                   out, lse, len(sources), eps, merge, _paired(prefix_lse),
                                   None if norm_eps is None else stats, norm_eps or 0.0)
    elif b * n:
        table, aligned = _pointer_table(sources)
        _dar_fwd_kernel[(triton.cdiv(b * n, cfg.block_rows),)](
            table, like, q, out, o32, lse, prefix.contiguous() if has_prefix else lse,
            prefix_lse.contiguous() if has_prefix else lse,
            len(sources), b * n, n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            BLOCK_R=cfg.block_rows, BLOCK_S=cfg.fwd_sources, BLOCK_D=triton.next_power_of_2(d), ALIGNED=aligned,
            STORE_O32=keep_o32, FUSED_REDUCE=cfg.fused_reduce, HAS_PREFIX=has_prefix,
            PAIRED=has_prefix and _paired(prefix_lse), num_warps=cfg.fwd_warps,
        )  # fmt: skip
    return out, o32, lse, stats


@torch.library.custom_op("routekit::dar_fused", mutates_args=())
def dar_fused(sources: list[Tensor], query: Tensor, eps: float, out_dtype: torch.dtype, keep_o32: bool,
              launch: list[int], prefix: Tensor | None = None, prefix_lse: Tensor | None = None,
              norm_eps: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, fp32 copy of out when ``keep_o32`` else an empty tensor, per-row log-sum-exp, and with
    ``norm_eps`` each out row's mean and 1/sqrt(var + norm_eps) (B, N, 2), else an empty tensor).
    With ``prefix``/``prefix_lse`` (from ``dar_prefix_fused``) the mix continues theirs."""
    return _mix(sources, query, eps, out_dtype, keep_o32, launch, prefix, prefix_lse, norm_eps)


@dar_fused.register_fake
def _(sources, query, eps, out_dtype, keep_o32, launch, prefix=None, prefix_lse=None, norm_eps=None):
    b, n, d = sources[0].shape
    new = sources[0].new_empty
    return new((b, n, d), dtype=out_dtype), new((b, n, d) if keep_o32 else (0,), dtype=torch.float32), \
        new((b, n), dtype=torch.float32), new((b, n, 2) if norm_eps is not None else (0,), dtype=torch.float32)


def _mix_backward(sources: list[Tensor], query: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor, eps: float,
                  launch: list[int], prefix_lse: Tensor | None, g_dot_o: Tensor | None = None,
                  ) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """The body of ``dar_fused_backward``, callable without the custom-op dispatch."""
    sources = _contiguous(sources)
    like = sources[0]
    b, n, d = out.shape
    cfg = Launch.from_list(launch)
    q = torch.broadcast_to(query, (b, n, d))
    has_prefix = prefix_lse is not None
    paired = has_prefix and _paired(prefix_lse)
    dprefix = like.new_empty((b, n, d) if has_prefix and not paired else (0,))
    y = like.new_empty(_y_shape(b, n, prefix_lse), dtype=torch.float32)
    per_row = _per_row(q)
    merge = _merge_launch("BWD", prefix_lse, q, len(sources))
    splits, iters = _sample_split(b, n, 1 if merge else cfg.block_rows, len(sources))  # (merge: one-row tiles)
    dq = torch.empty((b * n, d) if per_row else (b * splits, d), dtype=torch.float32, device=out.device)
    grads, grad_table, grad_aligned = _grad_buffers(sources)
    if g_dot_o is not None and (merge is None or not paired):
        raise DarInputError("g . o is taken only by a merge after a weighted sum (dar_triton._takes_row_dot)")
    if b * n and merge is not None:  # a two-phase chunk's merge: all its sources in one tile
        _dar_merge().merge_backward(_pointer_table(sources)[0], grad_table, like, q, grad_out, out.contiguous(), lse,
                                    prefix_lse.contiguous(), dprefix, y, dq, len(sources), splits, iters, eps, merge,
                                    paired, None if g_dot_o is None else g_dot_o.contiguous())
    elif b * n:
        table, aligned = _pointer_table(sources)
        _dar_bwd_kernel[(b * splits,)](
            table, grad_table, like, q, grad_out, out.contiguous(), lse, dq,
            prefix_lse.contiguous() if has_prefix else lse, dprefix, y,
            len(sources), b * n, n, d, *q.stride(), *grad_out.stride(), eps, 1.0 / math.sqrt(d), splits, iters,
            BLOCK_R=cfg.block_rows, BLOCK_S=cfg.bwd_sources, BLOCK_D=triton.next_power_of_2(d),
            ALIGNED=aligned and grad_aligned, FUSED_REDUCE=cfg.fused_reduce, HAS_PREFIX=has_prefix,
            DQ_PER_ROW=per_row, PAIRED=paired, num_warps=cfg.bwd_warps,
        )  # fmt: skip
    else:
        dq.zero_()
    return grads, _query_gradient(dq, query.shape, b, n, splits, per_row), dprefix, y


@torch.library.custom_op("routekit::dar_fused_backward", mutates_args=())
def dar_fused_backward(sources: list[Tensor], query: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor,
                       eps: float, launch: list[int], prefix_lse: Tensor | None = None,
                       g_dot_o: Tensor | None = None) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """(gradient of each source, contiguous, or all of them stacked in one tensor (``_shared_grads``);
    gradient of the query, fp32, in the query's shape; with a fused prefix's (B, N) lse: p_A g for the
    prefix mix and -p_A (g . o) for its log-sum-exp; with a weighted sum's (B, N, 2) state: empty and
    (g . o, this merge's lse less the mix's) for the state; else both empty). ``g_dot_o``: the rows'
    g . o (B, N) fp32, computed by the caller (``_takes_row_dot``); ``out`` is then not read."""
    return _mix_backward(sources, query, grad_out, out, lse, eps, launch, prefix_lse, g_dot_o)


@dar_fused_backward.register_fake
def _(sources, query, grad_out, out, lse, eps, launch, prefix_lse=None, g_dot_o=None):
    # contiguous, like the real outputs: a fake that copied a source's strides would promise
    # torch.compile a layout the kernel does not write
    b, n, d = out.shape
    like = sources[0]
    has_prefix = prefix_lse is not None
    grads = [like.new_empty((len(sources), *like.shape))] if _shared_grads(sources) else \
        [t.new_empty(t.shape) for t in sources]
    return (grads, query.new_empty(query.shape, dtype=torch.float32),
            like.new_empty((b, n, d) if has_prefix and not _paired(prefix_lse) else (0,)),
            like.new_empty(_y_shape(b, n, prefix_lse), dtype=torch.float32))


def _paired(prefix_lse: Tensor) -> bool:
    """Whether a prefix's lse is a weighted sum's (B, N, 2) state (``dar_stream``) rather than a (B, N)
    log-sum-exp (``dar_prefix_fused``): the merge then hands back its own gradient as the mix's and
    (g . o, its lse less the mix's) through the state, instead of writing p_A g."""
    return prefix_lse.dim() == 3


def _y_shape(b: int, n: int, prefix_lse: Tensor | None) -> tuple[int, ...]:
    """Shape of what a merge's backward hands its prefix's lse: (B, N, 2), (B, N), or none."""
    if prefix_lse is None:
        return (0,)
    return (b, n, 2) if _paired(prefix_lse) else (b, n)


def _save(ctx, sources, query, eps, launch, out, o32, lse, stats, prefix, prefix_lse) -> None:
    ctx.has_prefix = prefix_lse is not None
    ctx.prefix_dtype = prefix.dtype if ctx.has_prefix else None
    ctx.save_for_backward(query, out if o32.numel() == 0 else o32, lse, prefix_lse if ctx.has_prefix else lse,
                          stats, *sources)  # lse stands in for an absent prefix lse
    ctx.eps, ctx.launch = eps, launch


def _takes_row_dot(query: Tensor, out: Tensor, prefix_lse: Tensor | None, sources: int) -> bool:
    """Whether a merge's backward gets its rows' g . o from the graph (``dar_merge.row_dot_in_graph``):
    a merge after a weighted sum, in the merge kernel."""
    return (prefix_lse is not None and _paired(prefix_lse) and _dar_merge().row_dot_in_graph()
            and _merge_launch("BWD", prefix_lse, torch.broadcast_to(query, out.shape), sources) is not None)


def _through_stats(grad_out: Tensor | None, grad_stats: Tensor, out: Tensor, stats: Tensor) -> Tensor:
    """The output's whole gradient when its rows' (mean, r = 1/sqrt(var + eps)) were outputs too:
    d mean / d o = 1/D, d r / d o = -r^3 (o - mean) / D. Torch ops: under torch.compile Inductor fuses
    them into the kernel that makes both gradients (the norm's backward), as a LayerNorm backward."""
    o = out.float()
    mean, r = stats[..., :1], stats[..., 1:]
    d = out.shape[-1]
    g = grad_stats[..., :1] / d - grad_stats[..., 1:] * r * r * r * (o - mean) / d
    return (g if grad_out is None else grad_out.float() + g).to(out.dtype)


def _gradients(ctx, grad_out: Tensor | None, backward, row_dot: bool = False, grad_stats: Tensor | None = None,
               ) -> tuple[list[Tensor], Tensor, Tensor | None, Tensor | None]:
    """(source gradients, query gradient, prefix-mix and prefix-lse gradients or None) from ``backward``
    (the op or its body) and what ``_save`` kept. ``row_dot``: hand a merge after a weighted sum its
    rows' g . o as torch ops, which Inductor fuses into the kernel that makes g (the next sublayer's
    norm backward reads o there anyway), instead of the merge kernel reading o again. ``grad_stats``:
    the gradient of the rows' statistics, when the forward gave them."""
    query, out, lse, prefix_lse, stats, *sources = ctx.saved_tensors
    prefix_lse = prefix_lse if ctx.has_prefix else None
    if grad_stats is not None and stats.numel():
        grad_out = _through_stats(grad_out, grad_stats, out, stats)
    elif grad_out is None:
        grad_out = torch.zeros_like(out)
    g_dot_o = None
    if row_dot and _takes_row_dot(query, out, prefix_lse, len(sources)):
        g_dot_o = (grad_out.float() * out.float()).sum(-1)
    grads, dq, dprefix, y = backward(sources, query, grad_out, out, lse, ctx.eps, ctx.launch, prefix_lse, g_dot_o)
    if _shared_grads(sources):
        grads = list(grads[0].unbind(0))
    if not ctx.has_prefix:
        return grads, dq.to(query.dtype), None, None
    if _paired(prefix_lse):  # the mix's gradient is the merge's own (see _paired)
        dprefix = grad_out.to(ctx.prefix_dtype)
    return grads, dq.to(query.dtype), dprefix, y


def _setup_context(ctx, inputs, output) -> None:
    sources, query, eps, _, _, launch, *prefix = inputs  # the trailing arguments are dropped when not passed
    mix, mix_lse = prefix[:2] if len(prefix) >= 2 and prefix[0] is not None else (None, None)
    _save(ctx, sources, query, eps, launch, *output, mix, mix_lse)


def _backward(ctx, grad_out: Tensor, _grad_o32, _grad_lse, grad_stats):
    grads, dq, dprefix, y = _gradients(ctx, grad_out, dar_fused_backward, row_dot=True, grad_stats=grad_stats)
    grad_query = dq if ctx.needs_input_grad[1] else None
    # as many gradients as arguments were passed (trailing arguments not passed do not count)
    return (grads, grad_query, None, None, None, None, dprefix, y, None)[:len(ctx.needs_input_grad)]


dar_fused.register_autograd(_backward, setup_context=_setup_context)


class _EagerMix(torch.autograd.Function):
    """``dar_fused`` and its autograd without the custom-op dispatch, for eager mode: there the
    dispatch (argument flattening, alias checks, two redispatches per direction) was most of the
    host work of a 57-source aggregation at batch 32, more than its kernels take. Under
    torch.compile the custom op is used instead, so the graph holds one opaque call."""

    @staticmethod
    def forward(ctx, query, eps, out_dtype, keep_o32, launch, prefix, prefix_lse, *sources):
        out, o32, lse, stats = _mix(list(sources), query, eps, out_dtype, keep_o32, launch, prefix, prefix_lse)
        _save(ctx, sources, query, eps, launch, out, o32, lse, stats, prefix, prefix_lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads, dq, dprefix, y = _gradients(ctx, grad_out, _mix_backward)
        return dq, None, None, None, None, dprefix, y, *grads


def _head_tail(d: int) -> tuple[int, int]:
    """A row of d lanes as a power-of-two head and tail ((1024, 128) for 1152), or (padded d, 0)
    where that saves no lanes (d a power of two, or a tail as long as the head)."""
    head = 1 << (d.bit_length() - 1)
    tail = triton.next_power_of_2(d - head) if d > head else 0
    return (head, tail) if tail and head + tail < triton.next_power_of_2(d) else (triton.next_power_of_2(d), 0)


def _lane_split(d: int) -> tuple[int, int]:
    """``_head_tail`` for kernels that always take a tail: a one-lane tail past D, masked off, where the
    row needs none."""
    head, tail = _head_tail(d)
    return head, max(tail, 1)


def _prefix_operands(sources: list[Tensor], queries: Tensor, launch: list[int], prefix_launch: list[int],
                     ) -> tuple[list[Tensor], Tensor, Launch, PrefixLaunch]:
    """What both prefix ops start from: contiguous sources, the queries broadcast to (K, B, N, D),
    and the two launches decoded from their list form."""
    sources = _contiguous(sources)
    q = torch.broadcast_to(queries, (queries.shape[0], *sources[0].shape))
    return sources, q, Launch.from_list(launch), PrefixLaunch.from_list(prefix_launch)


@torch.library.custom_op("routekit::dar_prefix_fused", mutates_args=())
def dar_prefix_fused(sources: list[Tensor], queries: Tensor, eps: float, launch: list[int],
                     prefix_launch: list[int]) -> tuple[list[Tensor], Tensor]:
    """K partial mixes (one per query, in the sources' dtype) and their log-sum-exps (K, B, N)."""
    sources, q, cfg, pcfg = _prefix_operands(sources, queries, launch, prefix_launch)
    like = sources[0]
    k, b, n, d = q.shape
    mixes = [torch.empty_like(like) for _ in range(k)]
    lse = torch.empty((k, b, n), dtype=torch.float32, device=like.device)
    if b * n:
        table, aligned = _pointer_table(sources)
        mix_table, mix_aligned = _pointer_table(mixes)
        head, tail = _head_tail(d) if pcfg.split_rows else (triton.next_power_of_2(d), 0)
        _dar_prefix_fwd_kernel[(triton.cdiv(b * n, cfg.block_rows) * k,)](
            table, like, q, mix_table, lse, len(sources), k, b * n, n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            BLOCK_R=cfg.block_rows, BLOCK_S=cfg.fwd_sources, BLOCK_D=head, ALIGNED=aligned and mix_aligned,
            FUSED_REDUCE=cfg.fused_reduce, BLOCK_T=tail, num_warps=pcfg.fwd_warps,
        )  # fmt: skip
    return mixes, lse


@dar_prefix_fused.register_fake
def _(sources, queries, eps, launch, prefix_launch):
    like = sources[0]
    return [like.new_empty(like.shape) for _ in range(queries.shape[0])], \
        like.new_empty((queries.shape[0], *like.shape[:2]), dtype=torch.float32)


@torch.library.custom_op("routekit::dar_prefix_fused_backward", mutates_args=())
def dar_prefix_fused_backward(sources: list[Tensor], queries: Tensor, grad_mixes: list[Tensor], y: Tensor,
                              lse: Tensor, eps: float, launch: list[int], prefix_launch: list[int],
                              ) -> tuple[list[Tensor], Tensor]:
    """(gradient of each source; gradient of the queries, fp32, in their shape), from the merges'
    p_A g (``grad_mixes``) and -p_A (g . o) (``y``)."""
    sources, q, cfg, pcfg = _prefix_operands(sources, queries, launch, prefix_launch)
    like = sources[0]
    k, b, n, d = q.shape
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sources]
    grad_mixes = [g.to(like.dtype).contiguous() for g in grad_mixes]
    splits, iters = _sample_split(b, n, cfg.block_rows)
    per_row = n > 1 and q.stride(2) != 0
    dq = torch.empty((k, b * n, d) if per_row else (k, b * splits, d), dtype=torch.float32, device=like.device)
    if b * n:
        table, aligned = _pointer_table(sources)
        grad_table, grad_aligned = _pointer_table(grads)
        dmix_table, dmix_aligned = _pointer_table(grad_mixes)
        block_k, block_d = triton.next_power_of_2(k), triton.next_power_of_2(d)
        _dar_prefix_bwd_kernel[(b * splits,)](
            table, grad_table, like, q, dmix_table, y.contiguous(), lse.contiguous(), dq,
            len(sources), k, b * n, n, d, *q.stride(), eps, 1.0 / math.sqrt(d), splits, iters,
            BLOCK_K=block_k, BLOCK_R=cfg.block_rows, BLOCK_D=block_d,
            ALIGNED=aligned and grad_aligned and dmix_aligned, DQ_PER_ROW=per_row,
            FUSED_REDUCE=pcfg.fused_reduce, RELOAD_Q=pcfg.reload_query, num_warps=pcfg.bwd_warps,
        )  # fmt: skip
    else:
        dq.zero_()
    return grads, _query_gradient(dq, queries.shape, b, n, splits, per_row)


@dar_prefix_fused_backward.register_fake
def _(sources, queries, grad_mixes, y, lse, eps, launch, prefix_launch):
    return [t.new_empty(t.shape) for t in sources], queries.new_empty(queries.shape, dtype=torch.float32)


def _prefix_setup_context(ctx, inputs, output) -> None:
    sources, queries, eps, launch, prefix_launch = inputs
    ctx.save_for_backward(queries, output[1], *sources)
    ctx.eps, ctx.launch, ctx.prefix_launch = eps, launch, prefix_launch


def _prefix_backward(ctx, grad_mixes, grad_lse):
    queries, lse, *sources = ctx.saved_tensors
    # zeros for what autograd left None (a mix or the log-sum-exps no merge used)
    grad_mixes = [torch.zeros_like(sources[0]) if g is None else g for g in grad_mixes]
    y = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grads, dq = dar_prefix_fused_backward(sources, queries, grad_mixes, y, lse, ctx.eps, ctx.launch,
                                          ctx.prefix_launch)
    return grads, dq.to(queries.dtype) if ctx.needs_input_grad[1] else None, None, None, None


dar_prefix_fused.register_autograd(_prefix_backward, setup_context=_prefix_setup_context)


def _checked(sources: Sources, query: Tensor, out_dtype: torch.dtype | None) -> tuple[list[Tensor], torch.dtype, int]:
    _, b, n, d = check_dar_inputs(sources, query)
    sources = list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)
    if sources[0].dtype not in SUPPORTED_DTYPES:
        raise DarInputError(f"sources are {sources[0].dtype}; the Triton kernel supports {SUPPORTED_DTYPES}")
    if d > MAX_D:
        raise DarInputError(f"D={d} exceeds the Triton kernel's limit of {MAX_D}; use kernel='torch'")
    out_dtype = out_dtype or sources[0].dtype
    if out_dtype not in SUPPORTED_DTYPES:
        raise DarInputError(f"out_dtype {out_dtype} is not one of {SUPPORTED_DTYPES}")
    return sources, out_dtype, b * n


def dar_aggregate_triton(sources: Sources, query: Tensor, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
                         launch: Launch | None = None, prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Fused DAR aggregation with the contract of ``dar_aggregate_reference``.

    A stacked (S, B, N, D) tensor or a list of S (B, N, D) tensors (read in place).
    ``out_dtype`` (default: the sources') lets bf16 sources give an fp32 residual stream.
    ``launch`` overrides ``launch_config`` for tuning sweeps. ``prefix``: one (mix, lse) pair
    from ``dar_prefix_triton`` (its sources join this mix).
    """
    sources, out_dtype, rows = _checked(sources, query, out_dtype)
    launch = launch or launch_config(sources[0].shape[-1], rows)  # a Launch is valid by construction
    mix, lse = prefix if prefix is not None else (None, None)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or any(t.requires_grad for t in sources)
                                              or (mix is not None and (mix.requires_grad or lse.requires_grad)))
    # backward reads g . o from the output, or from an fp32 copy when the output is rounded below the
    # sources' precision (an output in the sources' dtype carries a rounding of their own size)
    keep_o32 = needs_grad and out_dtype.itemsize < sources[0].dtype.itemsize
    if torch.compiler.is_compiling():
        return dar_fused(sources, query, eps, out_dtype, keep_o32, launch.as_list(), mix, lse)[0]
    return _EagerMix.apply(query, eps, out_dtype, keep_o32, launch.as_list(), mix, lse, *sources)


def _compiling() -> bool:
    """torch.compiler.is_compiling() under a name of ours: a test stands in for a trace by patching this,
    never torch's own, whose identity Dynamo records in rule tables it builds once per process."""
    return torch.compiler.is_compiling()


def merge_with_stats(sources: Sources, query: Tensor, eps: float, prefix: tuple[Tensor, Tensor],
                     norm_eps: float) -> tuple[Tensor, Tensor] | None:
    """``dar_aggregate_triton(sources, query, eps, prefix=prefix)`` and its rows' (mean, 1/sqrt(var +
    norm_eps)) (B, N, 2) fp32, from the merge kernel, which holds each row when it stores it: a LayerNorm
    of the output is then pointwise, not another pass that reads it twice (``dar.layer_norm_of_mix``).
    None where that kernel does not run the merge, outside torch.compile (an eager LayerNorm is one
    fast kernel already) or with ROUTEKIT_DAR_NORM_STATS=graph (``dar_merge.norm_stats_in_merge``)."""
    if not _compiling() or not _dar_merge().norm_stats_in_merge():
        return None
    sources, out_dtype, rows = _checked(sources, query, None)
    mix, lse = prefix
    if _merge_launch("FWD", lse, torch.broadcast_to(query, sources[0].shape), len(sources)) is None:
        return None
    launch = launch_config(sources[0].shape[-1], rows)
    out, _, _, stats = dar_fused(sources, query, eps, out_dtype, False, launch.as_list(), mix, lse, norm_eps)
    return out, stats


def dar_prefix_triton(sources: Sources, queries: Tensor, eps: float = 1e-6, *, launch: Launch | None = None,
                      prefix_launch: PrefixLaunch | None = None) -> tuple[list[Tensor], Tensor]:
    """The shared part of K aggregations over the same ``sources``: K (mix, lse) pairs, as lists
    (mixes) and a (K, B, N) tensor, for ``dar_aggregate_triton(..., prefix=(mixes[k], lse[k]))``.
    ``queries``: (K, D) or broadcasting to (K, B, N, D)."""
    queries = prefix_queries(queries)
    sources, _, rows = _checked(sources, queries[0], None)
    d = sources[0].shape[-1]
    launch = launch or launch_config(d, rows)
    prefix_launch = prefix_launch or prefix_launch_config(d)
    settings = prefix_launch.as_list()
    parts = [dar_prefix_fused(sources, queries[k:k + prefix_launch.queries], eps, launch.as_list(), settings)
             for k in range(0, queries.shape[0], prefix_launch.queries)]
    if len(parts) == 1:
        return parts[0]
    return [m for mixes, _ in parts for m in mixes], torch.cat([lse for _, lse in parts])

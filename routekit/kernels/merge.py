"""A two-phase chunk's merge in Triton: one aggregation continuing a weighted sum's state.

A chunk's K sublayers share the sources before it; ``weighted_sums`` mixes those once per sublayer
and each sublayer then merges its few own sources into that mix: the online softmax starts from the
mix (weight 1 at its log-sum-exp) and takes them one at a time. The aggregation op
(``aggregation``) runs a merge through these kernels wherever they take it (one query per sample,
at most ``MAX_SOURCES`` own sources: ``fits``) and through its generic kernels otherwise.

Both directions are bandwidth-bound, so a row's loads are requested together (and, with prefetch,
the next row's while this one is computed), the next source is in flight while one is computed,
and a row is held as a power-of-two head and tail of lanes rather than padded (1024 + 128 at
D=1152). The query is one per sample and its gradient is summed in registers.

In backward a merge hands the weighted sum, through the state's two slots, its rows' g . o and its
own log-sum-exp less the mix's (``weighted_sums`` says why). Under torch.compile the rows' g . o come
from the graph (``row_dot``) and the kernel does not read o. The forward may also give each row's
LayerNorm statistics, computed from the row it holds (``merge_with_stats``: the norm that reads the
merge is then pointwise); ``through_stats`` is their backward.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from torch import Tensor

from routekit.kernels.launch import FUSED_REDUCE, MergeLaunch, lane_split, next_power_of_2, sample_split

MAX_SOURCES = 4
"""Most own sources these kernels take: a chunk of S=4 gives its merges 1-3 sources and a summary."""


@triton.jit
def add3(a0, a1, a2, b0, b1, b2):
    """tl.reduce's combine for three sums at once; the aggregation's generic kernels use it too (they import this
    module to launch the merges, so it lives here, below them)."""
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _query_row(q_ptr, b, stride_qb, stride_qd, D, lanes):
    """Sample b's query at ``lanes``, fp32 (one query per sample: the rows of a sample share it)."""
    return tl.load(q_ptr + b.to(tl.int64) * stride_qb + lanes * stride_qd, mask=lanes < D, other=0.0).to(tl.float32)


@triton.jit
def _tile(table_ptr, s0, S, like_ptr, row, D, ok, lanes, BLOCK_S: tl.constexpr):
    """Sources s0 .. s0+BLOCK_S-1 of this row at ``lanes`` (those past S masked off)."""
    idx = s0 + tl.arange(0, BLOCK_S)
    base = tl.load(table_ptr + tl.minimum(idx, S - 1)).to(tl.pointer_type(like_ptr.dtype.element_ty))
    return tl.load(base[:, None] + row * D + lanes[None, :], mask=(idx < S)[:, None] & ok[None, :], other=0.0)


@triton.jit
def _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n, live, N, D, stride_gb, stride_gn,
               stride_gd, lanes, BLOCK_S: tl.constexpr, LOAD_O: tl.constexpr):
    """What row n of sample b needs first at ``lanes``, all in flight at once: g, o (g again, unused,
    without LOAD_O), the first source tile."""
    ok = lanes < tl.where(live, D, 0)
    row = b.to(tl.int64) * N + n
    g = tl.load(g_ptr + b.to(tl.int64) * stride_gb + n.to(tl.int64) * stride_gn + lanes * stride_gd, mask=ok,
                other=0.0)
    if LOAD_O:
        o = tl.load(o_ptr + row * D + lanes, mask=ok, other=0.0)
    else:
        o = g
    return g, o, _tile(table_ptr, 0, S, like_ptr, row, D, ok, lanes, BLOCK_S)


@triton.jit
def _row_lse(lse_ptr, plse_ptr, b, n, live, N):
    """Row n's log-sum-exp and its mix's."""
    return tl.load(lse_ptr + b.to(tl.int64) * N + n, mask=live, other=0.0), _mix_lse(plse_ptr, b, n, live, N)


@triton.jit
def _source_sums(q, g, v, FUSED_REDUCE: tl.constexpr):
    """Per source of the tile: |v|^2, q . v, g . v."""
    if FUSED_REDUCE:
        return tl.reduce((v * v, q[None, :] * v, g[None, :] * v), 1, add3)
    return tl.sum(v * v, 1), tl.sum(q[None, :] * v, 1), tl.sum(g[None, :] * v, 1)


@triton.jit(do_not_specialize=["S"])  # one compilation for any number of sources
def _merge_bwd_kernel(
    table_ptr, grad_table_ptr, like_ptr, q_ptr, g_ptr, o_ptr, gdo_ptr, lse_ptr, plse_ptr, y_ptr, dq_ptr,
    S, N, D, stride_qb, stride_qd, stride_gb, stride_gn, stride_gd, eps, scale, SPLITS, ITERS,
    BLOCK_S: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, PREFETCH: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, GIVEN_DOT: tl.constexpr,
):  # fmt: skip
    """ITERS rows of sample b per program, each row as HEAD + TAIL lanes (TAIL lanes past D masked),
    its sources BLOCK_S at a time, the next tile in flight while one is computed. With GIVEN_DOT the
    rows' g . o come from ``gdo_ptr`` and o is not read."""
    pid = tl.program_id(0)
    b, split = pid // SPLITS, pid % SPLITS
    ety = like_ptr.dtype.element_ty
    head = tl.arange(0, HEAD)
    tail = HEAD + tl.arange(0, TAIL)
    q_h, q_t = _query_row(q_ptr, b, stride_qb, stride_qd, D, head), _query_row(q_ptr, b, stride_qb, stride_qd, D, tail)
    dq_h = tl.zeros([HEAD], tl.float32)
    dq_t = tl.zeros([TAIL], tl.float32)
    n0 = split * ITERS
    end = tl.minimum(N, n0 + ITERS)
    g_h, o_h, v_h = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n0, n0 < end, N, D, stride_gb, stride_gn,
                               stride_gd, head, BLOCK_S, not GIVEN_DOT)
    g_t, o_t, v_t = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n0, n0 < end, N, D, stride_gb, stride_gn,
                               stride_gd, tail, BLOCK_S, not GIVEN_DOT)
    lse, plse = _row_lse(lse_ptr, plse_ptr, b, n0, n0 < end, N)
    for it in range(ITERS):
        n = n0 + it
        live = n < end
        if PREFETCH:  # the next row's first loads fly while this row is computed
            ng_h, no_h, nv_h = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n + 1, n + 1 < end, N, D,
                                          stride_gb, stride_gn, stride_gd, head, BLOCK_S, not GIVEN_DOT)
            ng_t, no_t, nv_t = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n + 1, n + 1 < end, N, D,
                                          stride_gb, stride_gn, stride_gd, tail, BLOCK_S, not GIVEN_DOT)
            nlse, nplse = _row_lse(lse_ptr, plse_ptr, b, n + 1, n + 1 < end, N)
        ok_h = head < tl.where(live, D, 0)
        ok_t = tail < tl.where(live, D, 0)
        row = b.to(tl.int64) * N + n
        gh, gt = g_h.to(tl.float32), g_t.to(tl.float32)
        if GIVEN_DOT:
            g_dot_o = tl.load(gdo_ptr + row, mask=live, other=0.0)
        else:
            g_dot_o = tl.sum(gh * o_h.to(tl.float32), 0) + tl.sum(gt * o_t.to(tl.float32), 0)
        # the weighted sum's state gets g . o and this merge's lse less the mix's (weighted_sums' docstring)
        tl.store(y_ptr + row * 2, g_dot_o, mask=live)
        tl.store(y_ptr + row * 2 + 1, lse - plse, mask=live)
        for s0 in range(0, S, BLOCK_S):
            vh, vt = v_h.to(tl.float32), v_t.to(tl.float32)
            if s0 + BLOCK_S < S:  # the next tile of this row
                v_h = _tile(table_ptr, s0 + BLOCK_S, S, like_ptr, row, D, ok_h, head, BLOCK_S)
                v_t = _tile(table_ptr, s0 + BLOCK_S, S, like_ptr, row, D, ok_t, tail, BLOCK_S)
            idx = s0 + tl.arange(0, BLOCK_S)
            s_ok = idx < tl.where(live, S, 0)  # (not `& live`: the interpreter's `&` with a scalar gives ints)
            ss_h, qv_h, gv_h = _source_sums(q_h, gh, vh, FUSED_REDUCE)
            ss_t, qv_t, gv_t = _source_sums(q_t, gt, vt, FUSED_REDUCE)
            # logit = scale r (q . v), r = rsqrt(mean(v^2) + eps): softmax gradient c, and dr/dv = -r^3 v / D
            r = tl.rsqrt((ss_h + ss_t) / D + eps)
            qv = qv_h + qv_t
            w = tl.where(s_ok, tl.exp(qv * r * scale - lse), 0.0)
            c = tl.where(s_ok, w * (gv_h + gv_t - g_dot_o) * scale * r, 0.0)
            k = qv * r * r / D
            dst = tl.load(grad_table_ptr + tl.minimum(idx, S - 1)).to(tl.pointer_type(ety))
            dv_h = w[:, None] * gh[None, :] + c[:, None] * (q_h[None, :] - k[:, None] * vh)
            dv_t = w[:, None] * gt[None, :] + c[:, None] * (q_t[None, :] - k[:, None] * vt)
            tl.store(dst[:, None] + row * D + head[None, :], dv_h.to(ety), mask=s_ok[:, None] & ok_h[None, :])
            tl.store(dst[:, None] + row * D + tail[None, :], dv_t.to(ety), mask=s_ok[:, None] & ok_t[None, :])
            dq_h += tl.sum(c[:, None] * vh, 0)
            dq_t += tl.sum(c[:, None] * vt, 0)
        if PREFETCH:
            g_h, o_h, v_h, lse, plse, g_t, o_t, v_t = ng_h, no_h, nv_h, nlse, nplse, ng_t, no_t, nv_t
        else:
            g_h, o_h, v_h = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n + 1, n + 1 < end, N, D, stride_gb,
                                       stride_gn, stride_gd, head, BLOCK_S, not GIVEN_DOT)
            g_t, o_t, v_t = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n + 1, n + 1 < end, N, D, stride_gb,
                                       stride_gn, stride_gd, tail, BLOCK_S, not GIVEN_DOT)
            lse, plse = _row_lse(lse_ptr, plse_ptr, b, n + 1, n + 1 < end, N)
    tl.store(dq_ptr + pid.to(tl.int64) * D + head, dq_h, mask=head < D)
    tl.store(dq_ptr + pid.to(tl.int64) * D + tail, dq_t, mask=tail < D)


@triton.jit(do_not_specialize=["S"])  # one compilation for any number of sources
def _merge_fwd_kernel(
    table_ptr, like_ptr, q_ptr, mix_ptr, plse_ptr, out_ptr, lse_ptr, stats_ptr,
    S, N, D, stride_qb, stride_qd, eps, scale, norm_eps, SPLITS, ITERS,
    HEAD: tl.constexpr, TAIL: tl.constexpr, PREFETCH: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    """A merge's forward, ITERS rows of sample b per program as the backward walks them: the online
    softmax starts from the weighted sum (its mix, weight 1 at its lse) and takes the own sources one at
    a time, the next source in flight (and the next row's mix and first source, with PREFETCH). With
    STATS, also each stored row's mean and 1/sqrt(var + norm_eps) (its LayerNorm's, ``stats_ptr`` (B, N, 2))."""
    pid = tl.program_id(0)
    b, split = pid // SPLITS, pid % SPLITS
    head = tl.arange(0, HEAD)
    tail = HEAD + tl.arange(0, TAIL)
    q_h, q_t = _query_row(q_ptr, b, stride_qb, stride_qd, D, head), _query_row(q_ptr, b, stride_qb, stride_qd, D, tail)
    n0 = split * ITERS
    end = tl.minimum(N, n0 + ITERS)
    a_h, v_h = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n0, n0 < end, N, D, head)
    a_t, v_t = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n0, n0 < end, N, D, tail)
    m = _mix_lse(plse_ptr, b, n0, n0 < end, N)
    for it in range(ITERS):
        n = n0 + it
        live = n < end
        if PREFETCH:
            na_h, nv_h = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n + 1, n + 1 < end, N, D, head)
            na_t, nv_t = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n + 1, n + 1 < end, N, D, tail)
            nm = _mix_lse(plse_ptr, b, n + 1, n + 1 < end, N)
        ok_h = head < tl.where(live, D, 0)
        ok_t = tail < tl.where(live, D, 0)
        row = b.to(tl.int64) * N + n
        acc_h, acc_t = a_h.to(tl.float32), a_t.to(tl.float32)
        denom = tl.zeros_like(m) + 1.0
        for s in range(0, S):
            vh, vt = v_h.to(tl.float32), v_t.to(tl.float32)
            if s + 1 < S:
                v_h = _source(table_ptr, s + 1, like_ptr, row, D, ok_h, head)
                v_t = _source(table_ptr, s + 1, like_ptr, row, D, ok_t, tail)
            r = tl.rsqrt((tl.sum(vh * vh, 0) + tl.sum(vt * vt, 0)) / D + eps)
            logit = (tl.sum(q_h * vh, 0) + tl.sum(q_t * vt, 0)) * r * scale
            m_new = tl.maximum(m, logit)
            alpha = tl.exp(m - m_new)
            p = tl.exp(logit - m_new)
            denom = denom * alpha + p
            acc_h = acc_h * alpha + p * vh
            acc_t = acc_t * alpha + p * vt
            m = m_new
        ety = out_ptr.dtype.element_ty
        y_h, y_t = (acc_h / denom).to(ety), (acc_t / denom).to(ety)
        tl.store(out_ptr + row * D + head, y_h, mask=ok_h)
        tl.store(out_ptr + row * D + tail, y_t, mask=ok_t)
        tl.store(lse_ptr + row, m + tl.log(denom), mask=live)
        if STATS:  # of the row as stored (rounded), two passes over it in registers
            yh, yt = y_h.to(tl.float32), y_t.to(tl.float32)
            mean = (tl.sum(yh, 0) + tl.sum(yt, 0)) / D
            ch, ct = tl.where(ok_h, yh - mean, 0.0), tl.where(ok_t, yt - mean, 0.0)
            var = (tl.sum(ch * ch, 0) + tl.sum(ct * ct, 0)) / D
            tl.store(stats_ptr + row * 2, mean, mask=live)
            tl.store(stats_ptr + row * 2 + 1, tl.rsqrt(var + norm_eps), mask=live)
        if PREFETCH:
            a_h, v_h, a_t, v_t, m = na_h, nv_h, na_t, nv_t, nm
        else:
            a_h, v_h = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n + 1, n + 1 < end, N, D, head)
            a_t, v_t = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n + 1, n + 1 < end, N, D, tail)
            m = _mix_lse(plse_ptr, b, n + 1, n + 1 < end, N)


@triton.jit
def _source(table_ptr, s, like_ptr, row, D, ok, lanes):
    """Source s's row at ``lanes``."""
    src = tl.load(table_ptr + s).to(tl.pointer_type(like_ptr.dtype.element_ty))
    return tl.load(src + row * D + lanes, mask=ok, other=0.0)


@triton.jit
def _mix_loads(table_ptr, like_ptr, mix_ptr, b, n, live, N, D, lanes):
    """Row n of sample b at ``lanes``: the weighted sum's mix and the first own source, both in flight."""
    ok = lanes < tl.where(live, D, 0)
    row = b.to(tl.int64) * N + n
    return tl.load(mix_ptr + row * D + lanes, mask=ok, other=0.0), _source(table_ptr, 0, like_ptr, row, D, ok, lanes)


@triton.jit
def _mix_lse(plse_ptr, b, n, live, N):
    """Row n's mix's log-sum-exp, slot 0 of the weighted sum's (B, N, 2) state."""
    return tl.load(plse_ptr + (b.to(tl.int64) * N + n) * 2, mask=live, other=0.0)


def _row_lanes(d: int, launch: MergeLaunch) -> tuple[int, int]:
    """A row's (head, tail) lanes: 1024 + 128 at D=1152 with ``split_rows``, else padded (one masked tail lane)."""
    return lane_split(d) if launch.split_rows else (next_power_of_2(d), 1)


def fits(sources: int) -> bool:
    """Whether these kernels take a merge of ``sources`` own sources (its query one per sample: the
    aggregation op checks that)."""
    return 1 <= sources <= MAX_SOURCES


def merge_forward(table: Tensor, like: Tensor, q: Tensor, mix: Tensor, state: Tensor, out: Tensor, lse: Tensor,
                  sources: int, eps: float, launch: MergeLaunch, stats: Tensor | None = None,
                  norm_eps: float = 0.0) -> None:
    """Launch the forward for (B, N, D) rows (``q`` broadcast to them, one query per sample), rows
    split among programs as the backward splits them; ``state`` the weighted sum's (B, N, 2); ``stats``
    (B, N, 2) fp32: filled with each output row's mean and 1/sqrt(var + norm_eps)."""
    b, n, d = out.shape
    splits, iters = sample_split(b, n, 1, sources)
    head, tail = _row_lanes(d, launch)
    _merge_fwd_kernel[(b * splits,)](
        table, like, q, mix, state, out, lse, lse if stats is None else stats, sources, n, d, q.stride(0),
        q.stride(2), eps, 1.0 / math.sqrt(d), norm_eps, splits, iters, HEAD=head, TAIL=tail,
        PREFETCH=launch.prefetch, STATS=stats is not None, num_warps=launch.warps,
    )  # fmt: skip


def merge_backward(table: Tensor, grad_table: Tensor, like: Tensor, q: Tensor, grad_out: Tensor, out: Tensor,
                   lse: Tensor, state: Tensor, y: Tensor, dq: Tensor, sources: int, splits: int, iters: int,
                   eps: float, launch: MergeLaunch, g_dot_o: Tensor | None = None) -> None:
    """Launch the kernel for (B, N, D) rows: ``q`` broadcast to (B, N, D) with one query per sample,
    ``y`` (B, N, 2) what the state's gradient gets, ``dq`` (B * splits, D) fp32 per-program query
    gradients, ``g_dot_o``: the rows' g . o (B, N) fp32, when given ``out`` is not read."""
    b, n, d = out.shape
    head, tail = _row_lanes(d, launch)
    _merge_bwd_kernel[(b * splits,)](
        table, grad_table, like, q, grad_out, out, lse if g_dot_o is None else g_dot_o, lse, state, y, dq,
        sources, n, d, q.stride(0), q.stride(2), *grad_out.stride(), eps, 1.0 / math.sqrt(d), splits, iters,
        BLOCK_S=min(launch.tile, next_power_of_2(sources)), HEAD=head, TAIL=tail,
        PREFETCH=launch.prefetch, FUSED_REDUCE=launch.fused_reduce and FUSED_REDUCE,
        GIVEN_DOT=g_dot_o is not None, num_warps=launch.warps,
    )  # fmt: skip


def row_dot(grad_out: Tensor, out: Tensor) -> Tensor:
    """The rows' g . o (B, N) fp32 for a compiled merge's backward, as torch ops: Inductor fuses them into
    the kernel that makes g (the next sublayer's norm backward, which reads o there anyway), so the merge
    kernel does not read o again. (Eager, they would be a pass of their own: the kernel reads o there.)"""
    return (grad_out.float() * out.float()).sum(-1)


def through_stats(grad_out: Tensor | None, grad_stats: Tensor, out: Tensor, stats: Tensor) -> Tensor:
    """The output's whole gradient when its rows' (mean, r = 1/sqrt(var + eps)) were outputs too:
    d mean / d o = 1/D, d r / d o = -r^3 (o - mean) / D. Torch ops: under torch.compile Inductor fuses
    them into the kernel that makes both gradients (the norm's backward), as a LayerNorm backward."""
    o = out.float()
    mean, r = stats[..., :1], stats[..., 1:]
    d = out.shape[-1]
    g = grad_stats[..., :1] / d - grad_stats[..., 1:] * r * r * r * (o - mean) / d
    return (g if grad_out is None else grad_out.float() + g).to(out.dtype)

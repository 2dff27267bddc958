"""A two-phase chunk's merges in Triton, forward and backward, every load of a row issued at once.

A merge (``dar_triton.dar_fused`` with a prefix) reads the chunk's shared part (one mix and its
log-sum-exp) and at most a chunk's few own sources; both directions are bandwidth-bound. Backward,
per row, it reads the gradient g, the output o and the sources and writes the sources' gradients,
and for the shared part either p_A g and a row factor (after a fused prefix) or two row values
(after a weighted sum: ``dar_stream``'s docstring). The generic kernels (``_dar_fwd_kernel``,
``_dar_bwd_kernel``) pad rows of 1152 to 2048 lanes and the backward waits for g and o before it
asks for the first source; here a row's loads are requested together (optionally the next row's
while this one is computed), the next source is in flight while one is computed, and rows may be
held as a power-of-two head and tail of lanes. The query is one per sample (static or static +
e(t)) and its gradient is summed in registers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from routekit.kernels.dar_reference import DarInputError, env_choice
from routekit.kernels.dar_triton import FUSED_REDUCE, _add3, _lane_split, _sample_split

MAX_SOURCES = 4
"""Most own sources this kernel takes: a chunk of S=4 gives its merges 1-3 sources and a summary."""


@dataclass(frozen=True)
class MergeLaunch:
    """Warps per program, sources per tile, whether the next row's first loads are issued before this
    row is computed, whether rows are held as a head and tail of lanes (1024 + 128 at D=1152) rather
    than padded, and whether a tile's three row sums share one tl.reduce (slow in Triton's CPU interpreter)."""

    warps: int
    tile: int
    prefetch: bool
    split_rows: bool
    fused_reduce: bool = False

    def __post_init__(self) -> None:
        for name in ("warps", "tile"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise DarInputError(f"merge launch {name} must be a power of two, got {value}")


# From the H200 probe of these kernels (benchmarks/results/dar_merge_probe_0941d86.md): one warp, one source per
# tile, the next row in flight, 1024 + 128 lanes: 20.0 ms over a step's merges against 26.4 for the generic kernel
# (2 warps 23.1, 4 warps 28.0; padded rows on 4 warps 34.6). The forward takes the same (tile and fused reduce
# do not apply: one source at a time): 9.7 ms over a step's merges (c455a17) against the generic kernel's 10.5-10.6
# in earlier calls (throughput_dit_dar_merge_kernels_compile_c455a17.md, *_0941d86.md).
DEFAULTS = {"BWD": MergeLaunch(warps=1, tile=1, prefetch=True, split_rows=True),
            "FWD": MergeLaunch(warps=1, tile=1, prefetch=True, split_rows=True)}


def merge_launch(direction: str = "BWD") -> MergeLaunch | None:
    """The merges' launch in ``direction`` ("BWD" or "FWD"), or None for the generic kernel:
    ROUTEKIT_DAR_MERGE_BWD / ROUTEKIT_DAR_MERGE_FWD = "generic" or "warps,tile,prefetch,split_rows,fused_reduce"
    (e.g. "4,1,1,1,0") override the defaults, for A/B and tuning."""
    name = f"ROUTEKIT_DAR_MERGE_{direction}"
    value = os.environ.get(name)
    if not value:
        return DEFAULTS[direction]
    if value == "generic":
        return None
    try:
        warps, tile, prefetch, split, fused = (int(v) for v in value.split(","))
        return MergeLaunch(warps, tile, bool(prefetch), bool(split), bool(fused))
    except ValueError as exc:  # DarInputError is a ValueError too
        raise DarInputError(f"{name}={value!r}: expected 'generic' or five integers warps,tile,"
                            f"prefetch,split_rows,fused_reduce (warps and tile powers of two), e.g. 4,1,1,1,0 ({exc})"
                            ) from None


ROW_DOT = ("graph", "kernel")


def row_dot_in_graph() -> bool:
    """Where a merge's backward (after a weighted sum, under torch.compile) gets its rows' g . o:
    "graph" (default: torch ops that Inductor fuses into the norm backward that makes g and reads o
    anyway, so the merge kernel does not read o) or "kernel" (the merge kernel reads o);
    ROUTEKIT_DAR_MERGE_DOT chooses, for A/B. Eager runs always take "kernel": there the torch ops
    would be a pass of their own."""
    return env_choice("ROUTEKIT_DAR_MERGE_DOT", ROW_DOT, "graph") == "graph"


NORM_STATS = ("merge", "graph")


def norm_stats_in_merge() -> bool:
    """Where a LayerNorm that reads a merge (``dar.layer_norm_of_mix``, under torch.compile) gets its rows'
    mean and 1/std: "merge" (default: the merge kernel computes them from the row it holds, and the norm
    is pointwise) or "graph" (a LayerNorm of the stored output, a reduction pass of Inductor's);
    ROUTEKIT_DAR_NORM_STATS chooses, for A/B. Read when the graph is traced."""
    return env_choice("ROUTEKIT_DAR_NORM_STATS", NORM_STATS, "merge") == "merge"


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
def _row_lse(lse_ptr, plse_ptr, b, n, live, N, PAIRED: tl.constexpr):
    """Row n's log-sum-exp and its prefix's."""
    return tl.load(lse_ptr + b.to(tl.int64) * N + n, mask=live, other=0.0), _prefix_lse(plse_ptr, b, n, live, N, PAIRED)


@triton.jit
def _source_sums(q, g, v, FUSED_REDUCE: tl.constexpr):
    """Per source of the tile: |v|^2, q . v, g . v."""
    if FUSED_REDUCE:
        return tl.reduce((v * v, q[None, :] * v, g[None, :] * v), 1, _add3)
    return tl.sum(v * v, 1), tl.sum(q[None, :] * v, 1), tl.sum(g[None, :] * v, 1)


@triton.jit
def _merge_bwd_kernel(
    table_ptr, grad_table_ptr, like_ptr, q_ptr, g_ptr, o_ptr, gdo_ptr, lse_ptr, plse_ptr, dprefix_ptr, y_ptr, dq_ptr,
    S, N, D, stride_qb, stride_qd, stride_gb, stride_gn, stride_gd, eps, scale, SPLITS, ITERS,
    BLOCK_S: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, PREFETCH: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, PAIRED: tl.constexpr, GIVEN_DOT: tl.constexpr,
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
    lse, plse = _row_lse(lse_ptr, plse_ptr, b, n0, n0 < end, N, PAIRED)
    for it in range(ITERS):
        n = n0 + it
        live = n < end
        if PREFETCH:  # the next row's first loads fly while this row is computed
            ng_h, no_h, nv_h = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n + 1, n + 1 < end, N, D,
                                          stride_gb, stride_gn, stride_gd, head, BLOCK_S, not GIVEN_DOT)
            ng_t, no_t, nv_t = _row_loads(table_ptr, S, like_ptr, g_ptr, o_ptr, b, n + 1, n + 1 < end, N, D,
                                          stride_gb, stride_gn, stride_gd, tail, BLOCK_S, not GIVEN_DOT)
            nlse, nplse = _row_lse(lse_ptr, plse_ptr, b, n + 1, n + 1 < end, N, PAIRED)
        ok_h = head < tl.where(live, D, 0)
        ok_t = tail < tl.where(live, D, 0)
        row = b.to(tl.int64) * N + n
        gh, gt = g_h.to(tl.float32), g_t.to(tl.float32)
        if GIVEN_DOT:
            g_dot_o = tl.load(gdo_ptr + row, mask=live, other=0.0)
        else:
            g_dot_o = tl.sum(gh * o_h.to(tl.float32), 0) + tl.sum(gt * o_t.to(tl.float32), 0)
        if PAIRED:  # a weighted sum's state: g . o and this merge's lse less the mix's (dar_stream's docstring)
            tl.store(y_ptr + row * 2, g_dot_o, mask=live)
            tl.store(y_ptr + row * 2 + 1, lse - plse, mask=live)
        else:
            p_a = tl.where(live, tl.exp(plse - lse), 0.0)
            tl.store(dprefix_ptr + row * D + head, (p_a * gh).to(ety), mask=ok_h)
            tl.store(dprefix_ptr + row * D + tail, (p_a * gt).to(ety), mask=ok_t)
            tl.store(y_ptr + row, -p_a * g_dot_o, mask=live)
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
            lse, plse = _row_lse(lse_ptr, plse_ptr, b, n + 1, n + 1 < end, N, PAIRED)
    tl.store(dq_ptr + pid.to(tl.int64) * D + head, dq_h, mask=head < D)
    tl.store(dq_ptr + pid.to(tl.int64) * D + tail, dq_t, mask=tail < D)


@triton.jit
def _merge_fwd_kernel(
    table_ptr, like_ptr, q_ptr, mix_ptr, plse_ptr, out_ptr, lse_ptr, stats_ptr,
    S, N, D, stride_qb, stride_qd, eps, scale, norm_eps, SPLITS, ITERS,
    HEAD: tl.constexpr, TAIL: tl.constexpr, PREFETCH: tl.constexpr, PAIRED: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    """A merge's forward, ITERS rows of sample b per program as the backward walks them: the online
    softmax starts from the shared part (its mix, weight 1 at its lse) and takes the own sources one at
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
    m = _prefix_lse(plse_ptr, b, n0, n0 < end, N, PAIRED)
    for it in range(ITERS):
        n = n0 + it
        live = n < end
        if PREFETCH:
            na_h, nv_h = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n + 1, n + 1 < end, N, D, head)
            na_t, nv_t = _mix_loads(table_ptr, like_ptr, mix_ptr, b, n + 1, n + 1 < end, N, D, tail)
            nm = _prefix_lse(plse_ptr, b, n + 1, n + 1 < end, N, PAIRED)
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
            m = _prefix_lse(plse_ptr, b, n + 1, n + 1 < end, N, PAIRED)


@triton.jit
def _source(table_ptr, s, like_ptr, row, D, ok, lanes):
    """Source s's row at ``lanes``."""
    src = tl.load(table_ptr + s).to(tl.pointer_type(like_ptr.dtype.element_ty))
    return tl.load(src + row * D + lanes, mask=ok, other=0.0)


@triton.jit
def _mix_loads(table_ptr, like_ptr, mix_ptr, b, n, live, N, D, lanes):
    """Row n of sample b at ``lanes``: the shared part's mix and the first own source, both in flight."""
    ok = lanes < tl.where(live, D, 0)
    row = b.to(tl.int64) * N + n
    return tl.load(mix_ptr + row * D + lanes, mask=ok, other=0.0), _source(table_ptr, 0, like_ptr, row, D, ok, lanes)


@triton.jit
def _prefix_lse(plse_ptr, b, n, live, N, PAIRED: tl.constexpr):
    """Row n's prefix log-sum-exp (from a (B, N, 2) state when PAIRED)."""
    return tl.load(plse_ptr + (b.to(tl.int64) * N + n) * (2 if PAIRED else 1), mask=live, other=0.0)


def _row_lanes(d: int, launch: MergeLaunch) -> tuple[int, int]:
    """A row's (head, tail) lanes: 1024 + 128 at D=1152 with ``split_rows``, else padded (one masked tail lane)."""
    return _lane_split(d) if launch.split_rows else (triton.next_power_of_2(d), 1)


def merge_forward(table: Tensor, like: Tensor, q: Tensor, mix: Tensor, prefix_lse: Tensor, out: Tensor, lse: Tensor,
                  sources: int, eps: float, launch: MergeLaunch, paired: bool, stats: Tensor | None = None,
                  norm_eps: float = 0.0) -> None:
    """Launch the forward for (B, N, D) rows (``q`` broadcast to them, one query per sample), rows
    split among programs as the backward splits them; ``stats`` (B, N, 2) fp32: filled with each output
    row's mean and 1/sqrt(var + norm_eps)."""
    b, n, d = out.shape
    splits, iters = _sample_split(b, n, 1, sources)
    head, tail = _row_lanes(d, launch)
    _merge_fwd_kernel[(b * splits,)](
        table, like, q, mix, prefix_lse, out, lse, lse if stats is None else stats, sources, n, d, q.stride(0),
        q.stride(2), eps, 1.0 / math.sqrt(d), norm_eps, splits, iters, HEAD=head, TAIL=tail,
        PREFETCH=launch.prefetch, PAIRED=paired, STATS=stats is not None, num_warps=launch.warps,
    )  # fmt: skip


def fits(sources: int) -> bool:
    """Whether this kernel takes a merge of ``sources`` own sources (its query one per sample)."""
    return 1 <= sources <= MAX_SOURCES


def merge_backward(table: Tensor, grad_table: Tensor, like: Tensor, q: Tensor, grad_out: Tensor, out: Tensor,
                   lse: Tensor, prefix_lse: Tensor, dprefix: Tensor, y: Tensor, dq: Tensor, sources: int,
                   splits: int, iters: int, eps: float, launch: MergeLaunch, paired: bool,
                   g_dot_o: Tensor | None = None) -> None:
    """Launch the kernel for (B, N, D) rows: ``q`` broadcast to (B, N, D) with one query per sample,
    ``dq`` (B * splits, D) fp32 per-program query gradients, ``paired``: the prefix lse is a weighted
    sum's (B, N, 2) state (``dar_triton._paired``), ``g_dot_o``: the rows' g . o (B, N) fp32, when
    given ``out`` is not read."""
    b, n, d = out.shape
    head, tail = _row_lanes(d, launch)
    _merge_bwd_kernel[(b * splits,)](
        table, grad_table, like, q, grad_out, out, lse if g_dot_o is None else g_dot_o, lse, prefix_lse, dprefix, y,
        dq,
        sources, n, d, q.stride(0), q.stride(2), *grad_out.stride(), eps, 1.0 / math.sqrt(d), splits, iters,
        BLOCK_S=min(launch.tile, triton.next_power_of_2(sources)), HEAD=head, TAIL=tail,
        PREFETCH=launch.prefetch, FUSED_REDUCE=launch.fused_reduce and FUSED_REDUCE, PAIRED=paired,
        GIVEN_DOT=g_dot_o is not None, num_warps=launch.warps,
    )  # fmt: skip

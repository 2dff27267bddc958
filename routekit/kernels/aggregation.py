"""The fused DAR aggregation in Triton: each source read once forward and once backward.

One op (``aggregate_op``, with ``aggregate_backward_op`` for its gradients) computes
h = sum_s softmax_s(q . RMSNorm(v_s) / sqrt(D)) v_s with the contract of ``naive.aggregate``. Its
generic kernels give a program a block of rows (b, n) and walk the sources, a tile at a time, with an
online softmax (running max and sum, rescaled accumulator): only the output and a per-row log-sum-exp
are kept, and backward recomputes keys and weights from the sources. Sources are addressed through an
int64 table of their data pointers (``tables``), so a list of tensors is read in place, without a stack.

A two-phase chunk's merge (a ``prefix`` given: the aggregation continues a weighted sum's state) runs
through ``merge``'s kernels where they take it, and through the generic kernels otherwise (a query
per row, more own sources than they take, or an fp32 copy of the output kept for backward).

The op is a ``torch.library`` custom op, so torch.compile keeps it in its graph as one opaque call;
eager, the same bodies run through a plain autograd.Function (``_EagerMix``), which spares the host the
custom op's dispatch. docs/kernels.md tells the design and what measured it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from routekit.kernels import merge
from routekit.kernels.launch import AggregateLaunch, launch_list, sample_split
from routekit.kernels.merge import add3
from routekit.kernels.naive import DarInputError, Sources, check_dar_inputs
from routekit.kernels.tables import contiguous, pointer_table, table_of

MAX_D = 2048
"""Largest feature size: a whole row of a source lives in registers."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


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


@triton.jit(do_not_specialize=["S"])  # one compilation for any number of sources
def _dar_fwd_kernel(
    table_ptr, like_ptr, q_ptr, out_ptr, o32_ptr, lse_ptr, mix_ptr, state_ptr,
    S, R, N, D, stride_qb, stride_qn, stride_qd, eps, scale,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    STORE_O32: tl.constexpr, FUSED_REDUCE: tl.constexpr, HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    rows, row_ok, mask, offs = _row_block(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    q = _load_rows(q_ptr, rows, mask, N, stride_qb, stride_qn, stride_qd, BLOCK_D)
    if HAS_PREFIX:  # a weighted sum's mix, weight 1 at its lse: the online softmax's starting state
        m = tl.load(state_ptr + rows * 2, mask=row_ok, other=0.0)
        denom = tl.full([BLOCK_R], 1.0, tl.float32)
        acc = tl.load(mix_ptr + offs, mask=mask, other=0.0).to(tl.float32)
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


@triton.jit(do_not_specialize=["S"])  # one compilation for any number of sources
def _dar_bwd_kernel(
    table_ptr, grad_table_ptr, like_ptr, q_ptr, g_ptr, o_ptr, lse_ptr, dq_ptr, state_ptr, y_ptr,
    S, R, N, D, stride_qb, stride_qn, stride_qd, stride_gb, stride_gn, stride_gd, eps, scale, SPLITS, ITERS,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, HAS_PREFIX: tl.constexpr, DQ_PER_ROW: tl.constexpr,
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
        if HAS_PREFIX:  # the weighted sum's state gets g . o and this merge's lse less the mix's
            tl.store(y_ptr + rows * 2, g_dot_o, mask=row_ok)
            tl.store(y_ptr + rows * 2 + 1, lse - tl.load(state_ptr + rows * 2, mask=row_ok, other=0.0), mask=row_ok)
        if DQ_PER_ROW:
            dq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)

        v_next = _load_tile(table_ptr, 0, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
        for s0 in range(0, S, BLOCK_S):
            v = v_next.to(tl.float32)
            v_next = _load_tile(table_ptr, s0 + BLOCK_S, S, like_ptr, offs, mask, BLOCK_S, ALIGNED)
            if FUSED_REDUCE:
                ss, qv, gv = tl.reduce((v * v, q[None, :, :] * v, g[None, :, :] * v), 2, add3)
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
        return grads, *pointer_table(grads)
    stacked = torch.empty((len(sources), *like.shape), dtype=like.dtype, device=like.device)
    base, step = stacked.data_ptr(), stacked.stride(0) * stacked.element_size()
    return [stacked], *table_of([base + i * step for i in range(len(sources))], like.device)


def _query_gradient(dq: Tensor, shape: torch.Size, b: int, n: int, splits: int, per_row: bool) -> Tensor:
    """A backward kernel's query gradient, (rows or programs, D), summed to the query's broadcast
    ``shape``: over the programs of each sample, and over samples where the query is shared (one
    reduction for a (D,) query)."""
    d = dq.shape[-1]
    if per_row:
        return dq.view(b, n, d).sum_to_size(shape)
    if math.prod(shape[:-1]) == 1:  # the same query for every sample
        return dq.sum(-2).view(shape)
    return dq.view(b, splits, d).sum(-2, keepdim=True).sum_to_size(shape)


def _per_row(q: Tensor) -> bool:
    """Whether a query broadcast to (B, N, D) differs between a sample's rows."""
    return q.shape[1] > 1 and q.stride(1) != 0


def _merges(state: Tensor | None, q: Tensor, sources: int) -> bool:
    """Whether ``merge``'s kernels run this aggregation: a merge (a weighted sum's ``state`` given) of a
    query one per sample (``q`` broadcast to (B, N, D)) and few own sources."""
    return state is not None and not _per_row(q) and merge.fits(sources)


def _mix(sources: list[Tensor], query: Tensor, eps: float, out_dtype: torch.dtype, keep_o32: bool,
         launch: list[int], mix: Tensor | None, state: Tensor | None, norm_eps: float | None = None,
         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward of ``aggregate_op``, callable without the custom-op dispatch."""
    sources = contiguous(sources)
    like = sources[0]
    b, n, d = like.shape
    cfg = AggregateLaunch.from_list(launch)
    q = torch.broadcast_to(query, (b, n, d))
    out = torch.empty((b, n, d), dtype=out_dtype, device=like.device)
    o32 = torch.empty((b, n, d) if keep_o32 else (0,), dtype=torch.float32, device=like.device)
    lse = torch.empty((b, n), dtype=torch.float32, device=like.device)
    merges = not keep_o32 and _merges(state, q, len(sources))
    if norm_eps is not None and not merges:
        raise DarInputError("row statistics come only from a merge's own kernel (aggregation.merge_with_stats_triton)")
    stats = torch.empty((b, n, 2) if norm_eps is not None else (0,), dtype=torch.float32, device=like.device)
    if b * n and merges:
        merge.merge_forward(pointer_table(sources)[0], like, q, mix.contiguous(), state.contiguous(), out, lse,
                            len(sources), eps, cfg.merge_fwd, None if norm_eps is None else stats, norm_eps or 0.0)
    elif b * n:
        table, aligned = pointer_table(sources)
        has_prefix = state is not None
        _dar_fwd_kernel[(triton.cdiv(b * n, cfg.block_rows),)](
            table, like, q, out, o32, lse, mix.contiguous() if has_prefix else lse,
            state.contiguous() if has_prefix else lse,
            len(sources), b * n, n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            BLOCK_R=cfg.block_rows, BLOCK_S=cfg.fwd_sources, BLOCK_D=triton.next_power_of_2(d), ALIGNED=aligned,
            STORE_O32=keep_o32, FUSED_REDUCE=cfg.fused_reduce, HAS_PREFIX=has_prefix, num_warps=cfg.fwd_warps,
        )  # fmt: skip
    return out, o32, lse, stats


@torch.library.custom_op("routekit::aggregate", mutates_args=())
def aggregate_op(sources: list[Tensor], query: Tensor, eps: float, out_dtype: torch.dtype, keep_o32: bool,
                 launch: list[int], mix: Tensor | None = None, state: Tensor | None = None,
                 norm_eps: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, fp32 copy of out when ``keep_o32`` else an empty tensor, per-row log-sum-exp, and with
    ``norm_eps`` each out row's mean and 1/sqrt(var + norm_eps) (B, N, 2), else an empty tensor).
    With ``mix``/``state`` (a Triton weighted sum's) the aggregation continues theirs: a merge.
    ``launch``: ``AggregateLaunch.as_list()``."""
    return _mix(sources, query, eps, out_dtype, keep_o32, launch, mix, state, norm_eps)


@aggregate_op.register_fake
def _(sources, query, eps, out_dtype, keep_o32, launch, mix=None, state=None, norm_eps=None):
    _checked(sources, query, out_dtype)  # the checks a compiled caller leaves to the trace (`_inputs`)
    _checked_prefix(None if state is None else (mix, state), sources[0])
    b, n, d = sources[0].shape
    new = sources[0].new_empty
    return new((b, n, d), dtype=out_dtype), new((b, n, d) if keep_o32 else (0,), dtype=torch.float32), \
        new((b, n), dtype=torch.float32), new((b, n, 2) if norm_eps is not None else (0,), dtype=torch.float32)


def _mix_backward(sources: list[Tensor], query: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor, eps: float,
                  launch: list[int], state: Tensor | None, g_dot_o: Tensor | None = None,
                  ) -> tuple[list[Tensor], Tensor, Tensor]:
    """The body of ``aggregate_backward_op``, callable without the custom-op dispatch."""
    sources = contiguous(sources)
    like = sources[0]
    b, n, d = out.shape
    cfg = AggregateLaunch.from_list(launch)
    q = torch.broadcast_to(query, (b, n, d))
    has_prefix = state is not None
    y = like.new_empty((b, n, 2) if has_prefix else (0,), dtype=torch.float32)
    per_row = _per_row(q)
    merges = _merges(state, q, len(sources))
    splits, iters = sample_split(b, n, 1 if merges else cfg.block_rows, len(sources))  # (merges: one-row tiles)
    dq = torch.empty((b * n, d) if per_row else (b * splits, d), dtype=torch.float32, device=out.device)
    grads, grad_table, grad_aligned = _grad_buffers(sources)
    if g_dot_o is not None and not merges:
        raise DarInputError("g . o is taken only by a merge's own kernel (aggregation._takes_row_dot)")
    if b * n and merges:
        merge.merge_backward(pointer_table(sources)[0], grad_table, like, q, grad_out, out.contiguous(), lse,
                             state.contiguous(), y, dq, len(sources), splits, iters, eps, cfg.merge_bwd,
                             None if g_dot_o is None else g_dot_o.contiguous())
    elif b * n:
        table, aligned = pointer_table(sources)
        _dar_bwd_kernel[(b * splits,)](
            table, grad_table, like, q, grad_out, out.contiguous(), lse, dq, state.contiguous() if has_prefix else lse,
            y, len(sources), b * n, n, d, *q.stride(), *grad_out.stride(), eps, 1.0 / math.sqrt(d), splits, iters,
            BLOCK_R=cfg.block_rows, BLOCK_S=cfg.bwd_sources, BLOCK_D=triton.next_power_of_2(d),
            ALIGNED=aligned and grad_aligned, FUSED_REDUCE=cfg.fused_reduce, HAS_PREFIX=has_prefix,
            DQ_PER_ROW=per_row, num_warps=cfg.bwd_warps,
        )  # fmt: skip
    else:
        dq.zero_()
    return grads, _query_gradient(dq, query.shape, b, n, splits, per_row), y


@torch.library.custom_op("routekit::aggregate_backward", mutates_args=())
def aggregate_backward_op(sources: list[Tensor], query: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor,
                          eps: float, launch: list[int], state: Tensor | None = None,
                          g_dot_o: Tensor | None = None) -> tuple[list[Tensor], Tensor, Tensor]:
    """(gradient of each source, contiguous, or all of them stacked in one tensor (``_shared_grads``);
    gradient of the query, fp32, in the query's shape; with a weighted sum's ``state``, what the state's
    gradient gets: (g . o, this merge's lse less the mix's) (B, N, 2), else an empty tensor). ``g_dot_o``:
    the rows' g . o (B, N) fp32, computed by the caller (``_takes_row_dot``); ``out`` is then not read."""
    return _mix_backward(sources, query, grad_out, out, lse, eps, launch, state, g_dot_o)


@aggregate_backward_op.register_fake
def _(sources, query, grad_out, out, lse, eps, launch, state=None, g_dot_o=None):
    # contiguous, like the real outputs: a fake that copied a source's strides would promise
    # torch.compile a layout the kernel does not write
    b, n, _ = out.shape
    like = sources[0]
    grads = [like.new_empty((len(sources), *like.shape))] if _shared_grads(sources) else \
        [t.new_empty(t.shape) for t in sources]
    return (grads, query.new_empty(query.shape, dtype=torch.float32),
            like.new_empty((b, n, 2) if state is not None else (0,), dtype=torch.float32))


def _save(ctx, sources, query, eps, launch, out, o32, lse, stats, mix, state) -> None:
    ctx.has_prefix = state is not None
    ctx.mix_dtype = mix.dtype if ctx.has_prefix else None
    ctx.save_for_backward(query, out if o32.numel() == 0 else o32, lse, state if ctx.has_prefix else lse,
                          stats, *sources)  # lse stands in for an absent state
    ctx.eps, ctx.launch = eps, launch


def _takes_row_dot(query: Tensor, out: Tensor, state: Tensor | None, sources: int) -> bool:
    """Whether a merge's backward gets its rows' g . o from the graph (``merge.row_dot``): a merge in
    the merge kernel."""
    return _merges(state, torch.broadcast_to(query, out.shape), sources)


def _gradients(ctx, grad_out: Tensor | None, backward, row_dot: bool = False, grad_stats: Tensor | None = None,
               ) -> tuple[list[Tensor], Tensor, Tensor | None, Tensor | None]:
    """(source gradients, query gradient, the mix's and the state's gradients or None) from ``backward``
    (the op or its body) and what ``_save`` kept. ``row_dot``: hand a merge its rows' g . o as torch ops
    (``merge.row_dot``). ``grad_stats``: the gradient of the rows' statistics, when the forward gave them."""
    query, out, lse, state, stats, *sources = ctx.saved_tensors
    state = state if ctx.has_prefix else None
    if grad_stats is not None and stats.numel():
        grad_out = merge.through_stats(grad_out, grad_stats, out, stats)
    elif grad_out is None:
        grad_out = torch.zeros_like(out)
    g_dot_o = merge.row_dot(grad_out, out) if row_dot and _takes_row_dot(query, out, state, len(sources)) else None
    grads, dq, y = backward(sources, query, grad_out, out, lse, ctx.eps, ctx.launch, state, g_dot_o)
    if _shared_grads(sources):
        grads = list(grads[0].unbind(0))
    if not ctx.has_prefix:
        return grads, dq.to(query.dtype), None, None
    # the mix's gradient is the merge's own: the weighted sum's backward weights it (weighted_sums' docstring)
    return grads, dq.to(query.dtype), grad_out.to(ctx.mix_dtype), y


def _setup_context(ctx, inputs, output) -> None:
    sources, query, eps, _, _, launch, *prefix = inputs  # the trailing arguments are dropped when not passed
    mix, state = prefix[:2] if len(prefix) >= 2 and prefix[0] is not None else (None, None)
    _save(ctx, sources, query, eps, launch, *output, mix, state)


def _backward(ctx, grad_out: Tensor, _grad_o32, _grad_lse, grad_stats):
    grads, dq, dmix, dstate = _gradients(ctx, grad_out, aggregate_backward_op, row_dot=True, grad_stats=grad_stats)
    grad_query = dq if ctx.needs_input_grad[1] else None
    # as many gradients as arguments were passed (trailing arguments not passed do not count)
    return (grads, grad_query, None, None, None, None, dmix, dstate, None)[:len(ctx.needs_input_grad)]


aggregate_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerMix(torch.autograd.Function):
    """``aggregate_op`` and its autograd without the custom-op dispatch, for eager mode: there the
    dispatch (argument flattening, alias checks, two redispatches per direction) was most of the
    host work of a 57-source aggregation at batch 32, more than its kernels take. Under
    torch.compile the custom op is used instead, so the graph holds one opaque call."""

    @staticmethod
    def forward(ctx, query, eps, out_dtype, keep_o32, launch, mix, state, *sources):
        out, o32, lse, stats = _mix(list(sources), query, eps, out_dtype, keep_o32, launch, mix, state)
        _save(ctx, sources, query, eps, launch, out, o32, lse, stats, mix, state)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads, dq, dmix, dstate = _gradients(ctx, grad_out, _mix_backward)
        return dq, None, None, None, None, dmix, dstate, *grads


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


def _checked_prefix(prefix: tuple[Tensor, Tensor] | None, like: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """(mix, state) of a prefix for these kernels: a Triton weighted sum's (B, N, D) mix and (B, N, 2)
    state, or (None, None)."""
    if prefix is None:
        return None, None
    mix, state = prefix
    b, n, d = like.shape
    if tuple(mix.shape) != (b, n, d) or tuple(state.shape) != (b, n, 2):
        raise DarInputError(f"prefix of shapes {tuple(mix.shape)} and {tuple(state.shape)}: the Triton kernel continues "
                            f"a Triton weighted sum's mix and state, ({b}, {n}, {d}) and ({b}, {n}, 2); a (B, N) "
                            "log-sum-exp merges only with kernel='torch'")
    return mix, state


def _inputs(sources: Sources, query: Tensor, out_dtype: torch.dtype | None, prefix: tuple[Tensor, Tensor] | None,
            ) -> tuple[list[Tensor], torch.dtype, int, Tensor | None, Tensor | None]:
    """(sources as a list, out_dtype, rows B*N, mix, state), checked by `_checked` and `_checked_prefix`; under
    torch.compile a non-empty list is taken as it is: Dynamo steps through this Python at every aggregation of a
    model (most of DAR's share of its trace was checks), while the op's fake, which checks the same, runs as plain
    Python when the trace reaches the op."""
    if torch.compiler.is_compiling() and isinstance(sources, (list, tuple)) and sources:
        sources = list(sources)
        mix, state = prefix if prefix is not None else (None, None)
        return sources, out_dtype or sources[0].dtype, sources[0].shape[0] * sources[0].shape[1], mix, state
    sources, out_dtype, rows = _checked(sources, query, out_dtype)
    return (sources, out_dtype, rows, *_checked_prefix(prefix, sources[0]))


def aggregate_triton(sources: Sources, query: Tensor, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
                     launch: AggregateLaunch | None = None, prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Fused DAR aggregation with the contract of ``naive.aggregate``.

    A stacked (S, B, N, D) tensor or a list of S (B, N, D) tensors (read in place). ``out_dtype``
    (default: the sources') lets bf16 sources give an fp32 residual stream. ``launch`` overrides
    ``aggregate_launch`` for tuning sweeps. ``prefix``: one (mix, state) pair of
    ``weighted_sums.weighted_sum_triton`` (its sources join this mix).
    """
    sources, out_dtype, rows, mix, state = _inputs(sources, query, out_dtype, prefix)
    launch = launch_list(sources[0].shape[-1], rows, launch)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or any(t.requires_grad for t in sources)
                                              or (mix is not None and (mix.requires_grad or state.requires_grad)))
    # backward reads g . o from the output, or from an fp32 copy when the output is rounded below the
    # sources' precision (an output in the sources' dtype carries a rounding of their own size)
    keep_o32 = needs_grad and out_dtype.itemsize < sources[0].dtype.itemsize
    if torch.compiler.is_compiling():
        return aggregate_op(sources, query, eps, out_dtype, keep_o32, launch, mix, state)[0]
    return _EagerMix.apply(query, eps, out_dtype, keep_o32, launch, mix, state, *sources)


def _compiling() -> bool:
    """torch.compiler.is_compiling() under a name of ours: a test stands in for a trace by patching this,
    never torch's own, whose identity Dynamo records in rule tables it builds once per process."""
    return torch.compiler.is_compiling()


def merge_with_stats_triton(sources: Sources, query: Tensor, eps: float, prefix: tuple[Tensor, Tensor],
                            norm_eps: float, launch: AggregateLaunch | None = None) -> tuple[Tensor, Tensor] | None:
    """``aggregate_triton(sources, query, eps, prefix=prefix)`` and its rows' (mean, 1/sqrt(var + norm_eps))
    (B, N, 2) fp32, from the merge kernel, which holds each row when it stores it: a LayerNorm of the
    output is then pointwise, not another pass that reads it twice. None where that kernel does not run
    the merge, and outside torch.compile (an eager LayerNorm is one fast kernel already). (Here, not in
    ``merge``: the op that launches the merge kernels lives in this module, which imports that one.)"""
    if not _compiling():
        return None
    sources, out_dtype, rows, mix, state = _inputs(sources, query, None, prefix)
    if not _merges(state, torch.broadcast_to(query, sources[0].shape), len(sources)):
        return None
    launch = launch_list(sources[0].shape[-1], rows, launch)
    out, _, _, stats = aggregate_op(sources, query, eps, out_dtype, False, launch, mix, state, norm_eps)
    return out, stats

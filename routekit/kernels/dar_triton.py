"""Fused DAR aggregation in Triton: each source is read once forward and once backward.

The naive path (``dar_reference``) stacks the sources, then materialises fp32 copies,
normalised keys, logits and weighted products, several times the size of the sources.
Here one program owns one row (b, n) and walks the sources with an online softmax
(running max and sum, rescaled accumulator), so only the output and a per-row log-sum-exp
are kept for backward; backward recomputes keys and weights from the sources.

A row is held as a power-of-two head plus a power-of-two tail (D=1152 is 1024 + 128), not
padded to the next power of two (2048): padding would idle 44% of the lanes and double the
registers a program holds, halving how many programs, hence loads, an SM keeps in flight.

Sources are addressed through an int64 table of data pointers, so a list of tensors is read
in place (no ``torch.stack`` copy). The kernels sit behind ``torch.library`` custom ops, so
``torch.compile`` keeps them in its graph (one opaque call) instead of breaking around them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from routekit.kernels.dar_reference import DarInputError, Sources, check_dar_inputs

MAX_D = 4096
"""Largest feature size: a whole row of a source lives in registers."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _source_ptr(table_ptr, s, like_ptr, ALIGNED: tl.constexpr):
    """Pointer to source ``s`` (element type of ``like_ptr``), read from the pointer table."""
    ptr = tl.load(table_ptr + s).to(tl.pointer_type(like_ptr.dtype.element_ty))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load_row(table_ptr, s, like_ptr, base, head, tail, tail_ok, ALIGNED: tl.constexpr):
    """Row ``base`` of source ``s`` as (head, tail), still in the sources' dtype."""
    ptr = _source_ptr(table_ptr, s, like_ptr, ALIGNED) + base
    return tl.load(ptr + head), tl.load(ptr + tail, mask=tail_ok, other=0.0)


@triton.jit
def _dot(a_head, a_tail, b_head, b_tail):
    return tl.sum(a_head * b_head, 0) + tl.sum(a_tail * b_tail, 0)


@triton.jit
def _dar_fwd_kernel(
    table_ptr, like_ptr, q_ptr, out_ptr, o32_ptr, lse_ptr,
    S, N, D, stride_qb, stride_qn, stride_qd, eps, scale,
    HEAD: tl.constexpr, TAIL: tl.constexpr, ALIGNED: tl.constexpr, STORE_O32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (B * N * D) may pass 2**31
    base = row * D
    head = tl.arange(0, HEAD)
    tail = HEAD + tl.arange(0, TAIL)
    tail_ok = tail < D
    q_row = q_ptr + (row // N) * stride_qb + (row % N) * stride_qn
    q_head = tl.load(q_row + head * stride_qd).to(tl.float32)
    q_tail = tl.load(q_row + tail * stride_qd, mask=tail_ok, other=0.0).to(tl.float32)

    m = tl.full([1], float("-inf"), tl.float32)
    denom = tl.zeros([1], tl.float32)
    acc_head = tl.zeros([HEAD], tl.float32)
    acc_tail = tl.zeros([TAIL], tl.float32)
    # Two sources stay in flight while one is reduced, to hide memory latency; the last
    # iterations re-read source S-1, which is then in cache.
    h0, t0 = _load_row(table_ptr, 0, like_ptr, base, head, tail, tail_ok, ALIGNED)
    h1, t1 = _load_row(table_ptr, tl.minimum(1, S - 1), like_ptr, base, head, tail, tail_ok, ALIGNED)
    for s in range(S):
        v_head, v_tail = h0.to(tl.float32), t0.to(tl.float32)
        h0, t0 = h1, t1
        h1, t1 = _load_row(table_ptr, tl.minimum(s + 2, S - 1), like_ptr, base, head, tail, tail_ok, ALIGNED)
        r = tl.rsqrt(_dot(v_head, v_tail, v_head, v_tail) / D + eps)
        logit = _dot(q_head, q_tail, v_head, v_tail) * r * scale
        m_new = tl.maximum(m, logit)
        alpha = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        denom = denom * alpha + p
        acc_head = acc_head * alpha + p * v_head
        acc_tail = acc_tail * alpha + p * v_tail
        m = m_new

    out_head, out_tail = acc_head / denom, acc_tail / denom
    tl.store(out_ptr + base + head, out_head.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + base + tail, out_tail.to(out_ptr.dtype.element_ty), mask=tail_ok)
    if STORE_O32:
        tl.store(o32_ptr + base + head, out_head)
        tl.store(o32_ptr + base + tail, out_tail, mask=tail_ok)
    tl.store(lse_ptr + row + tl.arange(0, 1), m + tl.log(denom))


@triton.jit
def _dar_bwd_kernel(
    table_ptr, grad_table_ptr, like_ptr, q_ptr, g_ptr, o_ptr, lse_ptr, dq_ptr,
    S, N, D, stride_qb, stride_qn, stride_qd, eps, scale,
    HEAD: tl.constexpr, TAIL: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = row * D
    head = tl.arange(0, HEAD)
    tail = HEAD + tl.arange(0, TAIL)
    tail_ok = tail < D
    q_row = q_ptr + (row // N) * stride_qb + (row % N) * stride_qn
    q_head = tl.load(q_row + head * stride_qd).to(tl.float32)
    q_tail = tl.load(q_row + tail * stride_qd, mask=tail_ok, other=0.0).to(tl.float32)
    g_head = tl.load(g_ptr + base + head).to(tl.float32)
    g_tail = tl.load(g_ptr + base + tail, mask=tail_ok, other=0.0).to(tl.float32)
    o_head = tl.load(o_ptr + base + head).to(tl.float32)
    o_tail = tl.load(o_ptr + base + tail, mask=tail_ok, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    g_dot_o = _dot(g_head, g_tail, o_head, o_tail)

    dq_head = tl.zeros([HEAD], tl.float32)
    dq_tail = tl.zeros([TAIL], tl.float32)
    h0, t0 = _load_row(table_ptr, 0, like_ptr, base, head, tail, tail_ok, ALIGNED)
    h1, t1 = _load_row(table_ptr, tl.minimum(1, S - 1), like_ptr, base, head, tail, tail_ok, ALIGNED)
    for s in range(S):
        v_head, v_tail = h0.to(tl.float32), t0.to(tl.float32)
        h0, t0 = h1, t1
        h1, t1 = _load_row(table_ptr, tl.minimum(s + 2, S - 1), like_ptr, base, head, tail, tail_ok, ALIGNED)
        r = tl.rsqrt(_dot(v_head, v_tail, v_head, v_tail) / D + eps)
        q_dot_v = _dot(q_head, q_tail, v_head, v_tail)
        w = tl.exp(q_dot_v * r * scale - lse)
        dlogit = w * (_dot(g_head, g_tail, v_head, v_tail) - g_dot_o)
        # logit = scale * r * (q . v) and dr/dv = -r^3 v / D.
        c = dlogit * scale * r
        k = q_dot_v * r * r / D
        dv_ptr = _source_ptr(grad_table_ptr, s, like_ptr, ALIGNED) + base
        dv_head = w * g_head + c * (q_head - k * v_head)
        dv_tail = w * g_tail + c * (q_tail - k * v_tail)
        tl.store(dv_ptr + head, dv_head.to(like_ptr.dtype.element_ty))
        tl.store(dv_ptr + tail, dv_tail.to(like_ptr.dtype.element_ty), mask=tail_ok)
        dq_head += c * v_head
        dq_tail += c * v_tail
    tl.store(dq_ptr + base + head, dq_head)
    tl.store(dq_ptr + base + tail, dq_tail, mask=tail_ok)


def row_split(d: int) -> tuple[int, int]:
    """(HEAD, TAIL): the largest power of two <= d, and the power of two covering the rest (>= 1)."""
    head = 1 << (d.bit_length() - 1)
    return head, triton.next_power_of_2(d - head) if d > head else 1


def launch_warps(d: int) -> tuple[int, int]:
    """(forward, backward) warps per row program: about 8 (forward) and 4 (backward) elements of
    the row per thread, so many small programs share each SM and keep loads in flight (retune
    from the benchmark's sweep)."""
    return max(1, min(8, d // 256)), max(1, min(8, d // 128))


def _pointer_table(tensors: list[Tensor]) -> tuple[Tensor, bool]:
    """Int64 tensor of the data pointers of ``tensors`` on their device, and whether all are
    16-byte aligned."""
    ptrs = [t.data_ptr() for t in tensors]
    table = torch.tensor(ptrs, dtype=torch.int64)
    if tensors[0].is_cuda:
        table = table.pin_memory().to(tensors[0].device, non_blocking=True)
    return table, all(p % 16 == 0 for p in ptrs)


def _contiguous(tensors: list[Tensor]) -> list[Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


@torch.library.custom_op("routekit::dar_fused", mutates_args=())
def dar_fused(sources: list[Tensor], query: Tensor, eps: float, out_dtype: torch.dtype, keep_o32: bool,
              fwd_warps: int, bwd_warps: int) -> tuple[Tensor, Tensor, Tensor]:
    """(out, fp32 copy of out or an empty tensor, per-row log-sum-exp)."""
    sources = _contiguous(sources)
    like = sources[0]
    b, n, d = like.shape
    q = torch.broadcast_to(query, (b, n, d))
    out = torch.empty((b, n, d), dtype=out_dtype, device=like.device)
    keep_o32 = keep_o32 and out_dtype != torch.float32  # backward reads g . o in fp32
    o32 = torch.empty((b, n, d) if keep_o32 else (0,), dtype=torch.float32, device=like.device)
    lse = torch.empty((b, n), dtype=torch.float32, device=like.device)
    if b * n:
        table, aligned = _pointer_table(sources)
        head, tail = row_split(d)
        _dar_fwd_kernel[(b * n,)](
            table, like, q, out, o32, lse, len(sources), n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            HEAD=head, TAIL=tail, ALIGNED=aligned, STORE_O32=keep_o32, num_warps=fwd_warps,
        )  # fmt: skip
    return out, o32, lse


@dar_fused.register_fake
def _(sources, query, eps, out_dtype, keep_o32, fwd_warps, bwd_warps):
    b, n, d = sources[0].shape
    keep_o32 = keep_o32 and out_dtype != torch.float32
    out = sources[0].new_empty((b, n, d), dtype=out_dtype)
    return out, sources[0].new_empty((b, n, d) if keep_o32 else (0,), dtype=torch.float32), \
        sources[0].new_empty((b, n), dtype=torch.float32)


@torch.library.custom_op("routekit::dar_fused_backward", mutates_args=())
def dar_fused_backward(sources: list[Tensor], query: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor,
                       eps: float, warps: int) -> tuple[list[Tensor], Tensor]:
    """(gradient of each source, gradient of the query broadcast to (B, N, D) in fp32)."""
    sources = _contiguous(sources)
    grads = [torch.empty_like(t) for t in sources]
    b, n, d = out.shape
    dq = torch.empty((b, n, d), dtype=torch.float32, device=out.device)
    if b * n:
        table, aligned = _pointer_table(sources)
        grad_table, grad_aligned = _pointer_table(grads)
        q = torch.broadcast_to(query, (b, n, d))
        head, tail = row_split(d)
        _dar_bwd_kernel[(b * n,)](
            table, grad_table, sources[0], q, grad_out.contiguous(), out.contiguous(), lse, dq,
            len(sources), n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            HEAD=head, TAIL=tail, ALIGNED=aligned and grad_aligned, num_warps=warps,
        )  # fmt: skip
    return grads, dq


@dar_fused_backward.register_fake
def _(sources, query, grad_out, out, lse, eps, warps):
    return [torch.empty_like(t) for t in sources], out.new_empty(out.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    sources, query, eps, _, _, _, bwd_warps = inputs
    out, o32, lse = output
    ctx.save_for_backward(query, out if o32.numel() == 0 else o32, lse, *sources)
    ctx.eps, ctx.warps = eps, bwd_warps


def _backward(ctx, grad_out: Tensor, _grad_o32, _grad_lse):
    query, out, lse, *sources = ctx.saved_tensors
    grads, dq = dar_fused_backward(sources, query, grad_out, out, lse, ctx.eps, ctx.warps)
    grad_query = dq.sum_to_size(query.shape).to(query.dtype) if ctx.needs_input_grad[1] else None
    return grads, grad_query, None, None, None, None, None


dar_fused.register_autograd(_backward, setup_context=_setup_context)


def dar_aggregate_triton(sources: Sources, query: Tensor, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
                         num_warps: tuple[int, int] | None = None) -> Tensor:
    """Fused DAR aggregation with the contract of ``dar_aggregate_reference``.

    A stacked (S, B, N, D) tensor or a list of S (B, N, D) tensors (read in place).
    ``out_dtype`` (default: the sources') lets bf16 sources give an fp32 residual stream.
    ``num_warps`` = (forward, backward) overrides ``launch_warps`` for tuning sweeps.
    """
    _, b, n, d = check_dar_inputs(sources, query)
    sources = list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)
    if sources[0].dtype not in SUPPORTED_DTYPES:
        raise DarInputError(f"sources are {sources[0].dtype}; the Triton kernel supports {SUPPORTED_DTYPES}")
    if d > MAX_D:
        raise DarInputError(f"D={d} exceeds the Triton kernel's limit of {MAX_D}; use kernel='torch'")
    out_dtype = out_dtype or sources[0].dtype
    if out_dtype not in SUPPORTED_DTYPES:
        raise DarInputError(f"out_dtype {out_dtype} is not one of {SUPPORTED_DTYPES}")
    fwd_warps, bwd_warps = num_warps or launch_warps(d)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or any(t.requires_grad for t in sources))
    out, _, _ = dar_fused(sources, query, eps, out_dtype, needs_grad, fwd_warps, bwd_warps)
    return out

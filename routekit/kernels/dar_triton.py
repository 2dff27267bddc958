"""Fused DAR aggregation in Triton: each source is read once forward and once backward.

The naive path (``dar_reference``) stacks the sources, then materialises fp32 copies,
normalised keys, logits and weighted products, several times the size of the sources.
Here one program owns a block of rows (b, n) and walks the sources with an online
softmax (running max and sum, rescaled accumulator), so only the output and a per-row
log-sum-exp are kept for backward; backward recomputes keys and weights from the sources.

Sources are addressed through an int64 table of data pointers, so a list of tensors is
read in place (no ``torch.stack`` copy). The kernels sit behind ``torch.library`` custom
ops, so ``torch.compile`` keeps them in its graph (one opaque call) instead of breaking
around them. (A variant that split each row into a power-of-two head and tail instead of
padding D=1152 to 2048 lanes measured slower on the H200, in both directions:
benchmarks/results/dar_kernel_headtail.md.)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from routekit.kernels.dar_reference import DarInputError, Sources, check_dar_inputs

MAX_D = 2048
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
def _load_source(table_ptr, s, like_ptr, offs, mask, ALIGNED: tl.constexpr):
    return tl.load(_source_ptr(table_ptr, s, like_ptr, ALIGNED) + offs, mask=mask, other=0.0)


@triton.jit
def _dar_fwd_kernel(
    table_ptr, like_ptr, q_ptr, out_ptr, o32_ptr, lse_ptr,
    S, R, N, D, stride_qb, stride_qn, stride_qd, eps, scale,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr, STORE_O32: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)  # (B * N * D) may pass 2**31
    offs = rows64[:, None] * D + cols[None, :]
    q_offs = (rows64 // N) * stride_qb + (rows64 % N) * stride_qn
    q = tl.load(q_ptr + q_offs[:, None] + cols[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)

    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    # Three sources stay in flight while one is reduced, to hide memory latency (they cost
    # few registers while still in bf16); the last iterations re-read source S-1 from cache.
    v_next = _load_source(table_ptr, 0, like_ptr, offs, mask, ALIGNED)
    v_then = _load_source(table_ptr, tl.minimum(1, S - 1), like_ptr, offs, mask, ALIGNED)
    v_last = _load_source(table_ptr, tl.minimum(2, S - 1), like_ptr, offs, mask, ALIGNED)
    for s in range(S):
        v = v_next.to(tl.float32)
        v_next, v_then = v_then, v_last
        v_last = _load_source(table_ptr, tl.minimum(s + 3, S - 1), like_ptr, offs, mask, ALIGNED)
        r = tl.rsqrt(tl.sum(v * v, 1) / D + eps)
        logit = tl.sum(q * v, 1) * r * scale
        m_new = tl.maximum(m, logit)
        alpha = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        denom = denom * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v
        m = m_new

    out = acc / denom[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_O32:
        tl.store(o32_ptr + offs, out, mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(denom), mask=row_ok)


@triton.jit
def _dar_bwd_kernel(
    table_ptr, grad_table_ptr, like_ptr, q_ptr, g_ptr, o_ptr, lse_ptr, dq_ptr,
    S, R, N, D, stride_qb, stride_qn, stride_qd, eps, scale,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)  # (B * N * D) may pass 2**31
    offs = rows64[:, None] * D + cols[None, :]
    q_offs = (rows64 // N) * stride_qb + (rows64 % N) * stride_qn
    q = tl.load(q_ptr + q_offs[:, None] + cols[None, :] * stride_qd, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + offs, mask=mask, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_dot_o = tl.sum(g * o, 1)

    dq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    v_next = _load_source(table_ptr, 0, like_ptr, offs, mask, ALIGNED)
    v_then = _load_source(table_ptr, tl.minimum(1, S - 1), like_ptr, offs, mask, ALIGNED)
    v_last = _load_source(table_ptr, tl.minimum(2, S - 1), like_ptr, offs, mask, ALIGNED)
    for s in range(S):
        v = v_next.to(tl.float32)
        v_next, v_then = v_then, v_last
        v_last = _load_source(table_ptr, tl.minimum(s + 3, S - 1), like_ptr, offs, mask, ALIGNED)
        r = tl.rsqrt(tl.sum(v * v, 1) / D + eps)
        q_dot_v = tl.sum(q * v, 1)
        w = tl.exp(q_dot_v * r * scale - lse)
        dlogit = w * (tl.sum(g * v, 1) - g_dot_o)
        # logit = scale * r * (q . v) and dr/dv = -r^3 v / D.
        c = dlogit * scale * r
        dv = w[:, None] * g + c[:, None] * (q - (q_dot_v * r * r / D)[:, None] * v)
        dv_ptr = _source_ptr(grad_table_ptr, s, like_ptr, ALIGNED)
        tl.store(dv_ptr + offs, dv.to(like_ptr.dtype.element_ty), mask=mask)
        dq += c[:, None] * v
    tl.store(dq_ptr + offs, dq, mask=mask)


def launch_config(d: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_R, forward warps, backward warps): tiles of about 2K elements. From the H200 sweep at
    D=1152 (benchmarks/results/dar_kernel.md): one row per program, 2 warps forward and 8 backward
    (16 and 4 elements per thread) were fastest; the same elements per thread elsewhere."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(2048 // block_d, triton.next_power_of_2(rows)))
    size = block_r * block_d
    return block_r, max(1, min(8, size // 1024)), max(1, min(8, size // 256))


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
              block_rows: int, fwd_warps: int, bwd_warps: int) -> tuple[Tensor, Tensor, Tensor]:
    """(out, fp32 copy of out when ``keep_o32`` else an empty tensor, per-row log-sum-exp)."""
    sources = _contiguous(sources)
    like = sources[0]
    b, n, d = like.shape
    q = torch.broadcast_to(query, (b, n, d))
    out = torch.empty((b, n, d), dtype=out_dtype, device=like.device)
    o32 = torch.empty((b, n, d) if keep_o32 else (0,), dtype=torch.float32, device=like.device)
    lse = torch.empty((b, n), dtype=torch.float32, device=like.device)
    if b * n:
        table, aligned = _pointer_table(sources)
        _dar_fwd_kernel[(triton.cdiv(b * n, block_rows),)](
            table, like, q, out, o32, lse, len(sources), b * n, n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            BLOCK_R=block_rows, BLOCK_D=triton.next_power_of_2(d), ALIGNED=aligned, STORE_O32=keep_o32,
            num_warps=fwd_warps,
        )  # fmt: skip
    return out, o32, lse


@dar_fused.register_fake
def _(sources, query, eps, out_dtype, keep_o32, block_rows, fwd_warps, bwd_warps):
    b, n, d = sources[0].shape
    new = sources[0].new_empty
    return new((b, n, d), dtype=out_dtype), new((b, n, d) if keep_o32 else (0,), dtype=torch.float32), \
        new((b, n), dtype=torch.float32)


@torch.library.custom_op("routekit::dar_fused_backward", mutates_args=())
def dar_fused_backward(sources: list[Tensor], query: Tensor, grad_out: Tensor, out: Tensor, lse: Tensor,
                       eps: float, block_rows: int, warps: int) -> tuple[list[Tensor], Tensor]:
    """(gradient of each source, contiguous; gradient of the query broadcast to (B, N, D), fp32)."""
    sources = _contiguous(sources)
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sources]
    b, n, d = out.shape
    dq = torch.empty((b, n, d), dtype=torch.float32, device=out.device)
    if b * n:
        table, aligned = _pointer_table(sources)
        grad_table, grad_aligned = _pointer_table(grads)
        q = torch.broadcast_to(query, (b, n, d))
        _dar_bwd_kernel[(triton.cdiv(b * n, block_rows),)](
            table, grad_table, sources[0], q, grad_out.contiguous(), out.contiguous(), lse, dq,
            len(sources), b * n, n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            BLOCK_R=block_rows, BLOCK_D=triton.next_power_of_2(d), ALIGNED=aligned and grad_aligned,
            num_warps=warps,
        )  # fmt: skip
    return grads, dq


@dar_fused_backward.register_fake
def _(sources, query, grad_out, out, lse, eps, block_rows, warps):
    # contiguous, like the real outputs: a fake that copied a source's strides would promise
    # torch.compile a layout the kernel does not write
    return [t.new_empty(t.shape) for t in sources], out.new_empty(out.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    sources, query, eps, _, _, block_rows, _, bwd_warps = inputs
    out, o32, lse = output
    ctx.save_for_backward(query, out if o32.numel() == 0 else o32, lse, *sources)
    ctx.eps, ctx.block_rows, ctx.warps = eps, block_rows, bwd_warps


def _backward(ctx, grad_out: Tensor, _grad_o32, _grad_lse):
    query, out, lse, *sources = ctx.saved_tensors
    grads, dq = dar_fused_backward(sources, query, grad_out, out, lse, ctx.eps, ctx.block_rows, ctx.warps)
    grad_query = dq.sum_to_size(query.shape).to(query.dtype) if ctx.needs_input_grad[1] else None
    return grads, grad_query, None, None, None, None, None, None


dar_fused.register_autograd(_backward, setup_context=_setup_context)


def dar_aggregate_triton(sources: Sources, query: Tensor, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
                         block_rows: int | None = None, num_warps: tuple[int, int] | None = None) -> Tensor:
    """Fused DAR aggregation with the contract of ``dar_aggregate_reference``.

    A stacked (S, B, N, D) tensor or a list of S (B, N, D) tensors (read in place).
    ``out_dtype`` (default: the sources') lets bf16 sources give an fp32 residual stream.
    ``block_rows`` (a power of two) and ``num_warps`` = (forward, backward) override
    ``launch_config`` for tuning sweeps.
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
    if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
        raise DarInputError(f"block_rows must be a power of two, got {block_rows}")
    default_rows, fwd_warps, bwd_warps = launch_config(d, b * n)
    fwd_warps, bwd_warps = num_warps or (fwd_warps, bwd_warps)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or any(t.requires_grad for t in sources))
    keep_o32 = needs_grad and out_dtype != torch.float32  # backward reads g . o in fp32, not a rounded copy
    out, _, _ = dar_fused(sources, query, eps, out_dtype, keep_o32, block_rows or default_rows, fwd_warps, bwd_warps)
    return out

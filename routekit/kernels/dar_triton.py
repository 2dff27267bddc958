"""Fused DAR aggregation in Triton: each source is read once forward and once backward.

The naive path (``dar_reference``) stacks the sources, then materialises fp32 copies,
normalised keys, logits and weighted products, several times the size of the sources.
Here one program owns a block of rows (b, n) and walks the sources with an online
softmax (running max and sum, rescaled accumulator), so only the output and a per-row
log-sum-exp are kept for backward; backward recomputes keys and weights from the sources.

Sources are addressed through an int64 table of data pointers, so a list of tensors is
read in place (no ``torch.stack`` copy) and a stacked tensor is just evenly spaced
pointers.
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


def launch_config(d: int, rows: int) -> tuple[int, int]:
    """(BLOCK_R, num_warps): tiles of about 2K elements, 16 per thread, so that many small
    programs share each SM and keep loads in flight (retune from the benchmark's sweep)."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(2048 // block_d, triton.next_power_of_2(rows)))
    return block_r, max(1, min(8, block_r * block_d // 512))


def _pointer_table(tensors: tuple[Tensor, ...]) -> tuple[Tensor, bool]:
    """Int64 tensor of the data pointers of ``tensors`` (one per source) on their device,
    and whether all are 16-byte aligned; a stacked (S, B, N, D) tensor gives S pointers."""
    if len(tensors) == 1 and tensors[0].dim() == 4:
        (stacked,) = tensors
        step = stacked.stride(0) * stacked.element_size()
        ptrs = [stacked.data_ptr() + s * step for s in range(stacked.shape[0])]
    else:
        ptrs = [t.data_ptr() for t in tensors]
    table = torch.tensor(ptrs, dtype=torch.int64)
    if tensors[0].is_cuda:
        table = table.pin_memory().to(tensors[0].device, non_blocking=True)
    return table, all(p % 16 == 0 for p in ptrs)


def _with_contiguous_rows(src: Tensor) -> Tensor:
    """``src`` whose (B, N, D) slices are row-major, copying only when they are not."""
    inner = src[0] if src.dim() == 4 else src
    return src if inner.is_contiguous() else src.contiguous()


class _DarAggregate(torch.autograd.Function):
    """Autograd wrapper; ``sources`` is one stacked (S, B, N, D) tensor or S (B, N, D) tensors."""

    @staticmethod
    def forward(ctx, eps: float, config: tuple[int, int], query: Tensor, *sources: Tensor) -> Tensor:
        sources = tuple(_with_contiguous_rows(t) for t in sources)
        table, aligned = _pointer_table(sources)
        like = sources[0]
        b, n, d = like.shape[-3:]
        q = torch.broadcast_to(query, (b, n, d))
        out = torch.empty((b, n, d), dtype=like.dtype, device=like.device)
        training = any(ctx.needs_input_grad)
        # Backward needs the output in fp32: a rounded bf16 output would blur g . o.
        o32 = torch.empty_like(out, dtype=torch.float32) if training and out.dtype != torch.float32 else out
        lse = torch.empty((b, n), dtype=torch.float32, device=like.device)
        block_r, num_warps = config
        _dar_fwd_kernel[(triton.cdiv(b * n, block_r),)](
            table, like, q, out, o32, lse, len(table), b * n, n, d, *q.stride(), eps, 1.0 / math.sqrt(d),
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d), ALIGNED=aligned, STORE_O32=o32 is not out,
            num_warps=num_warps,
        )  # fmt: skip
        if training:
            ctx.save_for_backward(query, o32, lse, *sources)
            ctx.eps, ctx.config = eps, config
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, o32, lse, *sources = ctx.saved_tensors
        grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in sources)
        table, aligned = _pointer_table(tuple(sources))
        grad_table, grad_aligned = _pointer_table(grads)
        b, n, d = o32.shape
        q = torch.broadcast_to(query, (b, n, d))
        dq = torch.empty_like(o32)
        block_r, num_warps = ctx.config
        _dar_bwd_kernel[(triton.cdiv(b * n, block_r),)](
            table, grad_table, sources[0], q, grad_out.contiguous(), o32, lse, dq,
            len(table), b * n, n, d, *q.stride(), ctx.eps, 1.0 / math.sqrt(d),
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d), ALIGNED=aligned and grad_aligned,
            num_warps=num_warps,
        )  # fmt: skip
        grad_query = dq.sum_to_size(query.shape).to(query.dtype) if ctx.needs_input_grad[2] else None
        return None, None, grad_query, *grads


@torch.compiler.disable
def dar_aggregate_triton(
    sources: Sources,
    query: Tensor,
    eps: float = 1e-6,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Fused DAR aggregation with the contract of ``dar_aggregate_reference``.

    A list of sources is read in place and gets a list of gradients; a stacked tensor
    gets a stacked gradient.  ``block_rows`` (a power of two) and ``num_warps`` override
    ``launch_config`` for tuning sweeps.  Opaque to ``torch.compile``: the pointer table
    reads ``data_ptr`` values, which cannot be traced.
    """
    _, b, n, d = check_dar_inputs(sources, query)
    inputs = (sources,) if isinstance(sources, Tensor) else tuple(sources)
    if inputs[0].dtype not in SUPPORTED_DTYPES:
        raise DarInputError(f"sources are {inputs[0].dtype}; the Triton kernel supports {SUPPORTED_DTYPES}")
    if d > MAX_D:
        raise DarInputError(f"D={d} exceeds the Triton kernel's limit of {MAX_D}; use kernel='torch'")
    if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
        raise DarInputError(f"block_rows must be a power of two, got {block_rows}")
    default_rows, default_warps = launch_config(d, b * n)
    config = (block_rows or default_rows, num_warps or default_warps)
    return _DarAggregate.apply(eps, config, query, *inputs)

"""How fast could a streaming prefix be? A go/no-go measurement for the next prefix design, not a
routekit code path.

Today's prefix kernels compute each shared source's logits (RMS and K dot products per row) inside
the chunk's prefix and run issue-bound at 12.5% occupancy (ncu_prefix_858fd6a.txt). With static
queries every source's logits for all later queries could come from one small GEMM per source, made
once; each chunk's prefix would then be a weighted sum (forward) and, backward, K row dot products
per source plus the weighted sum of the mixes' gradients. This script times exactly those pieces at
DiT-XL/2 batch 256 (65536 rows, D=1152, K=4, 14 chunks sharing 1..14 sources) and checks the two
Triton kernels against torch first:

- ``wsum`` forward: mixes_k = sum_s softmax_s(l_ks) v_s and their log-sum-exp, from given logits;
- ``wsum`` backward: dl_ks = p_ks (dmix_k . v_s + y_k) and dv_s = sum_k p_ks dmix_k (the logit path
  of dv_s goes to the GEMM backward);
- per source, the logit GEMM (rows x D) @ (D x F) with F = 4 x the later chunks, and its two backward
  GEMMs, as bf16 torch.matmul stand-ins.

The weighted sums run over SWEEP's settings (warps, rows per program, forward per query, head and tail,
pipeliner stages).

    python benchmarks/dar_stream_probe.py            # H200: writes results/dar_stream_probe.{json,md}
    python benchmarks/dar_stream_probe.py --quick    # tiny shapes, CPU (TRITON_INTERPRET=1): checks only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import device_or_exit, header, machine, write  # noqa: E402
from benchmarks.dar_kernel import time_ms  # noqa: E402
from routekit.kernels.dar_stream import _lanes, _source_row  # noqa: E402
from routekit.kernels.dar_triton import _lane_split, _pointer_table, _row_block  # noqa: E402

# (warps, rows per program, forward with one program per (row, query), rows as a 1024 + 128 head and tail
# instead of 2048 padded lanes, pipeliner stages (0: the next source held in registers)); measured: rows 1
# on 2/4/8 warps (e2235da), 2 and 4 rows (4af3816: slower)
SWEEP = [(4, 1, False, False, 0), (1, 1, True, False, 0), (2, 1, True, False, 0), (4, 1, True, False, 0),
         (1, 1, True, True, 0), (2, 1, True, True, 0), (4, 1, True, True, 0), (8, 1, True, True, 0)]


@triton.jit
def _probs(logit_ptr, rows, row_ok, S, K, R, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
    """Softmax over sources of the rows' (K, S) logits (stored (K, S, R)): (K, S, rows) weights and the
    (K, rows) log-sum-exp."""
    ks = tl.arange(0, BLOCK_K)
    ss = tl.arange(0, BLOCK_S)
    ok = (ks < K)[:, None, None] & (ss < S)[None, :, None] & row_ok[None, None, :]
    at = (ks[:, None, None] * S + ss[None, :, None]).to(tl.int64) * R + rows[None, None, :]
    logit = tl.load(logit_ptr + at, mask=ok, other=float("-inf"))
    m = tl.max(logit, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # padded queries or rows
    p = tl.where(ok, tl.exp(logit - m[:, None, :]), 0.0)
    denom = tl.sum(p, 1)
    denom = tl.where(denom == 0.0, 1.0, denom)
    return p / denom[:, None, :], m + tl.log(denom), ks, ss


@triton.jit
def _row_ptr(table_ptr, i, like_ptr):
    return tl.load(table_ptr + i).to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def _wsum_fwd_kernel(table_ptr, like_ptr, logit_ptr, mix_table_ptr, lse_ptr, S, K, R, D,
                     BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, row_ok, mask, offs = _row_block(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    p, lse, ks, ss = _probs(logit_ptr, rows, row_ok, S, K, R, BLOCK_K, BLOCK_S)
    acc = tl.zeros([BLOCK_K, BLOCK_R, BLOCK_D], tl.float32)
    v_next = tl.load(_row_ptr(table_ptr, 0, like_ptr) + offs, mask=mask, other=0.0)
    for s in range(0, S):  # the next source's rows are in flight while these are summed (the last, twice: cached)
        v = v_next.to(tl.float32)
        v_next = tl.load(_row_ptr(table_ptr, tl.minimum(s + 1, S - 1), like_ptr) + offs, mask=mask, other=0.0)
        ps = tl.sum(tl.where(ss[None, :, None] == s, p, 0.0), 1)  # (K, rows)
        acc += ps[:, :, None] * v[None, :, :]
    k_ok = ks < K
    mix = tl.load(mix_table_ptr + ks, mask=k_ok, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty))
    tl.store(mix[:, None, None] + offs[None, :, :], acc.to(like_ptr.dtype.element_ty),
             mask=k_ok[:, None, None] & mask[None, :, :])
    tl.store(lse_ptr + ks[:, None] * R + rows[None, :], lse, mask=k_ok[:, None] & row_ok[None, :])


@triton.jit
def _query_probs(logit_ptr, S, K, R, BLOCK_S: tl.constexpr):
    """A per-(row, query) program's row, query, source lanes, softmax weights and log-sum-exp."""
    pid = tl.program_id(0)
    row = (pid // K).to(tl.int64)
    k = pid % K
    ss = tl.arange(0, BLOCK_S)
    s_ok = ss < S
    logit = tl.load(logit_ptr + (k * S + ss).to(tl.int64) * R + row, mask=s_ok, other=float("-inf"))
    m = tl.max(logit, 0)
    p = tl.where(s_ok, tl.exp(logit - m), 0.0)
    denom = tl.sum(p, 0)
    return row, k, ss, p / denom, m + tl.log(denom)


@triton.jit
def _wsum_fwd_query_kernel(table_ptr, like_ptr, logit_ptr, mix_table_ptr, lse_ptr, S, K, R, D,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The forward with one program per (row, query), the K programs of a row adjacent so its
    sources come from L2 after the first: one accumulator per program instead of K."""
    row, k, ss, p, lse = _query_probs(logit_ptr, S, K, R, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    offs = row * D + cols
    acc = tl.zeros([BLOCK_D], tl.float32)
    v_next = tl.load(_row_ptr(table_ptr, 0, like_ptr) + offs, mask=col_ok, other=0.0)
    for s in range(0, S):
        v = v_next.to(tl.float32)
        v_next = tl.load(_row_ptr(table_ptr, tl.minimum(s + 1, S - 1), like_ptr) + offs, mask=col_ok, other=0.0)
        acc += tl.sum(tl.where(ss == s, p, 0.0), 0) * v
    tl.store(_row_ptr(mix_table_ptr, k, like_ptr) + offs, acc.to(like_ptr.dtype.element_ty), mask=col_ok)
    tl.store(lse_ptr + k * R + row, lse)


@triton.jit
def _wsum_bwd_kernel(table_ptr, grad_table_ptr, like_ptr, logit_ptr, dmix_table_ptr, y_ptr, dl_ptr, S, K, R, D,
                     BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, row_ok, mask, offs = _row_block(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    p, _, ks, ss = _probs(logit_ptr, rows, row_ok, S, K, R, BLOCK_K, BLOCK_S)
    k_ok = ks < K
    live = k_ok[:, None] & row_ok[None, :]
    dmix_ptr = tl.load(dmix_table_ptr + ks, mask=k_ok, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty))
    dmix = tl.load(dmix_ptr[:, None, None] + offs[None, :, :], mask=k_ok[:, None, None] & mask[None, :, :],
                   other=0.0).to(tl.float32)
    y = tl.load(y_ptr + ks[:, None] * R + rows[None, :], mask=live, other=0.0)
    v_next = tl.load(_row_ptr(table_ptr, 0, like_ptr) + offs, mask=mask, other=0.0)
    for s in range(0, S):
        v = v_next.to(tl.float32)
        v_next = tl.load(_row_ptr(table_ptr, tl.minimum(s + 1, S - 1), like_ptr) + offs, mask=mask, other=0.0)
        ps = tl.sum(tl.where(ss[None, :, None] == s, p, 0.0), 1)  # (K, rows)
        hv = tl.sum(dmix * v[None, :, :], 2)
        tl.store(dl_ptr + (ks[:, None] * S + s) * R + rows[None, :], ps * (hv + y), mask=live)
        dv = tl.sum(ps[:, :, None] * dmix, 0)
        tl.store(_row_ptr(grad_table_ptr, s, like_ptr) + offs, dv.to(like_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_probs(logit_ptr, row, S, K, R, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
    """One row's (K, S) softmax weights over sources (logits stored (K, S, R))."""
    ks = tl.arange(0, BLOCK_K)
    ss = tl.arange(0, BLOCK_S)
    ok = (ks < K)[:, None] & (ss < S)[None, :]
    logit = tl.load(logit_ptr + (ks[:, None] * S + ss[None, :]).to(tl.int64) * R + row, mask=ok,
                    other=float("-inf"))
    m = tl.max(logit, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.where(ok, tl.exp(logit - m[:, None]), 0.0)
    denom = tl.sum(p, 1)
    denom = tl.where(denom == 0.0, 1.0, denom)
    return p / denom[:, None], ks, ss


@triton.jit
def _advance(table_ptr, s, S, like_ptr, head, head_ok, tail, tail_ok, h_next, t_next):
    """Source s's row (the one in flight) in fp32, and source s+1's row put in flight."""
    nxt_h, nxt_t = _source_row(table_ptr, tl.minimum(s + 1, S - 1), like_ptr, head, head_ok, tail, tail_ok)
    return h_next.to(tl.float32), t_next.to(tl.float32), nxt_h, nxt_t


@triton.jit
def _wsum_fwd_query_ht_kernel(table_ptr, like_ptr, logit_ptr, mix_table_ptr, lse_ptr, S, K, R, D,
                              BLOCK_S: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, STAGES: tl.constexpr):
    """``_wsum_fwd_query_kernel`` with the row as HEAD + TAIL lanes (1024 + 128 for D=1152) rather than
    a power of two padded: 44% fewer lanes, registers and issued instructions at D=1152. STAGES > 0:
    the source loop is left to Triton's pipeliner (``tl.range(num_stages=STAGES)``, the loads staged
    through shared memory) instead of holding the next source in registers."""
    row, k, ss, p, lse = _query_probs(logit_ptr, S, K, R, BLOCK_S)
    head, head_ok, tail, tail_ok = _lanes(row, 0, D, D, HEAD, TAIL)
    acc_h = tl.zeros([HEAD], tl.float32)
    acc_t = tl.zeros([TAIL], tl.float32)
    if STAGES == 0:
        h_next, t_next = _source_row(table_ptr, 0, like_ptr, head, head_ok, tail, tail_ok)
        for s in range(0, S):  # the next source's row in flight while this one is used
            h, t, h_next, t_next = _advance(table_ptr, s, S, like_ptr, head, head_ok, tail, tail_ok, h_next, t_next)
            ps = tl.sum(tl.where(ss == s, p, 0.0), 0)
            acc_h += ps * h
            acc_t += ps * t
    else:
        for s in tl.range(0, S, num_stages=STAGES):
            h, t = _source_row(table_ptr, s, like_ptr, head, head_ok, tail, tail_ok)
            h, t = h.to(tl.float32), t.to(tl.float32)
            ps = tl.sum(tl.where(ss == s, p, 0.0), 0)
            acc_h += ps * h
            acc_t += ps * t
    out = _row_ptr(mix_table_ptr, k, like_ptr)
    tl.store(out + head, acc_h.to(like_ptr.dtype.element_ty))
    tl.store(out + tail, acc_t.to(like_ptr.dtype.element_ty), mask=tail_ok)
    tl.store(lse_ptr + k * R + row, lse)


@triton.jit
def _wsum_bwd_source(s, h, t, p, ss, ks, k_ok, dmix_h, dmix_t, y, dl_ptr, grad_table_ptr, like_ptr, S, R, head,
                     tail, tail_ok):
    """One source of ``_wsum_bwd_ht_kernel``'s row: its K logit gradients and its gradient."""
    ps = tl.sum(tl.where(ss[None, :] == s, p, 0.0), 1)  # (K,)
    hv = tl.sum(dmix_h * h[None, :], 1) + tl.sum(dmix_t * t[None, :], 1)
    tl.store(dl_ptr + (ks * S + s) * R + tl.program_id(0).to(tl.int64), ps * (hv + y), mask=k_ok)
    out = _row_ptr(grad_table_ptr, s, like_ptr)
    tl.store(out + head, tl.sum(ps[:, None] * dmix_h, 0).to(like_ptr.dtype.element_ty))
    tl.store(out + tail, tl.sum(ps[:, None] * dmix_t, 0).to(like_ptr.dtype.element_ty), mask=tail_ok)


@triton.jit
def _wsum_bwd_ht_kernel(table_ptr, grad_table_ptr, like_ptr, logit_ptr, dmix_table_ptr, y_ptr, dl_ptr, S, K, R, D,
                        BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr,
                        STAGES: tl.constexpr):
    """``_wsum_bwd_kernel`` for one row per program, the row as HEAD + TAIL lanes: the K mixes'
    gradients held in registers take 1152 lanes each instead of 2048. STAGES as in the forward."""
    row = tl.program_id(0).to(tl.int64)
    p, ks, ss = _row_probs(logit_ptr, row, S, K, R, BLOCK_K, BLOCK_S)
    k_ok = ks < K
    head, head_ok, tail, tail_ok = _lanes(row, 0, D, D, HEAD, TAIL)
    dmix_ptr = tl.load(dmix_table_ptr + ks, mask=k_ok, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty))
    dmix_h = tl.load(dmix_ptr[:, None] + head[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32)
    dmix_t = tl.load(dmix_ptr[:, None] + tail[None, :], mask=k_ok[:, None] & tail_ok[None, :],
                     other=0.0).to(tl.float32)
    y = tl.load(y_ptr + ks * R + row, mask=k_ok, other=0.0)
    if STAGES == 0:
        h_next, t_next = _source_row(table_ptr, 0, like_ptr, head, head_ok, tail, tail_ok)
        for s in range(0, S):  # the next source's row in flight while this one is used
            h, t, h_next, t_next = _advance(table_ptr, s, S, like_ptr, head, head_ok, tail, tail_ok, h_next, t_next)
            _wsum_bwd_source(s, h, t, p, ss, ks, k_ok, dmix_h, dmix_t, y, dl_ptr, grad_table_ptr, like_ptr, S, R,
                             head, tail, tail_ok)
    else:
        for s in tl.range(0, S, num_stages=STAGES):
            h, t = _source_row(table_ptr, s, like_ptr, head, head_ok, tail, tail_ok)
            h, t = h.to(tl.float32), t.to(tl.float32)
            _wsum_bwd_source(s, h, t, p, ss, ks, k_ok, dmix_h, dmix_t, y, dl_ptr, grad_table_ptr, like_ptr, S, R,
                             head, tail, tail_ok)


def _blocks(logits, d, rows_per_program):
    k, s, _ = logits.shape
    return dict(BLOCK_K=triton.next_power_of_2(k), BLOCK_S=triton.next_power_of_2(s), BLOCK_R=rows_per_program,
                BLOCK_D=triton.next_power_of_2(d))


def wsum_forward(sources, logits, warps, rows_per_program=1, per_query=False, head_tail=False, stages=0):
    k, s, r = logits.shape
    d = sources[0].shape[-1]
    mixes = [torch.empty_like(sources[0]) for _ in range(k)]
    lse = torch.empty((k, r), dtype=torch.float32, device=logits.device)
    if head_tail:  # one program per (row, query)
        head, tail = _lane_split(d)
        _wsum_fwd_query_ht_kernel[(r * k,)](
            _pointer_table(sources)[0], sources[0], logits, _pointer_table(mixes)[0], lse, s, k, r, d,
            BLOCK_S=triton.next_power_of_2(s), HEAD=head, TAIL=tail, STAGES=stages, num_warps=warps)
        return mixes, lse
    if per_query:
        _wsum_fwd_query_kernel[(r * k,)](
            _pointer_table(sources)[0], sources[0], logits, _pointer_table(mixes)[0], lse, s, k, r, d,
            BLOCK_S=triton.next_power_of_2(s), BLOCK_D=triton.next_power_of_2(d), num_warps=warps)
        return mixes, lse
    _wsum_fwd_kernel[(triton.cdiv(r, rows_per_program),)](
        _pointer_table(sources)[0], sources[0], logits, _pointer_table(mixes)[0], lse, s, k, r, d,
        **_blocks(logits, d, rows_per_program), num_warps=warps)
    return mixes, lse


def wsum_backward(sources, logits, dmixes, y, warps, rows_per_program=1, head_tail=False, stages=0):
    k, s, r = logits.shape
    d = sources[0].shape[-1]
    grads = [torch.empty_like(t) for t in sources]
    dl = torch.empty_like(logits)
    if head_tail:  # one row per program
        head, tail = _lane_split(d)
        _wsum_bwd_ht_kernel[(r,)](
            _pointer_table(sources)[0], _pointer_table(grads)[0], sources[0], logits, _pointer_table(dmixes)[0], y,
            dl, s, k, r, d, BLOCK_K=triton.next_power_of_2(k), BLOCK_S=triton.next_power_of_2(s), HEAD=head,
            TAIL=tail, STAGES=stages, num_warps=warps)
        return grads, dl
    _wsum_bwd_kernel[(triton.cdiv(r, rows_per_program),)](
        _pointer_table(sources)[0], _pointer_table(grads)[0], sources[0], logits, _pointer_table(dmixes)[0], y, dl,
        s, k, r, d, **_blocks(logits, d, rows_per_program), num_warps=warps)
    return grads, dl


def check(device: str) -> dict[str, float]:
    """Both kernels against torch on small shapes; largest error relative to the largest value."""
    gen = torch.Generator(device).manual_seed(0)
    k, s, rows, d = 3, 5, 7, 40
    sources = [torch.randn(rows, d, generator=gen, device=device) for _ in range(s)]
    logits = torch.randn(k, s, rows, generator=gen, device=device) * 3
    dmixes = [torch.randn(rows, d, generator=gen, device=device) for _ in range(k)]
    y = torch.randn(k, rows, generator=gen, device=device)
    v = torch.stack(sources)  # (S, R, D)
    p = logits.softmax(1)  # (K, S, R)
    mix_ref = torch.einsum("ksr,srd->krd", p, v)
    dm = torch.stack(dmixes)
    dl_ref = p * (torch.einsum("krd,srd->ksr", dm, v) + y[:, None, :])
    dv_ref = torch.einsum("ksr,krd->srd", p, dm)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    errors = {"mix": 0.0, "lse": 0.0, "dl": 0.0, "dv": 0.0}
    # 4 rows: the last block is partial; head and tail: d=40 is 32 + 8 (tail padded to 16)
    for rows_per_program, per_query, head_tail, stages in ((1, False, False, 0), (4, False, False, 0),
                                                           (1, True, False, 0), (1, True, True, 0), (1, True, True, 3)):
        mixes, lse = wsum_forward(sources, logits, 4, rows_per_program, per_query, head_tail, stages)
        grads, dl = wsum_backward(sources, logits, dmixes, y, 4, rows_per_program, head_tail, stages)
        for name, err in (("mix", rel(torch.stack(mixes), mix_ref)), ("lse", rel(lse, logits.logsumexp(1))),
                          ("dl", rel(dl, dl_ref)), ("dv", rel(torch.stack(grads), dv_ref))):
            errors[name] = max(errors[name], err)
    return errors


def measure(chunks: int, k: int, rows: int, d: int, warps: int, rows_per_program: int,
            per_query: bool, head_tail: bool, stages: int) -> dict[str, object]:
    gen = torch.Generator("cuda").manual_seed(0)
    pool = [torch.randn(rows, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(chunks + 1)]
    dmixes = [torch.randn(rows, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
    fwd = bwd = 0.0
    for c in range(chunks):
        sources = pool[:c + 1]
        logits = torch.randn(k, c + 1, rows, generator=gen, device="cuda") * 2
        y = torch.randn(k, rows, generator=gen, device="cuda")
        fwd += time_ms(lambda sources=sources, logits=logits:
                       wsum_forward(sources, logits, warps, rows_per_program, per_query, head_tail, stages))
        bwd += time_ms(lambda sources=sources, logits=logits, y=y:
                       wsum_backward(sources, logits, dmixes, y, warps, rows_per_program, head_tail, stages))
    gemm_fwd = gemm_bwd = 0.0
    for i, v in enumerate(pool):  # v_0 is read by all chunks, chunk i-1's summary by the chunks after it
        later = chunks - i if i else chunks
        if later <= 0:
            continue
        f = k * later
        q = torch.randn(f, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        dl = torch.randn(rows, f, generator=gen, device="cuda", dtype=torch.bfloat16)
        gemm_fwd += time_ms(lambda v=v, q=q: (v @ q.t(), v.float().pow(2).sum(-1)))
        gemm_bwd += time_ms(lambda v=v, q=q, dl=dl: (dl @ q, dl.t() @ v))
    unit = rows * d * 2 / 1e9
    reads = chunks * (chunks + 1) // 2
    return {"wsum_fwd_ms": fwd, "wsum_bwd_ms": bwd, "gemm_fwd_ms": gemm_fwd, "gemm_bwd_ms": gemm_bwd,
            "wsum_fwd_gbps": (reads + chunks * k) * unit / fwd * 1e3,
            "wsum_bwd_gbps": (2 * reads + chunks * k) * unit / bwd * 1e3}


# (forward warps, backward warps, forward split, backward split) of routekit's own weighted-sum ops
# (ROUTEKIT_DAR_WSUM); each phase varied with the other at its default
ROUTEKIT_SWEEP = [(4, 1, 1, 1), (4, 1, 2, 4), (2, 2, 2, 2), (1, 2, 4, 4), (4, 1, 4, 8), (2, 1, 4, 4)]


def fastest(runs: list[dict]) -> str:
    """ROUTEKIT_DAR_WSUM of the fastest forward with the fastest backward (each timed on its own)."""
    fwd = min(runs, key=lambda r: r["fwd_ms"])
    bwd = min(runs, key=lambda r: r["bwd_ms"])
    return f"{fwd['fwd_warps']},{bwd['bwd_warps']},{fwd['fwd_split']},{bwd['bwd_split']}"


def measure_routekit(chunks: int, k: int, rows: int, d: int, launch: list[int]) -> dict[str, object]:
    """routekit's ``dar_wsum`` and its backward (dar_stream) over the chunks, ms summed."""
    from routekit.kernels import dar_stream

    gen = torch.Generator("cuda").manual_seed(0)
    pool = [torch.randn(1, rows, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(chunks + 1)]
    dmixes = [torch.randn(1, rows, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(k)]
    fwd = bwd = 0.0
    for c in range(chunks):
        sources = pool[:c + 1]
        logits = torch.randn(c + 1, 1, rows, k, generator=gen, device="cuda") * 2
        lse = dar_stream.dar_wsum(sources, logits, launch)[1][..., 0].contiguous()  # the state's log-sum-exp
        y = torch.randn(k, 1, rows, generator=gen, device="cuda")
        fwd += time_ms(lambda sources=sources, logits=logits: dar_stream.dar_wsum(sources, logits, launch))
        bwd += time_ms(lambda sources=sources, logits=logits, lse=lse, y=y:
                       dar_stream.dar_wsum_backward(sources, logits, lse, dmixes, y, launch))
    return {"fwd_warps": launch[0], "bwd_warps": launch[1], "fwd_split": launch[2], "bwd_split": launch[3],
            "fwd_ms": fwd, "bwd_ms": bwd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="correctness on tiny shapes only (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results")
    parser.add_argument("--routekit", action="store_true",
                        help="time routekit's dar_wsum ops over ROUTEKIT_SWEEP instead (dar_stream_routekit.*)")
    parser.add_argument("--best-file", type=Path, default=None,
                        help="with --routekit: write the fastest forward and backward as a ROUTEKIT_DAR_WSUM value")
    args = parser.parse_args()
    device = device_or_exit(args.quick)
    errors = check(device)
    print(f"kernels vs torch (max error / max value): {errors}", flush=True)
    if max(errors.values()) > 1e-4:
        sys.exit(f"the probe's kernels disagree with torch ({errors}); not timing them")
    if args.quick:
        return
    if args.routekit:
        runs = []
        for w in ROUTEKIT_SWEEP:
            try:
                runs.append(measure_routekit(14, 4, 256 * 256, 1152, list(w)))
            except Exception as exc:  # a launch this GPU's Triton rejects must not lose the others
                runs.append({**dict(zip(("fwd_warps", "bwd_warps", "fwd_split", "bwd_split"), w)),
                             "status": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(runs[-1], flush=True)
        lines = ["# routekit's weighted sums (dar_stream) at DiT-XL/2 b256, by launch", "", header(machine()),
                 "14 chunks of 4 queries over 1..14 shared sources, 65536 rows, D=1152, bf16; ms summed over the "
                 "chunks (do_bench medians). Split: programs per row, each a slice of its lanes.", "",
                 "| fwd warps | bwd warps | fwd split | bwd split | fwd ms | bwd ms |", "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['fwd_warps']} | {r['bwd_warps']} | {r['fwd_split']} | {r['bwd_split']} | "
                  + (f"{r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} |" if "status" not in r else f"{r['status']} | |")
                  for r in runs]
        timed = [r for r in runs if "status" not in r]
        best = fastest(timed) if timed else None
        lines += ["", f"Fastest forward with fastest backward: `ROUTEKIT_DAR_WSUM={best}`." if best else
                  "No launch ran."]
        write("dar_stream_routekit", {"machine": machine(), "runs": runs, "fastest": best}, "\n".join(lines) + "\n",
              args.out)
        if args.best_file and best:
            args.best_file.write_text(best + "\n")
        return
    report = {"machine": machine(), "check": errors, "runs": []}
    for warps, rows_per_program, per_query, head_tail, stages in SWEEP:
        row = {"warps": warps, "rows": rows_per_program, "per_query": per_query, "head_tail": head_tail,
               "stages": stages, **measure(14, 4, 256 * 256, 1152, warps, rows_per_program, per_query, head_tail,
                                           stages)}
        print(row, flush=True)
        report["runs"].append(row)
    write("dar_stream_probe", report, markdown(report), args.out)


def markdown(report: dict) -> str:
    m, errors = report["machine"], report["check"]
    lines = ["# Streaming prefix pieces at DiT-XL/2 b256 (go/no-go for the next prefix design)", "",
             header(m),
             "14 chunks of 4 queries over 1..14 shared sources, 65536 rows, D=1152, bf16; all 14 chunks summed, ms "
             "(do_bench medians). Compare the prefix kernels in a DiT-XL/2 b256 step today: forward 20.1, backward "
             "37.2 ms (throughput_dit_dar_compile.md).", "",
             "| warps | rows | fwd per query | head + tail | stages | wsum fwd | wsum bwd | logit GEMMs fwd (stand-in) | "
             "logit GEMMs bwd (stand-in) | fwd GB/s | bwd GB/s |", "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['warps']} | {r.get('rows', 1)} | {'yes' if r.get('per_query') else 'no'} | "
              f"{'yes' if r.get('head_tail') else 'no'} | {r.get('stages', 0)} | "
              f"{r['wsum_fwd_ms']:.2f} | {r['wsum_bwd_ms']:.2f} | "
              f"{r['gemm_fwd_ms']:.2f} | {r['gemm_bwd_ms']:.2f} | {r['wsum_fwd_gbps']:.0f} | {r['wsum_bwd_gbps']:.0f} |"
              for r in report["runs"]]
    lines += ["", f"Kernels vs torch on small shapes (max error / max value): {errors}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

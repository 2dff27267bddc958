"""A two-phase chunk's shared part in Triton: K softmax-weighted sums of its sources from given logits.

With static queries each shared source's logits for every aggregation that will read it are known
when the source is made, and one GEMM gives them (``logits.source_logits``). A chunk's shared part is
then K weighted sums of its S shared sources: no RMS, no query and no query gradient per row, so the
kernels stream the sources; the logits' gradients go back to the sources and queries through that
GEMM's backward, once per source. A program holds a row, or a 1/split slice of one
(``launch.WeightedSumLaunch``), as a power-of-two head and tail of lanes (1024 + 128 at D=1152).

Each mix k comes with a (B, N, 2) state that stands in for its log-sum-exp: slot 0 holds it, slot 1 a
zero. The mix's merge (``merge``) continues from both, and in backward needs nothing written for the
mix: it hands back its own gradient g as the mix's and, through the state's gradient, its rows' g . o
and its own log-sum-exp L less the mix's l (zero where no merge reads the mix). With P = exp(logit - L)
(the source's weight within the merge), a source's gradient is sum_k P_k g_k and a logit's
P (g . v - g . o): neither the mix nor a p g tensor per merge is kept or written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from routekit.kernels.launch import DEFAULTS, WeightedSumLaunch, cdiv, lane_split
from routekit.kernels.naive import DarInputError, check_logits
from routekit.kernels.tables import contiguous, pointer_table

MIN_BLOCK_S = 16
"""The forward holds a row's (sources, mixes) logits as a tile of at least this many sources, so that every chunk of
a model up to 16 shared sources (DiT-XL/2 with chunks of 4 has 1-14) runs one compiled kernel, not one per power of
two: each compilation is a second or more of a first compiled step, the tile's padding a few masked registers."""


def _slices(d: int, split: int) -> tuple[int, int, int]:
    """(slice width, head lanes, tail lanes) for rows of d lanes cut into ``split`` slices."""
    width = cdiv(d, split)
    return width, *lane_split(width)


@triton.jit
def _lanes(row, part, W, D, HEAD: tl.constexpr, TAIL: tl.constexpr):
    """Slice ``part`` (of width W) of a row: offsets and masks as HEAD + TAIL lanes (lanes past the
    slice or past D masked off)."""
    head = tl.arange(0, HEAD)
    tail = HEAD + tl.arange(0, TAIL)
    start = part * W
    return (row * D + start + head, (head < W) & (start + head < D),
            row * D + start + tail, (tail < W) & (start + tail < D))


@triton.jit
def _source_row(table_ptr, s, like_ptr, offs_h, ok_h, offs_t, ok_t):
    src = tl.load(table_ptr + s).to(tl.pointer_type(like_ptr.dtype.element_ty))
    return tl.load(src + offs_h, mask=ok_h, other=0.0), tl.load(src + offs_t, mask=ok_t, other=0.0)


@triton.jit(do_not_specialize=["S"])  # one compilation for any number of sources
def _wsum_fwd_kernel(table_ptr, like_ptr, logit_ptr, mix_table_ptr, state_ptr, S, K, R, D, W,
                     BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr,
                     SPLIT: tl.constexpr):
    """A slice of a row per program (SPLIT programs a row): its K mixes over the S sources, the next
    source in flight."""
    pid = tl.program_id(0)
    row, part = (pid // SPLIT).to(tl.int64), pid % SPLIT
    ks = tl.arange(0, BLOCK_K)
    ss = tl.arange(0, BLOCK_S)
    k_ok = ks < K
    ok = (ss < S)[:, None] & k_ok[None, :]
    logit = tl.load(logit_ptr + (ss[:, None].to(tl.int64) * R + row) * K + ks[None, :], mask=ok,
                    other=float("-inf"))  # (S, K)
    m = tl.max(logit, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # padded queries
    p = tl.where(ok, tl.exp(logit - m[None, :]), 0.0)
    denom = tl.sum(p, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    p = p / denom[None, :]
    offs_h, ok_h, offs_t, ok_t = _lanes(row, part, W, D, HEAD, TAIL)
    acc_h = tl.zeros([BLOCK_K, HEAD], tl.float32)
    acc_t = tl.zeros([BLOCK_K, TAIL], tl.float32)
    h_next, t_next = _source_row(table_ptr, 0, like_ptr, offs_h, ok_h, offs_t, ok_t)
    for s in range(0, S):
        h = h_next.to(tl.float32)
        t = t_next.to(tl.float32)
        h_next, t_next = _source_row(table_ptr, tl.minimum(s + 1, S - 1), like_ptr, offs_h, ok_h, offs_t, ok_t)
        ps = tl.sum(tl.where(ss[:, None] == s, p, 0.0), 0)  # (K,)
        acc_h += ps[:, None] * h[None, :]
        acc_t += ps[:, None] * t[None, :]
    mix = tl.load(mix_table_ptr + ks, mask=k_ok, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty))
    tl.store(mix[:, None] + offs_h[None, :], acc_h.to(like_ptr.dtype.element_ty), mask=k_ok[:, None] & ok_h[None, :])
    tl.store(mix[:, None] + offs_t[None, :], acc_t.to(like_ptr.dtype.element_ty), mask=k_ok[:, None] & ok_t[None, :])
    first = (ks * 0 + part) == 0  # (not `& (part == 0)`: the interpreter's `&` with a scalar gives ints)
    tl.store(state_ptr + (ks * R + row) * 2, m + tl.log(denom), mask=k_ok & first)  # the state's lse slot


@triton.jit(do_not_specialize=["S"])  # one compilation for any number of sources
def _wsum_bwd_kernel(table_ptr, grad_table_ptr, like_ptr, logit_ptr, lse_ptr, dmix_table_ptr, y_ptr, dl_ptr,
                     S, K, R, D, W, BLOCK_K: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr,
                     SPLIT: tl.constexpr):
    """A slice of a row per program (SPLIT programs a row): the K mixes' gradients held, each source's
    gradient written once and its K logit gradients p (g . v + y), p = exp(logit - lse). Split, a slice
    writes its share, p (g . v over its lanes) (the first slice's with p y), to its own (S, R, K) part
    of dl_ptr, for the caller to sum."""
    pid = tl.program_id(0)
    row, part = (pid // SPLIT).to(tl.int64), pid % SPLIT
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    lse = tl.load(lse_ptr + ks * R + row, mask=k_ok, other=0.0)
    y = tl.load(y_ptr + ks * R + row, mask=k_ok & ((ks * 0 + part) == 0), other=0.0)  # the first slice's
    offs_h, ok_h, offs_t, ok_t = _lanes(row, part, W, D, HEAD, TAIL)
    dmix = tl.load(dmix_table_ptr + ks, mask=k_ok, other=0).to(tl.pointer_type(like_ptr.dtype.element_ty))
    g_h = tl.load(dmix[:, None] + offs_h[None, :], mask=k_ok[:, None] & ok_h[None, :], other=0.0).to(tl.float32)
    g_t = tl.load(dmix[:, None] + offs_t[None, :], mask=k_ok[:, None] & ok_t[None, :], other=0.0).to(tl.float32)
    h_next, t_next = _source_row(table_ptr, 0, like_ptr, offs_h, ok_h, offs_t, ok_t)
    for s in range(0, S):
        h = h_next.to(tl.float32)
        t = t_next.to(tl.float32)
        h_next, t_next = _source_row(table_ptr, tl.minimum(s + 1, S - 1), like_ptr, offs_h, ok_h, offs_t, ok_t)
        at = (s * R + row) * K + ks
        p = tl.where(k_ok, tl.exp(tl.load(logit_ptr + at, mask=k_ok, other=0.0) - lse), 0.0)
        gv = tl.sum(g_h * h[None, :], 1) + tl.sum(g_t * t[None, :], 1)
        tl.store(dl_ptr + (part * S).to(tl.int64) * R * K + at, p * (gv + y), mask=k_ok)
        out = tl.load(grad_table_ptr + s).to(tl.pointer_type(like_ptr.dtype.element_ty))
        tl.store(out + offs_h, tl.sum(p[:, None] * g_h, 0).to(like_ptr.dtype.element_ty), mask=ok_h)
        tl.store(out + offs_t, tl.sum(p[:, None] * g_t, 0).to(like_ptr.dtype.element_ty), mask=ok_t)


@torch.library.custom_op("routekit::weighted_sum", mutates_args=())
def weighted_sum_op(sources: list[Tensor], logits: Tensor, launch: list[int]) -> tuple[list[Tensor], Tensor]:
    """K mixes (in the sources' dtype) and their states (K, B, N, 2) from fp32 logits (S, B, N, K): a
    state holds the mix's log-sum-exp and a zero whose gradient brings the merge's own back (the module docstring)."""
    sources = contiguous(sources)
    like = sources[0]
    s, b, n, k = logits.shape
    d = like.shape[-1]
    mixes = [torch.empty_like(like) for _ in range(k)]
    state = torch.zeros((k, b, n, 2), dtype=torch.float32, device=like.device)
    if b * n:
        split = launch[2]
        width, head, tail = _slices(d, split)
        _wsum_fwd_kernel[(b * n * split,)](
            pointer_table(sources)[0], like, logits.contiguous(), pointer_table(mixes)[0], state, s, k, b * n, d,
            width, BLOCK_K=triton.next_power_of_2(k), BLOCK_S=max(MIN_BLOCK_S, triton.next_power_of_2(s)),
            HEAD=head, TAIL=tail,
            SPLIT=split, num_warps=launch[0],
        )  # fmt: skip
    return mixes, state


@weighted_sum_op.register_fake
def _(sources, logits, launch):
    like = sources[0]
    return [like.new_empty(like.shape) for _ in range(logits.shape[-1])], \
        like.new_empty((logits.shape[-1], *like.shape[:2], 2), dtype=torch.float32)


@torch.library.custom_op("routekit::weighted_sum_backward", mutates_args=())
def weighted_sum_backward_op(sources: list[Tensor], logits: Tensor, lse: Tensor, grad_mixes: list[Tensor], y: Tensor,
                             launch: list[int]) -> tuple[list[Tensor], Tensor]:
    """(gradient of each source along the weights, gradient of the logits (S, B, N, K)), for mixes'
    gradients g_k weighted by exp(logit - lse_k) and row factors y (both (K, B, N))."""
    sources = contiguous(sources)
    like = sources[0]
    s, b, n, k = logits.shape
    d = like.shape[-1]
    grads = [torch.empty_like(t) for t in sources]
    split = launch[3]
    dlogits = logits.new_empty((split, *logits.shape) if split > 1 else logits.shape)  # split: a share a slice
    grad_mixes = [g.to(like.dtype).contiguous() for g in grad_mixes]
    if b * n:
        width, head, tail = _slices(d, split)
        _wsum_bwd_kernel[(b * n * split,)](
            pointer_table(sources)[0], pointer_table(grads)[0], like, logits.contiguous(), lse.contiguous(),
            pointer_table(grad_mixes)[0], y.contiguous(), dlogits, s, k, b * n, d, width,
            BLOCK_K=triton.next_power_of_2(k), HEAD=head, TAIL=tail, SPLIT=split, num_warps=launch[1],
        )  # fmt: skip
    else:
        dlogits.zero_()
    return grads, dlogits if split == 1 else dlogits.sum(0)


@weighted_sum_backward_op.register_fake
def _(sources, logits, lse, grad_mixes, y, launch):
    return [t.new_empty(t.shape) for t in sources], logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output) -> None:
    sources, logits, launch = inputs
    ctx.save_for_backward(logits, output[1], *sources)
    ctx.launch = launch


def _backward(ctx, grad_mixes, grad_state):
    logits, state, *sources = ctx.saved_tensors
    # a mix no merge read has a zero gradient and a zero slot: its weights stay this sum's softmax, finite
    grad_mixes = [torch.zeros_like(sources[0]) if g is None else g for g in grad_mixes]
    if grad_state is None:
        grad_state = torch.zeros_like(state)
    lse = state[..., 0] + grad_state[..., 1]  # each merge's own log-sum-exp
    grads, dlogits = weighted_sum_backward_op(sources, logits, lse, grad_mixes, -grad_state[..., 0], ctx.launch)
    return grads, dlogits, None


weighted_sum_op.register_autograd(_backward, setup_context=_setup_context)


def weighted_sum_triton(sources: list[Tensor], logits: Tensor, launch: WeightedSumLaunch | None = None,
                        ) -> tuple[list[Tensor], Tensor]:
    """``naive.weighted_sum``'s contract, with (K, B, N, 2) states in place of the log-sum-exps, for merges
    by the Triton aggregation (the backward pair above). ``launch`` overrides ``DEFAULTS["weighted_sum"]``."""
    sources = list(sources)
    check_logits(len(sources), *sources[0].shape[:2], logits)
    if logits.dtype != torch.float32:
        raise DarInputError(f"logits must be fp32 for the Triton kernel, got {logits.dtype}")
    return weighted_sum_op(sources, logits, (launch or DEFAULTS["weighted_sum"]).as_list())

"""Bidirectional WKV (Vision-RWKV's Bi-WKV) three ways that agree: reference, chunked, matmul.

Per channel c, with a decay w_c >= 0 per token of distance and a bonus u_c for the token itself:

    out_t = sum_i a_ti v_i / sum_i a_ti,   a_ti = exp(k_i - (|t - i| - 1) w)  (i != t),   a_tt = exp(u + k_t)

This is a softmax over i with a per-channel Toeplitz bias, which is how the reference computes it.
The fast forms use that exp factorises: a_ti = K(t - i) exp(k_i), with the kernel K the same for
every sample. All three take w, u (C,) and k, v (B, N, C) and return (B, N, C) in v's dtype.

Numerical stability: no term ever exceeds 1 (keys are taken relative to a maximum, and relu(u)
is folded into the kernel), so nothing overflows; what remains is underflow of a query's largest
term below about exp(-80) (fp32 and bf16 share that exponent range). The reference subtracts the
exact per-query maximum (a softmax) and never underflows. The chunked form subtracts per-chunk
maxima: only the spread of keys inside one chunk plus the decay across one chunk must stay below
about 80, whatever the spread over the sequence. The matmul form subtracts one maximum per
sequence: u + k_t - max_i k_i must stay above about -80 for every t. Both bounds are far beyond the
keys of a normalised layer (decay across a 64-token chunk is at most 14 at initialisation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _distances(n: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(n, device=device)
    return (pos[:, None] - pos[None, :]).abs()  # (t, i)


def wkv_reference(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The definition as a softmax over an (N, N) bias per channel: O(B·N²·C) memory, tests only."""
    with torch.autocast(k.device.type, enabled=False):
        w, u, k, v = w.float(), u.float(), k.float(), v.float()
        dist = _distances(k.shape[1], k.device)[..., None]  # (t, i, 1)
        bias = torch.where(dist == 0, u, -(dist - 1) * w)  # (t, i, C)
        weights = torch.softmax(bias + k[:, None], dim=2)  # (B, t, i, C), normalised over i
        return (weights * v[:, None]).sum(2).to(v.dtype)


def _kernel(w: torch.Tensor, u: torch.Tensor, n: int) -> torch.Tensor:
    """K(t - i) for t, i < n as a (C, n, n) matrix, scaled by exp(-relu(u)) so every entry is <= 1."""
    dist = _distances(n, w.device)
    log_k = torch.where(dist == 0, u[:, None, None], -(dist - 1).clamp(min=0) * w[:, None, None])
    return torch.exp(log_k - u.relu()[:, None, None])


def wkv_chunked(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunk: int = 64) -> torch.Tensor:
    """CPU path: blockwise kernel sums in fp32, memory O(B·N·C + C·chunk²), no loop over tokens.

    Inside a chunk the kernel is one (chunk × chunk) matrix per channel. Between chunks the
    exponential decay factorises: chunk j reaches a later chunk as its right-edge summary
    sum_i exp(-(end_j - i) w) z_i, decayed by exp(-chunk·w) per whole chunk in between, and
    symmetrically for earlier chunks; those few chunk-to-chunk weights form a small matrix too.
    Each chunk's keys are taken relative to the chunk's own maximum, and each query chunk adds
    its sources relative to the largest of them, so the spread of k across chunks does not matter.
    """
    dtype = v.dtype
    with torch.autocast(k.device.type, enabled=False):
        w, u, k, v = w.float(), u.float(), k.float(), v.float()
        batch, n, c = k.shape
        size = min(chunk, n)
        chunks = -(-n // size)
        pad = chunks * size - n  # padding keys are -inf: they add nothing; outputs there are cut off
        k = F.pad(k, (0, 0, 0, pad), value=float("-inf")).view(batch, chunks, size, c)
        v = F.pad(v, (0, 0, 0, pad)).view(batch, chunks, size, c)
        top = k.amax(dim=2).detach()  # (B, chunks, C): largest key of each chunk
        ek = torch.exp(k - top[:, :, None])
        z = torch.stack([ek * v, ek], dim=-1)  # (B, chunks, size, C, 2): numerator and denominator
        out = torch.einsum("cti,bjicz->bjtcz", _kernel(w, u, size), z)  # in units of exp(top)
        if chunks > 1:
            pos = torch.arange(size, device=k.device, dtype=w.dtype)[:, None]
            from_start = torch.exp(-pos * w)  # (chunk, C): decay from a chunk's first token to pos
            to_end = torch.exp(-(size - 1 - pos) * w)  # decay from pos to the chunk's last token
            idx = torch.arange(chunks, device=k.device)
            gaps = (idx[:, None] - idx[None, :] - 1)[..., None]  # whole chunks strictly between a and j
            log_carry = (-(gaps.clamp(min=0) * size) * w).masked_fill(gaps < 0, float("-inf"))  # (a, j, C)
            log_before = log_carry + top[:, None]  # (B, a, j, C): chunk j < a as seen from chunk a
            log_after = log_carry.transpose(0, 1) + top[:, None]  # chunk j > a
            ref = torch.maximum(top, torch.maximum(log_before.amax(2), log_after.amax(2))).detach()
            right = torch.einsum("ic,bjicz->bjcz", to_end, z)  # chunk summaries seen from their end
            left = torch.einsum("ic,bjicz->bjcz", from_start, z)  # ... and from their start
            before = torch.einsum("bajc,bjcz->bacz", torch.exp(log_before - ref[:, :, None]), right)
            after = torch.einsum("bajc,bjcz->bacz", torch.exp(log_after - ref[:, :, None]), left)
            scale = torch.exp(-u.relu())[:, None]  # the kernel's exp(-relu(u)) off the diagonal
            outside = from_start[:, :, None] * before[:, :, None] + to_end[:, :, None] * after[:, :, None]
            out = out * torch.exp(top - ref)[:, :, None, :, None] + scale * outside
        out = out.reshape(batch, chunks * size, c, 2)[:, :n]  # drop padding before dividing
        return (out[..., 0] / out[..., 1]).to(dtype)


def wkv_matmul(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """GPU path: the whole (N × N) kernel per channel as one batched matmul in k's dtype.

    Under bf16 autocast this runs on tensor cores: at N=256, C=768, batch 256 it is about 50 GFLOP
    per call and a (C, N, N) kernel of 100 MB; numerator and denominator then carry bf16 rounding.
    """
    dtype = k.dtype
    batch, n, c = k.shape
    ek = torch.exp(k.float() - k.float().amax(dim=1, keepdim=True).detach())  # max over tokens
    z = torch.cat([ek * v.float(), ek], dim=0).permute(2, 1, 0).to(dtype)  # (C, N, 2B)
    out = torch.bmm(_kernel(w.float(), u.float(), n).to(dtype), z).float().permute(2, 1, 0)
    return (out[:batch] / out[batch:]).to(v.dtype)

"""Mamba-2's SSD scan two ways that agree: a token loop (the oracle) and the chunked form.

Per head, with a scalar decay exp(dt_t·A) (A < 0) shared by the head's whole state:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ      (state: headdim × d_state)
    y_t = h_t C_t

Shapes: x (B, L, H, P), dt (B, L, H) already positive, A (H,), B and C (B, L, G, N) with the H
heads split evenly over G groups. Returns y (B, L, H, P) in x's dtype, without Mamba's D·x skip.
The signature matches mamba_ssm's `mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor) -> torch.Tensor:
    """The recurrence itself, one token at a time in fp32: slow, for tests on small sizes."""
    dtype = x.dtype
    with torch.autocast(x.device.type, enabled=False):
        x, dt, A, B, C = (a.float() for a in (x, dt, A, B, C))
        heads = x.shape[2]
        B, C = (m.repeat_interleave(heads // m.shape[2], dim=2) for m in (B, C))  # (B, L, H, N)
        state = x.new_zeros(x.shape[0], heads, x.shape[3], B.shape[-1])
        ys = []
        for t in range(x.shape[1]):
            decay = torch.exp(dt[:, t] * A)[..., None, None]
            state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
            ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
        return torch.stack(ys, dim=1).to(dtype)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the diagonal.

    Summing masked copies (instead of subtracting two cumulative sums) keeps it exact for long decays.
    """
    n = a.shape[-1]
    strict = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., :, None].expand(*a.shape, n).masked_fill(~strict, 0).cumsum(dim=-2)
    return sums.masked_fill(~torch.ones_like(strict).tril(), float("-inf"))


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk: int = 64) -> torch.Tensor:
    """Pure-PyTorch SSD in fp32: quadratic (attention-like) form inside chunks, states between them.

    Memory O(B·L·H·(P + N) + B·L·H·chunk); the only sequential part, passing states from chunk to
    chunk, is itself a small (chunks × chunks) decay matrix, so there is no Python loop at all.
    """
    dtype = x.dtype
    with torch.autocast(x.device.type, enabled=False):
        x, dt, A, B, C = (a.float() for a in (x, dt, A, B, C))
        batch, n, heads, _ = x.shape
        size = min(chunk, n)
        chunks = -(-n // size)
        pad = chunks * size - n  # padding has dt = 0: no input and no decay, and is cut off at the end

        def split(m: torch.Tensor) -> torch.Tensor:  # (B, L, ...) -> (B, chunks, size, ...)
            m = F.pad(m, (0, 0) * (m.dim() - 2) + (0, pad))
            return m.view(batch, chunks, size, *m.shape[2:])

        B, C = (split(m.repeat_interleave(heads // m.shape[2], dim=2)) for m in (B, C))  # (B, c, l, H, N)
        xdt = split(x * dt[..., None])  # (B, c, l, H, P)
        log_decay = split(dt * A).permute(0, 1, 3, 2)  # (B, c, H, l), <= 0
        cum = log_decay.cumsum(dim=-1)

        # 1. Inside each chunk: y_t = sum_{s <= t} (C_t · B_s) exp(a_{s+1} + ... + a_t) dt_s x_s.
        scores = torch.einsum("bclhn,bcshn->bchls", C, B) * torch.exp(_segsum(log_decay))
        y = torch.einsum("bchls,bcshp->bclhp", scores, xdt)
        # 2. The state each chunk leaves behind from its own tokens.
        to_end = torch.exp(cum[..., -1:] - cum)  # (B, c, H, l)
        states = torch.einsum("bclhn,bchl,bclhp->bchpn", B, to_end, xdt)
        # 3. The state entering each chunk: earlier chunks' states, decayed over the chunks between.
        between = torch.exp(_segsum(F.pad(cum[..., -1], (0, 0, 1, 0)).transpose(1, 2)))  # (B, H, c+1, c+1)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        entering = torch.einsum("bhzc,bchpn->bzhpn", between, states)[:, :-1]
        # 4. What the entering state contributes to each token of the chunk.
        y = y + torch.einsum("bclhn,bchpn,bchl->bclhp", C, entering, torch.exp(cum))
        return y.reshape(batch, chunks * size, heads, -1)[:, :n].to(dtype)

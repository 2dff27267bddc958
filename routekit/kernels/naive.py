"""Plain PyTorch references for every kernel entry point, and the contract they all share.

Each function here is the obvious implementation (stack, normalise, softmax, weighted sum, all in fp32)
of one public entry point of ``routekit.kernels``, with its signature less ``kernel``: the path that
runs where a kernel cannot (``kernel="torch"``, CPU, no triton), and the oracle the tests hold each
kernel to. ``check_dar_inputs`` and ``check_logits`` are the contract: every implementation refuses
the same inputs with the same message.

DAR (Diffusion-Adaptive Routing) replaces the residual sum by a softmax-weighted mix of every earlier
source: h = sum_s softmax_s(q . RMSNorm(v_s) / sqrt(D)) v_s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from routekit.errors import InputError

Sources = Tensor | Sequence[Tensor]


class DarInputError(InputError):
    """Sources, query, logits or a prefix of a DAR op that no implementation can use."""


def check_dar_inputs(sources: Sources, query: Tensor) -> tuple[int, int, int, int]:
    """Validate ``sources`` and ``query``; return (S, B, N, D).

    Shared by every implementation so that all of them reject the same inputs with the
    same message.
    """
    if isinstance(sources, Tensor):
        if sources.dim() != 4:
            raise DarInputError(f"stacked sources must be 4-D (S, B, N, D), got shape {tuple(sources.shape)}")
        shape, device = tuple(sources.shape), sources.device
    else:
        sources = list(sources)
        if not sources:
            raise DarInputError("sources is empty: DAR needs at least one source")
        first = sources[0]
        # one pass without enumerate or any(): torch.compile traces this at every aggregation of a model
        for src in sources:
            if not isinstance(src, Tensor) or src.dim() != 3 or src.shape != first.shape or src.dtype != first.dtype \
                    or src.device != first.device:
                _refuse_source(sources)
        shape, device = (len(sources), *first.shape), first.device
    s, b, n, d = shape
    if s == 0 or d == 0:
        raise DarInputError(f"sources (S, B, N, D) = {shape} must have S >= 1 and D >= 1")
    if not isinstance(query, Tensor) or query.dim() == 0 or query.dim() > 3 or query.shape[-1] != d:
        got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise DarInputError(
            f"query must end in D={d} and broadcast to (B, N, D)=({b}, {n}, {d}), e.g. ({d},), "
            f"({b}, 1, {d}) or ({b}, {n}, {d}); got {got}"
        )
    lead = query.shape[:-1]
    if (len(lead) == 2 and lead[0] not in (1, b)) or (lead and lead[-1] not in (1, n)):
        raise DarInputError(
            f"query of shape {tuple(query.shape)} does not broadcast to (B, N, D)=({b}, {n}, {d})"
        )
    if query.device != device:
        raise DarInputError(f"query is on {query.device} but the sources are on {device}")
    return s, b, n, d


def _refuse_source(sources: list) -> None:
    """Raise for the first source that is not a (B, N, D) tensor like source 0."""
    first = sources[0]
    for i, src in enumerate(sources):
        if not isinstance(src, Tensor) or src.dim() != 3:
            got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
            raise DarInputError(f"source {i} must be a 3-D (B, N, D) tensor, got {got}")
        if src.shape != first.shape or src.dtype != first.dtype or src.device != first.device:
            raise DarInputError(
                f"source {i} is {tuple(src.shape)} {src.dtype} on {src.device}, but source 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: all sources must match"
            )


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math runs in: fp32, or fp64 for fp64 sources (whose model is kept in fp64 on purpose)."""
    return torch.promote_types(dtype, torch.float32)


def _keys(values: Tensor, eps: float) -> Tensor:
    """RMSNorm(v) over the last dim, without a weight."""
    return values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)


def _logits(values: Tensor, query: Tensor, eps: float) -> Tensor:
    """q . RMSNorm(v) / sqrt(D) over the last dim: values (..., S, B, N, D) in fp32 (or fp64)."""
    return (_keys(values, eps) * query.to(values.dtype)).sum(-1) / math.sqrt(values.shape[-1])


def _stacked(sources: Sources) -> Tensor:
    return sources if isinstance(sources, Tensor) else torch.stack(list(sources))


def aggregate(sources: Sources, query: Tensor, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
              prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Softmax-over-sources mix of ``sources`` keyed by their RMS-normalised values.

    ``sources`` is a stacked (S, B, N, D) tensor or a sequence of S (B, N, D) tensors and ``query``
    broadcasts to (B, N, D). Math is fp32 (fp64 for fp64 sources); the result has ``out_dtype``, by default
    the sources' dtype.
    ``prefix``: one (mix, lse) pair of ``weighted_sum``, which joins the softmax as one more source of
    value ``mix`` and logit ``lse``: the result is then the mix over its sources and these together.
    """
    check_dar_inputs(sources, query)
    stacked = _stacked(sources)
    values = stacked.to(_wide(stacked.dtype))
    logits = _logits(values, query, eps)
    if prefix is not None:
        mix, lse = prefix
        if lse.shape != mix.shape[:-1]:
            raise DarInputError(f"prefix lse of shape {tuple(lse.shape)} must be (B, N) = {tuple(mix.shape[:-1])}; a "
                                "Triton weighted sum's (B, N, 2) state merges only with kernel='triton'")
        values = torch.cat([mix.to(values.dtype)[None], values])
        logits = torch.cat([lse.to(values.dtype)[None], logits])
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * values).sum(0).to(out_dtype or stacked.dtype)


def merge_with_stats(sources: Sources, query: Tensor, eps: float, *, prefix: tuple[Tensor, Tensor],
                     norm_eps: float) -> tuple[Tensor, Tensor]:
    """``aggregate(sources, query, eps, prefix=prefix)`` (in the sources' dtype) and its rows' LayerNorm
    statistics as (B, N, 2) fp32: the mean and 1/sqrt(var + norm_eps) of each row as returned (rounded)."""
    mix = aggregate(sources, query, eps, prefix=prefix)
    var, mean = torch.var_mean(mix.to(_wide(mix.dtype)), -1, correction=0)
    return mix, torch.stack([mean, torch.rsqrt(var + norm_eps)], -1)


def check_logits(s: int, b: int, n: int, logits: Tensor) -> None:
    """Refuse logits that are not (S, B, N, K) for S sources of (B, N, D)."""
    if logits.dim() != 4 or tuple(logits.shape[:3]) != (s, b, n):
        raise DarInputError(f"logits must be (S, B, N, K) = ({s}, {b}, {n}, K) for these sources, "
                            f"got {tuple(logits.shape)}")


def weighted_sum(sources: Sources, logits: Tensor) -> tuple[list[Tensor], Tensor]:
    """A two-phase chunk's shared part: the K mixes sum_s softmax_s(logits) v_s over S sources (in their
    dtype) and their log-sum-exps (K, B, N), from given fp32 ``logits`` (S, B, N, K) (``source_logits``
    of each source for the chunk's K queries). Mix k continues in ``aggregate(own_sources, query_k,
    prefix=(mixes[k], lse[k]))``, which then equals the aggregation over all the sources at once."""
    stacked = _stacked(sources)
    check_logits(stacked.shape[0], *stacked.shape[1:3], logits)
    wide = _wide(stacked.dtype)
    weights = torch.softmax(logits.to(wide), dim=0)
    mixes = torch.einsum("sbnk,sbnd->kbnd", weights, stacked.to(wide)).to(stacked.dtype)
    return list(mixes.unbind(0)), torch.logsumexp(logits.to(wide), dim=0).permute(2, 0, 1)


def source_logits(v: Tensor, queries: Tensor, temb: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """One source's logits for F queries at once, as ``aggregate`` computes them: (q_f + e) . RMSNorm(v)
    / sqrt(D), an fp32 (B, N, F) tensor (float64 for a float64 source). ``queries`` (F, D); ``temb`` the
    timestep embedding e(t), (B, 1, D), or None. Computed outside any autocast region."""
    with torch.autocast(v.device.type, enabled=False):
        wide = torch.promote_types(v.dtype, torch.float32)
        keys = _keys(v.to(wide), eps)
        z = keys @ queries.to(wide).t()
        if temb is not None:
            z = z + (keys * temb.to(wide)).sum(-1, keepdim=True)
        return z / math.sqrt(v.shape[-1])

"""Helpers shared by the backbone tests: tiny models, their inputs, and weights moved off their init."""

from __future__ import annotations

import torch

from backbones import dit, mamba, rwkv

MAMBA_MIXER = dict(d_state=8, headdim=16)


def small_rwkv(**overrides) -> rwkv.DiffusionRWKV:
    """A tiny Diffusion-RWKV (grid 8×8, width 32) that runs in milliseconds on CPU."""
    return rwkv.build("S/2", **{"depth": 2, "hidden": 32, "input_size": 16, "num_classes": 10, **overrides})


def small_mamba(**overrides) -> mamba.DiM:
    """A tiny DiM (grid 8×8, width 32, 4 heads) that runs in milliseconds on CPU."""
    return mamba.build("S/2", **{"depth": 2, "hidden": 32, "input_size": 16, "num_classes": 10,
                                 **MAMBA_MIXER, **overrides})


def inputs(model, batch: int = 2, seed: int = 0):
    """Seeded (x, t, y) for any backbone (they share DiT's example_inputs)."""
    return dit.example_inputs(model, batch, generator=torch.Generator().manual_seed(seed))


def perturb(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """Move every parameter off its init, so zero gates no longer hide the sublayers."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def assert_same_values_and_grads(fn, oracle, args, atol=1e-5, rtol=1e-4):
    """A fast op equals its reference in value and in the gradients of a random projection.

    ``atol`` scales with the largest magnitude of the expected tensor: a gradient such as a
    per-channel decay's sums hundreds of terms, and two fp32 summation orders differ by that
    sum's rounding, not by a fixed amount."""
    def close(got, want):
        torch.testing.assert_close(got, want, atol=atol * max(1.0, want.abs().max().item()), rtol=rtol)

    out, expected = fn(*args), oracle(*args)
    close(out, expected)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((out * weight).sum(), args)
    expected_grads = torch.autograd.grad((expected * weight).sum(), args)
    for g, e in zip(grads, expected_grads):
        close(g, e)

"""Deterministic ODE samplers: EDM's Heun (2nd order) and Euler for rectified flow, with classifier-free
guidance. Initial noise comes from a caller's CPU generator, so samples never touch the training RNG and
the same seed gives the same images on every device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recipes.objectives import EDM, Net, Objective, RectifiedFlow, edm_sigmas, rf_times

Field = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, t as a scalar tensor) -> estimate


def guided(estimate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], labels: torch.Tensor,
           guidance: float, null_class: int) -> Field:
    """Classifier-free guidance: uncond + w (cond - uncond), both halves in one batched call.
    ``guidance == 1`` is the plain conditional model and costs one call."""

    def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        if guidance == 1:
            return estimate(x, t.expand(batch), labels)
        null = torch.full_like(labels, null_class)
        both = estimate(torch.cat([x, x]), t.expand(2 * batch), torch.cat([labels, null]))
        cond, uncond = both.chunk(2)
        return uncond + guidance * (cond - uncond)

    return field


def heun_edm(edm: EDM, denoiser: Field, noise: torch.Tensor, steps: int) -> torch.Tensor:
    """EDM Algorithm 1 (deterministic Heun): 2 * steps - 1 network calls."""
    sigmas = edm_sigmas(edm.config, steps, noise.device)
    x = noise * sigmas[0]
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        slope = (x - denoiser(x, sigma)) / sigma
        x_next = x + (sigma_next - sigma) * slope
        if sigma_next > 0:  # second-order correction everywhere except the last step to sigma = 0
            slope_next = (x_next - denoiser(x_next, sigma_next)) / sigma_next
            x_next = x + (sigma_next - sigma) * (slope + slope_next) / 2
        x = x_next
    return x


def euler_rf(velocity: Field, noise: torch.Tensor, steps: int) -> torch.Tensor:
    """Euler integration of dx/dt = v from t = 1 (noise) to t = 0 (data): ``steps`` network calls."""
    times = rf_times(steps, noise.device)
    x = noise
    for t, t_next in zip(times[:-1], times[1:]):
        x = x + (t_next - t) * velocity(x, t)
    return x


@torch.no_grad()
def sample(objective: Objective, net: Net, labels: torch.Tensor, shape: tuple[int, ...], *, steps: int,
           guidance: float, null_class: int, generator: torch.Generator) -> torch.Tensor:
    """Images (len(labels), *shape) in roughly [-1, 1] from net; put net in eval mode first."""
    noise = torch.randn(len(labels), *shape, generator=generator).to(labels.device)
    if isinstance(objective, EDM):
        field = guided(lambda x, s, y: objective.denoise(net, x, s, y), labels, guidance, null_class)
        return heun_edm(objective, field, noise, steps)
    if isinstance(objective, RectifiedFlow):
        field = guided(lambda x, t, y: objective.velocity(net, x, t, y), labels, guidance, null_class)
        return euler_rf(field, noise, steps)
    raise TypeError(f"no sampler for {type(objective).__name__}")

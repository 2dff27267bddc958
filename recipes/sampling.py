"""Deterministic ODE samplers: EDM's Heun (2nd order) and Euler for rectified flow, with classifier-free
guidance or SPRINT's path-drop guidance. Initial noise comes from a caller's CPU generator, so samples never
touch the training RNG and the same seed gives the same images on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal

import torch
from torch import nn

import routekit as rk
from recipes.objectives import EDM, Net, Objective, RectifiedFlow, edm_sigmas, rf_times
from routekit.flops import flop_counter_mode

Field = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, t as a scalar tensor) -> estimate
Estimate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, t per sample, labels)
GuidanceKind = Literal["cfg", "pdg"]


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


def path_drop_guided(estimate: Estimate, labels: torch.Tensor, guidance: float, null_class: int,
                     weak: Callable[[], AbstractContextManager]) -> Field:
    """Path-Drop Guidance (SPRINT): weak + w (cond - weak), where cond is the full model given the labels
    and weak the same model given the null class inside ``weak()`` (``routekit.path_drop``: the fused
    routes' blocks skipped). The halves run as two calls, since they are different programs; the weak one
    is cheaper than CFG's unconditional half. ``guidance == 1`` is the plain conditional model."""

    def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        cond = estimate(x, t.expand(batch), labels)
        if guidance == 1:
            return cond
        with weak():
            uncond = estimate(x, t.expand(batch), torch.full_like(labels, null_class))
        return uncond + guidance * (cond - uncond)

    return field


def _field(objective: Objective, net: Net, labels: torch.Tensor, guidance: float, null_class: int,
           kind: GuidanceKind) -> Field:
    """The guided estimate the objective's sampler integrates: a denoiser for EDM, a velocity for RF."""
    if isinstance(objective, EDM):
        estimate = lambda x, s, y: objective.denoise(net, x, s, y)
    elif isinstance(objective, RectifiedFlow):
        estimate = lambda x, t, y: objective.velocity(net, x, t, y)
    else:
        raise TypeError(f"no sampler for {type(objective).__name__}")
    if kind == "pdg":
        return path_drop_guided(estimate, labels, guidance, null_class, lambda: rk.path_drop(net))
    if kind == "cfg":
        return guided(estimate, labels, guidance, null_class)
    raise ValueError(f"guidance kind is 'cfg' or 'pdg', got {kind!r}")


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
           guidance: float, null_class: int, generator: torch.Generator,
           guidance_kind: GuidanceKind = "cfg") -> torch.Tensor:
    """Images (len(labels), *shape) in roughly [-1, 1] from net; put net in eval mode first.
    ``guidance_kind="pdg"`` needs a net routed with a fused route (``routekit.path_drop`` runs it)."""
    noise = torch.randn(len(labels), *shape, generator=generator).to(labels.device)
    field = _field(objective, net, labels, guidance, null_class, guidance_kind)
    if isinstance(objective, EDM):
        return heun_edm(objective, field, noise, steps)
    return euler_rf(field, noise, steps)


def network_calls(objective: Objective, steps: int) -> int:
    """Guided network evaluations drawing one image takes: EDM's Heun sampler ``2 * steps - 1``, rectified
    flow's Euler sampler ``steps``. Times ``guided_eval_flops``, what sampling one image costs."""
    return 2 * steps - 1 if isinstance(objective, EDM) else steps


@torch.no_grad()
def guided_eval_flops(objective: Objective, net: nn.Module, shape: tuple[int, ...], *, guidance: float,
                      null_class: int, guidance_kind: GuidanceKind = "cfg", device: torch.device | str = "cpu") -> int:
    """FLOPs of one guided network evaluation for one image: what a sampling step costs per image (EDM's Heun
    step makes two such evaluations, but its last, Euler's step one). Both halves of the guidance are counted:
    CFG's batched pair of full passes, or PDG's full pass and its cheaper path-dropped one. Counted by torch's
    FLOP counter on ``net`` as it is (put it in eval mode first); the count does not depend on the weights."""
    labels = torch.zeros(1, dtype=torch.long, device=device)
    field = _field(objective, net, labels, guidance, null_class, guidance_kind)
    x = torch.zeros(1, *shape, device=device)
    t = torch.ones((), device=device)  # sigma 1 for EDM, t 1 for RF: a valid noise level for both
    field(x, t)  # a program's first call may build it (path_drop's does, running the model): not a step's cost
    with flop_counter_mode() as counter:
        field(x, t)
    return counter.get_total_flops()

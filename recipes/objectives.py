"""Training objectives: EDM (Karras et al. 2022, as TREAD trains) and rectified flow (SiT's linear path).

Both call the network as ``net(x, t, y)`` with t a float per sample, which is the backbones' interface;
the backbones scale t themselves. Randomness comes from the global torch RNG, whose state checkpoints
carry, so a resumed run draws the same noise as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recipes.config import EDMConfig, RFConfig

Net = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, ...) so it broadcasts against a batch shaped like ``like``."""
    return values.reshape(-1, *([1] * (like.dim() - 1)))


class EDM:
    """EDM preconditioning D(x; sigma) = c_skip x + c_out F(c_in x, c_noise, y).

    The loss is EDM's lambda(sigma) ||D - x||^2 written in F's terms: lambda * c_out^2 = 1, so it equals
    ||F - (x - c_skip x_noisy) / c_out||^2, which keeps bf16 activations well scaled at every sigma.
    """

    def __init__(self, config: EDMConfig):
        self.config = config

    def preconditioning(self, sigma: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(c_skip, c_out, c_in, c_noise) for noise levels sigma (any shape)."""
        sd = self.config.sigma_data
        total = sigma**2 + sd**2
        return sd**2 / total, sigma * sd / total.sqrt(), 1 / total.sqrt(), sigma.log() / 4

    def weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """EDM's loss weight lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2."""
        sd = self.config.sigma_data
        return (sigma**2 + sd**2) / (sigma * sd) ** 2

    def sample_sigma(self, batch: int, device: torch.device) -> torch.Tensor:
        """Training noise levels: ln sigma ~ N(P_mean, P_std^2)."""
        return (self.config.P_mean + self.config.P_std * torch.randn(batch, device=device)).exp()

    def denoise(self, net: Net, x: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """D(x; sigma), the denoised estimate, in float32."""
        c_skip, c_out, c_in, c_noise = self.preconditioning(sigma)
        out = net(x * _per_sample(c_in, x), c_noise, y).float()
        return _per_sample(c_skip, x) * x + _per_sample(c_out, x) * out

    def loss(self, net: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean weighted denoising error of one batch of clean images x."""
        sigma = self.sample_sigma(x.shape[0], x.device)
        noisy = x + _per_sample(sigma, x) * torch.randn_like(x)
        c_skip, c_out, c_in, c_noise = self.preconditioning(sigma)
        target = (x - _per_sample(c_skip, x) * noisy) / _per_sample(c_out, x)
        out = net(noisy * _per_sample(c_in, x), c_noise, y).float()
        return (out - target).square().mean()


class RectifiedFlow:
    """Linear interpolant x_t = (1 - t) x + t eps (t = 1 is pure noise); the network predicts the
    velocity dx_t/dt = eps - x, so sampling integrates from t = 1 to t = 0."""

    def __init__(self, config: RFConfig):
        self.config = config

    def sample_t(self, batch: int, device: torch.device) -> torch.Tensor:
        """Training times: uniform (SiT) or logit-normal (SD3), which favours the middle of the path."""
        if self.config.t_sampling == "logit_normal":
            return torch.sigmoid(torch.randn(batch, device=device))
        return torch.rand(batch, device=device)

    @staticmethod
    def interpolate(x: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = _per_sample(t, x)
        return (1 - t) * x + t * noise

    def velocity(self, net: Net, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The network's velocity estimate, in float32."""
        return net(x, t, y).float()

    def loss(self, net: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean squared velocity error of one batch of clean images x."""
        t = self.sample_t(x.shape[0], x.device)
        noise = torch.randn_like(x)
        out = self.velocity(net, self.interpolate(x, noise, t), t, y)
        return (out - (noise - x)).square().mean()


Objective = EDM | RectifiedFlow


def make_objective(config: EDMConfig | RFConfig) -> Objective:
    """The objective a config's ``objective.kind`` names."""
    return EDM(config) if config.kind == "edm" else RectifiedFlow(config)


def edm_sigmas(config: EDMConfig, steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Karras et al.'s rho-spaced noise levels, sigma_max down to sigma_min, then a final 0: (steps + 1,)."""
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    lo, hi = config.sigma_min ** (1 / config.rho), config.sigma_max ** (1 / config.rho)
    sigmas = (hi + ramp * (lo - hi)) ** config.rho
    return torch.cat([sigmas, sigmas.new_zeros(1)]).float().to(device)


def rf_times(steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform times 1 -> 0 for Euler integration: (steps + 1,)."""
    return torch.linspace(1.0, 0.0, steps + 1, device=device)


"""`routekit demo`: the whole product in about a minute on a CPU.

Inspects a small diffusion transformer (a DiT: patch embedding, adaLN-conditioned attention blocks, a linear
head), applies TREAD's default route (half the tokens skip blocks 2..8), verifies that inference is unchanged,
then times real training steps (forward, backward, AdamW), vanilla and routed in turn, and says how far the
measured speed-up can be trusted on this machine. The model lives here, so the demo needs nothing but routekit.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .flops import step_flops
from .inspection import inspect
from .model import apply
from .verify import verify

# the spread (between quartiles) of the step-by-step speed-ups above which the median says little
NOISY = 0.10


class Block(nn.Module):
    """Self-attention and an MLP, each a residual branch scaled and shifted by the conditioning (adaLN)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.modulation = nn.Linear(dim, 6 * dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        x = x + gate1 * self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class DemoDiT(nn.Module):
    """A class-conditional DiT over 32×32 latents of 4 channels, patch 2: a 16×16 grid of 256 tokens."""

    def __init__(self, dim: int = 128, depth: int = 12, heads: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(4, dim, 2, 2)
        self.pos = nn.Parameter(torch.randn(1, 256, dim) * 0.02)
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.label = nn.Embedding(classes, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, 4 * 2 * 2)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2) + self.pos  # (batch, 256, dim)
        c = self.time(t[:, None]) + self.label(y)
        for block in self.blocks:
            tokens = block(tokens, c)
        out = self.head(tokens).unflatten(1, (16, 16)).unflatten(-1, (4, 2, 2))  # (batch, 16, 16, 4, 2, 2)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(x.shape)


def example_inputs(batch: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """Latents, times in [0, 1) and class labels for `DemoDiT`."""
    return (torch.randn(batch, 4, 32, 32, generator=generator), torch.rand(batch, generator=generator),
            torch.randint(0, 10, (batch,), generator=generator))


def loss(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Rectified flow's velocity loss on every token, as TREAD trains."""
    x, t, y = inputs
    noise = torch.randn_like(x)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    return (model(x_t, t, y) - (noise - x)).pow(2).mean()


def time_steps(models: dict[str, nn.Module], inputs: tuple, steps: int) -> dict[str, list[float]]:
    """Seconds of `steps` training steps of each model, taken in turn (a step of one, then of the next), after one
    warm-up step each: whatever else the machine does falls on all of them alike."""
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in tqdm(range(steps + 1), desc="training steps", leave=False, disable=None):
        for name, model in models.items():
            model.train()
            start = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            loss(model, inputs).backward()
            optimizers[name].step()
            if step:  # the first is the warm-up
                times[name].append(time.perf_counter() - start)
    return times


def reading(vanilla: list[float], routed: list[float], limit: float) -> tuple[float, float, str]:
    """The median speed-up of the steps taken in turn, the spread between the quartiles of the step-by-step
    speed-ups (relative to the median), and what the numbers allow one to say."""
    ratios = [v / r for v, r in zip(vanilla, routed)]
    speedup = statistics.median(vanilla) / statistics.median(routed)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    spread = (q3 - q1) / statistics.median(ratios)
    if spread > NOISY:
        verdict = (f"too noisy to read: step-by-step speed-ups spread {spread:.0%} between quartiles (the machine is "
                   "busy); run again on an idle machine, or with more --steps")
    elif speedup > limit * (1 + NOISY):
        verdict = ("above the FLOP limit by more than the noise allows: this CPU's kernels do not scale with "
                   "tokens (small matrices run below peak); read the GPU results in docs/benchmarks.md")
    else:
        verdict = f"{speedup / limit:.2f} of the FLOP limit; the spread between quartiles is {spread:.0%}"
    return speedup, spread, verdict


def run_demo(steps: int = 6, batch: int = 4) -> dict:
    torch.manual_seed(0)
    model = DemoDiT()
    example = example_inputs(2)
    print("== 1. inspect the demo's DiT (what routekit finds) ==")
    print(inspect(model, example, routes="default"))
    print("\n== 2. apply TREAD's default route and verify inference is unchanged ==")
    vanilla = copy.deepcopy(model)  # apply routes the model itself: a twin without routes to time against
    routed = apply(model, routes="default", example_inputs=example)
    print(verify(routed, routed, example))
    inputs = example_inputs(batch, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    flops = {name: step_flops(m, lambda m: loss(m, inputs)) for name, m in (("vanilla", vanilla), ("routed", routed))}
    limit = flops["vanilla"] / flops["routed"]
    print(f"\n== 3. train {steps} steps each at batch {batch} on {torch.get_num_threads()} CPU threads, in turn ==")
    times = time_steps({"vanilla": vanilla, "routed": routed}, inputs, steps)
    speedup, spread, verdict = reading(times["vanilla"], times["routed"], limit)
    print(f"vanilla step {statistics.median(times['vanilla']) * 1e3:.0f} ms | routed step "
          f"{statistics.median(times['routed']) * 1e3:.0f} ms (medians of {steps}) | measured speed-up "
          f"{speedup:.2f}× | FLOP limit {limit:.2f}× (torch's FLOP counter, forward + backward)\n{verdict}")
    return {"vanilla_s": times["vanilla"], "routed_s": times["routed"], "speedup": speedup, "flop_limit": limit,
            "spread": spread}

"""`routekit demo`: the whole product in one minute on a CPU.

Inspects DiT-S/2, applies TREAD's default route (2→8, half the tokens), verifies that inference is
unchanged, then times a few real training steps (forward, backward, AdamW) vanilla vs routed.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .inspection import inspect
from .model import apply, original_forward, report_of
from .verify import verify


def _step_time(model, batch_inputs, steps: int, label: str) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    times = []
    # the first step warms up; off a terminal no bar (disable=None), only the result line
    for _ in tqdm(range(steps + 1), desc=label, leave=False, disable=None):
        x, t, y = batch_inputs
        start = time.perf_counter()
        noise = torch.randn_like(x)
        x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
        loss = (model(x_t, t, y) - (noise - x)).pow(2).mean()  # rectified-flow velocity loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def run_demo(steps: int = 3, batch: int = 4) -> dict:
    # the demo's model is one of the project's backbones, imported by this entry point when it runs:
    # importing routekit never imports its example models
    from backbones import dit

    torch.manual_seed(0)
    model = dit.build("S/2")
    example = dit.example_inputs(model, 2)
    print("== 1. inspect DiT-S/2 (what routekit finds) ==")
    print(inspect(model, example, routes="default"))
    print("\n== 2. apply TREAD's default route and verify inference is unchanged ==")
    routed = apply(model, routes="default", example_inputs=example)
    checked = verify(model, routed, example)
    print(checked)
    print(f"\n== 3. train {steps} steps at batch {batch} on {torch.get_num_threads()} CPU threads ==")
    inputs = dit.example_inputs(model, batch, generator=torch.Generator().manual_seed(1))
    with original_forward(routed):  # the same model without its routes
        vanilla = _step_time(routed, inputs, steps, "vanilla")
    fast = _step_time(routed, inputs, steps, "routed")
    fraction = report_of(routed).block_flop_fraction()
    print(f"vanilla step {vanilla * 1e3:.0f} ms | routed step {fast * 1e3:.0f} ms | "
          f"measured speed-up {vanilla / fast:.2f}× (block FLOPs alone would give {1 / fraction:.2f}×)")
    return {"vanilla_s": vanilla, "routed_s": fast, "speedup": vanilla / fast}

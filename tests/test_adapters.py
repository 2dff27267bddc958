"""What users put on the models they route: LoRA adapters (peft) and the model's own gradient checkpointing.

A LoRA fine-tuning step on a small FLUX with a route and gradient checkpointing trains only the LoRA
parameters, recomputes the checkpointed blocks in backward, and leaves eval bit-identical to the un-routed
LoRA model; adapters and checkpointing may come before `rk.apply` or after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from zoo import Missing, diffusers_flux  # noqa: E402

import routekit as rk  # noqa: E402


def flux_with_lora():
    try:
        peft = pytest.importorskip("peft")
        model, args, kwargs = diffusers_flux()
    except Missing as err:
        pytest.skip(str(err))
    model.requires_grad_(False)
    return model, args, kwargs, peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"])


def block_runs(model) -> list[bool]:
    """Whether gradients were on at each block call: a checkpointed block runs again in backward, with them."""
    calls = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda m, a, kw: calls.append(torch.is_grad_enabled()), with_kwargs=True)
    return calls


@pytest.mark.parametrize("order", ["adapters, then apply", "apply, then adapters"])
def test_a_lora_step_with_a_route_and_checkpointing_trains_only_lora_and_keeps_eval(order):
    model, args, kwargs, lora = flux_with_lora()
    route = rk.Route(start=1, end=4)
    if order == "adapters, then apply":
        model.add_adapter(lora)
        model.enable_gradient_checkpointing()
        routed = rk.apply(model, route, example_inputs=args, example_kwargs=kwargs)
    else:  # on the routed model, as a user who routes first would: it is the model's class, with its methods
        routed = rk.apply(model, route, example_inputs=args, example_kwargs=kwargs)
        routed.add_adapter(lora)  # replaces layers inside the blocks, which the model shares
        routed.enable_gradient_checkpointing()
    routed.train()
    routed(*args, **kwargs)  # traced again where the model changed after apply (the trace runs the blocks too)
    calls = block_runs(model)
    routed.zero_grad()
    routed(*args, **kwargs).sample.square().mean().backward()
    trained = {n for n, p in routed.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained and all("lora_" in n for n in trained), sorted(trained)[:5]
    assert len(calls) == 2 * len(model.transformer_blocks), calls  # every block ran again in backward
    checked = rk.verify(model, routed, args, kwargs)
    assert checked.train == "rate 0 bit-identical"

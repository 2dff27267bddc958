"""The FLOP fraction `inspect` reports for a route is what torch's FLOP counter measures over a training step:
every token a routed block sees counts (a joint stack's text, attention's quadratic share)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import routekit as rk
from benchmarks.common import flop_counter_mode
from routekit.model import report_of

diffusers = pytest.importorskip("diffusers")


def step_flops(model, args, kwargs) -> int:
    model.train()
    with flop_counter_mode() as counter:
        model(*args, **kwargs)[0].pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def test_flux_route_across_both_stacks_plans_the_flops_a_train_step_takes():
    """FLUX, SimpleTuner's route 2 → -2 across its double- and single-stream blocks, with 192 text tokens beside 256
    image tokens: the double-stream blocks' text and attention over image + text are in the plan's fraction (counting
    the image tokens alone, linearly, gives 0.667 against the 0.755 measured)."""
    torch.manual_seed(0)
    flux = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=3, num_single_layers=6,
                                            attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                                            pooled_projection_dim=32, axes_dims_rope=(8, 12, 12))
    side, text = 16, 192
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1], img_ids[..., 2] = torch.arange(side)[:, None], torch.arange(side)[None, :]
    kwargs = {"encoder_hidden_states": torch.randn(1, text, 64), "pooled_projections": torch.randn(1, 32),
              "timestep": torch.rand(1), "img_ids": img_ids.flatten(0, 1), "txt_ids": torch.zeros(text, 3),
              "return_dict": False}
    args = (torch.randn(1, side * side, 64),)
    plain = step_flops(flux, args, kwargs)
    routed = rk.apply(flux, rk.Route(start=2, end=-2), example_inputs=args, example_kwargs=kwargs)
    plan = report_of(routed)
    assert plan.flops_measured
    measured = step_flops(routed, args, kwargs) / plain
    assert abs(plan.block_flop_fraction() / measured - 1) < 0.02, (plan.block_flop_fraction(), measured)
    assert abs(dataclasses.replace(plan, flops=()).block_flop_fraction() / measured - 1) > 0.1  # what it replaced
    assert "counted" in str(rk.inspect(routed))

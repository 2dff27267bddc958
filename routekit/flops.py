"""Counting FLOPs with torch's own counter: one place for the demo, the tests and the benchmarks.

`flop_counter_mode` is torch's `FlopCounterMode` with attention counted on the CPU too; `step_flops` counts one
training step (forward and backward) of a model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils import flop_counter


def flop_counter_mode() -> flop_counter.FlopCounterMode:
    """torch's FLOP counter, attention on the CPU included. Before torch 2.15 the counter had no formula for the
    CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) and counted it as
    free, so a CPU count left attention out and a route's FLOP ratio came out higher than the GPU's. Where the
    registry lacks them, the same formulas torch uses for the GPU's fused kernels count them."""
    aten = torch.ops.aten
    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda grad, q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_backward_flop_count(grad, q, k, v),
    }
    missing = {op: formula for op, formula in cpu_attention.items() if op not in flop_counter.flop_registry}
    return flop_counter.FlopCounterMode(display=False, custom_mapping=missing)


def step_flops(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> int:
    """FLOPs of one forward and backward of ``loss(model)`` in train mode; the gradients it made are dropped."""
    model.train()
    with flop_counter_mode() as counter:
        loss(model).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()

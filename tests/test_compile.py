"""The routed training graph is plain torch: torch.compile(fullgraph=True) takes it whole and matches eager.

Compiled and eager runs must select the same tokens: either the random selector under the same seed with
inductor's `fallback_random` (compiled RNG draws like eager), or a deterministic selector registered here.
CPU inductor compiles C++ for a minute or more on a cold cache, so the default backend is aot_eager
(dynamo capture + AOTAutograd forward/backward graphs); set RK_TEST_INDUCTOR=1 to also run inductor.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch._dynamo
import torch._inductor.config

import routekit as rk
from backbones import dit

pytestmark = pytest.mark.usefixtures("one_thread")


@rk.register_selector("test_checkerboard")
def checkerboard(batch: int, tokens: int, rate: float, *, grid=None, generator=None, device=None) -> torch.Tensor:
    """Deterministic: sample b keeps the tokens of parity b % 2 (rate is ignored; tokens is even here)."""
    return torch.arange(tokens, device=device).view(-1, 2)[:, 0] + (torch.arange(batch, device=device) % 2)[:, None]


BACKENDS = ["aot_eager", pytest.param("inductor", marks=[
    pytest.mark.slow, pytest.mark.skipif(not os.environ.get("RK_TEST_INDUCTOR"), reason="set RK_TEST_INDUCTOR=1")])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("selector, class_dropout", [("random", 0.1), ("test_checkerboard", 0.0)])
def test_compiled_routed_dit_matches_eager_in_train_mode(backend: str, selector: str, class_dropout: float) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = dit.build("S/2", depth=6, hidden=64, heads=2, input_size=8, num_classes=10,
                          class_dropout=class_dropout)
        with torch.no_grad():  # off adaLN-Zero, so outputs and gradients are not all zero
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
        routed = rk.apply(model, routes=[rk.Route(start=1, end=2, rate=0.5, selector=selector),
                                         rk.Route(start=3, end=4, rate=0.25, selector=selector)],
                          example_inputs=(x, t, y)).train()
        params = list(routed.parameters())

        def step(forward) -> tuple:
            image = x.clone().requires_grad_()
            torch.manual_seed(5)
            out = forward(image, t, y)
            grads = torch.autograd.grad(out.square().mean(), [image, *params])
            return out.detach(), grads, [s.last_index for s in routed.routekit.routes]

        torch._dynamo.reset()
        with mock.patch.object(torch._inductor.config, "fallback_random", True):
            compiled = step(torch.compile(routed, fullgraph=True, backend=backend))
        eager = step(routed)
    for c, e in zip(compiled[2], eager[2]):
        assert torch.equal(c, e), "compiled and eager must select the same tokens"
    assert compiled[0].abs().max() > 0
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    for c, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)

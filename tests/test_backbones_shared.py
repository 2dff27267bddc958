"""Laws every scan backbone keeps, held once for Diffusion-RWKV and DiM (the DiT file checks its own)."""

import pytest
import torch
import torch.fx as fx
from backbone_helpers import inputs, perturb, small_mamba, small_rwkv

# Mamba's gradient check turns its optional MLP on, so those parameters are covered too.
BACKBONES = {"rwkv": (small_rwkv, {}), "mamba": (small_mamba, {"mlp_ratio": 2.0})}


@pytest.fixture(params=list(BACKBONES))
def backbone(request):
    return BACKBONES[request.param]


@pytest.mark.parametrize("small, overrides", [(small_rwkv, {}), (small_mamba, {"mlp_ratio": 0.0}),
                                              (small_mamba, {"mlp_ratio": 4.0})], ids=["rwkv", "mamba", "mamba-mlp"])
def test_output_is_exactly_zero_at_init_and_every_block_is_the_identity(small, overrides):
    model = small(**overrides)
    x, t, y = inputs(model)
    assert torch.count_nonzero(model(x, t, y)) == 0
    tokens, c = torch.randn(2, 64, 32), torch.randn(2, 32)
    for block in model.blocks:
        assert torch.equal(block(tokens, c), tokens)


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_block_runs_on_whole_rows_of_the_grid(backbone, rows):
    block = perturb(backbone[0]()).blocks[1]
    x, c = torch.randn(3, rows * 8, 32), torch.randn(3, 32)
    out = block(x, c)
    assert out.shape == x.shape and torch.isfinite(out).all() and not torch.equal(out, x)


def test_gradients_reach_every_parameter_and_are_finite(backbone):
    small, grad_overrides = backbone
    model = perturb(small(**grad_overrides))
    x, t, y = inputs(model)
    model(x, t, y).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_bf16_autocast_forward_is_finite(backbone):
    model = perturb(backbone[0]()).eval()
    x, t, y = inputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, y)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), model(x, t, y), atol=0.05, rtol=0.05)


def test_example_inputs_are_deterministic_and_valid(backbone):
    model = backbone[0]()
    a, b = inputs(model, 5, seed=3), inputs(model, 5, seed=3)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    x, t, y = a
    assert x.shape == (5, 4, 16, 16) and ((t >= 0) & (t < 1)).all() and y.dtype == torch.long
    assert ((y >= 0) & (y < 10)).all()


class BlocksAsLeaves(fx.Tracer):
    """What routekit's tracer does: the blocks are opaque calls, the top-level forward is traced."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname.startswith("blocks.") or super().is_leaf_module(m, qualname)


@pytest.mark.parametrize("train", [True, False])
def test_top_level_forward_traces_to_a_plain_block_chain(backbone, train):
    model = perturb(backbone[0](depth=3)).train(train)
    graph = BlocksAsLeaves().trace(model)
    calls = [n.target for n in graph.nodes if n.op == "call_module" and n.target.startswith("blocks.")]
    assert calls == ["blocks.0", "blocks.1", "blocks.2"]
    traced = fx.GraphModule(model, graph)
    x, t, y = inputs(model, 3)
    torch.manual_seed(1)
    expected = model(x, t, y)
    torch.manual_seed(1)
    assert torch.equal(traced(x, t, y), expected)

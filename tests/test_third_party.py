"""Models routekit has never seen, from timm, diffusers and transformers, built from small configs with random weights.

For each: `inspect` finds the block stack, the token stream and its special tokens; a route applies in
graph mode and in boundary mode; `verify` passes; a train step runs with fewer tokens in the routed blocks
and gradients reach every parameter they reached before; and the FLOPs of one routed train step
(forward + backward, counted by torch's FlopCounterMode) match the plan within 5%. The plan's FLOPs are
the original step's, less, for each routed block, the difference between that block's FLOPs on all
tokens and on the kept count (each block run alone on its captured inputs, cut to that many tokens).

A package that is absent (or, like timm without torchvision, does not import) skips its case with the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import routekit as rk

pytestmark = pytest.mark.usefixtures("one_thread")


def _package(name: str):
    try:
        return importlib.import_module(name)
    except Exception as err:  # timm raises ModuleNotFoundError (torchvision), a broken torchvision RuntimeError
        pytest.skip(f"{name} is not usable here ({type(err).__name__}: {err}); see README 'Limits'")


@dataclass
class Case:
    """A third-party model, its example call, the route to place and what inspect must find."""

    build: Callable[[], tuple[nn.Module, tuple, dict]]
    route: rk.Route
    stack: str
    tokens: int
    special: tuple[int, ...] = ()


def timm_vit():
    timm = _package("timm")
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64)  # 1 class + 4×4 patch tokens
    return model, (torch.randn(2, 3, 64, 64),), {}


def diffusers_dit():
    diffusers = _package("diffusers")
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=6,
                                            sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=1)
    return model, (torch.randn(2, 4, 8, 8),), {"timestep": torch.tensor([3, 7]), "class_labels": torch.tensor([1, 4])}


def diffusers_pixart():
    diffusers = _package("diffusers")
    model = diffusers.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                               out_channels=8, num_layers=6, sample_size=8, patch_size=2,
                                               cross_attention_dim=32, caption_channels=24, norm_num_groups=1)
    kwargs = {"encoder_hidden_states": torch.randn(2, 5, 24), "timestep": torch.tensor([3, 7]),
              "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    return model, (torch.randn(2, 4, 8, 8),), kwargs


def transformers_mamba():
    transformers = _package("transformers")
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=6, expand=2)
    return transformers.MambaModel(config), (torch.randint(0, 64, (2, 12)),), {}


def transformers_vit():
    transformers = _package("transformers")
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=64,
                                    image_size=16, patch_size=4)
    return transformers.ViTModel(config, add_pooling_layer=False), (torch.randn(2, 3, 16, 16),), {}


def transformers_dinov2_registers():
    transformers = _package("transformers")
    config = transformers.Dinov2WithRegistersConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                                                    intermediate_size=64, image_size=16, patch_size=4,
                                                    num_register_tokens=4)
    return transformers.Dinov2WithRegistersModel(config), (torch.randn(2, 3, 16, 16),), {}


CASES = {
    "timm-vit_small_patch16_224": Case(timm_vit, rk.Route(start=2, end=8, keep=[0]), "blocks", 17, (0,)),
    "diffusers-DiT": Case(diffusers_dit, rk.Route(start=1, end=4), "transformer_blocks", 16),
    "diffusers-PixArt": Case(diffusers_pixart, rk.Route(start=1, end=4, selector="row"), "transformer_blocks", 16),
    "transformers-Mamba": Case(transformers_mamba, rk.Route(start=1, end=4), "layers", 12),
    "transformers-ViT": Case(transformers_vit, rk.Route(start=1, end=4, keep=[0]), "layers", 17, (0,)),
    "transformers-Dinov2-registers": Case(transformers_dinov2_registers,
                                          rk.Route(start=1, end=4, selector="row", keep=range(5)),
                                          "encoder.layer", 21, tuple(range(5))),
}


def first_float(out) -> torch.Tensor:
    return next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


def train_step(model: nn.Module, args: tuple, kwargs: dict) -> int:
    """FLOPs of one forward + backward of a squared-output loss."""
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        first_float(model(*args, **kwargs)).pow(2).mean().backward()
    return counter.get_total_flops()


def block_step_flops(block: nn.Module, call: tuple[tuple, dict], batch: int, tokens: int, keep: int) -> int:
    """FLOPs of the block alone, forward + backward, on its captured inputs cut to `keep` of `tokens` tokens."""

    def cut(v):
        if not isinstance(v, torch.Tensor):
            return v
        if v.dim() >= 2 and v.shape[0] == batch and v.shape[1] == tokens:
            v = v[:, :keep]
        return v.detach().requires_grad_(v.requires_grad)

    args, kwargs = pytree.tree_map(cut, call)
    with FlopCounterMode(display=False) as counter:
        first_float(block(*args, **kwargs)).pow(2).mean().backward()
    return counter.get_total_flops()


def captured_calls(model: nn.Module, names: list[str], args: tuple, kwargs: dict) -> dict[str, tuple[tuple, dict]]:
    calls, handles = {}, []
    for name in names:
        hook = lambda m, a, kw, name=name: calls.setdefault(name, (a, kw))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    model(*args, **kwargs)
    for h in handles:
        h.remove()
    return calls


def stream_tokens_per_block(model: nn.Module, report: rk.GraphReport, args: tuple, kwargs: dict) -> list[int]:
    """Token count of the stream entering each block in one forward of `model`."""
    seen, handles = {}, []
    for block in report.blocks:
        def hook(m, a, kw, i=block.index):
            stream = a[report.stream_slot] if isinstance(report.stream_slot, int) else kw[report.stream_slot]
            seen[i] = stream.shape[1]
        handles.append(model.get_submodule(block.qualname).register_forward_pre_hook(hook, with_kwargs=True))
    model(*args, **kwargs)
    for h in handles:
        h.remove()
    return [seen[i] for i in range(len(report.blocks))]


@pytest.fixture(params=list(CASES), scope="module")
def case(request) -> tuple[str, Case, nn.Module, tuple, dict]:
    spec = CASES[request.param]
    torch.manual_seed(0)
    model, args, kwargs = spec.build()
    return request.param, spec, model, args, kwargs


def test_inspect_finds_the_block_stack_the_stream_and_the_special_tokens(case) -> None:
    _, spec, model, args, kwargs = case
    report = rk.inspect(model, args, kwargs, routes=[spec.route])
    assert report.mode == "graph" and report.stack == spec.stack and report.tokens == spec.tokens
    assert report.special == spec.special
    if spec.special:
        assert f"keep={list(spec.special)}" in str(report)
        with pytest.raises(rk.ConfigError, match=rf"keep=\[{', '.join(map(str, spec.special))}\]"):
            rk.apply(model, rk.Route(start=spec.route.start, end=spec.route.end), example_inputs=args,
                     example_kwargs=kwargs)


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_a_routed_train_step_sees_fewer_tokens_lets_gradients_flow_and_saves_the_planned_flops(case, mode) -> None:
    name, spec, model, args, kwargs = case
    routed = rk.apply(model, [spec.route], example_inputs=args, example_kwargs=kwargs, mode=mode)
    assert rk.verify(model, routed, args, kwargs)["mode"] == mode
    report = rk.report_of(routed)
    route = spec.route
    batch, tokens = report.stream.shape[:2]
    kept = report.placed[0].kept
    assert kept < tokens

    model.train()
    routed.train()
    want = [kept if route.start <= i <= route.end else tokens for i in range(report.depth)]
    assert stream_tokens_per_block(routed, report, args, kwargs) == want

    original = train_step(model, args, kwargs)
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    measured = train_step(routed, args, kwargs)
    routed_reached = {n for n, p in routed.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached == routed_reached, f"gradients stopped reaching {sorted(reached - routed_reached)[:5]}"
    assert (~rk.last_route_mask(routed)).sum(1).tolist() == [kept] * batch

    names = [b.qualname for b in report.blocks[route.start:route.end + 1]]
    calls = captured_calls(model, names, args, kwargs)
    saved = sum(block_step_flops(model.get_submodule(n), calls[n], batch, tokens, tokens)
                - block_step_flops(model.get_submodule(n), calls[n], batch, tokens, kept) for n in names)
    plan = (original - saved) / original
    got = measured / original
    print(f"{name} [{mode}]: a routed train step costs {got:.4f} of the original FLOPs; plan {plan:.4f}")
    assert abs(got / plan - 1) < 0.05

"""A routed model is a drop-in for the user's model: what the peers' own test suites ask of it
(`benchmarks/peer_suites.py`), held here on tiny models without their test trees.

Saved with the model's own `save_pretrained`, it loads back with `from_pretrained` (transformers) and `AutoModel`
(diffusers) as the model's class; in eval it returns what the original returns, hidden states and attentions
included; a config that asks for hidden states routes; gradient checkpointing trains in graph mode as without it;
diffusers' smallest Flux (one double- and one single-stream block) routes across both stacks; a call that skips a
routed block runs unrouted, saying so; it is of the
model's own type, and pickles and `torch.save`s as the model.
"""

from __future__ import annotations

import copy
import io
import json
import pickle

import pytest
import torch

import routekit as rk

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

ROUTE = rk.Route(start=0, end=1, rate=0.5)


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def llama(**config):
    """The shape of transformers' Llama tester: 2 layers of width 32, 13 sequences of 7 tokens, a padding mask."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                   pad_token_id=0, attn_implementation="eager", **config)
    ids = torch.randint(0, 99, (13, 7), generator=_g())
    return transformers.LlamaModel(cfg), {"input_ids": ids, "attention_mask": torch.tril(torch.ones_like(ids))}


def vit(**config):
    """The shape of transformers' ViT tester: 13 images of 30×30, patch 2 (225 tokens and [CLS]), 2 layers."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=30, patch_size=2, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=37, attn_implementation="eager", **config)
    return transformers.ViTModel(cfg), {"pixel_values": torch.randn(13, 3, 30, 30, generator=_g())}


def wan():
    """diffusers' Wan tester config and inputs: 2 layers, a 2-frame 16×16 video (128 tokens), 12 text tokens."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                            in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
                                            num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                            rope_max_seq_len=32)
    return model, {"hidden_states": torch.randn(1, 4, 2, 16, 16, generator=_g()),
                   "encoder_hidden_states": torch.randn(1, 12, 16, generator=_g(1)), "timestep": torch.tensor([1])}


def sd3():
    """diffusers' SD3 tester config and inputs: 4 layers, 32×32 latents at patch 1 (1024 tokens), 154 text tokens."""
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=4,
                                            attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                            joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
                                            pos_embed_max_size=96)
    return model, {"hidden_states": torch.randn(2, 4, 32, 32, generator=_g()),
                   "encoder_hidden_states": torch.randn(2, 154, 32, generator=_g(1)),
                   "pooled_projections": torch.randn(2, 64, generator=_g(2)), "timestep": torch.tensor([1.0, 5.0])}


def flux_1_1():
    """diffusers' own Flux tester config: one double-stream and one single-stream block."""
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    return model, {"hidden_states": torch.randn(1, 16, 4, generator=_g()),
                   "encoder_hidden_states": torch.randn(1, 48, 32, generator=_g(1)),
                   "pooled_projections": torch.randn(1, 32, generator=_g(2)),
                   "img_ids": torch.randn(16, 3, generator=_g(3)), "txt_ids": torch.randn(48, 3, generator=_g(4)),
                   "timestep": torch.tensor([1.0])}


def routed(build, **apply):
    """(the original, a twin of it with the same weights that `apply` routes, the inputs): apply may route the
    model in place, so the original is kept apart to compare with."""
    model, kwargs = build()
    original = copy.deepcopy(model).eval()
    return original, rk.apply(model, routes=ROUTE, example_kwargs=kwargs, **apply), kwargs


def first(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else (out.sample if hasattr(out, "sample") else out.last_hidden_state)


@pytest.mark.parametrize("build", [llama, vit], ids=["llama", "vit"])
def test_save_pretrained_loads_back_as_the_models_class(build, tmp_path):
    original, model, kwargs = routed(build)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(original).__name__]
    loaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation=original.config._attn_implementation)
    assert type(loaded) is type(original)
    state = original.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(first(loaded.eval()(**kwargs)), first(original(**kwargs)))


def test_a_saved_routed_wan_loads_with_automodel(tmp_path):
    original, model, kwargs = routed(wan)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    loaded = diffusers.AutoModel.from_pretrained(str(tmp_path)).eval()
    assert type(loaded) is diffusers.WanTransformer3DModel
    with torch.no_grad():
        assert torch.equal(first(loaded(**kwargs)), first(original(**kwargs)))


@pytest.mark.parametrize("build", [llama, vit], ids=["llama", "vit"])
def test_eval_hidden_states_and_attentions_are_the_originals(build):
    original, model, kwargs = routed(build)
    model.eval()
    with torch.no_grad():
        got = model(**kwargs, output_hidden_states=True, output_attentions=True)
        want = original(**kwargs, output_hidden_states=True, output_attentions=True)
    for name in ("hidden_states", "attentions"):
        assert got[name] is not None and len(got[name]) == len(want[name]), name
        for a, b in zip(got[name], want[name]):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("build", [llama, vit], ids=["llama", "vit"])
def test_a_config_with_output_hidden_states_routes(build):
    original, model, kwargs = routed(lambda: build(output_hidden_states=True))
    model.train()
    model(**kwargs).last_hidden_state.square().mean().backward()
    model.eval()
    with torch.no_grad():
        got, want = model(**kwargs), original(**kwargs)
    assert len(got.hidden_states) == len(want.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))


def _grads(model, kwargs) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    first(model(**kwargs)).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("when", ["before apply", "after apply"])
def test_sd3_with_gradient_checkpointing_trains_in_graph_mode_as_without(when):
    _, plain, kwargs = routed(sd3, mode="graph", generator=_g(7))
    want = _grads(plain, kwargs)
    model, kwargs = sd3()
    if when == "before apply":
        model.enable_gradient_checkpointing()
    checked = rk.apply(model, routes=ROUTE, example_kwargs=kwargs, mode="graph", generator=_g(7))
    if when == "after apply":
        checked.enable_gradient_checkpointing()
    assert rk.inspect(checked).mode == "graph"
    got = _grads(checked, kwargs)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_a_training_call_that_skips_a_routed_block_runs_unrouted_and_says_so():
    """SD3's `skip_layers` (skip-layer guidance) leaves out a block a route spans: that call has no route to run,
    so it runs the original forward with a RouteWarning; calls that run every block stay routed."""
    original, model, kwargs = routed(sd3, generator=_g(3))
    model.train()
    original.train()
    skip = {**kwargs, "skip_layers": [0]}
    with pytest.warns(rk.RouteWarning, match="transformer_blocks.0 is skipped by this call"):
        got = first(model(**skip))
    assert torch.equal(got, first(original(**skip)))
    assert not torch.equal(got, first(model(**kwargs)))  # skipping changes the output, as the peers' test asks
    with torch.no_grad():
        routed_out = first(model(**kwargs))
    assert not torch.equal(routed_out, first(original(**kwargs)))  # the full call is still routed


def test_the_smallest_flux_routes_across_both_stacks():
    original, model, kwargs = routed(flux_1_1)
    plan = rk.inspect(model)
    assert plan.stack == "transformer_blocks → single_transformer_blocks"
    assert plan.placed[0].stacks == (0, 1)
    model.train()
    first(model(**kwargs)).square().mean().backward()
    model.eval()
    with torch.no_grad():
        assert torch.equal(first(model(**kwargs)), first(original(**kwargs)))


@pytest.mark.parametrize("build", [llama, wan], ids=["llama", "wan"])
def test_the_routed_model_is_of_the_models_type(build):
    model, kwargs = build()
    cls = type(model)
    assert type(rk.apply(model, routes=ROUTE, example_kwargs=kwargs)) is cls


@pytest.mark.parametrize("build", [llama, wan], ids=["llama", "wan"])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_the_routed_model_pickles_and_saves_as_the_model(build, how):
    original, model, kwargs = routed(build)
    if how == "pickle":
        back = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        back = torch.load(buffer, weights_only=False)
    assert isinstance(back, type(original))  # `type(...) is`: test_the_routed_model_is_of_the_models_type
    back.train()
    first(back(**kwargs)).square().mean().backward()
    assert rk.last_route_mask(back).any()  # routes still run in training
    back.eval()
    with torch.no_grad():
        assert torch.equal(first(back(**kwargs)), first(original(**kwargs)))

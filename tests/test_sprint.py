"""SPRINT's fused route end, Path-Drop Guidance and training in stages (routekit/fusion.py, guidance.py, stages.py).

A fused route (`Route(fuse=...)`) changes the model: its eval runs the route on every token with the fusion, and
`verify` holds it to its own full-token program. Each law is checked against SPRINT written out by hand on the
repository's DiT (plain PyTorch), and on models people train (diffusers, transformers, the scan backbones).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).parent))
import zoo  # noqa: E402
from backbone_helpers import inputs, perturb, small_mamba, small_rwkv  # noqa: E402
from zoo import ZOO, Missing  # noqa: E402

import routekit as rk  # noqa: E402
import routekit.sharding  # noqa: E402,F401
from backbones import dit  # noqa: E402
from routekit.model import original_forward  # noqa: E402


def small_dit(depth: int = 6) -> dit.DiT:
    """A tiny DiT moved off its init (zero gates and a zero final layer would hide what a route changes)."""
    torch.manual_seed(0)
    return perturb(dit.DiT(depth=depth, hidden=32, heads=4, patch=2, input_size=8, in_channels=4, num_classes=10))


def fused(model, route: dict | None = None, generator=None, **fusion):
    example = inputs(model)
    rk.apply(model, rk.Route(**{"start": 1, "end": 3, "rate": 0.75, "fuse": rk.Fusion(**fusion), **(route or {})}),
             example_inputs=example, generator=generator)
    return model, example


def by_hand(model: dit.DiT, x, t, y, start: int, end: int, index=None, deep: bool = True):
    """SPRINT on the repository's DiT, written out: blocks before `start` on every token; blocks start..end on
    the tokens `index` (every token where None), or none of them (`deep=False`, the path dropped); their output
    put back at the kept positions of a sequence of mask tokens and fused with the stream at `start`."""
    end_module = model.routekit.sprint["0"]
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    for block in model.blocks[:start]:
        h = block(h, c)
    dense = h
    out = end_module.mask.expand(h.shape).clone()
    if deep:
        index = torch.arange(h.shape[1]).expand(h.shape[0], -1) if index is None else index
        kept = torch.stack([h[b, index[b]] for b in range(h.shape[0])])
        for block in model.blocks[start:end + 1]:
            kept = block(kept, c)
        for b in range(h.shape[0]):
            out[b, index[b]] = kept[b]
    h = end_module.fuse(torch.cat([out, dense], dim=-1))
    for block in model.blocks[end + 1:]:
        h = block(h, c)
    return model.unpatchify(model.final_layer(h, c))


# ---- the fusion's laws -------------------------------------------------------------------------------------------

def test_the_fine_tuning_initialisation_at_rate_0_is_the_unrouted_model_bit_for_bit():
    model = small_dit()
    example = inputs(model)
    with torch.no_grad():
        model.eval()
        want_eval = model(*example)
        model.train()
        torch.manual_seed(3)
        want_train = model(*example)
    fused(model, {"rate": 0.0}, init="preserve", path_drop=0.0)
    with torch.no_grad():
        assert torch.equal(model.eval()(*example), want_eval)
        torch.manual_seed(3)
        assert torch.equal(model.train()(*example), want_train)


def test_training_is_sprint_written_out_by_hand():
    model, (x, t, y) = fused(small_dit(), generator=torch.Generator().manual_seed(0), path_drop=0.0)
    model.train()
    torch.manual_seed(5)
    got = model(x, t, y)
    routed = rk.last_route_mask(model)
    index = torch.stack([torch.nonzero(~row).flatten() for row in routed])
    assert index.shape[1] == 4  # 16 tokens, 75% routed around
    torch.manual_seed(5)
    torch.testing.assert_close(got, by_hand(model, x, t, y, 1, 3, index))


def test_eval_runs_the_route_on_every_token_with_the_fusion_and_differs_from_the_original():
    model, (x, t, y) = fused(small_dit())
    model.eval()
    with torch.no_grad(), original_forward(model):
        original = model(x, t, y)
    with torch.no_grad():
        got = model(x, t, y)
        torch.testing.assert_close(got, by_hand(model, x, t, y, 1, 3))
    assert not torch.allclose(got, original)  # SPRINT's initialisation changes the model
    assert "fused" in str(rk.verify(model, model, (x, t, y)).train)


def test_the_path_drop_replaces_whole_samples_deep_paths_by_mask_tokens():
    model, (x, t, y) = fused(small_dit(), generator=torch.Generator().manual_seed(0), path_drop=0.999999)
    model.train()
    torch.manual_seed(1)
    got = model(x, t, y)  # every sample's deep path dropped (a draw below 0.999999)
    torch.manual_seed(1)
    torch.testing.assert_close(got, by_hand(model, x, t, y, 1, 3, deep=False))


def test_the_fusion_belongs_to_the_model_saves_loads_and_trains():
    model, example = fused(small_dit())
    keys = [k for k in model.state_dict() if k.startswith("routekit.")]
    assert keys == ["routekit.sprint.0.mask", "routekit.sprint.0.fuse.weight", "routekit.sprint.0.fuse.bias"]
    model.train()
    model(*example).pow(2).mean().backward()
    end = model.routekit.sprint["0"]
    assert end.mask.grad.abs().sum() > 0 and end.fuse.weight.grad.abs().sum() > 0
    other, _ = fused(small_dit())
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(other.eval()(*example), model.eval()(*example))


def test_a_bf16_model_gets_its_fusion_in_bf16():
    model = small_dit().to(torch.bfloat16)
    example = tuple(v.to(torch.bfloat16) if v.is_floating_point() else v for v in inputs(model))
    rk.apply(model, rk.Route(start=1, end=3, rate=0.75, fuse="sprint"), example_inputs=example)
    assert model.routekit.sprint["0"].fuse.weight.dtype == torch.bfloat16
    out = model.train()(*example)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---- Path-Drop Guidance ---------------------------------------------------------------------------------------

def test_path_drop_is_the_model_without_the_middle_span_and_skips_its_blocks():
    model, (x, t, y) = fused(small_dit())
    model.eval()
    with torch.no_grad(), rk.path_drop(model):  # the first call traces the forward, which runs every block
        model(x, t, y)
    calls = []
    hooks = [b.register_forward_hook(lambda *a, i=i: calls.append(i)) for i, b in enumerate(model.blocks)]
    with torch.no_grad(), rk.path_drop(model):
        got = model(x, t, y)
    for h in hooks:
        h.remove()
    assert calls == [0, 4, 5]  # blocks 1..3 never ran
    with torch.no_grad():
        torch.testing.assert_close(got, by_hand(model, x, t, y, 1, 3, deep=False))
        assert not torch.allclose(model(x, t, y), got)  # out of the block: the full model again


def test_path_drop_is_refused_without_a_fused_route_or_across_a_join():
    model = small_dit()
    rk.apply(model, rk.Route(start=1, end=3), example_inputs=inputs(model))
    with pytest.raises(rk.ConfigError, match="this model has none"), rk.path_drop(model):
        pass
    try:
        flux, args, kwargs = zoo.diffusers_flux()
    except Missing as err:
        pytest.skip(str(err))
    for span in ({"start": 1, "end": 2}, {"start": "single_transformer_blocks.0", "end": "single_transformer_blocks.1"}):
        rk.apply(flux, rk.Route(**span, fuse="sprint"), example_inputs=args, example_kwargs=kwargs)
        flux.eval()
        with pytest.raises(rk.ConfigError, match="text"), torch.no_grad(), rk.path_drop(flux):
            flux(*args, **kwargs)  # both of Flux's stacks hand their text on block to block
        rk.strip(flux, drop_learned=True)
    rk.apply(flux, rk.Route(start=2, end=-2, fuse="sprint"), example_inputs=args, example_kwargs=kwargs)
    with pytest.raises(rk.ConfigError, match="crosses"), torch.no_grad(), rk.path_drop(flux):
        flux(*args, **kwargs)
    # the positive twins: DiT above, and the zoo's rows below (SD3, Wan, Llama, Mamba, RWKV, DiM)


# ---- stages -------------------------------------------------------------------------------------------------

def test_set_rate_changes_the_kept_count_and_keeps_the_learned_ends():
    model, example = fused(small_dit())
    model.train()
    model(*example)
    assert rk.last_route_mask(model).sum(1).tolist() == [12, 12]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert rk.set_rate(model, 0.0) is model
    model(*example)
    assert rk.last_route_mask(model).sum(1).tolist() == [0, 0]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(rk.ConfigError, match=r"set_rate\(1.5\).*\[0, 1\)"):
        rk.set_rate(model, 1.5)
    with pytest.raises(rk.InputError, match="valid routes are 0..0"):
        rk.set_rate(model, 0.5, route=1)
    model(*example)
    assert rk.last_route_mask(model).sum(1).tolist() == [0, 0]  # a refused rate leaves the routes as they were


# ---- refusals and their positive twins --------------------------------------------------------------------------

def test_refusals_name_the_argument_and_the_way_out():
    with pytest.raises(rk.ConfigError, match="fuse is None"):
        rk.Route(start=1, end=2, fuse="tread")
    with pytest.raises(rk.ConfigError, match="path_drop is the share"):
        rk.Fusion(path_drop=1.0)
    model = small_dit()
    with pytest.raises(rk.ConfigError, match="use one of them"):
        rk.apply(model, rk.Route(start=1, end=3, fuse="sprint"), residual=rk.DAR(), example_inputs=inputs(model))
    with pytest.raises(rk.ConfigError, match="needs graph mode"):
        rk.apply(model, rk.Route(start=1, end=3, fuse="sprint"), example_inputs=inputs(model), mode="boundary")
    fused(model)
    with pytest.raises(rk.ConfigError, match="set_rate"):
        rk.apply(model, rk.Route(start=1, end=3), example_inputs=inputs(model))
    with pytest.raises(rk.ConfigError, match="drop_learned=True"):
        rk.strip(model)
    assert rk.strip(model, drop_learned=True) is model and "routekit.sprint.0.mask" not in model.state_dict()


def test_a_fused_route_at_rate_0_is_no_warning():
    model = small_dit()
    with warnings.catch_warnings():
        warnings.simplefilter("error", rk.RouteWarning)
        rk.apply(model, rk.Route(start=1, end=3, rate=0.0, fuse="sprint"), example_inputs=inputs(model))


def test_a_fused_model_compiles_and_trains():
    model, example = fused(small_dit(), path_drop=0.0)
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*example), model(*example))
    model.train()
    compiled(*example).pow(2).mean().backward()
    assert model.routekit.sprint["0"].fuse.weight.grad is not None


def test_a_fused_route_keeps_forced_tokens_in_its_deep_path_and_shards_by_block():
    model, (x, t, y) = fused(small_dit(), generator=torch.Generator().manual_seed(0), path_drop=0.0)
    model.train()
    forced = torch.zeros(2, 16, dtype=torch.bool)
    forced[:, :3] = True
    with rk.force_keep(model, forced):
        model(x, t, y)
    assert not rk.last_route_mask(model)[:, :3].any()
    units = rk.sharding.fsdp_units(model)
    assert [unit[0] for unit in units] == list(model.blocks)  # the blocks, as with TREAD's routes; the ends in the root


# ---- the zoo: models people train, fused ---------------------------------------------------------------------

SPRINT_ROWS = {  # (span, what path_drop says: None where the weak pass runs, else the refusal it gives)
    "diffusers DiT": ({"start": 1, "end": 3}, None),
    "diffusers SD3": ({"start": 1, "end": 3}, "text"),  # a joint stack: its blocks hand the text on
    "diffusers Flux (across both stacks)": ({"start": 2, "end": -2}, "crosses"),
    "diffusers Wan": ({"start": 1, "end": 3}, None),  # text by cross-attention: read, never handed on
    "transformers Llama": ({"start": 1, "end": 2}, None),
    "transformers ViT": ({"start": 1, "end": 2}, None),  # its class token, kept in the deep path
    "transformers Mamba": ({"start": 1, "end": 2}, None),
}


def scan(build):
    def make():
        model = perturb(build(depth=4))
        return model, inputs(model), {}
    return make


BUILDS = {**{name: ZOO[name].build for name in SPRINT_ROWS},
          "Diffusion-RWKV": scan(small_rwkv), "DiM (Mamba-2)": scan(small_mamba)}


@pytest.mark.parametrize("name", list(BUILDS))
def test_a_fused_route_on_a_model_people_train_verifies_trains_and_drops_its_path(name):
    torch.set_num_threads(1)
    try:
        model, args, kwargs = BUILDS[name]()
    except Missing as err:
        pytest.skip(str(err))
    span, refusal = SPRINT_ROWS.get(name, ({"start": 1, "end": 2, "selector": "row"}, None))  # a 2-D scan
    rk.apply(model, rk.Route(**span, rate=0.5, fuse="sprint"), example_inputs=args, example_kwargs=kwargs)
    result = rk.verify(model, model, args, kwargs)
    assert "fused" in result.train
    model.train()
    loss = sum(t.float().pow(2).mean() for t in pytree.tree_leaves(model(*args, **kwargs))
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad)
    loss.backward()
    assert model.routekit.sprint["0"].fuse.weight.grad.abs().sum() > 0
    model.eval()
    if refusal is not None:
        with pytest.raises(rk.ConfigError, match=refusal), torch.no_grad(), rk.path_drop(model):
            model(*args, **kwargs)
        return
    with torch.no_grad(), rk.path_drop(model):
        weak = pytree.tree_leaves(model(*args, **kwargs))
    with torch.no_grad():
        full = pytree.tree_leaves(model(*args, **kwargs))
    assert all(torch.isfinite(w).all() for w in weak if isinstance(w, torch.Tensor) and w.is_floating_point())
    assert any(not torch.equal(w, f) for w, f in zip(weak, full) if isinstance(w, torch.Tensor))

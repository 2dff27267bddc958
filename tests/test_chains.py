"""Routes over a chain of block stacks: Flux runs double-stream blocks on the image tokens, then single-stream
blocks where the text is joined in front (by the owner, or inside the block); SimpleTuner's headline route
runs from double block 2 to single block -2, counting over the chain. The zoo (test_model_support.py) holds
diffusers Flux and Chroma routed 2 → -2 across both stacks in both modes: verified, their training FLOPs the
plan's, no owner-added token routed. Here: the chain's indices and names, what crosses the join, a Flux
whose attention reads `key.shape` for its head size, and SimpleTuner's tread_config taken as it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from zoo import ZOO, Missing

import routekit as rk
from routekit.model import report_of


def build(name: str):
    try:
        return ZOO[name].build()
    except Missing as err:
        pytest.skip(str(err))


def test_route_ends_count_over_the_chain_from_either_end_or_by_stack_and_index():
    model, args, kwargs = build("diffusers Chroma (across both stacks)")  # 4 double + 6 single blocks
    plans = [report_of(rk.apply(model, route, example_inputs=args, example_kwargs=kwargs)).placed[0]
             for route in (rk.Route(start=2, end=-2), rk.Route(start=2, end=8),
                           rk.Route(start="transformer_blocks.2", end="single_transformer_blocks.-2"),
                           rk.Route(start="transformer_blocks.-2", end="single_transformer_blocks.4"))]
    assert {(p.start, p.end, p.stacks) for p in plans} == {(2, 8, (0, 1))}
    assert plans[0].kept_in == (8, 13)  # 8 of 16 image tokens; then with the 5 text tokens joined in front
    with pytest.raises(rk.ConfigError, match=r"'single_blocks\.1' names no block of the chain.*'transformer_blocks', "
                                             r"'single_transformer_blocks'"):
        rk.apply(model, rk.Route(start=2, end="single_blocks.1"), example_inputs=args, example_kwargs=kwargs)
    with pytest.raises(rk.ConfigError, match=r"named '<stack>\.<index>'"):
        rk.Route(start="transformer_blocks", end=4)


def test_a_cross_stack_route_hands_the_single_stream_blocks_the_text_and_the_kept_image_tokens():
    """In Chroma the owner joins the text in front of the image tokens between the stacks: the first single block
    gets every text token and the route's kept image tokens, in order, and its RoPE rows cut to match."""
    model, args, kwargs = build("diffusers Chroma (across both stacks)")
    routed = rk.apply(model, rk.Route(start=2, end=-2), example_inputs=args, example_kwargs=kwargs).train()
    seen = {}

    def single(module, a, kw):
        seen.setdefault("in", kw)

    def double(module, a, out):
        seen.setdefault("text", out[0])
        seen.setdefault("image", out[1])

    model.single_transformer_blocks[0].register_forward_pre_hook(single, with_kwargs=True)
    model.transformer_blocks[3].register_forward_hook(double)
    routed(*args, **kwargs)
    kept = (~rk.last_route_mask(routed)).nonzero()[:, 1].view(2, 8)
    stream = seen["in"]["hidden_states"]
    assert stream.shape == (2, 13, 32)
    torch.testing.assert_close(stream[:, :5], seen["text"], rtol=0, atol=0)
    torch.testing.assert_close(stream[:, 5:], seen["image"], rtol=0, atol=0)
    cos = seen["in"]["image_rotary_emb"][0]
    full = model.pos_embed(torch.cat([kwargs["txt_ids"], kwargs["img_ids"]]))[0]
    assert torch.equal(cos, torch.cat([full[:5], full[5:][kept[0]]]))  # one selection for the batch (a 2-D table)
    rk.verify(model, routed, args, kwargs)


class KeyShapeProcessor:
    """Flux's joint attention as SimpleTuner writes it: the head size read off the key (`key.shape[-1] // heads`)
    and the text projections reshaped with it. A shape read is no data flow: the text stays the text's."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        batch = hidden_states.shape[0]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        split = lambda x: x.view(batch, -1, attn.heads, head_dim).transpose(1, 2)  # noqa: E731
        query, key, value = attn.norm_q(split(query)), attn.norm_k(split(key)), split(value)
        if encoder_hidden_states is not None:
            text = [split(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
            query, key, value = (torch.cat([t, x], dim=2) for t, x in zip(text, (query, key, value)))
        if image_rotary_emb is not None:
            query, key = apply_rotary_emb(query, image_rotary_emb), apply_rotary_emb(key, image_rotary_emb)
        out = F.scaled_dot_product_attention(query, key, value).transpose(1, 2).reshape(batch, -1,
                                                                                         attn.heads * head_dim)
        if encoder_hidden_states is None:
            return out
        text, image = out.split([encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], 1)
        return attn.to_out[1](attn.to_out[0](image)), attn.to_add_out(text)


def test_a_flux_whose_attention_reads_the_key_shape_routes_its_double_stack():
    model, args, kwargs = build("diffusers Flux")
    model.set_attn_processor(KeyShapeProcessor())
    routed = rk.apply(model, rk.Route(start=1, end=4), example_inputs=args, example_kwargs=kwargs)
    table = next(s for s in report_of(routed).blocks[1].side_inputs if s.slot == "image_rotary_emb")
    assert [g.rest_first for g in table.tokens] == [True, True]  # the text's rows first, read off the block's cat
    rk.verify(model, routed, args, kwargs)


def test_simpletuners_tread_config_goes_into_apply_as_it_is():
    """SimpleTuner's documented Flux route: selection_ratio is the share routed around, the layer indices count
    over the double- and single-stream blocks, negative from the end."""
    model, args, kwargs = build("diffusers Flux (across both stacks)")
    tread_config = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}
    ours = report_of(rk.apply(model, rk.Route(start=2, end=-2, rate=0.5), example_inputs=args,
                                 example_kwargs=kwargs)).placed[0]
    theirs = report_of(rk.apply(model, tread_config, example_inputs=args, example_kwargs=kwargs)).placed[0]
    assert (theirs.start, theirs.end, theirs.route.rate, theirs.kept) == (ours.start, ours.end, 0.5, 8) == (2, 10, 0.5, 8)
    for bad in ({"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2}]}, {"routes": {"start_layer_idx": 2}}):
        with pytest.raises(rk.ConfigError, match="tread_config"):
            rk.apply(model, bad, example_inputs=args, example_kwargs=kwargs)


def test_the_importance_selector_keeps_the_tokens_of_largest_l1_norm():
    selector = rk.selectors.importance(0.0)
    stream = torch.randn(3, 10, 4)
    kept = selector(3, 10, 0.5, stream=stream)
    want = stream.abs().sum(-1).topk(5, dim=1).indices.sort(dim=1).values
    assert torch.equal(kept, want)


class _Mixer(torch.nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(torch.nn.functional.layer_norm(x, x.shape[-1:]))


class WithReference(torch.nn.Module):
    """A noisy latent and a reference image, each through a stack of its own, then one stack over both joined
    (latent first), as Flux3 runs an image condition; the reference's stack runs last."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.latent_in, self.reference_in = torch.nn.Linear(4, dim), torch.nn.Linear(4, dim)
        self.latent = torch.nn.ModuleList(_Mixer(dim) for _ in range(2))
        self.reference = torch.nn.ModuleList(_Mixer(dim) for _ in range(2))
        self.joint = torch.nn.ModuleList(_Mixer(dim) for _ in range(4))

    def forward(self, latents, reference):
        x, r = self.latent_in(latents), self.reference_in(reference)
        for block in self.latent:
            x = block(x)
        for block in self.reference:
            r = block(r)
        x = torch.cat([x, r], dim=1)
        for block in self.joint:
            x = block(x)
        return x[:, :latents.shape[1]]


def test_of_two_stacks_joining_the_next_the_chain_takes_the_one_the_image_made():
    """Flux3 with a reference image routed the reference's tokens and kept the noisy latent's as special: the
    chain went on through whichever stack joined last. It goes through the one made from the model's first
    input, and the reference's tokens are the joint stack's special ones."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 8, 4), torch.randn(2, 8, 4))
    plan = rk.inspect(WithReference(), inputs)
    assert [s.name for s in plan.stacks] == ["latent", "joint"]
    assert plan.stacks[1].special == tuple(range(-8, 0))

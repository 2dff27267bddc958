"""Values that cross a route's ends, on real models, each against the route written by hand with hooks.

TREAD defines what a route hands on: the kept tokens as its blocks made them, the routed ones at their value at
the route's start. The same rule holds for every per-token value besides the stream, by where it is made and
read: made before the route and read inside it (a long skip into a routed out-block), it is cut at the kept
tokens; made inside and read inside, it is the route's own; made inside and read after (a skip from a routed
in-block, hidden states per layer), it is put back like the stream; handed on unchanged by the routed blocks
(T5's relative position bias, made by the first layer and passed from layer to layer), the readers after the
route get it whole. U-ViT joins its skips with `torch.cat(..., dim=-1)`, HunyuanDiT inside its blocks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from zoo import uvit

import routekit as rk
from routekit.routing import gather_tokens, scatter_tokens

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class HandRoute:
    """A route placed by hand on `blocks` (the chain, in order) from `start` to `end`, keeping `kept` (B, K):
    the stream (each block's first argument) gathered before `start` and scattered into its value there after
    `end`; `cut(hand, i, args, kwargs)`, called for each block from `start` on, cuts block i's inputs made before
    the route (and hands the blocks after it what they read whole); an output of a routed block that a block after
    the route reads (found by identity) is put back like the stream."""

    def __init__(self, blocks, start: int, end: int, kept: torch.Tensor, cut=lambda hand, i, a, k: (a, k)):
        self.blocks, self.start, self.end, self.kept, self.cut = blocks, start, end, kept, cut
        self.full, self.made, self.handles = None, [], []

    def __enter__(self):
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(self._before(i), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._after(i)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _before(self, i):
        def hook(module, args, kwargs):
            args = list(args)
            if i == self.start:
                self.full = args[0]
                args[0] = gather_tokens(args[0], self.kept)
            if i >= self.start:
                args, kwargs = self.cut(self, i, tuple(args), kwargs)
                args = list(args)
            if i > self.end:  # a value a routed block made, read after the route: put back like the stream
                for made in self.made:
                    args = [scatter_tokens(self.full, self.kept, a) if a is made else a for a in args]
                    kwargs = {k: scatter_tokens(self.full, self.kept, v) if v is made else v for k, v in kwargs.items()}
            return tuple(args), kwargs
        return hook

    def _after(self, i):
        def hook(module, args, out):
            if not self.start <= i <= self.end:
                return None
            stream = out[0] if isinstance(out, tuple) else out
            self.made.append(stream)
            if i < self.end:
                return None
            back = scatter_tokens(self.full, self.kept, stream)
            return (back, *out[1:]) if isinstance(out, tuple) else back
        return hook


def _routed_and_hand(model, route: rk.Route, args: tuple, kwargs: dict, blocks, cut=lambda hand, i, a, k: (a, k)):
    """(routekit's training output, the hand route's on the same kept tokens, what verify found on the routed
    model)."""
    twin = copy.deepcopy(model).train()
    routed = rk.apply(model, routes=route, example_inputs=args, example_kwargs=kwargs, generator=_g(0)).train()
    torch.manual_seed(1)
    got = routed(*args, **kwargs)
    mask = rk.last_route_mask(routed)
    kept = (~mask).nonzero()[:, 1].view(len(mask), -1)
    placed = rk.inspect(routed).placed[0]
    torch.manual_seed(1)
    with HandRoute(blocks(twin), placed.start, placed.end, kept, cut):
        want = twin(*args, **kwargs)
    return got, want, rk.verify(routed, routed, example_inputs=args, example_kwargs=kwargs)


def _first(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def test_t5s_position_bias_handed_on_through_a_route_reaches_the_layers_after_it_whole():
    """T5's first layer makes a (1, heads, N, N) bias and every layer hands it on: the routed layers read it cut on
    both token axes, the layers after the route read it whole, and verify agrees."""
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=5, num_heads=4,
                                   relative_attention_num_buckets=8, dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(config)
    ids = torch.randint(0, 64, (2, 12), generator=_g(1))
    whole = []

    def cut(hand, i, args, kwargs):  # the bias the layer before the route made, at the kept tokens on both axes
        args = list(args)
        if i == 3:  # after the route: whole
            args[2] = whole[0]
        if i == 1:
            whole.append(args[2])
            bias, kept = args[2].expand(len(hand.kept), -1, -1, -1), hand.kept
            bias = bias.gather(2, kept[:, None, :, None].expand(-1, bias.shape[1], -1, bias.shape[3]))
            args[2] = bias.gather(3, kept[:, None, None, :].expand(-1, bias.shape[1], bias.shape[2], -1))
        return tuple(args), kwargs

    got, want, _ = _routed_and_hand(model, rk.Route(start=1, end=2), (ids,), {}, lambda m: m.encoder.block, cut)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)


def test_a_u_vit_route_from_its_in_blocks_into_its_out_blocks_puts_a_skip_made_inside_back_like_the_stream():
    """Route in_blocks.2 → out_blocks.0 across the mid-block: out_blocks.0 reads in_blocks.3's skip as the route
    made it; out_blocks.1, after the route, reads in_blocks.2's put back like the stream."""
    model, args, kwargs = uvit()
    got, want, _ = _routed_and_hand(model, rk.Route(start="in_blocks.2", end="out_blocks.0"), args, kwargs,
                                    lambda m: [*m.in_blocks, *m.out_blocks])
    torch.testing.assert_close(got, want)


def hunyuan_dit(layers: int = 6):
    """HunyuanDiT at the width of diffusers' tester, 6 layers: layers 0 and 1 make skips, 5 and 4 read them."""
    torch.manual_seed(0)
    model = diffusers.HunyuanDiT2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=layers,
                                        attention_head_dim=8, num_attention_heads=2, cross_attention_dim=8,
                                        cross_attention_dim_t5=8, pooled_projection_dim=4, hidden_size=16,
                                        text_len=4, text_len_t5=4)
    b = 2
    kwargs = {"hidden_states": torch.randn(b, 4, 8, 8, generator=_g(1)),
              "timestep": torch.tensor([10.0, 500.0]),
              "encoder_hidden_states": torch.randn(b, 4, 8, generator=_g(2)),
              "text_embedding_mask": torch.ones(b, 4),
              "encoder_hidden_states_t5": torch.randn(b, 4, 8, generator=_g(3)),
              "text_embedding_mask_t5": torch.ones(b, 4),
              "image_meta_size": torch.tensor([[1024.0, 1024, 16, 16, 0, 0]] * b),
              "style": torch.zeros(b, dtype=torch.long),
              "image_rotary_emb": (torch.randn(16, 8, generator=_g(4)), torch.randn(16, 8, generator=_g(5))),
              "return_dict": False}
    return model, kwargs


@pytest.mark.parametrize(("start", "end"), [(1, 3), (2, 4)], ids=["skip made inside, read after", "skip made "
                                                                   "before, read inside"])
def test_hunyuan_dit_routes_across_its_long_skips(start: int, end: int):
    """1 → 3: layer 1's skip, made inside, reaches layer 4 put back like the stream. 2 → 4: layer 4 reads layer
    1's skip, made before the route, cut at the kept tokens, as it cuts the rotary table. verify's reference,
    which does not read routekit's decisions, agrees."""
    model, kwargs = hunyuan_dit()

    def cut(hand, i, args, kwargs):
        if i > end:
            return args, kwargs
        assert (hand.kept == hand.kept[0]).all()  # the table has no batch axis, and the blocks take none: one selection
        kwargs = dict(kwargs)
        cos, sin = kwargs["image_rotary_emb"]
        kwargs["image_rotary_emb"] = (cos[hand.kept[0]], sin[hand.kept[0]])
        skip = kwargs.get("skip")
        if skip is not None and not any(skip is m for m in hand.made):
            kwargs["skip"] = gather_tokens(skip, hand.kept)
        return args, kwargs

    got, want, found = _routed_and_hand(model, rk.Route(start=start, end=end), (), kwargs, lambda m: m.blocks, cut)
    torch.testing.assert_close(_first(got), _first(want))
    assert "outputs match the original blocks with the routed tokens masked" in str(found)  # inner outputs put back

"""Per-token side inputs of any layout are routed with the tokens: position tables with the token axis
anywhere, with or without a batch axis, inside tuples and dicts, joined with another sequence's positions;
grid sizes handed to blocks as numbers.

The law, held on the random family of position-encoded models in `strategies.py` (`position_cases`): each
routed block computes exactly what the original block computes on the kept tokens (its inputs gathered at them
by hand there, never by routekit).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from strategies import POSITION_DIM, position_cases
from torch import nn

import routekit as rk
from routekit.model import report_of

DIM = POSITION_DIM


@settings(max_examples=40, deadline=None)
@given(case=position_cases())
def test_a_routed_block_computes_what_the_original_computes_on_the_kept_tokens(case):
    model, (x, text) = case.build(), case.inputs()
    routed = rk.apply(model, rk.Route(start=case.start, end=case.end, rate=0.5), example_inputs=(x, text),
                      mode=case.mode, generator=torch.Generator().manual_seed(case.seed))
    plan = report_of(routed)
    assert plan.blocks[case.start].side_inputs[0].kind == "per-token", plan
    seen = {}
    handle = routed.get_submodule(f"blocks.{case.start}").register_forward_hook(
        lambda module, args, out: seen.setdefault("out", out), prepend=True)  # before a hook executor's scatter
    routed.train()
    out = routed(x, text)
    handle.remove()
    placed = report_of(routed).placed[0]
    kept_index = (~rk.last_route_mask(routed)).nonzero()[:, 1].view(case.batch, -1)
    stream_in = x  # the stream entering the route's first block, run by hand
    for block in model.blocks[:case.start]:
        stream_in = block(stream_in, *model.side(x, text))
    kept = torch.stack([s[i] for s, i in zip(stream_in, kept_index)])
    want = model.blocks[case.start](kept, *model.side_at(x, text, kept_index))
    torch.testing.assert_close(seen["out"], want, rtol=0, atol=0)
    assert out.shape == x.shape and placed.kept == kept_index.shape[1]
    if case.layout in ("token first", "joint first", "joint last"):  # the consumer broadcasts a per-sample table
        assert not placed.shared


class SharedOnly(nn.Module):
    """A block whose table must stay unbatched: it reshapes it to (N, D) explicitly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x, table):
        return x + self.fc(x * table.reshape(x.shape[1], DIM))


class SharedOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(SharedOnly() for _ in range(4))

    def forward(self, x):
        table = torch.linspace(0, 1, x.shape[1] * DIM).view(x.shape[1], DIM)
        for block in self.blocks:
            x = block(x, table)
        return x


def test_a_table_the_block_cannot_take_per_sample_gets_one_selection_for_the_batch():
    torch.manual_seed(0)
    model, x = SharedOwner(), torch.randn(3, 8, DIM)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))
    plan = report_of(routed)
    assert plan.placed[0].shared and "one selection for the batch" in str(plan)
    routed.train()
    routed(x)
    mask = rk.last_route_mask(routed)
    assert (mask == mask[:1]).all() and mask.sum(1).tolist() == [4] * 3
    rk.verify(model, routed, (x,))


class GridSized(nn.Module):
    """A block handed the grid's height and width as numbers, which it reshapes its tokens with (as Sana's)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(DIM, DIM, 3, padding=1)

    def forward(self, x, height, width):
        image = x.transpose(1, 2).reshape(x.shape[0], DIM, height, width)
        return x + self.conv(image).flatten(2).transpose(1, 2)


class GridOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.blocks = nn.ModuleList(GridSized() for _ in range(4))

    def forward(self, image):
        x = self.embed(image)
        height, width = x.shape[2], x.shape[3]
        x = x.flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, height, width)
        return x


@pytest.mark.parametrize("mode", ["graph", "boundary"])
@pytest.mark.parametrize("selector", ["row", "column", "window"])
def test_grid_sizes_handed_to_blocks_as_numbers_follow_the_kept_grid(mode, selector):
    torch.manual_seed(0)
    model, image = GridOwner(), torch.randn(2, 3, 12, 16)
    routed = rk.apply(model, rk.Route(start=1, end=2, selector=selector), example_inputs=(image,), mode=mode)
    routed.train()
    assert routed(image).shape == (2, 48, DIM)
    rk.verify(model, routed, (image,))
    with pytest.raises(rk.ConfigError, match=r"sizes as numbers \(arguments 'height', 'width'\).*than the 6×8 one.*"
                                             r"keep such a grid on this one: 'column'.*'row'.*'window'"):  # + users'
        rk.apply(model, rk.Route(start=1, end=2, selector="importance"), example_inputs=(image,), mode=mode)


class VideoSized(nn.Module):
    """A block handed a video grid's frames, height and width as numbers (as SanaVideo's temporal convolution)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(DIM, DIM, 3, padding=1)

    def forward(self, x, frames, height, width):
        video = x.transpose(1, 2).reshape(x.shape[0], DIM, frames, height, width)
        return x + self.conv(video).flatten(2).transpose(1, 2)


class VideoOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv3d(3, DIM, (1, 2, 2), (1, 2, 2))
        self.blocks = nn.ModuleList(VideoSized() for _ in range(4))

    def forward(self, video):
        x = self.embed(video)
        frames, height, width = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, frames, height, width)
        return x


def test_a_video_grid_handed_to_blocks_names_the_selectors_that_fit_it():
    """Rows and windows of a T×H×W grid differ from frame to frame: no smaller grid. The refusal names what fits."""
    torch.manual_seed(0)
    model, video = VideoOwner(), torch.randn(2, 3, 4, 4, 4)
    with pytest.raises(rk.ConfigError, match=r"selector 'row''s do not; selectors that keep such a grid on this one: "
                                             r"'column', 'frame'") as refused:
        rk.apply(model, rk.Route(start=1, end=2, selector="row"), example_inputs=(video,))
    fitting = str(refused.value).rsplit(": ", 1)[1]
    assert "'row'" not in fitting and "'window'" not in fitting  # other selectors registered elsewhere may follow
    routed = rk.apply(model, rk.Route(start=1, end=2, selector="frame"), example_inputs=(video,))
    rk.verify(model, routed, (video,))
    assert routed.train()(video).shape == video.new_empty(2, 16, DIM).shape


def _dinov3(augment: bool):
    zoo = pytest.importorskip("zoo")
    try:
        return zoo.transformers_dinov3(augment)
    except zoo.Missing as err:
        pytest.skip(str(err))


@pytest.mark.parametrize(("mode", "rate", "example"), [("graph", 0.5, 2), ("boundary", 0.5, 2), ("graph", 0.25, 2),
                                                       ("boundary", 0.25, 2), ("graph", 0.5, 1)])
def test_a_table_over_the_image_tokens_only_is_cut_at_the_kept_image_tokens(mode, rate, example):
    """DINOv3's rotary table covers its 16 patches, not its class and 4 register tokens: a routed block must
    get the kept patches' rows, so that it still takes the 5 tokens before them for the prefix. Left whole, a
    rate of 0.25 ran with every kept token at a wrong position, and 0.5 failed. Its 2 heads meet a batch of 2:
    a table cut per sample, broadcast against the heads, runs and mixes samples, so the route selects once for
    the batch; an example of one sample shows no mixing, so the probe asks with two."""
    model, (image,), _ = _dinov3(augment=False)
    start = 2
    routed = rk.apply(model, rk.Route(start=start, end=4, rate=rate), example_inputs=(image[:example],), mode=mode)
    assert report_of(routed).placed[0].shared
    side = report_of(routed).blocks[start].side_inputs[0]
    assert side.kind == "per-token", side
    seen = {}
    handle = routed.get_submodule(f"model.layer.{start}").register_forward_hook(
        lambda m, a, out: seen.setdefault("out", out), prepend=True)  # before a hook executor's scatter
    routed.train()
    routed(image)
    handle.remove()
    kept = (~rk.last_route_mask(routed)).nonzero()[:, 1].view(2, -1)
    assert (kept[:, :5] == torch.arange(5)).all()
    with torch.no_grad():  # the stream entering block `start`, and each sample's kept tokens at their own rows
        cos, sin = model.rope_embeddings(image)
        x = model.embeddings(image)
        for layer in model.model.layer[:start]:
            x = layer(x, position_embeddings=(cos, sin))
        want = torch.cat([model.model.layer[start](x[b:b + 1, i], position_embeddings=(cos[i[5:] - 5], sin[i[5:] - 5]))
                          for b, i in enumerate(kept)])
    torch.testing.assert_close(seen["out"], want)
    rk.verify(model, routed, (image,))


def test_a_route_that_sets_aside_the_tokens_before_an_image_only_table_is_refused():
    model, (image,), _ = _dinov3(augment=False)
    with pytest.raises(rk.ConfigError, match=r"table over the image's tokens only.*keep=\[0, 1, 2, 3, 4\]"):
        rk.apply(model, rk.Route(start=1, end=4, keep=[]), example_inputs=(image,))


class CrossText(nn.Module):
    """A block cross-attending to a caption exactly as long as the image's patches."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)

    def forward(self, x, text):
        return x + self.attn(x, text, text, need_weights=False)[0]


class ClassTokenCaptioned(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.cls = nn.Parameter(torch.randn(1, 1, DIM))
        self.blocks = nn.ModuleList(CrossText() for _ in range(4))

    def forward(self, image, text):
        x = self.embed(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.blocks:
            x = block(x, text)
        return x


def test_a_sequence_as_long_as_the_image_tokens_that_the_block_takes_whole_is_not_cut():
    """The twin of the DINOv3 test: a caption of 16 tokens beside 1 + 16 stream tokens looks like a table over
    the patches by its length, but the block runs with it whole on fewer tokens, so it stays whole."""
    torch.manual_seed(0)
    model, image, text = ClassTokenCaptioned(), torch.randn(2, 3, 8, 8), torch.randn(2, 16, DIM)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(image, text))
    plan = report_of(routed)
    assert plan.special == (0,) and plan.blocks[1].side_inputs[0].kind == "per-sample", plan
    seen = {}
    handle = routed.get_submodule("blocks.1").register_forward_pre_hook(lambda m, args: seen.update(text=args[1]))
    routed.train()
    routed(image, text)
    handle.remove()
    assert seen["text"] is text or torch.equal(seen["text"], text)
    rk.verify(model, routed, (image, text))

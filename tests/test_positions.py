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

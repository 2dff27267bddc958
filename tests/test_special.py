"""Special tokens: every token the owner puts into the stream from something other than the image (text joined
in, register and class tokens, a duration token) is kept by every route, with or without a patch grid, in
either stack, in both modes; where routekit cannot tell which they are, a route without `keep` is refused by
name, never routed silently. The zoo (test_model_support.py) holds this on AuraFlow, StableAudio, Chroma,
Lumina2, ViT, Dinov2 and a U-ViT; the laws below hold it on models built to probe each path."""

from __future__ import annotations

import pytest
import torch
import zoo
from test_positions import DIM, GridSized
from torch import nn
from zoo import ZOO, Missing

import routekit as rk
from routekit.model import report_of


class Joined(nn.Module):
    """Text tokens and learned registers joined in front of a patch grid, then blocks that mix them all (as a
    single-stream stack does): measuring which tokens change with the image would call every one the image's."""

    def __init__(self, registers: int = 3):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.text = nn.Linear(5, DIM)
        self.registers = nn.Parameter(torch.randn(1, registers, DIM))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, 0.0, batch_first=True)
                                    for _ in range(4))

    def forward(self, image, text):
        patches = self.embed(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.registers.expand(image.shape[0], -1, -1), self.text(text), patches], dim=1)
        for block in self.blocks:
            x = block(x)
        return x


def joined_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 4, 5, generator=g)


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_tokens_joined_in_front_of_the_image_are_kept_in_both_modes(mode):
    torch.manual_seed(0)
    model, inputs = Joined(), joined_inputs()
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=inputs, mode=mode)
    plan = report_of(routed)
    assert plan.special == tuple(range(7)) and plan.grid == (4, 4)
    routed.train()
    routed(*inputs)
    mask = rk.last_route_mask(routed)
    assert not mask[:, :7].any() and mask[:, 7:].sum(1).tolist() == [8, 8]
    rk.verify(model, routed, inputs)


def test_without_a_grid_the_owners_tokens_are_special_all_the_same():
    class NoGrid(Joined):  # the image patchified by a Linear on packed latents: no patch grid anywhere
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(12, DIM)

        def forward(self, latents, text):
            x = torch.cat([self.registers.expand(latents.shape[0], -1, -1), self.text(text), self.embed(latents)], 1)
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = NoGrid()
    inputs = (torch.randn(2, 16, 12), joined_inputs()[1])
    plan = rk.inspect(model, inputs)
    assert plan.grid is None and plan.special == tuple(range(7))


class TimeToken(nn.Module):
    """A time token joined in front of the patches, cast to the image's dtype with `type_as` (OmniGen's), and
    registers shaped `expand_as` the patches: the image gives them a dtype and a shape, not its values."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.time = nn.Linear(1, DIM)
        self.registers = nn.Parameter(torch.randn(1, 2, DIM))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, 0.0, batch_first=True)
                                    for _ in range(4))

    def forward(self, image, t):
        patches = self.embed(image).flatten(2).transpose(1, 2)
        token = self.time(t[:, None].type_as(patches)).type_as(patches)
        registers = self.registers.expand_as(patches[:, :2])
        x = torch.cat([token[:, None], registers, patches, torch.zeros_like(patches[:, :1])], dim=1)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_a_token_that_takes_only_the_images_dtype_or_shape_is_special(mode):
    """`type_as(image)`, `expand_as(image)` and `zeros_like(image)` read what the image is, not what it holds: the
    time token, the registers and the padding token are the owner's (graph mode called them the image's, and
    routed them)."""
    torch.manual_seed(0)
    model, inputs = TimeToken(), (torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.7]))
    plan = rk.inspect(model, inputs, mode=mode)
    assert plan.special == (0, 1, 2, -1) and plan.grid == (4, 4), plan


def test_a_join_the_graph_does_not_show_is_refused_by_name_unless_keep_is_given():
    class Hidden(Joined):  # text and image joined, and mixed, inside a call the trace does not open (a leaf)
        def __init__(self):
            super().__init__()
            self.join = nn.ModuleList([JoinAndMix()])

        def forward(self, image, text):
            patches = self.embed(image).flatten(2).transpose(1, 2)
            x = self.join[0](self.text(text), patches)
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model, inputs = Hidden(), joined_inputs()
    with pytest.raises(rk.ConfigError, match=r"could not read off the graph which of the stream.s tokens were made "
                                             r"from the image.*pass keep=\[\.\.\.\]"):
        rk.apply(model, rk.Route(start=1, end=2), example_inputs=inputs)
    routed = rk.apply(model, rk.Route(start=1, end=2, keep=range(4)), example_inputs=inputs)
    routed.train()
    routed(*inputs)
    assert not rk.last_route_mask(routed)[:, :4].any()


def test_a_per_sample_join_of_image_and_caption_is_refused_unless_keep_is_given():
    """diffusers' Z-Image, never called before: its stream is built per sample (image tokens, then the caption
    padded to 32) and padded into a batch; the graph cannot tell the caption's tokens from the image's, so a
    route without `keep` is refused by name, and with the caption's positions kept never routes one of them."""
    try:
        model, args, kwargs = zoo.diffusers_zimage()
    except Missing as err:
        pytest.skip(str(err))
    with pytest.raises(rk.ConfigError, match=r"could not read off the graph which of the stream.s tokens were made "
                                             r"from the image.*pass keep=\[\.\.\.\]"):
        rk.apply(model, rk.Route(start=1, end=4), example_inputs=args)
    routed = rk.apply(model, rk.Route(start=1, end=4, keep=range(-32, 0)), example_inputs=args)
    assert report_of(routed).mode == "graph"
    rk.verify(model, routed, args)
    routed.train()
    routed(*args)
    mask = rk.last_route_mask(routed)
    assert mask.shape[1] == 96 and mask.any() and not mask[:, 64:].any()
    with torch.no_grad():
        model.eval()(*args)  # the model the traces ran still runs (its rotary cache is not left holding proxies)


class JoinAndMix(nn.Module):
    def forward(self, text, patches):
        x = torch.cat([text, patches], dim=1)
        return x + x.mean(1, keepdim=True)  # every token now changes with the image


def test_a_grid_given_for_the_image_tokens_of_a_joined_stream_is_taken():
    """AuraFlow's single-stream stack: 8 registers and the text before a 4×4 patch grid that no convolution shows;
    grid=(4, 4) names the image tokens' grid (it was refused for not covering the text)."""
    try:
        model, args, kwargs = ZOO["diffusers AuraFlow"].build()
    except Missing as err:
        pytest.skip(str(err))
    route = rk.Route(start="single_transformer_blocks.1", end="single_transformer_blocks.4", selector="row")
    routed = rk.apply(model, route, example_inputs=args, example_kwargs=kwargs, grid=(4, 4))
    assert report_of(routed).grid == (4, 4)
    routed.train()
    routed(*args, **kwargs)
    mask = rk.last_route_mask(routed)
    assert not mask[:, :13].any() and mask[:, 13:].view(2, 4, 4).all(2).sum(1).tolist() == [2, 2]  # whole rows
    alone = rk.apply(model, rk.Route(start=1, end=4, selector="row"), example_inputs=args, example_kwargs=kwargs,
                     grid=(4, 4), stack="single_transformer_blocks")  # the stack alone: 13 + 16 tokens
    assert report_of(alone).grid == (4, 4) and report_of(alone).tokens == 29
    with pytest.raises(rk.ConfigError, match="without its 13 special tokens, 16"):
        rk.apply(model, route, example_inputs=args, example_kwargs=kwargs, grid=(5, 5), stack="single_transformer_blocks")


class TextThenGrid(nn.Module):
    """77 text tokens joined in front of a 4×4 grid, blocks handed the grid's height and width as numbers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.text = nn.Linear(5, DIM)
        self.blocks = nn.ModuleList(TextGridSized() for _ in range(4))

    def forward(self, image, text):
        patches = self.embed(image)
        height, width = patches.shape[2], patches.shape[3]
        x = torch.cat([self.text(text), patches.flatten(2).transpose(1, 2)], dim=1)
        for block in self.blocks:
            x = block(x, height, width)
        return x


class TextGridSized(nn.Module):
    def __init__(self):
        super().__init__()
        self.grid = GridSized()
        self.seen: list[int] = []

    def forward(self, x, height, width):
        self.seen.append(height)
        text = x.shape[1] - height * width
        return torch.cat([x[:, :text], self.grid(x[:, text:], height, width)], dim=1)


def test_grid_sizes_shrink_by_the_grids_share_not_by_all_kept_tokens():
    """With many special tokens the kept grid's height is the kept rows (2 of 4), not the kept tokens' share of
    the grid's height (77 + 8 of 93 tokens would give 3): the audit's planted bug, which one class token hides."""
    torch.manual_seed(0)
    model = TextThenGrid()
    inputs = (torch.randn(2, 3, 8, 8), torch.randn(2, 77, 5))
    routed = rk.apply(model, rk.Route(start=1, end=2, selector="row"), example_inputs=inputs)
    plan = report_of(routed)
    assert plan.special == tuple(range(77)) and plan.placed[0].kept == 77 + 8
    for block in model.blocks:
        block.seen.clear()
    routed.train()
    routed(*inputs)
    assert [b.seen for b in model.blocks] == [[4], [2], [2], [4]]
    rk.verify(model, routed, inputs)

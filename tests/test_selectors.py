"""The selector contract, held at run time and by properties.

A selection is a LongTensor (batch, kept) whose rows are sorted, unique and in range; `random` draws an
independent subset per sample; rate 0 keeps every token without drawing; the built-ins cannot be
replaced by accident.
"""

from __future__ import annotations

import copy

import pytest
import torch
import zoo
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import D, Registers, Residual, Tokens, built, image, tokens, train_out
from torch import nn

import routekit as rk
from routekit.errors import ConfigError, InputError, SelectorError
from routekit.model import report_of
from routekit.routing import select_tokens, with_forced
from routekit.selectors import SelectorSpec, checked, importance, selector_names
from routekit.selectors import selector as selector_spec

DIM = 8


class Net(nn.Module):
    """Tokens in, tokens out, with dropout inside the blocks and after them."""

    def __init__(self, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Residual(DIM, dropout=0.5) for _ in range(depth))
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.drop(x)


def routed_with(selector: str, batch: int = 4, tokens: int = 12, rate: float = 0.5):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(batch, tokens, DIM)
    return model, rk.apply(model, rk.Route(start=1, end=2, rate=rate, selector=selector), example_inputs=(x,)), x


def _register_once(name: str, fn) -> None:
    if name not in selector_names():
        rk.register_selector(name)(fn)


@pytest.mark.parametrize("name, fn, rule", [
    ("t_duplicates", lambda b, n, rate, **kw: torch.zeros(b, n // 2, dtype=torch.long), "unique"),
    ("t_unsorted", lambda b, n, rate, **kw: torch.arange(n // 2).flip(0).expand(b, -1), "sorted"),
    ("t_out_of_range", lambda b, n, rate, **kw: torch.arange(1, n + 1)[: n // 2 + 1].expand(b, -1) + n // 2, "within"),
    ("t_wrong_dtype", lambda b, n, rate, **kw: torch.arange(n // 2).float().expand(b, -1), "LongTensor"),
    ("t_wrong_batch", lambda b, n, rate, **kw: torch.arange(n // 2).expand(b + 1, -1), "samples"),
    ("t_empty", lambda b, n, rate, **kw: torch.zeros(b, 0, dtype=torch.long), "kept"),
])
def test_a_selector_that_breaks_the_contract_is_refused_naming_the_rule(name, fn, rule):
    _register_once(name, fn)
    with pytest.raises(rk.SelectorError, match=rule):
        routed_with(name)


def test_built_in_selectors_cannot_be_replaced_by_accident():
    before = selector_spec("random").fn
    with pytest.raises(rk.ConfigError, match="override=True"):
        rk.register_selector("random")(lambda b, n, rate, **kw: torch.arange(n).expand(b, -1))
    assert selector_spec("random").fn is before
    _register_once("t_first", lambda b, n, rate, **kw: torch.arange(n // 2).expand(b, -1))
    with pytest.raises(rk.ConfigError, match="already registered"):
        rk.register_selector("t_first")(lambda b, n, rate, **kw: torch.arange(n // 2).expand(b, -1))

    def second(b, n, rate, **kw):
        return torch.arange(n - n // 2, n).expand(b, -1)

    rk.register_selector("t_first", override=True)(second)
    assert selector_spec("t_first").fn is second


def test_random_selects_per_sample():
    """A route's selection differs between the samples of a batch: TREAD draws a subset per sample."""
    _, routed, x = routed_with("random", batch=8, tokens=16)
    routed.train()
    routed(x)
    mask = rk.last_route_mask(routed)
    assert len({tuple(row.tolist()) for row in mask}) == 8


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(2, 64), tokens=st.integers(4, 64), rate=st.floats(0.1, 0.9), seed=st.integers(0, 2**16))
def test_random_draws_an_independent_uniform_subset_per_sample(batch, tokens, rate, seed):
    """Every sample keeps the same count, every position is equally likely, and samples do not share
    their draws: over many batches each position's keep frequency is near 1 - rate in every sample,
    and two samples agree on a position about as often as independence predicts."""
    generator = torch.Generator().manual_seed(seed)
    rounds = 400
    picks = torch.stack([select_tokens("random", batch, tokens, rate, grid=None, generator=generator, device="cpu")
                         for _ in range(rounds)])  # (rounds, batch, kept)
    kept = tokens - int(tokens * rate)
    assert picks.shape == (rounds, batch, kept)
    masks = torch.zeros(rounds, batch, tokens).scatter_(2, picks, 1.0)
    p = kept / tokens
    freq = masks.mean(0)  # (batch, tokens)
    assert (freq - p).abs().max() < 5 * (p * (1 - p) / rounds) ** 0.5 + 1e-6
    agree = (masks[:, 0] == masks[:, 1]).float().mean()
    expected = p * p + (1 - p) * (1 - p)
    assert abs(agree - expected) < 5 * (expected * (1 - expected) / (rounds * tokens)) ** 0.5 + 0.02


def test_rate_zero_keeps_every_token_and_draws_nothing():
    """At rate 0 a routed model with dropout makes exactly the draws the plain model makes."""
    model, routed, x = routed_with("random", rate=0.0)
    model.train()
    routed.train()
    torch.manual_seed(3)
    want = model(x)
    torch.manual_seed(3)
    got = routed(x)
    assert torch.equal(got, want)
    assert not rk.last_route_mask(routed).any()


def test_negative_block_indices_count_from_the_end():
    """SimpleTuner's convention: -1 is the last block. A route 1→-2 on 4 blocks covers blocks 1..2."""
    torch.manual_seed(0)
    model = Net(depth=4)
    x = torch.randn(2, 12, DIM)
    routed = rk.apply(model, rk.Route(start=1, end=-2), example_inputs=(x,))
    placed = report_of(routed).placed[0]
    assert (placed.start, placed.end) == (1, 2)
    assert "route 0: blocks 1→2" in str(report_of(routed))
    explicit = rk.apply(rk.strip(copy.deepcopy(routed)), rk.Route(start=1, end=2), example_inputs=(x,))
    for r in (routed, explicit):
        r.routekit.routes[0].generator = torch.Generator().manual_seed(4)
        r.train()
        torch.manual_seed(1)
    torch.manual_seed(1)
    a = routed(x)
    torch.manual_seed(1)
    assert torch.equal(a, explicit(x))
    with pytest.raises(rk.ConfigError, match="-4..-1"):
        rk.apply(model, rk.Route(start=-5, end=-1), example_inputs=(x,))
    with pytest.raises(rk.ConfigError, match="after its end"):
        rk.apply(model, rk.Route(start=-1, end=1), example_inputs=(x,))
    with pytest.raises(rk.ConfigError, match="start"):
        rk.Route(start=-1, end=-3)


class Video(nn.Module):
    """A Conv3d patch embedding over (frames, height, width): the stream's tokens are a T×H×W grid."""

    def __init__(self, depth: int = 4):
        super().__init__()
        self.embed = nn.Conv3d(3, DIM, (1, 2, 2), (1, 2, 2))
        self.blocks = nn.ModuleList(Residual(DIM, dropout=0.5) for _ in range(depth))

    def forward(self, video):
        x = self.embed(video).flatten(2).transpose(1, 2)  # (B, T·H·W, D)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("selector", ["frame", "tube", "row", "column"])
def test_video_grids_are_read_off_a_conv3d_and_grid_selectors_keep_whole_lines(selector):
    torch.manual_seed(0)
    model = Video()
    video = torch.randn(2, 3, 4, 6, 8)  # T=4 frames of 3×4 patches
    routed = rk.apply(model, rk.Route(start=1, end=2, selector=selector), example_inputs=(video,),
                      generator=torch.Generator().manual_seed(1))
    assert report_of(routed).grid == (4, 3, 4)
    routed.train()
    routed(video)
    kept = ~rk.last_route_mask(routed).reshape(2, 4, 3, 4)  # (B, T, H, W)
    if selector == "frame":
        assert (kept.flatten(2).all(2) | ~kept.flatten(2).any(2)).all() and kept.flatten(2).all(2).sum(1).eq(2).all()
    if selector == "tube":  # the same positions in every frame
        assert (kept == kept[:, :1]).all() and kept[:, 0].sum((1, 2)).eq(6).all()
    if selector == "row":
        assert (kept.all(3) | ~kept.any(3)).all()
    if selector == "column":
        assert (kept.all(2) | ~kept.any(2)).all() and (kept == kept[:, :1]).all()


def test_sprints_structured_selection_keeps_the_same_share_of_every_cell_and_refuses_a_grid_without_cells():
    """structured_with_random_offset at rate 0.75 on a 2×4×4 video grid: cells of 2×2×2, two tokens kept in each,
    drawn per cell and per sample. On a 4×3×4 grid no side divides every axis: refused, naming the grid and what
    would do."""
    torch.manual_seed(0)
    routed = rk.apply(Video(), rk.Route(start=1, end=2, rate=0.75, selector="structured_with_random_offset"),
                      example_inputs=(torch.randn(3, 3, 2, 8, 8),), generator=torch.Generator().manual_seed(1))
    assert report_of(routed).grid == (2, 4, 4)
    routed.train()
    routed(torch.randn(3, 3, 2, 8, 8))
    kept = ~rk.last_route_mask(routed).reshape(3, 1, 2, 2, 2, 2, 2)  # (B, T cells, 2, H cells, 2, W cells, 2)
    per_cell = kept.permute(0, 1, 3, 5, 2, 4, 6).flatten(4).sum(4)  # (B, cells...)
    assert per_cell.eq(2).all()
    assert not (kept[0] == kept[1]).all() or not (kept[1] == kept[2]).all()  # each sample draws its own
    with pytest.raises(ConfigError, match=r"4×3×4 grid.*rate 0.75 keeps one token of every 2×2 cell"):
        rk.apply(Video(), rk.Route(start=1, end=2, rate=0.75, selector="structured_with_random_offset"),
                 example_inputs=(torch.randn(2, 3, 4, 6, 8),))


class Reordered(nn.Module):
    """A patch grid whose tokens the owner may reorder before the blocks: `windows` puts each 2×2 window's four
    tokens one after another (Hiera's mask units), `columns` reads the grid column by column, `flipped` reverses
    the tokens (every row and column is still one, the other way round). `reshape=True`
    patchifies by reshaping the image behind a class token, so the grid is measured off the image, not a conv."""

    def __init__(self, order: str, reshape: bool = False):
        super().__init__()
        self.order, self.reshape = order, reshape
        self.embed = nn.Linear(3 * 4, DIM) if reshape else nn.Conv2d(3, DIM, 2, 2)
        self.cls = nn.Parameter(torch.randn(1, 1, DIM))
        self.blocks = nn.ModuleList(Residual(DIM) for _ in range(4))

    def forward(self, image):
        b, _, h, w = image.shape
        if self.reshape:  # (B, 3, H, W) → (B, H/2, W/2, 12) → a (B, D, H/2, W/2) grid, made by no module
            x = self.embed(image.reshape(b, 3, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).flatten(3))
            x = x.permute(0, 3, 1, 2)
        else:
            x = self.embed(image)
        d, h, w = x.shape[1:]
        if self.order == "windows":
            x = x.reshape(b, d, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, h * w, d)
        elif self.order == "columns":
            x = x.transpose(2, 3).flatten(2).transpose(1, 2)
        elif self.order == "flipped":
            x = x.flatten(2).transpose(1, 2).flip(1)
        else:
            x = x.flatten(2).transpose(1, 2)
        if self.reshape:
            x = torch.cat([self.cls.expand(b, -1, -1), x], dim=1)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("mode", ["graph", "boundary"])
@pytest.mark.parametrize("order", ["windows", "columns"])
def test_a_grid_whose_tokens_are_reordered_before_the_blocks_is_refused_to_grid_selectors(order, mode):
    """A run of the stream is a row of the image only if the tokens reach the blocks in the grid's raster order,
    which no graph shows: `row` kept whole 2×2 windows as rows of Hiera, scattered over the image, silently. The
    order is measured; a reordered grid is refused to grid selectors by name, `random` still routes it."""
    torch.manual_seed(0)
    model, x = Reordered(order), torch.randn(2, 3, 8, 8)
    with pytest.raises(rk.ConfigError, match=r"selector 'row' keeps runs of tokens as lines of the grid, but the "
                                             r"image's tokens enter blocks.0 in an order whose lines are not the "
                                             r"image's: within one row of the stream's 4×4 grid the image's row "
                                             r"changes \(token [12] comes from embed's cell 4,"):
        rk.apply(model, rk.Route(start=1, end=2, selector="row"), example_inputs=(x,), mode=mode)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,), mode=mode)
    assert "its lines reach the blocks broken up" in str(rk.inspect(model, (x,), mode=mode))
    rk.verify(model, routed, (x,))
    given = rk.apply(model, rk.Route(start=1, end=2, selector="row"), example_inputs=(x,), mode=mode, grid=(4, 4))
    assert report_of(given).grid == (4, 4)  # the user's grid is taken as the stream's own order


@pytest.mark.parametrize("mode", ["graph", "boundary"])
@pytest.mark.parametrize(("order", "reshape"), [("raster", False), ("raster", True), ("flipped", False)])
def test_a_grid_whose_lines_are_the_images_keeps_its_rows_whether_a_conv_or_a_reshape_made_it(order, reshape, mode):
    """The twin: tokens in the grid's own order, from a patch conv or from the image reshaped behind a class
    token (measured off the image's pixels then), or reversed (each line still one): `row` routes, and the rows
    it keeps are the image's."""
    torch.manual_seed(0)
    model, x = Reordered(order, reshape), torch.randn(2, 3, 8, 8)
    routed = rk.apply(model, rk.Route(start=1, end=2, selector="row"), example_inputs=(x,), mode=mode,
                      generator=torch.Generator().manual_seed(1))
    plan = report_of(routed)
    assert plan.grid == (4, 4) and plan.report.reordered is None and plan.special == ((0,) if reshape else ())
    rk.verify(model, routed, (x,))
    routed.train()
    routed(x)
    kept = ~rk.last_route_mask(routed)[:, 1:] if reshape else ~rk.last_route_mask(routed)
    kept = kept.reshape(2, 4, 4)
    assert (kept.all(2) | ~kept.any(2)).all() and kept.all(2).sum(1).eq(2).all()


class Checked(Reordered):
    """An owner that checks its patch features' range (as a model guarding against overflow might): the values
    the order's measurement puts in fail the check."""

    def __init__(self):
        super().__init__("raster")

    def forward(self, image):
        if self.embed(image).abs().amax() > 6:
            raise ValueError("patch features out of range")
        return super().forward(image)


def test_a_model_that_refuses_the_values_measuring_puts_in_keeps_its_grid_unmeasured():
    """apply failed: a measurement is not the model's use, so a model that refuses its values leaves the order
    unmeasured (nothing claimed) and the grid serves grid selectors as before."""
    torch.manual_seed(0)
    model, x = Checked(), torch.randn(2, 3, 8, 8)
    routed = rk.apply(model, rk.Route(start=1, end=2, selector="row"), example_inputs=(x,), mode="boundary")
    assert report_of(routed).grid == (4, 4) and report_of(routed).report.reordered is None
    rk.verify(model, routed, (x,))


def test_a_column_by_column_grid_made_by_reshaping_the_image_is_refused_to_grid_selectors():
    torch.manual_seed(0)
    model, x = Reordered("columns", reshape=True), torch.randn(2, 3, 8, 8)
    with pytest.raises(rk.ConfigError, match=r"within one row of the stream's 4×4 grid the image's row changes "
                                             r"\(token 2 comes from the image's cell 4,"):
        rk.apply(model, rk.Route(start=1, end=2, selector="column"), example_inputs=(x,))


def test_hiera_whose_mask_units_reorder_its_patches_is_refused_to_grid_selectors_and_routes_at_random():
    """timm's Hiera lays its patches out by mask unit before the blocks; with its first stage the longest, that
    stage is the stack and the patch conv's grid has as many cells as it has tokens, so `row` would keep mask
    units for rows."""
    try:
        hiera = zoo.package("timm.models.hiera")
    except zoo.Missing as err:
        pytest.skip(str(err))
    torch.manual_seed(0)
    model = hiera.Hiera(img_size=(64, 64), embed_dim=16, num_heads=1, stages=(3, 1, 1, 1), num_classes=4,
                        mask_unit_size=(4, 4), global_pos_size=(4, 4))  # its patch conv's 7×7 kernels overlap
    x = torch.randn(2, 3, 64, 64)
    with pytest.raises(rk.ConfigError, match=r"in an order whose lines are not the image's: within one row of the "
                                             r"stream's 16×16 grid the image's row changes \(token \d+ comes from "
                                             r"patch_embed.proj's cell"):
        rk.apply(model, rk.Route(start=0, end=1, selector="row"), example_inputs=(x,))
    routed = rk.apply(model, rk.Route(start=0, end=1), example_inputs=(x,))
    rk.verify(model, routed, (x,))


def test_frame_and_tube_need_a_video_grid():
    torch.manual_seed(0)
    with pytest.raises(rk.ConfigError, match="T×H×W"):
        select_tokens("frame", 2, 12, 0.5, grid=(3, 4), generator=None, device="cpu")


def test_importance_keeps_the_largest_tokens_and_mixes_in_chance():
    from routekit.selectors import importance

    stream = torch.randn(3, 20, DIM)
    norms = stream.abs().sum(-1)
    top = norms.topk(10, dim=1).indices.sort(1).values
    by_norm = importance(mix=0.0)(3, 20, 0.5, stream=stream, generator=torch.Generator().manual_seed(0))
    assert torch.equal(by_norm, top)
    mixed = select_tokens("importance", 3, 20, 0.5, grid=None, generator=torch.Generator().manual_seed(0),
                          device="cpu", stream=stream)
    assert mixed.shape == (3, 10) and not torch.equal(mixed, top)
    with pytest.raises(rk.ConfigError, match="mix"):
        importance(mix=1.5)


def test_the_importance_selector_routes_a_model():
    _, routed, x = routed_with("importance")
    routed.train()
    routed(x)
    assert rk.last_route_mask(routed).sum(1).tolist() == [6] * 4


@pytest.mark.parametrize("selector", ["random", "importance"])
def test_force_keep_masks_are_never_routed_and_the_batch_keeps_one_count(selector):
    _, routed, x = routed_with(selector, batch=4, tokens=12, rate=0.5)
    routed.train()
    force = torch.zeros(4, 12, dtype=torch.bool)
    force[0, :3] = True  # fewer than the 6 the route keeps: the count stays 6
    force[1, 5] = True
    with rk.force_keep(routed, force):
        routed(x)
    routed_out = rk.last_route_mask(routed)
    assert not (routed_out & force).any() and (~routed_out).sum(1).tolist() == [6] * 4
    force[2, :9] = True  # more than 6: every sample keeps 9, so the blocks see one shape
    with rk.force_keep(routed, force):
        out = routed(x)
    routed_out = rk.last_route_mask(routed)
    assert not (routed_out & force).any() and (~routed_out).sum(1).tolist() == [9] * 4
    assert out.shape == x.shape
    routed(x)  # outside the block the mask is gone
    assert (~rk.last_route_mask(routed)).sum(1).tolist() == [6] * 4


def test_force_keep_refuses_what_it_cannot_honour():
    _, routed, x = routed_with("random")
    with pytest.raises(rk.InputError, match="bool"):
        with rk.force_keep(routed, torch.ones(4, 12)):
            pass
    routed.train()
    with pytest.raises(rk.SelectorError, match="batch"):
        with rk.force_keep(routed, torch.ones(3, 12, dtype=torch.bool)):
            routed(x)


def test_force_keep_refuses_a_mask_that_is_not_batch_by_tokens_at_once():
    routed = rk.apply(built(Tokens), rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    with pytest.raises(InputError, match="bool"):
        with rk.force_keep(routed, torch.ones(6, dtype=torch.bool)):
            pass


def test_at_rate_zero_a_force_keep_mask_changes_nothing_whatever_the_selector():
    model = built(Registers)
    routed = rk.apply(model, rk.Route(start=0, end=1, rate=0.0, selector="row", keep=[0, 1]), example_inputs=image())
    with rk.force_keep(routed, torch.ones(2, 26, dtype=torch.bool)):
        train_out(routed, image())
    assert not rk.last_route_mask(routed).any()


def test_a_force_keep_mask_must_be_bool_and_cover_the_stream():
    index = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(SelectorError, match="bool"):
        with_forced(index, torch.ones(2, 4), "random", None, 4)
    with pytest.raises(SelectorError, match=r"here \(2, 4\); got torch.bool \(2, 5\)"):
        with_forced(index, torch.ones(2, 5, dtype=torch.bool), "random", None, 4)


def test_register_selector_hands_back_the_function_it_decorates():
    def halves(batch, n, rate, **kw):
        return torch.arange(n - n // 2).expand(batch, -1)

    assert rk.register_selector("t_halves_decorated", override=True)(halves) is halves


def test_which_selectors_keep_whole_rows():
    names = ("row", "window", "frame", "column", "random")
    assert [selector_spec(name).keeps_rows for name in names] == [True] * 3 + [False] * 2


def test_a_selector_returning_something_other_than_a_tensor_is_refused_naming_the_contract():
    rk.register_selector("t_list", override=True)(lambda batch, n, rate, **kw: [[0, 1]] * batch)
    with pytest.raises(SelectorError, match="LongTensor"):
        select_tokens("t_list", 2, 4, 0.5, grid=None, generator=None, device="cpu")


def test_a_selection_of_one_token_per_sample_is_valid():
    one = torch.zeros(3, 1, dtype=torch.long)
    assert checked("random", one, 3, 4) is one


def test_a_custom_selector_returning_a_valid_selection_routes_and_one_index_past_the_end_is_refused():
    rk.register_selector("t_last_two", override=True)(lambda batch, n, rate, **kw: torch.arange(n - 2, n).expand(
        batch, -1))
    rk.register_selector("t_past_end", override=True)(lambda batch, n, rate, **kw: torch.arange(n - 1, n + 1).expand(
        batch, -1))
    assert select_tokens("t_last_two", 2, 5, 0.5, grid=None, generator=None, device="cpu").tolist() == [[3, 4]] * 2
    with pytest.raises(SelectorError, match="sorted, unique and within"):
        select_tokens("t_past_end", 2, 5, 0.5, grid=None, generator=None, device="cpu")


def test_importance_by_default_mixes_half_chance_and_at_full_chance_is_random():
    stream = torch.randn(3, 10, D, generator=torch.Generator().manual_seed(0))

    def picks(fn, **kw):
        return fn(3, 10, 0.5, generator=torch.Generator().manual_seed(7), device="cpu", **kw)

    assert torch.equal(picks(importance(), stream=stream), picks(importance(0.5), stream=stream))
    assert torch.equal(picks(importance(1.0), stream=stream), picks(selector_spec("random").fn))


def test_the_column_selector_keeps_a_share_of_the_columns():
    assert selector_spec("column").kept_grid((4, 6), 0.5) == (4, 3)
    assert selector_spec("column").kept_grid((2, 4, 6), 0.25) == (2, 4, 5)


def test_a_grid_selector_without_a_grid_asks_for_one():
    with pytest.raises(ConfigError, match="grid="):
        selector_spec("row").fn(2, 16, 0.5, grid=None)


# ---- laws the first mutmut run found unheld (docs/mutation.md) ----------------------------------------------------


def test_a_registered_selector_keeps_the_flags_it_was_registered_with_and_none_it_was_not():
    def fn(batch, n, rate, **kw):
        return torch.arange(n - n // 2).expand(batch, -1)

    def kept_grid(grid, rate):
        return grid

    rk.register_selector("t_flagged", needs_grid=True, keeps_rows=True, needs_stream=True, kept_grid=kept_grid,
                         override=True)(fn)
    rk.register_selector("t_plain", override=True)(fn)
    assert selector_spec("t_flagged") == SelectorSpec(fn, True, True, True, kept_grid)
    assert selector_spec("t_plain") == SelectorSpec(fn)


@pytest.mark.parametrize("name", ["", 3, None])
def test_a_selector_name_that_is_not_a_non_empty_string_is_refused(name):
    with pytest.raises(rk.ConfigError, match="non-empty string"):
        rk.register_selector(name)


def test_a_custom_selection_may_start_at_token_zero_and_may_not_start_below_it():
    rk.register_selector("t_first_two", override=True)(lambda batch, n, rate, **kw: torch.arange(2).expand(batch, -1))
    rk.register_selector("t_negative", override=True)(
        lambda batch, n, rate, **kw: torch.tensor([-1, 0, 1]).expand(batch, -1))
    assert select_tokens("t_first_two", 2, 5, 0.5, grid=None, generator=None, device="cpu").tolist() == [[0, 1]] * 2
    with pytest.raises(SelectorError, match="sorted, unique and within"):
        select_tokens("t_negative", 2, 5, 0.5, grid=None, generator=None, device="cpu")


def test_importance_scales_each_samples_norms_to_the_unit_range_before_mixing_in_chance():
    """Samples whose norms differ in offset and spread are ranked alike: each is scaled by its own min and max."""
    base = torch.randn(1, 10, D, generator=torch.Generator().manual_seed(0))
    stream = torch.cat([base, 100 * base + 7, 0.01 * base])  # one ranking by norm, three ranges
    draw = torch.rand(3, 10, generator=torch.Generator().manual_seed(7))
    norm = stream.abs().sum(-1)
    low, high = norm.amin(1, keepdim=True), norm.amax(1, keepdim=True)
    want = (0.7 * (norm - low) / (high - low) + 0.3 * draw).topk(5, dim=1).indices.sort(1).values
    got = importance(0.3)(3, 10, 0.5, stream=stream, generator=torch.Generator().manual_seed(7), device="cpu")
    assert torch.equal(got, want)

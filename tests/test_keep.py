"""Special tokens: `Route(keep=...)` positions are in every selection, and analysis finds them where it can.

Laws: the kept set always contains `keep`; the selector picks among the other tokens and `rate` applies
to those; grid selectors see the grid of the other tokens; a stream built as patch grid + k other tokens
(a `cat` along the token axis) reports those k positions and refuses a route that would set them aside.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import routekit as rk
from routekit.model import report_of
from routekit.probe import kept_tokens
from routekit.routing import resolve_keep, select_tokens

DIM = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + self.proj(x)


class Joint(nn.Module):
    """Patch tokens of a 4×6 grid, joined with `prefix` learned tokens before and `suffix` text tokens after."""

    def __init__(self, prefix: int, suffix: int, depth: int = 4):
        super().__init__()
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.prefix = nn.Parameter(torch.randn(1, prefix, DIM))
        self.text = nn.Linear(5, DIM)
        self.suffix = suffix
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])

    def forward(self, image, text):
        parts = [self.prefix.expand(image.shape[0], -1, -1), self.embed(image).flatten(2).transpose(1, 2)]
        if self.suffix:
            parts.append(self.text(text))
        x = torch.cat(parts, dim=1)
        for block in self.blocks:
            x = block(x)
        return x


def joint(prefix: int, suffix: int) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return Joint(prefix, suffix), (torch.randn(2, 3, 8, 12), torch.randn(2, max(suffix, 1), 5))


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(2, 40), rate=st.floats(0, 0.99), data=st.data())
def test_the_selection_always_holds_keep_and_the_rate_applies_to_the_other_tokens(tokens: int, rate: float,
                                                                                 data) -> None:
    keep = data.draw(st.lists(st.integers(-tokens, tokens - 1), max_size=tokens - 1, unique_by=lambda i: i % tokens))
    route = rk.Route(start=0, end=0, rate=rate, keep=keep)
    resolved = resolve_keep(route.keep, tokens)
    index = select_tokens("random", 3, tokens, rate, resolved, grid=None,
                          generator=torch.Generator().manual_seed(0), device="cpu")
    others = tokens - len(keep)
    assert index.shape == (3, len(keep) + others - int(others * rate)) == (3, kept_tokens("random", rate, resolved,
                                                                                           tokens, None))
    assert (index.diff(dim=1) > 0).all() and index.min() >= 0 and index.max() < tokens
    for row in index.tolist():
        assert {i % tokens for i in keep} <= set(row)


@pytest.mark.parametrize(("prefix", "suffix", "special"), [(1, 0, [0]), (5, 0, [0, 1, 2, 3, 4]), (0, 3, [-3, -2, -1]),
                                                           (1, 2, [0, -2, -1])])
@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_tokens_joined_to_the_patch_grid_are_found_and_kept(prefix: int, suffix: int, special: list, mode: str) -> None:
    """Found in both modes (graph mode reads the cat; boundary mode measures which tokens do not depend on the
    patch embedding), and kept by every route unless keep=[] says to route them too."""
    model, inputs = joint(prefix, suffix)
    report = rk.inspect(model, inputs, mode=mode)
    assert report.grid == (4, 6) and report.tokens == 24 + prefix + suffix
    assert sorted(i % report.tokens for i in report.special) == sorted(i % report.tokens for i in special)
    assert "routes keep them" in str(report)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=inputs, mode=mode)
    placed = report_of(routed).placed[0]
    assert placed.keep == tuple(sorted(i % report.tokens for i in special))
    assert "(found: class/register/text tokens" in str(report_of(routed))
    routed.train()
    for _ in range(3):
        routed(*inputs)
        assert not rk.last_route_mask(routed)[:, list(special)].any()
    everything = rk.apply(model, rk.Route(start=1, end=2, keep=[]), example_inputs=inputs, mode=mode)
    assert report_of(everything).placed[0].keep == ()  # routing them too, when asked


@pytest.mark.parametrize("selector", ["random", "row", "window", "column"])
def test_routed_models_never_set_the_kept_tokens_aside_and_grid_selectors_keep_grid_lines(selector: str) -> None:
    model, inputs = joint(1, 2)
    special = list(rk.inspect(model, inputs).special)
    routed = rk.apply(model, rk.Route(start=1, end=2, selector=selector, keep=special), example_inputs=inputs,
                      generator=torch.Generator().manual_seed(0))
    assert rk.verify(model, routed, inputs).mode == "graph"
    routed.train()
    for _ in range(5):
        routed(*inputs)
        routed_mask = rk.last_route_mask(routed)
        assert not routed_mask[:, special].any()
        grid = routed_mask[:, 1:-2].reshape(2, 4, 6)
        if selector in ("row", "window"):
            assert (grid.all(2) | ~grid.any(2)).all()  # whole rows of the 4×6 grid
        if selector == "column":
            assert (grid.all(1) | ~grid.any(1)).all()
    assert (~routed_mask).sum(1).tolist() == [report_of(routed).placed[0].kept] * 2


def test_grid_selectors_need_keep_to_be_exactly_the_tokens_beside_the_grid() -> None:
    model, inputs = joint(1, 2)
    for keep in ([], [0], [0, -1], [0, 1, -2, -1]):
        with pytest.raises(rk.ConfigError, match="selector 'row' picks from the 4×6 grid"):
            rk.apply(model, rk.Route(start=1, end=2, selector="row", keep=keep), example_inputs=inputs)


@pytest.mark.parametrize("keep", [[27], [-28], [0, 1000]])
def test_keep_positions_outside_the_stream_are_refused_with_the_valid_range(keep: list) -> None:
    model, inputs = joint(1, 2)
    with pytest.raises(rk.ConfigError, match=r"outside the stream's 27 tokens \(valid positions are -27\.\.26"):
        rk.apply(model, rk.Route(start=1, end=2, keep=keep), example_inputs=inputs)
    with pytest.raises(rk.ConfigError, match="outside the stream"):
        rk.inspect(model, inputs, routes=rk.Route(start=1, end=2, keep=keep))


def test_keeping_every_token_is_refused() -> None:
    model, inputs = joint(1, 2)
    with pytest.raises(rk.ConfigError, match="keeps all 27 tokens"):
        rk.apply(model, rk.Route(start=1, end=2, keep=range(27)), example_inputs=inputs)


@pytest.mark.parametrize(("keep", "message"), [("prefix:1", "list of token positions"), ([0, 0], "twice"),
                                               ([0.5], "integer token positions"), ([True], "integer token positions"),
                                               (3, "list of token positions")])
def test_keep_is_validated_as_a_list_of_positions(keep, message: str) -> None:
    with pytest.raises(rk.ConfigError, match=message):
        rk.Route(start=0, end=1, keep=keep)
    assert rk.Route(start=0, end=1, keep=range(3)).keep == (0, 1, 2)
    assert rk.Route(start=0, end=1, keep=torch.tensor([0, -1]).tolist()).keep == (0, -1)


def test_the_report_counts_kept_tokens_in_its_flop_estimate() -> None:
    model, inputs = joint(1, 0)
    report = rk.inspect(model, inputs, routes=rk.Route(start=0, end=3, rate=0.5, keep=[0]))
    assert "13 of 25 tokens go through" in str(report)  # 1 kept + 12 of the 24 patch tokens
    assert "always keeping [0]" in str(report)

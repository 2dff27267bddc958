"""Fuzzing the error contract: whatever a caller passes, routekit routes it or raises a RoutekitError.

Route plans and example inputs are generated broken on purpose (one field or one tensor corrupted at a
time, plus whole-value garbage), and every public entry point that takes them must refuse with a
routekit error (ConfigError, InputError, TraceError, AnalysisError), never a TypeError, a pydantic
ValidationError or a torch RuntimeError. Plans and input shapes drawn at random, valid or not, must
either work (and then train) or be refused the same way.

CI runs ROUTEKIT_FUZZ_EXAMPLES=200 examples per property (the default); a long run:
    ROUTEKIT_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz.py -s
prints how many invalid plans and inputs were refused.
"""

from __future__ import annotations

import collections
import copy
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import routekit as rk
from routekit.model import report_of
from routekit.selectors import selector_names

EXAMPLES = int(os.environ.get("ROUTEKIT_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
COUNTS: collections.Counter = collections.Counter()
DEPTH, GRID, CHANNELS = 4, (4, 4), 3


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.proj(x)
        return x + (y if mask is None else y * mask[..., None])


class Net(nn.Module):
    """Patch embedding (a 4×4 grid from 8×8 images), a fixed position table, optional class token, 4 blocks."""

    def __init__(self, cls_token: bool, dim: int = 8):
        super().__init__()
        self.embed = nn.Conv2d(CHANNELS, dim, 2, 2)
        self.pos = nn.Parameter(torch.randn(1, GRID[0] * GRID[1], dim) * 0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None
        self.blocks = nn.ModuleList([Block(dim) for _ in range(DEPTH)])
        self.head = nn.Linear(dim, 2)

    def forward(self, image: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(image).flatten(2).transpose(1, 2) + self.pos
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


torch.manual_seed(0)
MODELS = {False: Net(cls_token=False), True: Net(cls_token=True)}
IMAGE = torch.randn(2, CHANNELS, 8, 8)
SELECTORS = ("random", "row", "window", "column")


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print(f"\nfuzz counts ({EXAMPLES} examples per property): {dict(sorted(COUNTS.items()))}; "
          f"invalid plans and inputs refused with a routekit error: {COUNTS['invalid refused']}")


def refused(call, kind: str) -> rk.RoutekitError:
    """`call()` must raise a RoutekitError with a message; anything else fails the property."""
    with pytest.raises(rk.RoutekitError) as err:
        call()
    assert str(err.value).strip()
    COUNTS["invalid refused"] += 1
    COUNTS[kind] += 1
    return err.value


garbage = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.binary(max_size=4), st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.just(object()), st.just(torch.zeros(2)),
)


@st.composite
def valid_route(draw, cls_token: bool) -> dict:
    start = draw(st.integers(0, DEPTH - 1))
    route = {"start": start, "end": draw(st.integers(start, DEPTH - 1)),
             "rate": draw(st.floats(0.0, 0.95)), "selector": draw(st.sampled_from(SELECTORS))}
    if cls_token:
        route["keep"] = [0]
    return route


def corrupt_route(route: dict, cls_token: bool):
    """Strategy: `route` with one field made invalid for this model (or the route replaced by garbage)."""
    tokens = GRID[0] * GRID[1] + cls_token
    bad_index = st.one_of(st.integers(max_value=-DEPTH - 1), st.integers(min_value=DEPTH), st.floats(0.1, 3.9).filter(
        lambda f: f != int(f)), st.text(max_size=3).filter(lambda t: not t.strip().lstrip("+-").isdigit()), st.none())
    bad_keep = st.one_of(
        st.lists(st.integers(min_value=tokens, max_value=10**9), min_size=1, max_size=3),
        st.lists(st.integers(max_value=-tokens - 1, min_value=-10**9), min_size=1, max_size=3),
        st.just([0, 0]), st.just(list(range(tokens))), st.just("prefix:1"), st.just([0.5]), st.just([True]),
        st.integers(), st.just(["0"]),
    )
    fields = {
        "start": bad_index, "end": bad_index | st.integers(-DEPTH, -1).filter(lambda e: e % DEPTH < route["start"]),
        "rate": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0), st.just(math.nan), st.text(max_size=3)
                          .filter(lambda t: not _is_number(t)), st.none()),
        "selector": st.text(max_size=8).filter(lambda t: t not in selector_names()) | st.none() | st.integers(),
        "keep": bad_keep,
        "extra": garbage,
    }
    if cls_token:  # a class token routed like a patch token: refused unless keep=[] says so
        fields["keep"] = bad_keep | st.just(None)
    name = st.sampled_from(sorted(fields))
    return name.flatmap(lambda n: fields[n].map(lambda v: {**route, n: v} if n != "extra" else {**route, "colour": v}))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@st.composite
def invalid_plans(draw):
    cls_token = draw(st.booleans())
    kind = draw(st.sampled_from(["field", "order", "overlap", "past-end", "grid", "container"]))
    route = draw(valid_route(cls_token))
    if kind == "field":
        plan = [draw(corrupt_route(route, cls_token))]
    elif kind == "order":
        start = draw(st.integers(1, DEPTH - 1))
        plan = [{**route, "start": start, "end": draw(st.integers(0, start - 1))}]
    elif kind == "overlap":
        second = {**route, "start": draw(st.integers(route["start"], route["end"])), "end": route["end"]}
        plan = [route, second]
    elif kind == "past-end":
        plan = [{**route, "end": draw(st.integers(DEPTH, 10**6))}]
    elif kind == "grid":  # the class token leaves 17 tokens: a grid selector must keep exactly it
        cls_token = True
        keep = draw(st.sampled_from([[], [1], [0, 1], [-1]]))
        plan = [{**route, "selector": draw(st.sampled_from(SELECTORS[1:])), "keep": keep}]
    else:
        plan = draw(st.one_of(garbage.filter(lambda g: g is not None and not isinstance(g, (list, dict))),
                              st.lists(garbage.filter(lambda g: not isinstance(g, dict)), min_size=1, max_size=2),
                              st.just("default")))
    return cls_token, kind, plan


@FUZZ
@given(invalid_plans())
def test_every_invalid_route_plan_is_refused_with_a_routekit_error(case) -> None:
    cls_token, kind, plan = case
    refused(lambda: rk.apply(MODELS[cls_token], routes=plan, example_inputs=(IMAGE,)), f"plan: {kind}")


@st.composite
def invalid_inputs(draw):
    """Example calls the model cannot take: one thing wrong with a valid (image, mask) call."""
    batch = draw(st.integers(1, 3))
    image, mask = torch.randn(batch, CHANNELS, 8, 8), torch.ones(batch, GRID[0] * GRID[1])
    kind = draw(st.sampled_from(["channels", "size", "rank", "dtype", "device", "not-a-tensor", "extra-arg",
                                 "unknown-kwarg", "missing", "container", "kwargs-container", "mask-tokens"]))
    args, kwargs = (image,), {"mask": mask}
    if kind == "channels":
        args = (torch.randn(batch, draw(st.integers(1, 6).filter(lambda c: c != CHANNELS)), 8, 8),)
    elif kind == "size":
        side = draw(st.sampled_from([4, 6, 10, 12, 16]))  # not 2: one token broadcasts against the position table
        height, width = draw(st.permutations([side, draw(st.sampled_from([side, 8]))]))
        args = (torch.randn(batch, CHANNELS, height, width),)
    elif kind == "rank":
        # not 3-D or 4-D: a (3, h, w) image is a valid unbatched call, and tiny images broadcast one token
        args = (torch.randn(draw(st.lists(st.integers(1, 4), max_size=2) | st.lists(st.integers(1, 3), min_size=5,
                                                                                       max_size=5))),)
    elif kind == "dtype":
        args = (image.to(draw(st.sampled_from([torch.float64, torch.int64, torch.bool, torch.complex64]))),)
    elif kind == "device":
        args = (image.to("meta"),)
    elif kind == "not-a-tensor":
        args = (draw(garbage.filter(lambda g: not isinstance(g, torch.Tensor))),)
    elif kind == "extra-arg":
        args = (image, mask, draw(garbage))
        kwargs = {}
    elif kind == "unknown-kwarg":
        kwargs = {draw(st.sampled_from(["masks", "x", "timestep"])): mask}
    elif kind == "missing":
        args, kwargs = (), {"mask": mask}
    elif kind == "container":
        return kind, draw(st.one_of(st.integers(), st.text(max_size=3), st.none(), st.just({"image": image}))), None
    elif kind == "kwargs-container":
        kwargs = draw(st.one_of(st.lists(st.integers(), max_size=2), st.text(min_size=1, max_size=3),
                                st.just({1: mask})))
    else:
        kwargs = {"mask": torch.ones(batch, draw(st.integers(1, 30).filter(lambda n: n not in (1, 16))))}
    return kind, args, kwargs


@FUZZ
@given(invalid_inputs(), st.sampled_from(["apply", "apply-graph", "apply-boundary", "inspect", "verify"]))
def test_every_invalid_example_call_is_refused_by_every_entry_point(case, verb: str) -> None:
    kind, args, kwargs = case
    model = MODELS[False]
    calls = {
        "apply": lambda: rk.apply(model, rk.Route(start=1, end=2), example_inputs=args, example_kwargs=kwargs),
        "apply-graph": lambda: rk.apply(model, rk.Route(start=1, end=2), example_inputs=args, example_kwargs=kwargs,
                                        mode="graph"),
        "apply-boundary": lambda: rk.apply(model, rk.Route(start=1, end=2), example_inputs=args, example_kwargs=kwargs,
                                           mode="boundary"),
        "inspect": lambda: rk.inspect(model, args, kwargs),
        "verify": lambda: rk.verify(model, ROUTED, args, kwargs),
    }
    refused(calls[verb], f"input: {kind}")


ROUTED = rk.apply(copy.deepcopy(MODELS[False]), rk.Route(start=1, end=2), example_inputs=(IMAGE,))  # apply routes the
# model it is given: the entry points above take the plain model, as a user does before apply
ROUTED(IMAGE)  # one routed forward, so last_route_mask has a mask to return


def _valid_grid(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)
            and value[0] * value[1] == GRID[0] * GRID[1])


GARBAGE_CALLS = {  # entry point and option: (the call with `value`, which values are valid there)
    "strip": (lambda v: rk.strip(v), lambda v: False),
    "report_of": (lambda v: report_of(v), lambda v: False),
    "last_route_mask route": (lambda v: rk.last_route_mask(ROUTED, route=v),
                              lambda v: v is None or (type(v) is int and v == 0)),
    "last_route_mask model": (lambda v: rk.last_route_mask(v), lambda v: False),
    "verify routed": (lambda v: rk.verify(MODELS[False], v, (IMAGE,)), lambda v: False),
    "verify seed": (lambda v: rk.verify(MODELS[False], ROUTED, (IMAGE,), seed=v), lambda v: type(v) is int),
    "apply model": (lambda v: rk.apply(v, rk.Route(start=1, end=2), example_inputs=(IMAGE,)), lambda v: False),
    "apply grid": (lambda v: rk.apply(MODELS[False], rk.Route(start=1, end=2), example_inputs=(IMAGE,), grid=v),
                   lambda v: v is None or _valid_grid(v)),
    "apply stack": (lambda v: rk.apply(MODELS[False], rk.Route(start=1, end=2), example_inputs=(IMAGE,), stack=v),
                    lambda v: v is None or v == "blocks"),
    "apply mode": (lambda v: rk.apply(MODELS[False], rk.Route(start=1, end=2), example_inputs=(IMAGE,), mode=v),
                   lambda v: v in ("auto", "graph", "boundary")),
    "apply residual": (lambda v: rk.apply(MODELS[False], rk.Route(start=1, end=2), example_inputs=(IMAGE,), residual=v),
                       lambda v: v is None),
    "apply generator": (lambda v: rk.apply(MODELS[False], rk.Route(start=1, end=2), example_inputs=(IMAGE,),
                                           generator=v), lambda v: v is None),
    "inspect model": (lambda v: rk.inspect(v, (IMAGE,)), lambda v: False),
    "inspect routes": (lambda v: rk.inspect(MODELS[False], (IMAGE,), routes=v), lambda v: v is None or v == []),
    "inspect stack": (lambda v: rk.inspect(MODELS[False], (IMAGE,), stack=v), lambda v: v is None or v == "blocks"),
    "Route": (lambda v: rk.Route(**v) if isinstance(v, dict) else rk.Route(start=0, end=1, selector=v),
              lambda v: v in selector_names()),
    "DAR": (lambda v: rk.DAR(query=v) if not isinstance(v, dict) else rk.DAR(**v),
            lambda v: v == {} or v in ("static", "static_t", "dynamic")),
}


@FUZZ
@given(st.sampled_from(sorted(GARBAGE_CALLS)), garbage)
def test_every_entry_point_refuses_garbage_arguments(verb: str, value) -> None:
    call, valid = GARBAGE_CALLS[verb]
    if valid(value):
        return
    refused(lambda: call(value), f"argument: {verb}")


random_routes = st.lists(st.fixed_dictionaries(
    {"start": st.integers(-1, DEPTH), "end": st.integers(-1, DEPTH)},
    optional={"rate": st.floats(-0.2, 1.2, allow_nan=False), "selector": st.sampled_from([*SELECTORS, "nope"]),
              "keep": st.lists(st.integers(-20, 20), max_size=3)}), max_size=3)
random_shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.sampled_from([4, 6, 8, 10]), st.sampled_from([6, 8]))


@st.composite
def random_calls(draw):
    """A model, a plan and an input shape: each valid about half the time, so both outcomes are common."""
    cls_token = draw(st.booleans())
    routes = draw(st.one_of(st.lists(valid_route(cls_token), max_size=1), random_routes, garbage))
    shape = draw(st.one_of(st.tuples(st.integers(1, 3), st.just(CHANNELS), st.just(8), st.just(8)), random_shapes))
    return cls_token, routes, shape


@FUZZ
@given(random_calls())
def test_any_plan_on_any_input_shape_routes_and_trains_or_is_refused(call) -> None:
    cls_token, routes, shape = call
    model = MODELS[cls_token]
    try:
        routed = rk.apply(model, routes=routes, example_inputs=(torch.randn(*shape),))
    except rk.RoutekitError:
        COUNTS["random plan or shape refused"] += 1
        return
    COUNTS["random plan and shape applied"] += 1
    routed.train()
    routed(torch.randn(*shape)).sum().backward()
    assert rk.verify(model, routed, (torch.randn(*shape),)).mode == "graph"

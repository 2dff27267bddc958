"""Validated, serialisable configuration: `Route` and `DAR`, plain data.

Configs are plain data (pydantic), so they print, compare, and round-trip through YAML/JSON.
Errors are `ConfigError`s that say what was wrong and what would be valid.
"""

from __future__ import annotations

import operator
import warnings
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from .errors import ConfigError, RouteWarning
from .selectors import selector as selector_spec


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, *args, **data):
        if args:
            fields = ", ".join(f"{name}=..." for name in type(self).model_fields)
            raise ConfigError(f"{type(self).__name__} takes keyword arguments only ({type(self).__name__}({fields})); "
                              f"got {len(args)} positional: {args!r:.80}")
        try:
            super().__init__(**data)
        except pydantic.ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or type(self).__name__}: {e['msg'].removeprefix('Value error, ')}"
                for e in err.errors()
            )
            raise ConfigError(f"invalid {type(self).__name__}: {problems}") from None


class Fusion(_Config):
    """SPRINT's end of a route (Park et al., "Sparse-Dense Residual Fusion for Efficient Diffusion Transformers").

    Where TREAD's end puts the routed tokens back with their value at the route's start, a fused end puts the
    blocks' output (the *deep* path) back at the kept positions, fills the others with a learned mask token, and
    fuses that with the stream as it entered the route (the *dense* path) by one linear layer over their
    concatenation, `Linear(cat([deep, dense]))` (2D → D), for every token, in training and in eval: a fused
    route changes the model, as DAR does, and its parameters are the model's (`routekit.sprint.<k>.*`).

    `path_drop`: in training, the share of samples whose whole deep output is replaced by mask tokens (SPRINT's
    0.1): what teaches the model the weak pass `routekit.path_drop` runs at sampling (Path-Drop Guidance).
    `init`: "sprint" starts the fusion as SPRINT pre-trains it (xavier-uniform weight, zero bias); "preserve"
    starts it as the identity on the deep path (weight [I | 0], zero bias), so that a pretrained model fused at
    rate 0 computes what it did (bit for bit in eval, where matmuls are exact on x·1 + y·0: CPU, bf16/fp32
    without TF32), the start for fine-tuning one. The mask token starts at N(0, 0.02²) either way and trains.
    """

    path_drop: float = 0.1
    init: Literal["sprint", "preserve"] = "sprint"

    @field_validator("path_drop", mode="before")
    @classmethod
    def _share(cls, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
            raise ValueError(f"path_drop is the share of samples whose deep path is dropped in training, in [0, 1) "
                             f"(SPRINT's is 0.1); got {v!r}")
        return float(v)


class Route(_Config):
    """A TREAD token route: blocks `start..end` (inclusive) see only the kept tokens.

    Block indices count from 0 over the chain of block stacks the stream passes through (Flux: its
    double-stream blocks, then its single-stream ones, as SimpleTuner counts them); negative ones count
    from the end (-1 = the last block). A block can also be named by its stack and its index in it:
    `Route(start="transformer_blocks.2", end="single_transformer_blocks.-2")`. Resolved against the
    model's chain when the route is planned; a route crossing from one stack into the next carries its
    kept tokens across (what the owner joins in between, text, is kept).

    `rate` is the fraction of tokens routed *around* the blocks (TREAD's best is 0.5). At block
    `start` the selector picks the kept tokens; after block `end` the routed tokens rejoin with
    their value at the route start.

    `keep`: token positions every selection contains (class/register tokens, text tokens of a joint
    stream; negative positions count from the end); the selector picks among the other tokens and
    `rate` applies to those. None: the special tokens analysis finds (`inspect` lists them) are kept;
    [] routes every token alike.

    `fuse`: how the route ends. None: TREAD's (the routed tokens rejoin with their start value). "sprint" or
    `Fusion(path_drop=..., init=...)`: SPRINT's sparse-dense fusion (see `Fusion`), e.g.
    `Route(start=2, end=-3, rate=0.75, fuse="sprint")`; such a route changes the model in eval too.
    """

    start: int | str
    end: int | str
    rate: float = 0.5
    selector: str = "random"
    keep: tuple[int, ...] | None = None
    fuse: Fusion | None = None

    @field_validator("fuse", mode="before")
    @classmethod
    def _fusion(cls, v):
        if v == "sprint":
            return Fusion()
        if v is None or isinstance(v, (Fusion, dict)):
            return v
        raise ValueError(f"fuse is None (TREAD's end), 'sprint' or routekit.Fusion(path_drop=..., init=...); "
                         f"got {v!r:.80}")

    @field_validator("start", "end", "rate", mode="before")
    @classmethod
    def _not_bool(cls, v):
        if isinstance(v, bool):
            raise ValueError(f"expected a number, got {v!r}")
        return v

    @field_validator("rate")
    @classmethod
    def _rate_in_range(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError(f"rate is the fraction of tokens routed around the blocks and must be in [0, 1), got {v}")
        return v

    @field_validator("selector")
    @classmethod
    def _known_selector(cls, v: str) -> str:
        try:
            selector_spec(v)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return v

    @field_validator("keep", mode="before")
    @classmethod
    def _positions(cls, v):
        if v is None:
            return None
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise ValueError(f"keep is a list of token positions, e.g. keep=[0] for a class token; got {v!r}")
        positions = []
        for p in v:
            if isinstance(p, bool) or not hasattr(p, "__index__"):
                raise ValueError(f"keep holds integer token positions, got {p!r}")
            positions.append(operator.index(p))
        if len(set(positions)) != len(positions):
            raise ValueError(f"keep lists a position twice: {positions}")
        return tuple(positions)

    @field_validator("start", "end")
    @classmethod
    def _block_name(cls, v):
        if isinstance(v, str) and not (v.count(".") and v.rpartition(".")[2].lstrip("-").isdigit()):
            raise ValueError(f"a block is an index in the chain (2, -2) or named '<stack>.<index>' "
                             f"('single_transformer_blocks.-2'); got {v!r}")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> Route:
        if isinstance(self.start, str) or isinstance(self.end, str):
            return self
        if (self.start < 0) == (self.end < 0) and self.start > self.end:
            raise ValueError(f"start ({self.start}) must be <= end ({self.end}); the route covers blocks start..end")
        return self

    @classmethod
    def default(cls, depth: int, rate: float = 0.5, selector: str = "random", keep=None) -> Route:
        """TREAD's default route for a stack of `depth` blocks: 2 → depth−4 (DiT-B/2 2→8, XL/2 2→24)."""
        if depth < 7:
            raise ConfigError(f"the default route 2→depth-4 needs at least 7 blocks, the stack has {depth}")
        return cls(start=2, end=depth - 4, rate=rate, selector=selector, keep=keep)


class DAR(_Config):
    """Diffusion-Adaptive Routing: residual adds become softmax aggregations over sublayer outputs.

    `query`: "static" (w_l, zero-init), "static_t" (w_l + e(t), the model's timestep embedding),
    "dynamic" (W_l v_{l-1}, zero-init). `chunk`: a sublayer sees summaries of earlier chunks of
    `chunk` sublayers plus the raw outputs of its own chunk. `timestep`: the fx node or module name
    of the timestep embedding, when analysis cannot find it.

    `preserve`: start from the model as it is, for fine-tuning pretrained weights. The paper's zero-init
    queries start every aggregation as the uniform average of its history, which is not the residual sum a
    pretrained model was trained with, so its output changes at step 0. With `preserve=True` each
    aggregation is blended into the residual add it replaces, h = a + g·(mix − a) with a = the add's own
    value and a learned gate g per aggregation starting at 0: at step 0 the model computes exactly what it
    did, and training moves each gate towards DAR's mix. None of the paper's variants has this.

    `regions`: under torch.compile, trace and compile each distinct block body once and reuse it for the other
    blocks (regional compilation, routekit/regions.py), instead of once per block. A trade: the first compiled
    step is shorter, each later step a little longer (Inductor does not fuse across a region's edge; the
    measured numbers are in docs/benchmarks.md): worth it for short runs. Eager runs are the same either way,
    bit for bit.
    """

    query: Literal["static", "static_t", "dynamic"] = "static"
    chunk: int | None = None
    kernel: Literal["auto", "triton", "torch"] = "auto"
    timestep: str | None = None
    eps: float = 1e-6
    preserve: bool = False
    regions: bool = False

    @field_validator("chunk")
    @classmethod
    def _positive_chunk(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"chunk is a number of sublayers and must be >= 1 (or None for no chunking), got {v}")
        return v


_SIMPLETUNER = {"selection_ratio": "rate", "start_layer_idx": "start", "end_layer_idx": "end"}


def coerce_routes(routes, depth: int) -> list[Route]:
    """Accept a Route, a list of Routes/dicts, None, "default" (TREAD's 2 → depth−4), or SimpleTuner's
    `tread_config` as it is (`{"routes": [{"selection_ratio", "start_layer_idx", "end_layer_idx"}, ...]}`: its
    ratio is the share routed around, its indices count over the chain of stacks, negative from the end, as
    routekit's do; SimpleTuner rounds the routed count half to even where routekit floors it, which keeps the
    same count wherever the share is a whole number of tokens, as 0.5 of an even count is)."""
    if routes is None:
        return []
    if routes == "default":
        return [Route.default(depth)]
    if isinstance(routes, dict) and set(routes) == {"routes"}:  # SimpleTuner's tread_config
        routes = routes["routes"]
        if not isinstance(routes, (list, tuple)):
            raise ConfigError(f"a tread_config's 'routes' is a list of routes, got {routes!r:.80}")
        routes = [_from_simpletuner(r) for r in routes]
    if isinstance(routes, (Route, dict)):
        routes = [routes]
    if isinstance(routes, (str, bytes)) or not hasattr(routes, "__iter__"):
        raise ConfigError(f"routes must be a Route, a list of Routes, None or 'default'; got {routes!r}")
    for r in routes:
        if not (isinstance(r, Route) or (isinstance(r, dict) and all(isinstance(k, str) for k in r))):
            raise ConfigError(f"each route is a Route or a dict of its fields (start, end, ...); got {r!r:.80}")
    routes = [r if isinstance(r, Route) else Route(**r) for r in routes]
    _warn_unlikely(routes, depth)
    return routes


def _warn_unlikely(routes: list[Route], depth: int) -> None:
    """A `RouteWarning` for a route that routes nothing, or one over the whole stack."""
    for k, r in enumerate(routes):
        if r.rate == 0 and r.fuse is None:  # a fused route at rate 0 still fuses: SPRINT's fine-tuning stage
            warnings.warn(f"route {k} ({r.start}→{r.end}) has rate=0: it routes no token, and training costs what it "
                          "did; TREAD routes half (rate=0.5)", RouteWarning, stacklevel=4)
        ends = (r.start, r.end)
        if depth > 1 and all(isinstance(e, int) and -depth <= e < depth for e in ends) \
                and (r.start % depth, r.end % depth) == (0, depth - 1):
            warnings.warn(f"route {k} ({r.start}→{r.end}) covers the whole stack of {depth} blocks: the first blocks "
                          "and the last, which embed the tokens and decode them, see only the kept ones; TREAD keeps "
                          f"them unrouted (routes='default': 2→{depth - 4})", RouteWarning, stacklevel=4)


def _from_simpletuner(route) -> Route:
    """One route of SimpleTuner's tread_config: {"selection_ratio", "start_layer_idx", "end_layer_idx"}."""
    if not isinstance(route, dict) or set(route) != set(_SIMPLETUNER):
        raise ConfigError(f"a tread_config route has exactly the keys {sorted(_SIMPLETUNER)}, got {route!r:.120}")
    return Route(**{_SIMPLETUNER[k]: v for k, v in route.items()})

"""`apply`: the one verb. It returns a RoutedModel: the user's model, routed in training only.

The routed model is an instance of a subclass of the model's own class that shares every submodule,
parameter and buffer with the model (held once): `state_dict` keys are the model's, an original
checkpoint loads strictly, attributes and methods are all there, and `isinstance` still holds. In
`eval()` its forward *is* the original forward; in `train()` it runs the routed graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn

from .analysis import GraphReport, analyse, block_runs, slot_value
from .config import DAR, Route, check_routes, coerce_routes
from .dar import DarState, dar_graph, residual_plan
from .errors import ConfigError, InputError, NonFiniteError, TraceError
from .keep import check_keep
from .ops import RouteSelect
from .rewrite import compile_graph, constants_to_inputs, route_graph
from .selectors import keeps_rows, needs_grid
from .trace import TensorMeta, Trace, bind_arguments, call_spec, flatten, preserved_state, shallow_copy, trace

_STATE = "routekit"  # the one submodule routekit adds; it holds parameters only with DAR


@dataclass
class Program:
    """A compiled training graph for one call signature (and one set of shapes, if specialised)."""

    fn: Any
    out_spec: pytree.TreeSpec
    constants: tuple
    specialised: bool
    report: GraphReport
    called: frozenset[str] = frozenset()  # qualified names of the modules the graph calls

    def __call__(self, module: nn.Module, tensors: list[torch.Tensor]) -> Any:
        return pytree.tree_unflatten(list(self.fn(module, *tensors, *self.constants)), self.out_spec)


class RoutekitState(nn.Module):
    """Everything routekit adds to a model, under one name: route selectors and DAR's queries."""

    def __init__(self, routes: list[Route], grid: tuple[int, int] | None, dar: DarState | None = None):
        super().__init__()
        self.routes = nn.ModuleList([RouteSelect(r, grid) for r in routes])
        if dar is not None:
            self.dar = dar


class RoutedModel(nn.Module):
    """Mixin before the model's class: training forward through the routed graph."""

    _routekit_base: type

    def forward(self, *args, **kwargs):
        if not self.training and self._routekit_residual is None:
            return super().forward(*args, **kwargs)  # routes are training-only: the original forward
        if self._routekit_residual is not None:
            _check_sharding(self)
        tensors, program = self._routekit_program(args, kwargs)
        out = program(self, tensors)
        if self._routekit_check_finite:
            _check_finite(out, self._routekit_routes)
        return out

    def _routekit_program(self, args: tuple, kwargs: dict,
                          program: Program | None = None) -> tuple[list[torch.Tensor], Program]:
        """The graph for this call's signature and mode (and shapes, if it was specialised to them),
        built on first use; `program` seeds the cache with one already built."""
        bound = bind_arguments(self._routekit_base.forward, args, kwargs)
        spec = call_spec(bound)
        tensors = [bound.arguments.get(n, bound.kwargs.get(n)) for n in spec.tensor_names]
        bucket = self._routekit_programs.setdefault((self.training, spec.key()), {})
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors)
        found = bucket.get(None, bucket.get(shapes))
        if found is None:
            found = program if program is not None else _build_program(self, args, kwargs)
            bucket[shapes if found.specialised else None] = found
        return tensors, found

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Strict about the original weights; routekit's own (DAR queries) may be absent from a checkpoint."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if not k.startswith(_STATE + ".")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, "
                f"unexpected keys {result.unexpected_keys}"
            )
        return result

    def __reduce__(self):
        """Pickle (torch.save, copy.deepcopy) as the model's own class plus routekit's state, not the made-up class."""
        state = {k: v for k, v in self.__dict__.items() if k != "_routekit_programs"}
        return _unpickle, (type(self).__bases__[0], self._routekit_base, state)


def _check_sharding(model: RoutedModel) -> None:
    """DAR runs the blocks' layers from one inlined graph, so an FSDP unit around a module whose own
    forward no longer runs (a block, or a non-leaf layer inside one) would never gather its parameters
    (FSDP2 fails deep inside a matmul on mixed Tensor/DTensor; FSDP1 on a missing attribute)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for info in model._routekit_report.blocks:
        for name, module in model.get_submodule(info.qualname).named_modules(prefix=info.qualname):
            if isinstance(module, (FSDPModule, FullyShardedDataParallel)) and name not in model._routekit_called:
                raise ConfigError(
                    f"{name} is an FSDP unit, but with DAR routekit runs the blocks' layers from one graph and "
                    f"never calls {name}'s forward, so its parameters would not be gathered. Shard the whole model "
                    "as one unit (fully_shard(model); accelerate: fsdp_auto_wrap_policy NO_WRAP) or only leaf "
                    "layers such as nn.Linear; routes without DAR work with per-block units"
                )


_CLASSES: dict[tuple[type, type], type] = {}


def _routed_class(cls: type, mixin: type | None = None) -> type:
    mixin = mixin or RoutedModel
    if (mixin, cls) not in _CLASSES:
        _CLASSES[mixin, cls] = type(f"Routed{cls.__name__}", (mixin, cls),
                                    {"_routekit_base": cls, "__module__": cls.__module__})
    return _CLASSES[mixin, cls]


def _unpickle(mixin: type, base: type, state: dict) -> nn.Module:
    """Rebuild a pickled routed model; its training programs are traced again on first use."""
    routed = _routed_class(base, mixin).__new__(_routed_class(base, mixin))
    routed.__dict__.update(state, _routekit_programs={})
    return routed


@contextlib.contextmanager
def training_mode(model: nn.Module, mode: bool):
    """Temporarily put every submodule in train or eval mode, restoring each flag after."""
    flags = {m: m.training for m in model.modules()}
    model.train(mode)
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def _original_view(routed: nn.Module) -> nn.Module:
    """The routed model seen as its original class (shared state), for tracing the original forward."""
    return shallow_copy(routed, cls=routed._routekit_base)


def _build_program(routed: nn.Module, args: tuple, kwargs: dict) -> Program:
    original = _original_view(routed)
    tr = trace(original, args, kwargs)
    report = analyse(tr, original, routed._routekit_stack)
    if routed._routekit_grid is not None:
        report.grid = routed._routekit_grid
    routes = routed._routekit_routes if routed.training else []
    return _program(tr, report, routes, routed._routekit_grid, original, routed._routekit_residual)


def _program(tr: Trace, report: GraphReport, routes: list[Route], grid, model: nn.Module,
             residual: DAR | None) -> Program:
    graph, placed = route_graph(tr.graph, report, routes, grid_fixed=grid is not None)
    constants = dict(tr.constants)
    specialised = bool(tr.specialised)
    if residual is not None:
        blocks, _ = residual_plan(model, report, routes)
        v0 = slot_value(next(n for n in tr.graph.nodes if n.name == report.blocks[0].node), report.stream_slot)
        constants.update(dar_graph(graph, model, report, blocks, residual, routes, placed, v0.name))
        specialised = specialised or any(b.trace.specialised for b in blocks)
    values = constants_to_inputs(graph, constants)
    mode = "train" if routes or residual is None else "eval"
    fn = compile_graph(graph, f"{report.model} {mode} graph")
    called = frozenset(n.target for n in graph.nodes if n.op == "call_module")
    return Program(fn, tr.out_spec, tuple(values), specialised, report, called)


def apply(model: nn.Module, routes: Route | list[Route] | str | None = None, residual: DAR | None = None,
          example_inputs: tuple | torch.Tensor = (), example_kwargs: dict | None = None, *,
          grid: tuple[int, int] | None = None, stack: str | None = None,
          generator: torch.Generator | None = None, check_finite: bool = False,
          mode: Literal["auto", "graph", "boundary"] = "auto") -> nn.Module:
    """Route `model`'s training graph; returns the routed model (the model itself is left unchanged).

    routes: a Route, a list of disjoint Routes, or "default" (TREAD's 2 → depth−4, rate 0.5).
    example_inputs / example_kwargs: one call's arguments, used once to trace and check shapes.
    grid: the (H, W) token grid when it cannot be read off a patch embedding. stack: the qualified
    name of the block container when several chains exist. generator: makes selections reproducible.
    check_finite: raise NonFiniteError when a routed forward produces NaN/Inf.
    mode: "graph" rewrites the traced owner forward; "boundary" places the routes with hooks at the
    block calls (routekit/boundary.py); "auto" uses graph mode and falls back to boundary mode when the
    owner forward does not trace. A torch.compile'd model comes back compiled the same way.
    """
    model, rewrap = unwrap_compiled(model)
    model = _unwrapped(model)
    if mode not in ("auto", "graph", "boundary"):
        raise ConfigError(f"mode must be 'auto', 'graph' or 'boundary', got {mode!r}")
    if residual is not None and not isinstance(residual, DAR):
        raise ConfigError(f"residual must be routekit.DAR(...) or None, got {residual!r}")
    args, kwargs = _example_call(model, example_inputs, example_kwargs)
    tr, fallback = _graph_trace(model, args, kwargs, mode)
    if tr is None:
        from .boundary import apply_boundary  # boundary mode builds on this module

        return rewrap(apply_boundary(model, routes, residual, args, kwargs, grid=grid, stack=stack,
                                     generator=generator, check_finite=check_finite, reason=fallback))
    with training_mode(model, True):
        report = analyse(tr, model, stack)
        if grid is not None:
            report.grid, report.grid_node = _checked_grid(grid, report), None
        routes = coerce_routes(routes, report.depth)
        check_plan(model, report, routes, args, kwargs)
        report.routes = routes
        dar_state = None
        if residual is not None:
            _, points = residual_plan(model, report, routes)
            report.residual = residual
            dar_state = DarState(residual, points, report.stream.shape[2])
            param = next(model.parameters(), None)
            if param is not None:
                dar_state.to(param.device)
        routed = shallow_copy(model, cls=_routed_class(type(model)))
        routed.add_module(_STATE, RoutekitState(routes, grid, dar_state))
        routed.__dict__.update(
            _routekit_routes=routes, _routekit_grid=grid, _routekit_stack=stack, _routekit_report=report,
            _routekit_check_finite=check_finite, _routekit_programs={}, _routekit_residual=residual,
        )
        for select in getattr(routed, _STATE).routes:
            select.generator = generator
        program = _program(tr, report, routes, grid, model, residual)
        routed._routekit_called = program.called
        routed._routekit_program(args, kwargs, program)
        _dry_run(routed, tr, args, kwargs)
    routed.train(model.training)
    return rewrap(routed)


def _graph_trace(model: nn.Module, args: tuple, kwargs: dict, mode: str) -> tuple[Trace | None, str | None]:
    """The training trace; (None, why) for boundary mode: asked for, or the trace failed in mode 'auto'."""
    if mode == "boundary":
        return None, None
    try:
        with training_mode(model, True):
            return trace(model, args, kwargs), None
    except TraceError as err:
        if mode == "graph":
            raise
        return None, str(err)


def unwrap_compiled(model: Any):
    """(the module inside a torch.compile wrapper, a function wrapping another module the same way)."""
    if isinstance(model, nn.Module) and hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        return model._orig_mod, lambda inner: type(model)(inner, model.dynamo_ctx)
    return model, lambda inner: inner


def _unwrapped(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InputError(f"routekit.apply takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, RoutedModel):
        raise ConfigError(
            f"{type(model).__name__} is already routed; call routekit.strip(model) first to re-apply with new routes"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise InputError(
            "model is wrapped by DistributedDataParallel: apply routekit first, then wrap it (or accelerate.prepare it)"
        )
    return model


def _example_call(model: nn.Module, example_inputs, example_kwargs) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise InputError(f"expected an nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(
            f"example_inputs is a tuple of positional arguments (or one tensor), got {type(example_inputs).__name__}"
        )
    named = isinstance(example_kwargs, dict) and all(isinstance(k, str) for k in example_kwargs)
    if example_kwargs is not None and not named:
        raise InputError(f"example_kwargs is a dict of keyword arguments by name, got {example_kwargs!r:.80}")
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    if not args and not kwargs:
        raise InputError("example_inputs are required: one call's arguments, e.g. example_inputs=(x, t, y)")
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    for value in pytree.tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor) and devices and value.device not in devices:
            raise InputError(
                f"an example input is on {value.device} but the model is on {', '.join(map(str, devices))}; "
                "move the inputs (or the model) so they share a device"
            )
    return args, kwargs


def _checked_grid(grid, report: GraphReport) -> tuple[int, int]:
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2 and all(type(g) is int and g > 0 for g in grid)):
        raise ConfigError(f"grid is (H, W), two positive ints, got {grid!r:.80}")
    if grid[0] * grid[1] != report.tokens:
        raise ConfigError(f"grid {tuple(grid)} does not match the stream's {report.tokens} tokens (H·W must equal it)")
    return (int(grid[0]), int(grid[1]))


def check_plan(model: nn.Module, report: GraphReport, routes: list[Route], args: tuple, kwargs: dict) -> None:
    """Refuse routes this model cannot take, naming the block and what would be valid."""
    check_routes(routes, [b.qualname for b in report.blocks])
    check_keep(routes, report)
    for k, route in enumerate(routes):
        blocks = report.blocks[route.start:route.end + 1]
        for block in blocks:
            bad = [s for s in block.side_inputs if s.kind == "token-first"]
            if bad:
                raise ConfigError(
                    f"route {k} cannot contain {block.qualname}: its input {bad[0].slot!r} has the token axis first "
                    f"and no batch axis ({bad[0].meta}); per-sample selection would need it batched"
                )
            if block.aux_escapes:
                raise ConfigError(
                    f"route {k} cannot contain {block.qualname}: it returns a per-token value used elsewhere "
                    f"({block.aux_escapes[0]}), which would have only the kept tokens"
                )
        for block in blocks[:-1]:
            if block.escapes:
                raise ConfigError(
                    f"route {k} cannot pass through {block.qualname}: its output is also used by "
                    f"{block.escapes[0].split(' → ')[1]}, outside the chain; end the route at block {block.index} "
                    "or start it after"
                )
        if needs_grid(route.selector) and report.grid is None:
            raise ConfigError(
                f"route {k}: selector {route.selector!r} needs the token grid, and none was found (no 4-D patch "
                "embedding output upstream of the stream); pass grid=(H, W) to routekit.apply"
            )
        if not keeps_rows(route.selector):
            for block in blocks:
                if _needs_whole_rows(model, report, block):
                    raise ConfigError(
                        f"route {k}: {block.qualname} ({block.cls}) fails on a token count that is not whole grid rows, "
                        f"so selector {route.selector!r} would break it; use selector='row' (or 'window')"
                    )


def _needs_whole_rows(model: nn.Module, report: GraphReport, block) -> bool:
    """Probe: does the block fail when given one token fewer than the full grid? Then it reshapes to rows."""
    if report.grid is None or report.grid[1] == 1:
        return False
    return not block_runs(model, report, block, report.tokens - 1)


def _dry_run(routed: nn.Module, tr: Trace, args: tuple, kwargs: dict) -> None:
    """Run the routed graph once on the example inputs: its outputs must match the original's shapes."""
    with preserved_state(routed, [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]):
        try:
            out = routed(*args, **kwargs)
        except Exception as err:
            raise ConfigError(
                f"the routed training graph failed on the example inputs: {type(err).__name__}: {err}"
            ) from err
    got = [TensorMeta(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in flatten(out)[0]]
    output = next(n for n in tr.graph.nodes if n.op == "output")
    want = pytree.tree_leaves([a.meta["rk"] if isinstance(a, torch.fx.Node) else a for a in output.args[0]])
    for select in getattr(routed, _STATE).routes:
        select.last_index = None
    if [getattr(g, "shape", g) for g in got] != [getattr(w, "shape", w) for w in want]:
        raise ConfigError(f"routing changed the training output shapes: original {want}, routed {got}")


def _check_finite(out, routes) -> None:
    for i, t in enumerate(flatten(out)[0]):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            raise NonFiniteError(
                f"output {i} of the routed forward has NaN/Inf (routes: "
                f"{', '.join(f'{r.start}→{r.end}' for r in routes)}); check_finite=True raised it"
            )


def strip(routed: nn.Module) -> nn.Module:
    """The plain model back: same class as the original, sharing the routed model's weights."""
    routed, rewrap = unwrap_compiled(routed)
    if not isinstance(routed, RoutedModel):
        raise InputError(f"strip takes a model returned by routekit.apply, got {type(routed).__name__}")
    plain = shallow_copy(routed, cls=routed._routekit_base)
    del plain._modules[_STATE]
    if "_routekit_boundary" in routed.__dict__:
        routed._routekit_boundary.detach(plain)
    for key in [k for k in plain.__dict__ if k.startswith("_routekit_")]:
        del plain.__dict__[key]
    return rewrap(plain)


def report_of(routed: nn.Module) -> GraphReport:
    """The analysis `apply` made, with the routes it placed."""
    routed = unwrap_compiled(routed)[0]
    if not isinstance(routed, RoutedModel):
        raise InputError(f"expected a model returned by routekit.apply, got {type(routed).__name__}")
    return routed._routekit_report


def last_route_mask(routed: nn.Module, route: int | None = None) -> torch.Tensor:
    """Bool (B, N): True for tokens routed around the blocks in the last training forward.

    With several routes, a token counts as routed if any route set it aside (or pass `route=k`).
    For losses that weight routed tokens differently; TREAD's own loss uses all tokens.
    """
    routed = unwrap_compiled(routed)[0]
    selects = list(getattr(routed, _STATE).routes) if isinstance(routed, RoutedModel) else []
    if not selects:
        raise InputError("last_route_mask needs a model returned by routekit.apply with at least one route")
    if route is not None:
        if type(route) is not int or not 0 <= route < len(selects):
            raise InputError(f"route {route} does not exist; valid routes are 0..{len(selects) - 1}")
        selects = [selects[route]]
    if any(s.last_index is None for s in selects):
        raise InputError("no routed forward has run yet: call the model in train() mode first")
    masks = []
    for s in selects:
        kept = torch.zeros(s.last_index.shape[0], s.last_tokens, dtype=torch.bool, device=s.last_index.device)
        masks.append(~kept.scatter(1, s.last_index, True))
    return torch.stack(masks).any(0)

"""`apply`, the one verb: a routed model assembled from a plan, run by one of two executors.

The routed model is an instance of a subclass of the model's own class that shares every submodule,
parameter and buffer with the model (held once): `state_dict` keys are the model's, an original
checkpoint loads strictly, attributes and methods are all there, and `isinstance` still holds. In
`eval()` its forward *is* the original forward (unless DAR changed the model); in `train()` it runs
the plan through its executor: the rewritten fx graph (`programs.Programs`, graph mode), or hooks at the block
calls (`hooks.Hooks`, boundary mode) where the owner's forward cannot be traced. Both executors read
the same frozen plan, made by the same checks.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .analysis import analyse
from .calls import signature_of
from .config import DAR, Route, coerce_routes
from .dar import DarState
from .errors import ConfigError, InputError, NonFiniteError, TraceError
from .findings import GraphReport
from .guards import assigned_attributes
from .hooks import Hooks
from .plan import Plan, make_plan
from .probe import Probe
from .programs import Programs, build_program
from .record import record
from .rewrite import STATE
from .routing import RouteSelect
from .state import eager, preserved_state, training_mode, unwrap_compiled
from .trace import Trace, trace, user_location
from .values import TensorMeta, flatten

Mode = Literal["auto", "graph", "boundary"]


class FallbackWarning(UserWarning):
    """routekit runs part of the model otherwise than it was asked to: routes at block calls (boundary mode)
    because the owner's forward does not trace, or blocks compiled on their own that DAR inlines, uncompiled."""


# ---- observing a model: trace or record, then analyse ------------------------------------------------------------

def observe(model: nn.Module, args: tuple, kwargs: dict, *, mode: Mode = "auto", stack: str | None = None,
            residual: bool = False) -> tuple[Trace | None, GraphReport]:
    """The training-mode trace of `model` (None in boundary mode) and its analysis.

    mode "graph" traces the owner's forward (TraceError if it cannot); "boundary" records the block
    calls; "auto" traces and falls back to recording with a FallbackWarning that says why.
    """
    if mode not in ("auto", "graph", "boundary"):
        raise ConfigError(f"mode must be 'auto', 'graph' or 'boundary', got {mode!r}")
    reason = None
    sets = assigned_attributes(type(model))
    if sets and mode != "boundary":
        attr, where = sets[0]
        reason = (f"{where} sets self.{attr} as the forward runs, state a traced graph would not carry (and "
                  "that may change only in another mode)")
        if mode == "graph":
            raise TraceError(f"cannot trace {type(model).__name__}.forward: {reason}; route it in mode='boundary'")
    with training_mode(model, True):
        if mode != "boundary" and reason is None:
            try:
                tr = trace(model, args, kwargs)
                return tr, analyse(tr, model, stack=stack, residual=residual, call=(args, kwargs))
            except TraceError as err:
                if mode == "graph":
                    raise
                reason = str(err)
        recorded, images = record(model, args, kwargs)  # InputError where the model does not run on the inputs
    if reason is not None:
        warnings.warn(f"routekit: {type(model).__name__}.forward does not trace, so routes go at the block calls "
                      f"(boundary mode; DAR needs graph mode): {reason}. Pass mode='graph' to make this an error, "
                      "or mode='boundary' to ask for it", FallbackWarning, stacklevel=3)
    with training_mode(model, True):
        return None, analyse(recorded, model, stack=stack, mode="boundary", fallback=reason, images=images,
                             call=(args, kwargs), residual=residual)


# ---- the routed model ------------------------------------------------------------------------------------------

class RoutekitState(nn.Module):
    """Everything routekit adds to a model, under one name: route selectors and DAR's queries."""

    def __init__(self, plan: Plan, dar: DarState | None = None):
        super().__init__()
        grid = plan.grid if plan.grid_given else None
        self.routes = nn.ModuleList([RouteSelect(r.route, r.keep, grid, r.shared) for r in plan.placed])
        if dar is not None:
            self.dar = dar


# What a routed model holds of its own: nn.Module's tables (its submodule table adds routekit's state; the
# parameter, buffer and hook tables are the model's own dicts), a compiled call of its own, routekit's
# state. Everything else (the mode, `self.scale`, diffusers' `gradient_checkpointing`, a config) is the
# model's, read and written there, as a torch.compile or peft wrapper reads the model it wraps.
_OWN = (frozenset(nn.Module().__dict__) - {"training"}) | {"_compiled_call_impl"}


class RoutedModel(nn.Module):
    """Mixin before the model's class: the training forward runs the plan through the executor. One state
    with the model: an attribute set on either after `apply` is seen by both (see `_OWN`)."""

    _routekit_base: type
    _routekit_signature: inspect.Signature  # the base forward's, without self: read once, never under Dynamo

    def __getattr__(self, name: str):
        state = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if name in state.get(table, ()):
                return state[table][name]
        model = state.get("_routekit_model")
        if model is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        found = model.__dict__.get(name, _OWN)
        return getattr(model, name) if found is _OWN else found

    def __setattr__(self, name: str, value) -> None:
        model = self.__dict__.get("_routekit_model")
        if model is None or name in _OWN or name.startswith(("_routekit_", "__")):
            return super().__setattr__(name, value)
        setattr(model, name, value)
        if isinstance(value, nn.Module):  # a submodule set on the routed model: in its own table too
            self._modules[name] = value

    def __delattr__(self, name: str) -> None:
        model = self.__dict__.get("_routekit_model")
        if model is None or name in _OWN or name.startswith("_routekit_") or name in self._modules:
            self._modules.pop(name, None) if name in self._modules else super().__delattr__(name)
            if model is None or name not in model._modules:
                return
        delattr(model, name)

    def forward(self, *args, **kwargs):
        plan = self._routekit_plan
        if not self.training and plan.dar is None:
            return super().forward(*args, **kwargs)  # routes are training-only: the original forward
        out = self._routekit_executor(self, args, kwargs)
        if self._routekit_check_finite:
            _check_finite(out, plan)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Strict about the original weights; routekit's own (DAR queries) may be absent from a checkpoint."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if not k.startswith(STATE + ".")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing}, "
                f"unexpected keys {result.unexpected_keys}"
            )
        return result

    def __reduce__(self):
        """Pickle (torch.save, copy.deepcopy) as the model's own class plus routekit's state, not the made-up class."""
        return _unpickle, (self._routekit_base, dict(self.__dict__))


_CLASSES: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    if cls not in _CLASSES:
        shadowed = {name: _model_first(name) for name in _class_values(cls)}
        _CLASSES[cls] = type(f"Routed{cls.__name__}", (RoutedModel, cls),
                             {"_routekit_base": cls, "_routekit_signature": signature_of(cls.forward),
                              "__module__": cls.__module__, **shadowed})
    return _CLASSES[cls]


def _class_values(cls: type) -> set[str]:
    """The plain values a model's classes hold as defaults for their instances (diffusers' `_hf_peft_config_loaded =
    False`, set True on the model by `add_adapter`): a routed model reads the model's own value first."""
    names = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        names |= {name for name, value in vars(klass).items() if not name.startswith("__") and name not in _OWN
                  and not hasattr(value, "__get__") and not isinstance(value, type)}
    return names


def _model_first(name: str) -> property:
    """The model's own attribute `name`, else its class's default: a property, as an instance attribute would
    be read before the class's (a property, rather than a `__getattribute__` of the routed model's own, because
    torch.compile traces through attribute reads)."""
    def get(self):
        model = self.__dict__.get("_routekit_model")
        found = model.__dict__.get(name, _OWN) if model is not None else _OWN
        return getattr(self._routekit_base, name) if found is _OWN else found

    def put(self, value):
        setattr(self.__dict__["_routekit_model"], name, value)

    return property(get, put, doc=f"the model's {name}")


def _unpickle(base: type, state: dict) -> nn.Module:
    """Rebuild a pickled routed model; its programs are traced again on first use."""
    routed = _routed_class(base).__new__(_routed_class(base))
    routed.__dict__.update(state)
    return routed


def assemble(model: nn.Module, plan: Plan, tr: Trace | None, example: tuple[tuple, dict], *,
             generator: torch.Generator | None = None, check_finite: bool = False) -> nn.Module:
    """The routed model of `plan`: graph mode when `tr` (the training trace of the `example` call) is given,
    boundary mode otherwise."""
    dar = None
    if plan.dar is not None:
        dar = DarState(plan.dar.config, plan.dar.points, plan.report.stream.shape[2], like=model)
    routed = _routed_class(type(model)).__new__(_routed_class(type(model)))
    routed.__dict__.update({k: v for k, v in model.__dict__.items() if k in _OWN}, _routekit_model=model)
    routed.__dict__["_modules"] = type(model._modules)(model._modules)  # its own table: routekit's state joins it
    state = RoutekitState(plan, dar)
    routed.add_module(STATE, state)
    for select in state.routes:
        select.generator = generator
    executor = Programs(plan) if tr is not None else Hooks(plan)
    routed.__dict__.update(_routekit_plan=plan, _routekit_executor=executor, _routekit_check_finite=check_finite)
    with training_mode(routed, True):
        if tr is not None:
            executor.program(routed, *example, seed=build_program(tr, plan, model, True))
        else:
            executor.attach(routed, list(state.routes))
    if tr is not None and plan.dar is not None:
        # DAR's eval forward is a program too (routes alone evaluate with the original forward): built now, so a
        # trace that fails says so at apply, and a first evaluation under torch.compile(fullgraph=True), where
        # building it would be a graph break, finds it ready
        with training_mode(routed, False):
            executor.program(routed, *example)
    return routed


def apply(model: nn.Module, routes: Route | list[Route] | str | None = None, residual: DAR | None = None,
          example_inputs: tuple | torch.Tensor = (), example_kwargs: dict | None = None, *,
          grid: tuple[int, int] | None = None, stack: str | None = None,
          generator: torch.Generator | None = None, check_finite: bool = False, mode: Mode = "auto") -> nn.Module:
    """Route `model`'s training graph; returns the routed model (the model itself is left unchanged).

    routes: a Route, a list of disjoint Routes, or "default" (TREAD's 2 → depth−4, rate 0.5).
    residual: DAR(...) to replace the residual adds by DAR's aggregations (graph mode only).
    example_inputs / example_kwargs: one call's arguments, used once to trace and check shapes.
    grid: the (H, W) token grid when it cannot be read off a patch embedding. stack: the qualified
    name of the block container when several chains exist. generator: makes selections reproducible.
    check_finite: raise NonFiniteError when a routed forward produces NaN/Inf (for debugging: it reads the output
    on the host every step, a sync, and under torch.compile a graph break, which fullgraph=True refuses).
    mode: "graph" rewrites the traced owner forward; "boundary" places the routes with hooks at the
    block calls; "auto" uses graph mode and falls back to boundary mode (with a FallbackWarning) when
    the owner forward does not trace. A torch.compile'd model comes back compiled the same way.
    """
    model, rewrap = unwrap_compiled(model)
    model = _unwrapped(model)
    if residual is not None and not isinstance(residual, DAR):
        raise ConfigError(f"residual must be routekit.DAR(...) or None, got {residual!r}")
    args, kwargs = example_call(model, example_inputs, example_kwargs)
    with eager():
        tr, report = observe(model, args, kwargs, mode=mode, stack=stack, residual=residual is not None)
        plan = make_plan(report, coerce_routes(routes, report.depth), residual, Probe(model, report), grid=grid)
        _warn_uncompiled(plan)
        routed = assemble(model, plan, tr, (args, kwargs), generator=generator, check_finite=check_finite)
        _dry_run(routed, plan, tr, args, kwargs)
    return rewrap(routed)  # in the model's modes, module by module (they are the same modules)


def _warn_uncompiled(plan: Plan) -> None:
    """Blocks compiled on their own that DAR inlines run their code uncompiled (`Plan.uncompiled_by_dar`): a
    slower training step nobody asked for, unless the routed model is compiled as a whole."""
    lost = plan.uncompiled_by_dar()
    if lost:
        names = lost[0] if len(lost) == 1 else f"{lost[0]} … {lost[-1]} ({len(lost)} blocks)"
        warnings.warn(f"routekit: {names} run under torch.compile on their own, and DAR inlines them into the routed "
                      "model's graph (each aggregation reads sublayer outputs across blocks), so in training their "
                      "code runs uncompiled. Compile the routed model as a whole instead: torch.compile(routed). "
                      "Evaluation runs the original model, compiled blocks included", FallbackWarning, stacklevel=3)


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


def example_call(model: nn.Module, example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """The example call as (args, kwargs), checked: InputError says what is wrong with it."""
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


def _dry_run(routed: nn.Module, plan: Plan, tr: Trace | None, args: tuple, kwargs: dict) -> None:
    """Run the routed training forward once on the example inputs: its outputs must match the original's shapes."""
    with training_mode(routed, True), preserved_state(routed, _tensors(args, kwargs)):
        try:
            out = routed(*args, **kwargs)
        except Exception as err:
            raise ConfigError(
                f"the routed training forward failed on the example inputs at {user_location(err.__traceback__)}: "
                f"{type(err).__name__}: {err}{_BOUNDARY_HINT if plan.mode == 'boundary' else ''}"
            ) from err
    got = [TensorMeta(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in flatten(out)[0]]
    graph = tr.graph if tr is not None else None
    output = next(n for n in graph.nodes if n.op == "output") if graph is not None else None
    want = pytree.tree_leaves([a.meta["rk"] if isinstance(a, fx.Node) else a for a in output.args[0]]) \
        if output is not None else got
    for select in getattr(routed, STATE).routes:
        select.last_index = None
    if [_shape_or_type(g) for g in got] != [_shape_or_type(w) for w in want]:
        raise ConfigError(f"routing changed the training output shapes: original {want}, routed {got}")


# A boundary-mode route runs the routed blocks on the kept tokens: what a block hands out other than by its return
# value has only those, and code that joins it with every token's values fails (or, without a size check, mixes
# token counts silently, which is why the README names the common case).
_BOUNDARY_HINT = (
    ". In boundary mode the routed blocks see only the kept tokens, so a value they hand out by a side way (a hook "
    "that collects per-token outputs, such as transformers' router logits for its load-balancing loss) has only "
    "those; turn such outputs off while training with routes (output_router_logits=False), or route blocks that "
    "make none")


def _shape_or_type(value: Any) -> Any:
    """What an output must keep under a route: a tensor its shape, anything else its type (a cache the forward
    returns is a fresh object each call)."""
    return value.shape if isinstance(value, TensorMeta) else type(value)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _check_finite(out, plan: Plan) -> None:
    for i, t in enumerate(flatten(out)[0]):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            raise NonFiniteError(
                f"output {i} of the routed forward has NaN/Inf (routes: "
                f"{', '.join(f'{r.start}→{r.end}' for r in plan.placed)}); check_finite=True raised it"
            )


def strip(routed: nn.Module, *, drop_dar: bool = False) -> nn.Module:
    """The plain model back: the model `apply` was given (one state with the routed model: same weights, same
    attributes), compiled as the routed model was. A model trained with DAR computes something else without
    its aggregations: that is refused unless `drop_dar=True` says to drop them (and their trained queries)."""
    routed, rewrap = unwrap_compiled(routed)
    if not isinstance(routed, RoutedModel):
        raise InputError(f"strip takes a model returned by routekit.apply, got {type(routed).__name__}")
    if routed._routekit_plan.dar is not None and not drop_dar:
        raise ConfigError(
            f"this model has DAR ({routed._routekit_plan.dar.points} aggregations in place of its residual adds): "
            "without them it computes something else, so strip would drop what it learned; keep the routed model "
            "(its eval runs DAR), or pass strip(model, drop_dar=True) to get the model without DAR anyway"
        )
    return rewrap(routed._routekit_model)


def report_of(routed: nn.Module) -> Plan:
    """The plan `apply` made (it reads as its analysis too: `report_of(m).stack`, `.grid`, `.mode`)."""
    routed = unwrap_compiled(routed)[0]
    if not isinstance(routed, RoutedModel):
        raise InputError(f"expected a model returned by routekit.apply, got {type(routed).__name__}")
    return routed._routekit_plan


@contextlib.contextmanager
def force_keep(routed: nn.Module, mask: torch.Tensor):
    """Within the block, every route of `routed` keeps the tokens `mask` marks (bool (batch, tokens)), e.g. the
    tokens a masked loss reads: they are never routed around. The selector's choice fills the rest of the
    route's kept count; a sample with more marked tokens than that raises the count for the whole batch.

        with rk.force_keep(routed, loss_mask):
            loss = (routed(x, t, y) - target)[loss_mask].pow(2).mean()
    """
    routed = unwrap_compiled(routed)[0]
    selects = list(getattr(routed, STATE).routes) if isinstance(routed, RoutedModel) else []
    if not selects:
        raise InputError("force_keep needs a model returned by routekit.apply with at least one route")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise InputError(f"force_keep's mask is a bool (batch, tokens) tensor, got {mask!r:.80}")
    for select in selects:
        select.force = mask
    try:
        yield routed
    finally:
        for select in selects:
            select.force = None


def last_route_mask(routed: nn.Module, route: int | None = None) -> torch.Tensor:
    """Bool (B, N): True for tokens routed around the blocks in the last training forward.

    With several routes, a token counts as routed if any route set it aside (or pass `route=k`).
    For losses that weight routed tokens differently; TREAD's own loss uses all tokens.
    """
    routed = unwrap_compiled(routed)[0]
    selects = list(getattr(routed, STATE).routes) if isinstance(routed, RoutedModel) else []
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

"""`apply`, the one verb: a plan installed on the model, run by one of two executors.

The routed model is the user's model: `apply` installs a `Routing` as the instance's `forward` (as accelerate
installs its autocast wrapper) and changes nothing else, so its class, attributes, modules, `state_dict`,
`config`, `save_pretrained`, pickling and the libraries' own hooks are the model's. In `eval()` the forward
*is* the original forward (unless DAR changed the model); in `train()` it runs the plan through its executor:
the rewritten fx graph (`programs.Programs`, graph mode), or hooks at the block calls (`hooks.Hooks`, boundary
mode) where the owner's forward cannot be traced. Both executors read the same frozen plan, made by the same
checks. DAR's queries are parameters of the model, under the `routekit` submodule; `strip` takes it all off.
"""

from __future__ import annotations

import contextlib
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
from .decision import Plan
from .errors import ConfigError, InputError, NonFiniteError, TraceError
from .findings import GraphReport
from .fusion import FusedEnd
from .guards import assigned_attributes
from .hooks import Hooks
from .placing import STATE
from .plan import make_plan
from .probe import Probe
from .programs import Programs, build_program
from .record import record
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


# ---- the routing installed on a model ------------------------------------------------------------------------

class RoutekitState(nn.Module):
    """Everything routekit adds to a model, under one name: route selectors, fused routes' ends (`sprint`, by
    route number) and DAR's queries. A submodule of the model only where it holds parameters the model trains
    and saves (DAR, fused routes); with TREAD's routes alone a plain attribute, so the model's modules,
    `state_dict` and `repr` are the user's."""

    def __init__(self, plan: Plan, dar: DarState | None = None, like: nn.Module | None = None):
        super().__init__()
        grid = plan.grid if plan.grid_given else None
        self.routes = nn.ModuleList([RouteSelect(r.route, r.keep, grid, r.shared) for r in plan.placed])
        if plan.fused:
            self.sprint = nn.ModuleDict({
                str(k): FusedEnd(plan.placed[k].route.fuse, plan.report.stack_of(plan.placed[k].end).stream.shape[-1],
                                 like=like) for k in plan.fused})
        if dar is not None:
            self.dar = dar
        self.register_load_state_dict_post_hook(_optional)


def _optional(state: RoutekitState, incompatible) -> None:
    """A checkpoint of the original model loads strictly into the routed one: routekit's own parameters (DAR's
    queries) it lacks keep their values instead of counting as missing."""
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(STATE + ".")]


class Routing:
    """What `apply` installs on a model, as the model's own `forward` (an attribute of the instance, as
    accelerate installs its autocast wrapper): in `train()` it runs the plan through the executor, in `eval()`
    the original forward (unless DAR changed the model). The model keeps its class, its attributes, its modules
    and its parameters: nothing else of routekit is on it but this and, with DAR, the `routekit` submodule.

    `original(...)` is the forward as it was before `apply` (the class's, or a wrapper installed before)."""

    def __init__(self, model: nn.Module, plan: Plan, executor: Programs | Hooks, state: RoutekitState,
                 check_finite: bool):
        self.model, self.plan, self.executor, self.state, self.check_finite = model, plan, executor, state, check_finite
        self.inner = model.__dict__.get("forward")  # a forward installed on the instance before, else None
        self.__signature__ = signature_of(type(model).forward)  # what `inspect.signature(model.forward)` shows
        self.suspended = 0  # > 0: the original forward, whatever the mode (`original_forward`)

    def original(self, *args, **kwargs):
        model = self.model
        return self.inner(*args, **kwargs) if self.inner is not None else type(model).forward(model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        model, plan = self.model, self.plan
        if self.suspended or (not model.training and not plan.changes_model):
            return self.original(*args, **kwargs)  # TREAD's routes are training-only: the original forward
        out = self.executor(model, args, kwargs)
        if self.check_finite:
            _check_finite(out, plan)
        return out

    def __getstate__(self):  # a Signature does not pickle: read again from the class
        return {k: v for k, v in self.__dict__.items() if k != "__signature__"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__signature__ = signature_of(type(self.model).forward)

    def __repr__(self) -> str:
        routes = ", ".join(f"{r.start}→{r.end}" for r in self.plan.placed) or "none"
        fused = f", fused {', '.join(map(str, self.plan.fused))}" if self.plan.fused else ""
        return (f"<routekit routing of {type(self.model).__name__}: routes {routes}{fused}"
                f"{', DAR' if self.plan.dar else ''}>")


def routing_of(model: Any) -> Routing | None:
    """The routing `apply` installed on `model` (a torch.compile wrapper looked through), or None."""
    model = unwrap_compiled(model)[0]
    found = model.__dict__.get("forward") if isinstance(model, nn.Module) else None
    return found if isinstance(found, Routing) else None


def routed_model(model: Any, what: str) -> tuple[nn.Module, Routing]:
    """(the module, its routing) of a model `apply` routed; InputError naming `what` asked otherwise."""
    routing = routing_of(model)
    if routing is None:
        raise InputError(f"{what} takes a model routed by routekit.apply, got {type(model).__name__} without routes")
    return routing.model, routing


@contextlib.contextmanager
def original_forward(model: nn.Module):
    """Within the block, a routed model runs its original forward in any mode (what `verify` compares with)."""
    routing = routing_of(model)
    if routing is None:
        yield model
        return
    routing.suspended += 1
    try:
        yield routing.model
    finally:
        routing.suspended -= 1


def install(model: nn.Module, plan: Plan, tr: Trace | None, example: tuple[tuple, dict], *,
            generator: torch.Generator | None = None, check_finite: bool = False) -> Routing:
    """Route `model` in place by `plan`: graph mode when `tr` (the training trace of the `example` call) is
    given, boundary mode otherwise."""
    dar = None
    if plan.dar is not None:
        dar = DarState(plan.dar.config, plan.dar.points, plan.report.stream.shape[2], like=model)
    state = RoutekitState(plan, dar, like=model)
    for select in state.routes:
        select.generator = generator
    for end in getattr(state, "sprint", {}).values():
        end.generator = generator
    if plan.changes_model:
        model.add_module(STATE, state)
    else:  # no parameters: an attribute, not a submodule (the model's modules and state_dict stay the user's)
        object.__setattr__(model, STATE, state)
    signature = signature_of(type(model).forward)
    executor = Programs(plan, signature) if tr is not None else Hooks(plan)
    routing = Routing(model, plan, executor, state, check_finite)
    if tr is not None:
        executor.original = routing.original
    object.__setattr__(model, "forward", routing)
    with training_mode(model, True):
        if tr is not None:
            executor.program(model, *example, seed=build_program(tr, plan, model, True))
        else:
            executor.attach(model, list(state.routes), routing.original)
    if tr is not None and plan.changes_model:
        # the eval forward of a model DAR or a fused route changed is a program too (TREAD's routes alone evaluate
        # with the original forward): built now, so a trace that fails says so at apply, and a first evaluation
        # under torch.compile(fullgraph=True), where building it would be a graph break, finds it ready
        with training_mode(model, False):
            executor.program(model, *example)
    return routing


def reinstall(model: nn.Module, routing: Routing) -> None:
    """Put back a routing `uninstall` took off (its state, its forward, boundary mode's hooks)."""
    object.__setattr__(model, STATE, routing.state)
    object.__setattr__(model, "forward", routing)
    if isinstance(routing.executor, Hooks):
        routing.executor.attach(model, list(routing.state.routes), routing.original)


def uninstall(model: nn.Module) -> None:
    """Take routekit off `model`: its forward, hooks and state (DAR's queries with them)."""
    routing = routing_of(model)
    if routing is None:
        return
    if isinstance(routing.executor, Hooks):
        routing.executor.detach()
    if routing.inner is not None:
        object.__setattr__(model, "forward", routing.inner)
    else:
        del model.__dict__["forward"]
    if STATE in model._modules:
        del model._modules[STATE]
    model.__dict__.pop(STATE, None)


def apply(model: nn.Module, routes: Route | list[Route] | str | None = None, residual: DAR | None = None,
          example_inputs: tuple | torch.Tensor = (), example_kwargs: dict | None = None, *,
          grid: tuple[int, int] | None = None, stack: str | None = None,
          generator: torch.Generator | None = None, check_finite: bool = False, mode: Mode = "auto") -> nn.Module:
    """Route `model`'s training graph, in place (as torchao's `quantize_` and PEFT's injection do): returns the
    model, of its own class, whose training forward now runs the routes; `strip(model)` takes them off again.

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
    before = routing_of(model)
    uninstall(model)  # routes applied before are replaced (a refused apply puts them back)
    try:
        with eager():
            tr, report = observe(model, args, kwargs, mode=mode, stack=stack, residual=residual is not None)
            plan = make_plan(report, coerce_routes(routes, report.depth), residual, Probe(model, report), grid=grid)
            _warn_uncompiled(plan)
            install(model, plan, tr, (args, kwargs), generator=generator, check_finite=check_finite)
            _dry_run(model, plan, tr, args, kwargs)
    except BaseException:
        uninstall(model)
        if before is not None:
            reinstall(model, before)
        raise
    return rewrap(model)


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
    routing = routing_of(model)
    if routing is not None and routing.plan.changes_model:
        what = "DAR, which changed the model (its aggregations and their queries)" if routing.plan.dar else \
            "fused routes, which changed the model (their mask tokens and fusions)"
        raise ConfigError(
            f"this {type(model).__name__} has {what}: applying again would drop them; to change a route's rate "
            "between training stages call routekit.set_rate(model, rate); to start over, "
            "routekit.strip(model, drop_learned=True) first"
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
    for select in routing_of(routed).state.routes:
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


def strip(routed: nn.Module, *, drop_learned: bool = False) -> nn.Module:
    """Take the routes off a model `apply` routed, in place, and return it: its forward is the original again,
    in every mode. A model trained with DAR or fused routes computes something else without them: that is
    refused unless `drop_learned=True` says to drop them (DAR's queries, the fusions and mask tokens)."""
    model, routing = routed_model(routed, "strip")
    plan = routing.plan
    if plan.changes_model and not drop_learned:
        what = f"DAR ({plan.dar.points} aggregations in place of its residual adds)" if plan.dar else \
            f"fused routes ({', '.join(f'{plan.placed[k].start}→{plan.placed[k].end}' for k in plan.fused)}: " \
            "SPRINT's mask tokens and fusions)"
        raise ConfigError(
            f"this model has {what}: without them it computes something else, so strip would drop what it "
            "learned; keep the routed model (its eval runs them), or pass strip(model, drop_learned=True) to get the "
            "original model anyway"
        )
    uninstall(model)
    return routed


def report_of(routed: nn.Module) -> Plan:
    """The plan `apply` made (it reads as its analysis too: `report_of(m).stack`, `.grid`, `.mode`)."""
    return routed_model(routed, "report_of")[1].plan


def _selects(routed: nn.Module, what: str) -> list[RouteSelect]:
    selects = list(routed_model(routed, what)[1].state.routes)
    if not selects:
        raise InputError(f"{what} needs a model routed by routekit.apply with at least one route")
    return selects


@contextlib.contextmanager
def force_keep(routed: nn.Module, mask: torch.Tensor):
    """Within the block, every route of `routed` keeps the tokens `mask` marks (bool (batch, tokens)), e.g. the
    tokens a masked loss reads: they are never routed around. The selector's choice fills the rest of the
    route's kept count; a sample with more marked tokens than that raises the count for the whole batch.

        with rk.force_keep(routed, loss_mask):
            loss = (routed(x, t, y) - target)[loss_mask].pow(2).mean()
    """
    selects = _selects(routed, "force_keep")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise InputError(f"force_keep's mask is a bool (batch, tokens) tensor, got {mask!r:.80}")
    for select in selects:
        select.force = mask
    try:
        yield unwrap_compiled(routed)[0]
    finally:
        for select in selects:
            select.force = None


def last_route_mask(routed: nn.Module, route: int | None = None) -> torch.Tensor:
    """Bool (B, N): True for tokens routed around the blocks in the last training forward.

    With several routes, a token counts as routed if any route set it aside (or pass `route=k`).
    For losses that weight routed tokens differently; TREAD's own loss uses all tokens.
    """
    selects = _selects(routed, "last_route_mask")
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

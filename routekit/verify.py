"""`verify`: prove that a routed model changes only what was asked, in eval and in training.

Three checks; the first raises `InferenceChanged`, the training checks `TrainingChanged`, each with what differs:

1. eval: the routed model in eval is the original model: the same traced graph, node for node, and
   bit-identical outputs under the same seed. DAR and fused routes (SPRINT's end) change the model, so its
   eval is held to its own graph as a fresh trace builds it now (a program built at `apply` must not have
   gone stale).
2. train at rate 0: the routed model's own training program, with every route keeping every token,
   reproduces the original forward in train mode (the model as the routed model holds it now, same
   seed) bit for bit: routes are pure gathers and scatters, nothing else in the graph may differ. With
   DAR, to rounding, against DAR without routes: route boundaries split chunk sums, and the tolerance is a few
   units in the last place of the output's dtype. With fused routes, bit for bit against the model's own
   full-token program (what its eval runs), with the path drop off. Where a block inlined by DAR was specialised to the kept
   count, the routed program is traced again at rate 0, and the result says so.
3. the kept tokens: at the first route's start, with its real rate, the route's first block gets the
   original stream gathered at the kept tokens, and computes what the original block computes on the
   original inputs cut to them (the stream gathered, every side input as the plan cuts it).

Both sides run alike: each run gets its own copy of the call's arguments (a generation cache the first run
filled would otherwise hand the next run its keys and values too), and where the model holds compiled
regions (blocks under `torch.compile`) every run, routed or not, runs them eagerly: a routed program calls a
compiled block at other shapes and strides, Dynamo compiles it again, and another kernel rounds otherwise, a
difference that says nothing about the rewrite. The result says so (`compiled`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from .bind import bind
from .calls import bind_arguments, parameter_names
from .decision import Plan
from .errors import InferenceChanged, InputError, TraceError, TrainingChanged
from .model import example_call, original_forward, report_of, routing_of, unwrap_compiled
from .programs import Programs
from .reference import masked_reference
from .routing import gather_tokens, route_side
from .state import eager, fresh, is_compiled, preserved_state, training_mode
from .trace import trace
from .values import flatten


def graph_lines(graph: fx.Graph) -> list[str]:
    """One line per node: op, target and arguments, in the names users know (module paths)."""
    lines = []
    for node in graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        lines.append(f"{node.name} = {node.op}[{target}](args={node.args}, kwargs={node.kwargs})")
    return lines


@dataclass(frozen=True)
class Verified:
    """What `verify` compared. A check that ran says what it found; one that could not run says why (a string
    that starts with "not run"); None where the model gives it nothing to check (no routes).

    mode: "graph" or "boundary", how the routes are placed. outputs: the eval outputs compared bit for bit.
    nodes: eval graph nodes compared with an unrouted copy passed as `model` (None when the routed model is held
    to its own original forward). variants: the keyword arguments with which the eval call was compared too
    (`output_hidden_states=True`, ...). train: the rate-0 training check. kept: the kept-token check of the
    first route's first block. reference: the masked-attention reference (reference.py), which does not share
    routekit's reading of the model. compiled: the compiled regions run eagerly for the comparison, or None."""

    mode: str
    outputs: int
    nodes: int | None = None
    variants: tuple[str, ...] = ()
    train: str | None = None
    kept: str | None = None
    reference: str | None = None
    compiled: str | None = None

    @property
    def checks(self) -> tuple[str, ...]:
        """The checks that ran."""
        ran = ["eval"] + [name for name in ("train", "kept", "reference")
                          if getattr(self, name) is not None and not getattr(self, name).startswith("not run")]
        return tuple(ran)

    def __str__(self) -> str:
        lines = [f"verified ({self.mode} mode): eval {self.outputs} outputs bit-identical"
                 + (f", {self.nodes} graph nodes" if self.nodes is not None else "")
                 + (f"; also with {', '.join(self.variants)}" if self.variants else "")]
        lines += [f"  {name}: {getattr(self, name)}" for name in ("train", "kept", "reference", "compiled")
                  if getattr(self, name) is not None]
        return "\n".join(lines)


def verify(model: nn.Module, routed: nn.Module, example_inputs: tuple | torch.Tensor = (),
           example_kwargs: dict | None = None, *, seed: int = 0) -> Verified:
    """Check `routed` against the original model on the example inputs (see the module docstring and
    `Verified`); raises `InferenceChanged` or `TrainingChanged` with what differs. `model` is the routed model
    itself (held to its own original forward) or an unrouted copy of it."""
    model, routed = unwrap_compiled(model)[0], unwrap_compiled(routed)[0]
    if type(seed) is not int:
        raise InputError(f"seed is an int, got {seed!r:.80}")
    if routing_of(routed) is None:
        raise InputError(f"verify checks a model routed by routekit.apply(model, ...); got {type(routed).__name__} "
                         "without routes")
    if model is not routed and routing_of(model) is not None:
        raise InputError("verify(model, routed, ...): model is routed too; pass the routed model as both (it is "
                         "compared with its own original forward), or an unrouted copy of it as model")
    args, kwargs = example_call(model, example_inputs, example_kwargs)
    plan = report_of(routed)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    compiled = compiled_regions(routed)
    train = kept = reference = None
    with preserved_state(model, tensors), preserved_state(routed, tensors), eager():
        nodes, outputs = _eval(model, routed, args, kwargs, seed)
        # a changed model computes otherwise, its layers' outputs too: the libraries' extra outputs are not the original's
        variants = _eval_variants(routed, args, kwargs, seed) if not plan.changes_model else ()
        if plan.placed:
            with torch.enable_grad(), _no_path_drop(routed):  # as training runs: a forward may branch on it
                train = _train_at_rate_zero(routed, args, kwargs, seed)
                kept = _kept_tokens(routed, args, kwargs, seed) if plan.dar is None else (
                    "not run: DAR inlines the blocks into one graph, so no block call is there to compare")
            reference = _reference(routed, args, kwargs, seed) if not plan.changes_model else (
                f"not run: {'DAR' if plan.dar else 'a fused route'} changes the model, and the reference runs the "
                "original model's blocks and route ends")
    note = (f"{', '.join(compiled[:3])}{' ...' if len(compiled) > 3 else ''} compiled: run eagerly on both sides"
            if compiled else None)
    return Verified(plan.report.mode, outputs, nodes, variants, train, kept, reference, note)


def compiled_regions(model: nn.Module) -> list[str]:
    """The modules of `model` that run under torch.compile (`state.is_compiled`)."""
    return [name or type(module).__name__ for name, module in model.named_modules() if is_compiled(module)]


def _original(routed: nn.Module):
    """The routed model's original forward, in whatever mode the model is in (its own weights)."""
    def run(*args, **kwargs):
        with original_forward(routed) as model:
            return model(*args, **kwargs)
    return run


def _run(module: nn.Module, args: tuple, kwargs: dict, seed: int, what: str, error=InferenceChanged) -> Any:
    torch.manual_seed(seed)
    args, kwargs = fresh((args, kwargs))
    try:
        return module(*args, **kwargs)
    except Exception as err:
        raise error(f"{what} fails on the example inputs: {type(err).__name__}: {err}") from err


def _eval(model: nn.Module, routed: nn.Module, args: tuple, kwargs: dict, seed: int) -> tuple[int | None, int]:
    plan = report_of(routed)
    with training_mode(model, False), training_mode(routed, False), torch.no_grad():
        if plan.changes_model:
            what = "DAR" if plan.dar else "fused"
            want = _run(lambda *a, **k: routing_of(routed).executor.run_fresh(routed, a, k), args, kwargs, seed,
                        f"the {what} graph traced afresh")
            _compare(want, _run(routed, args, kwargs, seed, "the routed model in eval"),
                     f"the {what} model's eval program", f"the {what} graph traced afresh")
            return None, len(flatten(want)[0])
        original = None
        if model is routed:  # routed in place: held to its own forward as it was before `apply`
            want = _run(_original(routed), args, kwargs, seed, f"{type(model).__name__} in eval", InputError)
        else:  # an unrouted copy: the same graph, and the same outputs with the routed model's weights
            try:
                original = graph_lines(trace(model, args, kwargs).graph)
            except TraceError:
                original = None  # an owner that does not trace in eval (boundary mode): outputs alone are compared
            if original is not None:
                now = graph_lines(trace(routed, args, kwargs).graph)
                if original != now:
                    diff = "\n".join(difflib.unified_diff(original, now, "original eval graph", "routed eval graph",
                                                          lineterm="", n=1))
                    raise InferenceChanged(f"the routed model's eval graph differs from the original's:\n{diff}")
            keys = set(model.state_dict(keep_vars=True))
            state = {k: v for k, v in routed.state_dict(keep_vars=True).items() if k in keys}
            want = _run(lambda *a, **k: functional_call(model, state, a, k), args, kwargs, seed,
                        f"{type(model).__name__} in eval", InputError)
        got = _run(routed, args, kwargs, seed, "the routed model in eval")
    _compare(want, got, "original", "routed")
    return (len(original) if original is not None else None), len(flatten(want)[0])


# Keyword arguments with which the libraries' forwards return more than by default (transformers' hidden states and
# attention maps, the tuple form): an eval call with any of them is the original forward's call too.
_EVAL_VARIANTS = {"output_hidden_states": True, "output_attentions": True, "return_dict": False}


def _eval_variants(routed: nn.Module, args: tuple, kwargs: dict, seed: int) -> tuple[str, ...]:
    """The eval call with each of `_EVAL_VARIANTS` its forward takes, compared with the original forward's element
    for element. Returns the variants compared."""
    names = routing_of(routed).__signature__.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in names.values())  # transformers' forwards take them so
    compared = []
    for name, value in _EVAL_VARIANTS.items():
        if (name not in names and not takes_any) or kwargs.get(name) == value:
            continue
        call = {**kwargs, name: value}
        with training_mode(routed, False), torch.no_grad():
            try:
                want = _run(_original(routed), args, call, seed, f"the original forward with {name}={value}", InputError)
            except InputError:
                continue  # the model's own forward does not take it on this call: nothing to compare
            got = _run(routed, args, call, seed, f"the routed model in eval with {name}={value}")
        _compare(want, got, f"original with {name}={value}", f"routed with {name}={value}")
        compared.append(f"{name}={value}")
    return tuple(compared)


@contextlib.contextmanager
def _no_path_drop(routed: nn.Module):
    """Within the block, fused routes drop no sample's deep path in training: verify's training checks compare
    two runs of one model, and a path drop draws which samples lose it from the selector's generator."""
    ends = list(getattr(routing_of(routed).state, "sprint", {}).values())
    shares = [end.path_drop for end in ends]
    for end in ends:
        end.path_drop = 0.0
    try:
        yield
    finally:
        for end, share in zip(ends, shares):
            end.path_drop = share


@contextlib.contextmanager
def _every_token(routed: nn.Module):
    """Within the block, every route of `routed` keeps every token (its selectors at rate 0): verify's rate-0
    run of the routed model's own training program."""
    selects = list(routing_of(routed).state.routes)
    routes = [select.route for select in selects]
    for select in selects:
        select.route = select.route.model_copy(update={"rate": 0.0})
    try:
        yield
    finally:
        for select, route in zip(selects, routes):
            select.route = route


def _train_at_rate_zero(routed: nn.Module, args: tuple, kwargs: dict, seed: int) -> str:
    plan = report_of(routed)
    executor = routing_of(routed).executor
    # DAR inlines the blocks, and a block whose code was specialised to its shapes is inlined as traced at the
    # route's kept count: where that code cannot take every token (it reshapes to the kept grid), the training
    # program cannot run at rate 0, and the routed program is traced again at rate 0 instead (and says so)
    retraced = plan.dar is not None and any(plan.report.blocks[i].adds and plan.report.blocks[i].body.specialised
                                            for r in plan.placed for i in r.blocks)
    how = ""
    with training_mode(routed, True):
        try:
            with _every_token(routed):
                got = _run(routed, args, kwargs, seed, "the routed training graph at rate 0", TrainingChanged)
        except TrainingChanged:
            if not retraced:
                raise
            zero = dataclasses.replace(plan, placed=tuple(
                dataclasses.replace(p, route=p.route.model_copy(update={"rate": 0.0})) for p in plan.placed))
            with _every_token(routed):
                got = _run(lambda *a, **k: executor.run_fresh(routed, a, k, plan=zero), args, kwargs, seed,
                           "the routed training graph traced at rate 0", TrainingChanged)
            how = " (traced at rate 0: a block's code is specialised to the kept count)"
        if plan.changes_model:  # its own program without routes: DAR's, or fused ends on every token
            reference = lambda *a, **k: executor.run_fresh(routed, a, k, routes=False)  # noqa: E731
        else:
            reference = _original(routed)
        want = _run(reference, args, kwargs, seed, "the original forward in train mode", InputError)
    if plan.dar is not None:  # the same sums in another order (route boundaries split two-phase chunks)
        _compare(want, got, "DAR without routes", "routed DAR at rate 0", close=True, error=TrainingChanged,
                 precision=_computed_in(routed))
        return f"rate 0{how} matches DAR without routes (to rounding)"
    if plan.fused:
        _compare(want, got, "fused routes on every token", "routed training graph at rate 0", error=TrainingChanged)
        return "rate 0 bit-identical to the fused routes on every token"
    _compare(want, got, "original in train mode", "routed training graph at rate 0", error=TrainingChanged)
    return "rate 0 bit-identical"


def _kept_tokens(routed: nn.Module, args: tuple, kwargs: dict, seed: int) -> int:
    """The first route's first block computes what the original block computes on the kept tokens: its
    stream input is the original's gathered at them, and its output is the original block's output on the
    original inputs cut by the plan (the stream gathered, each side input as the plan cuts it)."""
    seen: dict[str, Any] = {}

    def capture(key):
        def hook(module, a, kw):
            seen.setdefault(key, fresh((a, kw)))  # as the block got it: the run goes on to change a cache
            torch.manual_seed(seed + 1)  # the block's own random draws (dropout) are the same in every run
        return hook

    with training_mode(routed, True):
        plan = _plan_of_call(routed, args, kwargs)
        route, report = plan.placed[0], plan.report
        block = report.blocks[route.start]
        report = report.stack_of(route.start)  # the stream the route starts on
        module = routed.get_submodule(block.qualname)
        for key, run in (("routed", routed), ("original", _original(routed))):
            handles = [module.register_forward_pre_hook(capture(key), with_kwargs=True)]
            if key == "routed":  # first among the forward hooks: the block's own output, before a route's scatter
                handles.append(module.register_forward_hook(lambda m, a, out: seen.setdefault("output", out),
                                                            prepend=True))
            try:
                _run(run, args, kwargs, seed, f"the {key} model in train mode", TrainingChanged)
            finally:
                for handle in handles:
                    handle.remove()
        index = routing_of(routed).state.routes[0].last_index
        forward = type(unwrap_compiled(module)[0]).forward  # a compiled block's own signature
        names = parameter_names(unwrap_compiled(module)[0])
        name = lambda slot: names[slot] if isinstance(slot, int) else slot  # noqa: E731
        bound = bind_arguments(forward, *seen["original"])  # by name: the two calls may differ in form
        values = bound.arguments
        stream = values[name(report.stream_slot)]
        values[name(report.stream_slot)] = gather_tokens(stream, index)
        routed_stream = bind_arguments(forward, *seen["routed"]).arguments[name(report.stream_slot)]
        _compare(values[name(report.stream_slot)], routed_stream,
                 f"{block.qualname}'s input {report.stream_slot!r} in the original, gathered",
                 f"{block.qualname}'s input {report.stream_slot!r} in route 0", error=TrainingChanged)
        for side in block.side_inputs:
            key = name(side.slot)
            if values.get(key) is not None:  # a per-token input this call leaves out is left out
                values[key] = route_side(values[key], stream, index, route.cuts(side), route.shared)
        torch.manual_seed(seed + 1)
        want = module(*bound.args, **bound.kwargs)
    # close rather than equal: the route's graph may hand the block an equivalent input in another form (an
    # explicit causal mask where the eager forward passed None to the same attention)
    _compare(want, seen["output"], f"{block.qualname} on the original's inputs cut to the kept tokens",
             f"{block.qualname} in route 0", close=True, error=TrainingChanged, precision=_computed_in(module))
    return f"{block.qualname} on the kept tokens matches the original block on its inputs cut as planned"


def _reference(routed: nn.Module, args: tuple, kwargs: dict, seed: int) -> str:
    """The routed forward (eval mode: no dropout draws to tell apart) against the masked-attention reference
    (reference.py) with the same selection; TrainingChanged where they differ."""
    routing = routing_of(routed)
    # gradients on: torch's fused inference paths (nn.TransformerEncoderLayer's, taken in eval without them) do not
    # call scaled_dot_product_attention, whose keys the reference masks
    with training_mode(routed, False), torch.enable_grad():
        torch.manual_seed(seed)
        call = fresh((args, kwargs))
        if isinstance(routing.executor, Programs):
            got = routing.executor.run_fresh(routed, *call, routes=True)
            plan = _bound_plan(routed, args, kwargs)
        else:
            got = routing.executor(routed, *call)
            plan = report_of(routed)
        routes = []
        for k, route in enumerate(plan.placed):
            select = routing.state.routes[k]
            kept = torch.zeros(select.last_index.shape[0], select.last_tokens, dtype=torch.bool,
                               device=select.last_index.device).scatter(1, select.last_index, True)
            start, end = plan.report.blocks[route.start], plan.report.blocks[route.end]
            inner = tuple((b.qualname, plan.report.stack_of(b.index).stream_out_index)
                          for b in plan.report.blocks[route.start:route.end])
            routes.append((start.qualname, end.qualname, plan.report.stack_of(route.start).stream_slot,
                           plan.report.stack_of(route.end).stream_out_index, ~kept, inner))
            select.last_index = None
        found = masked_reference(routed, _original(routed), routes, *fresh((args, kwargs)), seed)
    if isinstance(found, str):
        return f"not run: {found}"
    want, calls = found
    # the outputs a route defines: what the routed blocks hand out by a side way (a mixture of experts' router
    # logits, per layer, and the load-balancing loss over them) holds the kept tokens' alone, by design
    pairs = [(a, b) for a, b in zip(flatten(want)[0], flatten(got)[0]) if isinstance(a, torch.Tensor)
             and isinstance(b, torch.Tensor) and a.dim() and a.shape == b.shape]
    _compare([a for a, _ in pairs], [b for _, b in pairs], "the original blocks with the routed tokens masked out of "
             "attention", "the routed forward", close=True, error=TrainingChanged, precision=_computed_in(routed),
             objects=False)
    return (f"{len(pairs)} outputs match the original blocks with the routed tokens masked out of {calls} attention "
            "calls")


def _bound_plan(routed: nn.Module, args: tuple, kwargs: dict) -> Plan:
    """The plan a fresh program of this call follows (graph mode binds the decision to the call's shapes)."""
    return bind(report_of(routed), routed, args, kwargs)[1]


def _plan_of_call(routed: nn.Module, args: tuple, kwargs: dict) -> Plan:
    """The plan the routed model's training forward follows on this call: graph mode plans a call of another
    signature or other shapes again (its blocks may take other inputs: a mask the example call did not pass),
    boundary mode follows the example's."""
    executor = routing_of(routed).executor
    if isinstance(executor, Programs):
        return executor.program(routed, args, kwargs)[1].plan
    return report_of(routed)


def _computed_in(model: nn.Module) -> torch.dtype | None:
    """The least precise floating dtype `model` computes in: its parameters' or, where autocast is on, autocast's.
    An output's own dtype can be wider than the sums behind it: a bf16 LM casts its logits to fp32 at the end
    (transformers' Mamba and FalconMamba heads do), and judging those by fp32's last place called every bf16 DAR
    model changed."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtypes |= {torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)


def _tolerance(a: torch.Tensor, precision: torch.dtype | None = None) -> tuple[float, float]:
    """(rtol, atol) for "the same sums in another order": a few units in the last place of the dtype the sums
    were made in (the output's, or a less precise one the model computes in: `_computed_in`; bf16's is 2^-7),
    the absolute part in proportion to the output's scale, since the sums that round are as large as the
    largest values, not as the element."""
    if not a.is_floating_point():
        return 0.0, 0.0
    eps = max(torch.finfo(a.dtype).eps, torch.finfo(precision).eps if precision is not None else 0.0)
    scale = a.detach().abs().max().item() if a.numel() else 0.0
    return max(1e-4, 4 * eps), max(1e-5, 4 * eps * scale)


def _compare(expected, got, want_name: str, got_name: str, close: bool = False, depth: int = 0,
             error: type = InferenceChanged, precision: torch.dtype | None = None, objects: bool = True) -> None:
    """Raise `error` where `got` differs from `expected`: tensors bit for bit (or `close`), objects without an
    equality of their own (a cache) by their attributes, unless `objects` is False (a route's caches hold the
    kept tokens' keys: what the route hands on is its outputs)."""
    want, have = flatten(expected), flatten(got)
    if want[1] != have[1]:
        raise error(f"output structure differs: {want_name} {want[1]}, {got_name} {have[1]}")
    for i, (a, b) in enumerate(zip(want[0], have[0])):
        if isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                described = f"{b.dtype}{list(b.shape)}" if isinstance(b, torch.Tensor) else repr(b)
                raise error(f"output {i}: {want_name} {a.dtype}{list(a.shape)}, {got_name} {described}")
            same = torch.allclose(a, b, *_tolerance(a, precision)) if close else torch.equal(a, b)
            if not same:
                diff = (a.double() - b.double()).abs()
                raise error(
                    f"output {i} of {got_name} is not {'close to' if close else 'bit-identical to'} {want_name}'s: "
                    f"{int((diff > 0).sum())} of {diff.numel()} elements differ, max |Δ| = {diff.max().item():.3e}"
                )
        elif type(a) is type(b) and type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__") and depth < 4 \
                and objects:
            # an object without equality (a cache)
            _compare(vars(a), vars(b), want_name, got_name, close, depth + 1, error, precision)
        elif type(a) is type(b) and type(a).__eq__ is object.__eq__ and not objects:
            continue
        elif a != b:
            raise error(f"output {i}: {want_name} {a!r}, {got_name} {b!r}")

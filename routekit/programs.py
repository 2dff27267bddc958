"""Graph mode's executor: the plan written into a traced forward, compiled to a program per kind of call.

A routed model in graph mode runs a program: the rewritten fx graph of its forward for one call signature
and mode, compiled to Python code. `Programs` keeps one per signature (and shapes, where the trace baked a
number in), binds the plan to a call it has not met (bind.py: the forward traced again, the decision `apply`
made bound to that trace, nothing decided again), and traces again where an assumption the graph made broke
(guards.py). Boundary mode's executor is hooks.py's `Hooks`.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .bind import Skipped, bind
from .calls import bind_arguments, call_inputs, call_spec
from .decision import Plan
from .errors import ConfigError, RouteWarning
from .graphs import compile_graph
from .guards import Assumptions
from .regions import CALLED
from .rewrite import constants_to_inputs, rewrite
from .sharding import check_sharding
from .trace import Trace


@dataclass
class Program:
    """A compiled graph for one call signature and mode (and one set of shapes, if it was specialised to them;
    any batch size where no number in it was read off a batch axis)."""

    fn: Any
    out_spec: pytree.TreeSpec
    constants: tuple
    specialised: bool
    plan: Plan
    called: frozenset[str] = frozenset()  # qualified names of the modules the graph calls
    assumed: Assumptions = Assumptions()

    def key(self, shapes: tuple) -> Any:
        """Where this program sits among the programs of one call signature: for any shapes, for these shapes
        but the batch size, or for these shapes alone."""
        if not self.specialised:
            return None
        if self.assumed.batch_generic:
            return "batch", tuple((shape[1:], dtype) for shape, dtype in shapes)
        return "shapes", shapes

    def __call__(self, module: nn.Module, tensors: list[torch.Tensor]) -> Any:
        return pytree.tree_unflatten(list(self.fn(module, *tensors, *self.constants)), self.out_spec)


def build_program(tr: Trace, plan: Plan, model: nn.Module, training: bool, routes: bool | None = None,
                  dropping: bool = False) -> Program:
    """The plan written into the trace (routes if `training`, unless `routes` says otherwise; DAR and fused
    routes' ends either way; `dropping`: fused routes without their blocks), as a Python function."""
    with_routes = training if routes is None else routes
    rewritten = rewrite(tr, plan, model, with_routes, dropping)
    values = constants_to_inputs(rewritten.graph, rewritten.constants)
    label = f"{plan.report.model} {'train' if training else 'eval'} graph"
    called = frozenset(n.target for n in rewritten.graph.nodes if n.op == "call_module").union(
        *(n.meta.get(CALLED, ()) for n in rewritten.graph.nodes))
    # the routes may hold for the call's shapes alone (Plan.routes_shape_bound), however shape-generic the rest of
    # the graph is: other shapes are planned again
    shaped = bool(rewritten.specialised) or (with_routes and plan.routes_shape_bound)
    return Program(compile_graph(rewritten.graph, label), tr.out_spec, tuple(values), shaped, plan, called,
                   rewritten.assumed)


UNROUTED = "unrouted"  # the program of a call that skips a routed block: the original forward


class Programs:
    """The executor of graph mode: one program per call signature and mode (and shapes where a program
    was specialised to them), traced on first use from the model's original forward."""

    def __init__(self, plan: Plan, signature: inspect.Signature):
        self.plan, self.signature = plan, signature  # the model's forward's, without self
        self.programs: dict = {}
        self.retraced: dict[str, int] = {}  # what broke, per attribute: programs traced again because of it
        self.original = None  # the model's forward before the routes: what a call that skips a routed block runs
        self.dropping = 0  # > 0: fused routes run without their blocks (`routekit.path_drop`)

    def __getstate__(self):  # programs hold generated code: traced again after unpickling
        return {"plan": self.plan, "signature": self.signature, "programs": {}, "retraced": {},
                "original": self.original, "dropping": 0}

    def __call__(self, routed: nn.Module, args: tuple, kwargs: dict) -> Any:
        check_sharding(routed, self.called)
        tensors, program = self.program(routed, args, kwargs)
        if program is UNROUTED:
            return self.original(*args, **kwargs)
        return program(routed, tensors)

    def run_fresh(self, routed: nn.Module, args: tuple, kwargs: dict, routes: bool | None = None,
                  plan: Plan | None = None) -> Any:
        """The output of a program traced now (not the cached one) for this call, with or without the routes,
        from this executor's plan or from `plan` (the same model, other routes)."""
        program = _build(plan or self.plan, routed, args, kwargs, routes, fresh=True)
        return program(routed, call_inputs(*_bound(self.signature, args, kwargs)))

    def called(self) -> frozenset[str]:
        """Every module some program calls."""
        return frozenset().union(*(p.called for bucket in self.programs.values() for p in bucket.values()
                                    if p is not UNROUTED))

    def program(self, routed: nn.Module, args: tuple, kwargs: dict,
                seed: Program | None = None) -> tuple[list[torch.Tensor], Program]:
        """The program for this call, built on first use and again where one of its assumptions broke (an
        attribute it read changed, a module it traced through got hooks); `seed` fills the cache with one
        already built."""
        bound, spec = _bound(self.signature, args, kwargs)
        tensors = call_inputs(bound, spec)
        bucket = self.programs.setdefault((routed.training, self.dropping > 0, spec.key()), {})
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors if isinstance(t, torch.Tensor))
        batch = tuple((shape[1:], dtype) for shape, dtype in shapes)
        found = bucket.get(None) or bucket.get(("batch", batch)) or bucket.get(("shapes", shapes))
        broken = found.assumed.broken(routed) if found is not None and found is not UNROUTED else None
        if broken is not None:
            self._stale(found, broken)
            del bucket[found.key(shapes)]
            found = None
        if found is None:
            try:
                found = seed if seed is not None else \
                    _build_outside_compile(self.plan, routed, args, kwargs, self.dropping > 0)
            except Skipped as err:
                if self.plan.changes_model or self.original is None:
                    raise
                # a call that skips a block (SD3's `skip_layers` for skip-layer guidance) has no route to bind to:
                # it runs the original forward, as eval does, and says so once per kind of call
                warnings.warn(f"{err.block} is skipped by this call, so it runs unrouted (the model's original "
                              "forward); calls that run every block are routed as before", RouteWarning, stacklevel=4)
                found = UNROUTED
            except ConfigError as err:
                raise (ConfigError(f"{broken}, so the graph was traced again, and: {err}") if broken else err) from None
            bucket[None if found is UNROUTED else found.key(shapes)] = found
        return tensors, found

    def _stale(self, program: Program, broken: str) -> None:
        """Count a program traced again because an assumption broke; one that breaks at every call is a value
        the forward changes itself, which a graph cannot hold: say which."""
        what = broken.split(" is ")[0]
        self.retraced[what] = count = self.retraced.get(what, 0) + 1
        if count > 8:
            raise ConfigError(
                f"the routed graph was traced again {count} times because {broken}: a value the forward reads as "
                "plain Python and that changes from call to call cannot be part of a traced graph; pass it as an "
                "argument (or keep it in a tensor/buffer) instead"
            )


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict):
    """(the call's arguments bound to the forward's parameters, its call spec)."""
    bound = bind_arguments(signature, args, kwargs)
    return bound, call_spec(bound)


def _build(plan: Plan, routed: nn.Module, args: tuple, kwargs: dict, routes: bool | None = None,
           fresh: bool = False, dropping: bool = False) -> Program:
    """The plan bound to this call (`bind.bind`: the call traced, the decision bound to its trace), written in."""
    tr, bound = bind(plan, routed, args, kwargs, fresh=fresh)
    return build_program(tr, bound, routed, routed.training, routes, dropping)


def _build_outside_compile(plan: Plan, routed: nn.Module, args: tuple, kwargs: dict, dropping: bool) -> Program:
    """`_build`, never under Dynamo: a call with a new signature or shapes inside a compiled region traces
    eagerly (a graph break there), and the compiled code calls the program it returns."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_build)(plan, routed, args, kwargs, dropping=dropping)
    return _build(plan, routed, args, kwargs, dropping=dropping)

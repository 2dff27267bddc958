"""`inspect`: what routekit sees in a model and what it would do, before (or after) routing it."""

from __future__ import annotations

import torch
from torch import nn

from .config import DAR, Route, coerce_routes
from .decision import Plan
from .errors import ConfigError
from .model import Mode, example_call, observe, routing_of, unwrap_compiled
from .plan import make_plan
from .probe import Probe
from .state import eager


def inspect(model: nn.Module, example_inputs: tuple | torch.Tensor = (), example_kwargs: dict | None = None, *,
            routes: Route | list[Route] | str | None = None, residual: DAR | None = None,
            grid: tuple[int, int] | None = None, stack: str | None = None, mode: Mode = "auto") -> Plan:
    """Trace and analyse `model` on example inputs: block stack, token stream, side inputs, grid, the
    residual adds DAR would rewrite, and (with `routes`/`residual`) the checked plan. Nothing is changed.

    Print the result for a table; `.draw(path)` writes a PNG. A routed model gives the plan `apply` made.
    `mode` as in `apply`: the plan's `mode` says whether the owner forward was traced ("graph") or only
    its block calls recorded ("boundary").
    """
    model = unwrap_compiled(model)[0]
    if routing_of(model) is not None:
        if example_inputs != () or example_kwargs is not None:
            example_call(model, example_inputs, example_kwargs)  # checked all the same
        return routing_of(model).plan
    if residual is not None and not isinstance(residual, DAR):
        raise ConfigError(f"residual must be routekit.DAR(...) or None, got {residual!r}")
    args, kwargs = example_call(model, example_inputs, example_kwargs)
    with eager():
        _, report = observe(model, args, kwargs, mode=mode, stack=stack, residual=True)
        return make_plan(report, coerce_routes(routes, report.depth), residual, Probe(model, report), grid=grid)

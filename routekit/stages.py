"""`set_rate`: a routed model's routes at another rate, for training in stages.

SPRINT pre-trains with 75% of the tokens set aside and fine-tunes briefly with every token (rate 0) on the same
model: its fused routes keep their ends (mask token, fusion) and only their rate changes. `apply` cannot serve
that (applying again routes the model anew, and refuses a model whose routes or DAR hold what it learned), so
`set_rate` plans the routes again at the new rate on the analysis `apply` made, with every check `apply` makes
(no trace, no analysis), and keeps everything else: the model's parameters, routekit's (fused ends, DAR's
queries) and the eval programs, which no route's rate changes.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Route
from .errors import ConfigError, InputError
from .model import routed_model
from .plan import make_plan
from .probe import Probe
from .programs import Programs
from .state import eager


def set_rate(model: nn.Module, rate: float, route: int | None = None) -> nn.Module:
    """Set the rate (the share of tokens routed around the blocks) of every route of `model`, or of route number
    `route`, in place; returns the model. The training programs are made again on the next training call (under
    torch.compile, a recompilation). A rate the selector or the blocks cannot take is refused as `apply` refuses
    it, and the model keeps its routes as they were."""
    inner, routing = routed_model(model, "set_rate")
    plan = routing.plan
    if not plan.placed:
        raise InputError("set_rate changes a route's rate, and this model has no routes (DAR alone)")
    if route is not None and (type(route) is not int or not 0 <= route < len(plan.placed)):
        raise InputError(f"route {route!r} does not exist; valid routes are 0..{len(plan.placed) - 1}, or None for all")
    with eager(), torch.no_grad():
        try:
            routes = [Route(**{**r.route.model_dump(), "rate": rate}) if route in (None, k) else r.route
                      for k, r in enumerate(plan.placed)]
            if [r.rate for r in routes] == [r.route.rate for r in plan.placed]:
                return model
            new = make_plan(plan.report, routes, plan.dar.config if plan.dar else None, Probe(inner, plan.report),
                            grid=plan.grid if plan.grid_given else None)
        except ConfigError as err:
            raise ConfigError(f"set_rate({rate}): {err}") from None
    routing.plan = routing.executor.plan = new
    for select, placed in zip(routing.state.routes, new.placed):
        select.route, select.shared = placed.route, placed.shared
    if isinstance(routing.executor, Programs):  # the eval programs read no route's rate: kept
        for key in [key for key in routing.executor.programs if key[0]]:
            del routing.executor.programs[key]
    return model

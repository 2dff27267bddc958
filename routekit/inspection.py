"""`inspect`: what routekit sees in a model, before (or after) routing it."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .analysis import GraphReport, analyse
from .boundary import analyse_boundary
from .config import Route, coerce_routes
from .dar import residual_plan
from .errors import ConfigError, RoutekitError
from .keep import resolve_keep
from .model import RoutedModel, _example_call, _graph_trace, report_of, training_mode, unwrap_compiled


def inspect(model: nn.Module, example_inputs: tuple | torch.Tensor = (), example_kwargs: dict | None = None, *,
            routes: Route | list[Route] | str | None = None, stack: str | None = None,
            mode: Literal["auto", "graph", "boundary"] = "auto") -> GraphReport:
    """Trace and analyse `model` on example inputs: block stack, token stream, side inputs, grid.

    Print the result for a table; `.draw(path)` writes a PNG. With `routes`, the report marks them.
    A routed model reports the analysis `apply` made. `mode` as in `apply`: the report's `mode` says
    whether the owner forward was traced ("graph") or only its block calls recorded ("boundary").
    """
    model = unwrap_compiled(model)[0]
    if isinstance(model, RoutedModel):
        return report_of(model)
    if mode not in ("auto", "graph", "boundary"):
        raise ConfigError(f"mode must be 'auto', 'graph' or 'boundary', got {mode!r}")
    args, kwargs = _example_call(model, example_inputs, example_kwargs)
    tr, fallback = _graph_trace(model, args, kwargs, mode)
    if tr is None:
        report = analyse_boundary(model, args, kwargs, stack, fallback)[0]
    else:
        with training_mode(model, True):
            report = analyse(tr, model, stack)
    report.routes = coerce_routes(routes, report.depth)
    for route in report.routes:
        resolve_keep(route.keep, report.tokens)
    try:  # the residual adds DAR would rewrite, per block
        residual_plan(model, report, report.routes)
    except RoutekitError as err:
        report.residual_granularity = f"unknown ({err})"
    return report


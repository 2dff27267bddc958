"""`inspect`: what routekit sees in a model, before (or after) routing it."""

from __future__ import annotations

import torch
from torch import nn

from .analysis import GraphReport, analyse
from .config import Route, coerce_routes
from .model import RoutedModel, _example_call, report_of, training_mode
from .trace import trace


def inspect(model: nn.Module, example_inputs: tuple | torch.Tensor = (), example_kwargs: dict | None = None, *,
            routes: Route | list[Route] | str | None = None, stack: str | None = None) -> GraphReport:
    """Trace and analyse `model` on example inputs: block stack, token stream, side inputs, grid.

    Print the result for a table; `.draw(path)` writes a PNG. With `routes`, the report marks them.
    A routed model reports the analysis `apply` made.
    """
    if isinstance(model, RoutedModel):
        return report_of(model)
    args, kwargs = _example_call(model, example_inputs, example_kwargs)
    with training_mode(model, True):
        report = analyse(trace(model, args, kwargs), model, stack)
    report.routes = coerce_routes(routes, report.depth)
    return report


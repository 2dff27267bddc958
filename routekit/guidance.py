"""`path_drop`: a fused model run without its fused routes' blocks, the weak pass of Path-Drop Guidance.

A route with `fuse=...` (SPRINT's end, fusion.py) learns, through the path drop in training, what the model
computes when a sample's deep path is gone: its end fuses mask tokens with the stream as it entered the route.
Path-Drop Guidance (PDG) uses that as the weak model of a guided sampling step: the conditional estimate from
the full model, the weak one from the model without the route's blocks and with the null condition, mixed as
classifier-free guidance mixes its two, weak + w·(cond − weak). The weak pass costs the blocks outside the route,
so a guided step costs about one full pass plus those, where CFG costs two full passes.

    with rk.path_drop(model):
        weak = model(x, t, null_labels)
"""

from __future__ import annotations

import contextlib

from torch import nn

from .errors import ConfigError
from .model import routed_model


@contextlib.contextmanager
def path_drop(model: nn.Module):
    """Within the block, `model` (routed with fused routes, `Route(fuse=...)`) runs every fused route without
    its blocks, in eval and in training: the route's end fuses mask tokens, in place of the blocks' output, with
    the stream as it entered the route, as for a sample whose path the training dropped. TREAD's routes run as
    they do in that mode. The blocks are not called, so their FLOPs are not spent. A route whose blocks hand on
    more than the stream (a joint block's text stream, a long skip) is refused at the call, saying which."""
    inner, routing = routed_model(model, "path_drop")
    if not routing.plan.fused:
        raise ConfigError(
            "path_drop runs a model's fused routes without their blocks, and this model has none: route it with a "
            "fused route, e.g. routekit.Route(start=2, end=-3, rate=0.75, fuse='sprint')")
    routing.executor.dropping += 1  # fused routes exist in graph mode alone (plan._check_fused)
    try:
        yield model
    finally:
        routing.executor.dropping -= 1

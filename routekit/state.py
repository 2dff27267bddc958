"""Running a user's model without lasting side effects.

routekit runs the user's model to trace it, record it, probe its blocks and verify it. None of
that may change the model: modes, buffers (BatchNorm statistics) and RNG streams come back as they
were, and routekit's own additions live on copies that share the model's parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn


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


def unwrap_compiled(model: Any):
    """(the module inside a torch.compile wrapper, a function wrapping another module the same way)."""
    if isinstance(model, nn.Module) and hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        return model._orig_mod, lambda inner: type(model)(inner, model.dynamo_ctx)
    return model, lambda inner: inner

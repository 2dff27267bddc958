"""routekit: rewrite the graph of any block-stacked PyTorch model for cheaper training.

    routed = routekit.apply(model, routes="default", example_inputs=(x, t, y))
    routed.train()  # blocks 2..depth-4 see half the tokens (TREAD)
    routed.eval()   # the original forward, bit for bit

SPRINT's sparse-dense fusion ends a route with `Route(..., fuse="sprint")`; `path_drop` runs such a model without
the route's blocks (Path-Drop Guidance's weak pass); `set_rate` changes a route's rate between training stages.

The package exports what a user calls; the rest lives in its own module: the plan a routed model carries
(`routekit.model.report_of`, `routekit.decision.Plan`), the analysis (`routekit.findings.GraphReport`), the
selector registry (`routekit.selectors`: `selector_names`, `uniform` for selectors of your own) and FSDP2's
unit list (`routekit.sharding.fsdp_units`).
"""

from .config import DAR, Fusion, Route
from .errors import (
    AnalysisError,
    ConfigError,
    InferenceChanged,
    InputError,
    NonFiniteError,
    RoutekitError,
    RouteWarning,
    SelectorError,
    TraceError,
    TrainingChanged,
    VerificationError,
)
from .guidance import path_drop
from .inspection import inspect
from .model import FallbackWarning, apply, force_keep, last_route_mask, strip
from .selectors import register_selector
from .sharding import shard
from .stages import set_rate
from .verify import verify

__all__ = [
    "DAR", "Fusion", "Route", "apply", "force_keep", "inspect", "last_route_mask", "path_drop", "register_selector",
    "set_rate", "shard", "strip", "verify",
    "AnalysisError", "ConfigError", "FallbackWarning", "InferenceChanged", "InputError", "NonFiniteError",
    "RoutekitError", "RouteWarning", "SelectorError", "TraceError", "TrainingChanged", "VerificationError",
]
__version__ = "0.1.0"

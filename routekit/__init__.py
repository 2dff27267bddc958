"""routekit: rewrite the graph of any block-stacked PyTorch model for cheaper training.

    routed = routekit.apply(model, routes="default", example_inputs=(x, t, y))
    routed.train()  # blocks 2..depth-4 see half the tokens (TREAD)
    routed.eval()   # the original forward, bit for bit
"""

from .config import DAR, Route
from .errors import (
    AnalysisError,
    ConfigError,
    InferenceChanged,
    InputError,
    NonFiniteError,
    RoutekitError,
    SelectorError,
    TraceError,
    TrainingChanged,
    VerificationError,
)
from .findings import GraphReport
from .inspection import inspect
from .model import FallbackWarning, RoutedModel, apply, force_keep, last_route_mask, report_of, strip
from .plan import Plan
from .selectors import register_selector, selector_names, uniform
from .sharding import fsdp_units, shard
from .verify import verify

__all__ = [
    "DAR", "AnalysisError", "ConfigError", "FallbackWarning", "GraphReport", "InferenceChanged", "InputError",
    "NonFiniteError", "Plan", "Route", "RoutedModel", "RoutekitError", "SelectorError", "TraceError", "TrainingChanged",
    "VerificationError", "apply",
    "force_keep", "fsdp_units", "inspect", "last_route_mask", "register_selector", "report_of", "selector_names",
    "shard", "strip", "uniform", "verify",
]
__version__ = "0.1.0"

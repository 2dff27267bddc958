"""Every failure routekit reports is one of these, so callers can catch `RoutekitError`.

Each message says what was wrong and what would be valid; none is a bare fx traceback.
"""

from __future__ import annotations


class RoutekitError(Exception):
    """Base of all routekit errors."""


class ConfigError(RoutekitError, ValueError):
    """A route or DAR configuration that can never be valid, or is invalid for this model."""


class TraceError(RoutekitError):
    """The model's forward could not be traced; the message names the file and line."""


class AnalysisError(RoutekitError):
    """The traced graph has no usable block stack or token stream."""


class InputError(RoutekitError, ValueError):
    """Example inputs or call arguments that do not fit the model."""


class VerificationError(RoutekitError, AssertionError):
    """`verify` found that a routed model computes something it was not asked to change."""


class InferenceChanged(VerificationError):
    """The routed model in eval differs from the original model."""


class TrainingChanged(VerificationError):
    """The routed model's training forward changes more than which tokens the routed blocks see."""


class NonFiniteError(RoutekitError, FloatingPointError):
    """A routed forward produced NaN or Inf while `check_finite=True`."""


class RouteWarning(UserWarning):
    """A route that is valid but almost certainly not what was meant: one that routes no token (`rate=0`), or one
    over the whole stack (TREAD keeps the first blocks and the last unrouted: they embed and decode the tokens)."""


class SelectorError(ConfigError):
    """A selector returned indices a route cannot use; the message says which rule it broke."""

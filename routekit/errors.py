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


class InferenceChanged(RoutekitError, AssertionError):
    """The routed model's inference path differs from the original model's."""


class NonFiniteError(RoutekitError, FloatingPointError):
    """A routed forward produced NaN or Inf while `check_finite=True`."""


class SelectorError(ConfigError):
    """A selector returned indices a route cannot use; the message says which rule it broke."""

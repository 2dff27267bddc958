"""`verify`: prove the routed model's inference is the original's, node for node and bit for bit."""

from __future__ import annotations

import difflib

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from .errors import InferenceChanged, InputError, TraceError
from .model import RoutedModel, example_call, unwrap_compiled
from .state import training_mode
from .trace import flatten, preserved_state, trace


def graph_lines(graph: fx.Graph) -> list[str]:
    """One line per node: op, target and arguments, in the names users know (module paths)."""
    lines = []
    for node in graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        lines.append(f"{node.name} = {node.op}[{target}](args={node.args}, kwargs={node.kwargs})")
    return lines


def verify(model: nn.Module, routed: nn.Module, example_inputs: tuple | torch.Tensor = (),
           example_kwargs: dict | None = None, *, seed: int = 0) -> dict:
    """Check that `routed` in eval mode is `model`: the same traced graph and bit-identical outputs.

    Both run under the routed model's parameters (torch.func.functional_call), with the same RNG
    seed. Raises InferenceChanged with a readable diff otherwise; returns what was compared. Where
    the eval forward does not trace (boundary mode, or an owner that builds a cache in eval), the
    outputs alone are compared and "nodes" is None.
    """
    model, routed = unwrap_compiled(model)[0], unwrap_compiled(routed)[0]
    if type(seed) is not int:
        raise InputError(f"seed is an int, got {seed!r:.80}")
    if not isinstance(routed, RoutedModel):
        raise InputError(f"verify compares a model with routekit.apply(model, ...); got {type(routed).__name__}")
    args, kwargs = example_call(model, example_inputs, example_kwargs)
    with training_mode(model, False), training_mode(routed, False):
        try:
            original = graph_lines(trace(model, args, kwargs).graph)
        except TraceError:
            original = None
        inference = original and graph_lines(trace(routed, args, kwargs, signature_of=routed._routekit_base.forward).graph)
        if original != inference:
            diff = "\n".join(difflib.unified_diff(original, inference, "original eval graph", "routed eval graph",
                                                  lineterm="", n=1))
            raise InferenceChanged(f"the routed model's eval graph differs from the original's:\n{diff}")
        keys = set(model.state_dict(keep_vars=True))
        state = {k: v for k, v in routed.state_dict(keep_vars=True).items() if k in keys}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with preserved_state(model, tensors):
            torch.manual_seed(seed)
            try:
                expected = functional_call(model, state, args, kwargs)
            except Exception as err:
                raise InputError(f"{type(model).__name__} fails in eval on the example inputs: "
                                 f"{type(err).__name__}: {err}") from None
            torch.manual_seed(seed)
            try:
                got = routed(*args, **kwargs)
            except Exception as err:
                raise InferenceChanged(f"the routed model fails in eval where the original runs: "
                                       f"{type(err).__name__}: {err}") from err
    _compare(expected, got)
    return {"mode": routed._routekit_plan.report.mode, "nodes": original and len(original),
            "outputs": len(flatten(expected)[0])}


def _compare(expected, got, depth: int = 0) -> None:
    want, have = flatten(expected), flatten(got)
    if want[1] != have[1]:
        raise InferenceChanged(f"output structure differs: original {want[1]}, routed {have[1]}")
    for i, (a, b) in enumerate(zip(want[0], have[0])):
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise InferenceChanged(f"output {i}: original {a.dtype}{list(a.shape)}, routed {b.dtype}{list(b.shape)}")
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs()
                raise InferenceChanged(
                    f"output {i} is not bit-identical: {int((diff > 0).sum())} of {diff.numel()} elements differ, "
                    f"max |Δ| = {diff.max().item():.3e}"
                )
        elif type(a) is type(b) and type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__") and depth < 4:
            _compare(vars(a), vars(b), depth + 1)  # an object without equality (a cache): compare what it holds
        elif a != b:
            raise InferenceChanged(f"output {i}: original {a!r}, routed {b!r}")

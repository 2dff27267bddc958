"""Objects a traced graph cannot hold, and how a trace deals with them: an object passed in is traced on a private
copy (tracing runs the forward, which may change it), and one the forward makes and hands on (a transformers
LM's generation cache) is snapshotted at trace time and copied afresh on every run of the graph
(`per_run_copy`), so each run starts from what the forward made, not from what the last run left in it.
"""

from __future__ import annotations

import copy
import enum
import types
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .errors import TraceError


def attribute_path(root: nn.Module, obj: Any) -> str | None:
    """The qualified name of `obj` as a plain attribute of `root` or one of its submodules, if it is one."""
    for prefix, module in root.named_modules():
        for k, v in vars(module).items():
            if v is obj:
                return f"{prefix}.{k}" if prefix else k
    return None


def private_copy(obj: Any) -> Any:
    """The object an input is traced with: a deep copy, so tracing (which runs the forward) leaves the
    caller's object as it was. One that cannot be copied is traced as it is."""
    try:
        return copy.deepcopy(obj)
    except Exception:
        return obj


def snapshot_of(obj: Any) -> Any:
    """A deep copy of an object the forward made, refused if it would copy the model or traced values: the
    graph copies it on every run."""
    memo: dict = {}
    try:
        snapshot = copy.deepcopy(obj, memo)
    except Exception as err:
        raise TraceError(f"{type(obj).__name__}, made by the forward and passed on, cannot be copied for each "
                         f"run: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    held = [v for k, v in memo.items() if k != id(memo) and isinstance(v, (nn.Module, nn.Parameter, fx.Proxy))]
    if held:
        raise TraceError(f"{type(obj).__name__}, made by the forward and passed on, holds a {type(held[0]).__name__}; "
                         "routekit would copy it on every run")
    return snapshot


# Values a deep copy returns as they are.
_ATOMS = (int, float, complex, bool, str, bytes, type(None), type, range, frozenset, enum.Enum, torch.dtype,
          torch.device, types.FunctionType, types.BuiltinFunctionType)


def per_run_copy(value: Any) -> Any:
    """The copy a graph makes on every run of the snapshot of an object the forward made (a transformers LM's
    generation cache): what copy.deepcopy makes of it, written so that torch.compile traces it into the
    graph. Dynamo cannot trace copy.deepcopy's memo of ids (an internal error compiling a routed Llama with its
    cache on). Only for snapshots `plainly_copied` accepts; any other is copied by copy.deepcopy."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) in (list, tuple):
        return type(value)(per_run_copy(v) for v in value)
    if type(value) is dict:
        return {k: per_run_copy(v) for k, v in value.items()}
    new = object.__new__(type(value))
    new.__dict__.update({k: per_run_copy(v) for k, v in value.__dict__.items()})
    return new


def plainly_copied(obj: Any) -> bool:
    """Whether `per_run_copy(obj)` makes what `copy.deepcopy(obj)` makes: a tree (nothing reached twice, which
    deepcopy would keep shared) of atoms, plain lists, tuples and dicts, tensors that are not views and need no
    gradient, and objects that copy as their `__dict__` (no slots, abc.ABC's empty ones aside, no `__new__`,
    `__deepcopy__`, reduce or state methods of their own)."""
    seen: set[int] = set()

    def plain(value: Any) -> bool:
        if isinstance(value, _ATOMS):
            return True
        if id(value) in seen:
            return False
        seen.add(id(value))
        cls = type(value)
        if isinstance(value, torch.Tensor):
            return cls is torch.Tensor and not value.requires_grad and value._base is None
        if cls in (list, tuple):
            return all(plain(v) for v in value)
        if cls is dict:
            return all(isinstance(k, _ATOMS) for k in value) and all(plain(v) for v in value.values())
        own = cls.__new__ is object.__new__ and cls.__reduce_ex__ is object.__reduce_ex__ \
            and cls.__reduce__ is object.__reduce__ and getattr(cls, "__getstate__", None) in (None, object.__getstate__) \
            and not hasattr(cls, "__setstate__") and not hasattr(cls, "__deepcopy__") \
            and not any(vars(k).get("__slots__") for k in cls.__mro__) and hasattr(value, "__dict__")
        return own and all(plain(v) for v in value.__dict__.values())

    return plain(obj)

"""Running a user's model without lasting side effects.

routekit runs the user's model to trace it, record it, probe its blocks and verify it. None of
that may change the model: modes, buffers (BatchNorm statistics) and RNG streams come back as they
were, and routekit's own additions live on copies that share the model's parameters.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any

import torch
import torch.fx as fx
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


@contextlib.contextmanager
def as_found(model: nn.Module):
    """Leave the model's modules as they were found after a run routekit makes of it: hooks the run registered on
    any module are removed, plain attributes it added to one are deleted, and an attribute (of a module, or of a
    plain object a module holds) that a trace left holding one of its proxies gets its old value back.

    Why: a forward may set up state on its first call. transformers' output capturing registers hooks on the
    modules inside the blocks and marks the model as done; a trace runs on a copy of the traced-through modules
    (guards.Recorder), so the mark lands on the copy and the hooks on the user's own modules, and the model's
    next call registers them again (each router's logits counted twice). diffusers' Z-Image caches its rotary
    table in a plain object on first use: filled during a trace, it held proxies, and every later call failed.
    Other changes a run makes (a cache filled with real values, a lazy module's shapes) are the model's own
    first-call behaviour and stay."""
    modules = list(model.modules())
    hooks = {id(m): {k: set(v) for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)} for m in modules}
    found = {id(m): dict(vars(m)) for m in modules}
    held = {id(o): (o, dict(vars(o))) for m in modules for o in vars(m).values() if _plain_object(o)}
    try:
        yield
    finally:
        for m in modules:
            for name, keys in hooks[id(m)].items():
                table = vars(m).get(name)
                for key in [key for key in (table or {}) if key not in keys]:
                    del table[key]
            _restore(vars(m), found[id(m)], drop_added=True)
        for obj, attributes in held.values():
            _restore(vars(obj), attributes, drop_added=False)


def _restore(now: dict, before: dict, *, drop_added: bool) -> None:
    for key in list(now):
        if key not in before:
            if drop_added:
                del now[key]
        elif now[key] is not before[key] and _holds_proxy(now[key]):
            now[key] = before[key]


def _holds_proxy(value: Any, depth: int = 0) -> bool:
    if isinstance(value, fx.Proxy):
        return True
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_holds_proxy(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(_holds_proxy(v, depth + 1) for v in value.values())
    return False


def _plain_object(value: Any) -> bool:
    """An object of the model's own making held by a module (a rotary-table helper), not a module, tensor,
    class or function: its attributes are state a forward may set."""
    return hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type)) \
        and not inspect.isroutine(value) and not inspect.ismodule(value)


def eager():
    """Compiled regions (blocks under torch.compile) run eagerly for the while: routekit's own runs of a model
    (traces, probes on made-up shapes, the dry run) need the values, not kernels; compiling for them would
    spend minutes and fill Dynamo's caches (and its recompile limit) with shapes training never meets."""
    return torch.compiler.set_stance("force_eager")


def is_compiled(module: nn.Module) -> bool:
    """Whether a module runs under torch.compile: wrapped (`torch.compile(block)`, `block.compile()`) or with a
    compiled forward (`@torch.compile` on the class's forward, as the official TREAD DiT block)."""
    forwards = (type(module).forward, module.__dict__.get("forward"))
    return (type(module).__name__ == "OptimizedModule" or module.__dict__.get("_compiled_call_impl") is not None
            or any(hasattr(f, "_torchdynamo_orig_callable") for f in forwards))


def unwrap_compiled(model: Any):
    """(the module inside a torch.compile wrapper, a function wrapping another module the same way)."""
    if isinstance(model, nn.Module) and hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        return model._orig_mod, lambda inner: type(model)(inner, model.dynamo_ctx)
    return model, lambda inner: inner


def fresh(value: Any) -> Any:
    """A copy of call arguments for one more run of a model: tuples, lists, dicts and other objects are copied,
    tensors among them shared (inputs a forward reads), tensors held inside other objects copied (state a run
    updates: a generation cache that the first run filled would hand a second run its keys and values too)."""
    inner: dict[int, Any] = {}
    for obj in _objects(value):
        for t in _tensors_in(obj):
            inner.setdefault(id(t), t.detach().clone())
    return _copy(value, inner)


def _copy(value: Any, inner: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor) or _immutable(value):
        return value
    if isinstance(value, (tuple, list)):
        items = [_copy(v, inner) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, _copy(v, inner)) for k, v in value.items())
    try:
        return copy.deepcopy(value, dict(inner))
    except Exception:  # an object that cannot be copied runs as it is
        return value


def _immutable(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                               nn.Module, type)) or callable(value)


def _objects(value: Any):
    """The objects (not tensors, not plain containers) inside call arguments."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _objects(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _objects(v)
    elif not isinstance(value, torch.Tensor) and not _immutable(value):
        yield value


def _tensors_in(obj: Any, depth: int = 0, seen: set | None = None):
    """The tensors an object holds, through its attributes and containers (a few levels down)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list, set, frozenset)):
        for v in obj:
            yield from _tensors_in(v, depth + 1, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not _immutable(obj):
        for v in vars(obj).values():
            yield from _tensors_in(v, depth + 1, seen)


def shallow_copy(model: nn.Module, cls: type | None = None) -> nn.Module:
    """A module sharing `model`'s submodules, parameters and buffers, with its own attribute dict.

    routekit adds its own submodules and hooks to such copies (the routed model, boundary mode's private
    modules, verify's run at rate 0): none may touch the user's model.
    """
    copy = (cls or type(model)).__new__(cls or type(model))
    copy.__dict__.update(model.__dict__)
    # its own submodule table; the parameter and buffer tables are the model's, so a dtype or device move
    # of either moves both (the tensors are shared: the tables must be too)
    copy.__dict__["_modules"] = type(model.__dict__["_modules"])(model.__dict__["_modules"])
    return copy


@contextlib.contextmanager
def preserved_state(model: nn.Module, tensors: list[torch.Tensor]):
    """Run without lasting side effects: RNG streams and buffers (e.g. BatchNorm statistics) restored."""
    devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            yield
        finally:
            for name, b in model.named_buffers():
                if name in saved and b.shape == saved[name].shape:
                    b.copy_(saved[name])

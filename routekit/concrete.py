"""The proxies a concrete trace records with: each carries the example value behind it, so Python code that looks
at a value (a shape's arithmetic, a branch, an unpacked tuple, `hasattr`) sees what the real forward sees, and
the trace records where it was specialised; a conversion of a tensor's data (`.item()`, `bool(x.any())`) is
refused with the file and line, since a graph replays no branch on values.
"""

from __future__ import annotations

import operator
import os
import traceback
from typing import Any

import torch
import torch.fx as fx

from .errors import TraceError

_ROUTEKIT_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def user_location(tb=None) -> str:
    """`file:line in function: code` of the innermost frame outside torch and routekit."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith((_TORCH_DIR, _ROUTEKIT_DIR)) and "<" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "<unknown location>"


class _Untraceable(Exception):
    """Raised inside a submodule that failed to trace, carrying its name to the retry loop."""

    def __init__(self, qualname: str, cause: BaseException):
        super().__init__(qualname)
        self.qualname, self.cause = qualname, cause


class _DataDependent(Exception):
    pass


class _ConcreteMixin:
    """Proxy behaviour for Python code that looks at a value: use the example value, record the specialisation.

    Conversions of a tensor's *data* are refused (data-dependent control flow); conversions of shapes and
    numbers are specialised to the example inputs and listed in `Trace.specialised`. Attribute reads, hashing
    and item assignment behave as they would on the value, so the traced forward takes the branches the
    real one takes (an attribute that is None is None, `hasattr` answers for the value, a set of equal
    lengths has one member).
    """

    def _convert(self, why: str, convert):
        value = self.node.meta["value"]
        if isinstance(value, torch.Tensor):
            raise _DataDependent(f"{why} of a tensor's data at {user_location()}")
        read = _read_off_data(self.node, self.tracer.data_leaves)
        if read is not None:  # a number taken out of a tensor first: a graph would hold the example's
            raise _DataDependent(f"{why} of a number read off a tensor's data ({read}) at {user_location()}")
        result = convert(value)
        self.tracer.specialised.append(f"{why} = {result!r} at {user_location()}")
        self.tracer.recorder.converted(self.node)
        return result

    def __bool__(self):
        return self._convert("bool()", bool)

    def __int__(self):
        return self._convert("int()", int)

    def __index__(self):
        return self._convert("index", operator.index)

    def __float__(self):
        return self._convert("float()", float)

    def __len__(self):
        value = self.node.meta["value"]
        if isinstance(value, torch.Tensor):  # a tensor's length is its first dimension: a shape
            self.tracer.specialised.append(f"len() = {len(value)} at {user_location()}")
            self.tracer.recorder.batch_generic = False
        return len(value)  # the arity of a tuple or torch.Size is structure, not a specialisation

    def __iter__(self):
        value = self.node.meta["value"]
        if isinstance(value, dict):  # a dict iterates over its keys: structure, not values
            return iter(list(value))
        if not isinstance(value, (tuple, list, torch.Size, torch.Tensor)):  # dict.items(), a generator: a list first
            return iter(self.tracer.create_proxy("call_function", list, (self,), {}))
        return iter([self[i] for i in range(len(self))])

    def __getattr__(self, k: str):
        if k in ("node", "tracer", "root", "attr", "_node"):  # fx's own fields, not yet set
            raise AttributeError(k)
        value = getattr(_value_of(self), k)  # AttributeError as for the value: hasattr() answers for it
        if value is None:  # the code's `is None` tests must see it: a specialisation to the example's state
            self.tracer.specialised.append(f".{k} is None at {user_location()}")
            return None
        return _ConcreteAttribute(self, k)

    def __setitem__(self, key, value):
        """`mask[i, :n] = True` on a tensor the forward made: recorded (and run) as an in-place setitem."""
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __hash__(self):
        """A number or string hashes as its value (eager `set(lengths)` dedupes equal ones); a tensor or
        any other value by identity, as in eager."""
        value = _value_of(self)
        return hash(value) if isinstance(value, (int, float, str)) else object.__hash__(self)

    def __eq__(self, other):
        if self.tracer.finished or (isinstance(other, fx.Proxy) and other.tracer is not self.tracer):
            # a proxy kept from an earlier trace or attempt, as the key of an lru_cache the forward filled
            # (BEiT's position index, keyed by sizes read off the input), equals nothing: the lookup misses
            return False
        return fx.Proxy.__eq__(self, other)


_DATA_READS = ("tolist", "item")


def _read_off_data(node: fx.Node, data_leaves: set[str]) -> str | None:
    """What read this number off a tensor's data, where it was read off one: `.tolist()` or `.item()` (Lumina2
    lays its caption and image out by `mask.sum(1).tolist()`), or a submodule left a leaf because its own code
    converts data (its numbers are such reads); None otherwise. A tensor stops the search: its shape is no read
    of data. Memoised in the nodes' meta."""
    pending = [node]
    while pending:
        current = pending[-1]
        if "rk_read" in current.meta:
            pending.pop()
            continue
        read = None
        if current.op == "call_method" and current.target in _DATA_READS and isinstance(current.args[0], fx.Node):
            read = f"{current.args[0].name}.{current.target}()"
        elif current.op == "call_module" and current.target in data_leaves:
            read = f"the output of {current.target}, whose code converts data"
        elif current is not node and isinstance(current.meta.get("value"), torch.Tensor):
            read = None
        else:
            unknown = [n for n in current.all_input_nodes if "rk_read" not in n.meta]
            if unknown:
                pending.extend(unknown)
                continue
            read = next((n.meta["rk_read"] for n in current.all_input_nodes if n.meta["rk_read"]), None)
        current.meta["rk_read"] = read
        pending.pop()
    return node.meta["rk_read"]


def _value_of(proxy: fx.Proxy) -> Any:
    """The example value behind a proxy; an attribute's without recording a getattr (most become method calls)."""
    if isinstance(proxy, fx.proxy.Attribute) and getattr(proxy, "_node", None) is None:
        return getattr(_value_of(proxy.root), proxy.attr)
    return proxy.node.meta["value"]


class _ConcreteProxy(_ConcreteMixin, fx.Proxy):
    pass


class _ConcreteAttribute(_ConcreteMixin, fx.proxy.Attribute):
    @property
    def node(self) -> fx.Node:
        """fx's lazy getattr node, refused by name where the attribute is a string (`x.device.type`): the tracer
        hands strings on as themselves, so there is no node, and fx's own property would fail with an
        AttributeError that hides behind `__getattr__`. A graph would keep the example's device type; the code
        that reads it stays eager instead (a leafed module, or boundary mode), which also keeps any autocast
        region it opens with that type."""
        if self._node is None:
            made = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {})
            if not isinstance(made, fx.Proxy):
                raise TraceError(f"the forward compares or passes on .{self.attr} = {made!r} at {user_location()}, "
                                 "a string read off a value, which a traced graph would fix to the example's")
            self._node = made.node
        return self._node

"""Trace a model with torch.fx while running it on example inputs.

Why concrete values: owner forwards do shape arithmetic (`h = int(x.shape[1] ** 0.5)`), branch on
shapes, and unpack tuples. Every node is executed as it is recorded, so such code is specialised to
the example shapes (and the trace says it was), while data-dependent control flow is refused with
the file and line. The members of every ModuleList/Sequential are leaves, so block internals
(custom kernels, compiled forwards) are never traced at the owner level; submodules that cannot be
traced become leaves automatically, and the trace reports which.

Real forwards are traced as they run: the call is made as the caller made it; tensors inside tuple,
list and dict arguments are graph inputs like top-level ones (calls.py maps a call onto them);
an object fx cannot hold (a generation cache) is a graph input when passed in, and, when the forward
makes it, a fresh copy on every run of the graph; item assignment into a tensor is recorded in place.
The private part of torch.fx this needs (its tracing flag) is detected, with a fallback (fxcompat.py), so a
torch release that moves it does not silently turn graph mode off. While a node runs for real, fx's patches of
nn.Module stay in place and the tracer's own hooks into them (`call_module`, `getattr`) pass the real call
through: undoing the patches per node would reset nn.Module's `__call__` and `__getattr__` slots, which CPython
propagates to every subclass loaded (thousands with diffusers and transformers), twice per node.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import inspect
import math
import operator
import os
import traceback
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn

from .calls import CallSpec, Input, as_called, bind_arguments, call_inputs, call_spec, is_constant
from .errors import TraceError
from .fxcompat import not_fx_tracing
from .guards import Assumptions, Recorder, hooked
from .state import as_found, preserved_state
from .values import TensorMeta, describe, pickled_fields, read_only

_ROUTEKIT_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class Trace:
    """A traced forward: graph, argument mapping, output structure and what was specialised.

    `constants` holds the values of get_attr targets the model does not have: tensors made by the forward
    from no input, and the state, when first used, of objects the forward made (see `_Tracer.create_arg`).
    Frozen, its mappings read-only; the fx graph is mutable by nature, so whoever rewrites it works on a
    copy (rewrite.py deep-copies it).
    """

    graph: fx.Graph
    spec: CallSpec
    out_spec: pytree.TreeSpec
    constants: Mapping[str, Any]
    leafed: Mapping[str, str] = field(default_factory=dict)
    specialised: tuple[str, ...] = ()
    training: bool = True
    assumed: Assumptions = field(default_factory=Assumptions)  # what the graph took as given: see guards.py

    def __post_init__(self):
        object.__setattr__(self, "constants", read_only(self.constants))
        object.__setattr__(self, "leafed", read_only(self.leafed))
        object.__setattr__(self, "specialised", tuple(self.specialised))

    def __reduce__(self):
        return type(self), pickled_fields(self)


def container_members(model: nn.Module) -> set[str]:
    """Qualified names of every member of a ModuleList/Sequential/ModuleDict: the candidate blocks."""
    members = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            members.update(f"{name}.{child}" if name else child for child, _ in module.named_children())
    return members


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


class _Tracer(fx.Tracer):
    """fx's tracer, running every node as it records it; see the module docstring."""

    def __init__(self, leaves: set[str], bound: inspect.BoundArguments, spec: CallSpec, call: tuple[tuple, dict],
                 recorder: Recorder, data_leaves: set[str]):
        super().__init__(autowrap_modules=(math,))
        self.leaves, self.bound, self.spec, self.call, self.recorder = leaves, bound, spec, call, recorder
        self.data_leaves = data_leaves  # leaves because their own code converts a tensor's data
        self.specialised: list[str] = []
        self.record_stack_traces = False
        self.inputs: dict[str, Any] = {}  # placeholder name -> its example value
        self.objects: dict[int, tuple[Any, fx.Node]] = {}  # id -> (object the forward made, its node)
        self.snapshots: dict[str, Any] = {}  # node name -> that object's state when the forward first used it
        self.running = 0  # > 0 while a node runs for real: module calls and attribute reads are the real ones
        self.finished = False  # set once the trace ends: its proxies may outlive it as keys of the forward's caches

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        """Container members (the blocks), torch's own layers, and any module with hooks: the graph calls it
        as a module, so its hooks run (an FSDP unit gathers its parameters, a user's hook fires)."""
        return qualname in self.leaves or super().is_leaf_module(m, qualname) or (bool(qualname) and hooked(m))

    def proxy(self, node: fx.Node) -> fx.Proxy | str | None:
        """A proxy for the node's value; None for a call that returned None (a setitem, a method run for its
        effect, a cache lookup that found nothing), so the code's `is None` tests see it, and a string as
        itself (a key of a dict from `.items()`: structure, and a proxy could not key a dict argument). The
        node stays in the graph for its effects; a method of an object returning None is a specialisation
        to its state."""
        value = node.meta.get("value")
        if node.op == "placeholder" or not (value is None or isinstance(value, str)):
            return _ConcreteProxy(node, self)
        if value is not None:
            return value
        owner = node.args[0].meta["value"] if node.op == "call_method" and isinstance(node.args[0], fx.Node) else None
        if owner is not None and not isinstance(owner, torch.Tensor):
            self.specialised.append(f".{node.target}() returned None at {user_location()}")
        return None

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        proxies = {}
        for inp, value in zip(self.spec.inputs, call_inputs(self.bound, self.spec)):
            self.inputs[inp.name] = value if inp.kind is torch.Tensor else _private_copy(value)
            proxies[inp] = self.create_proxy("placeholder", inp.name, (), {})
        values = {inp.argument: proxies[inp] for inp in self.spec.inputs if not inp.path}
        for name, structure in self.spec.constants.items():
            if any(isinstance(v, Input) for v in pytree.tree_leaves(structure)):
                values[name] = pytree.tree_map(lambda v: proxies[v] if isinstance(v, Input) else v, structure)

        def flat_forward(root, *_placeholders):
            args, kwargs = as_called(self.bound.signature, *self.call, values)
            out = root_fn(root, *args, **kwargs)
            leaves, self.out_spec = pytree.tree_flatten(out)
            return tuple(leaves)

        return flat_forward, [self.root, *proxies.values()]

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "placeholder":
            node.meta["value"] = self.inputs[target]
        elif kind != "output":
            self.running += 1
            try:
                with not_fx_tracing(), self.recorder.paused():
                    node.meta["value"] = self._run(node)
            finally:
                self.running -= 1
        return node

    def create_arg(self, a: Any):
        if isinstance(a, torch.Tensor) and a.grad_fn is not None and a not in self.tensor_attrs:
            # computed from parameters while a block ran for real, yet not a value the graph holds: it left the
            # block by a side way (a forward hook collecting outputs, as transformers' output capturing does for
            # router logits; a list a block appends to), so the graph would hand on the example's value each run
            raise TraceError(
                f"a tensor {describe(a)} computed inside a block reaches the forward other than through a block's "
                "return value (a forward hook that collects outputs, a list a block appends to); a traced graph "
                "would hand on the example's value on every run")
        with self.recorder.paused():  # fx keeps constants on the root: its writes, not the forward's
            try:
                return super().create_arg(a)
            except NotImplementedError:  # an object fx cannot put in a graph
                return self._object_node(a)

    def _object_node(self, obj: Any) -> fx.Node:
        """The node standing for an object a forward passes to a module or function (or returns).

        An attribute of the model is read from it (get_attr). A value-like object (see `is_constant`), or a
        parameter's default, is a constant: the same object on every run. An object the forward made (a
        generation cache built in the forward) must be new on every run, as in eager: the graph deep-copies
        its state at first use, once per run, and every use in the run shares that copy. Objects passed in
        as arguments never get here: they are graph inputs.
        """
        if id(obj) in self.objects:
            return self.objects[id(obj)][1]
        path = _attribute_path(self.root, obj)
        name = f"_routekit_object_{len(self.objects)}"
        if path is not None:
            node = self.create_node("get_attr", path, (), {})
        elif is_constant(obj) or any(obj is v for v in self.spec.constants.values()):  # e.g. a default
            setattr(self.root, name, obj)
            node = self.create_node("get_attr", name, (), {})
        else:
            snapshot = _snapshot(obj)
            setattr(self.root, name, snapshot)
            copier = per_run_copy if _plainly_copied(snapshot) else copy.deepcopy
            node = self.create_node("call_function", copier, (self.create_node("get_attr", name, (), {}),), {})
            node.meta["value"] = obj  # the forward goes on with the object itself
            self.snapshots[node.name] = snapshot
            self.specialised.append(f"{type(obj).__name__} made by the forward: each run starts from its state "
                                    f"at first use, at {user_location()}")
        self.objects[id(obj)] = (obj, node)
        return node

    def _run(self, node: fx.Node) -> Any:
        args = fx.node.map_arg(node.args, lambda n: n.meta["value"])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta["value"])
        if node.op == "get_attr":
            return _fetch(self.root, node.target)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, node.target)(*rest, **kwargs)
        if node.op == "call_module":
            return self.root.get_submodule(node.target)(*args, **kwargs)
        return None

    def path_of_module(self, mod: nn.Module) -> str:
        """fx's, and for a user's module reached past the copy the trace runs on (see `Recorder`), its path."""
        try:
            return super().path_of_module(mod)
        except NameError:
            path = self.recorder.originals.get(id(mod))
            if path is None:
                raise
            return path

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if self.running:  # a node running for real reads the real parameter, not a proxy of it
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if self.running:  # a node running for real: the module's own call, hooks and all, recorded nowhere
            return forward(*args, **kwargs)
        try:
            qualname = self.path_of_module(m)
        except NameError:  # a module the forward made (transformers' ACT2FN[name] builds one per lookup): inline code
            return forward(*args, **kwargs)
        if self.is_leaf_module(m, qualname):
            out = super().call_module(m, forward, args, kwargs)
            checkpoint = _checkpoint_around(m)
            if checkpoint is not None and isinstance(out, fx.Proxy):
                out.node.meta["checkpoint"] = checkpoint
            return out
        self.recorder.entered(qualname)
        try:
            return super().call_module(m, forward, args, kwargs)
        except _Untraceable:
            raise
        except Exception as err:  # any failure inside a submodule: retry with it as a leaf
            raise _Untraceable(qualname, err) from err


_CHECKPOINT_CODE = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__
_CHECKPOINT_DEFAULTS = {"use_reentrant": None, "determinism_check": "default", "debug": False, "early_stop": True,
                        "preserve_rng_state": True}


def _checkpoint_around(module: nn.Module) -> dict | None:
    """The options of the `torch.utils.checkpoint.checkpoint` call that is running `module` now (the owner's
    forward checkpoints a block: `checkpoint(block, x, ...)`, or a partial of it as diffusers does), or None.

    Read off the checkpoint call's frame: nothing else holds those options. The owner's forward calls torch's
    function directly (or a `functools.partial` of it, bound before any trace, as diffusers binds
    `_gradient_checkpointing_func`), so no argument carries them to the tracer and no wrapper routekit could
    install would see a call through a name bound before it; torch keeps them in no state a public API reads.
    The walk only reads frames (locals of torch's own function, found by its code object) and starts here."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is _CHECKPOINT_CODE:
            local = frame.f_locals
            function = local.get("function")
            if function is module or getattr(function, "__self__", None) is module:
                given = {**local, **(local.get("kwargs") or {})}
                if given.get("context_fn", torch.utils.checkpoint.noop_context_fn) \
                        is not torch.utils.checkpoint.noop_context_fn:
                    raise TraceError(f"{type(module).__name__} is checkpointed with a context_fn, which a rewritten "
                                     "graph cannot carry; drop it, or route in boundary mode")
                return {k: given[k] for k, default in _CHECKPOINT_DEFAULTS.items() if given.get(k, default) != default}
            return None
        frame = frame.f_back
    return None


_FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn")


@contextlib.contextmanager
def _torch_takes_traced_values(tracer: _Tracer):
    """torch's factories, while the owner forward is traced, take sizes the trace computed: `torch.ones(b, n)`
    with proxies for b and n is refused by torch's argument parser ("takes 1 positional argument") before any
    proxy is asked for its value (HunyuanVideo's attention mask, HiDream's ids), and `torch.zeros((b, n))` reads
    them as numbers, tying the graph to the example's batch. Either becomes a node computing its size from the
    shapes it was read off, on each run. So do `torch.finfo` and `torch.iinfo` of a dtype read off a value
    (transformers' eager masks fill with `torch.finfo(x.dtype).min`): torch refuses the proxy, and the example's
    dtype baked in would go stale when the model is cast."""
    originals = {name: getattr(torch, name) for name in _FACTORIES}

    def taking_dtypes(info):
        @functools.wraps(info)
        def call(dtype=None):
            if tracer.running or not isinstance(dtype, fx.Proxy):
                return info() if dtype is None else info(dtype)
            return tracer.create_proxy("call_function", info, (dtype,), {})
        return call

    def taking_sizes(factory):
        @functools.wraps(factory)
        def call(*args, **kwargs):
            if tracer.running or not any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves((args, kwargs))):
                return factory(*args, **kwargs)
            number = lambda v: type(_value_of(v) if isinstance(v, fx.Proxy) else v) is int  # noqa: E731
            if factory is not originals["full"] and args and all(map(number, args)):
                args = (tuple(args),)  # sizes one by one: the one size tuple every factory takes (not a torch.Size)
            return tracer.create_proxy("call_function", factory, args, kwargs)
        return call

    infos = {name: getattr(torch, name) for name in ("finfo", "iinfo")}
    for name, factory in originals.items():
        setattr(torch, name, taking_sizes(factory))
    for name, info in infos.items():
        setattr(torch, name, taking_dtypes(info))
    try:
        yield
    finally:
        for name, factory in {**originals, **infos}.items():
            setattr(torch, name, factory)


def _attribute_path(root: nn.Module, obj: Any) -> str | None:
    """The qualified name of `obj` as a plain attribute of `root` or one of its submodules, if it is one."""
    for prefix, module in root.named_modules():
        for k, v in vars(module).items():
            if v is obj:
                return f"{prefix}.{k}" if prefix else k
    return None


def _private_copy(obj: Any) -> Any:
    """The object an input is traced with: a deep copy, so tracing (which runs the forward) leaves the
    caller's object as it was. One that cannot be copied is traced as it is."""
    try:
        return copy.deepcopy(obj)
    except Exception:
        return obj


def _snapshot(obj: Any) -> Any:
    """A deep copy of an object the forward made, refused if it would copy the model or traced values: the
    graph copies it on every run."""
    memo: dict = {}
    try:
        snapshot = copy.deepcopy(obj, memo)
    except Exception as err:
        raise TraceError(f"{type(obj).__name__}, made by the forward and passed on, cannot be copied for each "
                         f"run: {_short(err)}") from None
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
    cache on). Only for snapshots `_plainly_copied` accepts; any other is copied by copy.deepcopy."""
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


def _plainly_copied(obj: Any) -> bool:
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


def _fetch(root: nn.Module, target: str) -> Any:
    obj = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def trace(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *,
          signature_of=None, leaves: set[str] | None = None) -> Trace:
    """Trace `model`'s forward (in its current train/eval mode) on example inputs.

    Placeholders and specialisation follow the signature of `signature_of` (default: the model
    class's forward), so a wrapper with a `(*args, **kwargs)` forward traces with the wrapped
    model's argument names. Untraceable submodules become leaves, listed in `Trace.leafed`; a
    failure at the owner level raises TraceError naming the file and line.
    """
    bound = bind_arguments(signature_of or type(model).forward, args, kwargs or {})
    spec = call_spec(bound)
    leaves = set(container_members(model)) | set(leaves or ())
    leafed: dict[str, str] = {}
    data_leaves: set[str] = set()
    tensors = [v for v in call_inputs(bound, spec) if isinstance(v, torch.Tensor)]
    # traced with gradients on in train mode: a forward that checkpoints its blocks only when they are on
    # (`torch.is_grad_enabled() and self.gradient_checkpointing`) takes the branch it trains with
    with preserved_state(model, tensors), as_found(model), torch.set_grad_enabled(model.training):
        while True:
            recorder = Recorder(model, leaves)  # the trace runs on its copy of the module tree
            tracer = _Tracer(leaves, bound, spec, (tuple(args), dict(kwargs or {})), recorder, data_leaves)
            try:
                with recorder.recording(), _torch_takes_traced_values(tracer):
                    graph = tracer.trace(recorder.root)
                break
            except _Untraceable as err:
                leafed[err.qualname] = _short(err.cause)
                leaves.add(err.qualname)
                if isinstance(err.cause, _DataDependent):
                    data_leaves.add(err.qualname)
            except _DataDependent as err:
                raise TraceError(
                    f"cannot trace {type(model).__name__}.forward: control flow depends on {err}. routekit "
                    "specialises shapes, not data; move that branch into a submodule (it becomes a leaf)"
                ) from None
            except Exception as err:
                where = user_location(err.__traceback__)
                at = "" if where == "<unknown location>" else f" at {where}"  # a value met after the forward returned
                detail = str(err).splitlines()[0] if isinstance(err, TraceError) else _short(err)
                raise TraceError(f"cannot trace {type(model).__name__}.forward{at}: {detail}") from None
            finally:
                tracer.finished = True
    if recorder.writes:
        raise TraceError(
            f"cannot trace {type(model).__name__}.forward: it sets {recorder.writes[0]} as it runs, which a traced "
            "graph would not repeat; keep such state in a buffer, or change it outside the forward"
        )
    constants = {}
    for node in graph.nodes:
        if node.op == "get_attr" and not _has_attr(model, node.target):
            constants[node.target] = node.meta["value"]
    passed = dict(zip(spec.names, call_inputs(bound, spec)))  # an object input is described as passed, not as traced
    for node in graph.nodes:
        value = node.meta.pop("value", None)
        value = passed[node.target] if node.op == "placeholder" else tracer.snapshots.get(node.name, value)
        node.meta["rk"] = describe(value)
    _drop_dead_shape_arithmetic(graph)
    return Trace(graph, spec, tracer.out_spec, constants, leafed, tracer.specialised, model.training,
                 recorder.assumptions())


def _has_attr(model: nn.Module, target: str) -> bool:
    try:
        _fetch(model, target)
        return True
    except AttributeError:
        return False


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _is_shape_value(v: Any) -> bool:
    leaves = pytree.tree_leaves(v)
    return v is not None and all(isinstance(x, (int, float, bool, torch.Size)) for x in leaves)


def _drop_dead_shape_arithmetic(graph: fx.Graph) -> None:
    """Remove unused nodes that only computed shapes or numbers from tensors and numbers, left behind by
    specialisation; a call on an object (a cache's update returning a count) is kept for its effect."""
    for node in reversed(graph.nodes):
        if (node.op in ("call_function", "call_method") and not node.users and _is_shape_value(node.meta["rk"])
                and all(isinstance(n.meta["rk"], TensorMeta) or _is_shape_value(n.meta["rk"])
                        for n in node.all_input_nodes)):
            graph.erase_node(node)

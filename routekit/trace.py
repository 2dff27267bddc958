"""Trace a model with torch.fx while running it on example inputs.

Why concrete values: owner forwards do shape arithmetic (`h = int(x.shape[1] ** 0.5)`), branch on
shapes, and unpack tuples. Every node is executed as it is recorded, so such code is specialised to
the example shapes (and the trace says it was), while data-dependent control flow is refused with
the file and line. The members of every ModuleList/Sequential are leaves, so block internals
(custom kernels, compiled forwards) are never traced at the owner level; submodules that cannot be
traced become leaves automatically, and the trace reports which.

Real forwards are traced as they run: the call is made as the caller made it; tensors inside tuple,
list and dict arguments are graph inputs like top-level ones (`call_inputs` gives them in order);
an object fx cannot hold (a generation cache) is a graph input when passed in, and, when the forward
makes it, a fresh copy on every run of the graph; item assignment into a tensor is recorded in place.
The private parts of torch.fx this needs (its tracing flag, its nn.Module patches) are detected, with
a fallback each, so a torch release that moves one does not silently turn graph mode off.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import math
import operator
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn

from .errors import InputError, TraceError
from .guards import Assumptions, Recorder, hooked

_ROUTEKIT_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a traced tensor; the analysis needs nothing more."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{', '.join(map(str, self.shape))}]"


def describe(value: Any) -> Any:
    """Replace tensors by TensorMeta inside any structure, to keep metadata without the memory.

    A dataclass pytree does not know (fx builds such outputs in the graph) becomes the tuple of its fields.
    """

    def leaf(v):
        if isinstance(v, torch.Tensor):
            return TensorMeta(tuple(v.shape), v.dtype)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return tuple(describe(getattr(v, f.name)) for f in dataclasses.fields(v))
        return v

    return pytree.tree_map(leaf, value)


def flatten(value: Any) -> tuple[list, list]:
    """Leaves and structure of a value, descending into dataclasses that pytree does not know."""
    leaves, spec = pytree.tree_flatten(value)
    flat, structure = [], [spec]
    for v in leaves:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            inner, inner_structure = flatten({f.name: getattr(v, f.name) for f in dataclasses.fields(v)})
            flat.extend(inner)
            structure.append((type(v), inner_structure))
        else:
            flat.append(v)
    return flat, structure


@dataclass(frozen=True)
class Input:
    """One graph input (placeholder): where it sits in a call and what it is.

    `argument` is the argument's name (an entry of *args or **kwargs goes by its own name, see `_flat_arguments`),
    `path` the pytree key path of the value inside it (() for the argument itself), `kind` torch.Tensor or the
    class of an object the graph takes as an input (a cache, see `_is_constant`).
    """

    name: str
    argument: str
    path: tuple = ()
    kind: type = torch.Tensor


@dataclass
class CallSpec:
    """How a call's arguments map onto a traced graph.

    Graph inputs (placeholders, in signature order) are the call's tensors, at the top level or inside
    tuples, lists and dicts (every pytree container), and the objects a graph cannot hold as constants
    (a cache, whose state the graph must read and update at run time). Everything else is a constant the
    graph was specialised to: `constants` holds it per argument, a container with its `Input`s in place
    of the inputs, so the key that selects a graph includes every container's structure.
    """

    inputs: tuple[Input, ...]
    constants: dict[str, Any]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The placeholder names under model.py's current name for them; goes once model.py calls `call_inputs`."""
        return self.names

    def key(self) -> tuple:
        return self.inputs, tuple((k, _hashable(v)) for k, v in sorted(self.constants.items()))


def _hashable(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


@dataclass
class Trace:
    """A traced forward: graph, argument mapping, output structure and what was specialised.

    `constants` holds the values of get_attr targets the model does not have: tensors made by the forward
    from no input, and the state, when first used, of objects the forward made (see `_Tracer.create_arg`).
    """

    graph: fx.Graph
    spec: CallSpec
    out_spec: pytree.TreeSpec
    constants: dict[str, Any]
    leafed: dict[str, str] = field(default_factory=dict)
    specialised: list[str] = field(default_factory=list)
    training: bool = True
    assumed: Assumptions = field(default_factory=Assumptions)  # what the graph took as given: see guards.py


def bind_arguments(forward, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a call to a forward's signature (without `self`), defaults applied; InputError if it does not fit."""
    # under torch.compile the call is bound once, as it is traced (Dynamo traces through a cache wrapper anyway)
    sig = _without_self(inspect.signature(forward)) if torch.compiler.is_compiling() else _signature(forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise InputError(f"inputs do not fit forward{sig}: {err}") from None
    bound.apply_defaults()
    return bound


@functools.lru_cache(maxsize=256)
def _signature(forward) -> inspect.Signature:
    """A forward's signature without `self`: read once per function (every training call binds its arguments)."""
    return _without_self(inspect.signature(forward))


def _without_self(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=list(sig.parameters.values())[1:])


_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format,
                   torch.Size, torch.Generator, slice, range, enum.Enum, type, nn.Module)


def _is_constant(value: Any) -> bool:
    """A value a graph can be specialised to: immutable, or compared by value, or code (a function, a module).

    Anything else that is not a tensor (a cache, a mutable config object) is hashed by identity or not at
    all: it may change between calls, so it is a graph input and what the forward does with it is recorded.
    """
    if value is None or value is Ellipsis or isinstance(value, _CONSTANT_TYPES) or callable(value):
        return True
    return type(value).__hash__ not in (None, object.__hash__)


def call_spec(bound: inspect.BoundArguments) -> CallSpec:
    """The inputs and constants of a bound call (`bind_arguments`); InputError for an fx Node among them."""
    inputs, constants, taken = [], {}, {name for name, _, _ in _flat_arguments(bound)}
    for name, value, param in _flat_arguments(bound):
        if param is not None and value is param.default:  # not passed: the forward uses its default itself
            constants[name] = value
            continue
        leaves, treespec = pytree.tree_flatten_with_path(value, is_leaf=_keyless)
        marked = []
        for path, leaf in leaves:
            if isinstance(leaf, fx.Node):
                raise InputError(
                    f"argument {name!r} holds the fx node {leaf.name!r} at {pytree.keystr(path) or 'its top level'}; "
                    "trace takes concrete values (tensors, or objects), not the nodes of another graph"
                )
            if isinstance(leaf, torch.Tensor) or not _is_constant(leaf):
                leaf = Input(_unique(_leaf_name(name, path), taken) if path else name, name, tuple(path),
                             torch.Tensor if isinstance(leaf, torch.Tensor) else type(leaf))
                inputs.append(leaf)
            marked.append(leaf)
        if not (len(leaves) == 1 and not leaves[0][0] and isinstance(marked[0], Input)):  # not one input itself
            constants[name] = pytree.tree_unflatten(marked, treespec)
    return CallSpec(tuple(inputs), constants)


def _keyless(value: Any) -> bool:
    """A type registered with pytree without key paths (`register_pytree_node` with no flatten_with_keys_fn):
    its parts cannot be named or fetched, so the object is taken whole, as an object that is not registered is."""
    node = pytree.SUPPORTED_NODES.get(type(value))
    return node is not None and node.flatten_with_keys_fn is None


def call_inputs(bound: inspect.BoundArguments, spec: CallSpec, step=None) -> list[Any]:
    """The values of a call's graph inputs, in placeholder order: what a graph traced with `spec` is called with.

    `bound` is the call bound by `bind_arguments`, and must have `spec`'s key (`call_spec(bound).key()`).
    `step(value, key)` takes one key of an input's path into its argument (default: the key's own lookup);
    a graph rewrite passes one that reads an item of a container node.
    """
    arguments = {name: value for name, value, _ in _flat_arguments(bound)}
    values = []
    for inp in spec.inputs:
        value = arguments[inp.argument]
        for key in inp.path:
            value = key.get(value) if step is None else step(value, key)
        values.append(value)
    return values


def _leaf_name(argument: str, path) -> str:
    """A placeholder name for a value inside an argument: `image_rotary_emb_0`, `added_cond_kwargs_resolution`."""
    parts = [argument]
    for key in path:
        part = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
        parts.append(re.sub(r"\W", "_", str(part)))
    return "_".join(parts)


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    taken.add(candidate)
    return candidate


def _flat_arguments(bound: inspect.BoundArguments):
    """(name, value, parameter) per argument; *args and **kwargs entries are spread out under their own names,
    with parameter None (they have no default)."""
    for name, param in bound.signature.parameters.items():
        if name not in bound.arguments:
            continue
        value = bound.arguments[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            yield from ((f"{name}_{i}", v, None) for i, v in enumerate(value))
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            yield from ((k, v, None) for k, v in value.items())
        else:
            yield name, value, param


def _as_called(signature: inspect.Signature, args: tuple, kwargs: dict, values: dict[str, Any]) -> tuple[tuple, dict]:
    """The call as it was made (positional arguments positional, keywords by keyword, defaults left to the
    forward), with the arguments in `values` (by flat name) replaced. A forward's decorators may tell a passed
    argument from a default (transformers fills `use_cache` from the config only when it was not passed), so
    the trace must not pass what the caller did not."""
    params = list(signature.parameters.values())
    positional = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    names = [positional[i] if i < len(positional) else f"{star}_{i - len(positional)}" for i in range(len(args))]
    return (tuple(values.get(n, v) for n, v in zip(names, args)),
            {k: values.get(k, v) for k, v in kwargs.items()})


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
        if isinstance(other, fx.Proxy) and other.tracer is not self.tracer:
            return False  # a proxy kept from an earlier attempt (e.g. in an lru_cache) is not this trace's value
        return fx.Proxy.__eq__(self, other)


def _value_of(proxy: fx.Proxy) -> Any:
    """The example value behind a proxy; an attribute's without recording a getattr (most become method calls)."""
    if isinstance(proxy, fx.proxy.Attribute) and getattr(proxy, "_node", None) is None:
        return getattr(_value_of(proxy.root), proxy.attr)
    return proxy.node.meta["value"]


class _ConcreteProxy(_ConcreteMixin, fx.Proxy):
    pass


class _ConcreteAttribute(_ConcreteMixin, fx.proxy.Attribute):
    pass


class _Tracer(fx.Tracer):
    """fx's tracer, running every node as it records it; see the module docstring."""

    def __init__(self, leaves: set[str], bound: inspect.BoundArguments, spec: CallSpec, call: tuple[tuple, dict],
                 recorder: Recorder):
        super().__init__(autowrap_modules=(math,))
        self.leaves, self.bound, self.spec, self.call, self.recorder = leaves, bound, spec, call, recorder
        self.specialised: list[str] = []
        self.record_stack_traces = False
        self.inputs: dict[str, Any] = {}  # placeholder name -> its example value
        self.objects: dict[int, tuple[Any, fx.Node]] = {}  # id -> (object the forward made, its node)
        self.snapshots: dict[str, Any] = {}  # node name -> that object's state when the forward first used it

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
            args, kwargs = _as_called(self.bound.signature, *self.call, values)
            out = root_fn(root, *args, **kwargs)
            leaves, self.out_spec = pytree.tree_flatten(out)
            return tuple(leaves)

        return flat_forward, [self.root, *proxies.values()]

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "placeholder":
            node.meta["value"] = self.inputs[target]
        elif kind != "output":
            with _patches_reverted(), _not_fx_tracing(), self.recorder.paused():  # run the real modules
                node.meta["value"] = self._run(node)
        return node

    def create_arg(self, a: Any):
        with self.recorder.paused():  # fx keeps constants on the root: its writes, not the forward's
            try:
                return super().create_arg(a)
            except NotImplementedError:  # an object fx cannot put in a graph
                return self._object_node(a)

    def _object_node(self, obj: Any) -> fx.Node:
        """The node standing for an object a forward passes to a module or function (or returns).

        An attribute of the model is read from it (get_attr). A value-like object (see `_is_constant`), or a
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
        elif _is_constant(obj) or any(obj is v for v in self.spec.constants.values()):  # e.g. a default
            setattr(self.root, name, obj)
            node = self.create_node("get_attr", name, (), {})
        else:
            snapshot = _snapshot(obj)
            setattr(self.root, name, snapshot)
            node = self.create_node("call_function", copy.deepcopy, (self.create_node("get_attr", name, (), {}),), {})
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

    def call_module(self, m, forward, args, kwargs):
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
    Read off the call's frame, so a `functools.partial` bound before tracing is seen too."""
    frame = sys._getframe(2)
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


def _fx_flag_switch():
    """How to clear torch.fx's "symbolic tracing" flag while concrete values run.

    Under the flag a torch.compile'd module refuses to run ("Detected that you are using FX to symbolically
    trace a dynamo-optimized function") and ProxyableClassMeta classes build proxies. torch keeps the flag
    privately and has moved it (a module global up to 2.13, a thread-local behind `_is_fx_tracing_context`
    from 2.14), so each is detected, never assumed. Where neither exists, Dynamo's own switch for nested
    compiles (`force_compile_during_fx_trace`) lets compiled modules run under the flag.
    """
    fx_trace = torch.fx._symbolic_trace
    if callable(getattr(fx_trace, "_is_fx_tracing_context", None)):
        return "thread-local", lambda: fx_trace._is_fx_tracing_context(False)
    if isinstance(getattr(fx_trace, "_is_fx_tracing_flag", None), bool):
        return "module-global", lambda: _module_flag_cleared(fx_trace)
    return "dynamo-config", _dynamo_compiles_under_fx


@contextlib.contextmanager
def _module_flag_cleared(fx_trace):
    flag = fx_trace._is_fx_tracing_flag
    fx_trace._is_fx_tracing_flag = False
    try:
        yield
    finally:
        fx_trace._is_fx_tracing_flag = flag


def _dynamo_compiles_under_fx():
    import torch._dynamo

    return torch._dynamo.config.patch(force_compile_during_fx_trace=True, error_on_nested_fx_trace=False)


_FX_FLAG_SWITCH, _not_fx_tracing = _fx_flag_switch()

# nn.Module's own methods, captured at import (before any trace patches them), for `_modules_restored`
_MODULE_METHODS = {name: vars(nn.Module)[name] for name in ("__call__", "__getattr__")}


def _patch_reverter():
    """How to run real modules while fx's tracer has patched nn.Module (its `__call__` records a call
    instead of running it): torch's private `_maybe_revert_all_patches` where it exists (it also undoes
    the tracer's other patches), else nn.Module's own methods put back for the while."""
    revert = getattr(torch.fx._symbolic_trace, "_maybe_revert_all_patches", None)
    return revert if callable(revert) else _modules_restored


@contextlib.contextmanager
def _modules_restored():
    patched = {name: vars(nn.Module)[name] for name in _MODULE_METHODS}
    for name, method in _MODULE_METHODS.items():
        setattr(nn.Module, name, method)
    try:
        yield
    finally:
        for name, method in patched.items():
            setattr(nn.Module, name, method)


_patches_reverted = _patch_reverter()


def _fetch(root: nn.Module, target: str) -> Any:
    obj = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def shallow_copy(model: nn.Module, cls: type | None = None) -> nn.Module:
    """A module sharing `model`'s submodules, parameters and buffers, with its own attribute dict.

    Tracing writes constants onto its root, and routekit adds its own submodules: neither may touch
    the user's model.
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
    tensors = [v for v in call_inputs(bound, spec) if isinstance(v, torch.Tensor)]
    # traced with gradients on in train mode: a forward that checkpoints its blocks only when they are on
    # (`torch.is_grad_enabled() and self.gradient_checkpointing`) takes the branch it trains with
    with preserved_state(model, tensors), torch.set_grad_enabled(model.training):
        while True:
            root = shallow_copy(model)
            recorder = Recorder(root, leaves)
            tracer = _Tracer(leaves, bound, spec, (tuple(args), dict(kwargs or {})), recorder)
            try:
                with recorder.recording():
                    graph = tracer.trace(root)
                break
            except _Untraceable as err:
                leafed[err.qualname] = _short(err.cause)
                leaves.add(err.qualname)
            except _DataDependent as err:
                raise TraceError(
                    f"cannot trace {type(model).__name__}.forward: control flow depends on {err}. routekit "
                    "specialises shapes, not data; move that branch into a submodule (it becomes a leaf)"
                ) from None
            except Exception as err:
                raise TraceError(
                    f"cannot trace {type(model).__name__}.forward at {user_location(err.__traceback__)}: "
                    f"{_short(err)}"
                ) from None
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

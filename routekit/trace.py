"""Trace a model with torch.fx while running it on example inputs.

Why concrete values: owner forwards do shape arithmetic (`h = int(x.shape[1] ** 0.5)`), branch on
shapes, and unpack tuples. Every node is executed as it is recorded, so such code is specialised to
the example shapes (and the trace says it was), while data-dependent control flow is refused with
the file and line. The members of every ModuleList/Sequential are leaves, so block internals
(custom kernels, compiled forwards) are never traced at the owner level; submodules that cannot be
traced become leaves automatically, and the trace reports which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import operator
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches

from .errors import InputError, TraceError

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


@dataclass
class CallSpec:
    """How a call's arguments map onto a traced graph.

    Tensors are graph inputs (placeholders, in signature order); every other argument is a
    constant the graph was specialised to, and so part of the key that selects a graph.
    """

    tensor_names: tuple[str, ...]
    constants: dict[str, Any]

    def key(self) -> tuple:
        return self.tensor_names, tuple((k, _hashable(v)) for k, v in sorted(self.constants.items()))


def _hashable(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


@dataclass
class Trace:
    """A traced forward: graph, argument mapping, output structure and what was specialised."""

    graph: fx.Graph
    spec: CallSpec
    out_spec: pytree.TreeSpec
    constants: dict[str, torch.Tensor]
    leafed: dict[str, str] = field(default_factory=dict)
    specialised: list[str] = field(default_factory=list)
    training: bool = True


def bind_arguments(forward, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a call to a forward's signature (without `self`), defaults applied; InputError if it does not fit."""
    sig = inspect.signature(forward)
    sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise InputError(f"inputs do not fit forward{sig}: {err}") from None
    bound.apply_defaults()
    return bound


def call_spec(bound: inspect.BoundArguments) -> CallSpec:
    tensors, constants = [], {}
    for name, value in _flat_arguments(bound):
        if isinstance(value, torch.Tensor):
            tensors.append(name)
        else:
            leaves = pytree.tree_leaves(value)
            if any(isinstance(v, torch.Tensor) for v in leaves):
                raise InputError(
                    f"argument {name!r} is a {type(value).__name__} holding tensors; routekit takes tensor "
                    "arguments at the top level of the call (pass each tensor as its own argument)"
                )
            constants[name] = value
    return CallSpec(tuple(tensors), constants)


def _flat_arguments(bound: inspect.BoundArguments):
    """(name, value) per argument; *args and **kwargs entries are spread out under their own names."""
    for name, param in bound.signature.parameters.items():
        if name not in bound.arguments:
            continue
        value = bound.arguments[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            yield from ((f"{name}_{i}", v) for i, v in enumerate(value))
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            yield from value.items()
        else:
            yield name, value


def _rebuild_call(bound: inspect.BoundArguments, values: dict[str, Any]) -> tuple[tuple, dict]:
    """Positional and keyword arguments for the forward, with `values` substituted by name."""
    args, kwargs = [], {}
    for name, param in bound.signature.parameters.items():
        if name not in bound.arguments:
            continue
        value = bound.arguments[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            args.extend(values.get(f"{name}_{i}", v) for i, v in enumerate(value))
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update({k: values.get(k, v) for k, v in value.items()})
        elif param.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = values.get(name, value)
        else:
            args.append(values.get(name, value))
    return tuple(args), kwargs


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
    """Proxy behaviour for Python conversions: use the example value and record the specialisation.

    Conversions of a tensor's *data* are refused (data-dependent control flow); conversions of
    shapes and numbers are specialised to the example inputs and listed in `Trace.specialised`.
    """

    def _convert(self, why: str, convert):
        value = self.node.meta["value"]
        if isinstance(value, torch.Tensor):
            raise _DataDependent(f"{why} of a tensor's data at {user_location()}")
        result = convert(value)
        self.tracer.specialised.append(f"{why} = {result!r} at {user_location()}")
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
        return len(value)  # the arity of a tuple or torch.Size is structure, not a specialisation

    def __iter__(self):
        return iter([self[i] for i in range(len(self))])

    def __getattr__(self, k: str):
        return _ConcreteAttribute(self, k)


class _ConcreteProxy(_ConcreteMixin, fx.Proxy):
    pass


class _ConcreteAttribute(_ConcreteMixin, fx.proxy.Attribute):
    pass


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str], bound: inspect.BoundArguments, spec: CallSpec):
        super().__init__(autowrap_modules=(math,))
        self.leaves, self.bound, self.spec = leaves, bound, spec
        self.specialised: list[str] = []
        self.record_stack_traces = False

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ConcreteProxy(node, self)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        values = {}
        for name, value in _flat_arguments(self.bound):
            if name in self.spec.tensor_names:
                values[name] = self.create_proxy("placeholder", name, (), {})
                values[name].node.meta["value"] = value

        def flat_forward(root, *_placeholders):
            args, kwargs = _rebuild_call(self.bound, values)
            out = root_fn(root, *args, **kwargs)
            leaves, self.out_spec = pytree.tree_flatten(out)
            return tuple(leaves)

        return flat_forward, [self.root, *(values[n] for n in self.spec.tensor_names)]

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind not in ("placeholder", "output"):
            with _maybe_revert_all_patches(), _not_fx_tracing():  # run the real modules (compiled ones too)
                node.meta["value"] = self._run(node)
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
        qualname = self.path_of_module(m)
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except _Untraceable:
            raise
        except Exception as err:  # any failure inside a submodule: retry with it as a leaf
            raise _Untraceable(qualname, err) from err


@contextlib.contextmanager
def _not_fx_tracing():
    """Run concrete values outside fx's tracing flag: a torch.compile'd block refuses to run under it."""
    flag = fx._symbolic_trace._is_fx_tracing_flag
    fx._symbolic_trace._is_fx_tracing_flag = False
    try:
        yield
    finally:
        fx._symbolic_trace._is_fx_tracing_flag = flag


def _fetch(root: nn.Module, target: str) -> Any:
    obj = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def shallow_copy(model: nn.Module, cls: type | None = None) -> nn.Module:
    """A module sharing `model`'s submodules, parameters and buffers, with its own attribute dicts.

    Tracing writes constants onto its root, and routekit adds its own submodules: neither may touch
    the user's model.
    """
    copy = (cls or type(model)).__new__(cls or type(model))
    copy.__dict__.update(model.__dict__)
    for attr in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        copy.__dict__[attr] = type(model.__dict__[attr])(model.__dict__[attr])
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
    tensors = [v for _, v in _flat_arguments(bound) if isinstance(v, torch.Tensor)]
    with preserved_state(model, tensors):
        while True:
            tracer = _Tracer(leaves, bound, spec)
            try:
                graph = tracer.trace(shallow_copy(model))
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
    constants = {}
    for node in graph.nodes:
        if node.op == "get_attr" and not _has_attr(model, node.target):
            constants[node.target] = node.meta["value"]
    for node in graph.nodes:
        node.meta["rk"] = describe(node.meta.pop("value", None))
    _drop_dead_shape_arithmetic(graph)
    return Trace(graph, spec, tracer.out_spec, constants, leafed, tracer.specialised, model.training)


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
    """Remove unused nodes that only computed shapes or numbers, left behind by specialisation."""
    for node in reversed(graph.nodes):
        if node.op in ("call_function", "call_method") and not node.users and _is_shape_value(node.meta["rk"]):
            graph.erase_node(node)

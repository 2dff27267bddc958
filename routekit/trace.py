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
import functools
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn

from .calls import CallSpec, Input, as_called, bind_arguments, call_inputs, call_spec, is_constant
from .concrete import (
    _ConcreteProxy,
    _DataDependent,
    _Untraceable,
    _value_of,
    user_location,
)
from .errors import TraceError
from .fxcompat import not_fx_tracing
from .guards import Assumptions, Recorder, hooked
from .objects import attribute_path, per_run_copy, plainly_copied, private_copy, snapshot_of
from .state import as_found, preserved_state
from .values import TensorMeta, describe, pickled_fields, read_only


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
            self.inputs[inp.name] = value if inp.kind is torch.Tensor else private_copy(value)
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
        path = attribute_path(self.root, obj)
        name = f"_routekit_object_{len(self.objects)}"
        if path is not None:
            node = self.create_node("get_attr", path, (), {})
        elif is_constant(obj) or any(obj is v for v in self.spec.constants.values()):  # e.g. a default
            setattr(self.root, name, obj)
            node = self.create_node("get_attr", name, (), {})
        else:
            snapshot = snapshot_of(obj)
            setattr(self.root, name, snapshot)
            copier = per_run_copy if plainly_copied(snapshot) else copy.deepcopy
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

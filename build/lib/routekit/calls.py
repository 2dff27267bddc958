"""How a call's arguments map onto a traced graph: binding, graph inputs, constants.

A traced graph takes a call's tensors (at the top level or inside tuples, lists and dicts) and the
objects a graph cannot hold (a cache) as inputs, and is specialised to everything else. Tracing decides
that once (`call_spec`); every later call of a routed model binds its arguments the same way
(`bind_arguments`) to pick its program by the call's key and hand it its inputs (`call_inputs`).
"""

from __future__ import annotations

import enum
import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .errors import InputError


@dataclass(frozen=True)
class Input:
    """One graph input (placeholder): where it sits in a call and what it is.

    `argument` is the argument's name (an entry of *args or **kwargs goes by its own name, see `_flat_arguments`),
    `path` the pytree key path of the value inside it (() for the argument itself), `kind` torch.Tensor or the
    class of an object the graph takes as an input (a cache, see `is_constant`).
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

    def key(self) -> tuple:
        return self.inputs, tuple((k, _hashable(v)) for k, v in sorted(self.constants.items()))


def _hashable(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def bind_arguments(forward, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a call to a forward's signature (without `self`), defaults applied; InputError if it does not fit.

    `forward` may be that signature itself (`signature_of`), as a routed model's training call passes it: read
    before torch.compile traces the call, it spares Dynamo `inspect.signature`, which breaks the graph on some
    forwards (a diffusers class marked allow_in_graph, as LTX-Video's transformer: `hasattr(forward, "__wrapped__")`).
    """
    sig = forward if isinstance(forward, inspect.Signature) else signature_of(forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:
        raise InputError(f"inputs do not fit forward{sig}: {err}") from None
    bound.apply_defaults()
    return bound


@functools.lru_cache(maxsize=256)
def signature_of(forward) -> inspect.Signature:
    """A forward's signature without `self`: read once per function (every training call binds its arguments)."""
    return _without_self(inspect.signature(forward))


def _without_self(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=list(sig.parameters.values())[1:])


_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format,
                   torch.Size, torch.Generator, slice, range, enum.Enum, type, nn.Module)


def is_constant(value: Any) -> bool:
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
            if isinstance(leaf, torch.Tensor) or not is_constant(leaf):
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


def as_called(signature: inspect.Signature, args: tuple, kwargs: dict, values: dict[str, Any]) -> tuple[tuple, dict]:
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

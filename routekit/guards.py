"""What a traced graph assumed about the model, recorded while tracing and checked on every call.

A concrete trace bakes into the graph what the forward read as plain Python: a module's `self.scale`, a
class-dropout probability, `self.gradient_checkpointing`, a submodule's mode; it inlines the modules it
traces through, so hooks registered on them later would never run; and numbers it read off shapes. None
of that may go stale silently: each program carries its `Assumptions`, the executor checks them before
every call and traces again where one no longer holds (or, for a value that changes on every call, says
which attribute to turn into an argument).
"""

from __future__ import annotations

import ast
import contextlib
import enum
import inspect
import operator
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

_MISSING = object()
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def _plain(value: Any) -> bool:
    """A value a graph bakes in as a constant: a number, a string, a dtype..., or a tuple/list of them."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


@dataclass(frozen=True)
class Assumptions:
    """reads: (module path, attribute, value) of plain values the forward read off modules it traced through.
    traced_through: the modules whose forward the graph inlines (their hooks would not run; a module with
    hooks is kept a module call instead). batch_generic: no number in the graph was read off a batch axis, so
    the graph serves any batch size of the same other dimensions."""

    reads: tuple[tuple[str, str, Any], ...] = ()
    traced_through: tuple[str, ...] = ()
    batch_generic: bool = True

    def __post_init__(self):
        # The module paths to look up, parents first, each as (its parent's place, its name): `broken` runs before
        # every training call, and torch.compile traces it into every graph, so each of a model's hundred-odd
        # paths costs one module-table lookup there (`get_submodule`, or a walk from the root, costs more).
        places: dict[str, int] = {"": 0}
        walk: list[tuple[int, str]] = []

        def place(path: str) -> int:
            if path not in places:
                parent, _, atom = path.rpartition(".")
                walk.append((place(parent), atom))
                places[path] = len(walk)
            return places[path]

        object.__setattr__(self, "_reads", tuple((place(p), p, a, v) for p, a, v in self.reads))
        object.__setattr__(self, "_traced", tuple((place(p), p) for p in self.traced_through))
        object.__setattr__(self, "_walk", tuple(walk))

    def under(self, prefix: str) -> Assumptions:
        """These assumptions of a submodule traced alone, as seen from the model that holds it at `prefix`."""
        at = lambda path: f"{prefix}.{path}" if path else prefix  # noqa: E731
        return Assumptions(tuple((at(p), a, v) for p, a, v in self.reads), tuple(map(at, self.traced_through)),
                           self.batch_generic)

    def __add__(self, other: Assumptions) -> Assumptions:
        return Assumptions(self.reads + other.reads, self.traced_through + other.traced_through,
                           self.batch_generic and other.batch_generic)

    def broken(self, root: nn.Module) -> str | None:
        """The first assumption that no longer holds for `root` (the model the graph runs on), said in words;
        None when all hold."""
        modules = [root]  # every path's module, in `_walk`'s order (None past a module that is gone)
        for parent, atom in self._walk:
            above = modules[parent]
            modules.append(above.__dict__["_modules"].get(atom) if above is not None else None)
        for place, path, attr, value in self._reads:
            module = modules[place]
            now = module.__dict__.get(attr, _MISSING) if module is not None else _MISSING
            if type(now) is not type(value) or now != value:
                shown = "gone" if now is _MISSING else repr(now)
                return f"{path or type(root).__name__}.{attr} is {shown}, was {value!r} when the graph was traced"
        for place, path in self._traced:
            module = modules[place]
            if module is not None and hooked(module):
                return f"{path} has hooks now, which the traced graph (built through its forward) would not run"
        return None


def hooked(module: nn.Module) -> bool:
    """Whether calling the module runs hooks (its own forward, pre-forward or backward hooks)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


class Recorder:
    """Records, while a trace runs, the plain values the forward reads off the modules it traces through.

    The trace runs on `root`, a copy of the model's module tree made for it: each module it traces through is
    copied into an instance of a subclass of its own class whose attribute lookup notes such reads (sharing
    the module's attributes, parameters, buffers and hooks, with a submodule table of copies); the leaves (and
    what they hold) are the user's own modules, not copied: a leaf's own code runs at every call, so reads made
    while the tracer runs a leaf's real forward are not recorded either (`paused`). The user's modules keep
    their classes, and a plain attribute the forward sets lands on the copy (and is refused: `writes`). A forward
    bound to the user's module itself (accelerate's hooks replace `forward` by a partial of the module) runs on
    that module: the modules it calls keep their paths (`originals`), but what it reads goes unrecorded.

    Why a subclass at all: a plain value read in a forward (`self.scale`) is a Python attribute lookup, and torch
    has no hook for one (its global module hooks see calls and the registration of parameters, buffers and
    submodules); reading the source (`assigned_attributes`) finds writes, not the reads made through helpers,
    `getattr` and other modules' attributes.
    """

    def __init__(self, model: nn.Module, leaves: set[str]):
        self.leaves = leaves
        self.paths: dict[int, str] = {}  # id of each recording copy -> the path of the module it copies
        self.originals: dict[int, str] = {}  # id of each copied user's module -> its path
        self.reads: dict[tuple[str, str], Any] = {}
        self.writes: list[str] = []  # attributes the forward sets: a graph cannot repeat that
        self.traced_through: list[str] = []
        self.batch_generic = True
        self.active = False
        self.root = self._copy(model, "", {})

    def _copy(self, module: nn.Module, path: str, copies: dict[int, nn.Module]) -> nn.Module:
        """`module` as the trace sees it: a recording copy whose submodules are copied the same way (one copy per
        module, however many paths lead to it); a leaf, or a module whose class cannot be subclassed, as itself
        (its reads go unrecorded)."""
        if id(module) in copies:
            return copies[id(module)]
        if any(path == leaf or path.startswith(leaf + ".") for leaf in self.leaves):
            return module
        try:
            cls = _recording_class(type(module))
            copy = cls.__new__(cls)
        except TypeError:  # a class that cannot be subclassed or made so (extension types)
            return module
        copies[id(module)] = copy
        self.paths[id(copy)], self.originals[id(module)] = path, path
        copy.__dict__.update(module.__dict__)
        children = module.__dict__["_modules"]
        copy.__dict__["_modules"] = type(children)(
            (name, None if child is None else self._copy(child, f"{path}.{name}" if path else name, copies))
            for name, child in children.items())
        return copy

    @contextlib.contextmanager
    def recording(self):
        """Record the reads and writes made on `root` for the duration."""
        global _CURRENT
        previous, _CURRENT, self.active = _CURRENT, self, True
        try:
            yield self
        finally:
            _CURRENT, self.active = previous, False

    @contextlib.contextmanager
    def paused(self):
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    def note(self, module: nn.Module, name: str, value: Any) -> None:
        path = self.paths.get(id(module))
        if path is not None:
            self.reads.setdefault((path, name), value)

    def wrote(self, module: nn.Module, name: str) -> None:
        path = self.paths.get(id(module))
        if path is not None:
            self.writes.append(f"{path or 'self'}.{name}")

    def entered(self, path: str) -> None:
        if path not in self.traced_through:
            self.traced_through.append(path)

    def converted(self, node: fx.Node) -> None:
        """A number was read off `node` and baked in: the graph stops serving other batch sizes when it was read
        off a batch axis (a shape's first entry, a tensor's length)."""
        if reads_batch(node):
            self.batch_generic = False

    def assumptions(self) -> Assumptions:
        reads = tuple((p, a, v) for (p, a), v in self.reads.items())
        return Assumptions(reads, tuple(self.traced_through), self.batch_generic)


_CURRENT: Recorder | None = None
_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    if cls not in _CLASSES:
        def __getattribute__(self, name, _get=object.__getattribute__):
            value = _get(self, name)
            recorder = _CURRENT
            if recorder is not None and recorder.active and not name.startswith("__") and _plain(value) \
                    and name in _get(self, "__dict__"):
                recorder.note(self, name, value)
            return value

        def __setattr__(self, name, value):
            recorder = _CURRENT
            if recorder is not None and recorder.active:
                recorder.wrote(self, name)
            super(_CLASSES[cls], self).__setattr__(name, value)

        _CLASSES[cls] = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def reads_batch(node: fx.Node) -> bool:
    """Whether a value in the graph derives from a batch axis: a shape's (or `size()`'s) first entry, a whole
    shape, or a tensor's `size(0)`, anywhere upstream of `node`."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is operator.getitem and _is_shape(n.args[0]):
            if n.args[1] in (0, slice(None)) or isinstance(n.args[1], slice) and (n.args[1].start or 0) == 0:
                return True
            continue  # another axis: not the batch
        if n.op == "call_method" and n.target == "size" and (n.args[1:] in ((0,), ()) or n.kwargs.get("dim") == 0):
            return True
        if _is_shape(n) and any(u.op != "call_function" or u.target is not operator.getitem for u in n.users):
            return True  # a whole shape used as one value
        stack.extend(n.all_input_nodes)
    return False


def _is_shape(node: Any) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",))
        or (node.op == "call_method" and node.target == "size" and not node.args[1:] and not node.kwargs))


def assigned_attributes(cls: type, method: str = "forward", depth: int = 0,
                        seen: set | None = None) -> list[tuple[str, str]]:
    """(attribute, method) for every `self.attr = ...` in `cls`'s forward and in the methods it calls on self,
    read off the source without running it.

    A forward that sets its own attributes keeps state a traced graph cannot carry, and may set them only when
    something changes (transformers' RwkvModel rescales its weights and sets `layers_are_rescaled` when the mode
    flips): a trace on the example call cannot see that, so the source is read instead, and nothing is run (a
    run in the other mode would rescale the user's weights).
    """
    seen = set() if seen is None else seen
    owner = next((k for k in cls.__mro__ if method in vars(k)), None)
    if owner is None or owner in (nn.Module, object) or (owner, method) in seen or depth > 3:
        return []
    seen.add((owner, method))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(vars(owner)[method]))))
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        found += [(t.attr, f"{owner.__name__}.{method}") for t in targets if _on_self(t)]
        if isinstance(node, ast.Call) and _on_self(node.func):
            found += assigned_attributes(cls, node.func.attr, depth + 1, seen)
    return found


def _on_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"

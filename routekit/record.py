"""Block-call recording: the graph of a model's block calls, for owners whose forward does not trace.

Graph mode traces the owner's forward, the code around the blocks. Some owners do not trace: they
pass objects fx cannot hold (a generation cache), branch on tensor values, or call code fx does not
see through. Recording needs only that the blocks are called: the model runs once on the example
inputs with hooks on every member of every ModuleList/Sequential; each outermost member call becomes
a node of a small fx graph whose arguments link to earlier calls' outputs by tensor identity; other
tensors are placeholders and what the model returns is the output node. The same analysis as graph
mode reads that graph.

What a recording cannot show, it measures: the token grid is the last 4-D module output before the
first block, and the stream's tokens that do not come from that grid (class, register or text
tokens) are those that do not change when the grid module's output does.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .calls import CallSpec
from .errors import InputError
from .state import fresh, preserved_state, training_mode
from .trace import Trace, container_members, user_location
from .values import describe, flatten


@dataclass(frozen=True)
class Image:
    """A (B, C, H, W) or (B, C, T, H, W) module output seen while recording: how many block calls preceded it,
    the module, its shape, and whether the module is a convolution (a patch embedding)."""

    calls_before: int
    module: str
    shape: tuple[int, ...]
    conv: bool


@dataclass
class _Call:
    qualname: str
    args: tuple
    kwargs: dict
    output: Any = None


def record(model: nn.Module, args: tuple, kwargs: dict) -> tuple[Trace, list[Image]]:
    """Run `model` once and build the graph of its outermost container-member calls, plus the 4-D
    module outputs (candidate patch embeddings) in the order they were made."""
    members = container_members(model)
    calls: list[_Call] = []
    active: list[str] = []
    images: list[Image] = []
    handles = []

    def before(name):
        def hook(module, a, kw):
            if not active:
                calls.append(_Call(name, *fresh((a, kw))))  # objects (a cache) as the block got them
            active.append(name)

        return hook

    def after(module, a, out):
        active.pop()
        if not active:
            calls[-1].output = out

    def image(name):
        def hook(module, a, out):
            if isinstance(out, torch.Tensor) and out.dim() in (4, 5):
                images.append(Image(len(calls), name, tuple(out.shape), isinstance(module, (nn.Conv2d, nn.Conv3d))))

        return hook

    for name, module in model.named_modules():
        if name in members:
            handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
            handles.append(module.register_forward_hook(after))
        handles.append(module.register_forward_hook(image(name)))
    try:
        with preserved_state(model, _tensors(args, kwargs)):
            out = model(*args, **kwargs)
    except Exception as err:
        raise InputError(
            f"{type(model).__name__} failed on the example inputs at {user_location(err.__traceback__)}: "
            f"{type(err).__name__}: {err}"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    return _call_graph(calls, out), images


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _call_graph(calls: list[_Call], out: Any) -> Trace:
    graph = fx.Graph()
    nodes: dict[int, fx.Node] = {}

    def tensor_node(value: torch.Tensor) -> fx.Node:
        if id(value) not in nodes:
            nodes[id(value)] = graph.placeholder(f"input_{len(nodes)}")
            nodes[id(value)].meta["rk"] = describe(value)
        return nodes[id(value)]

    def node_of(value):  # tensors, also inside tuples, lists and dicts, become nodes; the rest stays
        return pytree.tree_map(lambda v: tensor_node(v) if isinstance(v, torch.Tensor) else v, value)

    for call in calls:
        node = graph.create_node("call_module", call.qualname, tuple(node_of(v) for v in call.args),
                                 {k: node_of(v) for k, v in call.kwargs.items()}, name=call.qualname.replace(".", "_"))
        node.meta["rk"] = describe(call.output)
        if isinstance(call.output, torch.Tensor):
            nodes[id(call.output)] = node
        elif isinstance(call.output, (tuple, list)):
            for j, item in enumerate(call.output):
                if isinstance(item, torch.Tensor):
                    nodes[id(item)] = graph.call_function(operator.getitem, (node, j))
                    nodes[id(item)].meta["rk"] = describe(item)
    leaves = flatten(out)[0]
    graph.output(tuple(nodes.get(id(v), describe(v)) if isinstance(v, torch.Tensor) else v for v in leaves))
    return Trace(graph, CallSpec((), {}), pytree.tree_flatten(out)[1], {})


def grid_image(images: list[Image], first_call: int, batch: int, tokens: int) -> Image | None:
    """The patch embedding's output: the last (batch, C, *grid) module output before the first block with
    0 < cells <= tokens, a convolution's if there is one.

    With fewer cells than tokens the stream holds other tokens too (`tokens_not_from`).
    """
    fits = [i for i in reversed(images) if i.calls_before <= first_call and i.shape[0] == batch
            and 0 < math.prod(i.shape[2:]) <= tokens]
    return next((i for i in fits if i.conv), fits[0] if fits else None)


def tokens_not_from(model: nn.Module, args: tuple, kwargs: dict, block: str, slot, *, module: str | None = None,
                    image: torch.Tensor | None = None) -> tuple[int, ...]:
    """Positions of the stream entering `block` that depend neither on module `module`'s output nor on the
    input tensor `image` (the one given): class, register and text tokens, made from something else.

    The model runs twice in eval mode up to `block` (which is not run): once as it is, once with that output
    (or input) replaced by other values. A token that comes out the same both times was not made from it.
    Positions are counted from the start for the first half of the stream, from the end (negative) after.
    """
    seen: list[torch.Tensor] = []

    class _Stop(Exception):
        pass

    def capture(mod, a, kw):
        seen.append(a[slot] if isinstance(slot, int) else kw[slot])
        raise _Stop

    def other(t: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator(t.device).manual_seed(0)
        return torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) * 3 + 1

    calls = [(args, kwargs), (args, kwargs)]
    if image is not None:
        calls[1] = pytree.tree_map(lambda v: other(v) if v is image else v, (args, kwargs))
    stop = model.get_submodule(block).register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with preserved_state(model, _tensors(args, kwargs)), training_mode(model, False):
            for run, (a, kw) in enumerate(calls):
                handle = None
                if run and module is not None:
                    handle = model.get_submodule(module).register_forward_hook(lambda m, i, out: other(out))
                torch.manual_seed(0)  # the same random draws in both runs (preserved_state restores the streams)
                try:
                    model(*a, **kw)
                except _Stop:
                    pass
                finally:
                    if handle is not None:
                        handle.remove()
    finally:
        stop.remove()
    if len(seen) != 2 or seen[0].shape != seen[1].shape or seen[0].dim() != 3:
        return ()
    same = (seen[0] == seen[1]).flatten(2).all(-1).all(0)  # (tokens,): unchanged in every sample
    tokens = same.shape[0]
    return tuple(i if i < tokens / 2 else i - tokens for i in same.nonzero().flatten().tolist())


def image_input(args: tuple, kwargs: dict, batch: int) -> torch.Tensor | None:
    """The call's image (or video): its one floating (batch, C, H, W) or (batch, C, T, H, W) input, else its first
    argument where that is a floating (batch, ...) tensor (audio latents (B, C, L), packed latents (B, N, C))."""
    found = [t for t in _tensors(args, kwargs) if t.is_floating_point() and t.dim() in (4, 5) and t.shape[0] == batch]
    if len(found) == 1:
        return found[0]
    first = args[0] if args else next(iter(kwargs.values()), None)
    plain = isinstance(first, torch.Tensor) and first.is_floating_point() and first.dim() >= 3
    return first if not found and plain and first.shape[0] == batch else None


def token_offset(model: nn.Module, args: tuple, kwargs: dict, block: str, slot, source: str,
                 index: int | None) -> int | None:
    """Where the stream entering `block` holds the tokens `source` (a block called before it) handed on, as one
    run of positions: their offset, where a slice of the stream equals that output exactly (output `index` of a
    tuple); None where none does. The stream joins them with others (the text of a joint stack)."""
    seen: dict[str, torch.Tensor] = {}

    class _Stop(Exception):
        pass

    def capture(mod, a, kw):
        seen["stream"] = a[slot] if isinstance(slot, int) else kw[slot]
        raise _Stop

    def output(mod, a, out):
        seen["source"] = out if index is None else out[index]

    handles = [model.get_submodule(block).register_forward_pre_hook(capture, with_kwargs=True),
               model.get_submodule(source).register_forward_hook(output)]
    try:
        with preserved_state(model, _tensors(args, kwargs)), training_mode(model, False):
            torch.manual_seed(0)
            model(*args, **kwargs)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    stream, part = seen.get("stream"), seen.get("source")
    if not isinstance(stream, torch.Tensor) or not isinstance(part, torch.Tensor) or stream.dim() != part.dim() \
            or stream.shape[0] != part.shape[0] or part.shape[1] > stream.shape[1]:
        return None
    length = part.shape[1]
    return next((o for o in range(stream.shape[1] - length + 1) if torch.equal(stream[:, o:o + length], part)), None)

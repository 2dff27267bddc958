"""Block-call recording: the graph of a model's block calls, for owners whose forward does not trace.

Graph mode traces the owner's forward, the code around the blocks. Some owners do not trace: they
pass objects fx cannot hold (a generation cache), branch on tensor values, or call code fx does not
see through. Recording needs only that the blocks are called: the model runs once on the example
inputs with hooks on every member of every ModuleList/Sequential; each outermost member call becomes
a node of a small fx graph whose arguments link to earlier calls' outputs by tensor identity; other
tensors are placeholders and what the model returns is the output node. The same analysis as graph
mode reads that graph.

What a recording cannot show is read off what it saw or measured: the token grid is the last 4-D module
output before the first block (`grid_image`), and the stream's tokens that do not come from that grid
(class, register or text tokens) are those that do not change when the grid module's output does (a
question probe.py answers by running the model: `tokens_not_from`).
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
from .findings import CallGrid
from .state import fresh, preserved_state
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

    With fewer cells than tokens the stream holds other tokens too (`probe.tokens_not_from`).
    """
    fits = [i for i in reversed(images) if i.calls_before <= first_call and i.shape[0] == batch
            and 0 < math.prod(i.shape[2:]) <= tokens]
    return next((i for i in fits if i.conv), fits[0] if fits else None)


def image_input(args: tuple, kwargs: dict, batch: int) -> torch.Tensor | None:
    """The call's image (or video): its first argument where that is a floating (batch, ...) tensor of three or
    more axes (latents (B, C, H, W), packed latents (B, N, C), audio latents (B, C, L): the first argument of
    every diffusers and timm model and of ViTs), else its one floating (batch, C, H, W) or (batch, C, T, H, W)
    input. The first argument comes first because a text encoder's stacked layers (Krea2's (B, L, layers, D))
    are 4-D too: taken for the image, they would make the text look like the image and the image like text."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, torch.Tensor) and first.is_floating_point() and first.dim() >= 3 and first.shape[0] == batch:
        return first
    found = [t for t in _tensors(args, kwargs) if t.is_floating_point() and t.dim() in (4, 5) and t.shape[0] == batch]
    return found[0] if len(found) == 1 else None


_SIZE_NAMES = (("num_frames", "frames"), ("height",), ("width",))


def named_sizes(kwargs: dict) -> tuple[int, ...] | None:
    """The latent sizes a call names, as a grid: (height, width) or (frames, height, width). Either as numbers
    (`num_frames`, `height`, `width`, as LTX-Video's pipeline passes them with its packed latents) or as QwenImage's
    `img_shapes`, one list of (frames, height, width) per sample, where each sample names one image and all the
    same (an edit model's reference images, named after it, would be tokens of another grid). None otherwise."""
    frames, height, width = (next((kwargs[n] for n in names if type(kwargs.get(n)) is int), None)
                             for names in _SIZE_NAMES)
    if height is not None and width is not None:
        return (height, width) if frames is None else (frames, height, width)
    shapes = kwargs.get("img_shapes")
    if not isinstance(shapes, (list, tuple)) or not shapes:
        return None
    named = {tuple(s[0]) if isinstance(s, list) and len(s) == 1 else tuple(s) for s in shapes}
    if len(named) != 1:
        return None
    grid = named.pop()
    if len(grid) != 3 or not all(type(size) is int and size > 0 for size in grid):
        return None
    return grid[1:] if grid[0] == 1 else grid


def grid_of_call(rule: CallGrid, args: tuple, kwargs: dict, batch: int) -> tuple[int, ...] | None:
    """The grid `rule` (measured on another call) gives this call; None where the call has no image or sizes."""
    if rule.patch is None:
        return named_sizes(kwargs)
    image = image_input(args, kwargs, batch)
    if image is None or image.dim() != len(rule.patch) + 2:
        return None
    sizes = (image.shape[1], *image.shape[3:]) if rule.frames_first else tuple(image.shape[2:])
    return tuple(size // patch for size, patch in zip(sizes, rule.patch))

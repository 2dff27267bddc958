"""A reference for a route that does not come from routekit's own reading of the model.

A correct TREAD route runs blocks `start..end` on the kept tokens alone and hands the routed tokens on with
their value at the route's start. For blocks whose tokens meet only in attention, the original blocks over
the *whole* stream compute the same for the kept tokens if every attention ignores the routed tokens as keys:
what a kept token attends to is then exactly what it attends to in the route, and every per-token input (a
RoPE row, a mask row, a caption read whole by cross-attention) is the one the original forward hands it,
whatever routekit decided about that input. So a route that cuts an input it should not (a caption as long as
the stream, gathered at the kept positions), or leaves whole one it should cut, differs from this reference.

Which keys are the routed tokens' is itself read off data, not off routekit's classification: a first run
with the routed tokens set to NaN at the route's start (and each attention computed with the NaN keys masked
out, their keys and values zeroed) shows, at every attention call inside the route, which key positions came
from routed tokens, and at the route's end which positions hold them. A second run with the true values
masks the same keys, and puts the routed tokens back at the end, and at the output of every block of the route
(a block output read after the route, a long skip, holds them as the route began; inside the route, routed
tokens are masked keys, so their values reach no kept token). Where NaN reaches a kept token anyway, the
blocks mix tokens other than by `scaled_dot_product_attention` (a convolution, a scan, attention written out
by hand), and the reference does not apply: `reference` says so instead of comparing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from .calls import slot_named
from .flow import written_out_attention
from .graphs import Slot


@dataclass
class _Route:
    """One route as the reference sees it: its first and last block, the stream's slot and output index there,
    and which tokens it routes (bool (B, N) at its start, from the routed run's selection)."""

    start: str
    end: str
    slot: Slot
    out_index: int | None
    routed: torch.Tensor
    inner: tuple = ()  # (block, output index) of each block before the last: their outputs may be read after it
    ends: torch.Tensor | None = None  # (B, N') which positions of the last block's output hold routed tokens
    inner_ends: dict = field(default_factory=dict)  # the same for each inner block's output
    stream: torch.Tensor | None = None  # the stream at the route's start (the values put back at its end)


@dataclass
class _Masks:
    """What the NaN run found, and the second run replays: per attention call inside a route, in call order,
    the key positions to ignore (bool (B, S))."""

    calls: list[torch.Tensor] = field(default_factory=list)
    active: int = 0  # routes open now
    replay: bool = False
    at: int = 0
    leaked: bool = False


class _MaskedAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` inside a route with the routed tokens' keys ignored: as torch's own function
    (`torch.nn.functional.scaled_dot_product_attention` for the while, which torch's multi-head attention, diffusers'
    and transformers' attention call by that name), and as a torch function a caller holds a reference to."""

    def __init__(self, masks: _Masks):
        super().__init__()
        self.masks = masks
        self.sdpa = F.scaled_dot_product_attention

    def __enter__(self):
        F.scaled_dot_product_attention = self.attend
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.sdpa
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.sdpa:
            return self.attend(*args, **kwargs)
        return func(*args, **kwargs)

    def attend(self, *args, **kwargs):
        if not self.masks.active:
            return self.sdpa(*args, **kwargs)
        call = _SDPA.bind(*args, **kwargs)
        call.apply_defaults()
        query, key, value = call.arguments["query"], call.arguments["key"], call.arguments["value"]
        rest = {k: v for k, v in call.arguments.items() if k not in ("query", "key", "value")}
        if self.masks.replay:
            ignored = self.masks.calls[self.masks.at]
            self.masks.at += 1
        else:
            ignored = key.isnan().flatten(0, -3).any(-1).reshape(*key.shape[:-2], key.shape[-2])
            ignored = ignored.reshape(-1, *ignored.shape[-1:]) if ignored.dim() > 1 else ignored[None]
            ignored = ignored.view(key.shape[0], -1, key.shape[-2]).any(1) if key.dim() > 2 else ignored
            self.masks.calls.append(ignored)
        return written_out_attention(query, key, value, **rest, ignored=ignored)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`scaled_dot_product_attention`'s signature, to read a call however it passes its arguments."""


_SDPA = inspect.signature(_sdpa)


def masked_reference(model: nn.Module, original, routes: list[tuple[str, str, Slot, int | None, torch.Tensor]],
                     args: tuple, kwargs: dict, seed: int) -> tuple[Any, int] | str:
    """The model's output with `routes` done by masking (the module docstring), and how many attention calls
    were masked; or why the reference does not apply. `original(*args, **kwargs)` runs the model's original
    forward; `routes` is, per route, (first block, last block, stream slot, output index, routed (B, N) bool,
    (block, output index) of each block before the last)."""
    masks = _Masks()
    plan = [_Route(*r) for r in routes]
    try:
        _run(model, original, plan, masks, args, kwargs, seed, poison=True)
    except _NoKeys as err:
        return str(err)
    if masks.leaked or not masks.calls:
        return ("the routed blocks mix tokens other than by scaled_dot_product_attention (a convolution, a scan, "
                "attention written out), so masking keys does not make a reference" if masks.calls else
                "the routed blocks call no scaled_dot_product_attention, so masking keys does not make a reference")
    masks.replay = True
    out = _run(model, original, plan, masks, args, kwargs, seed, poison=False)
    return out, len(masks.calls)


class _NoKeys(Exception):
    pass


def _run(model: nn.Module, original, routes: list[_Route], masks: _Masks, args: tuple, kwargs: dict, seed: int,
         poison: bool) -> Any:
    handles = []
    for route in routes:
        handles.append(model.get_submodule(route.start).register_forward_pre_hook(
            _enter(route, masks, poison), with_kwargs=True))
        handles.append(model.get_submodule(route.end).register_forward_hook(_leave(route, masks, poison)))
        handles += [model.get_submodule(name).register_forward_hook(_put_back(route, name, index, poison))
                    for name, index in route.inner]
    try:
        torch.manual_seed(seed)
        with _MaskedAttention(masks):
            return original(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def _enter(route: _Route, masks: _Masks, poison: bool):
    def hook(module, args, kwargs):
        masks.active += 1
        # the stream's parameter, as this call passes it (a checkpointed call passes by position what the
        # example passed by name)
        slot = slot_named(module, [*range(len(args)), *kwargs], route.slot)
        if slot is None:
            raise _NoKeys(f"{route.start} is called without its stream {route.slot!r} on this call")
        stream = args[slot] if isinstance(slot, int) else kwargs[slot]
        route.stream = stream
        if not poison:
            return None
        flagged = route.routed.to(stream.device)[..., None].expand_as(stream)
        poisoned = stream.masked_fill(flagged, float("nan"))
        if isinstance(slot, int):
            return (*args[:slot], poisoned, *args[slot + 1:]), kwargs
        return args, {**kwargs, slot: poisoned}
    return hook


def _leave(route: _Route, masks: _Masks, poison: bool):
    def hook(module, args, output):
        masks.active -= 1
        out = output if route.out_index is None else output[route.out_index]
        if poison:
            route.ends = out.isnan().any(-1)
            if int(route.ends.sum()) != int(route.routed.sum()):
                masks.leaked = True  # NaN reached tokens the route keeps (or never left the ones it routes)
            return None
        return _restored(output, route.out_index, route.ends, route)
    return hook


def _put_back(route: _Route, name: str, index: int | None, poison: bool):
    """A forward hook on a block inside the route, before its last: its output with the routed tokens at their
    value at the route's start (their positions found in the NaN run)."""
    def hook(module, args, output):
        out = output if index is None else output[index]
        if poison:
            route.inner_ends[name] = out.isnan().any(-1)
            return None
        ends = route.inner_ends.get(name)
        if ends is None or int(ends.sum()) != int(route.routed.sum()):
            return None  # tokens mixed by more than attention: the last block's check says so
        return _restored(output, index, ends, route)
    return hook


def _restored(output: Any, index: int | None, ends: torch.Tensor, route: _Route) -> Any:
    """A block's `output` with the stream in it (at `index`, or the output itself) holding, at the positions `ends`,
    the routed tokens' values at the route's start."""
    out = output if index is None else output[index]
    restored = out.clone()
    restored[ends] = route.stream[route.routed.to(route.stream.device)].to(out.dtype)
    if index is None:
        return restored
    items = list(output)
    items[index] = restored
    return type(output)(items) if not hasattr(output, "_fields") else type(output)(*items)


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]

"""Plan → block-call hooks: boundary mode, for owners whose forward cannot be traced.

The same plan as the graph rewrite, placed at the block calls instead of into a graph. A forward pre-hook on
block `start` selects and gathers the stream, pre-hooks on the route's blocks gather their per-token side
inputs, and a forward hook on block `end` scatters the kept tokens back. The hooks sit on the model's own
blocks (and patch embedding, whose output gives the grid), and act only inside the routed model's training
forward: anywhere else (eval, a call of the block itself) they pass everything through unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .decision import Plan
from .errors import ConfigError
from .findings import BlockInfo, Gather, SideInput
from .graphs import Slot
from .plan import suggestion
from .record import grid_of_call
from .routing import gather_tokens, joined_index, joined_stream, resolve_keep, route_side, scatter_tokens, static_tokens
from .values import TensorMeta


class Hooks:
    """The executor of boundary mode: hooks that place a plan's routes at block calls, and what one
    routed forward carries between them."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.handles: list = []  # the hooks on the model's modules, removed by `detach`
        self.routes: list[nn.Module] = []  # each route's selector
        self.original = None  # the model's forward as it was before the routes
        self.active = False
        self._clear()

    def _clear(self) -> None:
        self.selects: list[nn.Module] = []  # the selectors of the model running now
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grid_source: tuple[int, ...] | None = None  # the grid of the grid module's output on this forward
        self.call: tuple[tuple, dict] = ((), {})
        self.made: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # a routed block's output: (it,
        # the route's full stream, its index), to put back where the forward returns it (hidden states per layer);
        # a list matched by identity, not a dict by id(), which torch.compile cannot carry out of its graph

    def grid(self, stream: torch.Tensor) -> tuple[int, ...] | None:
        """The grid of this forward, for grid selectors: the grid of the grid module's output, else the grid the call
        gives where the analysis measured it on the example's (`findings.CallGrid`): it follows the image's size."""
        rule = self.plan.report.call_grid if self.plan.measured_grid else None
        if not rule:
            return self.grid_source
        grid = grid_of_call(rule, *self.call, stream.shape[0])
        self.plan.check_grid_found(stream.shape[1], grid)
        return grid

    def keep(self, route: int, stream: torch.Tensor, grid: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The positions route `route` keeps on this forward where the stream is not the example's length (None:
        the plan's): the positions given, resolved against this stream, or the special tokens the example call
        showed, where this call's grid leaves as many tokens besides the image's. Refused where it leaves others
        (a caption of another length): boundary mode found them on the example call and cannot find them again."""
        placed = self.plan.placed[route]
        stack = self.plan.report.stack_of(placed.start)
        tokens = stream.shape[1]
        if tokens == stack.tokens or not placed.keep:
            return None
        if placed.route.keep is not None:
            return resolve_keep(placed.route.keep, tokens)
        cells = math.prod(grid) if grid is not None else None
        if cells is not None and tokens - cells != len(stack.special):
            raise ConfigError(
                f"route {route}: this call's stream holds {tokens - cells} tokens besides the {cells} of its image's "
                f"grid, where the example inputs' held {len(stack.special)} ({suggestion(stack.special)}: text, "
                "class or register tokens every route keeps); boundary mode found them on the example call and "
                "cannot find them again: call the model with as many (captions of the example's length; where the "
                "model packs them by their mask, as Lumina2 does, as many unmasked tokens in the longest), or give "
                "the route keep=[...] covering the longest caption"
            )
        return resolve_keep(stack.special, tokens)

    def __call__(self, routed: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The original forward with the routes live, choosing tokens with `routed`'s own selectors (verify runs a
        copy of the routed model whose selectors keep every token)."""
        self.active, self.selects = True, self.routes
        self.call = (args, kwargs)
        try:
            out = self.original(*args, **kwargs)
            made = self.made  # the routed blocks' outputs the forward returns (transformers' hidden states per
            # layer) are put back like the stream: the routed tokens at their value at the route's start
            if not made:
                return out

            def put_back(v):
                found = next((m for m in made if m[0] is v), None) if isinstance(v, torch.Tensor) else None
                return v if found is None else scatter_tokens(found[1], found[2], v)

            return pytree.tree_map(put_back, out)
        finally:
            self.active = False
            self._clear()

    def attach(self, model: nn.Module, selects: list[nn.Module], original) -> None:
        """Hook the plan's routes onto `model`'s blocks as its containers hold them (a block compiled with
        `torch.compile(block)` is hooked on its wrapper: the hooks run around the compiled call); `original`
        is the model's forward without routes, which a routed training call runs with the hooks live."""
        self.routes, self.original = selects, original
        report = self.plan.report

        def hooked(qualname: str) -> tuple[nn.Module, Any]:
            # A block compiled in place (`block.compile()`) runs its hooks inside its compiled call: kept out of
            # it (run eagerly around the compiled forward), so the block's graph is its own, one per token count
            module = model.get_submodule(qualname)
            return module, (torch._dynamo.disable if module._compiled_call_impl is not None else lambda hook: hook)

        for k, route in enumerate(self.plan.placed):
            blocks = report.blocks[route.start:route.end + 1]
            for block in blocks:
                module, outside = hooked(block.qualname)
                self.handles.append(module.register_forward_hook(outside(_Made(self, k, block))))
            module, outside = hooked(blocks[-1].qualname)
            after = module.register_forward_hook(outside(_After(self, k)))
            self.handles.append(after)
            for block in blocks:
                before = _Before(self, k, block, block is blocks[0], after.id if block is blocks[-1] else None)
                module, outside = hooked(block.qualname)
                self.handles.append(module.register_forward_pre_hook(outside(before), with_kwargs=True))
        if report.grid_node and self.plan.placed and not self.plan.grid_given:
            self.handles.append(model.get_submodule(report.grid_node).register_forward_hook(_GridSource(self)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __getstate__(self):  # hook handles hold the modules weakly and do not pickle: hooked again on load
        return {**self.__dict__, "handles": []}

    def route_sides(self, route: int, block: BlockInfo, stream: torch.Tensor, index: torch.Tensor, args: tuple,
                    kwargs: dict):
        placed = self.plan.placed[route]
        for side in block.side_inputs:
            cuts = placed.cuts(side, block.stack)
            if not cuts:
                _check_unforeseen(side, args, kwargs, block, stream.shape[1])
                continue
            value = _get(args, kwargs, side.slot, block)
            if value is None:  # absent on this call (a mask the owner passes only where captions differ in length)
                continue
            if id(value) not in self.gathered:  # once per value and forward, kept alive with it
                self.gathered[id(value)] = (value, route_side(value, stream, index, cuts, placed.shared))
            cut = self.gathered[id(value)][1]
            if block.compiled:  # as the rewrite does: each token count compiled static (`routing.static_tokens`)
                static_tokens(cut, tuple((g.path, g.axes if g.batched or placed.shared else tuple(a + 1 for a in g.axes))
                                         for g in cuts if isinstance(g, Gather)))
            args, kwargs = _put(args, kwargs, side.slot, cut)
        if block.compiled:
            slot = self.plan.report.stack_of(block.index).stream_slot
            static_tokens(_get(args, kwargs, slot, block))
        return args, kwargs


class _Before:
    """Forward pre-hook on a route's block: at `start` select and gather the stream; gather side inputs.

    On the route's last block it also moves the scatter (`after`, a forward hook id) behind every forward hook
    registered since: a user's hook on that block then sees the block's own output, the kept tokens, as it
    does in graph mode, where the scatter is a graph node after the block call."""

    def __init__(self, hooks: Hooks, route: int, block: BlockInfo, first: bool, after: int | None = None):
        self.hooks, self.route, self.block, self.first, self.after = hooks, route, block, first, after

    def __call__(self, module, args, kwargs):
        hooks = self.hooks
        if not hooks.active:
            return None
        registered = module._forward_hooks
        if self.after is not None and self.after in registered and list(registered)[-1] != self.after:
            registered.move_to_end(self.after)  # only when a hook came since: under torch.compile, a graph break
        slot = hooks.plan.report.stack_of(self.block.index).stream_slot
        if self.first:
            hooks.gathered = {}
            stream = _get(args, kwargs, slot, self.block)
            grid = hooks.grid(stream)
            index = hooks.selects[self.route](stream, grid, hooks.keep(self.route, stream, grid))
            hooks.pending[self.route] = (stream, index)
            args, kwargs = _put(args, kwargs, slot, gather_tokens(stream, index))
        elif self.route not in hooks.pending:
            return None
        elif hooks.plan.report.stack_of(self.block.index).first == self.block.index:  # into the next stack
            hooks.pending[self.route] = _joined(hooks.plan.report, self.block.stack, _get(args, kwargs, slot, self.block),
                                                *hooks.pending[self.route])
        stream, index = hooks.pending[self.route]
        return hooks.route_sides(self.route, self.block, stream, index, args, kwargs)


def _joined(report, stack: int, joint: torch.Tensor, full: torch.Tensor, index: torch.Tensor):
    """A route's (full-size stream, index) in the next stack, whose stream `joint` the owner made of the kept
    tokens (at the stack's `joined_at`) and tokens of its own around them (`routing.joined_stream`)."""
    this, before = report.stacks[stack], report.stacks[stack - 1]
    if joint is full or (this.joined_at == 0 and joint.shape[1] == index.shape[1] and this.tokens == before.tokens):
        return full, index  # the stacks hand the stream on as it is
    return (joined_stream(joint, full, index, this.joined_at),
            joined_index(index, this.joined_at, before.tokens, this.tokens))


class _Made:
    """Forward hook on a route's block: its stream output (the kept tokens) noted, with the route's full stream and
    index there, so that where the forward returns it, it is put back like the stream (`Hooks.__call__`)."""

    def __init__(self, hooks: Hooks, route: int, block: BlockInfo):
        self.hooks, self.route, self.block = hooks, route, block

    def __call__(self, module, args, output):
        hooks = self.hooks
        if not hooks.active or self.route not in hooks.pending:
            return None
        position = hooks.plan.report.stack_of(self.block.index).stream_out_index
        made = output if position is None else output[position]
        if isinstance(made, torch.Tensor):
            hooks.made.append((made, *hooks.pending[self.route]))
        return None


class _After:
    """Forward hook on a route's last block: the kept tokens rejoin the stream as it was at the route start."""

    def __init__(self, hooks: Hooks, route: int):
        self.hooks, self.route = hooks, route

    def __call__(self, module, args, output):
        if not self.hooks.active or self.route not in self.hooks.pending:
            return None
        stream, index = self.hooks.pending.pop(self.route)
        plan = self.hooks.plan
        position = plan.report.stack_of(plan.placed[self.route].end).stream_out_index
        if position is None:
            return scatter_tokens(stream, index, output)
        items = list(output)
        items[position] = scatter_tokens(stream, index, items[position])
        if isinstance(output, list):
            return items
        return type(output)(*items) if hasattr(output, "_fields") else tuple(items)


class _GridSource:
    """Forward hook on the patch embedding: the grid of this forward, for grid selectors (its output's
    (B, C, H, W) or (B, C, T, H, W) spatial sizes)."""

    def __init__(self, hooks: Hooks):
        self.hooks = hooks

    def __call__(self, module, args, output):
        if self.hooks.active and isinstance(output, torch.Tensor) and output.dim() in (4, 5):
            self.hooks.grid_source = tuple(output.shape[2:])


def _check_unforeseen(side: SideInput, args: tuple, kwargs: dict, block: BlockInfo, tokens: int) -> None:
    """Refuse a tensor as long as the stream where the example call passed no tensor (Lumina2 passes its blocks an
    attention mask only where captions differ in length): boundary mode learned how a route cuts each block input
    on the example call, so it cannot tell whether this one carries the stream's tokens, and the block would
    see it whole beside the kept tokens. An input nothing cuts may be left out of a call: nothing to check."""
    if any(isinstance(v, TensorMeta) for v in pytree.tree_leaves(side.meta)):
        return
    slot = side.slot
    value = (args[slot] if slot < len(args) else None) if isinstance(slot, int) else kwargs.get(slot)
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and tokens in leaf.shape[1:]:
            name = side.argument if side.argument is not None else side.slot
            raise ConfigError(
                f"{block.qualname} takes a tensor {str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)} as "
                f"{name!r} on this call, where the example call passed {side.describe()}: boundary mode learned how a "
                "route cuts each block input on the example call and cannot tell whether this one carries the "
                "stream's tokens. Give example inputs on which it is a tensor too (an attention mask the model "
                "passes only where captions differ in length: an example batch whose captions do)"
            )


def _get(args: tuple, kwargs: dict, slot: Slot, block: BlockInfo):
    try:
        return args[slot] if isinstance(slot, int) else kwargs[slot]
    except (IndexError, KeyError):
        raise ConfigError(
            f"{block.qualname} was called without its argument {slot!r}, which it had on the example inputs; "
            "boundary mode routes calls made the way the example inputs made them"
        ) from None


def _put(args: tuple, kwargs: dict, slot: Slot, value: torch.Tensor) -> tuple[tuple, dict]:
    if isinstance(slot, int):
        return (*args[:slot], value, *args[slot + 1:]), kwargs
    return args, {**kwargs, slot: value}

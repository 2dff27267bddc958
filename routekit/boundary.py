"""Boundary mode: routes placed at block calls, for models whose owner forward cannot be traced.

Graph mode rewrites an fx trace of the owner's forward, the code around the blocks. Some owners do
not trace: they pass objects fx cannot hold (a generation cache), branch on tensor values, or call
code fx does not see through. Boundary mode needs only that the blocks are called:

1. `record`: the model runs once on the example inputs with hooks on every member of every
   ModuleList/Sequential. Each outermost member call becomes a node of a small fx graph whose
   arguments link to earlier calls' outputs by tensor identity; other tensors are placeholders and
   what the model returns is the output node. The same analysis as graph mode reads that graph:
   block stack, stream, per-token side inputs, block outputs that escape the chain.
2. `apply_boundary`: the routed model gets private copies of the modules on the path to each routed
   block (sharing parameters and buffers, so state_dict is unchanged and the user's model gets no
   hooks). A forward pre-hook on block `start` selects and gathers the stream, pre-hooks on the
   route's blocks gather their per-token side inputs, and a forward hook on block `end` scatters
   the kept tokens back. The hooks act only inside the routed model's training forward, so eval is
   the original forward, untouched.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .analysis import BlockInfo, GraphReport, Slot, analyse
from .config import DAR, Route, coerce_routes
from .errors import ConfigError, InputError
from .model import (
    _STATE,
    RoutedModel,
    RoutekitState,
    _check_finite,
    _checked_grid,
    _dry_run,
    _routed_class,
    check_plan,
    training_mode,
)
from .ops import gather_tokens, scatter_tokens
from .trace import CallSpec, Trace, container_members, describe, flatten, preserved_state, shallow_copy, user_location


class BoundaryRoutedModel(RoutedModel):
    """Mixin before the model's class: the original forward, with route hooks live while training."""

    def forward(self, *args, **kwargs):
        if not self.training:
            return self._routekit_base.forward(self, *args, **kwargs)
        with self._routekit_boundary.running():
            out = self._routekit_base.forward(self, *args, **kwargs)
        if self._routekit_check_finite:
            _check_finite(out, self._routekit_routes)
        return out


@dataclass
class _Call:
    qualname: str
    args: tuple
    kwargs: dict
    output: Any = None


def record(model: nn.Module, args: tuple, kwargs: dict) -> tuple[Trace, list[tuple[int, str, tuple[int, ...]]]]:
    """Run `model` once and build the graph of its outermost container-member calls.

    Also returns the 4-D outputs of every module as (calls made before it, module name, shape), from
    which the token grid is read.
    """
    members = container_members(model)
    calls: list[_Call] = []
    active: list[str] = []
    images: list[tuple[int, str, tuple[int, ...]]] = []
    handles = []

    def before(name):
        def hook(module, a, kw):
            if not active:
                calls.append(_Call(name, a, kw))
            active.append(name)

        return hook

    def after(module, a, out):
        active.pop()
        if not active:
            calls[-1].output = out

    def image(name):
        def hook(module, a, out):
            if isinstance(out, torch.Tensor) and out.dim() == 4:
                images.append((len(calls), name, tuple(out.shape)))

        return hook

    for name, module in model.named_modules():
        if name in members:
            handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
            handles.append(module.register_forward_hook(after))
        handles.append(module.register_forward_hook(image(name)))
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    try:
        with preserved_state(model, tensors):
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


def _call_graph(calls: list[_Call], out: Any) -> Trace:
    graph = fx.Graph()
    nodes: dict[int, fx.Node] = {}

    def node_of(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in nodes:
            nodes[id(value)] = graph.placeholder(f"input_{len(nodes)}")
            nodes[id(value)].meta["rk"] = describe(value)
        return nodes[id(value)]

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


def _grid(report: GraphReport, images, first_call: int) -> tuple[tuple[int, int] | None, str | None]:
    """The last 4-D (batch, C, H, W) module output before the first block with 0 < H·W <= tokens.

    With H·W < tokens the stream holds other tokens too, whose positions the call boundary does not
    show: a route's `keep` must name them (a grid selector then picks among the H·W others).
    """
    batch, tokens = report.stream.shape[:2]
    for calls_before, name, shape in reversed(images):
        if calls_before <= first_call and shape[0] == batch and 0 < shape[2] * shape[3] <= tokens:
            return (shape[2], shape[3]), name
    return None, None


def analyse_boundary(model: nn.Module, args: tuple, kwargs: dict, stack: str | None, reason: str | None):
    """The GraphReport of boundary mode (and the recorded call graph and grid module), in train mode."""
    with training_mode(model, True):
        tr, images = record(model, args, kwargs)
    report = analyse(tr, model, stack)
    report.mode, report.fallback = "boundary", reason
    first = [n.name for n in tr.graph.nodes if n.op == "call_module"].index(report.blocks[0].node)
    report.grid, report.grid_node = _grid(report, images, first)
    return report, tr, report.grid_node


def apply_boundary(model: nn.Module, routes, residual: DAR | None, args: tuple, kwargs: dict, *, grid, stack,
                   generator, check_finite: bool, reason: str | None) -> nn.Module:
    """`routekit.apply` in boundary mode: the same routes, placed by hooks at the route's block calls."""
    if residual is not None:
        raise ConfigError(
            "residual=DAR(...) rewrites the residual adds of a traced graph and needs graph mode, but "
            f"{type(model).__name__}.forward does not trace ({reason or 'mode=boundary was asked for'})"
        )
    report, tr, grid_module = analyse_boundary(model, args, kwargs, stack, reason)
    if grid is not None:
        report.grid, grid_module = _checked_grid(grid, report), None
    routes = coerce_routes(routes, report.depth)
    with training_mode(model, True):
        check_plan(model, report, routes, args, kwargs)
        report.routes = routes
        routed = shallow_copy(model, cls=_routed_class(type(model), BoundaryRoutedModel))
        routed.add_module(_STATE, RoutekitState(routes, grid))
        hooks = BoundaryHooks(report, routes, grid_module)
        routed.__dict__.update(
            _routekit_routes=routes, _routekit_grid=grid, _routekit_stack=stack, _routekit_report=report,
            _routekit_check_finite=check_finite, _routekit_programs={}, _routekit_residual=None,
            _routekit_boundary=hooks,
        )
        for select in getattr(routed, _STATE).routes:
            select.generator = generator
        hooks.attach(routed)
        _dry_run(routed, tr, args, kwargs)
    routed.train(model.training)
    return routed


class BoundaryHooks:
    """The hooks that place routes at block calls, and what one routed forward carries between them."""

    def __init__(self, report: GraphReport, routes: list[Route], grid_module: str | None):
        self.report, self.routes, self.grid_module = report, routes, grid_module
        self.paths: list[str] = []  # modules the routed model holds private copies of
        self.hook_ids: dict[str, list[int]] = {}
        self.selects: list[nn.Module] = []
        self.active = False
        self._clear()

    def _clear(self) -> None:
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grid_source: torch.Tensor | None = None

    @contextlib.contextmanager
    def running(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self._clear()

    def attach(self, routed: nn.Module) -> None:
        self.selects = list(getattr(routed, _STATE).routes)
        for k, route in enumerate(self.routes):
            blocks = self.report.blocks[route.start:route.end + 1]
            for block in blocks:
                module = self._private(routed, block.qualname)
                handle = module.register_forward_pre_hook(_Before(self, k, block, block is blocks[0]), with_kwargs=True)
                self.hook_ids.setdefault(block.qualname, []).append(handle.id)
            handle = self._private(routed, blocks[-1].qualname).register_forward_hook(_After(self, k))
            self.hook_ids[blocks[-1].qualname].append(handle.id)
        if self.grid_module and self.routes:
            handle = self._private(routed, self.grid_module).register_forward_hook(_GridSource(self))
            self.hook_ids.setdefault(self.grid_module, []).append(handle.id)

    def detach(self, plain: nn.Module) -> None:
        """Give `plain` (a copy of the routed model) private copies of the hooked modules, without routekit's hooks."""
        for path in list(self.paths):
            self._private(plain, path, fresh=True)
            module = plain.get_submodule(path)
            for attr, hooks in module.__dict__.items():
                if "hook" in attr and isinstance(hooks, dict):
                    for hook_id in self.hook_ids.get(path, []):
                        hooks.pop(hook_id, None)

    def _private(self, root: nn.Module, qualname: str, fresh: bool = False) -> nn.Module:
        """`root`'s own copy of the module at `qualname`, copying every module on the path once."""
        module, path = root, ""
        for atom in qualname.split(".") if qualname else []:
            path = f"{path}.{atom}" if path else atom
            if fresh or path not in self.paths:
                module._modules[atom] = _own_copy(module._modules[atom])
                if path not in self.paths:
                    self.paths.append(path)
            module = module._modules[atom]
        return module

    def gather_sides(self, block: BlockInfo, index: torch.Tensor, args: tuple, kwargs: dict):
        for side in block.side_inputs:
            if side.kind != "per-token":
                continue
            value = _get(args, kwargs, side.slot, block)
            if not isinstance(value, torch.Tensor):
                continue
            if id(value) not in self.gathered:  # one gather per tensor and forward, kept alive with it
                self.gathered[id(value)] = (value, gather_tokens(value, index))
            args, kwargs = _put(args, kwargs, side.slot, self.gathered[id(value)][1])
        return args, kwargs


class _Before:
    """Forward pre-hook on a route's block: at `start` select and gather the stream; gather side inputs."""

    def __init__(self, hooks: BoundaryHooks, route: int, block: BlockInfo, first: bool):
        self.hooks, self.route, self.block, self.first = hooks, route, block, first

    def __call__(self, module, args, kwargs):
        hooks = self.hooks
        if not hooks.active:
            return None
        slot = hooks.report.stream_slot
        if self.first:
            hooks.gathered = {}
            stream = _get(args, kwargs, slot, self.block)
            index = hooks.selects[self.route](stream, hooks.grid_source)
            hooks.pending[self.route] = (stream, index)
            args, kwargs = _put(args, kwargs, slot, gather_tokens(stream, index))
        elif self.route not in hooks.pending:
            return None
        return hooks.gather_sides(self.block, hooks.pending[self.route][1], args, kwargs)


class _After:
    """Forward hook on a route's last block: the kept tokens rejoin the stream as it was at the route start."""

    def __init__(self, hooks: BoundaryHooks, route: int):
        self.hooks, self.route = hooks, route

    def __call__(self, module, args, output):
        if not self.hooks.active or self.route not in self.hooks.pending:
            return None
        stream, index = self.hooks.pending.pop(self.route)
        position = self.hooks.report.stream_out_index
        if position is None:
            return scatter_tokens(stream, index, output)
        items = list(output)
        items[position] = scatter_tokens(stream, index, items[position])
        if isinstance(output, list):
            return items
        return type(output)(*items) if hasattr(output, "_fields") else tuple(items)


class _GridSource:
    """Forward hook on the patch embedding: the grid of this forward, for grid selectors."""

    def __init__(self, hooks: BoundaryHooks):
        self.hooks = hooks

    def __call__(self, module, args, output):
        if self.hooks.active and isinstance(output, torch.Tensor) and output.dim() == 4:
            self.hooks.grid_source = output


def _own_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` (same parameters, buffers, children) with its own hook tables."""
    copy = shallow_copy(module)
    for attr, value in module.__dict__.items():
        if "hook" in attr and isinstance(value, dict):
            copy.__dict__[attr] = type(value)(value)
    return copy


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

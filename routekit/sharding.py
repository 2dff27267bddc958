"""FSDP2 units for a routed model: which modules to shard together, so each block is gathered once.

FSDP gathers a unit's parameters in forward hooks of the unit's modules, so a unit must be made of
modules whose forward runs. Routes keep the blocks' own forward calls: the blocks are the units, as
accelerate's transformer auto-wrap policy makes them. DAR inlines the blocks into one graph: a block's
forward never runs, the graph calls its layers one by one. FSDP2 groups a list of modules into one unit
(`fully_shard([a, b, ...])`): it gathers at the first one's forward, frees after the last one's, gathers
again for backward when the last one's output gets its gradient, and reduces the gradients when the first
one's inputs get theirs. So the layers with parameters that DAR calls in a block make that block's unit,
provided those four points bracket every one of them: each layer is called once, reads the first layer's
output and feeds the last layer's input (checked on the block's own graph; DAR's aggregations only add
data flow between them). A block where that does not hold gets one unit per layer: still sharded, still
correct, gathered once per layer. Parameters the block reads directly rather than through a layer
(`get_attr`) stay with the root unit, which `shard` adds last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .errors import ConfigError, InputError
from .state import unwrap_compiled


def fsdp_units(routed: nn.Module) -> list[list[nn.Module]]:
    """The FSDP units of a model returned by `routekit.apply`, in block order, each a list of modules to
    pass to one `fully_shard` call: the blocks themselves with routes alone; with DAR, per block the
    layers the rewritten graph calls in it (see the module docstring), or the block where DAR calls it
    whole (its residual adds hidden inside)."""
    routed = unwrap_compiled(routed)[0]
    routing = routed.__dict__.get("forward") if isinstance(routed, nn.Module) else None
    plan = getattr(routing, "plan", None)
    if plan is None:
        raise InputError(f"fsdp_units takes a model routed by routekit.apply, got {type(routed).__name__} without "
                         "routes")
    units = []
    for info in plan.report.blocks:
        block = routed.get_submodule(info.qualname)
        if plan.dar is None or not info.adds:
            units.append([block])
            continue
        layers = _called_layers(block, info.body.graph)
        if _one_unit_serves(block, layers, info.body.graph):
            units.append([block.get_submodule(name) for name in layers])
        else:
            units.extend([block.get_submodule(name)] for name in layers)
    return [unit for unit in units if any(True for _ in _parameters(unit))]


def shard(routed: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
    """Apply FSDP2 to a model returned by `routekit.apply`: `fully_shard` on each of `fsdp_units(routed)`,
    then on the whole model (the root unit: embeddings, output layer, DAR's queries). Keyword arguments
    go to every `fully_shard` call (mesh, mp_policy, offload_policy, reshard_after_forward), except that the
    root keeps torch's own choice of `reshard_after_forward` (False: backward needs it first). Returns the
    model, sharded in place; `accelerate.prepare` then leaves its wrapping as it is."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    inner = unwrap_compiled(routed)[0]
    if isinstance(inner, FSDPModule) or any(isinstance(m, FSDPModule) for m in inner.modules()):
        raise InputError("shard takes a model no FSDP unit has been applied to yet: it makes every unit itself")
    for unit in fsdp_units(inner):
        fully_shard(unit if len(unit) > 1 else unit[0], **fully_shard_kwargs)
    fully_shard(inner, **{k: v for k, v in fully_shard_kwargs.items() if k != "reshard_after_forward"})
    return routed


def _parameters(unit: list[nn.Module]):
    for module in unit:
        yield from module.parameters()


def _called_layers(block: nn.Module, graph: fx.Graph) -> list[str]:
    """The modules with parameters the block's graph calls, in the order of their first call."""
    names = [n.target for n in graph.nodes if n.op == "call_module"]
    return [name for name in dict.fromkeys(names) if any(True for _ in block.get_submodule(name).parameters())]


def _one_unit_serves(block: nn.Module, layers: list[str], graph: fx.Graph) -> bool:
    """Whether one FSDP unit of `layers` gathers and frees them at the right times (module docstring):
    no layer inside another, each called once, every call downstream of the first and upstream of the last."""
    if len(layers) < 2:
        return True
    if any(a != b and b.startswith(a + ".") for a in layers for b in layers):
        return False
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in layers]
    if len(calls) != len(layers):
        return False
    first, last = calls[0], calls[-1]
    after_first = _reachable(first, lambda n: n.users)
    before_last = _reachable(last, lambda n: n.all_input_nodes)
    return all(n in after_first and n in before_last for n in calls)


def _reachable(start: fx.Node, step) -> set[fx.Node]:
    seen, stack = {start}, [start]
    while stack:
        for n in step(stack.pop()):
            if n not in seen:
                seen.add(n)
                stack.append(n)
    return seen


def check_sharding(routed: nn.Module, called: Callable[[], frozenset[str]]) -> None:
    """A rewritten graph calls only the modules in `called`: it traces through the rest (the owner's own
    layers, and with DAR the blocks and their non-leaf layers), so a module whose own forward no longer runs
    cannot carry an FSDP unit (its parameters would never be gathered: FSDP2
    fails deep inside a matmul on mixed Tensor/DTensor, FSDP1 on a missing attribute) nor an activation
    checkpoint (nothing would be recomputed). Accepted: `routekit.shard`'s units (`routekit.sharding.fsdp_units`:
    per block, the layers DAR calls in it, grouped), single called layers, and the whole model. Any other
    group of several modules is refused too: FSDP gathers a group at its first module's forward and frees
    it after its last, which only routekit's units are checked to fit. `called` gives the modules the graphs call;
    it is asked only in a distributed run (a union over every program, which torch.compile would otherwise trace
    at every call)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    _check_units(routed, called())


@torch.compiler.disable  # plain Python over the module tree, once per call: a graph break, not a trace
def _check_units(routed: nn.Module, called: frozenset[str]) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    runs = set()  # the modules whose forward runs: the root, those the graph calls, and what a called wrapper wraps
    for module in (routed, *(routed.get_submodule(name) for name in called)):
        runs.add(id(module))
        while isinstance(module, ActivationWrapper):  # accelerate checkpoints a block, then shards what it wraps
            module = module._checkpoint_wrapped_module
            runs.add(id(module))
    fix = ("use routekit.shard(model) before accelerate.prepare: one unit per block, made of the layers DAR calls "
           "in it (routekit.sharding.fsdp_units(model) lists them). Shard the whole model as one unit "
           "(fully_shard(model); accelerate: fsdp_auto_wrap_policy NO_WRAP) or single leaf layers such as nn.Linear "
           "to shard it yourself")
    units = None
    for name, module in routed.named_modules():
        if isinstance(module, ActivationWrapper) and id(module) not in runs:
            raise ConfigError(
                f"{name} is wrapped for activation checkpointing, but with DAR routekit runs the blocks' layers from "
                f"one graph and never calls {name}'s forward, so nothing would be recomputed. Turn activation "
                "checkpointing off for DAR models (accelerate: fsdp_activation_checkpointing: false)"
            )
        if not isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            continue
        if id(module) not in runs:
            raise ConfigError(
                f"{name} is an FSDP unit, but routekit's graph never calls {name}'s forward (it traces through it; "
                "with DAR, through the blocks too), so its parameters would not be gathered. To shard per block, "
                f"{fix}"
            )
        group = getattr(module._get_fsdp_state(), "_modules", (module,)) if isinstance(module, FSDPModule) else ()
        if len(group) > 1:
            if units is None:
                units = {frozenset(map(id, unit)) for unit in fsdp_units(routed)}
            if frozenset(map(id, group)) not in units:
                raise ConfigError(
                    f"{name} is in an FSDP unit of {len(group)} modules that is not one of routekit's units: FSDP "
                    "gathers a group at its first module's forward and frees it after its last, which DAR's graph "
                    f"is only checked to fit for routekit's units. To shard per block, {fix}"
                )

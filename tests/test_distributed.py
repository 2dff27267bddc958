"""Routes and DAR under DDP and FSDP2: two processes (gloo, CPU) against one.

DDP and FSDP both average the gradients of the ranks' parts of the batch. The reference is one process
that takes each step on both parts, each with its rank's route draws (a route's generator is reseeded
per step and rank in both), and averages their losses: the same arithmetic, so the losses, the trained
weights and the EMA must agree to float rounding. DDP runs without find_unused_parameters, so a DAR
parameter left without a gradient would fail its second step. FSDP shards with `routekit.shard`: for
DAR, one unit per block made of the layers DAR calls in it; the test counts the all-gathers a step
issues and holds them to the un-routed model's (the blocks as units, as accelerate wraps them).

The recipes' FSDP pieces that need no accelerate launch (the sharded EMA and the full-state checkpoint)
run in the same processes; `accelerate`'s FSDP plugin itself needs GPUs (it refuses CPU processes), so
`benchmarks/scaling.py --loss-check` covers the recipe end to end there.
"""

from __future__ import annotations

import copy
import faulthandler
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import routekit as rk
from backbones import dit
from routekit.model import report_of
from routekit.sharding import fsdp_units

WORLD, PART, STEPS = 2, 2, 3  # processes, samples per process, optimiser steps
TOL = dict(rtol=2e-5, atol=2e-6)


# --- models --------------------------------------------------------------------------------------------------


def tiny_dit() -> nn.Module:
    """A 3-block DiT whose adaLN-Zero layers are not zero, so every block and gate matters from the first step."""
    torch.manual_seed(0)
    model = dit.build("S/2", depth=3, hidden=32, heads=2, input_size=8, num_classes=10, class_dropout=0.0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0, 0.1)
                module.bias.normal_(0, 0.02)
    return model


class GatedBlock(nn.Module):
    """Its last layer (the gate) reads only the conditioning, so the first layer's output never reaches it: one
    FSDP unit of the block's layers would be gathered for backward when the gate's output gets its gradient,
    which nothing orders before fc1's and fc2's backward. routekit gives each layer its own unit here."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x))) * torch.sigmoid(self.gate(c)).unsqueeze(1)


class GatedNet(nn.Module):
    def __init__(self, d: int = 16, depth: int = 3):
        super().__init__()
        self.embed, self.cond, self.out = nn.Linear(4, d), nn.Linear(1, d), nn.Linear(d, 4)
        self.blocks = nn.ModuleList([GatedBlock(d) for _ in range(depth)])

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h, c = self.embed(x), self.cond(t[:, None])
        for block in self.blocks:
            h = block(h, c)
        return self.out(h)


KINDS = {  # name: (model, routes, DAR query)
    "vanilla": ("dit", False, None),
    "route": ("dit", True, None),
    "static": ("dit", False, "static"),
    "static+route": ("dit", True, "static"),
    "static_t+route": ("dit", True, "static_t"),
    "dynamic": ("dit", False, "dynamic"),
    "gated": ("gated", True, "static"),
}
DDP_KINDS = ["route", "static", "static_t+route", "dynamic"]
FSDP_KINDS = ["vanilla", "route", "static+route", "dynamic", "gated"]


def batch(kind: str, step: int, rank: int | None = None) -> tuple[torch.Tensor, ...]:
    """Step `step`'s batch of the whole world, or rank `rank`'s part of it; the target is the last tensor."""
    g = torch.Generator().manual_seed(step)
    n = WORLD * PART
    if KINDS[kind][0] == "gated":
        tensors = (torch.randn(n, 8, 4, generator=g), torch.rand(n, generator=g))
    else:
        tensors = (torch.randn(n, 4, 8, 8, generator=g), torch.rand(n, generator=g),
                   torch.randint(0, 10, (n,), generator=g))
    tensors = (*tensors, tensors[0].flip(0))
    return tensors if rank is None else tuple(t[rank * PART:(rank + 1) * PART] for t in tensors)


def build(kind: str) -> tuple[nn.Module, torch.Generator]:
    """The kind's model (routed unless vanilla) and the generator its routes draw from."""
    arch, routed, query = KINDS[kind]
    generator = torch.Generator()
    if arch == "gated":
        torch.manual_seed(0)
        model = GatedNet()
    else:
        model = tiny_dit()
    if kind == "vanilla":
        return model, generator
    example = batch(kind, 0, 0)[:-1]
    routes = [rk.Route(start=1, end=2, rate=0.5)] if routed else None
    residual = rk.DAR(query=query, chunk=2, kernel="torch") if query else None
    return rk.apply(model, routes=routes, residual=residual, example_inputs=example, generator=generator), generator


def loss(model: nn.Module, generator: torch.Generator, kind: str, step: int, rank: int) -> torch.Tensor:
    *inputs, target = batch(kind, step, rank)
    generator.manual_seed(1000 * step + rank)  # the rank's route draws, the same in both runs
    return (model(*inputs) - target).pow(2).mean()


def optimiser(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


EMA_DECAY = 0.5


def reference(kind: str) -> dict:
    """One process: per step, both ranks' parts with their route draws, losses averaged."""
    from recipes.train import update_ema

    model, generator = build(kind)
    ema = copy.deepcopy(model)
    opt = optimiser(model)
    losses = []
    for step in range(STEPS):
        parts = [loss(model, generator, kind, step, rank) for rank in range(WORLD)]
        total = sum(parts) / WORLD
        total.backward()
        opt.step()
        opt.zero_grad()
        update_ema(ema, model, EMA_DECAY)
        losses.append(total.item())
    return {"losses": losses, "weights": {k: v.detach() for k, v in model.state_dict().items()},
            "ema": {k: v.detach() for k, v in ema.state_dict().items()}}


# --- the two processes ---------------------------------------------------------------------------------------


def _worker(rank: int, strategy: str, kinds: list[str], folder: str) -> None:
    # a worker killed by a signal (gloo has aborted one: "terminate called without an active exception") prints
    # where each of its threads was, into the fixture's captured stderr
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        out = {kind: _train(rank, strategy, kind) for kind in kinds}
        if rank == 0:
            torch.save(out, f"{folder}/results.pt")
    finally:
        dist.destroy_process_group()


def _train(rank: int, strategy: str, kind: str) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from recipes.train import ShardedEMA, full_state, load_full_state

    model, generator = build(kind)
    ema = copy.deepcopy(model)  # before sharding: FSDP modules refuse deepcopy
    gathers = []
    if strategy == "ddp":
        net = nn.parallel.DistributedDataParallel(model)  # find_unused_parameters=False, the default
    else:
        if kind == "vanilla":  # accelerate's transformer auto-wrap: each block, then the root
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        else:
            rk.shard(model)
        net = model
        all_gather = _fsdp_param_group.foreach_all_gather

        def counted(*args, **kwargs):
            gathers[-1] += 1
            return all_gather(*args, **kwargs)

        _fsdp_param_group.foreach_all_gather = counted
        averaged = ShardedEMA(ema, net)
    opt = optimiser(net)
    losses = []
    try:
        for step in range(STEPS):
            gathers.append(0)
            value = loss(net, generator, kind, step, rank)
            value.backward()
            opt.step()
            opt.zero_grad()
            if strategy == "ddp":
                from recipes.train import update_ema

                update_ema(ema, model, EMA_DECAY)
            else:
                averaged.update(net, EMA_DECAY)
            value = value.detach()
            dist.all_reduce(value)
            losses.append(value.item() / WORLD)
    finally:
        if strategy != "ddp":
            _fsdp_param_group.foreach_all_gather = all_gather
    out = {"losses": losses, "gathers": gathers}
    if strategy == "ddp":
        out["weights"] = {k: v.detach() for k, v in model.state_dict().items()}
        out["ema"] = {k: v.detach() for k, v in ema.state_dict().items()}
        return out
    averaged.gather(net)
    out["ema"] = {k: v.detach() for k, v in ema.state_dict().items()}
    out["units"] = [len(unit) for unit in fsdp_units(model)] if kind != "vanilla" else None
    weights, opt_state = full_state(net, opt)
    out["weights"] = weights
    # the checkpoint path: the full state loaded into a freshly sharded model gives the same weights back
    shared = copy.deepcopy([weights, opt_state])  # loading turns the dicts' tensors into DTensors in place
    dist.broadcast_object_list(shared, src=0)
    fresh, _ = build(kind)
    if kind == "vanilla":
        for block in fresh.blocks:
            fully_shard(block)
        fully_shard(fresh)
    else:
        rk.shard(fresh)
    fresh_opt = optimiser(fresh)
    load_full_state(fresh, fresh_opt, *shared)
    reloaded, reloaded_opt = full_state(fresh, fresh_opt)
    out["reloaded"] = reloaded
    out["reloaded_opt_matches"] = rank != 0 or _same(reloaded_opt, opt_state)
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def spawn(strategy: str, kinds: list[str], folder: Path) -> dict:
    """Train each kind in two fresh processes; rank 0's results."""
    mp.start_processes(_worker, args=(strategy, kinds, str(folder)), nprocs=WORLD, start_method="spawn")
    return torch.load(folder / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return spawn("ddp", DDP_KINDS, tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    return spawn("fsdp", FSDP_KINDS, tmp_path_factory.mktemp("fsdp"))


def _close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("kind", DDP_KINDS)
def test_ddp_trains_routes_and_every_dar_query_as_one_process_does(ddp_runs, kind):
    """Without find_unused_parameters: every parameter (DAR's queries included) gets a gradient each step."""
    run, expected = ddp_runs[kind], reference(kind)
    torch.testing.assert_close(run["losses"], expected["losses"], **TOL)
    _close(run["weights"], expected["weights"])
    _close(run["ema"], expected["ema"])


@pytest.mark.parametrize("kind", FSDP_KINDS)
def test_fsdp2_with_routekits_units_trains_as_one_process_does(fsdp_runs, kind):
    """Losses, trained weights (read back as a full state dict) and the sharded EMA (gathered) match the
    one-process run; the full state loads into a freshly sharded model and reads back the same."""
    run, expected = fsdp_runs[kind], reference(kind)
    torch.testing.assert_close(run["losses"], expected["losses"], **TOL)
    _close(run["weights"], expected["weights"])
    _close(run["ema"], expected["ema"])
    _close(run["reloaded"], run["weights"])
    assert run["reloaded_opt_matches"]


def test_routes_and_dar_gather_each_block_once_per_pass_like_the_unrouted_model(fsdp_runs):
    """One all-gather per unit forward and one for backward (the root's stays gathered): 2 x 3 blocks + 1. A DAR
    unit is the five layers with parameters DAR calls in a DiT block; the gated block's layers are one unit each,
    so its model gathers more."""
    vanilla = fsdp_runs["vanilla"]["gathers"]
    assert vanilla == [2 * 3 + 1] * STEPS
    for kind in ("route", "static+route", "dynamic"):
        assert fsdp_runs[kind]["gathers"] == vanilla, kind
    assert fsdp_runs["route"]["units"] == [1, 1, 1]
    assert fsdp_runs["static+route"]["units"] == fsdp_runs["dynamic"]["units"] == [5, 5, 5]
    assert fsdp_runs["gated"]["units"] == [1] * 9
    assert fsdp_runs["gated"]["gathers"] == [2 * 9 + 1] * STEPS


# --- units, and wrappings routekit refuses (one process) -----------------------------------------------------


def test_dar_units_are_the_layers_dar_calls_in_each_block_and_routes_units_the_blocks():
    routed, _ = build("static+route")
    names = {id(m): n for n, m in routed.named_modules()}
    units = [[names[id(m)] for m in unit] for unit in fsdp_units(routed)]
    assert units == [[f"blocks.{i}.{layer}" for layer in ("adaLN_modulation.1", "attn.qkv", "attn.proj", "mlp.fc1",
                                                            "mlp.fc2")] for i in range(3)]
    routes, _ = build("route")
    assert [unit for unit in fsdp_units(routes)] == [[block] for block in routes.blocks]
    gated, _ = build("gated")
    assert fsdp_units(gated) == [[getattr(b, n)] for b in gated.blocks for n in ("fc1", "fc2", "gate")]
    with pytest.raises(rk.InputError, match="routekit.apply"):
        fsdp_units(tiny_dit())


@pytest.fixture
def one_process(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wrap_blocks_for_checkpointing(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)


@pytest.mark.parametrize("wrapping, message", [
    ("blocks", r"blocks\.0 is an FSDP unit.*never calls blocks\.0's forward.*routekit\.shard\(model\)"),
    ("a group of its own", r"blocks\.0\.attn\.qkv is in an FSDP unit of 2 modules that is not one of routekit's.*"
                           r"routekit\.shard"),
    ("checkpointed blocks", r"blocks\.0 is wrapped for activation checkpointing.*fsdp_activation_checkpointing"),
])
def test_a_wrapping_dar_cannot_serve_is_refused_naming_routekits_shard(one_process, wrapping, message):
    from torch.distributed.fsdp import fully_shard

    routed, _ = build("static+route")
    inputs = batch("static+route", 0, 0)[:-1]
    if wrapping == "blocks":
        for block in routed.blocks:
            fully_shard(block)
    elif wrapping == "a group of its own":
        fully_shard([routed.blocks[0].attn.qkv, routed.blocks[0].attn.proj])
    else:
        _wrap_blocks_for_checkpointing(routed)
    routed.train()
    with pytest.raises(rk.ConfigError, match=message):
        routed(*inputs)


def test_shard_makes_every_unit_itself_and_routes_keep_per_block_checkpointing(one_process):
    """`shard` refuses a model that already has FSDP units; routes call the blocks, so activation checkpointing
    around them (as accelerate applies it) stays in force and the loss is unchanged."""
    from torch.distributed.fsdp import fully_shard

    routed, _ = build("static")
    fully_shard(routed.blocks[0].attn.qkv)
    with pytest.raises(rk.InputError, match="no FSDP unit"):
        rk.shard(routed)
    routes, generator = build("route")
    expected = loss(routes, generator, "route", 0, 0)
    _wrap_blocks_for_checkpointing(routes)
    rk.shard(routes)
    torch.testing.assert_close(loss(routes, generator, "route", 0, 0), expected, **TOL)


def test_routes_take_accelerates_per_block_units_inside_its_checkpoint_wrappers(one_process):
    """accelerate wraps each block for activation checkpointing first, then makes the wrapped block (matched by
    its class) a unit: the unit sits inside a wrapper the graph calls, so its forward runs and it is accepted."""
    from torch.distributed.fsdp import fully_shard

    routes, generator = build("route")
    expected = loss(routes, generator, "route", 0, 0)
    _wrap_blocks_for_checkpointing(routes)
    for wrapper in routes.blocks:
        fully_shard(wrapper._checkpoint_wrapped_module)
    fully_shard(routes)
    torch.testing.assert_close(loss(routes, generator, "route", 0, 0), expected, **TOL)


def _compiled_worker(rank: int, kinds: list[str], folder: str) -> None:
    """FSDP2 as the recipes shard (routes: accelerate's order, checkpoint wrapper then the block inside it as
    the unit; DAR: routekit's units), then `torch.compile` of the sharded model, as `recipes.train` does."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        out = {}
        for kind in kinds:
            model, generator = build(kind)
            if report_of(model).dar is None:
                _wrap_blocks_for_checkpointing(model)
                for wrapper in model.blocks:
                    fully_shard(wrapper._checkpoint_wrapped_module)
                fully_shard(model)
            else:
                rk.shard(model)
            net, opt, losses = torch.compile(model, backend="aot_eager"), optimiser(model), []
            for step in range(STEPS):
                value = loss(net, generator, kind, step, rank)
                value.backward()
                opt.step()
                opt.zero_grad()
                value = value.detach()
                dist.all_reduce(value)
                losses.append(value.item() / WORLD)
            out[kind] = losses
        if rank == 0:
            torch.save(out, f"{folder}/results.pt")
    finally:
        dist.destroy_process_group()


def test_a_compiled_fsdp2_model_with_routes_or_dar_trains_as_one_process_does(tmp_path):
    kinds = ["route", "static+route"]
    mp.start_processes(_compiled_worker, args=(kinds, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    got = torch.load(tmp_path / "results.pt", weights_only=False)
    for kind in kinds:
        torch.testing.assert_close(got[kind], reference(kind)["losses"], **TOL)


# --- the recipes' accelerate FSDP2 path, as far as a CPU goes ----------------------------------------------------


def fsdp_plugin(monkeypatch, *launch_args: str):
    """The FSDP plugin `accelerate launch --config_file recipes/configs/accelerate/fsdp2.yaml ...` gives a process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "accelerate" / "fsdp2.yaml"
    args = launch_command_parser().parse_args(["--config_file", str(config), *launch_args, "-m", "recipes.train", "r"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])  # as accelerate's state does in a GPU process
    return plugin


def test_the_shipped_accelerate_config_is_fsdp2_in_bf16_with_per_block_units_and_checkpointing(monkeypatch):
    plugin = fsdp_plugin(monkeypatch)
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == ["DiTBlock"]
    assert plugin.activation_checkpointing and plugin.reshard_after_forward
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert not fsdp_plugin(monkeypatch, "--fsdp_activation_checkpointing", "false").activation_checkpointing


def test_the_recipes_shard_dar_models_into_routekits_units_and_leave_others_to_accelerate(one_process, monkeypatch):
    """DAR: routekit's units with the plugin's settings, before prepare, and never with activation checkpointing
    (the message says how to turn it off); routes and vanilla: untouched, for accelerate's own per-block wrapping."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule

    from recipes.config import ConfigError
    from recipes.train import fsdp_shard

    with_checkpointing = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=fsdp_plugin(monkeypatch)))
    routed, _ = build("static+route")
    with pytest.raises(ConfigError, match="--fsdp_activation_checkpointing false"):
        fsdp_shard(with_checkpointing, routed)
    plugin = fsdp_plugin(monkeypatch, "--fsdp_activation_checkpointing", "false")
    acc = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    for kind in ("route", "vanilla"):
        model, _ = build(kind)
        assert fsdp_shard(acc, model) is model and not any(isinstance(m, FSDPModule) for m in model.modules())
    sharded = fsdp_shard(acc, routed)
    assert isinstance(sharded, FSDPModule) and isinstance(sharded.blocks[2].mlp.fc2, FSDPModule)
    assert sharded.blocks[0].attn.qkv.weight.dtype == torch.float32  # sharded fp32, gathered in the plugin's bf16
    assert sharded._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16


if os.name != "posix":  # the file:// store and spawn as used here
    pytest.skip("distributed tests run on POSIX", allow_module_level=True)

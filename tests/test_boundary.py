"""Boundary mode, tracing robustness, wrappers and persistence.

Boundary mode places the same route ops as graph mode with hooks at the block calls, for owners whose
forward does not trace. Its laws: apply falls back to it by itself and says so; it routes exactly like
graph mode (same selection, same outputs, same gradients); eval is the original forward; the user's own
model gets no hooks; strip, pickling and verify work as in graph mode.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import routekit as rk
from routekit.model import original_forward, report_of, routing_of

DIM, GRID = 8, (4, 4)


class Cache:
    """A plain Python object handed to every block (like a generation cache): fx cannot hold it in a graph."""

    def __init__(self):
        self.calls = 0


class Block(nn.Module):
    """Takes the stream by keyword, a per-token mask, a per-sample scale, a cache; returns (stream, aux)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, DIM)

    def forward(self, x, mask=None, scale=None, cache=None):
        if cache is not None:
            cache.calls += 1
        y = self.proj(x) * torch.sigmoid(self.gate(x))
        if mask is not None:
            y = y * mask[..., None]
        if scale is not None:
            y = y * scale[:, None, None]
        return x + y, y.square().mean()


@dataclasses.dataclass
class Output:
    sample: torch.Tensor
    aux: torch.Tensor


class Owner(nn.Module):
    """A patch-embedding model whose forward fx can trace (`cache=False`) or not (`cache=True`: it also checks
    its input's values, control flow on tensor data that no trace can follow)."""

    def __init__(self, cache: bool, depth: int = 5):
        super().__init__()
        self.cache = cache
        self.embed = nn.Conv2d(3, DIM, 2, 2)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.head = nn.Linear(DIM, 3)

    def forward(self, image, scale=None, mask=None, return_dict: bool = True):
        if self.cache and not torch.isfinite(image).all():
            raise ValueError("the image has NaN or Inf")
        x = self.embed(image).flatten(2).transpose(1, 2)
        cache = Cache() if self.cache else None
        aux = 0.0
        for block in self.blocks:
            x, a = block(x=x, mask=mask, scale=scale, cache=cache)
            aux = aux + a
        out = self.head(x)
        return Output(out, aux) if return_dict else (out, aux)


def twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    untraceable = Owner(cache=True)
    traceable = Owner(cache=False)
    traceable.load_state_dict(untraceable.state_dict())
    return untraceable, traceable


def call(batch: int = 2) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1)
    image = torch.randn(batch, 3, 8, 8, generator=g)
    mask = (torch.rand(batch, GRID[0] * GRID[1], generator=g) > 0.2).float()
    return (image,), {"scale": torch.rand(batch, generator=g) + 0.5, "mask": mask}


ROUTES = [rk.Route(start=1, end=2, selector="row"), rk.Route(start=3, end=3, rate=0.25)]


def route(model: nn.Module, **options) -> nn.Module:
    args, kwargs = call()
    return rk.apply(model, ROUTES, example_inputs=args, example_kwargs=kwargs,
                    generator=torch.Generator().manual_seed(7), **options)


def test_apply_falls_back_to_boundary_mode_when_the_owner_does_not_trace_and_says_why() -> None:
    untraceable, _ = twins()
    args, kwargs = call()
    with pytest.raises(rk.TraceError, match="Owner.forward"):
        route(untraceable, mode="graph")
    routed = route(untraceable)
    report = report_of(routed)
    assert report.mode == "boundary" and "control flow depends on" in report.fallback
    assert "boundary mode" in str(report) and report.grid == GRID and report.grid_node == "embed"
    assert [s.kind for s in report.blocks[0].side_inputs if s.node] == ["per-token", "per-sample"]
    inspected = rk.inspect(untraceable, args, kwargs)
    assert inspected.mode == "boundary" and inspected.stack == "blocks" and inspected.stream_slot == "x"
    checked = rk.verify(untraceable, routed, args, kwargs)
    assert (checked.mode, checked.nodes, checked.outputs, checked.train, checked.compiled) == (
        "boundary", None, 2, "rate 0 bit-identical", None)
    assert checked.checks == ("eval", "train", "kept")  # its blocks call no attention: no masked reference


def test_boundary_mode_routes_exactly_like_graph_mode() -> None:
    untraceable, traceable = twins()
    args, kwargs = call()
    results = []
    for model, options in ((untraceable, {}), (traceable, {}), (traceable, {"mode": "boundary"})):
        routed = route(model, **options).train()
        out = routed(*args, **kwargs)
        (out.sample.square().mean() + out.aux).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        results.append((out, grads, [rk.last_route_mask(routed, k) for k in range(len(ROUTES))],
                        report_of(routed).mode))
    assert [r[3] for r in results] == ["boundary", "graph", "boundary"]
    for out, grads, masks, _ in results[1:]:
        torch.testing.assert_close(out.sample, results[0][0].sample, rtol=0, atol=0)
        torch.testing.assert_close(out.aux, results[0][0].aux, rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(masks, results[0][2]))
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads, results[0][1]))


def test_blocks_in_a_boundary_route_see_the_kept_tokens_and_their_gathered_mask() -> None:
    untraceable, _ = twins()
    routed = route(untraceable).train()
    seen = {}

    def record(i, kwargs):
        seen[i] = (kwargs["x"].shape[1], kwargs["mask"].shape[1])

    for i, block in enumerate(routed.blocks):  # hooks after routekit's: they see what the block gets
        block.register_forward_pre_hook(lambda m, a, kw, i=i: record(i, kw), with_kwargs=True)
    args, kwargs = call()
    routed(*args, **kwargs)
    assert seen == {0: (16, 16), 1: (8, 8), 2: (8, 8), 3: (12, 12), 4: (16, 16)}


def test_a_users_forward_hook_on_a_routes_last_block_sees_its_own_output_in_both_modes() -> None:
    """In graph mode the scatter is a node after the block call, so a hook on the route's last block sees (and
    may change) the block's output on the kept tokens; boundary mode's scatter hook must run after it too."""
    untraceable, traceable = twins()
    args, kwargs = call()
    results = []
    for model in (untraceable, traceable):
        routed = route(model).train()
        seen = {}

        def double(output, i, seen=seen):
            seen[i] = output[0].shape[1]
            return output[0] * 2, output[1]

        for i in (2, 3):  # the last blocks of the two routes; registered after apply, as a user would
            routed.blocks[i].register_forward_hook(lambda m, a, o, i=i: double(o, i))
        results.append((routed(*args, **kwargs).sample, seen, report_of(routed).mode))
    assert [r[2] for r in results] == ["boundary", "graph"]
    assert results[0][1] == results[1][1] == {2: 8, 3: 12}
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)


def test_the_hooks_act_only_in_a_routed_training_forward_and_eval_is_the_original_forward() -> None:
    """Boundary mode hooks the route's blocks of the model itself; the hooks pass everything through anywhere but
    in the routed model's training forward: a block called on its own, the original forward, eval."""
    untraceable, _ = twins()
    args, kwargs = call()
    torch.manual_seed(3)
    before = untraceable.train()(*args, **kwargs).sample
    routed = route(untraceable)
    assert routed is untraceable and any(b._forward_pre_hooks for b in routed.blocks)
    torch.manual_seed(3)
    assert not torch.equal(routed(*args, **kwargs).sample, before)  # routed
    with original_forward(routed):
        torch.manual_seed(3)
        assert torch.equal(routed(*args, **kwargs).sample, before)  # the hooks passed everything through
    x = torch.randn(2, 16, 8)
    got, want = routed.blocks[1](x), type(routed.blocks[1]).forward(routed.blocks[1], x)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)))
    with original_forward(routed):
        want = routed.eval()(*args, **kwargs).sample
    assert torch.equal(routed.eval()(*args, **kwargs).sample, want)


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_strip_gives_the_plain_model_with_the_same_weights_and_no_hooks(mode: str) -> None:
    _, traceable = twins()
    args, kwargs = call()
    routed = route(traceable, mode=mode)
    plain = rk.strip(routed)
    assert type(plain) is Owner and not hasattr(plain, "routekit")
    assert plain.state_dict().keys() == traceable.state_dict().keys()
    assert all(a is b for a, b in zip(plain.parameters(), traceable.parameters()))
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in plain.blocks)
    torch.manual_seed(0)
    want = traceable.train()(*args, **kwargs).sample
    torch.manual_seed(0)
    assert torch.equal(plain.train()(*args, **kwargs).sample, want)
    rk.apply(plain, ROUTES, example_inputs=args, example_kwargs=kwargs)  # routable again


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_a_routed_model_round_trips_through_torch_save_pickle_and_deepcopy(mode: str) -> None:
    _, traceable = twins()
    args, kwargs = call()
    routed = route(traceable, mode=mode)
    buffer = io.BytesIO()
    torch.save(routed, buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(routed)), copy.deepcopy(routed)]
    for loaded in copies:
        assert type(loaded) is type(routed) and report_of(loaded).mode == mode
        assert loaded.state_dict().keys() == routed.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), routed.state_dict().values()))
        for module in (routed, loaded):
            module.routekit.routes[0].generator = torch.Generator().manual_seed(5)
            module.routekit.routes[1].generator = torch.Generator().manual_seed(6)
        train = [m.train()(*args, **kwargs).sample for m in (routed, loaded)]
        assert torch.equal(*train)
        assert torch.equal(*[m.eval()(*args, **kwargs).sample for m in (routed, loaded)])
        assert rk.verify(traceable, routed, args, kwargs).mode == mode


def test_owner_forwards_with_keywords_none_defaults_and_tuple_or_dataclass_outputs_trace() -> None:
    _, traceable = twins()
    args, kwargs = call()
    for options in ({}, {"return_dict": False}, {"scale": None}, {"mask": kwargs["mask"]}):
        routed = rk.apply(traceable, ROUTES, example_inputs=args, example_kwargs=options)
        assert report_of(routed).mode == "graph"
        assert rk.verify(traceable, routed, args, options).mode == "graph"
        out = routed.train()(*args, **options)
        assert type(out) is (tuple if options.get("return_dict") is False else Output)


class DictOwner(Owner):
    def forward(self, image, scale=None, mask=None):
        out = super().forward(image, scale, mask)
        return {"sample": out.sample, "aux": [out.aux]}


def test_dict_outputs_and_compiled_blocks_route_in_graph_mode() -> None:
    torch.manual_seed(0)
    model = DictOwner(cache=False)
    model.blocks = nn.ModuleList([torch.compile(b, backend="eager") for b in model.blocks])
    args, kwargs = call()
    routed = rk.apply(model, ROUTES, example_inputs=args, example_kwargs=kwargs)
    assert report_of(routed).mode == "graph" and report_of(routed).blocks[0].cls == "OptimizedModule"
    assert rk.verify(model, routed, args, kwargs).mode == "graph"
    out = routed.train()(*args, **kwargs)
    assert set(out) == {"sample", "aux"} and out["sample"].shape == (2, 16, 3)


def test_a_torch_compiled_model_is_routed_inside_and_comes_back_compiled_the_same_way() -> None:
    _, traceable = twins()
    args, kwargs = call()
    compiled = torch.compile(traceable, backend="eager")
    routed = route(compiled)
    assert type(routed) is type(compiled) and routing_of(routed._orig_mod) is not None
    assert routed.dynamo_ctx is compiled.dynamo_ctx
    assert rk.verify(compiled, routed, args, kwargs).mode == "graph"
    routed.train()(*args, **kwargs).sample.sum().backward()
    assert rk.last_route_mask(routed).shape == (2, 16) and report_of(routed).depth == 5
    assert rk.inspect(routed).routes == ROUTES
    plain = rk.strip(routed)
    assert type(plain) is type(compiled) and type(plain._orig_mod) is Owner


def test_a_ddp_wrapped_model_is_refused_with_what_to_do(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(twins()[1])
        with pytest.raises(rk.InputError, match="DistributedDataParallel: apply routekit first"):
            route(wrapped)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_check_finite_raises_non_finite_error_in_a_routed_forward(mode: str) -> None:
    _, traceable = twins()
    args, kwargs = call()
    routed = route(traceable, mode=mode, check_finite=True).train()
    routed(*args, **kwargs)
    with torch.no_grad():
        traceable.blocks[1].proj.bias.fill_(float("nan"))
    with pytest.raises(rk.NonFiniteError, match="NaN/Inf"):
        routed(*args, **kwargs)


def test_inputs_on_another_device_than_the_model_are_refused_by_every_entry_point() -> None:
    _, traceable = twins()
    args, kwargs = call()
    routed = route(traceable)
    meta = tuple(a.to("meta") for a in args)
    for verb in (lambda: route(twins()[0].to("meta")), lambda: rk.apply(traceable, ROUTES, example_inputs=meta),
                 lambda: rk.inspect(traceable, meta), lambda: rk.verify(traceable, routed, meta)):
        with pytest.raises(rk.InputError, match="share a device"):
            verb()


def test_dar_needs_graph_mode() -> None:
    untraceable, _ = twins()
    with pytest.raises(rk.ConfigError, match="graph mode"):
        route(untraceable, residual=rk.DAR())


def test_mode_must_be_auto_graph_or_boundary() -> None:
    with pytest.raises(rk.ConfigError, match="'auto', 'graph' or 'boundary'"):
        route(twins()[1], mode="hooks")
    with pytest.raises(rk.ConfigError, match="'auto', 'graph' or 'boundary'"):
        rk.inspect(twins()[1], call()[0], mode="fx")



@dataclasses.dataclass
class _Context:
    """A context object a model hands its blocks, registered with pytree without key paths (the older API)."""

    bias: torch.Tensor


torch.utils._pytree.register_pytree_node(_Context, lambda c: ([c.bias], None), lambda xs, _: _Context(xs[0]))


class _ContextBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.f = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ctx: _Context) -> torch.Tensor:
        bias = ctx.bias if ctx.bias.dim() == 3 else ctx.bias[:, None]
        return x + self.f(x) + bias


class _ContextNet(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_ContextBlock(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx, x = _Context(c * 2), self.inp(x)
        for block in self.blocks:
            x = block(x, ctx)
        return x


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_a_pytree_registered_context_object_reaches_probes_as_values_and_a_per_token_one_is_refused(mode: str) -> None:
    torch.manual_seed(0)
    model, x = _ContextNet(), torch.randn(2, 32, 16)
    route = rk.Route(start=1, end=3, rate=0.5)
    per_sample = torch.randn(2, 16)
    report = rk.inspect(model, (x, per_sample), mode=mode)
    assert [s.kind for s in report.blocks[1].side_inputs] == ["per-sample"]  # its tensor, not a recorded node
    routed = rk.apply(model, route, example_inputs=(x, per_sample), mode=mode)
    assert rk.verify(model, routed, (x, per_sample)).train
    with pytest.raises(rk.ConfigError, match=r"cannot contain blocks\.1: its input 1 is an object \(_Context"):
        rk.apply(model, route, example_inputs=(x, torch.randn(2, 32, 16)), mode=mode)


class ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x, scale=None):
        return x + self.linear(x) * (1 if scale is None else scale[:, None, None])


class SometimesScaled(nn.Module):
    """Passes its blocks a per-sample scale only when it is given one."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 16, 2, 2)
        self.blocks = nn.ModuleList(ScaledBlock() for _ in range(6))

    def forward(self, image, scale=None):
        x = self.embed(image).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, scale=scale) if scale is not None else block(x)
        return x


def test_a_call_may_leave_out_a_block_input_no_route_cuts() -> None:
    """The example call passes a per-sample scale, a later call none: nothing cuts it, so boundary mode routes the
    call as it is (the check for tensors the example did not pass must not ask for one it did)."""
    model, image = SometimesScaled(), torch.randn(2, 3, 8, 8)
    routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=(image, torch.ones(2)), mode="boundary")
    routed.train()
    assert routed(image).shape == (2, 16, 16)
    assert rk.last_route_mask(routed).sum(1).tolist() == [8, 8]
    assert "kept" in rk.verify(model, routed, (image,)).checks

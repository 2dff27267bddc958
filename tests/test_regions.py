"""Shared block bodies (`DAR(regions=True)`, routekit/regions.py): one compile region per distinct block body.

Held here: eager, the shared graph gives the inlined graph's outputs and gradients bit for bit; under torch.compile
Dynamo traces each distinct body once and stamps it out for the other blocks (counted in the graph it hands the
backend), and the compiled step matches eager; a block whose code cannot be called safely as a function (an
in-place op, a value that may alias another at a segment's edge) stays inlined and still compiles.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import routekit as rk
from backbones import dit
from routekit import regions
from routekit.model import routing_of


def tiny_dit(depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return dit.build("S/2", depth=depth, hidden=32, heads=2, input_size=8, num_classes=10)


def train_graph(routed: nn.Module):
    (bucket,) = [b for (mode, _, _), b in routing_of(routed).executor.programs.items() if mode]
    (program,) = bucket.values()
    return program


def step(routed: nn.Module, args, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    routed.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = routed(*args)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in routed.parameters() if p.grad is not None]


def region_calls(routed: nn.Module) -> int:
    """How many calls of shared bodies the routed model's training program makes."""
    import inspect

    return inspect.getsource(train_graph(routed).fn).count("= routekit_regions_block_body")


@pytest.mark.parametrize("routes, shared_blocks", [(None, 3), ([rk.Route(start=1, end=2)], 4)],
                         ids=["dar", "dar+route"])
def test_a_dar_dit_runs_its_blocks_as_shared_bodies_bit_for_bit_as_inlined(routes, shared_blocks):
    """The blocks of a DAR DiT become two calls of shared bodies each (up to the attention's output, then the
    MLP's); without a route the first block's code is its own (its first sublayer reads the embedding, the others
    a merge with its norm folded in), with one it matches the routed blocks'. The step's output and every
    gradient equal those of the inlined graph, bit for bit."""
    model = tiny_dit()
    args = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    shared = rk.apply(copy.deepcopy(model), routes, residual=rk.DAR(chunk=4, regions=True), example_inputs=args)
    shared.train()
    inlined = rk.apply(copy.deepcopy(model), routes, residual=rk.DAR(chunk=4), example_inputs=args).train()
    expected = step(inlined, args)
    found = step(shared, args)
    assert region_calls(shared) == 2 * shared_blocks and region_calls(inlined) == 0
    assert torch.equal(found[0], expected[0])
    assert len(found[1]) == len(expected[1]) and all(torch.equal(a, b) for a, b in zip(found[1], expected[1]))


def test_under_torch_compile_each_distinct_body_is_traced_once_and_the_step_matches_eager():
    """Dynamo hands the backend one subgraph per distinct body and a call of it per block (the first block,
    whose code is its own, stays inlined); the compiled loss and gradients match the eager step's."""
    model = tiny_dit(depth=6)
    args = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    routed = rk.apply(model, residual=rk.DAR(chunk=4, regions=True), example_inputs=args).train()
    expected = step(routed, args)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    torch._dynamo.reset()
    try:
        found = step(torch.compile(routed, backend=backend, fullgraph=True), args)
    finally:
        torch._dynamo.reset()
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    bodies = {n.args[0].target for n in calls}
    assert len(calls) == 2 * 5 and len(bodies) == 2, (len(calls), bodies)  # blocks 1-5, two bodies each
    torch.testing.assert_close(found[0], expected[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(found[1], expected[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class InPlaceBlock(nn.Module):
    """A pre-norm block whose MLP activation runs in place."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(torch.relu_(self.fc1(self.norm2(x))))


class AliasingBlock(InPlaceBlock):
    """A block whose second sublayer reads a value that may be its input itself (`x.float()` of an fp32 x)."""

    def forward(self, x):
        h = self.attn(self.norm1(x)).float()
        x = x + h
        return x + self.fc2(self.fc1(self.norm2(x))) * h.float()


class Stack(nn.Module):
    def __init__(self, block: type, depth: int = 3, dim: int = 16):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(depth))

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("block", [InPlaceBlock, AliasingBlock])
def test_a_block_that_cannot_be_called_as_a_function_stays_inlined_and_compiles(block):
    """The twin of the DiT above: blocks with an in-place op, or whose segments would pass a value that may alias
    another, are left inlined (no region), so torch.compile never meets an aliasing region, and train as before."""
    torch.manual_seed(0)
    model = Stack(block)
    args = (torch.randn(2, 8, 16),)
    routed = rk.apply(model, residual=rk.DAR(chunk=2, regions=True), example_inputs=args).train()
    expected = step(routed, args)
    assert region_calls(routed) == 0
    torch._dynamo.reset()
    try:
        found = step(torch.compile(routed, backend="aot_eager", fullgraph=True), args)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(found[0], expected[0])


def test_views_crossing_a_segment_edge_are_made_again_inside_without_which_compile_refuses(monkeypatch):
    """DiT's adaLN chunks are views of one tensor, read by both sublayers: the second segment takes the chunked
    tensor and chunks it again itself. Passed in as they are, two views of one tensor alias, and torch.compile
    refuses the region (what the test above compiles is this rule at work)."""
    import inspect

    model = tiny_dit()
    args = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    routed = rk.apply(copy.deepcopy(model), residual=rk.DAR(chunk=4, regions=True), example_inputs=args).train()
    step(routed, args)
    bodies = {inspect.getsource(f.body) for k, f in train_graph(routed).fn.__globals__.items()
              if k.startswith("routekit_regions_block")}
    assert len(bodies) == 2 and all("chunk" in body for body in bodies), bodies

    monkeypatch.setattr(regions, "_remade", lambda node: False)
    monkeypatch.setattr(regions, "_fresh", lambda node, model: True)
    naive = rk.apply(model, residual=rk.DAR(chunk=4, regions=True), example_inputs=args).train()
    step(naive, args)  # eager, aliasing is harmless
    assert region_calls(naive) > 0
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="alias"):
            step(torch.compile(naive, backend="aot_eager", fullgraph=True), args)
    finally:
        torch._dynamo.reset()

"""The routed training graph is plain torch: torch.compile(fullgraph=True) takes it whole and matches eager.

Compiled and eager runs must select the same tokens: either the random selector under the same seed with
inductor's `fallback_random` (compiled RNG draws like eager), or a deterministic selector registered here.
CPU inductor compiles C++ for a minute or more on a cold cache, so the default backend is aot_eager
(dynamo capture + AOTAutograd forward/backward graphs); set RK_TEST_INDUCTOR=1 to also run inductor.
"""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import zoo

import routekit as rk
from backbones import dit
from routekit.model import report_of, routing_of


@rk.register_selector("test_checkerboard")
def checkerboard(batch: int, tokens: int, rate: float, *, grid=None, generator=None, device=None) -> torch.Tensor:
    """Deterministic: sample b keeps the tokens of parity b % 2 (rate is ignored; tokens is even here)."""
    return torch.arange(tokens, device=device).view(-1, 2)[:, 0] + (torch.arange(batch, device=device) % 2)[:, None]


BACKENDS = ["aot_eager", pytest.param("inductor", marks=[
    pytest.mark.slow, pytest.mark.skipif(not os.environ.get("RK_TEST_INDUCTOR"), reason="set RK_TEST_INDUCTOR=1")])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("selector, class_dropout", [("random", 0.1), ("test_checkerboard", 0.0)])
def test_compiled_routed_dit_matches_eager_in_train_mode(backend: str, selector: str, class_dropout: float) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = dit.build("S/2", depth=6, hidden=64, heads=2, input_size=8, num_classes=10,
                          class_dropout=class_dropout)
        with torch.no_grad():  # off adaLN-Zero, so outputs and gradients are not all zero
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        x, t, y = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
        routed = rk.apply(model, routes=[rk.Route(start=1, end=2, rate=0.5, selector=selector),
                                         rk.Route(start=3, end=4, rate=0.25, selector=selector)],
                          example_inputs=(x, t, y)).train()
        params = list(routed.parameters())

        def step(forward) -> tuple:
            image = x.clone().requires_grad_()
            torch.manual_seed(5)
            out = forward(image, t, y)
            grads = torch.autograd.grad(out.square().mean(), [image, *params])
            return out.detach(), grads, [s.last_index for s in routed.routekit.routes]

        torch._dynamo.reset()
        with mock.patch.object(torch._inductor.config, "fallback_random", True):
            compiled = step(torch.compile(routed, fullgraph=True, backend=backend))
        eager = step(routed)
    for c, e in zip(compiled[2], eager[2]):
        assert torch.equal(c, e), "compiled and eager must select the same tokens"
    assert compiled[0].abs().max() > 0
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    for c, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selector", ["random", "importance", "row", "window", "column"])
def test_a_compiled_routed_model_takes_a_second_batch_size(selector: str) -> None:
    """The last batch of an epoch is often smaller: the second batch size makes Dynamo's batch symbolic, and the
    selectors' draws must trace with it (torch's fake tensors refused `torch.rand(..., generator=None)`)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = dit.build("S/2", depth=4, hidden=32, heads=2, input_size=8, num_classes=10)
        routed = rk.apply(model, routes=[rk.Route(start=1, end=2, selector=selector)],
                          example_inputs=dit.example_inputs(model, 2)).train()
        torch._dynamo.reset()
        compiled = torch.compile(routed, backend="aot_eager")
        for batch in (4, 6, 3):
            x, t, y = dit.example_inputs(model, batch, generator=torch.Generator().manual_seed(batch))
            compiled(x, t, y).square().mean().backward()
            assert rk.last_route_mask(routed).shape == (batch, 16)


class ExternalDiT(torch.nn.Module):
    """A DiT as people write it outside this project: the owner reads the grid off the token count
    (`int(N ** 0.5)`, specialised when traced) and the blocks are plain modules."""

    def __init__(self, depth: int = 5, hidden: int = 32, patch: int = 2, channels: int = 4):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.embed = torch.nn.Conv2d(channels, hidden, patch, patch)
        self.time = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden))
        self.blocks = torch.nn.ModuleList(ExternalBlock(hidden) for _ in range(depth))
        self.head = torch.nn.Linear(hidden, patch * patch * channels)

    def forward(self, x, t):
        h = self.embed(x).flatten(2).transpose(1, 2)
        c = self.time(t[:, None])
        for block in self.blocks:
            h = block(h, c)
        h = self.head(h)
        side = int(h.shape[1] ** 0.5)
        h = h.reshape(h.shape[0], side, side, self.patch, self.patch, self.channels)
        return torch.einsum("nhwpqc->nchpwq", h).reshape(h.shape[0], self.channels, side * self.patch, side * self.patch)


class ExternalBlock(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.attn = torch.nn.MultiheadAttention(hidden, 2, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(2 * hidden, hidden))
        self.mod = torch.nn.Linear(hidden, hidden)

    def forward(self, x, c):
        h = self.norm1(x) * (1 + self.mod(c)[:, None])
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("variant", ["routes", "dar"])
def test_applied_at_batch_2_compiled_and_trained_at_another_batch(variant: str) -> None:
    """Apply with a batch-2 example, torch.compile the routed model, train three steps at a larger batch: the
    losses are those of the uncompiled routed model (CPU: aot_eager at batch 8; GPU: inductor at batch 256,
    bf16 autocast). A call at a new batch size never traces under Dynamo."""
    backend, batch = ("inductor", 256) if DEVICE == "cuda" else ("aot_eager", 8)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        models = [ExternalDiT().to(DEVICE) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        example = (torch.randn(2, 4, 8, 8, device=DEVICE), torch.rand(2, device=DEVICE))
        options = {"routes": [rk.Route(start=1, end=3, selector="test_checkerboard")]} if variant == "routes" \
            else {"residual": rk.DAR(chunk=2)}
        routed = [rk.apply(m, example_inputs=example, **options).train() for m in models]
        data = torch.Generator(DEVICE).manual_seed(3)
        batches = [(torch.randn(batch, 4, 8, 8, device=DEVICE, generator=data),
                    torch.rand(batch, device=DEVICE, generator=data)) for _ in range(3)]

        def losses(model) -> list[float]:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            out = []
            for x, t in batches:
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
                    loss = (model(x, t).float() - x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                out.append(loss.item())
            return out

        torch._dynamo.reset()
        compiled = losses(torch.compile(routed[0], backend=backend))
        eager = losses(routed[1])
    tolerance = 2e-2 if DEVICE == "cuda" else 1e-4  # bf16 autocast on the GPU
    assert compiled == pytest.approx(eager, rel=tolerance), (compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_blocks_compiled_one_by_one_are_compiled_once_per_token_count_and_stay_static(mode):
    """A DiT whose blocks are compiled on their own (as the official TREAD code ships it) meets two token counts
    in a route, all and the kept ones: each is compiled once, static (Dynamo's automatic dynamic shapes would
    compile a slower dynamic kernel for both), and inspect says what a compiled block sees. The blocks after the
    route see every token laid out contiguous (the route's scatter gives them so, as a hand-written one does),
    the blocks before it DiT's transposed patch embedding: a third graph, once."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = dit.build("S/2", depth=4, hidden=32, heads=2, input_size=8, num_classes=10, compile_blocks=True)
    args = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=args, mode=mode).train()
    for _ in range(3):
        routed(*args).square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 3  # per token count and layout, for all four blocks
    assert rk.last_route_mask(routed).sum(1).tolist() == [8, 8]  # routed in boundary mode too (the private copy
    # of a block.compile()'d block once ran the original's compiled call, which skipped the copy's routing hooks)
    plan = report_of(routed)
    assert "compiled: 16 and 8 tokens, each static" in str(plan)
    rk.verify(model, routed, args)
    torch._dynamo.reset()


def test_dar_over_blocks_compiled_one_by_one_says_it_runs_them_uncompiled(recwarn):
    """DAR inlines the blocks whose residual adds it rewrites, so blocks compiled on their own would run their code
    uncompiled in training: apply says so (FallbackWarning, naming the blocks and the fix) and inspect marks them.
    Its twins stay quiet: a route over the same compiled blocks (they keep their compiled calls), DAR over
    blocks that are not compiled, and DAR over a model compiled as a whole."""
    def build(compile_blocks: bool = False) -> dit.DiT:
        torch.manual_seed(0)
        return dit.build("S/2", depth=4, hidden=32, heads=2, input_size=8, num_classes=10,
                         compile_blocks=compile_blocks)

    compiled = build(compile_blocks=True)
    args = dit.example_inputs(compiled, 2, generator=torch.Generator().manual_seed(1))
    dar = rk.DAR(chunk=2)
    with pytest.warns(rk.FallbackWarning, match=r"blocks\.0 … blocks\.3 \(4 blocks\) run under torch.compile on "
                      r"their own.*uncompiled.*torch\.compile\(routed\)") as caught:
        routed = rk.apply(compiled, residual=dar, example_inputs=args)
    assert caught[0].filename == __file__  # it points at the user's apply call
    assert "compiled, DAR inlines it uncompiled" in str(report_of(routed))
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    routed.train()(*args).square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 0  # what the warning says: the blocks' compiled calls do not run
    recwarn.clear()
    quiet = [rk.apply(build(compile_blocks=True), rk.Route(start=1, end=2), example_inputs=args),
             rk.apply(build(), residual=dar, example_inputs=args),
             rk.apply(torch.compile(build()), residual=dar, example_inputs=args)]
    assert not [w for w in recwarn if issubclass(w.category, rk.FallbackWarning)]
    assert all("DAR inlines it uncompiled" not in str(report_of(q)) for q in quiet)
    torch._dynamo.reset()


@pytest.mark.parametrize("name, dar", [("transformers Llama", False), ("transformers GPT-2", False),
                                       ("diffusers LTX-Video (image to video)", False), ("transformers Llama", True)])
def test_a_routed_model_compiles_to_one_graph_where_the_model_does(name, dar):
    """Real models that compile whole compile whole routed, with fullgraph=True, step after step. A transformers
    LM makes its generation cache in the forward (use_cache is on by default, in training too), and the routed
    graph copies that cache's first state on every run: that copy was copy.deepcopy, on which Dynamo failed (an
    internal NameError), and each step now gets a cache of its own. LTX-Video's transformer class is marked
    allow_in_graph by diffusers, and reading its forward's signature under Dynamo was a graph break."""
    entry = zoo.ZOO[name]
    try:
        model, args, kwargs = entry.build()
    except zoo.Missing as err:
        pytest.skip(str(err))
    torch._dynamo.reset()
    routed = rk.apply(model, rk.Route(**entry.route), residual=rk.DAR(chunk=2) if dar else None, example_inputs=args,
                      example_kwargs=kwargs).train()
    compiled = torch.compile(routed, fullgraph=True, backend="aot_eager")
    outs = []
    for _ in range(2):
        out = compiled(*args, **kwargs)
        out[0].float().square().mean().backward()
        outs.append(out)
    if name.startswith("transformers"):
        assert model.config.use_cache
        assert outs[0].past_key_values is not None and outs[0].past_key_values is not outs[1].past_key_values
    torch._dynamo.reset()


@pytest.mark.parametrize("dar", [rk.DAR(chunk=2), rk.DAR(chunk=2, regions=True)], ids=["dar", "regions"])
def test_a_dar_model_compiles_to_one_graph_in_training_and_in_its_first_evaluation(dar):
    """DAR's eval forward is a program of its own: apply builds it, so the first evaluation of a model compiled
    with fullgraph=True finds it (building it there was a graph break, which fullgraph refuses)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = dit.build("S/2", depth=4, hidden=32, heads=2, input_size=8, num_classes=10)
    args = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    routed = rk.apply(model, rk.Route(start=1, end=2), residual=dar, example_inputs=args)
    assert {training for training, _, _ in routing_of(routed).executor.programs} == {True, False}
    compiled = torch.compile(routed, fullgraph=True, backend="aot_eager")
    compiled.train()(*args).square().mean().backward()
    with torch.no_grad():
        out = compiled.eval()(*args)
        assert torch.allclose(out, routed.eval()(*args), atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["graph", "boundary"])
@pytest.mark.parametrize("selector", ["random", "importance", "row", "window", "column"])
def test_a_routed_step_compiles_to_one_graph_with_no_host_sync_whatever_the_selector(selector, mode):
    """What CUDA graphs (`mode="reduce-overhead"`) need of a routed step: no read of a tensor's value on the host
    (it would break the graph, and fullgraph=True refuses a break), the selection drawn inside the graph; in
    boundary mode too, where the routes are hooks at the block calls."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = dit.build("S/2", depth=4, hidden=32, heads=2, input_size=8, num_classes=10)
    args = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    routed = rk.apply(model, rk.Route(start=1, end=2, selector=selector), example_inputs=args, mode=mode).train()
    compiled = torch.compile(routed, fullgraph=True, backend="aot_eager")
    compiled(*args).square().mean().backward()
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dar", [False, True])
def test_reduce_overhead_trains_a_routed_and_a_dar_model_under_cuda_graphs(dar):
    """Training steps as a loop makes them (gradients set to None before each backward: a gradient accumulated
    across CUDA-graph replays reads a buffer the next replay overwrote, routed or not) run under
    mode="reduce-overhead", draw a new selection each step inside the graph, and learn."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = dit.build("S/2", depth=4, hidden=64, heads=2, input_size=16, num_classes=10).cuda()
    args = dit.example_inputs(model, 8, generator=torch.Generator("cuda").manual_seed(1))
    target = torch.randn(args[0].shape, generator=torch.Generator("cuda").manual_seed(2), device="cuda")
    routed = rk.apply(model, rk.Route(start=1, end=2), residual=rk.DAR(chunk=2) if dar else None,
                      example_inputs=args).train()
    compiled = torch.compile(routed, mode="reduce-overhead")
    opt = torch.optim.AdamW(routed.parameters(), lr=1e-3)
    masks, losses = [], []
    for _ in range(8):
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = (compiled(*args).float() - target).square().mean()
        loss.backward()
        opt.step()
        masks.append(rk.last_route_mask(routed).clone())
        losses.append(loss.item())
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    assert not all(torch.equal(masks[0], m) for m in masks[1:])  # a new draw each step
    torch._dynamo.reset()

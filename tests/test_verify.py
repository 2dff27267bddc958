"""`verify` can fail: every way a routed model can differ from what was asked is a test that must see
InferenceChanged (eval) or TrainingChanged (the training forward); and it works on DAR models.

Also: apply, inspect and verify leave the user's model bit-identical (parameters, buffers, RNG state,
module modes, hooks), in graph and in boundary mode.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import D
from torch import nn

import routekit as rk
import routekit.placing
import routekit.rewrite
import routekit.routing
from backbones import dit
from routekit.errors import InferenceChanged
from routekit.model import Routing, report_of
from routekit.routing import gather_tokens
from routekit.verify import _compare

DIM = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, mask):
        return x + self.drop(self.fc(self.norm(x))) * mask[..., None]


class Owner(nn.Module):
    """Tokens through a BatchNorm (running statistics), blocks with a per-token mask, a Python scale read in
    the forward; `cache=True` makes the owner untraceable (boundary mode)."""

    def __init__(self, cache: bool = False, depth: int = 5):
        super().__init__()
        self.cache = cache
        self.scale = 1.5
        self.embed = nn.Linear(3, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x, mask):
        h = self.embed(x)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2) * self.scale
        calls = [] if self.cache else None
        for block in self.blocks:
            h = block(h, mask)
            if calls is not None:
                calls.append(object())  # a Python object fx cannot hold in a graph
                if len(calls) > len(self.blocks):
                    raise RuntimeError
        return self.head(h)


def example(batch: int = 3, tokens: int = 10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, tokens, 3, generator=g), (torch.rand(batch, tokens, generator=g) > 0.3).float()


def routed_owner(mode: str = "graph", **options):
    torch.manual_seed(0)
    model = Owner(cache=mode == "boundary")
    args = example()
    routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=args, mode=mode,
                      generator=torch.Generator().manual_seed(2), **options)
    return model, routed, args


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_verify_passes_and_checks_eval_train_and_the_kept_tokens(mode):
    model, routed, args = routed_owner(mode)
    checked = rk.verify(model, routed, args)
    assert checked.train == "rate 0 bit-identical" and "kept" in checked.checks and checked.outputs == 1


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_an_eval_that_differs_is_caught(mode, monkeypatch):
    """A routing whose eval forward is not the original's (planted: eval outputs doubled) fails the eval check."""
    model, routed, args = routed_owner(mode)
    call = Routing.__call__
    monkeypatch.setattr(Routing, "__call__", lambda self, *a, **k: call(self, *a, **k) * (
        1 if self.model.training or self.suspended else 2))
    with pytest.raises(rk.InferenceChanged, match="not bit-identical"):
        rk.verify(model, routed, args)


def dropping(block: str):
    """A rewrite that also drops `block`'s call from the training graph: a change verify must catch."""
    original = routekit.rewrite.place_routes

    def place_routes(graph, plan, selected, dropping=False):
        placed = original(graph, plan, selected, dropping)
        call = next(n for n in graph.nodes if n.op == "call_module" and n.target == block)
        call.replace_all_uses_with(call.args[0])
        graph.erase_node(call)
        return placed

    return place_routes


def test_a_training_graph_that_differs_from_the_original_forward_is_caught(monkeypatch):
    """A rewrite that changes more than the routes (here: one block's call dropped from the training graph)
    fails the rate-0 check."""
    monkeypatch.setattr(routekit.rewrite, "place_routes", dropping("blocks.4"))
    model, routed, args = routed_owner()
    with pytest.raises(rk.TrainingChanged, match="rate 0"):
        rk.verify(model, routed, args)


def test_a_route_that_gathers_the_wrong_tokens_is_caught(monkeypatch):
    """The route's first block must see the original inputs at the kept tokens. A gather that hands each
    sample another sample's selection is exact at rate 0 (every row is 0..N-1) and keeps every shape, so
    only the kept-token check can see it."""

    def other_samples(x, index):
        return gather_tokens(x, index.roll(1, dims=0))

    monkeypatch.setattr(routekit.placing, "gather_tokens", other_samples)
    model, routed, args = routed_owner()
    with pytest.raises(rk.TrainingChanged, match="input 'x'|input 0"):
        rk.verify(model, routed, args)


def test_a_side_input_left_ungathered_is_caught(monkeypatch):
    """A per-token side input (the mask) handed to the route's blocks at full size is caught, before it can
    fail or broadcast silently inside the block."""
    original = routekit.rewrite.place_routes

    def forgetting_side_inputs(graph, plan, selected, dropping=False):
        placed = original(graph, plan, selected, dropping)
        for node in graph.nodes:
            if node.op == "call_module" and node.target.startswith("blocks.") and len(node.args) > 1:
                mask = node.args[1]
                if mask.op == "call_function" and mask.target is routekit.placing.route_side:
                    node.update_arg(1, mask.args[0])
        return placed

    monkeypatch.setattr(routekit.rewrite, "place_routes", forgetting_side_inputs)
    with pytest.raises(rk.RoutekitError):
        model, routed, args = routed_owner()
        rk.verify(model, routed, args)


def tiny_dit(depth: int = 4):
    """A small DiT off its adaLN-Zero init (there every block's branches are gated to zero)."""
    torch.manual_seed(0)
    model = dit.build("S/2", depth=depth, hidden=32, heads=2, input_size=8, num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model, dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("routes", [None, [rk.Route(start=1, end=2)]])
def test_verify_works_on_dar_models(routes):
    model, args = tiny_dit()
    routed = rk.apply(model, routes=routes, residual=rk.DAR(chunk=2), example_inputs=args)
    with torch.no_grad():
        routed.routekit.dar.query.normal_(generator=torch.Generator().manual_seed(3))
    checked = rk.verify(model, routed, args)
    assert checked.nodes is None and checked.outputs == 1
    assert checked.train == (None if routes is None else "rate 0 matches DAR without routes (to rounding)")


def test_a_bf16_dar_model_with_a_route_left_routing_at_rate_0_fails_verify(monkeypatch):
    """DAR's rate-0 check allows rounding in the output's dtype (a few bf16 ulps: the zoo's bf16 test holds that
    real models' reordered sums pass), and no more: the routed program run at its real rate is still caught."""
    import importlib

    model, args = tiny_dit()
    model = model.to(torch.bfloat16)
    args = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)
    routed = rk.apply(model, routes=[rk.Route(start=1, end=2)], residual=rk.DAR(chunk=2), example_inputs=args)
    with torch.no_grad():
        routed.routekit.dar.query.normal_(generator=torch.Generator().manual_seed(3))
    assert rk.verify(model, routed, args).train == "rate 0 matches DAR without routes (to rounding)"
    monkeypatch.setattr(importlib.import_module("routekit.verify"), "_every_token", lambda routed: contextlib.nullcontext())
    with pytest.raises(rk.TrainingChanged, match="not close to DAR without routes"):
        rk.verify(model, routed, args)


def test_a_dar_program_never_goes_stale(monkeypatch):
    """An attribute the inlined attention reads, changed after the program was built, makes the program be
    traced again: its output is then the DAR graph traced afresh (verify passes), not the old one; and where
    the guard that notices is planted away, verify sees the stale program."""
    import routekit.guards as guards

    model, args = tiny_dit()
    routed = rk.apply(model, residual=rk.DAR(chunk=2), example_inputs=args)
    routed.eval()
    before = routed(*args)  # builds and caches the eval program
    routed.blocks[1].attn.heads = 1  # read by the traced attention
    assert not torch.equal(routed(*args), before)
    rk.verify(model, routed, args)
    routed.blocks[1].attn.heads = 2
    routed(*args)
    monkeypatch.setattr(guards.Assumptions, "broken", lambda self, root: None)
    routed.blocks[1].attn.heads = 1
    with pytest.raises(rk.InferenceChanged, match="DAR"):
        rk.verify(model, routed, args)


# --- apply changes the model's forward alone; inspect and verify leave it untouched ------------------------------


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "modes": {name: m.training for name, m in model.named_modules()},
        "hooks": {name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                  for name, m in model.named_modules()},
        "attributes": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "rng": torch.get_rng_state(),
        "grads": {k: p.grad for k, p in model.named_parameters()},
    }


def assert_same(before: dict, after: dict, *, parts=("modes", "hooks", "attributes", "grads")) -> None:
    assert before["state"].keys() == after["state"].keys()
    for key in before["state"]:
        assert torch.equal(before["state"][key], after["state"][key]), f"{key} changed"
    for part in parts:
        assert before[part] == after[part], part
    assert torch.equal(before["rng"], after["rng"]), "the global RNG moved"


@pytest.mark.parametrize("mode", ["graph", "boundary"])
@pytest.mark.parametrize("training", [True, False])
def test_apply_installs_routing_and_nothing_else_inspect_and_verify_change_nothing_strip_undoes_it(mode, training):
    """apply routes the model in place: its forward becomes the routing (and boundary mode hooks the route's
    blocks); its weights, buffers, modes, gradients and the global RNG stay as they were. inspect and verify
    change nothing; strip gives back the model exactly as it was."""
    torch.manual_seed(0)
    model = Owner(cache=mode == "boundary")
    model.train(training)
    model.blocks[2].eval()  # mixed modes must come back as they were
    args = example()
    before = snapshot(model)
    rk.inspect(model, args, routes=[rk.Route(start=1, end=3)], mode=mode)
    assert_same(before, snapshot(model))
    routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=args, mode=mode)
    assert routed is model and type(routed) is Owner
    applied = snapshot(model)
    assert_same(before, applied, parts=("modes", "grads"))
    assert applied["attributes"][""] == sorted({*before["attributes"][""], "forward", "routekit"})
    assert {k for k in applied["hooks"] if applied["hooks"][k] != before["hooks"][k]} == (
        {"blocks.1", "blocks.2", "blocks.3"} if mode == "boundary" else set())
    rk.verify(model, routed, args)
    assert_same(applied, snapshot(model))
    assert model.bn.num_batches_tracked.item() == 0
    rk.strip(routed)
    assert_same(before, snapshot(model))


def test_a_dar_apply_adds_its_queries_and_changes_nothing_else():
    model, args = tiny_dit()
    model.train()
    before = snapshot(model)
    twin = copy.deepcopy(model)
    routed = rk.apply(model, routes=[rk.Route(start=1, end=2)], residual=rk.DAR(chunk=2), example_inputs=args)
    rk.verify(model, routed, args)
    after = snapshot(model)
    assert set(after["state"]) - set(before["state"]) == {"routekit.dar.query"}
    assert all(torch.equal(before["state"][k], after["state"][k]) for k in before["state"])
    rk.strip(routed, drop_learned=True)
    assert_same(before, snapshot(model))
    torch.manual_seed(5)
    want = twin(*args)
    torch.manual_seed(5)
    assert torch.equal(model(*args), want)


# --- like with like: caches, compiled blocks, the CPU's kernels ------------------------------------------------

def _llama(**config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2, **config)
    return transformers.LlamaModel(config), (torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0)),)


def test_a_transformers_lm_with_its_cache_on_verifies_and_a_wrong_gather_in_it_is_still_caught(monkeypatch):
    """The default config fills a DynamicCache as it runs: each of verify's runs gets its own copy (the kept-token
    check once handed the block the cache its first run had filled, and called a correct model changed)."""
    model, args = _llama()
    assert model.config.use_cache
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=args)
    assert "kept" in rk.verify(model, routed, args).checks
    monkeypatch.setattr(routekit.placing, "gather_tokens", lambda x, index: gather_tokens(x, index.roll(1, dims=0)))
    with pytest.raises(rk.TrainingChanged, match="input"):
        rk.verify(model, rk.apply(model, rk.Route(start=1, end=2), example_inputs=args), args)


@pytest.mark.slow
def test_blocks_under_torch_compile_verify_by_running_eagerly_on_both_sides_and_train_compiled():
    """A DiT whose blocks are compiled one by one (as the official TREAD code ships it): verify runs the compiled
    blocks eagerly on both sides and says so (the routed program calls them at other shapes, where Dynamo compiles
    kernels that round otherwise); a planted change is still caught; a routed step runs through inductor."""
    torch.manual_seed(0)
    model = dit.build("S/2", depth=4, hidden=32, heads=2, input_size=8, num_classes=10, compile_blocks=True)
    args = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=args)
    checked = rk.verify(model, routed, args)
    assert checked.train == "rate 0 bit-identical" and "blocks.0" in checked.compiled
    routed.train()
    loss = routed(*args).square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    torch._dynamo.reset()


class DecoratedBlock(nn.Module):
    """A block whose class compiles its forward (`@torch.compile` on the method, as CompVis/tread's DiT block)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    @torch.compile(backend="eager")
    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def test_a_forward_compiled_on_its_class_is_a_compiled_region(monkeypatch):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(DecoratedBlock() for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 6, DIM)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))
    assert rk.verify(model, routed, (x,)).compiled.startswith("blocks.0, blocks.1, blocks.2 ...")
    monkeypatch.setattr(routekit.rewrite, "place_routes", dropping("blocks.3"))  # the planted change
    with pytest.raises(rk.TrainingChanged, match="rate 0"):
        rk.verify(model, rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,)), (x,))
    torch._dynamo.reset()


def test_rate_0_is_bit_identical_whatever_kernels_the_cpu_picks():
    """oneDNN rounds a convolution of a channels-last input otherwise than of a contiguous one on AVX2 CPUs (AMD
    EPYC's path; ONEDNN_MAX_CPU_ISA=AVX2 takes it on any x86 CPU): a route hands its blocks the stream laid out as
    the original does, so a route keeping every token is bit-identical on either path."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("oneDNN's ISA switch is x86's")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    test = "tests/test_positions.py::test_grid_sizes_handed_to_blocks_as_numbers_follow_the_kept_grid"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]


def test_a_route_lays_every_token_out_as_the_stream_is_and_fewer_contiguous():
    """Keeping every token (rate 0, where the bits must be the original's), the gather keeps the stream's layout;
    dropping some, it lays them out contiguous, as a hand-written gather does, and so does the scatter back."""
    stream = torch.randn(2, 5, 12).transpose(1, 2)  # (2, 12, 5), stored as (2, 5, 12): a patch embedding's view
    all_tokens = torch.arange(12).expand(2, 12)
    every = gather_tokens(stream, all_tokens)
    assert every.stride() == stream.stride() and torch.equal(every, stream)
    assert routekit.routing.scatter_tokens(stream, all_tokens, every).stride() == stream.stride()
    index = torch.tensor([[0, 3, 7], [1, 2, 11]])
    kept = gather_tokens(stream, index)
    assert kept.is_contiguous() and torch.equal(kept, torch.stack([s[i] for s, i in zip(stream, index)]))
    back = routekit.routing.scatter_tokens(stream, index, kept * 2)
    assert back.is_contiguous()
    want = stream.clone()
    for b in range(2):
        want[b, index[b]] *= 2
    assert torch.equal(back, want)


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_verify_runs_rate_0_and_puts_the_routes_back_after_also_when_a_run_fails(mode):
    """Verify's rate-0 run keeps every token by setting the routes' rate to 0 for the while: after it, also when
    a run fails, the routed model's routes have their own rate again."""
    model, routed, args = routed_owner(mode)
    live = routed.routekit.routes[0]
    rates = []
    block = routed.get_submodule("blocks.1")
    handle = block.register_forward_pre_hook(lambda m, a: rates.append(live.route.rate) if m.training else None)
    try:
        assert rk.verify(model, routed, args).train == "rate 0 bit-identical"
    finally:
        handle.remove()
    assert 0.0 in rates and live.route.rate == 0.5

    def fail(module, inputs):
        if module.training and live.route.rate == 0.0:
            raise RuntimeError("a training run fails")

    handle = block.register_forward_pre_hook(fail)
    try:
        with pytest.raises(rk.TrainingChanged, match="a training run fails"):
            rk.verify(model, routed, args)
    finally:
        handle.remove()
    assert live.route.rate == 0.5


def test_verify_reports_a_tensor_output_that_became_another_value():
    with pytest.raises(InferenceChanged, match="output 0"):
        _compare((torch.ones(2),), (3,), "original", "routed")


def test_verify_compares_output_objects_by_their_own_equality_where_they_have_one():
    class Meta:
        def __init__(self, n, note):
            self.n, self.note = n, note

        def __eq__(self, other):
            return self.n == other.n

    _compare((Meta(1, "a"),), (Meta(1, "b"),), "original", "routed")
    with pytest.raises(InferenceChanged):
        _compare((Meta(1, "a"),), (Meta(2, "a"),), "original", "routed")


class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x, mask=None):
        h = self.linear(x)
        return x + (h if mask is None else h * mask[..., None])


class Masked(nn.Module):
    """Blocks that take a per-token mask the caller may leave out (None), as diffusers' attention masks are."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, 2)
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(6))

    def forward(self, image, mask=None):
        x = self.embed(image).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x, mask)
        return x


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_a_block_input_the_example_call_did_not_pass_is_cut_by_its_data_flow_or_refused_by_name(mode):
    """Example inputs without the mask, then a call with it. Graph mode reads the blocks' data flow on that call:
    the mask scales each token's update, so it is cut with the stream, and the kept tokens come out as the
    unrouted model computes them (the blocks are token-wise). Boundary mode learned the blocks' inputs on the
    example call alone: the call is refused and the argument named (left whole, the blocks would get it beside
    the kept tokens and fail inside, or worse not). Example inputs with the mask, then a call without it: the
    mask is left out, and verify checks that call."""
    torch.manual_seed(0)
    model, image, mask = Masked(), torch.randn(2, 3, 8, 8), (torch.rand(2, 16) > 0.3).float()
    with torch.no_grad():
        want = model(image, mask)
    routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=(image,), mode=mode)
    routed.train()
    if mode == "graph":
        with torch.no_grad():
            got = routed(image, mask)
        kept = ~rk.last_route_mask(routed)
        assert kept.any() and not kept.all()
        assert torch.equal(got[kept], want[kept])
    else:
        with pytest.raises(rk.ConfigError, match="takes a tensor float32.2, 16. as 'mask' on this call, where the "
                                                 "example call passed None"):
            routed(image, mask)
    routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=(image, mask), mode=mode)
    checked = rk.verify(model, routed, (image,))  # the mask the example passed, left out
    assert checked.train == "rate 0 bit-identical" and "kept" in checked.checks
    assert "kept" in rk.verify(model, routed, (image, mask)).checks


# --- a reference that does not share routekit's reading of the model -----------------------------------------


def _caption_as_long_as_the_image(name: str):
    """PixArt (a 4×4 grid) and Wan (2 frames of 4×4) with captions as long as the image's tokens."""
    zoo = pytest.importorskip("zoo")
    pytest.importorskip("diffusers")
    return zoo.diffusers_pixart(text=16) if name == "pixart" else zoo.diffusers_wan(text=32)


def _planted_caption_cut(monkeypatch) -> None:
    """routekit's reading of the blocks' data flow made to say what a reading by lengths said: the caption, as long
    as the image, is per-token (cut at the kept positions, so cross-attention reads whichever caption tokens share
    an index with a kept image token)."""
    import routekit.probe
    from routekit.flow import Tied

    read = routekit.probe.token_axes

    def planted(module, args, kwargs, slot):
        found = read(module, args, kwargs, slot)
        names = list(inspect.signature(module.forward).parameters)
        caption = "encoder_hidden_states" if "encoder_hidden_states" in kwargs else \
            names.index("encoder_hidden_states") if "encoder_hidden_states" in names[:len(args)] else None
        if found is not None and caption is not None:  # PixArt passes the caption by name, Wan by position
            found[(caption, ())] = Tied((1,), True)
        return found

    monkeypatch.setattr(routekit.probe, "token_axes", planted)


@pytest.mark.parametrize("name", ["pixart", "wan"])
def test_a_caption_cut_at_the_kept_positions_fails_verify_by_the_masked_reference(name, monkeypatch):
    """The kept-token check cuts a block's inputs as the plan does, so it agrees with a wrong plan; the masked
    reference reads nothing of the plan, and differs."""
    model, args, kwargs = _caption_as_long_as_the_image(name)
    _planted_caption_cut(monkeypatch)
    routed = rk.apply(model, rk.Route(start=1, end=4), example_inputs=args, example_kwargs=kwargs)
    assert any(s.argument == "encoder_hidden_states" and s.tokens
               for s in report_of(routed).report.blocks[1].side_inputs)
    with pytest.raises(rk.TrainingChanged, match="masked out of attention"):
        rk.verify(routed, routed, args, kwargs)


@pytest.mark.parametrize("name", ["pixart", "wan"])
def test_the_same_models_as_they_are_verify_with_the_masked_reference(name):
    model, args, kwargs = _caption_as_long_as_the_image(name)
    routed = rk.apply(model, rk.Route(start=1, end=4), example_inputs=args, example_kwargs=kwargs)
    assert not any(s.argument == "encoder_hidden_states" and s.tokens
                   for s in report_of(routed).report.blocks[1].side_inputs)
    checked = rk.verify(routed, routed, args, kwargs)
    assert checked.checks == ("eval", "train", "kept", "reference") and "attention calls" in checked.reference

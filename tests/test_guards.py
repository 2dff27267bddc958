"""A training graph never goes stale, and a compiled or reshaped call never reuses a graph it should not.

What a traced forward read as plain Python is checked before every call (a change traces again; a value
that changes at every call is refused by name); modules the graph traces through that get hooks later are
traced again as module calls (their hooks run); activation checkpointing written in the owner's forward
survives the rewrite; a graph specialised to a shape serves another batch only where no batch size was baked
in, and never another token count; dtype and device moves move everything.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from tiny import Residual
from torch import nn

import routekit as rk
import routekit.guards
from routekit.model import original_forward, report_of, routing_of
from routekit.programs import Programs

DIM = 8


class Owner(nn.Module):
    """Reads a Python scale and a flag in its forward; can checkpoint its blocks as diffusers models do."""

    def __init__(self, depth: int = 5):
        super().__init__()
        self.scale, self.gradient_checkpointing = 1.5, False
        self.embed = nn.Linear(3, DIM)
        self.blocks = nn.ModuleList(Residual(DIM) for _ in range(depth))
        self.head = nn.Linear(DIM, 3)
        self.register_buffer("offset", torch.zeros(DIM))

    def forward(self, x):
        h = self.embed(x) * self.scale + self.offset
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(h)


def routed_owner(**options):
    torch.manual_seed(0)
    model, x = Owner(), torch.randn(2, 10, 3)
    return model, rk.apply(model, rk.Route(start=1, end=3), example_inputs=(x,), **options), x


def at_rate_zero_matches_the_original(routed: nn.Module, x: torch.Tensor) -> bool:
    from routekit.verify import _every_token, _original

    routed.train()
    with _every_token(routed):
        got = routed(x)
    return torch.equal(got, _original(routed)(x))


def test_an_attribute_the_forward_reads_changed_after_apply_is_read_again():
    model, routed, x = routed_owner()
    routed.train()
    before = routed(x)
    routed.scale = 2.0
    assert not torch.equal(routed(x), before)
    assert at_rate_zero_matches_the_original(routed, x)


def test_without_the_guard_the_stale_graph_is_what_verify_catches(monkeypatch):
    model, routed, x = routed_owner()
    routed.train()
    routed(x)
    monkeypatch.setattr(routekit.guards.Assumptions, "broken", lambda self, root: None)
    model.scale = routed.scale = 2.0
    with pytest.raises(rk.TrainingChanged, match="rate 0"):
        rk.verify(model, routed, (x,))


class Counting(Owner):
    """Changes an attribute in its forward: a traced graph would not repeat that."""

    def forward(self, x):
        self.scale += 0.125
        return super().forward(x)


def test_a_forward_that_sets_attributes_is_not_traced():
    torch.manual_seed(0)
    model, x = Counting(), torch.randn(2, 10, 3)
    with pytest.raises(rk.TraceError, match=r"sets self\.scale"):
        rk.apply(model, rk.Route(start=1, end=3), example_inputs=(x,), mode="graph")
    with pytest.warns(rk.FallbackWarning):
        routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=(x,))
    assert report_of(routed).mode == "boundary"  # the forward itself runs: its side effects with it


def test_a_value_that_changes_at_every_call_is_refused_by_name():
    model, routed, x = routed_owner()
    routed.train()
    with pytest.raises(rk.ConfigError, match=r"scale.*pass it as an argument"):
        for step in range(20):
            routed.scale = 1.0 + step
            routed(x)


def test_a_hook_registered_after_apply_on_a_traced_through_module_runs():
    model, routed, x = routed_owner()
    routed.train()
    routed(x)
    calls = []
    routed.embed.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    routed(x)  # traced again, with the hooked layer a module call (the trace runs it too)
    calls.clear()
    routed(x)
    assert calls == [(2, 10, DIM)]


def test_dar_honours_a_hook_on_a_block_or_refuses_it_by_name():
    """A block that gets a hook after apply is traced again as a module call, one DAR source (so the hook
    runs); where that changes DAR's aggregation points (a block of two sublayers), the error names the hook."""
    torch.manual_seed(0)
    model, x = Owner(), torch.randn(2, 10, 3)
    routed = rk.apply(model, residual=rk.DAR(), example_inputs=(x,)).train()
    routed(x)
    calls = []
    routed.blocks[2].register_forward_hook(lambda m, a, out: calls.append(1))
    routed(x)  # traced again (the trace runs the hooked block too)
    calls.clear()
    assert torch.isfinite(routed(x)).all() and calls == [1]  # one sublayer: the block as one source is the same
    from backbones import dit

    torch.manual_seed(0)
    model = dit.build("S/2", depth=3, hidden=32, heads=2, input_size=8, num_classes=10)
    args = dit.example_inputs(model, 2)
    routed = rk.apply(model, residual=rk.DAR(), example_inputs=args).train()
    routed(*args)
    routed.blocks[1].register_forward_hook(lambda m, a, out: None)
    with pytest.raises(rk.ConfigError, match=r"blocks\.1 has hooks.*aggregation points"):
        routed(*args)


def recomputations(routed: nn.Module, x: torch.Tensor) -> int:
    calls = []
    handles = [b.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled())) for b in routed.blocks]
    routed(x).square().mean().backward()
    for h in handles:
        h.remove()
    return len(calls) - len(routed.blocks)  # a checkpointed block runs again in backward


def test_activation_checkpointing_in_the_owner_forward_is_kept():
    torch.manual_seed(0)
    model, x = Owner(), torch.randn(2, 10, 3)
    model.gradient_checkpointing = True
    routed = rk.apply(model, rk.Route(start=1, end=3), example_inputs=(x,)).train()
    assert recomputations(routed, x) == 5
    plain = [p.grad.clone() for p in routed.parameters()]
    model.zero_grad()
    with rk.force_keep(routed, torch.ones(2, 10, dtype=torch.bool)):  # every token kept: the plain gradients
        routed.zero_grad()
        routed(x).square().mean().backward()
    model.zero_grad()
    model.train()(x).square().mean().backward()
    assert all(torch.allclose(p.grad, q) for p, q in zip(model.parameters(), [p.grad for p in routed.parameters()]))
    assert len(plain) == len(list(model.parameters()))


def test_dar_refuses_blocks_the_forward_checkpoints():
    torch.manual_seed(0)
    model, x = Owner(), torch.randn(2, 10, 3)
    model.gradient_checkpointing = True
    with pytest.raises(rk.ConfigError, match="torch.utils.checkpoint"):
        rk.apply(model, residual=rk.DAR(), example_inputs=(x,))


class SquareGrid(nn.Module):
    """Reads the grid off the token count (specialised when traced) and runs a loop over the batch."""

    def __init__(self, per_sample: bool):
        super().__init__()
        self.per_sample = per_sample
        self.embed = nn.Linear(1, DIM)
        self.blocks = nn.ModuleList(Residual(DIM) for _ in range(4))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        side = int(h.shape[1] ** 0.5)
        out = self.head(h).reshape(h.shape[0], side, side)
        if self.per_sample:  # the batch size baked in as a loop's length
            out = torch.stack([out[i] * (i + 1) for i in range(x.shape[0])])
        return out


def programs(routed: nn.Module) -> Programs:
    return routing_of(routed).executor


@pytest.mark.parametrize("per_sample", [False, True])
def test_a_new_batch_reuses_the_graph_unless_the_batch_size_was_baked_in(per_sample):
    torch.manual_seed(0)
    model = SquareGrid(per_sample)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(torch.randn(2, 16, 1),)).train()
    x = torch.randn(5, 16, 1)
    assert at_rate_zero_matches_the_original(routed, x)
    (bucket,) = [b for (train, _, _), b in programs(routed).programs.items() if train]
    assert len(bucket) == (2 if per_sample else 1)


def test_a_new_token_count_is_traced_again():
    """The grid side (int(N ** 0.5)) is baked in: at another token count the graph is traced again, and a
    cache that ignored the shapes would give the wrong grid (the planted bug fails this test)."""
    torch.manual_seed(0)
    model = SquareGrid(False)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(torch.randn(2, 16, 1),)).train()
    assert at_rate_zero_matches_the_original(routed, torch.randn(2, 36, 1))


def test_a_table_traced_at_batch_1_serves_batch_3():
    """A (1, N, D) table is shared by the batch: gathered per sample at batch 3 though traced at batch 1."""

    class TableBlock(nn.Module):
        def forward(self, x, table):
            return x + table

    class TableOwner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(TableBlock() for _ in range(3))

        def forward(self, x, table):
            for block in self.blocks:
                x = block(x, table)
            return x

    model = TableOwner()
    routed = rk.apply(model, rk.Route(start=1, end=1), example_inputs=(torch.randn(1, 6, 4), torch.randn(1, 6, 4)))
    routed.train()
    x, table = torch.randn(3, 6, 4), torch.randn(1, 6, 4)
    out = routed(x, table)
    kept = ~rk.last_route_mask(routed)
    with original_forward(routed):
        want = routed(x, table)
    assert torch.equal(out[kept], want[kept])


def test_dtype_and_device_moves_move_the_whole_model():
    model, routed, x = routed_owner()
    routed.to(torch.float64)
    assert model.offset.dtype == torch.float64 and model.embed.weight.dtype == torch.float64
    routed.train()
    assert routed(x.double()).dtype == torch.float64


# --- one state: the routed model and the model it was made from ---------------------------------------------------

@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_an_attribute_set_after_apply_reaches_the_routed_training_forward(mode):
    """The routed model is the model: a flag set on it after apply (a scale, a dropout probability, diffusers'
    gradient_checkpointing) reaches its training forward, which reads it afresh."""
    model, routed, x = routed_owner(mode=mode)
    assert routed is model
    routed.train()
    model.scale = 5.0
    assert at_rate_zero_matches_the_original(routed, x)
    torch.manual_seed(0)
    changed = routed(x)
    model.scale = 1.5
    torch.manual_seed(0)
    assert not torch.equal(changed, routed(x))  # the routed forward read 1.5, not 5.0
    assert rk.strip(routed) is model


def test_gradient_checkpointing_enabled_on_the_original_after_apply_recomputes_the_routed_blocks():
    """diffusers' `enable_gradient_checkpointing()` called on the model after apply: the routed model's next step
    checkpoints every block (each runs again in backward), and its losses stay the model's at rate 0."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=4,
                                            sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=1)
    args, kwargs = (torch.randn(2, 4, 8, 8),), {"timestep": torch.tensor([3, 7]), "class_labels": torch.tensor([1, 4])}
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=args, example_kwargs=kwargs).train()
    calls = []
    model.transformer_blocks[1].register_forward_pre_hook(lambda *_: calls.append(1))  # recomputing stops early

    def step():
        calls.clear()
        routed(*args, **kwargs).sample.square().mean().backward()
        return len(calls)

    assert step() == 1
    model.enable_gradient_checkpointing()
    step()  # traces again (the flag the forward branches on changed): the trace runs the block once more
    assert step() == 2  # forward, and again in backward
    rk.verify(model, routed, args, kwargs)


def test_a_forward_that_sets_attributes_when_the_mode_flips_is_found_at_apply():
    """transformers' RwkvModel rescales its weights and sets `layers_are_rescaled` when the mode flips: apply finds
    it from the forward's code (in whatever mode the model is), routes in boundary mode and says why; training,
    sampling and training again then run, and mode='graph' is refused at apply, not at the first step."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, attention_hidden_size=32,
                                     intermediate_size=64, context_length=32, rescale_every=2)
    model, ids = transformers.RwkvModel(config).eval(), torch.randint(0, 64, (2, 12))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(rk.FallbackWarning, match=r"_rescale_layers sets self\.layers_are_rescaled"):
        routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(ids,))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())  # apply ran nothing that rescales
    for training in (True, False, True, False):
        routed.train(training)
        routed(ids)
    rk.verify(model, routed, (ids,))
    with pytest.raises(rk.TraceError, match="layers_are_rescaled"):
        rk.apply(model, rk.Route(start=1, end=2), example_inputs=(ids,), mode="graph")


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = 2.0
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h):
        return self.lin(h) * self.gain


class Watched(Owner):
    """An owner whose forward looks at the user's own modules (`user`, not `self`: a trace runs on a copy) as
    it runs, and can set an attribute or raise."""

    def __init__(self, seen: list, fail: bool = False, write: bool = False):
        super().__init__()
        self.gain, self.fail, self.write, self.seen = Gain(), fail, write, seen
        self.user = [self]  # in a list: a plain attribute, not a submodule

    def forward(self, x):
        self.seen.append([type(m) for m in self.user[0].modules()])
        if self.write:
            self.steps = 1
        if self.fail:
            raise RuntimeError("the forward fails")
        return super().forward(self.gain(self.embed(x)) @ self.embed.weight)


@pytest.mark.parametrize("how", ["runs", "raises", "writes"])
def test_tracing_leaves_the_users_modules_their_classes_and_attributes_even_when_the_forward_fails(how):
    """A trace records what the forward reads on a copy of the module tree: the user's modules keep their own
    classes while it runs and after, an attribute the forward sets never reaches them, and the reads are
    still recorded (a changed `gain` traces again)."""
    from routekit.errors import TraceError
    from routekit.trace import trace

    seen: list = []
    model = Watched(seen, fail=how == "raises", write=how == "writes")
    classes = [type(m) for m in model.modules()]
    if how == "runs":
        tr = trace(model, (torch.randn(2, 10, 3),))
        assert ("gain", "gain", 2.0) in tr.assumed.reads and ("", "scale", 1.5) in tr.assumed.reads
    else:
        with pytest.raises(TraceError, match="sets self.steps" if how == "writes" else "the forward fails"):
            trace(model, (torch.randn(2, 10, 3),))
    assert seen and all(types == classes for types in seen)
    assert [type(m) for m in model.modules()] == classes and "steps" not in vars(model)


def test_a_forward_bound_to_the_users_module_itself_still_calls_its_layers_by_their_paths():
    """accelerate's hooks replace a module's forward by a partial bound to the module: the trace, which runs on a
    copy of the module tree, reaches the user's module through it, and calls its layers by their own paths."""
    import functools

    from routekit.trace import trace

    model = Watched([])
    model.gain.forward = functools.partial(type(model.gain).forward, model.gain)
    tr = trace(model, (torch.randn(2, 10, 3),))
    assert "gain.lin" in {n.target for n in tr.graph.nodes if n.op == "call_module"}
    assert "gain" in tr.assumed.traced_through

"""Graph-mode tracing (routekit/trace.py, calls.py, fxcompat.py): the owner forwards and blocks real models have.

Each hand-written model reproduces one kind of forward that tracing refused or got wrong: a decorator
that fills keyword arguments the caller did not pass (transformers' config defaults), **kwargs, a cache
object made by the forward or passed in, in-place item assignment on a tensor the forward made
(Lumina2's padded sequence), an attention processor object that dispatches to a backend, tensors
inside tuple/list/dict arguments (rotary (cos, sin), PixArt's added_cond_kwargs), a module made inside
the forward (transformers' ACT2FN), and a torch.compile'd block (which runs only with torch.fx's
tracing flag cleared, a flag torch 2.14 moved). Every test asserts a real graph (the blocks are
call_module leaves, nothing fell back to a leaf that should not) and that running the graph gives the
forward's output bit for bit on the example and on a second input of the same shapes.

The real models (transformers, diffusers, timm), built from small configs with random weights, check
the same for their owners and for each kind of block traced alone, as DAR traces them; a package that
is absent skips its case with the reason.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import operator
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from tiny import D, built
from torch import nn

import routekit.fxcompat as fxcompat
import routekit.objects as objects
import routekit.trace as rt
from routekit.calls import Input, bind_arguments, call_inputs, call_spec
from routekit.errors import InputError, TraceError
from routekit.state import shallow_copy
from routekit.trace import Trace, container_members, trace
from routekit.values import flatten

DIM = 16


# --- running a traced graph -------------------------------------------------------------------------


def run_graph(model: nn.Module, tr: Trace, args: tuple, kwargs: dict):
    """Call the traced graph the way the routed model does: the call's inputs (`call_inputs`) in
    placeholder order, its constants on the module, the output rebuilt from `out_spec`."""
    root = shallow_copy(model)
    for name, value in tr.constants.items():
        setattr(root, name, value)
    bound = bind_arguments(type(model).forward, args, kwargs)
    assert call_spec(bound).key() == tr.spec.key(), "the call does not select this graph"
    module = fx.GraphModule(root, tr.graph)
    return pytree.tree_unflatten(list(module(*call_inputs(bound, tr.spec))), tr.out_spec)


def assert_identical(want, got) -> None:
    """Same structure, same types, tensors equal bit for bit (dataclass outputs included)."""
    want_leaves, want_structure = flatten(want)
    got_leaves, got_structure = flatten(got)
    assert len(want_leaves) == len(got_leaves) and str(want_structure) == str(got_structure)
    tensors = 0
    for w, g in zip(want_leaves, got_leaves):
        assert type(w) is type(g)
        if isinstance(w, torch.Tensor):
            assert w.shape == g.shape and w.dtype == g.dtype and torch.equal(w, g)
            tensors += 1
    assert tensors, "the output holds no tensor to compare"


def assert_replays(model: nn.Module, make_call: Callable[[int], tuple[tuple, dict]], **trace_options) -> Trace:
    """Trace on make_call(0); the graph must reproduce the forward on that call and on make_call(1).

    Each run gets its own copy of the call, so objects the forward updates (a cache) start equal."""
    args, kwargs = make_call(0)
    tr = trace(model, args, kwargs, **trace_options)
    for seed in (0, 1):
        call = make_call(seed)
        torch.manual_seed(seed)
        want = model(*copy.deepcopy(call[0]), **copy.deepcopy(call[1]))
        torch.manual_seed(seed)
        got = run_graph(model, tr, *copy.deepcopy(call))
        assert_identical(want, got)
    return tr


def block_calls(tr: Trace, model: nn.Module) -> list[str]:
    members = container_members(model)
    return [n.target for n in tr.graph.nodes if n.op == "call_module" and n.target in members]


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- keyword arguments the caller did not pass, and **kwargs -----------------------------------------


def config_default(name: str):
    """Fill `name` from the model's config when the caller did not pass it (or passed None), by keyword, as
    transformers' merge_with_config_defaults does: passing it positionally as well is a TypeError."""

    def decorator(forward):
        @functools.wraps(forward)
        def wrapper(self, *args, **kwargs):
            if kwargs.get(name) is None:
                kwargs[name] = self.config[name]
            return forward(self, *args, **kwargs)

        return wrapper

    return decorator


class ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, mask=None, scale=None, use_cache=False):
        y = self.proj(x)
        if scale is not None:
            y = y * scale[:, None, None]
        return x + (y if use_cache else y.tanh())


class DefaultsOwner(nn.Module):
    """`use_cache` defaults from a config inside a decorator; extra keywords reach the blocks through **kwargs."""

    def __init__(self):
        super().__init__()
        self.config = {"use_cache": True}
        self.blocks = nn.ModuleList([ScaledBlock() for _ in range(3)])

    @config_default("use_cache")
    def forward(self, x, mask=None, use_cache=None, **kwargs):
        for block in self.blocks:
            x = block(x, mask=mask, use_cache=use_cache, **kwargs)
        return x


def test_a_call_is_traced_as_made_so_decorators_filling_defaults_see_what_the_caller_passed() -> None:
    model = DefaultsOwner()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {"scale": randn(s + 9, 2)}))
    assert block_calls(tr, model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert tr.spec.names == ("x", "scale")  # a tensor in **kwargs is an input under its own name
    assert tr.spec.constants == {"mask": None, "use_cache": None}  # the defaults select the graph, passed or not


def test_a_keyword_given_for_a_positional_parameter_and_a_varargs_entry_trace() -> None:
    class Star(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([ScaledBlock() for _ in range(2)])

        def forward(self, x, *extra, scale=None):
            for block in self.blocks:
                x = block(x, scale=scale) + sum(extra)
            return x

    model = Star()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 3, DIM), randn(s + 1, 2, 3, DIM)), {"scale": randn(s, 2)}))
    assert tr.spec.names == ("x", "extra_0", "scale") and len(block_calls(tr, model)) == 2


# --- caches: objects a graph cannot hold ---------------------------------------------------------------


class KVCache:
    """A generation cache: a plain object each block reads its past keys from and stores its keys in."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}

    def past(self, layer: int) -> torch.Tensor | None:
        return self.keys.get(layer)

    def store(self, layer: int, k: torch.Tensor) -> int:
        self.keys[layer] = k
        return len(self.keys)  # unused by the block: the call stays in the graph for its effect

    def length(self) -> int:
        return next(iter(self.keys.values())).shape[1] if self.keys else 0


class CacheBlock(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.q, self.k = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x, cache=None, use_cache=False):
        k = self.k(x)
        if cache is not None:
            past = cache.past(self.index)
            k = k if past is None else torch.cat([past, k], 1)
            cache.store(self.index, k)
        attn = torch.softmax(self.q(x) @ k.transpose(1, 2) / DIM ** 0.5, -1)
        return x + attn @ k


class CacheOwner(nn.Module):
    """Makes a cache when asked for one and none is passed, as transformers' Llama and Mamba do."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CacheBlock(i) for i in range(3)])

    def forward(self, x, cache=None, use_cache=True):
        if use_cache and cache is None:
            cache = KVCache()
        start = cache.length() if cache is not None else 0
        x = x + start
        for block in self.blocks:
            x = block(x, cache=cache, use_cache=use_cache)
        return x, cache


def test_a_cache_the_forward_makes_is_made_afresh_on_every_run_of_the_graph() -> None:
    model = CacheOwner()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert block_calls(tr, model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert any("KVCache made by the forward" in s for s in tr.specialised)
    made = next(n for n in tr.graph.nodes if n.target is objects.per_run_copy)  # a plain object: torch.compile traces it
    assert made.meta["rk"].keys == {}  # described as first used: the state a block traced alone (DAR) must see
    x = randn(3, 2, 5, DIM)
    want_out, want_cache = model(x)
    for _ in range(2):  # a second run starts from an empty cache again, not from the first run's
        out, cache = run_graph(model, tr, (x,), {})
        assert torch.equal(out, want_out) and cache is not want_cache
        assert cache.keys.keys() == want_cache.keys.keys()
        assert all(torch.equal(cache.keys[i], want_cache.keys[i]) for i in want_cache.keys)


class Slotted:
    __slots__ = ("keys",)

    def __init__(self):
        self.keys = {}


class OwnCopy(KVCache):
    def __deepcopy__(self, memo):
        return self  # shared across runs on purpose: deepcopy's rules, not ours


def test_the_per_run_copy_makes_what_deepcopy_makes_and_leaves_what_it_cannot_to_deepcopy() -> None:
    """A graph copies an object the forward made on every run with `per_run_copy` (which torch.compile traces)
    where that makes what copy.deepcopy makes: fresh objects, lists, dicts and tensors, the same atoms. Where it
    would not (a part reached twice, slots, a copy method of the class's own, a tensor that needs a gradient or
    is a view), the graph keeps copy.deepcopy."""
    cache = KVCache()
    cache.store(0, randn(1, 2, 3, DIM))
    cache.layers = [KVCache(), (None, torch.float16, "name", 3.5), {"kind": contextlib.nullcontext}]
    assert objects.plainly_copied(cache)
    made, want = objects.per_run_copy(cache), copy.deepcopy(cache)
    assert type(made) is KVCache and made is not cache and made.keys is not cache.keys
    assert torch.equal(made.keys[0], want.keys[0]) and made.keys[0].data_ptr() != cache.keys[0].data_ptr()
    assert type(made.layers[0]) is KVCache and made.layers[0] is not cache.layers[0]
    assert made.layers[1:] == want.layers[1:] and made.layers[2]["kind"] is contextlib.nullcontext
    shared = KVCache()
    twice = KVCache()
    twice.layers = [shared, shared]
    view = KVCache()
    view.store(0, randn(2, 2, 3, DIM)[0])
    grad = KVCache()
    grad.store(0, randn(3, 2, 3, DIM).requires_grad_())
    for other in (twice, Slotted(), OwnCopy(), view, grad):
        assert not objects.plainly_copied(other), type(other)


def filled_cache(seed: int) -> KVCache:
    cache = KVCache()
    for layer in range(3):
        cache.store(layer, randn(seed + layer, 2, 4, DIM))
    return cache


def test_a_cache_passed_in_is_a_graph_input_the_graph_updates_and_tracing_leaves_alone() -> None:
    model = CacheOwner()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {"cache": filled_cache(s)}))
    assert tr.spec.inputs[1] == Input("cache", "cache", (), KVCache)
    cache, x = filled_cache(5), randn(5, 2, 5, DIM)
    before = {k: v.clone() for k, v in cache.keys.items()}
    tr = trace(model, (x,), {"cache": cache})
    assert all(torch.equal(cache.keys[k], v) for k, v in before.items())  # traced on a private copy
    want = model(x, cache=copy.deepcopy(cache))[1]
    out, returned = run_graph(model, tr, (x,), {"cache": cache})
    assert returned is cache and all(torch.equal(cache.keys[k], want.keys[k]) for k in want.keys)


@pytest.mark.parametrize("state", ["empty", "filled"])
def test_a_block_traced_alone_records_what_it_does_with_a_cache_argument(state: str) -> None:
    block = CacheBlock(1)
    cache = KVCache if state == "empty" else filled_cache
    tr = assert_replays(block, lambda s: ((randn(s, 2, 5, DIM),), {"cache": cache(s) if state == "filled" else cache(),
                                                                     "use_cache": True}))
    methods = [n.target for n in tr.graph.nodes if n.op == "call_method"]
    assert methods.count("past") == methods.count("store") == 1 and not tr.leafed
    assert any(".past() returned None" in s for s in tr.specialised) == (state == "empty")


class Registry:
    """State the model keeps (an attribute, not made by the forward): every run must reach the same object."""

    def __init__(self):
        self.calls = 0


class CountingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, registry):
        registry.calls += 1
        return x + self.proj(x)


class RegistryOwner(nn.Module):
    def __init__(self):
        super().__init__()
        self.registry = Registry()
        self.blocks = nn.ModuleList([CountingBlock() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.registry)
        return x


REGISTRY = Registry()


class DefaultRegistryOwner(RegistryOwner):
    def forward(self, x, registry=REGISTRY):
        for block in self.blocks:
            x = block(x, registry)
        return x


@pytest.mark.parametrize("where", ["attribute", "default"])
def test_an_object_the_model_keeps_or_a_default_is_the_same_object_on_every_run(where: str) -> None:
    model = RegistryOwner() if where == "attribute" else DefaultRegistryOwner()
    registry = model.registry if where == "attribute" else REGISTRY
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert [n.target for n in tr.graph.nodes if n.op == "get_attr"] == (
        ["registry"] if where == "attribute" else ["_routekit_object_0"])
    calls = registry.calls
    run_graph(model, tr, (randn(0, 2, 5, DIM),), {})
    assert registry.calls == calls + 2


class Holder:
    def __init__(self, module: nn.Module):
        self.module = module


class HolderOwner(RegistryOwner):
    def forward(self, x):
        holder = Holder(self.blocks[0].proj)
        for block in self.blocks:
            x = block(x, holder)
        return x


def test_an_object_the_forward_makes_that_holds_a_module_is_refused() -> None:
    with pytest.raises(TraceError, match="Holder, made by the forward and passed on, holds a Linear"):
        trace(HolderOwner(), (randn(0, 2, 5, DIM),))


# --- in-place item assignment, and values compared as values ------------------------------------------


class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).chunk(3, -1)
        logits = q @ k.transpose(1, 2)
        if mask is not None:
            logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        return x + torch.softmax(logits, -1) @ v


class PackedOwner(nn.Module):
    """Packs caption and image tokens into one padded sequence with a mask, as diffusers' Lumina2 does:
    item assignment into tensors the forward made, and a mask only when the lengths differ."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MaskedBlock() for _ in range(2)])

    def forward(self, x, caption):
        batch, tokens, dim = x.shape
        captions = [caption.shape[1]] * batch
        lengths = [c + tokens for c in captions]
        use_mask = len(set(lengths)) > 1
        mask = x.new_zeros(batch, max(lengths), dtype=torch.bool)
        joint = x.new_zeros(batch, max(lengths), dim)
        for i, (c, n) in enumerate(zip(captions, lengths)):
            mask[i, :n] = True
            joint[i, :c] = caption[i]
            joint[i, c:n] = x[i]
        for block in self.blocks:
            joint = block(joint, mask if use_mask else None)
        return joint[:, captions[0]:]


class MaskPackedOwner(PackedOwner):
    """PackedOwner with each caption's length read off its mask, as diffusers' Lumina2 reads them
    (`mask.sum(1).tolist()`), or with `.item()`: the layout is the example mask's, which a graph would keep."""

    def __init__(self, read: str):
        super().__init__()
        self.read = read

    def forward(self, x, caption, caption_mask):
        batch, tokens, dim = x.shape
        counts = caption_mask.sum(1)
        captions = counts.tolist() if self.read == "tolist" else [counts[i].item() for i in range(batch)]
        lengths = [c + tokens for c in captions]
        joint = x.new_zeros(batch, max(lengths), dim)
        for i, (c, n) in enumerate(zip(captions, lengths)):
            joint[i, :c] = caption[i, :c]
            joint[i, c:n] = x[i]
        for block in self.blocks:
            joint = block(joint, None)
        return joint


@pytest.mark.parametrize("read", ["tolist", "item"])
def test_numbers_read_off_a_tensors_data_are_refused_like_its_data(read: str) -> None:
    """The twin of the test below: lengths read off a mask's values, not off shapes. `.tolist()` and `.item()`
    made plain numbers the trace specialised like shapes, so a routed Lumina2 replayed the example mask's layout for
    every mask of that padded length: a batch whose captions were shorter than the example's was laid out wrong,
    silently, and one longer failed inside the graph. Such numbers are refused as the data they came from."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TraceError, match=f"number read off a tensor's data .*{read}"):
        trace(MaskPackedOwner(read), (randn(0, 2, 6, DIM), randn(1, 2, 3, DIM), mask))


def test_lumina2_lays_out_its_caption_and_image_by_its_masks_data_and_is_refused_graph_mode() -> None:
    """Its rotary embedder reads the caption lengths with `.tolist()` (it becomes a leaf, its numbers reads of
    data), and the owner lays the sequence out by them."""
    model, make_call = lumina2()
    args, kwargs = make_call(0)
    with pytest.raises(TraceError, match="number read off a tensor's data .*rope_embedder"):
        trace(model.train(), args, kwargs)


def test_item_assignment_into_a_tensor_the_forward_made_is_recorded_in_place() -> None:
    model = PackedOwner()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 6, DIM), randn(s + 1, 2, 3, DIM)), {}))
    assert block_calls(tr, model) == ["blocks.0", "blocks.1"]
    assert sum(n.target is operator.setitem for n in tr.graph.nodes) == 6
    calls = [n for n in tr.graph.nodes if n.op == "call_module"]
    assert all(n.args[1] is None for n in calls), "equal lengths form a set of one: no mask, as in eager"


# --- an attention processor object, and tensors inside tuple/list/dict arguments ---------------------


_BACKENDS = {"math": lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v}


class Processor:
    """A plain object (not a module) the attention calls with itself, dispatching to a backend by name, as
    diffusers' attention processors do."""

    backend = "math"

    def __call__(self, attn, x, rotary=None, gain=None):
        q, k, v = attn.qkv(x).chunk(3, -1)
        if rotary is not None:
            cos, sin = rotary
            q, k = q * cos + q.roll(1, -1) * sin, k * cos + k.roll(1, -1) * sin
        out = attn.out(_BACKENDS[self.backend](q, k, v))
        return out if gain is None else out * gain


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.processor = Processor()

    def forward(self, x, rotary=None, **kwargs):
        accepted = set(inspect.signature(self.processor.__call__).parameters)
        return self.processor(self, x, rotary=rotary, **{k: v for k, v in kwargs.items() if k in accepted})


class RotaryBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(DIM), Attention(), nn.Linear(DIM, DIM)

    def forward(self, x, rotary, cond, extra=()):
        h = self.norm(x)
        if cond["shift"] is not None:
            h = h + cond["shift"][:, None]
        x = x + self.attn(h, rotary=rotary, gain=cond["gain"], ignored=1)
        return x + self.mlp(x) + sum(extra)


class RotaryOwner(nn.Module):
    """Takes (cos, sin), a dict and a list of tensors as arguments, and hands them on to its blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([RotaryBlock() for _ in range(3)])

    def forward(self, x, rotary, cond, extra):
        cos, sin = rotary
        for block in self.blocks:
            x = block(x, (cos, sin), cond, extra=extra)
        return x


def rotary_call(seed: int, gain: bool = False) -> tuple[tuple, dict]:
    angle = randn(seed, 5, DIM)
    cond = {"shift": randn(seed + 1, 2, DIM), "gain": randn(seed + 2, 2, 1, 1) if gain else None}
    return (randn(seed + 3, 2, 5, DIM), (angle.cos(), angle.sin()), cond, [randn(seed + 4, 2, 5, DIM)]), {}


def test_tensors_inside_tuple_list_and_dict_arguments_are_inputs_named_by_their_path() -> None:
    model = RotaryOwner()
    tr = assert_replays(model, rotary_call)
    assert block_calls(tr, model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert tr.spec.names == ("x", "rotary_0", "rotary_1", "cond_shift", "extra_0")
    assert tr.spec.constants["cond"] == {"shift": tr.spec.inputs[3], "gain": None}
    args, kwargs = rotary_call(0)
    bound = bind_arguments(RotaryOwner.forward, args, kwargs)
    wanted = [args[0], *args[1], args[2]["shift"], args[3][0]]
    assert all(a is b for a, b in zip(call_inputs(bound, tr.spec), wanted, strict=True))
    call = next(n for n in tr.graph.nodes if n.op == "call_module")
    assert isinstance(call.args[1], tuple) and all(isinstance(a, fx.Node) for a in call.args[1])
    other = call_spec(bind_arguments(RotaryOwner.forward, *rotary_call(0, gain=True)))
    assert other.key() != tr.spec.key()  # a tensor where there was None: another graph


def test_a_block_with_a_processor_and_container_arguments_traces_alone_as_dar_traces_it() -> None:
    block = RotaryBlock()

    def call(seed):
        args, _ = rotary_call(seed, gain=True)
        return (args[0], args[1], args[2]), {"extra": tuple(args[3])}

    tr = assert_replays(block, call)
    assert not tr.leafed
    assert {n.target for n in tr.graph.nodes if n.op == "call_module"} == {"norm", "attn.qkv", "attn.out", "mlp"}
    assert tr.spec.names == ("x", "rotary_0", "rotary_1", "cond_shift", "cond_gain", "extra_0")


def test_a_graph_node_among_the_arguments_is_refused_by_name() -> None:
    node = fx.Graph().placeholder("cos")
    with pytest.raises(InputError, match=r"argument 'rotary' holds the fx node 'cos' at \[0\]"):
        trace(RotaryBlock(), (randn(0, 2, 5, DIM), (node, node), {"shift": None, "gain": None}))


# --- Python code that looks at a value ----------------------------------------------------------------


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, feats=None):
        if feats is not None:
            x = x + feats["aux"][..., None]
        return {"main": x + self.proj(x), "aux": x.mean(-1), "extra": None}


class LookingOwner(nn.Module):
    """Iterates over a block's dict output and its items, keys a dict argument with its keys, tests an
    attribute and a value for None, and asks hasattr of a tensor."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([DictBlock() for _ in range(2)])

    def forward(self, x):
        if x.grad is not None:  # an input's gradient (a leaf's: no warning)
            x = x * 0
        feats = None
        for block in self.blocks:
            out = block(x, feats)
            x = sum(out[k] for k in out if out[k] is not None and out[k].dim() == 3)
            feats = {k: v for k, v in out.items() if v is not None}
            if out["extra"] is not None or hasattr(x, "routing_hint"):
                x = x * 0
        return x


def test_code_that_looks_at_a_value_sees_the_value() -> None:
    model = LookingOwner()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert block_calls(tr, model) == ["blocks.0", "blocks.1"] and not any(n.target is operator.mul for n in tr.graph.nodes)
    assert sum(n.target is list for n in tr.graph.nodes) == 2  # .items() is listed; iterating the dict reads its keys
    assert any(".grad is None" in s for s in tr.specialised)


def test_a_retry_does_not_reuse_values_an_lru_cache_kept_from_the_failed_attempt() -> None:
    @functools.lru_cache
    def positions(n):
        return torch.arange(n) / n

    class DataDependent(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # fx cannot trace this: it becomes a leaf, and tracing starts over

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = DataDependent()
            self.blocks = nn.ModuleList([ScaledBlock() for _ in range(2)])

        def forward(self, x):
            x = x + positions(x.shape[1])[:, None]
            x = self.gate(x)
            for block in self.blocks:
                x = block(x)
            return x

    model = Owner()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert list(tr.leafed) == ["gate"]


# --- a module made inside the forward ------------------------------------------------------------------


ACTIVATIONS = {"gelu": nn.GELU}  # a lookup that builds a new module each time, as transformers' ACT2FN


class ActBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + ACTIVATIONS["gelu"]()(self.proj(x))


def test_a_module_the_forward_makes_is_traced_through_not_made_a_leaf() -> None:
    tr = assert_replays(ActBlock(), lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert not tr.leafed and [n.target for n in tr.graph.nodes if n.op == "call_module"] == ["proj"]


# --- torch.compile'd blocks: torch.fx's tracing flag ---------------------------------------------------


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ScaledBlock() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def compiled_stack() -> Stack:
    torch.manual_seed(0)
    model = Stack()
    model.blocks[1] = torch.compile(model.blocks[1], backend="eager")
    return model


def test_a_compiled_block_runs_inside_an_owner_on_this_torch() -> None:
    model = compiled_stack()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert block_calls(tr, model) == ["blocks.0", "blocks.1", "blocks.2"] and not tr.leafed


def test_the_dynamo_switch_runs_a_compiled_block_where_torch_has_no_flag_routekit_knows(monkeypatch) -> None:
    monkeypatch.setattr(rt, "not_fx_tracing", fxcompat._dynamo_compiles_under_fx)
    model = compiled_stack()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert block_calls(tr, model) == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_compiled_block_fails_unless_the_flag_is_switched(monkeypatch) -> None:
    """The two tests above would pass vacuously if a compiled block ran under the flag anyway."""
    monkeypatch.setattr(rt, "not_fx_tracing", contextlib.nullcontext)
    with pytest.raises(TraceError, match="dynamo-optimized"):
        trace(compiled_stack(), (randn(0, 2, 5, DIM),))


class Nested(nn.Module):
    """A block whose own submodules run when the block runs as a leaf: they must run, not be recorded."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())

    def forward(self, x):
        return x + self.inner(x)


class NestedStack(Stack):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Nested(), Nested()])


def test_leaves_run_as_real_modules_while_fx_has_patched_nn_module() -> None:
    model = NestedStack()
    tr = assert_replays(model, lambda s: ((randn(s, 2, 5, DIM),), {}))
    assert [n.target for n in tr.graph.nodes if n.op == "call_module"] == ["blocks.0", "blocks.1"]


def test_leaves_recorded_instead_of_run_fail(monkeypatch) -> None:
    """The test above would pass vacuously if a node running for real did not pass its module calls through."""
    original = rt._Tracer.call_module

    def recording_anyway(self, m, forward, args, kwargs):
        running, self.running = self.running, 0
        try:
            return original(self, m, forward, args, kwargs)
        finally:
            self.running = running

    monkeypatch.setattr(rt._Tracer, "call_module", recording_anyway)
    with pytest.raises(TraceError, match="RecursionError"):  # the leaf's call records itself, forever
        trace(NestedStack(), (randn(0, 2, 5, DIM),))


def test_leaves_run_with_the_tracing_flag_cleared_on_this_torch() -> None:
    if fxcompat.FX_FLAG_SWITCH == "dynamo-config":
        pytest.skip("this torch keeps no tracing flag routekit knows; the Dynamo switch is tested above")
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch.fx._symbolic_trace.is_fx_symbolic_tracing())
            return x * 2

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Probe(), Probe()])

        def forward(self, x):
            seen.append(torch.fx._symbolic_trace.is_fx_symbolic_tracing())
            return self.blocks[1](self.blocks[0](x))

    trace(Owner(), (torch.ones(2, 3, 4),))
    assert seen == [True, False, False]  # the owner is traced under the flag, its leaves run without it
    assert not torch.fx._symbolic_trace.is_fx_symbolic_tracing()


# --- real models ---------------------------------------------------------------------------------------


def _package(name: str):
    try:
        return importlib.import_module(name)
    except Exception as err:  # timm without torchvision raises ModuleNotFoundError, a broken torchvision RuntimeError
        pytest.skip(f"{name} is not usable here ({type(err).__name__}: {err})")


def llama():
    transformers = _package("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaModel(config), lambda s: ((torch.randint(0, 64, (2, 7), generator=_gen(s)),), {})


def mamba():
    transformers = _package("transformers")
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=3, expand=2)
    return transformers.MambaModel(config), lambda s: ((torch.randint(0, 64, (2, 12), generator=_gen(s)),), {})


def lumina2():
    diffusers = _package("diffusers")
    model = diffusers.Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=1,
        num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None, norm_eps=1e-5,
        scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=8)
    return model, lambda s: ((randn(s, 2, 4, 8, 8),), {
        "timestep": torch.rand(2, generator=_gen(s)), "encoder_hidden_states": randn(s + 1, 2, 5, 8),
        "encoder_attention_mask": torch.ones(2, 5, dtype=torch.bool)})


def flux():
    diffusers = _package("diffusers")
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
    return model, lambda s: ((randn(s, 2, 16, 4),), {
        "encoder_hidden_states": randn(s + 1, 2, 5, 32), "pooled_projections": randn(s + 2, 2, 32),
        "timestep": torch.rand(2, generator=_gen(s)), "img_ids": randn(9, 16, 3), "txt_ids": randn(10, 5, 3)})


def wan():
    diffusers = _package("diffusers")
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                            in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32,
                                            num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                            rope_max_seq_len=32)
    return model, lambda s: ((randn(s, 2, 4, 2, 8, 8),), {
        "encoder_hidden_states": randn(s + 1, 2, 6, 16), "timestep": torch.randint(0, 1000, (2,), generator=_gen(s))})


def sd3():
    diffusers = _package("diffusers")
    model = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=2,
                                            attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                            joint_attention_dim=32, pooled_projection_dim=64, out_channels=4)
    return model, lambda s: ((randn(s, 2, 4, 8, 8),), {
        "encoder_hidden_states": randn(s + 1, 2, 5, 32), "pooled_projections": randn(s + 2, 2, 64),
        "timestep": torch.randint(0, 1000, (2,), generator=_gen(s))})


def sana():
    diffusers = _package("diffusers")
    model = diffusers.SanaTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=2,
                                             attention_head_dim=4, num_attention_heads=2, num_cross_attention_heads=2,
                                             cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
                                             sample_size=8)
    return model, lambda s: ((randn(s, 2, 4, 8, 8),), {
        "encoder_hidden_states": randn(s + 1, 2, 5, 8), "timestep": torch.randint(0, 1000, (2,), generator=_gen(s))})


def pixart():
    """With the resolution and aspect-ratio conditions: tensors inside the added_cond_kwargs dict."""
    diffusers = _package("diffusers")
    model = diffusers.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=24, in_channels=4,
                                               out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                               cross_attention_dim=48, caption_channels=24, norm_num_groups=1,
                                               use_additional_conditions=True)
    return model, lambda s: ((randn(s, 2, 4, 8, 8),), {
        "encoder_hidden_states": randn(s + 1, 2, 5, 24), "timestep": torch.tensor([3, 7]),
        "added_cond_kwargs": {"resolution": torch.tensor([[64.0, 64.0]] * 2), "aspect_ratio": torch.ones(2, 1)}})


def dit():
    diffusers = _package("diffusers")
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2,
                                            sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=1)
    return model, lambda s: ((randn(s, 2, 4, 8, 8),), {"timestep": torch.tensor([3, 7]),
                                                        "class_labels": torch.tensor([1, 4])})


def timm_vit():
    timm = _package("timm")
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, depth=3)
    return model, lambda s: ((randn(s, 2, 3, 32, 32),), {})


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# (builder, block stacks the owner must call as leaves, in order)
REAL = {
    "transformers-Llama": (llama, ["layers"]),
    "transformers-Mamba": (mamba, ["layers"]),
    "diffusers-Flux": (flux, ["transformer_blocks", "single_transformer_blocks"]),
    "diffusers-Wan": (wan, ["blocks"]),
    "diffusers-SD3": (sd3, ["transformer_blocks"]),
    "diffusers-Sana": (sana, ["transformer_blocks"]),
    "diffusers-PixArt": (pixart, ["transformer_blocks"]),
    "diffusers-DiT": (dit, ["transformer_blocks"]),
    "timm-ViT": (timm_vit, ["blocks"]),
}


def stack_calls(model: nn.Module, stacks: list[str]) -> list[str]:
    return [f"{s}.{i}" for s in stacks for i in range(len(model.get_submodule(s)))]


def calls_into(tr: Trace, model: nn.Module, stacks: list[str]) -> list[str]:
    return [c for c in block_calls(tr, model) if c.rsplit(".", 1)[0] in stacks]


@pytest.mark.parametrize("name", list(REAL))
def test_a_real_owner_traces_in_graph_mode_with_its_blocks_as_leaves(name: str) -> None:
    build, stacks = REAL[name]
    torch.manual_seed(0)
    model, make_call = build()
    tr = assert_replays(model.train(), make_call)
    assert calls_into(tr, model, stacks) == stack_calls(model, stacks)


@pytest.mark.parametrize("name", ["transformers-Llama", "transformers-Mamba"])
def test_a_real_owner_that_makes_a_cache_in_eval_traces_and_returns_a_fresh_one(name: str) -> None:
    build, stacks = REAL[name]
    torch.manual_seed(0)
    model, make_call = build()
    model.eval()
    tr = assert_replays(model, make_call)
    assert calls_into(tr, model, stacks) == stack_calls(model, stacks)
    args, kwargs = make_call(1)
    first, second = run_graph(model, tr, args, kwargs), run_graph(model, tr, args, kwargs)

    def cache(out):  # its name differs across transformers 5.x: cache, past_key_values (Llama), cache_params (Mamba)
        names = ("cache", "past_key_values", "cache_params")
        return next(c for c in (getattr(out, n, None) for n in names) if c is not None)

    want = cache(model(*args, **kwargs))
    assert cache(first) is not cache(second) and type(cache(first)) is type(want)
    for got in (cache(first), cache(second)):  # each run starts from an empty cache, not from the last run's
        assert_identical(held_tensors(want), held_tensors(got))


def held_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor an object holds, through its attributes, lists and dicts, in a fixed order."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return [obj]
    if id(obj) in seen or isinstance(obj, (str, int, float, bool, type(None), nn.Module)):
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in held_tensors(v, seen)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in held_tensors(v, seen)]
    return held_tensors(getattr(obj, "__dict__", {}), seen)


def captured_block_calls(model: nn.Module, make_call, stacks: list[str]) -> dict[str, tuple[nn.Module, tuple, dict]]:
    """The first call of each class of block, its arguments copied as they were at the call."""
    calls, handles = {}, []
    for name in stack_calls(model, stacks):
        def hook(module, args, kwargs):
            calls.setdefault(type(module).__name__, (module, *copy.deepcopy((args, kwargs))))

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(*make_call(0)[0], **make_call(0)[1])
    for handle in handles:
        handle.remove()
    return calls


def second_input(value):
    """Another call of the same shapes: new float tensors, the same integer ones (positions, masks)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return randn(7, *value.shape).to(value.dtype)
    return value


@pytest.mark.parametrize("name", list(REAL))
def test_each_block_of_a_real_model_traces_alone_as_dar_traces_it(name: str) -> None:
    build, stacks = REAL[name]
    torch.manual_seed(0)
    model, make_call = build()
    model.train()
    calls = captured_block_calls(model, make_call, stacks)
    assert calls
    for cls, (block, *call) in calls.items():
        tr = assert_replays(block, lambda s, call=tuple(call): call if s == 0 else pytree.tree_map(second_input, call))
        assert any(n.op == "call_module" for n in tr.graph.nodes), f"{cls}: no module call recorded"
        assert set(tr.leafed) <= {"mixer"}, f"{cls}: {tr.leafed}"  # Mamba's mixer runs a scan fx cannot see through


def test_a_trace_and_the_report_made_of_it_are_frozen_and_stay_so_through_pickle_and_deepcopy():
    """Nothing writes into a trace or a report after it is made: their fields cannot be set, their tables are
    read-only, their lists are tuples; a pickled or deep-copied one is as frozen."""
    import dataclasses
    import pickle

    import routekit as rk
    from routekit.model import report_of

    model, x = Stack(), randn(0, 2, 6, DIM)
    tr = trace(model, (x,))
    report = report_of(rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))).report
    for record, tables in ((tr, ("constants", "leafed")), (report, ("candidates", "leafed"))):
        for again in (record, pickle.loads(pickle.dumps(record)), copy.deepcopy(record)):
            with pytest.raises(dataclasses.FrozenInstanceError):
                again.leafed = {}
            for name in tables:
                assert dict(getattr(again, name)) == dict(getattr(record, name))
                with pytest.raises(TypeError):
                    getattr(again, name)["added"] = 1
            assert isinstance(again.specialised, tuple)
    assert report.candidates == {"blocks": 3}


def test_dtypes_slices_and_generators_passed_to_a_forward_are_constants_not_graph_inputs():
    class Casts(nn.Module):
        def forward(self, x, dtype, part, generator):
            return x[part].to(dtype)

    bound = bind_arguments(Casts.forward, (torch.ones(4, 2), torch.float16, slice(0, 2), torch.Generator()), {})
    spec = call_spec(bound)
    assert spec.names == ("x",)
    assert set(spec.constants) == {"dtype", "part", "generator"}


def test_every_graph_input_gets_its_own_identifier_however_the_names_of_leaves_collide():
    class Many(nn.Module):
        def forward(self, a, a_0, a_0_0, a_0_1, x, x_a):
            return a[0] + a_0 + a_0_0 + a_0_1 + x["a_b"] + x_a["b"]

    t = torch.ones(2)
    spec = call_spec(bind_arguments(Many.forward, ([t], t, t, t, {"a_b": t}, {"b": t}), {}))
    assert len(spec.names) == len(set(spec.names)) == 6
    assert all(name.isidentifier() for name in spec.names), spec.names


class Store:
    """An object the forward writes into (a cache): a graph input, not a constant."""

    def __init__(self):
        self.items = {}

    def __setitem__(self, key, value):
        self.items[key] = value


def test_item_assignment_into_an_object_passed_in_is_recorded_without_specialising():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x, store):
            store["h"] = self.fc(x)
            return x + 1

    tr = trace(built(Writes), (torch.randn(2, D), Store()))
    assert tr.specialised == ()
    assert any(n.target is operator.setitem for n in tr.graph.nodes)


class Counter:
    """An object passed in whose state the forward advances (a cache's length)."""

    def __init__(self):
        self.n = 1

    def bump(self):
        self.n += 1


def test_an_attribute_keeps_the_value_it_had_when_the_forward_read_it():
    class Reads(nn.Module):
        def forward(self, x, counter):
            n = counter.n
            y = x * n  # n is a graph value now
            counter.bump()
            return y * {1: 10.0, 2: 20.0}[n]  # eager: n is still 1

    tr = trace(Reads(), (torch.ones(2), Counter()))
    assert any(s.startswith("bool() = True") for s in tr.specialised), tr.specialised


def test_the_forward_sees_fx_tracing_throughout_the_trace_as_under_fx():
    class Peeks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.seen = nn.Linear(D, D), []

        def forward(self, x):
            self.seen.append(torch.fx._symbolic_trace.is_fx_symbolic_tracing())
            h = self.fc(x) + 1
            self.seen.append(torch.fx._symbolic_trace.is_fx_symbolic_tracing())
            return h

    model = built(Peeks)
    trace(model, (torch.randn(2, D),))
    assert model.seen == [True, True]
    assert not torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def test_shape_arithmetic_the_graph_does_not_use_is_dropped():
    class Square(nn.Module):
        def forward(self, x):
            b, n, d = x.shape
            side = int(n ** 0.5)
            return x.reshape(b, side, side, d).sum(2)

    tr = trace(Square(), (torch.randn(2, 9, 4),))
    unused = [n.name for n in tr.graph.nodes if n.op in ("call_function", "call_method") and not n.users]
    assert unused == []
    assert any("int()" in s for s in tr.specialised)


# --- a value leaving a block by a side way; a forward that sets itself up on its first call -------------------

COLLECTED: list[torch.Tensor] = []


class GatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.mlp = nn.Linear(D, 4), nn.Linear(D, D)

    def forward(self, x):
        return x + self.mlp(x) * torch.sigmoid(self.router(x)).mean(-1, keepdim=True)


class Capturing(nn.Module):
    """transformers' output capturing in miniature: on its first call the forward registers a hook on the router
    inside each block that collects the router's output, marks itself set up, and returns what was collected."""

    def __init__(self, capture: bool = True):
        super().__init__()
        self.capture = capture
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(4))

    def forward(self, x):
        if self.capture and not getattr(self, "_hooks_installed", False):
            _set_up(self)
        COLLECTED.clear()
        for block in self.blocks:
            x = block(x)
        return (x, torch.cat(COLLECTED, dim=1)) if self.capture else x


def _set_up(model: Capturing) -> None:
    """Outside the forward's own code, as transformers' decorator does it."""
    for block in model.blocks:
        block.router.register_forward_hook(lambda module, args, out: COLLECTED.append(out))
    model._hooks_installed = True


def test_a_value_a_block_hands_out_by_a_hook_is_refused_not_baked_into_the_graph():
    import routekit as rk

    torch.manual_seed(0)
    model, x = Capturing(), torch.randn(2, 6, D)
    model(x)  # set up: a trace meets the hooks, and the router outputs they collect while it runs the blocks
    with pytest.raises(TraceError, match="other than through a block's return value"):
        trace(model, (x,))
    with pytest.warns(rk.FallbackWarning, match="other than through a block's return value"):
        routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))
    other = torch.randn(2, 6, D)
    rk.verify(model, routed, (other,))  # boundary mode: the routers' outputs are this input's


def test_the_same_model_without_the_side_way_traces():
    torch.manual_seed(0)
    model, x = Capturing(capture=False), torch.randn(2, 6, D)
    tr = trace(model, (x,))
    assert [n.target for n in tr.graph.nodes if n.op == "call_module"] == [f"blocks.{i}" for i in range(4)]


def test_a_trace_leaves_the_hooks_and_marks_a_first_call_sets_up_as_it_found_them():
    """A never-called model: the trace runs its set-up on a copy of the traced-through modules (the mark lands on
    the copy) while the hooks land on the user's routers; left there, the model's first real call would register
    them again and collect every router's output twice."""
    import routekit as rk

    torch.manual_seed(0)
    model, x = Capturing(), torch.randn(2, 6, D)
    with pytest.raises(TraceError):
        trace(model, (x,))
    assert all(not block.router._forward_hooks for block in model.blocks)
    assert "_hooks_installed" not in vars(model)
    rk.inspect(model, (x,))  # falls back to boundary mode, whose recording is the model's first call
    _, collected = model(x)
    assert collected.shape[1] == len(model.blocks) * x.shape[1]  # each router once


class Factories(nn.Module):
    """Sizes read off the input handed to torch's factories, in each form they take them (HunyuanVideo's
    `torch.ones(batch, video + text)`, HiDream's `torch.zeros(h, w, 3)`)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x):
        b, n = x.shape[0], x.shape[1]
        mask = torch.ones(b, n + 1, dtype=torch.bool)
        ids = torch.zeros((b, n, 3)) + torch.zeros(b, n, 3) + torch.full((b, n, 3), 2.0)
        ids = ids + torch.empty(size=(b, n, 3)).fill_(0.0)
        like = torch.zeros(x.shape) + torch.ones(*x.shape) + torch.randn(x.size()) * 0  # a size read whole, unpacked
        for block in self.blocks:
            x = block(x)
        return x, mask, ids, like


def test_torch_factories_take_sizes_the_trace_computed_and_make_them_on_every_run():
    torch.manual_seed(0)
    model = Factories()
    tr = assert_replays(model, lambda seed: ((randn(seed, 2, 5, D),), {}))
    assert tr.specialised == ()  # no size was read as a number: the graph serves any batch
    mask, ids, like = run_graph(model, tr, (randn(2, 3, 7, D),), {})[1:]
    assert mask.shape == (3, 8) and ids.shape == (3, 7, 3) and (ids == 2).all()
    assert like.shape == (3, 7, D) and (like == 1).all()


class _Encoders(nn.Module):
    """Four of torch's encoder layers after the owner's own `prefix` (a module, or a function the trace reads)."""

    def __init__(self, prefix):
        super().__init__()
        self.prefix = prefix
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
                                    for _ in range(4))

    def forward(self, x):
        x = self.prefix(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_device_type_read_leaves_its_module_eager_and_says_why():
    """diffusers' rotary tables test `freqs.device.type == "npu"`: a string read off a tensor has no graph node, so
    the module that reads it stays eager (leafed) with that reason, not fx's hidden AttributeError('node'); the
    model around it still traces, routes and verifies."""
    import routekit as rk
    from routekit.model import report_of

    class Rope(nn.Module):
        def forward(self, x):
            freqs = x * 2
            if freqs.device.type == "npu":
                freqs = freqs.float()
            return freqs

    torch.manual_seed(0)
    model, x = _Encoders(Rope()), torch.randn(2, 6, 8)
    leafed = dict(trace(model, (x,)).leafed)
    assert "prefix" in leafed and ".type = 'cpu'" in leafed["prefix"] and "node" not in leafed["prefix"]
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))
    assert report_of(routed).mode == "graph"
    rk.verify(model, routed, (x,))


@functools.lru_cache(maxsize=8)
def _cached_index(window: tuple[int, int]) -> torch.Tensor:
    return torch.arange(window[0] * window[1])


def test_an_lru_cache_keyed_by_a_traced_size_serves_the_eager_model_after_the_trace():
    """transformers' BEiT keys an lru_cached position index by sizes read off the input. The trace fills that cache
    with its proxy as the key; the original model's next eager call (and the routed model's eval) must miss it and
    compute the index anew, not compare its number with the finished trace's proxy."""
    import routekit as rk

    def position(x):  # a tuple key, as BEiT's window
        return x + _cached_index((x.shape[1], 1))[None, :, None].to(x.dtype)

    _cached_index.cache_clear()
    torch.manual_seed(0)
    model, x = _Encoders(position), torch.randn(2, 5, 8)
    trace(model, (x,))  # the cache's first entry: the trace's, keyed by its proxy of x.shape[1]
    with torch.no_grad():
        model.eval()(x)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), routed.eval()(x))
    rk.verify(model, routed, (x,))


def test_a_numpy_scalar_the_forward_computes_runs_in_the_routed_program():
    """DINOv3 draws its position jitter between numpy-computed bounds: numpy 2 writes such a constant as
    `np.float64(...)` in the generated code, which must run there."""
    np = pytest.importorskip("numpy")
    import routekit as rk

    torch.manual_seed(0)
    model, x = _Encoders(lambda x: x * np.log(np.float64(2.0))), torch.randn(2, 6, 8)
    routed = rk.apply(model, rk.Route(start=1, end=2), example_inputs=(x,))
    rk.verify(model, routed, (x,))
    assert routed.train()(x).shape == x.shape


def test_a_mask_filled_with_the_streams_finfo_traces_and_follows_a_cast_of_the_model():
    """transformers' eager attention (Gemma2's default) fills its mask with `torch.finfo(x.dtype).min`, which
    torch refuses for a traced dtype: the model fell back to boundary mode and took no DAR. The dtype is read
    on each run, so a model cast after `apply` fills its bf16 mask with bf16's minimum, as eager does."""
    import zoo

    import routekit as rk
    from routekit.model import report_of
    try:
        model, args, _ = zoo.transformers_gemma2()
    except zoo.Missing as err:
        pytest.skip(str(err))
    routed = rk.apply(model, rk.Route(start=1, end=4), residual=rk.DAR(kernel="torch"), example_inputs=args,
                      mode="graph")
    assert report_of(routed).report.mode == "graph" and report_of(routed).dar is not None
    model.to(torch.bfloat16), routed.to(torch.bfloat16)
    assert "matches DAR without routes" in rk.verify(model, routed, args).train

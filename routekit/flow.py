"""Which axes of a block's inputs hold the stream's tokens, read from the block's data flow.

A block input is per-token along an axis only where that axis meets the stream's token axis in the block's
code: elementwise or broadcast against the stream or what is made from it (a RoPE table times q, a mask added
to q·kᵀ), joined onto it, or sliced by it. Equal lengths say nothing: a caption as long as the image is
contracted by cross-attention and never meets the stream's token axis, and a (batch, width) time embedding
as long as the stream meets the channels.

So the block is run once on fake tensors (no data, no compute) whose every size is a symbol of its own, even
where two sizes are equal (torch's symbolic shapes, without "duck" sizing, which would give equal sizes one
symbol). The block's code ties symbols as it runs: a broadcast makes two sizes one, a slice or a split by the
stream's length relates them. Afterwards an input axis whose size became the stream's token count is the
stream's own tokens; one that became the token count plus another sequence's is a joint table (text and image
tokens along one axis); one the block relates to the token count otherwise (a table over the image's patches,
lined up with the stream's last tokens by length) holds part of the stream's tokens. A block that does not run
on fake tensors (code that reads values, a kernel without a shape function) gets no answer here: its inputs
are classified by probing the block itself (`sides.py`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any, Literal

import sympy
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from .graphs import Slot
from .routing import is_opaque, keys
from .state import fresh

Relation = Literal["same", "joint", "part"]


@dataclass(frozen=True)
class Tied:
    """A tensor input's token axes, as the block's data flow ties them to the stream's token axis.

    axes: the axes that hold the stream's tokens (a mask (B, 1, N, N) has two). batched: its first axis is the
    batch's (or 1, shared by it). relation: "same" (as many tokens as the stream, in its order), "joint" (the
    stream's tokens and another sequence's along one axis), "part" (fewer: the stream's tokens less some the
    block sets apart, such as the class and register tokens before the image's patches)."""

    axes: tuple[int, ...]
    batched: bool
    relation: Relation = "same"
    source: tuple | None = None  # an output that is one of the block's inputs handed on unchanged: its (slot, path)


UNREAD = Tied((), False, "same")  # an input the block's code does not read on this call: its data flow says nothing
OUTPUT = "<output>"  # the slot under which `token_axes` gives the block's own outputs (path: within its return)


def token_axes(module: nn.Module, args: tuple, kwargs: dict, stream_slot: Slot) -> dict[tuple, Tied] | None:
    """{(slot, path): Tied} for every tensor among the block's inputs (but the stream) whose axes the block ties
    to the stream's token axis, and `UNREAD` for those it never reads (position ids an attention kernel of
    another backend would read); tensors it reads and does not tie are absent. The block's outputs are there
    too, under the slot `OUTPUT` (a joint block's text output is not the stream's tokens, however many it holds).
    None where the block does not run on fake tensors with symbolic sizes, or its stream's sizes are not symbols
    (a token count of 1)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    with _quiet():  # torch logs each symbol and guard it makes, and a failure at length: an answer here, not news
        env = _unpinned(ShapeEnv)(duck_shape=False, should_record_events=False)
        mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
        mode.cache_enabled = False  # one run per block: caching its ops costs a third of the run and is never read
        sizes: dict[tuple, list[Any]] = {}
        made_by_path: dict[tuple, torch.Tensor] = {}

        def fake(slot, path, leaf):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                return leaf
            context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * leaf.dim())
            made = mode.from_tensor(leaf, symbolic_context=context)
            sizes[(slot, keys(path))] = [s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in made.shape]
            made_by_path[(slot, keys(path))] = made
            return made

        def faked(slot, value):
            return pytree.tree_map_with_path(lambda p, leaf: fake(slot, p, leaf), value, is_leaf=is_opaque)

        args, kwargs = fresh((args, kwargs))  # objects (a cache) the block writes to are copies
        fake_args = [faked(i, a) for i, a in enumerate(args)]
        fake_kwargs = {k: faked(k, v) for k, v in kwargs.items()}
        stream = sizes.get((stream_slot, ()))
        if stream is None or len(stream) != 3 or not isinstance(stream[1], sympy.Expr):
            return None
        try:
            leaves = {id(t): key for key, t in made_by_path.items()}
            with mode, torch.no_grad(), _eval(module), _unchanged(module), _no_hooks(module), _Reads(leaves) as reads:
                out = module(*fake_args, **fake_kwargs)
        except Exception:
            return None
        handed_on = {}  # outputs that are inputs, unchanged (T5's position bias, made by its first layer, passed on)
        for path, leaf in pytree.tree_flatten_with_path(out, is_leaf=is_opaque)[0]:  # what it hands out, too
            if isinstance(leaf, torch.Tensor):
                sizes[(OUTPUT, keys(path))] = [s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in leaf.shape]
                if id(leaf) in leaves:
                    handed_on[(OUTPUT, keys(path))] = leaves[id(leaf)]
    resolve = lambda e: env.replace(e) if isinstance(e, sympy.Basic) else sympy.Integer(e)  # noqa: E731
    batch, tokens = resolve(stream[0]), resolve(stream[1])
    guards = [resolve(g.expr) for g in env.guards]
    found = {key: UNREAD for key in sizes if key not in reads.seen and key != (stream_slot, ()) and key[0] != OUTPUT}
    for key, shape in sizes.items():
        if key == (stream_slot, ()) or key in found:
            continue
        axes, relations = [], []
        for axis, size in enumerate(shape):
            relation = _relation(resolve(size), tokens, guards)
            if relation is not None:
                axes.append(axis)
                relations.append(relation)
        if not axes:
            continue
        first = resolve(shape[0])
        batched = 0 not in axes and len(shape) >= 2 and (first == batch or first == 1)
        kind = "joint" if "joint" in relations else "part" if "part" in relations else "same"
        found[key] = Tied(tuple(axes), batched, kind, handed_on.get(key))
    return found



@functools.cache
def _unpinned(shape_env: type) -> type:
    """torch's ShapeEnv that leaves a size a symbol where a comparison narrows its range to one value: a block that
    tests its length against a window (Gemma2's sliding window, at 2 tokens) would pin the stream's token count to a
    number, and with it every relation the run is there to read."""

    class Unpinned(shape_env):
        def _set_replacement(self, a, tgt, msg):
            if msg == "range_refined_to_singleton":
                return None
            return super()._set_replacement(a, tgt, msg)

    return Unpinned


def _relation(size: sympy.Expr, tokens: sympy.Expr, guards: list[sympy.Expr]) -> Relation | None:
    """How an axis of `size` relates to the stream's `tokens` after the block ran, or None where it does not."""
    mine, theirs = size.free_symbols, tokens.free_symbols
    if not mine or not theirs:
        return None
    if mine & theirs:
        rest = sympy.simplify(size - tokens)
        if rest == 0:
            return "same"
        if rest.free_symbols & theirs:
            return None  # a multiple or product of the token count (tokens and channels flattened): not its tokens
        if rest.is_number:
            return "joint" if rest > 0 else "part"
        return "part" if rest.is_negative else "joint"  # another sequence's tokens beside the stream's, or fewer
    # related without being equal: an order of these two sizes alone, linear in both (a split or slice of the stream
    # by the other's length); a reshape's divisibility guard (a product, a modulo) relates sizes it never lines up
    if any(_orders(g, mine, theirs) for g in guards):
        return "part"
    return None


def _orders(guard: sympy.Basic, mine: set, theirs: set) -> bool:
    if not isinstance(guard, (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan, sympy.GreaterThan)):
        return False
    found = guard.free_symbols
    if not (found and found <= mine | theirs and found & mine and found & theirs):
        return False
    difference = guard.lhs - guard.rhs
    return difference.is_polynomial(*found) and sympy.Poly(difference, *found).total_degree() == 1


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(name) for name in ("torch.__trace", "torch._subclasses.fake_tensor",
                                                     "torch.fx.experimental.symbolic_shapes")]
    flags = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, flag in zip(loggers, flags):
            logger.disabled = flag


HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
         "_forward_hooks_always_called")


@contextlib.contextmanager
def _no_hooks(module: nn.Module):
    """The block and its modules without their forward hooks: reading the data flow is not a run of the model, and
    a user's hook (one that records activations, counts calls) must not see fake tensors or an extra call."""
    saved = [(m, name, getattr(m, name)) for m in module.modules() for name in HOOKS if getattr(m, name, None)]
    for m, name, hooks in saved:
        setattr(m, name, type(hooks)())
    try:
        yield
    finally:
        for m, name, hooks in saved:
            setattr(m, name, hooks)


@contextlib.contextmanager
def _unchanged(module: nn.Module):
    """The module as it was after the run: a value it cached on itself (a rotary table, a mask) would be fake."""
    before = [(m, {name: dict(vars(m)[name]) if isinstance(vars(m)[name], dict) else vars(m)[name] for name in vars(m)})
              for m in module.modules()]
    try:
        yield
    finally:
        for m, attributes in before:
            for name in list(vars(m)):
                if name not in attributes:
                    del vars(m)[name]
                elif isinstance(attributes[name], dict) and isinstance(vars(m)[name], dict):
                    table = vars(m)[name]
                    table.clear()
                    table.update(attributes[name])
                else:
                    vars(m)[name] = attributes[name]


class _Reads(TorchFunctionMode):
    """Which of the block's input tensors (`leaves`: {id: (slot, path)}) any torch function reads; attention
    written out (`written_out_attention`): torch's kernels for it, fused or not, may read a sequence length as a
    plain number on fake tensors (torch 2.11's does), which pins the symbols the run is there to relate."""

    def __init__(self, leaves: dict[int, tuple]):
        super().__init__()
        self.leaves, self.seen = leaves, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):  # the tensors a torch function takes: arguments, or in a list of them
            for leaf in value if isinstance(value, (list, tuple)) else (value,):
                key = self.leaves.get(id(leaf))
                if key is not None:
                    self.seen.add(key)
        if func is _SDPA:
            return written_out_attention(*args, **kwargs, product=_product)
        if func in _MATMULS and len(args) == 2 and not kwargs and min(a.dim() for a in args) >= 2 \
                and max(a.dim() for a in args) >= 3:
            return _product(*args)
        if func is F.linear and args[0].dim() >= 3:  # without a bias, torch's linear is a matmul
            call = dict(zip(("input", "weight", "bias"), args), **kwargs)
            out = _product(call["input"], call["weight"].t())
            return out if call.get("bias") is None else out + call["bias"]
        return func(*args, **kwargs)


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for batched operands as a broadcast product summed over the shared axis: torch's matmul folds the
    batch axes into one by reading their sizes as plain numbers (torch 2.11 on fake tensors), which pins the
    symbols the run is there to relate; this form only broadcasts them."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


_SDPA = F.scaled_dot_product_attention  # torch's own, whatever replaces the attribute later (verify's reference)


def written_out_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False, *, ignored=None, product=torch.matmul):
    """`scaled_dot_product_attention` as its formula, without dropout, its two products by `product`; with
    `ignored` (bool (B, S)), those keys zeroed and masked out (verify's reference: a NaN there never reaches a
    score, as NaN · 0 is NaN)."""
    if ignored is not None:
        shape = (key.shape[0],) + (1,) * (key.dim() - 3) + (key.shape[-2], 1)
        keep = ~ignored.reshape(shape)
        key, value = key.where(keep, 0.0), value.where(keep, 0.0)
    if enable_gqa and key.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    scores = product(query, key.transpose(-2, -1)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    if ignored is not None:
        scores = scores.masked_fill(~keep.transpose(-2, -1), float("-inf"))
        return product(torch.softmax(scores.float(), dim=-1).to(value.dtype).nan_to_num(0.0), value)
    return product(torch.softmax(scores.float(), dim=-1).to(value.dtype), value)


class _eval:
    """The block in eval mode for the run (no dropout draws, no running statistics updated on fake values)."""

    def __init__(self, module: nn.Module):
        self.module, self.flags = module, {m: m.training for m in module.modules()}

    def __enter__(self):
        self.module.eval()

    def __exit__(self, *exc):
        for m, flag in self.flags.items():
            m.training = flag

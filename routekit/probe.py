"""The probe stage: running or tracing blocks (and selectors) on made-up inputs, to settle what a graph leaves open.

What the owner's graph leaves open about a block (does it still run on fewer tokens? with a side input cut
or whole? what does its own code do with the stream?) is settled by calling the block by itself on
made-up inputs shaped like its recorded ones (`fake_block_inputs`), without lasting side effects. The
analysis asks while it classifies side inputs and finds residual adds; the plan asks through a `Probe`, one
question per route (`Probe.route`), and gets a frozen `RouteAnswer`, so planning itself never runs the model
and the rewrite reads everything it needs (a block traced again at a route's kept count) off the plan. What
the graph cannot show about the stream's tokens (which were not made from the image, where a later stack
holds an earlier one's) is measured here too, running the model up to a block (`tokens_not_from`,
`token_offset`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .blocks import device_of, fake_block_inputs, traced_alone
from .calls import slot_named
from .config import Route
from .findings import BlockInfo, GraphReport
from .flow import token_axes
from .graphs import Slot
from .residuals import find_residual_adds
from .routing import is_opaque, kept_tokens
from .selectors import selector as selector_spec
from .state import fresh, preserved_state, training_mode, unwrap_compiled
from .trace import Trace
from .values import TensorMeta


def block_flow(model: nn.Module, qualname: str, inputs: dict[Slot, Any], stream_slot: Slot,
               cache: dict | None = None) -> dict | None:
    """The token axes the block at `qualname` ties to its stream (`flow.token_axes`), run on made-up values of its
    recorded inputs (`inputs`: {slot: what it holds, tensors as TensorMeta}); None where its data flow cannot be
    read. With `cache`, read once for blocks of one class fed alike (they tie their inputs alike)."""
    if cache is not None:
        key = (type(model.get_submodule(qualname)), stream_slot,
               repr(sorted(inputs.items(), key=lambda item: str(item[0]))))
        if key not in cache:
            cache[key] = block_flow(model, qualname, inputs, stream_slot)
        return cache[key]
    generator = torch.Generator().manual_seed(0)
    device = device_of(model)

    def made(meta):
        if not isinstance(meta, TensorMeta):
            return meta
        if meta.dtype.is_floating_point:
            return torch.randn(meta.shape, generator=generator, dtype=meta.dtype).to(device)
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)

    values = {slot: pytree.tree_map(made, meta) for slot, meta in inputs.items()}
    args = [values[i] for i in sorted(s for s in values if isinstance(s, int))]
    if args and len(args) != max(s for s in values if isinstance(s, int)) + 1:
        return None  # positional slots with gaps: not a call this can make
    module = unwrap_compiled(model.get_submodule(qualname))[0]
    return token_axes(module, tuple(args), {k: v for k, v in values.items() if isinstance(k, str)}, stream_slot)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def block_runs(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, tokens: int,
               shrink: tuple[int, ...] = ()) -> bool:
    """Probe: does the block run as a route's block on `tokens` tokens (zeros), with no lasting side effects?"""
    return run_block(model, block, stream_slot, stream, tokens, shrink) is not None


def run_block(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, tokens: int,
              shrink: tuple[int, ...] = (), random: bool = False, shared: bool = True,
              index: torch.Tensor | None = None) -> Any:
    """The block's output as a route's block on `tokens` tokens (`fake_block_inputs`), or None where it fails;
    no lasting side effects."""
    args, kwargs = fresh(fake_block_inputs(block, stream_slot, stream, device_of(model), tokens, shrink, random, shared,
                                           index))
    with preserved_state(model, [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]):
        torch.manual_seed(0)
        try:
            return model.get_submodule(block.qualname)(*args, **kwargs)
        except Exception:
            return None


def trace_block(model: nn.Module, block: BlockInfo, stream_slot: Slot, stream: TensorMeta, out_index: int | None,
                tokens: int, shrink: tuple[int, ...] = (), shared: bool = True) -> tuple[Trace, tuple[str, ...], str]:
    """Trace one block alone on inputs as a route's blocks see them at `tokens` tokens (`blocks.traced_alone`);
    returns the trace, its residual adds (node names) and the stream's placeholder."""
    tr, start, out = traced_alone(model, block, stream_slot, stream, out_index, tokens, shrink, shared)
    return tr, tuple(n.name for n in find_residual_adds(tr.graph, start, out)), start.name


# ---- the model run up to a block: which stream tokens come from what -----------------------------------------

class _Stop(Exception):
    """Raised where a measurement has what it came for: the rest of the model does not run."""


def _stream_into(model: nn.Module, args: tuple, kwargs: dict, block: str, slot,
                 hooks: dict[str, Any] | None = None) -> torch.Tensor | None:
    """The stream entering `block` on one call, the model run in eval mode up to it (the block is not run), with
    forward hooks `hooks` ({module: hook}) in place while it runs, the random draws of a fresh seed, and no lasting
    effect on the model; None where the call does not reach the block or hands it no tensor there."""
    seen: list[Any] = []

    def capture(mod, a, kw):  # by the parameter's name: a call under checkpointing passes it by position
        at = slot_named(mod, [*range(len(a)), *kw], slot)
        seen.append(None if at is None else a[at] if isinstance(at, int) else kw[at])
        raise _Stop

    handles = [model.get_submodule(block).register_forward_pre_hook(capture, with_kwargs=True)]
    handles += [model.get_submodule(name).register_forward_hook(hook) for name, hook in (hooks or {}).items()]
    try:
        with preserved_state(model, _tensors(args, kwargs)), training_mode(model, False), torch.no_grad():
            torch.manual_seed(0)  # the same random draws on every run (preserved_state restores the streams)
            model(*args, **kwargs)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen[0] if seen and isinstance(seen[0], torch.Tensor) else None


def _other(t: torch.Tensor) -> torch.Tensor:
    """Values far from a tensor's own, the same on every call: what a measurement puts in to see what changes."""
    generator = torch.Generator(t.device).manual_seed(0)
    return torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) * 3 + 1


class LayoutPerSample(Exception):
    """The samples of one call hold their tokens not made from the image at different positions: the owner lays out
    each sample by its data (a caption of its own length, the image packed after it by the caption's mask, as
    Lumina2 does). One set of positions kept for every sample would route some sample's caption tokens."""

    def __init__(self, positions: list[list[int]]):
        self.positions = positions
        shown = "; ".join(f"sample {i}: {_runs(p)}" for i, p in enumerate(positions[:3]))
        super().__init__(
            f"the example's samples hold their tokens not made from the image at different positions ({shown}"
            f"{'; ...' if len(positions) > 3 else ''}): the owner lays out each sample by its data, as a caption of "
            "its own length with the image packed after it"
        )


def _runs(positions: list[int]) -> str:
    """Positions as runs, `[0..4, 19..20]`."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return "[" + ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs) + "]"


def tokens_not_from(model: nn.Module, args: tuple, kwargs: dict, block: str, slot, *, module: str | None = None,
                    image: torch.Tensor | None = None) -> tuple[int, ...]:
    """Positions of the stream entering `block` that depend neither on module `module`'s output nor on the
    input tensor `image` (the one given): class, register and text tokens, made from something else.

    The model runs twice up to `block`: once as it is, once with that output (or input) replaced by other
    values. A token that comes out the same both times was not made from it. Positions are counted from the
    start for the first half of the stream, from the end (negative) after. LayoutPerSample where the samples
    disagree (padding comes out the same too, so a shorter caption moves it as well as the image).
    """
    changed_args, changed_kwargs = (args, kwargs) if image is None else \
        pytree.tree_map(lambda v: _other(v) if v is image else v, (args, kwargs))
    first = _stream_into(model, args, kwargs, block, slot)
    second = _stream_into(model, changed_args, changed_kwargs, block, slot,
                          None if module is None else {module: lambda m, i, out: _other(out)})
    if first is None or second is None or first.shape != second.shape or first.dim() != 3:
        return ()
    per_sample = (first == second).flatten(2).all(-1)  # (batch, tokens)
    if not (per_sample == per_sample[:1]).all():
        raise LayoutPerSample([row.nonzero().flatten().tolist() for row in per_sample])
    same = per_sample[0]
    tokens = same.shape[0]
    return tuple(i if i < tokens / 2 else i - tokens for i in same.nonzero().flatten().tolist())


def token_offset(model: nn.Module, args: tuple, kwargs: dict, block: str, slot, source: str,
                 index: int | None) -> int | None:
    """Where the stream entering `block` holds the tokens `source` (a block called before it) handed on, as one
    run of positions: their offset, where a slice of the stream equals that output exactly (output `index` of a
    tuple); None where none does. The stream joins them with others (the text of a joint stack)."""
    seen: list[Any] = []
    stream = _stream_into(model, args, kwargs, block, slot,
                          {source: lambda m, i, out: seen.append(out if index is None else out[index])})
    part = seen[-1] if seen else None  # its last call before the block
    if stream is None or not isinstance(part, torch.Tensor) or stream.dim() != part.dim() \
            or stream.shape[0] != part.shape[0] or part.shape[1] > stream.shape[1]:
        return None
    length = part.shape[1]
    return next((o for o in range(stream.shape[1] - length + 1) if torch.equal(stream[:, o:o + length], part)), None)


def grid_cells(model: nn.Module, args: tuple, kwargs: dict, block: str, slot, grid: tuple[int, ...],
               image_tokens: list[int], *, module: str | None = None, image: torch.Tensor | None = None,
               frames_first: bool = False) -> tuple[int, ...] | None:
    """Which cell of `grid` (counted in its raster order, rows after rows) each of the stream's image tokens
    (`image_tokens`, their positions in the stream entering `block`) was made from: the grid module `module`'s
    output, or where there is none the pixels of the input `image` ((B, C, *sizes), or with `frames_first` a
    video (B, T, C, H, W), as CogVideoX takes its latents), changed one set of cells at a time.

    Grid selectors keep whole lines of the grid by stream position: lines of the image only where the tokens
    reach the blocks in an order that keeps them, which the graph does not show (an owner may reorder them after
    the patch embedding, as Hiera's mask units do). Run j changes the cells whose index has bit j set, so
    ⌈log2 cells⌉ runs besides the model's own spell each token's cell. None where they do not (a token that
    changes with no cell or more than one: an embedding that mixes tokens before the blocks, patches that
    overlap in the pixels, a nondeterministic kernel; a model that fails on the changed values): nothing is
    claimed.
    """
    cells = math.prod(grid)
    if len(image_tokens) != cells:
        return None
    if module is not None:
        where = _cell_index(grid, (1,) * len(grid))
    elif image is not None:
        patch = _patch(tuple(image.shape[1:2] + image.shape[3:] if frames_first else image.shape[2:]), grid)
        if patch is None:
            return None
        where = _cell_index(grid, patch)
        if frames_first:
            where = where.unsqueeze(1)  # (T, 1, H, W): the same cells in every channel
    else:
        return None

    def changed(mask: torch.Tensor | None) -> torch.Tensor | None:
        if mask is None:
            return _stream_into(model, args, kwargs, block, slot)
        try:  # a measurement, not the model's use: values it refuses (a range check) leave the order unmeasured
            if module is not None:
                swap = {module: lambda m, i, out: torch.where(mask.to(out.device), _other(out), out)}
                return _stream_into(model, args, kwargs, block, slot, swap)
            a, kw = pytree.tree_map(lambda v: torch.where(mask.to(v.device), _other(v), v) if v is image else v,
                                    (args, kwargs))
            return _stream_into(model, a, kw, block, slot)
        except Exception:
            return None

    base = changed(None)
    if base is None or base.dim() != 3:
        return None
    code = torch.zeros(cells, dtype=torch.long)
    for bit in range(max(1, (cells - 1).bit_length())):
        picked = (torch.arange(cells) >> bit) & 1
        stream = changed(((where >> bit) & 1).bool())
        if stream is None or stream.shape != base.shape:
            return None
        moved = (stream != base)[:, image_tokens].flatten(2).any(-1).any(0).long().cpu()
        if int(moved.sum()) != int(picked.sum()):
            return None  # a token that changed with other cells than its own, or with none
        code |= moved << bit
    return tuple(code.tolist()) if sorted(code.tolist()) == list(range(cells)) else None


def _patch(sizes: tuple[int, ...], grid: tuple[int, ...]) -> tuple[int, ...] | None:
    """The pixels per cell along each axis of an image of these sizes made into `grid`; None where they do not
    divide."""
    if len(sizes) != len(grid) or any(d % g for d, g in zip(sizes, grid)):
        return None
    return tuple(d // g for d, g in zip(sizes, grid))


def _cell_index(grid: tuple[int, ...], patch: tuple[int, ...]) -> torch.Tensor:
    """(*grid·patch) raster index of the cell each pixel (or grid point, with patch 1) lies in."""
    index = torch.arange(math.prod(grid)).reshape(grid)
    for axis, size in enumerate(patch):
        index = index.repeat_interleave(size, dim=axis)
    return index


# ---- a route's blocks, for the plan ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RouteAnswer:
    """What probing one route's blocks told, for the plan to judge: plain values, nothing live."""

    kept: int  # tokens the selector keeps (in the route's first stack)
    fails: tuple[int, ...] = ()  # blocks that fail on the kept tokens (asked where they form a smaller grid)
    rows: tuple[int, ...] = ()  # blocks that fail on a token count that is not whole grid rows
    shared: bool = False  # one selection for the batch: a block computes otherwise with a table made per sample
    bodies: tuple[BlockInfo, ...] = ()  # blocks traced again at the kept count (DAR), where their trace was shape-bound
    stuck: tuple[int, ...] = ()  # blocks that fail on whole grid rows fewer too: no selector helps them


class Probe:
    """The one place the plan's questions about a model are answered by running it (`route`). The plan holds it
    only as a `plan.Prober`: it knows what to ask, never how a block is run."""

    def __init__(self, model: nn.Module, report: GraphReport):
        self.model, self.report = model, report
        self._flops: dict[tuple, int | None] = {}  # alike blocks (class, parameters, stack) counted once per count

    def route(self, route: Route, start: int, end: int, keep: tuple[int, ...], grid, shrink: tuple[int, ...],
              bodies: bool = False) -> RouteAnswer:
        """Probe the blocks `start..end` as route `route` hands them their inputs (`keep` always kept, grid sizes
        shrunk along `shrink`): the kept count, the blocks that fail on it or on a count that is not whole rows,
        whether the route must share one selection by the batch, and with `bodies` (DAR) the blocks traced again
        at the kept count where their own trace was specialised to the full one."""
        report, model = self.report, self.model
        kept = kept_tokens(route.selector, route.rate, keep, report.stack_of(start).tokens, grid)
        counts = report.joined_counts(start, end, kept)
        first = report.blocks[start].stack
        blocks = [(b, report.stack_of(b.index), counts[b.stack - first]) for b in report.blocks[start:end + 1]]
        fails, rows, stuck = [], [], []
        for block, stack, count in blocks:
            if selector_spec(route.selector).kept_grid is not None:  # the kept tokens form a smaller grid: run on it
                failed = not block_runs(model, block, stack.stream_slot, stack.stream, count, shrink)
                if failed:
                    fails.append(block.index)
            else:  # one token fewer than the grid breaks it: it reshapes to rows
                failed = grid is not None and grid[-1] != 1 and not block_runs(
                    model, block, stack.stream_slot, stack.stream, stack.tokens - 1, shrink)
                if failed:
                    rows.append(block.index)
            if (failed and grid is not None and not any(s.grid for s in block.side_inputs)
                    and not block_runs(model, block, stack.stream_slot, stack.stream, stack.tokens - grid[-1])):
                stuck.append(block.index)  # nor a whole row fewer (handed no grid sizes): it takes the stream's count
        shared = any(self._shared(block, stack, count, shrink) for block, stack, count in blocks)
        traced = ()
        if bodies:
            traced = tuple(self._body(block, stack, count, shrink, shared) for block, stack, count in blocks
                           if block.adds and block.body is not None and block.body.specialised
                           and count != stack.tokens)
        return RouteAnswer(kept, tuple(fails), tuple(rows), shared, traced, tuple(stuck))

    def block_flops(self, block: int, tokens: int, shrink: tuple[int, ...] = ()) -> int | None:
        """Forward FLOPs of block `block` as a route's block sees `tokens` of its stack's tokens (the stream and its
        per-token side inputs cut, what else it reads whole: a joint stack's text), counted by torch's FLOP
        counter on fake tensors (nothing computed), once for alike blocks; None where the block does not run so."""
        info, stack = self.report.blocks[block], self.report.stack_of(block)
        module = self.model.get_submodule(info.qualname)
        key = (info.cls, tuple(p.shape for p in module.parameters()), info.stack, tokens, shrink)
        if key not in self._flops:
            self._flops[key] = self._count_flops(info, stack, module, tokens, shrink)
        return self._flops[key]

    def _count_flops(self, info: BlockInfo, stack, module: nn.Module, tokens: int, shrink: tuple[int, ...]):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from .flops import flop_counter_mode

        args, kwargs = fresh(fake_block_inputs(info, stack.stream_slot, stack.stream, device_of(self.model),
                                               None if tokens == stack.tokens else tokens, shrink))
        # no lasting side effects: what the block stores on itself or its inputs' objects (a cache) while it runs on
        # fake tensors is put back
        with preserved_state(self.model, _tensors(args, kwargs)):
            try:
                with FakeTensorMode(allow_non_fake_inputs=True) as mode, flop_counter_mode() as counter, \
                        torch.no_grad():
                    fake = lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
                    module(*pytree.tree_map(fake, args), **pytree.tree_map(fake, kwargs))
            except Exception:
                return None
        return counter.get_total_flops()

    def _shared(self, block: BlockInfo, stack, count: int, shrink: tuple[int, ...]) -> bool:
        """Whether the block reads a table without a batch axis (a RoPE table (N, d)) and does not compute the same
        with it made one per sample (B, N', d): probed on random inputs at the kept count, each sample keeping
        other tokens (`_differing`), against the table shared by the batch and cut at each sample's tokens. Alike
        samples would hide a block that broadcasts a per-sample table against its heads (B, H, N', d): it runs,
        wherever the batch is as large as the heads, mixing one sample's positions into another's."""
        if not any(not g.batched for s in block.side_inputs for g in s.tokens):
            return False
        stream = stack.stream
        if stream.shape[0] == 1:  # one sample shows nothing of how a block mixes samples: probe two
            stream, block = _two_samples(stream, block)
        index = _differing(stream.shape[0], count, stack.tokens)
        args = (self.model, block, stack.stream_slot, stream, count, shrink, True)
        per_sample = run_block(*args, shared=False, index=index)
        if per_sample is None:
            return True
        for row in index.unique(dim=0):
            one = run_block(*args, shared=True, index=row.expand_as(index))
            if one is None:
                return False
            mine = (index == row).all(dim=1)
            for a, b in zip(pytree.tree_leaves(one), pytree.tree_leaves(per_sample)):
                if not isinstance(a, torch.Tensor):
                    continue
                if not isinstance(b, torch.Tensor) or a.shape != b.shape:
                    return True
                if a.dim() and a.shape[0] == len(index):
                    a, b = a[mine], b[mine]
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                    return True
        return False

    def _body(self, block: BlockInfo, stack, count: int, shrink: tuple[int, ...], shared: bool) -> BlockInfo:
        """The block traced alone as the route hands it its inputs (the kept count, grid sizes shrunk, tables as
        the route cuts them), with its residual adds there: what DAR inlines into a routed graph."""
        body, adds, _ = trace_block(self.model, block, stack.stream_slot, stack.stream, stack.stream_out_index,
                                    count, shrink, shared)
        return replace(block, body=body, adds=adds)


def _differing(batch: int, count: int, tokens: int) -> torch.Tensor:
    """(batch, count) sorted indices that differ between samples where the stream has tokens to spare: the first
    count - 1 tokens for all (a route's always-kept tokens lead its streams), then one of the rest per sample."""
    last = count - 1 + torch.arange(batch) % (tokens - count + 1)
    return torch.cat([torch.arange(count - 1).expand(batch, count - 1), last[:, None]], dim=1)


def _two_samples(stream: TensorMeta, block: BlockInfo) -> tuple[TensorMeta, BlockInfo]:
    """The stream and the block's inputs of an example of one sample, made two: every tensor whose first axis is
    the batch's (1) doubled, tables without a batch axis as they are."""
    def twice(meta: Any) -> Any:
        if isinstance(meta, TensorMeta) and meta.shape and meta.shape[0] == 1:
            return TensorMeta((2, *meta.shape[1:]), meta.dtype)
        return meta

    sides = tuple(replace(s, meta=pytree.tree_map(twice, s.meta, is_leaf=is_opaque)) for s in block.side_inputs)
    return twice(stream), replace(block, side_inputs=sides)

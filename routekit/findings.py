"""What analysis finds, as frozen records: a model's stacks, blocks, their side inputs, the whole report, and how
a route cuts a side input (`Gather` a tensor's token axes, `Shrink` a grid size).

Frozen, its containers too, so nothing writes into a report after it is made: tuples for sequences, read-only
mappings (`values.read_only`) for tables, and a frozen `Trace` for a block traced alone (its fx graph, mutable
by nature, is copied by whoever rewrites it). A side input's `meta` describes a value's structure as the value
had it (a dict input is described by a dict), so it is the one container left as found.

`analyse` (analysis.py) makes a `GraphReport`; the plan, the rewrite, the hooks and `inspect` read it. The
records sit in a module of their own, below every part of the analysis that fills them in, so each part
(side inputs, tokens, residual adds) can name them without importing the analysis that calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch.utils._pytree as pytree

from .graphs import Slot
from .values import TensorMeta, pickled_fields, read_only

if TYPE_CHECKING:  # named in annotations only: the records import nothing that traces
    from .trace import Trace


class Gather(NamedTuple):
    """A tensor inside a block argument that carries the stream's tokens, at `path` (the keys and indices leading
    to it inside the argument's value; () for the argument itself). A NamedTuple of plain values, so a
    rewritten graph can hold it as a constant.

    axes: its token axes (an attention mask (B, 1, N, N) has two). batched: its first axis is the batch
    (of size B, or 1 for a table shared by the batch); otherwise it is one table for every sample, e.g. a
    RoPE table (N, d). rest_first: the token axes are longer than the stream, other tokens first (a joint
    text + image table: text rows, then image rows); otherwise the stream's tokens come first. Token axes
    shorter than the stream hold its tokens but the leading special ones (a rotary table over the image's
    patches only, which the block lines up with the stream's last tokens: `sides.image_tables`).
    """

    path: tuple
    axes: tuple[int, ...]
    batched: bool = True
    rest_first: bool = False


class Segment(NamedTuple):
    """A run of the stream's tokens of one origin, as any call lays it out: `special` (text, register, class tokens:
    not the image's, or in a later stack not the earlier stack's) or not, and its length: a count, the size of a
    call input's token axis (`(placeholder, axis)`: a caption joined in front keeps the caption's length), or None
    for the rest of the stream (the image's tokens, as many as the call's image makes)."""

    special: bool
    length: int | tuple[str, int] | None


def layout_positions(layout: tuple[Segment, ...], tokens: int, sizes: dict[str, tuple[int, ...]]) -> \
        tuple[tuple[int, ...], int] | None:
    """(the special positions, where the first run not special starts) of a stream of `tokens` tokens laid out
    as `layout`, on a call whose inputs have `sizes` ({placeholder: shape}); None where the call does not give
    every length or they do not add up. Positions count from the start before the first run not special, from
    the end after it (text in front keeps its positions at any image size, registers after the image theirs)."""
    lengths = []
    for segment in layout:
        if isinstance(segment.length, tuple):
            shape = sizes.get(segment.length[0])
            if shape is None or len(shape) <= segment.length[1]:
                return None
            lengths.append(shape[segment.length[1]])
        else:
            lengths.append(segment.length)
    known = sum(n for n in lengths if n is not None)
    rest = [i for i, n in enumerate(lengths) if n is None]
    if len(rest) > 1 or (not rest and known != tokens) or known > tokens:
        return None
    if rest:
        lengths[rest[0]] = tokens - known
    flags = [segment.special for segment, n in zip(layout, lengths) for _ in range(n)]
    first = next((i for i, f in enumerate(flags) if not f), len(flags))
    return tuple(i if i < first else i - len(flags) for i, f in enumerate(flags) if f), first


class Shrink(NamedTuple):
    """A number inside a block argument that a route changes: a grid size (height, width or frames) along the
    axis whose lines the route's selector keeps a share of (`row` keeps rows: the height shrinks). It becomes
    the kept count, read off the call: the kept grid cells (the kept tokens but the `fixed` positions every
    selection holds) over all of them, times the number passed."""

    path: tuple
    fixed: int = 0


@dataclass(frozen=True)
class SideInput:
    """A block input other than the stream, and how a route must change it.

    `meta` is what it holds (tensors as TensorMeta, inside any tuple/list/dict); `tokens` the tensors in it
    that carry the stream's tokens (gathered with a route's indices, wherever their token axes are, with or
    without a batch axis); `grid` the numbers in it that are the token grid's sizes, as (path, grid axis)
    (height and width handed to a block that reshapes its tokens to the grid).
    """

    slot: Slot
    node: str | None  # the node feeding it whole (None for a constant or a container of nodes)
    meta: Any
    tokens: tuple[Gather, ...] = ()
    grid: tuple[tuple[tuple, int], ...] = ()
    unordered: tuple[tuple, ...] = ()  # joint tables whose layout (other tokens first or last) the block hides
    collided: tuple[tuple, ...] = ()  # tensors whose last axis is as long as the stream: tokens or features, untold
    sealed: tuple[tuple, ...] = ()  # objects a route does not look into (see `is_opaque`) that hold per-token tensors
    argument: str | int | None = None  # the block's parameter it binds to, by name where the signature tells

    @property
    def kind(self) -> str:
        if self.tokens:
            return "per-token"
        if self.grid:
            return "grid"
        return "per-sample" if any(isinstance(v, TensorMeta) for v in pytree.tree_leaves(self.meta)) else "constant"

    def leaf(self, path: tuple) -> Any:
        """What it holds at `path` (keys and indices, as a `Gather`'s)."""
        meta = self.meta
        for key in path:
            meta = meta[key]
        return meta

    def describe(self) -> str:
        """One line, whatever it holds: tensors as dtype[shape], containers by their entries, an object (a cache)
        by its class, long values cut."""
        plain = (TensorMeta, tuple, list, dict, int, float, bool, str, type(None))
        meta = self.meta
        text = repr(meta) if isinstance(meta, plain) else type(meta).__name__
        return text if len(text) <= 72 else text[:69] + "..."


@dataclass(frozen=True)
class CallGrid:
    """How a grid that no module shows at run time follows from any call: the call's image sizes over `patch`
    (one per grid axis; `frames_first`: the video comes (B, T, C, H, W)), or, `patch` None, the latent sizes the
    call names. Measured on one call, a grid holds for that image size alone: boundary mode derives each call's
    grid from this (`record.grid_of_call`), graph mode plans each new shape again."""

    patch: tuple[int, ...] | None = None
    frames_first: bool = False


@dataclass(frozen=True)
class Stack:
    """One container of blocks the stream passes through. A model may chain several: Flux runs its double-stream
    blocks on the image tokens, then its single-stream blocks, where the owner (or the block) joins the text in
    front. Routes count blocks over the whole chain, and carry their kept tokens across the joins."""

    name: str
    first: int  # the chain index of its first block
    depth: int
    stream_slot: Slot
    stream_out_index: int | None
    stream: TensorMeta
    grid: tuple[int, ...] | None
    grid_node: str | None  # the node (graph mode) or module (boundary mode) the grid was read off
    special: tuple[int, ...]  # tokens not made from the image (text, register, class tokens): routes keep them
    unknown_special: str | None = None  # why the special tokens could not be told (a route must be given `keep`)
    reordered: str | None = None  # why the stream's grid lines are not the image's (grid selectors refuse it)
    joined_at: int | None = None  # where the previous stack's tokens sit in this one's stream (None: the first)
    call_grid: CallGrid | None = None  # how `grid` follows from a call, where no `grid_node` shows it
    layout: tuple[Segment, ...] | None = None  # `special` and `joined_at` for any call (None: for this call's shapes)

    @property
    def tokens(self) -> int:
        return self.stream.shape[1]

    @property
    def blocks(self) -> range:
        return range(self.first, self.first + self.depth)


class AuxRead(NamedTuple):
    """A read of a block's per-token output other than its stream (`path` within what the block returns), by
    `reader` (a node's name; a module call's is its fx name)."""

    value: str
    path: tuple
    reader: str

    def __str__(self) -> str:
        return f"{self.value} → {self.reader}"


@dataclass(frozen=True)
class BlockInfo:
    """One block of the chain, as its call appears in the graph."""

    index: int
    qualname: str
    cls: str
    node: str  # the call_module node
    stream_out: str  # the node carrying the block's stream output (the call itself or a getitem of it)
    side_inputs: tuple[SideInput, ...] = ()
    escapes: tuple[str, ...] = ()  # the stream output used besides the next block: "out → user"
    aux_escapes: tuple[AuxRead, ...] = ()  # reads of its other per-token outputs, anywhere
    adds: tuple[str, ...] | None = None  # residual adds in `body` (None: not looked for; (): hidden)
    body: Trace | None = None  # the block traced alone at the stream's token count, when adds were looked for
    checkpointed: bool = False  # the owner runs it under torch.utils.checkpoint
    stack: int = 0  # which stack of the chain it belongs to
    compiled: bool = False  # it runs under torch.compile on its own (its token axes are marked static in a route)
    residual_free: bool = False  # `body` shows no residual connection and hides none (DAR has nothing to replace)
    flow: bool = False  # its side inputs' token axes were read off its data flow (flow.py), not probed
    per_token_outputs: tuple[tuple, ...] | None = None  # paths of its outputs that hold the stream's tokens (flow)
    handed_on: tuple[tuple[tuple, tuple], ...] = ()  # (output path, (slot, path) of the input it is, unchanged)


@dataclass(frozen=True)
class GraphReport:
    """What routekit found in a model. `inspect` prints it (with a plan) and draws it. Its stream, grid and
    special tokens are the first stack's; `stacks` has each stack's own."""

    model: str
    mode: Literal["graph", "boundary"]
    stacks: tuple[Stack, ...]
    blocks: tuple[BlockInfo, ...]
    candidates: Mapping[str, int]  # every chain of blocks found, by container name: its length
    leafed: Mapping[str, str]
    specialised: tuple[str, ...]
    requested: str | None = None  # the stack= the analysis was asked for (None: the chain it found)
    fallback: str | None = None  # why the owner forward was not traced (boundary mode)
    residual: str | None = None  # "sublayer", "block" or "mixed" granularity of the adds, or why unknown
    timestep: str | None = None  # the node of the model's own e(t) (DAR's static_t queries), where one was found
    embeddings: tuple[tuple[str, str], ...] = ()  # (module, node) of each module call giving a (batch, channels) value

    def __post_init__(self):  # its containers frozen too: mappings read-only, sequences tuples
        object.__setattr__(self, "candidates", read_only(self.candidates))
        object.__setattr__(self, "leafed", read_only(self.leafed))
        object.__setattr__(self, "specialised", tuple(self.specialised))

    def __reduce__(self):
        return type(self), pickled_fields(self)

    @property
    def stack(self) -> str:
        """The stack's name, or the chain's: "transformer_blocks → single_transformer_blocks"."""
        return " → ".join(s.name for s in self.stacks)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def stack_of(self, block: int) -> Stack:
        return self.stacks[self.blocks[block].stack]

    def __getattr__(self, name: str):  # stream_slot, stream, tokens, grid, special, ...: the first stack's
        if name.startswith("__") or name == "stacks":
            raise AttributeError(name)
        return getattr(self.stacks[0], name)

    def embedding(self, module: str | None) -> str | None:
        """The node of e(t): the last call of `module` (or of a module inside it) giving a (batch, channels) value,
        or with None the one analysis found; None where there is none."""
        if module is None:
            return self.timestep
        hits = [node for target, node in self.embeddings if target == module or target.startswith(module + ".")]
        return hits[-1] if hits else None

    def joined_counts(self, start: int, end: int, count: int) -> tuple[int, ...]:
        """`count` tokens in block `start`'s stack carried through each stack up to block `end`'s: a later stack's
        stream also holds what the owner joins in before it (text in front), which a route keeps."""
        first = self.blocks[start].stack
        return tuple(count + self.stacks[t].tokens - self.stacks[first].tokens
                     for t in range(first, self.blocks[end].stack + 1))

    def block_listing(self) -> str:
        return ", ".join(f"{b.index}: {b.qualname}" for b in self.blocks)

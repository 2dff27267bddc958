"""Which input each of the stream's tokens was made from, read off a traced graph backwards along the token
axis, and the stream's layout: runs of tokens of one origin, with lengths that follow the call.

`Origins.of` gives the origin of each token (the image's, or not: text, register and class tokens); analysis
takes the tokens not made from the image for the special tokens routes keep (tokens.py). `Origins.layout`
gives the same as runs whose lengths follow a call (`findings.Segment`): a caption joined in front keeps the
length of the caption the call passes, registers their count, and the image's tokens are the rest, so a
routed model binds which tokens are special to a call of another caption length or image size without
reading any graph again.
"""

from __future__ import annotations

import operator
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from .findings import Segment
from .flow import OUTPUT
from .graphs import CATS, kind_only, meta_of, slot_value, slots, to_networkx
from .values import TensorMeta


class Origins:
    """Per token of a value along its token axis (axis 1): whether it was made from the image (the model's first
    tensor input the stream comes from: latents, pixels, token ids), or, with `source`, from that node (an earlier
    stack's stream output); None where the graph does not show it.

    Read backwards along the token axis: a `cat` along it joins its parts' tokens; a chain's block hands on the
    tokens of its stream input, any other op those of its one input that carries as many tokens (the batched
    ones before a table shared by the batch); a value none of whose inputs carry its tokens (a patch embedding's
    flatten) was made from the image if the image is among its ancestors. Only the tokens' origin counts: text
    tokens that attended to the image in a joint block are still text. Where origins meet position by position
    (text mixed in by a mask, a caption written in with `index_copy`, a reference image beside the latents
    through one patch embedding), which position holds whose is in the values, not the graph: None.
    """

    def __init__(self, graph: fx.Graph, stream_in: fx.Node, batch: int, chains: dict, source: fx.Node | None = None,
                 model: nn.Module | None = None):
        self.graph, self.batch, self.source, self.model = graph, batch, source, model
        self.flows: dict = {}  # module calls' data flow, read once per class fed alike (`probe.block_flow`)
        self.inputs = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("rk"), TensorMeta)]
        self.flow = to_networkx(graph)
        ancestors = nx.ancestors(self.flow, stream_in.name)
        self.image = None if source is not None else next(
            (n for n in self.inputs if n.name in ancestors or n is stream_in), None)
        self.stream_of = {}  # a chain block's stream output node -> its stream input
        for nodes, (slot, out_index) in chains.values():
            for node in nodes:
                out = node if out_index is None else next(
                    (u for u in node.users if u.target is operator.getitem and u.args[1] == out_index), None)
                if out is not None and isinstance(slot_value(node, slot), fx.Node):
                    self.stream_of[out] = slot_value(node, slot)
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.memo: dict[fx.Node, tuple[bool, ...] | None] = {}

    def of(self, node: fx.Node, count: int) -> tuple[bool, ...] | None:
        """The origins of `node`'s `count` tokens."""
        if node not in self.memo:
            self.memo[node] = self._written(node, count)
        return self.memo[node]

    def whole(self, node: fx.Node) -> tuple[bool, ...] | None:
        """The origins of all of a tensor's tokens (its axis 1), or None for a tensor with no token axis."""
        meta = node.meta.get("rk")
        return self.of(node, meta.shape[1]) if isinstance(meta, TensorMeta) and len(meta.shape) >= 2 else None

    def _written(self, node: fx.Node, count: int) -> tuple[bool, ...] | None:
        """`_made`, then the item assignments into the value, in order (a canvas filled per sample)."""
        writes = sorted((u for u in node.users if u.op == "call_function" and u.target is operator.setitem
                         and u.args[0] is node), key=self.order.get)
        made = self._made(node, count)
        if not writes or made is None:
            return made
        made, written = list(made), set()
        for write in writes:
            positions = _token_positions(write.args[1], count)
            value = write.args[2]
            got = self._of_value(value, len(positions)) if positions is not None and isinstance(value, fx.Node) \
                else None
            if got is None or len(got) != len(positions):
                return None
            for p, m in zip(positions, got):
                made[p] = (made[p] or m) if p in written else m
                written.add(p)
        return tuple(made)

    def _of_value(self, value: fx.Node, count: int) -> tuple[bool, ...] | None:
        """The origins of the `count` tokens a value assigned into the stream holds: a slice of some tensor's
        tokens, or a tensor of its own carrying them."""
        if value.op == "call_function" and value.target is operator.getitem \
                and isinstance(value.args[0].meta.get("rk"), TensorMeta):
            return _sliced(value, self.whole)
        return self.of(value, count) if carries(value, count) else None

    def _made(self, node: fx.Node, count: int) -> tuple[bool, ...] | None:
        batch, image = self.batch, self.image
        if self.source is not None and node is self.source:
            return (True,) * count
        if node.op == "placeholder":
            return (node is image,) * count
        if node.op == "get_attr":
            return (False,) * count
        if node in self.stream_of:
            return self.of(self.stream_of[node], count)
        parts = token_cat_parts(node, count)
        if parts is not None:
            made = [self.of(p, p.meta["rk"].shape[1]) for p in parts]
            return None if any(m is None for m in made) else sum(made, ())
        if _is_token_cat(node):  # a cat of a tuple some call returns, or of parts that do not add up: unseen
            return None
        if node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0].meta.get("rk"), TensorMeta):  # a slice of a tensor's tokens
            made = _sliced(node, self.whole)
            if made is not None and len(made) == count:
                return made
        call = node.args[0] if node.op == "call_function" and node.target is operator.getitem else node
        batched = _carriers(call, count, batch)
        if batched and call.op != "call_module" and any(
                a not in batched and a not in kind_only(call) and _sequence(a, batch) and not carries(a, count)
                for a in call.all_input_nodes):
            # another sequence written into these tokens by an op (`index_copy` of a caption into the stream, a
            # scatter, `index_put`): which positions end up whose is in the values, not the graph. A module that
            # reads both (a joint block) hands on the tokens of its input that carries as many, in place
            return None
        if not batched:
            parts = [a.meta["rk"].shape[1] for a in call.all_input_nodes if isinstance(a.meta.get("rk"), TensorMeta)
                     and len(a.meta["rk"].shape) >= 3 and a.meta["rk"].shape[0] == batch]
            if len(parts) > 1 and sum(parts) == count:  # sequences joined inside a call the graph does not open
                return None
            if image is None:
                return (False,) * count
            if image is node:
                return (True,) * count
            above = nx.ancestors(self.flow, node.name)
            if image.name not in above:
                return (False,) * count
            if any(p is not image and p.name in above and (_sequence_like(p, image) or _image_like(p, image))
                   for p in self.inputs):
                # the image and another input (a caption's sequence, a reference image, a conditioning latent) both
                # feed a value whose tokens start here: Z-Image joins image and caption per sample (`cat` along
                # axis 0 of (N, D) tensors) and pads the batch, which no token axis shows; a second frame through the
                # same patch embedding is a frame of the image's grid: which tokens are whose is not in the graph
                return None
            return (True,) * count
        fed = [a for a in batched if self._fed(a)]
        made = [self.of(a, count) for a in fed or batched]  # a table of the model's own (a position embedding
        # added to the tokens) takes nothing from any input: the tokens stay whose they were
        if len(set(made)) > 1 and node is not call:  # one output of a module fed several sequences this long
            tied = [a for a in fed or batched if self._hands_on(call, a, node.args[1])]
            if len(tied) == 1:
                return self.of(tied[0], count)
        if any(m is None for m in made) or len(set(made)) > 1:
            # tokens of different origins combined position by position (text mixed in by an indicator mask:
            # `image * (1 - m) + text * m`), or one output of a call fed several sequences this long (a joint
            # block's text and image outputs): which origin each position holds is in the values
            return None
        return made[0]

    def _hands_on(self, call: fx.Node, value: fx.Node, index: Any) -> bool:
        """Whether output `index` of the module `call` holds the tokens of its input `value`, in order: its data flow
        ties that output's token axis to the input's as the same tokens (a joint block hands on its image input's
        tokens as its image output, its text's as its text output, however long each is)."""
        if self.model is None or call.op != "call_module":
            return False
        slot = next((s for s, a in slots(call) if a is value), None)
        if slot is None:
            return False
        from .probe import block_flow  # the probe stage runs blocks; origins reads graphs, and asks it only here
        tied = block_flow(self.model, call.target, {s: meta_of(a) for s, a in slots(call)}, slot, cache=self.flows)
        found = (tied or {}).get((OUTPUT, (index,)))
        return found is not None and found.relation == "same"

    def _fed(self, node: fx.Node) -> bool:
        """Whether a call input reaches `node` (rather than the model's parameters and constants alone)."""
        if node.op == "placeholder":
            return True
        above = nx.ancestors(self.flow, node.name)
        return any(p.name in above for p in self.inputs)

    # ---- the layout: runs of one origin, with lengths that follow the call ---------------------------------

    def layout(self, node: fx.Node, count: int) -> tuple[Segment, ...] | None:
        """`node`'s tokens as runs of one origin each, each with the rule its length follows (`Segment`): read
        off the joins along the token axis, back through the ops that hand one input's tokens on in place; a
        run of special tokens is as long as the call input it was made from all along (a caption's features
        through a projection), else as long as it is (registers, a padded caption, a time token). None where a
        run's origin is not shown."""
        while True:
            if node is self.source:
                return (Segment(False, None),)
            parts = token_cat_parts(node, count)
            if parts is not None:
                runs = [self.layout(p, p.meta["rk"].shape[1]) for p in parts]
                return None if any(r is None for r in runs) else sum(runs, ())
            if node in self.stream_of:
                node = self.stream_of[node]
                continue
            made = self.of(node, count)
            if made is None:
                return None
            if all(made):
                return (Segment(False, None),)  # the image's (or the earlier stack's): the rest of the stream
            if node.op == "placeholder":
                return (Segment(True, (node.target, 1)),)
            call = node.args[0] if node.op == "call_function" and node.target is operator.getitem else node
            batched = _carriers(call, count, self.batch) if node.op != "get_attr" else []
            if len(batched) != 1:
                return (Segment(True, count),) if not any(made) else None
            node = batched[0]


def token_cat_parts(node: fx.Node, count: int) -> list[fx.Node] | None:
    """The parts of a `cat` along the token axis whose tokens add up to `count`, else None."""
    if not _is_token_cat(node) or not isinstance(node.args[0], (list, tuple)):
        return None
    parts = list(node.args[0])
    if not all(isinstance(p, fx.Node) and carries(p, p.meta["rk"].shape[1]) for p in parts) \
            or sum(p.meta["rk"].shape[1] for p in parts) != count:
        return None
    return parts


def carries(value: Any, count: int) -> bool:
    """A tensor node with `count` tokens along axis 1."""
    meta = getattr(value, "meta", {}).get("rk") if isinstance(value, fx.Node) else None
    return isinstance(meta, TensorMeta) and len(meta.shape) >= 2 and meta.shape[1] == count


def _carriers(call: fx.Node, count: int, batch: int) -> list[fx.Node]:
    """The inputs of `call` that carry its `count` tokens (not those it reads only the kind of): the batched ones
    where some are (a table shared by the batch beside them adds to every sample alike)."""
    kinds = kind_only(call)
    feeding = [a for a in call.all_input_nodes if carries(a, count) and a not in kinds]
    return [a for a in feeding if a.meta["rk"].shape[0] == batch] or feeding


def _sequence(node: fx.Node, batch: int) -> bool:
    """A floating (B, L, ...) value with L > 1: a sequence of tokens of its own (a caption's features), not a
    per-sample value broadcast over the tokens ((B, 1, D))."""
    meta = node.meta.get("rk")
    return isinstance(meta, TensorMeta) and len(meta.shape) >= 3 and meta.shape[0] == batch \
        and meta.shape[1] > 1 and meta.dtype.is_floating_point


def _image_like(node: fx.Node, image: fx.Node) -> bool:
    """A second floating input of the image's rank (a reference image, a conditioning latent): where it feeds
    the value the tokens start in with the image (a second frame through the same patch embedding, channels
    joined to the latents), which tokens hold which is measured, not read."""
    meta, own = node.meta["rk"], image.meta["rk"]
    return len(meta.shape) == len(own.shape) and meta.dtype.is_floating_point


def _sequence_like(node: fx.Node, image: fx.Node) -> bool:
    """An input that can hold tokens of its own beside the image's: a (N, D) or (B, N, D) tensor (a caption's
    features, token ids with a batch) where the image is not; a boolean mask (whose counts shape the joined
    sequence, not its tokens), a second latent shaped like the image, and a vector of timesteps or labels are not."""
    meta = node.meta["rk"]
    return len(meta.shape) in (2, 3) and len(meta.shape) != len(image.meta["rk"].shape) and meta.dtype != torch.bool


def _token_positions(index: Any, count: int) -> range | None:
    """The token positions an index into a (B, N, ...) tensor picks: `[:, a:b]`, `[i, a:b]` (one sample's) or
    `[i]` (all of one sample's); None for any other index."""
    def value(v):  # a number the trace computed is a node holding it
        return v.meta.get("rk") if isinstance(v, fx.Node) else v

    index = tuple(slice(value(i.start), value(i.stop), value(i.step)) if isinstance(i, slice) else value(i)
                  for i in (index if isinstance(index, tuple) else (index,)))
    if any(isinstance(i, slice) and not all(b is None or type(b) is int for b in (i.start, i.stop, i.step))
           for i in index):
        return None
    if not index or not (index[0] == slice(None) or type(index[0]) is int):
        return None
    if len(index) == 1:
        return range(count) if type(index[0]) is int else None
    return range(count)[index[1]] if isinstance(index[1], slice) else None


def _sliced(node: fx.Node, origin) -> tuple[bool, ...] | None:
    """The origins of the tokens `x[...]` picks (`_token_positions`), from `origin(x)`; None for another index."""
    made = origin(node.args[0])
    positions = None if made is None else _token_positions(node.args[1], len(made))
    return None if positions is None else tuple(made[p] for p in positions)


def _is_token_cat(node: fx.Node) -> bool:
    """A `cat` along the token axis (dim 1 of (B, N, ...), or -2 of (B, N, D))."""
    is_cat = (node.op == "call_function" and node.target in CATS) or (node.op == "call_method" and node.target == "cat")
    meta = node.meta.get("rk")
    if not is_cat or not isinstance(meta, TensorMeta) or len(meta.shape) < 2:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return isinstance(dim, int) and dim % len(meta.shape) == 1



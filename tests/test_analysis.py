"""Laws of analysis (routekit/analysis.py, tokens.py, sides.py, residuals.py, record.py): which chain is the block
stack, what its stream and side inputs are, which tokens are special and what grid the rest form, which adds are
residual. Small deterministic models (tests/tiny.py), one behaviour each, as users meet it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import D, Mlp, Patches, Registers, Tokens, TupleBlock, built, image, tokens, train_out
from torch import nn

import routekit as rk
from routekit.errors import ConfigError
from routekit.record import image_input
from routekit.residuals import find_residual_adds
from routekit.sides import _grid_axis, _token_axes
from routekit.trace import trace
from routekit.values import TensorMeta


class Mixer(nn.Module):
    """A block that mixes tokens (each output token reads the mean of all): where a token comes from is
    lost after it."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(x).mean(1, keepdim=True)


def test_a_side_input_holding_a_tensor_among_numbers_is_per_sample():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x, cond):
            c, weight = cond
            return x + weight * self.fc(x + c[:, None])

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Scaled() for _ in range(3))

        def forward(self, x, c):
            for block in self.blocks:
                x = block(x, (c, 0.5))
            return x

    report = rk.inspect(built(Owner), (torch.randn(2, 5, D), torch.randn(2, D)))
    (side,) = report.blocks[0].side_inputs
    assert side.kind == "per-sample", side


def test_the_report_is_frozen():
    report = rk.inspect(built(Tokens), tokens()).report
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.stack = "elsewhere"


def test_the_stack_is_the_chain_carrying_the_tokens_even_when_a_longer_chain_of_other_modules_exists():
    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.cond = nn.ModuleList(nn.Linear(D, D) for _ in range(4))  # a longer chain, on a (B, D) vector
            self.blocks = nn.ModuleList(TupleBlock() for _ in range(3))

        def forward(self, x, c):
            for layer in self.cond:
                c = layer(c)
            aux = 0
            for block in self.blocks:
                x, a = block(x)
                aux = aux + a
            return x + c[:, None], aux

    report = rk.inspect(built(Owner), (torch.randn(2, 5, D), torch.randn(2, D)))
    assert (report.stack, report.depth, report.stream_out_index) == ("blocks", 3, 0)


def test_a_stack_nested_two_modules_deep_is_found():
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Mlp() for _ in range(3))

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.body = nn.Linear(3, D), Body()

        def forward(self, x):
            h = self.embed(x)
            for block in self.body.blocks:
                h = block(h)
            return h

    report = rk.inspect(built(Owner), tokens())
    assert (report.stack, report.depth) == ("body.blocks", 3)


def test_a_stack_of_image_blocks_is_refused_with_an_analysis_error_naming_its_stream():
    class ConvBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return x + self.conv(x)

    class Convs(nn.Module):
        def __init__(self, block=ConvBlock):
            super().__init__()
            self.blocks = nn.ModuleList(block() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.raises(rk.AnalysisError, match="batch, tokens, channels"):
        rk.inspect(built(Convs), (torch.randn(2, 4, 6, 6),))
    with pytest.raises(rk.AnalysisError, match="blocks's members include torch's own Conv2d: layers, not blocks"):
        rk.inspect(built(Convs, lambda: nn.Conv2d(4, 4, 3, padding=1)), (torch.randn(2, 4, 6, 6),))


def test_the_stream_out_of_a_tuple_block_is_its_stream_item_whatever_else_reads_the_tuple():
    class Tap(nn.Module):
        """A leaf the owner hands a block's whole output to, with an axis."""

        def forward(self, out, axis):
            return out[1].sum() * 0 + axis

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, D)
            self.blocks = nn.ModuleList(TupleBlock() for _ in range(3))
            self.taps = nn.ModuleList([Tap()])

        def forward(self, x):
            h, aux = self.embed(x), 0
            for block in self.blocks:
                out = block(h)
                aux = aux + out[1]  # the aux item read first
                aux = aux + self.taps[0](out, 0)
                h = out[0]
            return h, aux

    model, x = built(Owner), tokens(n=8)
    routed = rk.apply(model, rk.Route(start=1, end=1, rate=0.5), example_inputs=x,
                      generator=torch.Generator().manual_seed(0))
    assert rk.verify(model, routed, x).outputs == 2
    assert train_out(routed, x)[0].shape == (2, 8, D)


def test_a_zero_dimensional_tensor_handed_to_the_blocks_is_a_per_sample_input():
    class Scaled(Mlp):
        def forward(self, x, scale):
            return x + scale * self.fc(self.norm(x))

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Scaled() for _ in range(3))

        def forward(self, x, scale):
            for block in self.blocks:
                x = block(x, scale)
            return x

    report = rk.inspect(built(Owner), (torch.randn(2, 5, D), torch.tensor(0.5)))
    assert [s.kind for s in report.blocks[0].side_inputs] == ["per-sample"]


def test_a_table_as_long_as_the_stream_joined_with_another_input_is_a_joint_table():
    assert _token_axes(TensorMeta((2, 3 + 6, D), torch.float32), 2, 6, D, {3}) == ((1,), True, True)
    assert _token_axes(TensorMeta((2, 6, D), torch.float32), 2, 6, D, {3}) == ((1,), True, False)


def test_a_boolean_key_padding_mask_is_cut_along_its_keys_and_a_float_table_keeps_its_features():
    """A (B, 1, 1, N) boolean mask over the stream's tokens (Krea2's) has no features: its last axis is the keys.
    A float (B, 1, N) table whose features happen to number N keeps them."""
    assert _token_axes(TensorMeta((2, 1, 1, 6), torch.bool), 2, 6, D, set()) == ((3,), True, False)
    assert _token_axes(TensorMeta((2, 1, 6), torch.float32), 2, 6, D, set()) is None


def test_the_image_is_the_first_argument_before_any_other_four_axis_input():
    """Packed latents (B, N, C) first and a text encoder's stacked layers (B, L, layers, D) beside them (Krea2):
    the latents are the image. An LM's token ids first: the one 4-D floating input is."""
    latents, text = torch.randn(2, 16, 4), torch.randn(2, 5, 3, 8)
    assert image_input((latents,), {"encoder_hidden_states": text}, 2) is latents
    ids, pixels = torch.zeros(2, 7, dtype=torch.long), torch.randn(2, 3, 8, 8)
    assert image_input((ids,), {"pixel_values": pixels}, 2) is pixels
    assert image_input((ids,), {"a": pixels, "b": pixels.clone()}, 2) is None  # two: none is the image


@pytest.mark.parametrize(("name", "axis"), [("rows", -2), ("cols", -1), ("columns", -1), ("t", -3), ("time", -3),
                                            ("height", -2), ("grid_w", -1), ("num_frames", -3), ("scale", None)])
def test_numbers_handed_to_blocks_are_grid_sizes_by_their_names(name, axis):
    assert _grid_axis(name, ()) == axis


class JointBlock(nn.Module):
    """MMDiT-like: joins text tokens before the stream, reads a joint (B, text + N, D) table. Rotates half of
    the stream's features first (a cat of the stream with itself, as rotary embeddings do)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, text, table, c):
        rotated = torch.cat([x[..., D // 2:], x[..., :D // 2]], -1)
        joint = torch.cat([text, x + rotated], 1) * table
        return x + self.fc(joint)[:, text.shape[1]:] * c[:, None]


def test_a_joint_table_is_ordered_from_the_blocks_own_join_beside_other_side_inputs():
    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(JointBlock() for _ in range(3))

        def forward(self, x, text, table, c):
            for block in self.blocks:
                x = block(x, text, table, c)
            return x

    inputs = (torch.randn(2, 6, D), torch.randn(2, 3, D), torch.randn(2, 9, D), torch.randn(2, D))
    report = rk.inspect(built(Owner), inputs)
    table = report.blocks[0].side_inputs[1]
    assert table.unordered == ()
    assert [(g.axes, g.rest_first) for g in table.tokens] == [((1,), True)]


def test_tokens_not_made_from_the_image_are_measured_special_and_the_grid_is_the_image_over_the_patch():
    model = built(Registers)
    head_runs = []
    model.head.register_forward_hook(lambda *_: head_runs.append(1))
    report = rk.inspect(model, (image(),))
    assert (report.special, report.grid) == ((0, 1), (4, 6))
    assert head_runs == [1]  # in the trace; measuring runs the model up to the first block, no further


def test_a_model_whose_patch_grid_holds_every_token_runs_again_only_to_read_their_order_and_only_up_to_the_blocks():
    """No special token to measure; the grid's order is read in 1 + ⌈log2 24⌉ runs that stop at the first block."""
    model = built(Patches)
    embeds, blocks = [], []
    model.embed.register_forward_hook(lambda *_: embeds.append(1))
    model.blocks[0].register_forward_hook(lambda *_: blocks.append(1))
    report = rk.inspect(model, (image(),))
    assert (report.grid, report.special, report.report.reordered) == ((4, 6), (), None)
    assert (len(embeds), len(blocks)) == (1 + 1 + 5, 1)  # the trace's run, the order's runs


class Patchify(nn.Module):
    """An image patchified by reshaping, no patch embedding and no token besides the image's (CogView4's and
    HiDream's image stream); with `rows=True` its tokens are no patches: each holds a whole row of one channel."""

    def __init__(self, rows: bool = False):
        super().__init__()
        self.rows = rows
        self.embed = nn.Linear(12, D)
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))

    def forward(self, image):
        b, _, h, w = image.shape
        patches = image.reshape(b, h * w // 4, 12) if self.rows else \
            image.reshape(b, 3, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 12)
        h = self.embed(patches)
        for block in self.blocks:
            h = block(h)
        return h


def test_without_a_patch_embedding_the_grid_is_the_image_over_the_patch_where_measuring_confirms_it():
    """No patch embedding and no special tokens: the grid the image makes over some patch is taken only where
    measuring finds each token made from one of its cells (it was never taken: `row` asked for grid=). Its twin,
    tokens that are rows of one channel, as many as the cells of a 4×6 grid, gets none."""
    report = rk.inspect(built(Patchify), (image(),))
    assert (report.grid, report.special, report.report.reordered) == ((4, 6), (), None)
    rk.inspect(built(Patchify), (image(),), routes=rk.Route(start=0, end=1, selector="row"))
    rows = built(Patchify, rows=True)
    assert (rk.inspect(rows, (image(),)).grid, rk.inspect(rows, (image(),)).special) == (None, ())
    with pytest.raises(ConfigError, match="grid"):
        rk.inspect(rows, (image(),), routes=rk.Route(start=0, end=1, selector="row"))


@pytest.mark.parametrize(("mode", "dar"), [("graph", None), ("graph", rk.DAR(chunk=2)), ("boundary", None)])
def test_a_grid_measured_off_the_call_follows_the_image_size_of_every_call(mode, dar):
    """The grid no patch embedding shows is measured on the call, so it holds for that image size alone. Graph mode
    analysed a call of another shape (or DAR's training trace) again with no call: the grid was lost, and `row`
    refused the first training step (CogView4 in bf16 with DAR); and a shape-generic program kept the example's
    grid for any image size (4×6 on a 2×6 image). Boundary mode kept the example's 4×6 for every call: it refused a
    2×6 image, and routed a 6×4 one on 4×6 rows. A measured grid now holds for its shapes alone in graph mode, and
    boundary mode derives each call's from the image's size over the measured patch."""
    model = built(Patchify)
    routed = rk.apply(model, rk.Route(start=0, end=1, selector="row"), residual=dar, example_inputs=(image(),),
                      mode=mode)
    routed.train()
    routed(image())
    routed(torch.randn(2, 3, 4, 12))  # a 2×6 grid
    assert (~rk.last_route_mask(routed)).reshape(2, 2, 6).all(2).sum(1).tolist() == [1, 1]
    for _ in range(4):  # a 6×4 grid: as many tokens as the example's; its rows are 4 long
        routed(torch.randn(2, 3, 12, 8))
        routed_around = rk.last_route_mask(routed).reshape(2, 6, 4)
        assert (routed_around.all(2) | ~routed_around.any(2)).all() and routed_around.all(2).sum(1).tolist() == [3, 3]


class OnePatch(nn.Module):
    """Boundary mode: one patch token (a 1×1 grid) after two learned tokens, a second image input (a control
    image: the call has no one image), a number, and blocks that mix tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 4, 4)
        self.registers = nn.Parameter(torch.randn(1, 2, D))
        self.blocks = nn.ModuleList(Mixer() for _ in range(3))

    def forward(self, image, control, scale):
        patch = self.embed(image).flatten(2).transpose(1, 2) * scale + control.mean()
        h = torch.cat([self.registers.expand(image.shape[0], -1, -1), patch], 1)
        for block in self.blocks:
            h = block(h)
        return h


def test_a_recording_measures_the_tokens_not_made_from_its_patch_embedding_at_the_first_block():
    inputs = (torch.randn(2, 3, 4, 4), torch.randn(2, 1, 4, 4), 2.0)
    report = rk.inspect(built(OnePatch), inputs, mode="boundary")
    assert (report.mode, report.grid, report.grid_node, report.special) == ("boundary", (1, 1), "embed", (0, 1))


class GatedBlock(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how, self.norm, self.fc = how, nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        branch = self.fc(self.norm(x))
        if self.how == "times":
            return x * branch
        if self.how == "mul":
            return x.mul(branch)
        if self.how == "add":
            return x.add(branch)
        return x + branch


def residual_adds(block: nn.Module, with_output: bool = True) -> list[str]:
    tr = trace(block, (torch.randn(2, 5, D),))
    start = next(n for n in tr.graph.nodes if n.op == "placeholder")
    (out,) = next(n for n in tr.graph.nodes if n.op == "output").args[0]
    return [n.target.__name__ if callable(n.target) else n.target
            for n in find_residual_adds(tr.graph, start, out if with_output else None)]


@pytest.mark.parametrize(("how", "adds"), [("times", []), ("mul", []), ("add", ["add"]), ("plus", ["add"])])
def test_residual_adds_are_sums_with_the_stream_in_any_spelling_and_never_products(how, adds):
    assert residual_adds(built(GatedBlock, how)) == adds


def test_residual_adds_without_an_output_to_end_at_are_the_chain_found():
    class PostNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(D, D), nn.LayerNorm(D)

        def forward(self, x):
            return self.norm(x + self.fc(x))

    block = built(PostNorm)
    assert residual_adds(block, with_output=True) == []  # the chain does not end at the output
    assert residual_adds(block, with_output=False) == ["add"]


class PriorAdded(nn.Module):
    """GlmImage's shape: prior tokens run through a FeedForward's list of torch layers and are added onto the
    image tokens, after an in-place write the graph cannot follow; then the blocks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, D, 2, 2)
        self.prior = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.0), nn.Linear(D, D))
        self.blocks = nn.ModuleList(Mlp() for _ in range(4))

    def forward(self, image, prior, drop):
        x = self.embed(image).flatten(2).transpose(1, 2)
        prior = self.prior(prior)
        prior[drop] *= 0.0
        x = x + prior
        for block in self.blocks:
            x = block(x)
        return x


def test_a_list_of_torch_layers_is_no_block_stack():
    args = (torch.randn(2, 3, 4, 4), torch.randn(2, 4, D), torch.zeros(2, 4, dtype=torch.bool))
    report = rk.inspect(built(PriorAdded), args)
    assert report.stack == "blocks" and len(report.blocks) == 4
    # nothing shows which tokens the image made: said, not guessed (the layers' stream kept every token before)
    assert report.stacks[0].unknown_special and "write into the tokens" in report.stacks[0].unknown_special
    routed = rk.apply(built(PriorAdded), rk.Route(start=1, end=2, keep=[]), example_inputs=args)
    rk.verify(built(PriorAdded), routed, args)


class ControlAdded(nn.Module):
    """WanVACE's shape: a control branch's blocks (a shorter stack of their own) make hints the owner adds onto the
    stream between the model's blocks, cutting the model's chain into pieces shorter than the control chain."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(6))
        self.control = nn.ModuleList(Mlp() for _ in range(3))

    def forward(self, x, c):
        hints = []
        for block in self.control:
            c = block(c)
            hints.append(c)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i % 2 == 1:
                x = x + hints[i // 2]
        return x


def test_a_stack_cut_into_pieces_by_the_owner_is_not_replaced_by_a_side_branch_silently():
    args = (torch.randn(2, 6, D), torch.randn(2, 6, D))
    with pytest.raises(rk.AnalysisError, match=r"blocks has 6 blocks that chain only 2 at a time.*stack='control'"):
        rk.inspect(built(ControlAdded), args)
    assert rk.inspect(built(ControlAdded), args, stack="control").stack == "control"  # named: as asked


def test_special_tokens_are_measured_where_the_image_reaches():
    """The prior projector's input holds none of the image: every token there looks unchanged, so the measurement
    moves on to the stack's own first block, where every token changes with the image."""
    from routekit.tokens import _measured

    args = (torch.randn(2, 3, 4, 4), torch.randn(2, 4, D), torch.zeros(2, 4, dtype=torch.bool))
    model = built(PriorAdded)
    assert _measured(model, (args, {}), (("prior.0", 0), ("blocks.0", 0)), 2, 4) == ()
    assert _measured(model, (args, {}), (("prior.0", 0),), 2, 4) is None


def test_a_named_stack_that_does_not_chain_says_why():
    """Latte's shape: a stack whose members each take a reshaped stream (the owner's code between them)."""

    class Reshaped(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Mlp() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x).flip(1)
            return x

    with pytest.raises(rk.AnalysisError, match=r"stack 'blocks' is not a chain of blocks in Reshaped \(blocks.0's "
                                               r"output reaches blocks.1 only through flip.*; chains found: none"):
        rk.inspect(built(Reshaped), torch.randn(2, 6, D), stack="blocks")


class Pool(nn.Module):
    """A stage's first block: it halves the tokens and doubles nothing else (Hiera's pooling blocks)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x.reshape(x.shape[0], -1, 2, D).mean(2))


class Staged(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Mlp(), Pool(), Mlp(), Mlp(), Mlp()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_that_change_the_streams_shape_end_the_stack_at_them():
    """One container holding stages (Hiera's blocks, pooling at each stage's start): the stack was the whole
    chain with its first block's stream, so every probe ran later blocks on the wrong shape and routes failed at
    the first training step. The stack is the longest run of blocks keeping one shape, and routes there run."""
    torch.manual_seed(0)
    model, x = Staged(), torch.randn(2, 16, D)
    routed = rk.apply(model, rk.Route(start=0, end=1), example_inputs=(x,))
    report = rk.inspect(model, (x,))
    assert [b.qualname for b in report.report.blocks] == ["blocks.2", "blocks.3", "blocks.4"]
    assert report.tokens == 8
    routed.train()
    assert routed(x).shape == (x.shape[0], 8, D)
    rk.verify(model, routed, (x,))


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool, self.blocks = Pool(), nn.ModuleList([Mlp(), Mlp()])

    def forward(self, x):
        x = self.pool(x)
        for block in self.blocks:
            x = block(x)
        return x


class Stages(nn.Module):
    """Stages each starting with a pooling block (Swin's and Hiera's layout): the outer container's members each
    change the stream's shape, and the blocks worth routing sit inside them."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(Stage() for _ in range(3))

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


def test_a_container_of_stages_or_a_container_inside_one_is_refused_saying_which():
    """Swin was refused with 'its members are not called one after another', which they are, and its
    `stack='layers.1.blocks'` with no reason. The refusals name the shape each stage changes, and that a
    container inside a member is called whole; the twin above routes a container whose run keeps its shape."""
    model, x = built(Stages), torch.randn(2, 16, D)
    with pytest.raises(rk.AnalysisError, match=r"stages.0 changes the stream's shape \(float32\[2, 16, 8\] → "
                                               r"float32\[2, 8, 8\]\), as a stage does"):
        rk.inspect(model, (x,))
    with pytest.raises(rk.AnalysisError, match=r"stack 'stages.1.blocks' is not a chain of blocks in Stages \(it "
                                               r"runs inside stages.1, which is called whole, as one member of stages"):
        rk.inspect(model, (x,), stack="stages.1.blocks")

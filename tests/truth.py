"""What each model of the zoo is, read off its code: ground truth that routekit's analysis does not produce.

For each zoo entry, written from its forward (the file and line read are named beside each declaration, paths
under site-packages): the block stacks the stream runs through; per stack, the block parameter that takes the
stream and which output gives it back, which stream positions are special (text joined into the stream,
class and register tokens) as a function of the sizes the zoo's builder takes, where the previous stack's tokens
sit in it; and each block parameter that carries the stream's tokens: the tensor inside it (`path`), its token
axes, whether its first axis is the batch, and how its token axes hold tokens (`Layout`). Every other parameter
passes whole. tests/test_truth.py holds routekit's decisions to these, and routekit's routed outputs to a route
made by hand, with hooks, from these alone.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import zoo

# How a per-token tensor's token axes hold tokens:
#   "stream": the stream's own tokens, one row each;
#   "image": the stream's last tokens only (the image's, after the special ones), lined up by length
#            (DINOv3's and EVA's rotary tables over the patches);
#   "text first": another sequence's rows first, then the stream's (Flux's rotary table over text + image);
#   "stream first": the stream's rows first, then another sequence's (HunyuanVideo's mask over video + text).
Layout = Literal["stream", "image", "text first", "stream first"]


class Sizes(dict):
    """A builder's sizes by name (batch, text, frames, height, width, size, length, tokens), read as attributes."""

    def __getattr__(self, name: str) -> int:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class PerToken:
    """A tensor inside a block argument that carries the stream's tokens: a route cuts it at the kept positions.
    `argument`: the block's parameter, or, for a keyword the block takes through **kwargs, the keyword.
    `batched`: its first axis is the batch (of size B or 1); otherwise one table for every sample. `read`: where
    its layout is read."""

    argument: str
    path: tuple = ()
    axes: tuple[int, ...] = (1,)
    layout: Layout = "stream"
    batched: bool = True
    read: str = ""


@dataclass(frozen=True)
class Stack:
    """One container of blocks the stream runs through. `stream`: the block parameter taking it; `out`: which
    output of the block is the stream (None: the block returns the stream alone); `tokens`: the stream's length;
    `special`: the positions a route always keeps; `joined`: where the previous stack's tokens sit in this one's
    stream (the rest, joined in by the owner, is special); `grid`: numbers the blocks take that are the token
    grid's sizes, as (argument, grid axis)."""

    name: str
    stream: str
    tokens: Callable[[Sizes], int]
    out: int | None = None
    per_token: tuple[PerToken, ...] = ()
    special: Callable[[Sizes], tuple[int, ...]] = lambda s: ()
    joined: Callable[[Sizes], int] | None = None
    grid: tuple[tuple[str, int], ...] = ()
    read: str = ""


@dataclass(frozen=True)
class Truth:
    """A zoo model as its code reads. `grid`: the image's token grid at these sizes (None: a sequence model);
    `route`: (start, end) over the chain of `stacks`; `options`: rk.apply's (stack=); `spatial`: the values each
    size of the image (or sequence) takes in the collision property, small enough to run on a CPU; `fixed`: sizes
    the model is built for, which a later call keeps (a position table made for one image size)."""

    build: Callable
    stacks: tuple[Stack, ...]
    grid: Callable[[Sizes], tuple[int, ...]] | None
    spatial: dict[str, tuple[int, ...]]
    route: tuple[int, int] = (1, 4)
    selector: str = "random"
    options: dict = field(default_factory=dict)
    heads: int = 2
    head_dim: int = 16
    width: int = 32
    fixed: tuple[str, ...] = ()
    temb: int | None = None  # the width of a (B, width) time embedding the blocks take, where not `width`

    def sizes(self, **given: int) -> Sizes:
        """The builder's sizes: its defaults, updated with `given`."""
        defaults = {name: p.default for name, p in inspect.signature(self.build).parameters.items()
                    if isinstance(p.default, int) and not isinstance(p.default, bool)}
        unknown = set(given) - set(defaults)
        assert not unknown, f"{self.build.__name__} takes no {sorted(unknown)}"
        return Sizes(defaults | given)

    def image_tokens(self, s: Sizes) -> int:
        return math.prod(self.grid(s)) if self.grid else self.stacks[0].tokens(s)


# ---- the diffusers models ---------------------------------------------------------------------------------------

D = "diffusers/models/transformers/"


def _flux_rope(read: str) -> tuple[PerToken, ...]:
    """A rotary table (cos, sin) over the text's ids, then the image's, no batch axis."""
    return tuple(PerToken("image_rotary_emb", (i,), (0,), "text first", batched=False, read=read) for i in (0, 1))


def _table(argument: str, axes: tuple[int, ...], layout: Layout = "stream", batched: bool = False,
           read: str = "") -> tuple[PerToken, ...]:
    """A (cos, sin) pair, both cut alike."""
    return tuple(PerToken(argument, (i,), axes, layout, batched, read) for i in (0, 1))


def _image2d(patch: int) -> Callable[[Sizes], tuple[int, int]]:
    return lambda s: (s.height // patch, s.width // patch)


def _video(patch: int) -> Callable[[Sizes], tuple[int, int, int]]:
    return lambda s: (s.frames, s.height // patch, s.width // patch)


def _n(grid: Callable[[Sizes], tuple[int, ...]], extra: Callable[[Sizes], int] = lambda s: 0) -> Callable[[Sizes], int]:
    return lambda s: math.prod(grid(s)) + extra(s)


_dit_grid = lambda s: (s.size // 2, s.size // 2)  # noqa: E731
_px2 = _image2d(2)
_tok = _image2d(1)
_IMAGE = {"height": (4, 8, 16), "width": (4, 8, 16)}  # latent pixels, patches of 2
_WIDE = {"height": (4, 8, 16, 24), "width": (4, 8, 16, 32)}  # up to 12×16 patches, as many as 6·D
_PACKED = {"height": (2, 4, 8), "width": (2, 4, 8)}  # tokens
_VIDEO = {"frames": (1, 2, 3), "height": (4, 8), "width": (4, 8)}

FLUX_DOUBLE = Stack("transformer_blocks", "hidden_states", _n(_tok), out=1,
                    per_token=_flux_rope(D + "transformer_flux.py:749 ids = cat((txt_ids, img_ids))"),
                    read=D + "transformer_flux.py:769 encoder_hidden_states, hidden_states = block(...)")
FLUX_SINGLE = Stack("single_transformer_blocks", "hidden_states", _n(_tok), out=1, joined=lambda s: 0,
                    per_token=_flux_rope(D + "transformer_flux.py:749"),
                    read=D + "transformer_flux.py:392 the block joins the text in front itself and splits it off")
CHROMA_DOUBLE = Stack("transformer_blocks", "hidden_states", _n(_tok), out=1,
                      per_token=_flux_rope(D + "transformer_chroma.py:537 ids = cat((txt_ids, img_ids))"))
CHROMA_SINGLE = Stack("single_transformer_blocks", "hidden_states", _n(_tok, lambda s: s.text),
                      special=lambda s: tuple(range(s.text)), joined=lambda s: s.text,
                      per_token=_table("image_rotary_emb", (0,), read=D + "transformer_chroma.py:537, over the "
                                       "stream the owner joins at :583 cat([encoder_hidden_states, hidden_states])"))
HUNYUAN_SIDES = (PerToken("attention_mask", (), (3,), "stream first",
                          read=D + "transformer_hunyuan_video.py:1062 (B, 1, 1, N + L): video, then text"),)

TRUTHS: dict[str, Truth] = {
    "diffusers DiT": Truth(zoo.diffusers_dit, (Stack("transformer_blocks", "hidden_states", _n(_dit_grid)),),
                           _dit_grid, {"size": (4, 8, 12)}),
    "diffusers PixArt": Truth(zoo.diffusers_pixart, (Stack("transformer_blocks", "hidden_states", _n(_px2)),),
                              _px2, _WIDE, temb=6 * 32),  # diffusers/models/attention.py:991 (B, 6·D)
    "diffusers SD3": Truth(zoo.diffusers_sd3, (Stack(
        "transformer_blocks", "hidden_states", _n(_px2), out=1,
        read=D + "transformer_sd3.py:316 encoder_hidden_states, hidden_states = block(...)"),), _px2, _IMAGE),
    "diffusers Flux": Truth(zoo.diffusers_flux, (FLUX_DOUBLE, FLUX_SINGLE), _tok, _PACKED),
    "diffusers Flux (across both stacks)": Truth(zoo.diffusers_flux, (FLUX_DOUBLE, FLUX_SINGLE), _tok, _PACKED,
                                                 route=(2, -2)),
    "diffusers Flux (single-stream stack)": Truth(zoo.diffusers_flux, (FLUX_SINGLE,), _tok, _PACKED,
                                                  options={"stack": "single_transformer_blocks"}),
    "diffusers QwenImage": Truth(zoo.diffusers_qwenimage, (Stack(
        "transformer_blocks", "hidden_states", _n(_tok), out=1,
        # (image table, text table): only the first is over the image's tokens
        per_token=(PerToken("image_rotary_emb", (0,), (0,), batched=False,
                            read=D + "transformer_qwenimage.py:296 return vid_freqs, txt_freqs"),)),), _tok, _PACKED),
    "diffusers Wan": Truth(zoo.diffusers_wan, (Stack(
        "blocks", "hidden_states", _n(_video(2)),
        per_token=_table("rotary_emb", (1,), batched=True,
                         read=D + "transformer_wan.py:413 (1, F·H·W, 1, d)")),), _video(2), _VIDEO),
    "diffusers LTX-Video (image to video)": Truth(zoo.diffusers_ltx_video, (Stack(
        "transformer_blocks", "hidden_states", _n(_video(1)),
        per_token=(PerToken("temb", read=D + "transformer_ltx.py:559 (B, F·H·W, 6·D): a timestep per token"),
                   *_table("image_rotary_emb", (1,), batched=True, read=D + "transformer_ltx.py:543")),),),
        _video(1), {"frames": (1, 2, 3), "height": (2, 4), "width": (2, 4)}),
    "diffusers CogVideoX": Truth(zoo.diffusers_cogvideox, (Stack(
        "transformer_blocks", "hidden_states", _n(_video(2)), out=0,
        per_token=_table("image_rotary_emb", (0,), read="diffusers/models/attention_processor.py:2325 applied to "
                         "query[:, :, text_seq_length:], the video's rows"),),), _video(2), _VIDEO),
    "diffusers HunyuanVideo (across both stacks)": Truth(zoo.diffusers_hunyuan_video, (
        Stack("transformer_blocks", "hidden_states", _n(_video(2)), out=0,
              per_token=HUNYUAN_SIDES + _table("freqs_cis", (0,), read=D + "transformer_hunyuan_video.py:1042")),
        Stack("single_transformer_blocks", "hidden_states", _n(_video(2)), out=0, joined=lambda s: 0,
              per_token=HUNYUAN_SIDES + _table("image_rotary_emb", (0,), read=D + "transformer_hunyuan_video.py:1042"),
              read=D + "transformer_hunyuan_video.py:553 the block joins the text after the video itself")),
        _video(2), _VIDEO, route=(2, -2)),
    "diffusers Sana": Truth(zoo.diffusers_sana, (Stack(
        "transformer_blocks", "hidden_states", _n(_px2), grid=(("height", 0), ("width", 1)),
        read=D + "sana_transformer.py:286 unflatten(1, (height, width))"),), _px2, _WIDE, selector="row",
        temb=6 * 32),  # sana_transformer.py:262 timestep.reshape(batch_size, 6, -1)
    "diffusers Chroma (across both stacks)": Truth(zoo.diffusers_chroma, (CHROMA_DOUBLE, CHROMA_SINGLE), _tok,
                                                   _PACKED, route=(2, -2)),
    "diffusers Chroma (single-stream stack)": Truth(zoo.diffusers_chroma, (CHROMA_SINGLE,), _tok, _PACKED,
                                                    options={"stack": "single_transformer_blocks"}),
    "diffusers AuraFlow": Truth(zoo.diffusers_auraflow, (Stack(
        "single_transformer_blocks", "hidden_states", _n(_px2, lambda s: 8 + s.text),
        special=lambda s: tuple(range(8 + s.text)),
        read=D + "auraflow_transformer_2d.py:443 8 registers, then the text; :467 then the image"),), _px2,
        {"height": (4, 8), "width": (4, 8)}, options={"stack": "single_transformer_blocks"}),
    "diffusers StableAudio": Truth(zoo.diffusers_stable_audio, (Stack(
        "transformer_blocks", "hidden_states", lambda s: 1 + s.length, special=lambda s: (0,),
        per_token=_table("rotary_embedding", (0,), read="diffusers/pipelines/stable_audio/pipeline_stable_audio.py:677"
                         " over latents.shape[2] + 1 rows, as the zoo's"),
        read=D + "stable_audio_transformer.py:341 cat([global_hidden_states, hidden_states])"),),
        lambda s: (s.length,), {"length": (4, 8, 16)}),
    "diffusers OmniGen": Truth(zoo.diffusers_omnigen, (Stack(
        "layers", "hidden_states", _n(_px2, lambda s: s.text + 1), special=lambda s: tuple(range(s.text + 1)),
        per_token=(PerToken("attention_mask", (), (2, 3), read=D + "transformer_omnigen.py:472 (B, 1, S, S)"),
                   *_table("image_rotary_emb", (0,), read=D + "transformer_omnigen.py:174 [0]: sample 0's table")),
        read=D + "transformer_omnigen.py:460 cat([condition_tokens, time_token, hidden_states])"),), _px2,
        {"height": (4, 8), "width": (4, 8)}),
}


# ---- transformers, timm and the zoo's own --------------------------------------------------------------------

T = "transformers/models/"
_SEQUENCE = {"tokens": (2, 4, 12, 16, 32)}
_VISION = {"size": (8, 12, 16)}  # patches of 4
_vit_grid = lambda s: (s.size // 4, s.size // 4)  # noqa: E731
_CAUSAL_MASK = PerToken("attention_mask", (), (2, 3), read=T + "llama/modeling_llama.py:382 create_causal_mask: "
                        "(B, 1, N, N) or None where attention is causal alone")


def _lm(build: Callable, stack: str, extra: tuple[PerToken, ...], read: str) -> Truth:
    return Truth(build, (Stack(stack, "hidden_states", lambda s: s.tokens,
                               per_token=(_CAUSAL_MASK, PerToken("position_ids", read=read), *extra)),),
                 None, _SEQUENCE)


TRUTHS |= {
    "transformers Llama": _lm(zoo.transformers_llama, "layers", _table(
        "position_embeddings", (1,), batched=True, read=T + "llama/modeling_llama.py:391 (1, N, d)"),
        T + "llama/modeling_llama.py:391"),
    "transformers GPT-2": _lm(zoo.transformers_gpt2, "h", (), T + "gpt2/modeling_gpt2.py:615 through the block's **kwargs"),
    "transformers Gemma3": _lm(zoo.transformers_gemma3, "layers", _table(
        "position_embeddings", (1,), batched=True, read=T + "gemma3/modeling_gemma3.py:540"),
        T + "gemma3/modeling_gemma3.py:539"),
    "transformers Gemma2 (eager attention)": _lm(zoo.transformers_gemma2, "layers", _table(
        "position_embeddings", (1,), batched=True, read=T + "gemma2/modeling_gemma2.py:438"),
        T + "gemma2/modeling_gemma2.py:443"),
    "transformers GPT-NeoX": _lm(zoo.transformers_gpt_neox, "layers", _table(
        "position_embeddings", (1,), batched=True, read=T + "gpt_neox/modeling_gpt_neox.py:345"),
        T + "gpt_neox/modeling_gpt_neox.py:349"),
    "transformers Mamba": Truth(zoo.transformers_mamba, (Stack(
        "layers", "hidden_states", lambda s: s.tokens,
        per_token=(PerToken("attention_mask", read=T + "mamba/modeling_mamba.py:820 (B, N) where padded"),)),),
        None, _SEQUENCE),
    "transformers FalconMamba (LM head)": Truth(zoo.transformers_falcon_mamba, (Stack(
        "backbone.layers", "hidden_states", lambda s: s.tokens,
        per_token=(PerToken("attention_mask", read=T + "falcon_mamba/modeling_falcon_mamba.py:805"),)),),
        None, _SEQUENCE),
    "transformers CLIP vision": Truth(zoo.transformers_clip_vision, (Stack(
        "encoder.layers", "hidden_states", lambda s: (s.size // 2) ** 2 + 1, special=lambda s: (0,),
        read=T + "clip/modeling_clip.py:213 cat([class_embeds, patch_embeds])"),), lambda s: (s.size // 2,) * 2,
        {"size": (4, 6, 8)}, fixed=("size",)),
    "transformers ViT": Truth(zoo.transformers_vit, (Stack(
        "layers", "hidden_states", _n(_vit_grid, lambda s: 1), special=lambda s: (0,),
        read=T + "vit/modeling_vit.py:147 cat((cls_tokens, embeddings))"),), _vit_grid, _VISION, fixed=("size",)),
    "transformers Dinov2 (registers)": Truth(zoo.transformers_dinov2_registers, (Stack(
        "encoder.layer", "hidden_states", _n(_vit_grid, lambda s: 5), special=lambda s: tuple(range(5)),
        read=T + "dinov2_with_registers/modeling_dinov2_with_registers.py:149 class, 4 registers, patches"),),
        _vit_grid, _VISION),
    "transformers DINOv3 (rotary over patches)": Truth(zoo.transformers_dinov3, (Stack(
        "model.layer", "hidden_states", _n(_vit_grid, lambda s: 5), special=lambda s: tuple(range(5)),
        per_token=_table("position_embeddings", (0,), "image", read=T + "dinov3_vit/modeling_dinov3_vit.py:263 "
                         "num_prefix_tokens = num_tokens - num_patches"),
        read=T + "dinov3_vit/modeling_dinov3_vit.py:89 class, 4 registers, patches"),), _vit_grid, _VISION),
    "transformers BEiT": Truth(zoo.transformers_beit, (Stack(
        "layers", "hidden_states", _n(_vit_grid, lambda s: 1), special=lambda s: (0,),
        read=T + "beit/modeling_beit.py:169 cat((cls_tokens, embeddings))"),), _vit_grid, _VISION, fixed=("size",)),
    "timm ViT": Truth(zoo.timm_vit, (Stack(
        "blocks", "x", lambda s: (s.size // 16) ** 2 + 1, special=lambda s: (0,),
        read="timm/models/vision_transformer.py:1117 cat(to_cat + [x])"),), lambda s: (s.size // 16,) * 2,
        {"size": (32, 48, 64)}, heads=6, head_dim=64, width=384, fixed=("size",)),
    "timm EVA (rotary over patches)": Truth(zoo.timm_eva, (Stack(
        "blocks", "x", _n(_vit_grid, lambda s: 3), special=lambda s: (0, 1, 2),
        per_token=(PerToken("rope", (), (0,), "image", batched=False,
                            read="timm/models/eva.py:275 applied to q[:, :, npt:], the patches"),),
        read="timm/models/eva.py:1013 class and 2 registers, then the patches"),), _vit_grid, _VISION,
        fixed=("size",)),
    "U-ViT (out-blocks)": Truth(zoo.uvit, (Stack(
        "out_blocks", "x", lambda s: 18, special=lambda s: (0, 1),
        per_token=(PerToken("skip", read="tests/zoo.py UViT.forward: skips.pop(), the in-block's stream"),),
        read="tests/zoo.py UViT.forward: cat([time, label, tokens])"),), lambda s: (4, 4), {},
        route=(1, 2), options={"stack": "out_blocks"}),
}

# Zoo entries the declarations leave out, and why.
LEFT_OUT = {
    "diffusers Flux2 (across both stacks)": "not declared yet (its builder takes no sizes): single blocks with the "
                                            "text joined in front, batched 4-axis ids",
    "diffusers HiDream (double-stream stack)": "not declared yet (its builder takes no sizes)",
    "diffusers CogView4": "not declared yet (its builder takes no sizes)",
    "diffusers Mochi": "not declared yet (its builder takes no sizes)",
    "diffusers Krea2 (padded text)": "not declared yet (its builder takes no sizes)",
    "diffusers Lumina2": "boundary mode: each sample's caption sits where its mask says, no one layout per stack",
    "transformers Qwen3-MoE (router logits)": "boundary mode: the decisions adapter reads graph-mode programs",
    "transformers RWKV": "boundary mode: the decisions adapter reads graph-mode programs",
}
assert set(TRUTHS) | set(LEFT_OUT) == set(zoo.ZOO) and not set(TRUTHS) & set(LEFT_OUT)

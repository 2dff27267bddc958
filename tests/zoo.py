"""Models people train today, built from small configs with random weights (no downloads).

Each builder returns (model, example args, example kwargs). A package that is absent (or, like timm
without torchvision, does not import) makes the builder raise `Missing` with the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


class Missing(Exception):
    """The package a model needs is not usable here."""


def package(name: str):
    try:
        return importlib.import_module(name)
    except Exception as err:  # timm raises ModuleNotFoundError (torchvision), a broken torchvision RuntimeError
        raise Missing(f"{name} is not usable here ({type(err).__name__}: {err})") from None


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(batch: int, *steps: float, dtype=None) -> torch.Tensor:
    """One timestep (or label) per sample: the zoo's values, cycled over the batch."""
    return torch.tensor([steps[i % len(steps)] for i in range(batch)], dtype=dtype)


def _padded(batch: int, text: int) -> torch.Tensor:
    """A caption mask: every other sample's last two tokens padded ([[1]*5, [1, 1, 1, 0, 0]] at the zoo's sizes)."""
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1::2, max(text - 2, 1):] = 0
    return mask


def diffusers_dit(batch: int = 2, size: int = 8):
    """`size`: the latent's side (DiT unpatchifies a square, side read off the token count)."""
    model = package("diffusers").DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=6, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10, norm_num_groups=1)
    return model, (torch.randn(batch, 4, size, size, generator=_g()),), {
        "timestep": _steps(batch, 3, 7, dtype=torch.long), "class_labels": _steps(batch, 1, 4, dtype=torch.long)}


def diffusers_pixart(batch: int = 2, text: int = 5, height: int = 8, width: int = 8):
    model = package("diffusers").PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=6, sample_size=8,
        patch_size=2, cross_attention_dim=32, caption_channels=24, norm_num_groups=1)
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "timestep": _steps(batch, 3, 7, dtype=torch.long),
              "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    return model, (torch.randn(batch, 4, height, width, generator=_g()),), kwargs


def diffusers_sd3(batch: int = 2, text: int = 5, height: int = 8, width: int = 8):
    """`height`, `width`: the latent's, up to 16 (its position table covers 8×8 patches)."""
    model = package("diffusers").SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=6, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=8)
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "pooled_projections": torch.randn(batch, 16, generator=_g(2)), "timestep": _steps(batch, 3.0, 7.0)}
    return model, (torch.randn(batch, 4, height, width, generator=_g()),), kwargs


def flux_inputs(batch: int, height: int, width: int, text: int, channels: int = 16, joint: int = 24, pooled: int = 16,
                device="cpu", generator: torch.Generator | None = None):
    """FLUX's call: packed latent tokens (batch, height·width, channels), text tokens, the positions of both."""
    g = generator or _g()
    img_ids = torch.zeros(height, width, 3)
    img_ids[..., 1] = torch.arange(height)[:, None]
    img_ids[..., 2] = torch.arange(width)[None, :]
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, joint, generator=g),
              "pooled_projections": torch.randn(batch, pooled, generator=g),
              "timestep": torch.rand(batch, generator=g), "img_ids": img_ids.flatten(0, 1),
              "txt_ids": torch.zeros(text, 3)}
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    return (torch.randn(batch, height * width, channels, generator=g).to(device),), kwargs


def diffusers_flux(batch: int = 2, text: int = 5, height: int = 4, width: int = 4):
    """`height`, `width`: the packed latent's, in tokens."""
    model = package("diffusers").FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=6, num_single_layers=6, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    args, kwargs = flux_inputs(batch, height, width, text)
    return model, args, kwargs


def diffusers_flux2():
    model = package("diffusers").Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=4, num_single_layers=6, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))
    batch, height, width, text = 2, 4, 4, 5
    # its pipeline's ids: four axes (time, row, column, text position), batched
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text))
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "timestep": torch.tensor([0.3, 0.7]), "guidance": torch.tensor([4.0, 4.0]),
              "img_ids": img_ids[None].expand(batch, -1, -1), "txt_ids": txt_ids[None].expand(batch, -1, -1)}
    return model, (torch.randn(batch, height * width, 16, generator=_g()),), kwargs


def diffusers_qwenimage(batch: int = 2, text: int = 5, height: int = 4, width: int = 4):
    """`height`, `width`: the packed latent's, in tokens (patches of 2×2×4)."""
    model = package("diffusers").QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=6, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6))
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "encoder_hidden_states_mask": torch.ones(batch, text, dtype=torch.long),
              "timestep": _steps(batch, 0.3, 0.7), "img_shapes": [[(1, height, width)]] * batch}
    return model, (torch.randn(batch, height * width, 16, generator=_g()),), kwargs


def diffusers_zimage():
    """Not in the zoo's table: each sample's stream is its image tokens, then its caption's padded to 32
    (`cat` along axis 0 of (N, D) tensors, then `pad_sequence`), which the graph does not show token by token;
    routes need `keep` (tests/test_special.py). Its rotary helper, a plain object, fills a cache on first use."""
    model = package("diffusers").ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=6, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=24, axes_dims=[4, 6, 6], axes_lens=[128, 32, 32])
    images = [torch.randn(4, 1, 16, 16, generator=_g(k)) for k in range(2)]  # 8×8 patches: 64 tokens a sample
    captions = [torch.randn(5, 24, generator=_g(2 + k)) for k in range(2)]
    return model, (images, torch.tensor([0.3, 0.7]), captions), {}


def diffusers_wan(batch: int = 2, text: int = 5, frames: int = 2, height: int = 8, width: int = 8):
    """`frames`, `height`, `width`: the latent video's (patches of 1×2×2)."""
    model = package("diffusers").WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=16, ffn_dim=64, num_layers=6, rope_max_seq_len=32)
    kwargs = {"timestep": _steps(batch, 3, 7, dtype=torch.long),
              "encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1))}
    return model, (torch.randn(batch, 4, frames, height, width, generator=_g()),), kwargs


def diffusers_ltx_video(batch: int = 2, text: int = 5, frames: int = 2, height: int = 4, width: int = 4):
    """As its image-to-video pipeline calls it: latents packed (B, F·H·W, C), one timestep per token, 0 on the
    conditioning frame's tokens (a per-token side input every routed block must get cut)."""
    model = package("diffusers").LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=16,
        cross_attention_dim=32, num_layers=6, caption_channels=24)
    latents = torch.randn(batch, 4, frames, height, width, generator=_g()).permute(0, 2, 3, 4, 1).flatten(1, 3)
    conditioning = torch.zeros(batch, frames * height * width)
    conditioning[:, :height * width] = 1.0  # the first latent frame is the image
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "timestep": _steps(batch, 300.0, 700.0)[:, None] * (1 - conditioning),
              "encoder_attention_mask": _padded(batch, text),
              "num_frames": frames, "height": height, "width": width, "rope_interpolation_scale": (8 / 25, 32, 32)}
    return model, (latents,), kwargs


def diffusers_cogvideox(batch: int = 2, text: int = 5, frames: int = 2, height: int = 8, width: int = 8):
    """Text joined to the video in the patch embedding and split off before the blocks, which join the two again
    inside attention and the feed-forward; 3D rotary table as its pipeline builds it. `frames`, `height`, `width`:
    the latent video's (patches of 2×2)."""
    diffusers = package("diffusers")
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
        text_embed_dim=24, num_layers=6, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        max_text_seq_length=5, use_rotary_positional_embeddings=True)
    grid = (height // 2, width // 2)
    rope = get_3d_rotary_pos_embed(embed_dim=16, crops_coords=((0, 0), grid), grid_size=grid, temporal_size=frames)
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "timestep": _steps(batch, 300, 700, dtype=torch.long), "image_rotary_emb": rope}
    return model, (torch.randn(batch, frames, 4, height, width, generator=_g()),), kwargs  # (B, F, C, H, W)


def diffusers_hunyuan_video(batch: int = 2, text: int = 5, frames: int = 2, height: int = 8, width: int = 8):
    """Its blocks take a boolean mask over the video tokens joined with the text's, (B, 1, 1, N + L), made by
    `torch.ones(batch, N + L)` in the owner forward: a route cuts the mask's video part. `frames`, `height`,
    `width`: the latent video's (patches of 1×2×2)."""
    model = package("diffusers").HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=6,
        num_single_layers=6, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=24, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))
    kwargs = {"timestep": _steps(batch, 300.0, 700.0),
              "encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "encoder_attention_mask": _padded(batch, text),
              "pooled_projections": torch.randn(batch, 16, generator=_g(2)), "guidance": _steps(batch, 6000.0)}
    return model, (torch.randn(batch, 4, frames, height, width, generator=_g()),), kwargs


def diffusers_hidream():
    """A mixture of experts in every block, Llama's hidden states of each layer handed to the block of that
    index, and `hidden_states.device` read off each block's output (a read a route may pass)."""
    layers = 6
    model = package("diffusers").HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=layers, num_single_layers=layers, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[24, 20], text_emb_dim=16, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16), llama_layers=list(range(2 * layers)))
    kwargs = {"timesteps": torch.tensor([300, 700]), "encoder_hidden_states_t5": torch.randn(2, 5, 24, generator=_g(1)),
              "encoder_hidden_states_llama3": torch.randn(2 * layers, 2, 5, 20, generator=_g(2)),
              "pooled_embeds": torch.randn(2, 16, generator=_g(3))}
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), kwargs


def diffusers_cogview4():
    """Latents patchified by reshaping (no patch embedding shows the grid), text in a stream of its own."""
    model = package("diffusers").CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=6, attention_head_dim=16, num_attention_heads=2,
        text_embed_dim=24, time_embed_dim=32, condition_dim=16, pos_embed_max_size=16, sample_size=8,
        rope_axes_dim=(32, 32))
    kwargs = {"encoder_hidden_states": torch.randn(2, 5, 24, generator=_g(1)), "timestep": torch.tensor([300, 700]),
              "original_size": torch.tensor([[64.0, 64.0]] * 2), "target_size": torch.tensor([[64.0, 64.0]] * 2),
              "crop_coords": torch.tensor([[0.0, 0.0]] * 2)}
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), kwargs


def diffusers_mochi():
    """Video frames embedded one by one (a Conv2d over batch × frames): no patch embedding output shows the
    T×H×W grid, the call's latents over the patch do."""
    model = package("diffusers").MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=6, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=32, time_embed_dim=16, max_sequence_length=8)
    kwargs = {"encoder_hidden_states": torch.randn(2, 5, 32, generator=_g(1)), "timestep": torch.tensor([300, 700]),
              "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    return model, (torch.randn(2, 4, 2, 8, 8, generator=_g()),), kwargs


def diffusers_sana(batch: int = 2, text: int = 5, height: int = 8, width: int = 8):
    model = package("diffusers").SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=6,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
        sample_size=8, patch_size=2)
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "timestep": _steps(batch, 3, 7, dtype=torch.long)}
    return model, (torch.randn(batch, 4, height, width, generator=_g()),), kwargs


def diffusers_omnigen(batch: int = 2, text: int = 5, height: int = 8, width: int = 8):
    """OmniGen fills its mask with `torch.finfo(dtype).min` and casts its time token `type_as` the image. Its
    own collator makes the mask and positions, every other prompt left-padded by two."""
    diffusers = package("diffusers")
    from diffusers.pipelines.omnigen.processor_omnigen import OmniGenCollator
    model = diffusers.OmniGenTransformer2DModel(
        in_channels=4, patch_size=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, num_layers=6, pad_token_id=0, vocab_size=64, pos_embed_max_size=16, time_step_dim=32,
        rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8})
    mask = _padded(batch, text).flip(1)
    collator = OmniGenCollator(pad_token_id=0, hidden_size=32)
    image = [(height // 2) * (width // 2)] * batch
    kwargs = {"timestep": _steps(batch, 0.3, 0.7),
              "input_ids": torch.randint(1, 64, (batch, text), generator=_g(1)) * mask, "input_img_latents": [],
              "input_image_sizes": {}, "attention_mask": collator.create_mask(mask, image)[0],
              "position_ids": collator.create_position(mask, image)}
    return model, (torch.randn(batch, 4, height, width, generator=_g()),), kwargs


def diffusers_lumina2():
    model = package("diffusers").Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=6, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
        cap_feat_dim=24)
    kwargs = {"timestep": torch.tensor([0.3, 0.7]), "encoder_hidden_states": torch.randn(2, 5, 24, generator=_g(1)),
              "encoder_attention_mask": torch.ones(2, 5, dtype=torch.bool)}
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), kwargs


def diffusers_chroma(batch: int = 2, text: int = 5, height: int = 4, width: int = 4):
    """`height`, `width`: the packed latent's, in tokens."""
    model = package("diffusers").ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=4, num_single_layers=6, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
        approximator_layers=1)
    args, kwargs = flux_inputs(batch, height, width, text)
    del kwargs["pooled_projections"]
    return model, args, kwargs


def diffusers_auraflow(batch: int = 2, text: int = 5, height: int = 8, width: int = 8):
    """`height`, `width`: the latent's, up to 16 (its position table covers 8×8 patches)."""
    model = package("diffusers").AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=6, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32, out_channels=4, pos_embed_max_size=64)
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "timestep": _steps(batch, 3.0, 7.0)}
    return model, (torch.randn(batch, 4, height, width, generator=_g()),), kwargs


def diffusers_krea2():
    """Packed latents (B, N, C) first, the text encoder's stacked layers (B, L, layers, D) beside them (a 4-D
    floating input that is not the image), the text joined in front of the image tokens, and a boolean
    key-padding mask (B, 1, 1, L + N) the owner builds over both: one sample's text padded."""
    diffusers = package("diffusers")
    if not hasattr(diffusers, "Krea2Transformer2DModel"):
        raise Missing(f"diffusers {diffusers.__version__} has no Krea2Transformer2DModel")
    from diffusers.pipelines.krea2.pipeline_krea2 import Krea2Pipeline

    model = diffusers.Krea2Transformer2DModel(
        in_channels=16, num_layers=6, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=24, num_text_layers=3, text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=48, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6))
    kwargs = {"encoder_hidden_states": torch.randn(2, 5, 3, 24, generator=_g(1)), "timestep": torch.tensor([0.3, 0.7]),
              "position_ids": Krea2Pipeline.prepare_position_ids(5, 4, 4, "cpu"),
              "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)}
    return model, (torch.randn(2, 16, 16, generator=_g()),), kwargs


def diffusers_stable_audio(batch: int = 2, text: int = 5, length: int = 16):
    """`length`: the latent audio's, in tokens."""
    diffusers = package("diffusers")
    model = diffusers.StableAudioDiTModel(
        sample_size=16, in_channels=4, num_layers=6, attention_head_dim=16, num_attention_heads=2,
        num_key_value_attention_heads=1, out_channels=4, cross_attention_dim=32, time_proj_dim=16,
        global_states_input_dim=24, cross_attention_input_dim=24)
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    # as its pipeline calls it: the rotary table covers the global (duration) token the model prepends, then audio
    rotary = get_1d_rotary_pos_embed(8, length + 1, use_real=True, repeat_interleave_real=False)
    kwargs = {"timestep": _steps(batch, 3.0, 7.0), "encoder_hidden_states": torch.randn(batch, text, 24, generator=_g(1)),
              "global_hidden_states": torch.randn(batch, 1, 24, generator=_g(2)), "rotary_embedding": rotary}
    return model, (torch.randn(batch, 4, length, generator=_g()),), kwargs


def transformers_llama(batch: int = 2, tokens: int = 12):
    t = package("transformers")
    config = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return t.LlamaModel(config), (torch.randint(0, 64, (batch, tokens), generator=_g()),), {}


def transformers_gemma2(batch: int = 2, tokens: int = 12):
    """Gemma2 as configured by default: eager attention, whose mask transformers fills with
    `torch.finfo(dtype).min`, and a sliding window on every other layer."""
    t = package("transformers")
    config = t.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                            sliding_window=4)
    return t.Gemma2Model(config), (torch.randint(0, 64, (batch, tokens), generator=_g()),), {}


def transformers_qwen3_moe():
    """A mixture of experts asked for its router logits: transformers collects them with forward hooks on the
    routers inside the blocks, a side way out of a block a traced graph cannot repeat (boundary mode)."""
    t = package("transformers")
    config = t.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                              num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                              output_router_logits=True)
    return t.Qwen3MoeForCausalLM(config), (torch.randint(0, 64, (2, 12), generator=_g()),), {}


def transformers_falcon_mamba(batch: int = 2, tokens: int = 12):
    """An LM whose head casts the logits to fp32: in bf16 its output is wider than the sums behind it."""
    t = package("transformers")
    config = t.FalconMambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=6, expand=2)
    return t.FalconMambaForCausalLM(config), (torch.randint(0, 64, (batch, tokens), generator=_g()),), {}


def transformers_gpt2(batch: int = 2, tokens: int = 12):
    t = package("transformers")
    config = t.GPT2Config(vocab_size=64, n_embd=32, n_layer=6, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    return t.GPT2Model(config), (torch.randint(0, 64, (batch, tokens), generator=_g()),), {}


def transformers_gpt_neox(batch: int = 2, tokens: int = 12):
    t = package("transformers")
    config = t.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64)
    return t.GPTNeoXModel(config), (torch.randint(0, 64, (batch, tokens), generator=_g()),), {}


def transformers_gemma3(batch: int = 2, tokens: int = 12):
    t = package("transformers")
    config = t.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                sliding_window=8)
    return t.Gemma3TextModel(config), (torch.randint(0, 64, (batch, tokens), generator=_g()),), {}


def transformers_rwkv():
    t = package("transformers")
    config = t.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=6, attention_hidden_size=32,
                          intermediate_size=64, context_length=32)
    return t.RwkvModel(config), (torch.randint(0, 64, (2, 12), generator=_g()),), {}


def transformers_vit(batch: int = 2, size: int = 16):
    """`size`: the image's side (patches of 4; its position table is made for that size)."""
    t = package("transformers")
    config = t.ViTConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=64,
                         image_size=size, patch_size=4)
    return t.ViTModel(config, add_pooling_layer=False), (torch.randn(batch, 3, size, size, generator=_g()),), {}


def transformers_clip_vision(batch: int = 2, size: int = 8):
    """`size`: the image's side (patches of 2; its position table is made for that size)."""
    t = package("transformers")
    config = t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                                num_channels=3, image_size=size, patch_size=2, projection_dim=32)
    return t.CLIPVisionModel(config), (torch.randn(batch, 3, size, size, generator=_g()),), {}


def transformers_dinov2_registers(batch: int = 2, size: int = 16):
    """`size`: the image's side (patches of 4)."""
    t = package("transformers")
    config = t.Dinov2WithRegistersConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                                         intermediate_size=64, image_size=16, patch_size=4, num_register_tokens=4)
    return t.Dinov2WithRegistersModel(config), (torch.randn(batch, 3, size, size, generator=_g()),), {}


def transformers_dinov3(augment: bool = True, batch: int = 2, size: int = 16):
    """DINOv3's rotary table covers the patches alone; its blocks line it up with the stream's last tokens by
    length. Two heads and a batch of two: a per-sample table broadcast against the heads runs, mixing samples.
    `augment`: the position jitter, shift and rescale it draws in training (off: the table is a function of
    the image's size alone)."""
    t = package("transformers")
    if not hasattr(t, "DINOv3ViTConfig"):
        raise Missing(f"transformers {t.__version__} has no DINOv3")
    extra = {} if augment else {"pos_embed_shift": None, "pos_embed_jitter": None, "pos_embed_rescale": None}
    config = t.DINOv3ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                               image_size=16, patch_size=4, num_register_tokens=4, **extra)
    return t.DINOv3ViTModel(config), (torch.randn(batch, 3, size, size, generator=_g()),), {}


def transformers_beit(bias_per_layer: bool = False, batch: int = 2, size: int = 16):
    """BEiT as configured by default (no relative position bias), or with a relative position bias of each
    layer's own, an (N, N) table over the stream's tokens that a route cannot cut."""
    t = package("transformers")
    extra = {"use_relative_position_bias": True} if bias_per_layer else {}
    config = t.BeitConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
                          image_size=size, patch_size=4, vocab_size=64, **extra)
    return t.BeitModel(config), (torch.randn(batch, 3, size, size, generator=_g()),), {}


def transformers_mamba(batch: int = 2, tokens: int = 12):
    t = package("transformers")
    config = t.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=6, expand=2)
    return t.MambaModel(config), (torch.randint(0, 64, (batch, tokens), generator=_g()),), {}


def timm_vit(batch: int = 2, size: int = 64):
    """`size`: the image's side (patches of 16: 1 + 4×4 tokens at 64)."""
    timm = package("timm")
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=size, depth=6)
    return model, (torch.randn(batch, 3, size, size, generator=_g()),), {}


def timm_eva(batch: int = 2, size: int = 16):
    """EVA with a rotary table over the patches alone, which its attention applies after a fixed count of
    prefix tokens (class and 2 registers). `size`: the image's side (patches of 4)."""
    timm = package("timm")
    model = timm.models.eva.Eva(img_size=size, patch_size=4, embed_dim=32, depth=6, num_heads=2, mlp_ratio=2.0,
                                use_rot_pos_emb=True, use_abs_pos_emb=False, num_reg_tokens=2, num_classes=0)
    return model, (torch.randn(batch, 3, size, size, generator=_g()),), {}


class UViT(nn.Module):
    """U-ViT (Bao et al., 2023), small: the time and the class become tokens in front of the image's, and long
    skips join each in-block's output to the out-block of the same depth."""

    def __init__(self, dim: int = 32, depth: int = 4, patch: int = 2, channels: int = 4, classes: int = 10):
        super().__init__()
        self.patch_embed = nn.Conv2d(channels, dim, patch, patch)
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.label_embed = nn.Embedding(classes, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, 2 + 16, dim))
        block = lambda: nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)  # noqa: E731
        self.in_blocks = nn.ModuleList(block() for _ in range(depth))
        self.mid_block = block()
        self.out_blocks = nn.ModuleList(UViTOut(dim, block()) for _ in range(depth))
        self.out = nn.Linear(dim, patch * patch * channels)

    def forward(self, x, t, y):
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        time = self.time_embed(t[:, None, None].to(tokens.dtype))
        label = self.label_embed(y)[:, None]
        x = torch.cat([time, label, tokens], dim=1) + self.pos_embed
        skips = []
        for block in self.in_blocks:
            x = block(x)
            skips.append(x)
        x = self.mid_block(x)
        for block in self.out_blocks:
            x = block(x, skips.pop())
        return self.out(x[:, 2:])


class UViTOut(nn.Module):
    def __init__(self, dim: int, block: nn.Module):
        super().__init__()
        self.skip = nn.Linear(2 * dim, dim)
        self.block = block

    def forward(self, x, skip):
        return self.block(self.skip(torch.cat([x, skip], dim=-1)))


def uvit(batch: int = 2):
    return UViT(), (torch.randn(batch, 4, 8, 8, generator=_g()), torch.rand(batch, generator=_g(1)),
                    _steps(batch, 1, 4, dtype=torch.long)), {}


@dataclass(frozen=True)
class Entry:
    """A model of the zoo and how it is routed: `route` for `rk.apply`, the stack it must find, whether its
    stream holds tokens besides the patch grid that a route keeps (`special`)."""

    build: Callable[[], tuple[nn.Module, tuple, dict]]
    stack: str
    route: dict = field(default_factory=lambda: {"start": 1, "end": 4})
    special: tuple[int, ...] = ()
    options: dict = field(default_factory=dict)
    mode: str = "graph"  # how apply places the routes by itself: "boundary" where the forward does not trace


ZOO: dict[str, Entry] = {
    "diffusers DiT": Entry(diffusers_dit, "transformer_blocks"),
    "diffusers PixArt": Entry(diffusers_pixart, "transformer_blocks"),
    "diffusers SD3": Entry(diffusers_sd3, "transformer_blocks"),
    "diffusers Flux": Entry(diffusers_flux, "transformer_blocks → single_transformer_blocks"),
    "diffusers Flux (across both stacks)": Entry(diffusers_flux, "transformer_blocks → single_transformer_blocks",
                                                 route={"start": 2, "end": -2}),
    "diffusers Flux (single-stream stack)": Entry(diffusers_flux, "single_transformer_blocks",
                                                  options={"stack": "single_transformer_blocks"}),
    "diffusers Flux2 (across both stacks)": Entry(diffusers_flux2, "transformer_blocks → single_transformer_blocks",
                                                  route={"start": 2, "end": -2}),
    "diffusers QwenImage": Entry(diffusers_qwenimage, "transformer_blocks"),
    "diffusers Wan": Entry(diffusers_wan, "blocks"),
    "diffusers LTX-Video (image to video)": Entry(diffusers_ltx_video, "transformer_blocks"),
    "diffusers CogVideoX": Entry(diffusers_cogvideox, "transformer_blocks"),
    "diffusers HunyuanVideo (across both stacks)": Entry(diffusers_hunyuan_video,
                                                         "transformer_blocks → single_transformer_blocks",
                                                         route={"start": 2, "end": -2}),
    "diffusers HiDream (double-stream stack)": Entry(diffusers_hidream, "double_stream_blocks"),
    "diffusers CogView4": Entry(diffusers_cogview4, "transformer_blocks", route={"start": 1, "end": 4, "selector": "row"}),
    "diffusers Mochi": Entry(diffusers_mochi, "transformer_blocks", route={"start": 1, "end": 4, "selector": "frame"}),
    "diffusers Sana": Entry(diffusers_sana, "transformer_blocks", route={"start": 1, "end": 4, "selector": "row"}),
    "diffusers Lumina2": Entry(diffusers_lumina2, "layers", special=tuple(range(5)),  # the caption's tokens
                               mode="boundary"),  # it lays out its sequence by its mask's values
    "diffusers Chroma (across both stacks)": Entry(diffusers_chroma, "transformer_blocks → single_transformer_blocks",
                                                   route={"start": 2, "end": -2}),  # text joined in front between
    "diffusers Chroma (single-stream stack)": Entry(diffusers_chroma, "single_transformer_blocks",
                                                    special=tuple(range(5)),  # the text the owner joins in front
                                                    options={"stack": "single_transformer_blocks"}),
    "diffusers AuraFlow": Entry(diffusers_auraflow, "single_transformer_blocks",
                                special=tuple(range(13)),  # its 8 register tokens, then the 5 text tokens
                                options={"stack": "single_transformer_blocks"}),
    "diffusers Krea2 (padded text)": Entry(diffusers_krea2, "transformer_blocks", special=tuple(range(5))),  # its text
    "diffusers OmniGen": Entry(diffusers_omnigen, "layers", special=tuple(range(6))),  # its text, its time token
    "diffusers StableAudio": Entry(diffusers_stable_audio, "transformer_blocks", special=(0,)),  # the global token
    "transformers Llama": Entry(transformers_llama, "layers"),
    "transformers Gemma2 (eager attention)": Entry(transformers_gemma2, "layers"),
    "transformers Qwen3-MoE (router logits)": Entry(transformers_qwen3_moe, "model.layers", mode="boundary"),
    "transformers FalconMamba (LM head)": Entry(transformers_falcon_mamba, "backbone.layers"),
    "transformers GPT-2": Entry(transformers_gpt2, "h"),
    "transformers GPT-NeoX": Entry(transformers_gpt_neox, "layers"),
    "transformers Gemma3": Entry(transformers_gemma3, "layers"),
    "transformers RWKV": Entry(transformers_rwkv, "blocks", mode="boundary"),  # its forward rescales on mode flips
    "transformers ViT": Entry(transformers_vit, "layers", special=(0,)),
    "transformers CLIP vision": Entry(transformers_clip_vision, "encoder.layers", special=(0,)),
    "transformers Dinov2 (registers)": Entry(transformers_dinov2_registers, "encoder.layer", special=tuple(range(5))),
    "transformers DINOv3 (rotary over patches)": Entry(transformers_dinov3, "model.layer", special=tuple(range(5))),
    "transformers BEiT": Entry(transformers_beit, "layers", special=(0,)),
    "transformers Mamba": Entry(transformers_mamba, "layers"),
    "timm ViT": Entry(timm_vit, "blocks", special=(0,)),
    "timm EVA (rotary over patches)": Entry(timm_eva, "blocks", special=(0, 1, 2)),
    "U-ViT (out-blocks)": Entry(uvit, "out_blocks", route={"start": 1, "end": 2}, special=(0, 1),
                                options={"stack": "out_blocks"}),
}

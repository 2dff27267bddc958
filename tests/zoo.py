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


def diffusers_dit():
    model = package("diffusers").DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=6, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10, norm_num_groups=1)
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), {"timestep": torch.tensor([3, 7]),
                                                                "class_labels": torch.tensor([1, 4])}


def diffusers_pixart():
    model = package("diffusers").PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=6, sample_size=8,
        patch_size=2, cross_attention_dim=32, caption_channels=24, norm_num_groups=1)
    kwargs = {"encoder_hidden_states": torch.randn(2, 5, 24, generator=_g(1)), "timestep": torch.tensor([3, 7]),
              "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), kwargs


def diffusers_sd3():
    model = package("diffusers").SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=6, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=8)
    kwargs = {"encoder_hidden_states": torch.randn(2, 5, 24, generator=_g(1)),
              "pooled_projections": torch.randn(2, 16, generator=_g(2)), "timestep": torch.tensor([3.0, 7.0])}
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), kwargs


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


def diffusers_flux():
    model = package("diffusers").FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=6, num_single_layers=6, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    args, kwargs = flux_inputs(2, 4, 4, 5)
    return model, args, kwargs


def diffusers_wan():
    model = package("diffusers").WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=16, ffn_dim=64, num_layers=6, rope_max_seq_len=32)
    kwargs = {"timestep": torch.tensor([3, 7]), "encoder_hidden_states": torch.randn(2, 5, 24, generator=_g(1))}
    return model, (torch.randn(2, 4, 2, 8, 8, generator=_g()),), kwargs


def diffusers_sana():
    model = package("diffusers").SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=6,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
        sample_size=8, patch_size=2)
    kwargs = {"encoder_hidden_states": torch.randn(2, 5, 24, generator=_g(1)), "timestep": torch.tensor([3, 7])}
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), kwargs


def diffusers_lumina2():
    model = package("diffusers").Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=6, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
        cap_feat_dim=24)
    kwargs = {"timestep": torch.tensor([0.3, 0.7]), "encoder_hidden_states": torch.randn(2, 5, 24, generator=_g(1)),
              "encoder_attention_mask": torch.ones(2, 5, dtype=torch.bool)}
    return model, (torch.randn(2, 4, 8, 8, generator=_g()),), kwargs


def transformers_llama():
    t = package("transformers")
    config = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                           use_cache=False)  # as it trains: no generation cache
    return t.LlamaModel(config), (torch.randint(0, 64, (2, 12), generator=_g()),), {}


def transformers_vit():
    t = package("transformers")
    config = t.ViTConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=64,
                         image_size=16, patch_size=4)
    return t.ViTModel(config, add_pooling_layer=False), (torch.randn(2, 3, 16, 16, generator=_g()),), {}


def transformers_dinov2_registers():
    t = package("transformers")
    config = t.Dinov2WithRegistersConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                                         intermediate_size=64, image_size=16, patch_size=4, num_register_tokens=4)
    return t.Dinov2WithRegistersModel(config), (torch.randn(2, 3, 16, 16, generator=_g()),), {}


def transformers_mamba():
    t = package("transformers")
    config = t.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=6, expand=2)
    return t.MambaModel(config), (torch.randint(0, 64, (2, 12), generator=_g()),), {}


def timm_vit():
    timm = package("timm")
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64, depth=6)  # 1 + 4×4 tokens
    return model, (torch.randn(2, 3, 64, 64, generator=_g()),), {}


@dataclass(frozen=True)
class Entry:
    """A model of the zoo and how it is routed: `route` for `rk.apply`, the stack it must find, whether its
    stream holds tokens besides the patch grid that a route keeps (`special`)."""

    build: Callable[[], tuple[nn.Module, tuple, dict]]
    stack: str
    route: dict = field(default_factory=lambda: {"start": 1, "end": 4})
    special: tuple[int, ...] = ()
    options: dict = field(default_factory=dict)


ZOO: dict[str, Entry] = {
    "diffusers DiT": Entry(diffusers_dit, "transformer_blocks"),
    "diffusers PixArt": Entry(diffusers_pixart, "transformer_blocks"),
    "diffusers SD3": Entry(diffusers_sd3, "transformer_blocks"),
    "diffusers Flux": Entry(diffusers_flux, "transformer_blocks"),
    "diffusers Flux (single-stream stack)": Entry(diffusers_flux, "single_transformer_blocks",
                                                  options={"stack": "single_transformer_blocks"}),
    "diffusers Wan": Entry(diffusers_wan, "blocks"),
    "diffusers Sana": Entry(diffusers_sana, "transformer_blocks", route={"start": 1, "end": 4, "selector": "row"}),
    "diffusers Lumina2": Entry(diffusers_lumina2, "layers", special=tuple(range(5))),  # the caption's tokens
    "transformers Llama": Entry(transformers_llama, "layers"),
    "transformers ViT": Entry(transformers_vit, "layers", special=(0,)),
    "transformers Dinov2 (registers)": Entry(transformers_dinov2_registers, "encoder.layer", special=tuple(range(5))),
    "transformers Mamba": Entry(transformers_mamba, "layers"),
    "timm ViT": Entry(timm_vit, "blocks", special=(0,)),
}

"""FLUX with SimpleTuner's `tread_config`: route half the image tokens around blocks 2 .. -2 of the whole chain
(double-stream, then single-stream blocks), train a few LoRA-free AdamW steps with the flow-matching loss, check
that inference is unchanged.

    python examples/flux_tread_config.py                       # a small FLUX with random weights (CPU, seconds)
    python examples/flux_tread_config.py --model FLUX.1-dev    # a from_pretrained folder (GPU; bf16)

For LoRA fine-tuning on cached latents, `python -m routekit.finetune` does all of this at scale.
"""

import argparse
import copy

import torch
from diffusers import FluxTransformer2DModel

import routekit as rk

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="a FLUX pipeline's folder (its transformer/) or the transformer's own")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32

torch.manual_seed(0)
if args.model:
    flux = FluxTransformer2DModel.from_pretrained(args.model, subfolder="transformer", torch_dtype=dtype)
else:  # FLUX.1's layout at toy widths: 4 double- and 8 single-stream blocks
    flux = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=4, num_single_layers=8,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=16, axes_dims_rope=(4, 6, 6), guidance_embeds=True)
flux.to(device, dtype)
config = flux.config

# what FLUX's pipeline hands its transformer: VAE latents packed 2×2 into tokens, the positions of each image and
# text token, T5's text embeddings, CLIP's pooled embedding, the timestep in [0, 1] and the guidance value
batch, height, width, text = 2, 16, 16, 8                       # 16×16 latents (a 128×128 image): 64 tokens
latents = torch.randn(batch, config.in_channels // 4, height, width, device=device, dtype=dtype)
packed = latents.view(batch, -1, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5).flatten(3).flatten(1, 2)
img_ids = torch.zeros(height // 2, width // 2, 3, device=device)
img_ids[..., 1] = torch.arange(height // 2, device=device)[:, None]
img_ids[..., 2] = torch.arange(width // 2, device=device)[None, :]
flux_kwargs = {
    "encoder_hidden_states": torch.randn(batch, text, config.joint_attention_dim, device=device, dtype=dtype),
    "pooled_projections": torch.randn(batch, config.pooled_projection_dim, device=device, dtype=dtype),
    "timestep": torch.rand(batch, device=device), "img_ids": img_ids.flatten(0, 1),
    "txt_ids": torch.zeros(text, 3, device=device), "guidance": torch.full((batch,), 3.5, device=device),
    "return_dict": False,
}

tread_config = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}  # SimpleTuner's
routed = rk.apply(flux, tread_config, example_inputs=(packed,), example_kwargs=flux_kwargs)
print(rk.inspect(routed))
rk.verify(flux, routed, (packed,), flux_kwargs)            # raises InferenceChanged / TrainingChanged otherwise
print("verified: eval unchanged, training unchanged at rate 0, the kept tokens computed as before")

optimizer = torch.optim.AdamW(routed.parameters(), lr=1e-5)
routed.train()
for step in range(args.steps):                                   # flow matching: x_t = (1 - σ) x0 + σ ε, predict ε - x0
    noise, sigma = torch.randn_like(packed), torch.rand(batch, device=device)
    noisy = (1 - sigma[:, None, None].to(dtype)) * packed + sigma[:, None, None].to(dtype) * noise
    with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
        prediction = routed(noisy, **{**flux_kwargs, "timestep": sigma})[0]
    loss = (prediction.float() - (noise - packed).float()).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    print(f"step {step + 1}: loss {loss.item():.4f}")

routed.eval()
with torch.no_grad():
    plain = rk.strip(copy.deepcopy(routed)).eval()  # the trained weights without routekit
    same = torch.equal(routed(packed, **flux_kwargs)[0], plain(packed, **flux_kwargs)[0])
print("eval output equals the unrouted model's:", same)
assert same

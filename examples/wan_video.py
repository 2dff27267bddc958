"""Wan (diffusers' WanTransformer3DModel) on video latents: a route that keeps whole tubes of tokens (the same
spatial positions in every frame), a few AdamW steps with the flow-matching loss, inference unchanged.

    python examples/wan_video.py                                  # a small Wan with random weights (CPU, seconds)
    python examples/wan_video.py --model Wan2.1-T2V-1.3B-Diffusers  # a from_pretrained folder (GPU; bf16)
"""

import argparse
import copy

import torch
from diffusers import WanTransformer3DModel

import routekit as rk

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="a Wan pipeline's folder (its transformer/)")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32

torch.manual_seed(0)
if args.model:
    wan = WanTransformer3DModel.from_pretrained(args.model, subfolder="transformer", torch_dtype=dtype)
else:  # Wan's layout at toy widths: 8 blocks, patches of 1×2×2
    wan = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                out_channels=4, text_dim=32, freq_dim=16, ffn_dim=64, num_layers=8, rope_max_seq_len=32)
wan.to(device, dtype)
config = wan.config

# what Wan's pipeline hands its transformer: VAE latents (batch, channels, frames, height, width), the timestep
# in [0, 1000] and umT5's text embeddings
batch, frames, height, width, text = 2, 3, 8, 8, 6               # 3 latent frames of 4×4 patches: 48 tokens
latents = torch.randn(batch, config.in_channels, frames, height, width, device=device, dtype=dtype)
wan_kwargs = {"timestep": torch.tensor([250, 750], device=device),
              "encoder_hidden_states": torch.randn(batch, text, config.text_dim, device=device, dtype=dtype),
              "return_dict": False}

route = rk.Route(start=2, end=-3, rate=0.5, selector="tube")   # blocks 2..5 see half the tubes
routed = rk.apply(wan, routes=route, example_inputs=(latents,), example_kwargs=wan_kwargs)
print(rk.inspect(routed))
rk.verify(wan, routed, (latents,), wan_kwargs)               # raises InferenceChanged / TrainingChanged otherwise
print("verified: eval unchanged, training unchanged at rate 0, the kept tokens computed as before")

optimizer = torch.optim.AdamW(routed.parameters(), lr=1e-5)
routed.train()
for step in range(args.steps):                                   # flow matching: x_t = (1 - σ) x0 + σ ε, predict ε - x0
    noise, sigma = torch.randn_like(latents), torch.rand(batch, device=device)
    s = sigma.view(-1, 1, 1, 1, 1).to(dtype)
    with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
        prediction = routed((1 - s) * latents + s * noise, **{**wan_kwargs, "timestep": sigma * 1000})[0]
    loss = (prediction.float() - (noise - latents).float()).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    mask = rk.last_route_mask(routed)                            # (batch, tokens): True where a token was routed
    print(f"step {step + 1}: loss {loss.item():.4f}, {int(mask.sum())} of {mask.numel()} tokens routed")

routed.eval()
with torch.no_grad():
    plain = rk.strip(copy.deepcopy(routed)).eval()  # the trained weights without routekit
    same = torch.equal(routed(latents, **wan_kwargs)[0], plain(latents, **wan_kwargs)[0])
print("eval output equals the unrouted model's:", same)
assert same

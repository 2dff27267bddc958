"""A timm Vision Transformer classifier with a token route: blocks 2 .. -3 see half the patch tokens in training
(the class token is always kept), a few AdamW steps of cross-entropy, inference unchanged.

    python examples/timm_vit.py                                        # a small ViT with random weights (CPU)
    python examples/timm_vit.py --model vit_base_patch16_224 --pretrained   # timm's weights (needs the network)
"""

import argparse
import copy

import timm
import torch
import torch.nn.functional as F

import routekit as rk

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=None, help="a timm model name (default: a small ViT at 64×64)")
parser.add_argument("--pretrained", action="store_true")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
if args.model:
    vit = timm.create_model(args.model, pretrained=args.pretrained)
else:  # ViT's layout at toy widths: 8 blocks over a 4×4 grid of patches plus the class token
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, depth=8, embed_dim=64, num_heads=2,
                            num_classes=10)
vit.to(device)
size = vit.default_cfg["input_size"][-1] if args.model else 64

images, labels = torch.randn(4, 3, size, size, device=device), torch.randint(0, vit.num_classes, (4,), device=device)
routed = rk.apply(vit, routes=rk.Route(start=2, end=-3, rate=0.5), example_inputs=(images,))
print(rk.inspect(routed))
rk.verify(vit, routed, (images,))                            # raises InferenceChanged / TrainingChanged otherwise
print("verified: eval unchanged, training unchanged at rate 0, the kept tokens computed as before")

optimizer = torch.optim.AdamW(routed.parameters(), lr=1e-4)
routed.train()
for step in range(args.steps):
    with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
        loss = F.cross_entropy(routed(images).float(), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    print(f"step {step + 1}: loss {loss.item():.4f}")

routed.eval()
with torch.no_grad():
    plain = rk.strip(copy.deepcopy(routed)).eval()  # the trained weights without routekit
    same = torch.equal(routed(images), plain(images))
print("eval output equals the unrouted model's:", same)
assert same

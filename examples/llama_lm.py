"""A causal language model (transformers' Llama) with a token route: blocks 2 .. -3 see half the tokens in
training (the kept ones attend causally among themselves), the loss stays the next-token loss on every token,
and `eval()`, where generation happens, is the original model.

    python examples/llama_lm.py                          # a small Llama with random weights (CPU, seconds)
    python examples/llama_lm.py --model TinyLlama-1.1B   # a from_pretrained folder
"""

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import routekit as rk

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", help="a causal LM's from_pretrained folder")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
if args.model:
    lm = LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16 if device == "cuda" else None)
else:
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
lm.to(device)

batch, length = 4, 32
tokens = torch.randint(0, lm.config.vocab_size, (batch, length), device=device)
routed = rk.apply(lm, routes=rk.Route(start=2, end=-3, rate=0.5), example_inputs=(tokens,))
print(rk.inspect(routed))
rk.verify(lm, routed, (tokens,))                             # raises InferenceChanged / TrainingChanged otherwise
print("verified: eval unchanged, training unchanged at rate 0, the kept tokens computed as before")

optimizer = torch.optim.AdamW(routed.parameters(), lr=1e-4)
routed.train()
for step in range(args.steps):
    with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
        loss = routed(tokens, labels=tokens, use_cache=False).loss      # the next-token loss, every position
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    print(f"step {step + 1}: loss {loss.item():.4f}")

routed.eval()
with torch.no_grad():
    plain = rk.strip(copy.deepcopy(routed)).eval()  # the trained weights without routekit
    same = torch.equal(routed(tokens).logits, plain(tokens).logits)
    generated = routed.generate(tokens[:1, :8], max_new_tokens=8, do_sample=False)
print("eval output equals the unrouted model's:", same, "| generated", generated.shape[1] - 8, "tokens")
assert same

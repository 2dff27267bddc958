"""`routekit.finetune`'s train step at FLUX.1's widths: a route against `--routes none`, timed in turn.

The finetune command's own pieces (its flow-matching loss, peft LoRA on the attention projections, its routes), on
diffusers' FluxTransformer2DModel built from FLUX.1-dev's config with random weights (nothing is downloaded: the
speed of a step does not depend on the weights' values): 19 double- and 38 single-stream blocks, 24 heads of 128,
the frozen weights in bf16, LoRA rank 16 in fp32, bf16 autocast, gradient checkpointing (as FLUX LoRA runs train),
AdamW. Batch 1 at 1024×1024 (4096 image tokens) with 512 text tokens. The routed model and its original forward
(the same model with its routes suspended: one set of weights) take their steps in turn (a step of one, then of
the other, the order swapped every round), so that whatever else the GPU does falls on both alike; each step is
timed from its first kernel to its last. "FLOP limit" is the unrouted step's FLOPs over the routed one's (torch's
FLOP counter, forward, recompute and backward).

    python -m benchmarks.finetune                              # on a GPU: FLUX.1's widths and depth
    python -m benchmarks.finetune --routes 2:-2 --steps 20     # the route SimpleTuner documents for FLUX (default)
    python -m benchmarks.finetune --depth 4 8                  # fewer blocks (double, single) where memory is short
    python -m benchmarks.finetune --quick                      # CPU smoke run: a tiny FLUX, 64 + 8 tokens

Writes benchmarks/results/finetune_flux.{json,md,png} (or --out DIR, --name STEM) with the machine, the commit and
the command. SPRINT's fused span: `--routes 2:-3:0.75:random:sprint --name finetune_flux_sprint`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    attention_backends,
    device_or_exit,
    figure,
    free_memory,
    machine,
    step_stats,
    time_step,
    write,
)
from routekit import finetune  # noqa: E402
from routekit.cli import _routes  # noqa: E402
from routekit.flops import flop_counter_mode  # noqa: E402
from routekit.model import original_forward  # noqa: E402

FLUX1 = {"num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
         "joint_attention_dim": 4096, "pooled_projection_dim": 768, "in_channels": 64, "axes_dims_rope": (16, 56, 56),
         "guidance_embeds": True}
TINY = {**FLUX1, "num_layers": 2, "num_single_layers": 4, "attention_head_dim": 16, "num_attention_heads": 2,
        "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)}


def build(config: dict, device: str, dtype: torch.dtype):
    """FluxTransformer2DModel of `config` with random weights, made on `device` in `dtype` (no fp32 copy first)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return FluxTransformer2DModel(patch_size=1, **config)
    finally:
        torch.set_default_dtype(default)


def batch(config: dict, size: int, latent_side: int, text: int, device: str, dtype: torch.dtype) -> dict:
    """Cached-sample tensors as the finetune command batches them: VAE latents (16 channels), T5 and CLIP embeddings."""
    g = torch.Generator().manual_seed(0)
    tensors = {"latents": torch.randn(size, config["in_channels"] // 4, latent_side, latent_side, generator=g),
               "prompt_embeds": torch.randn(size, text, config["joint_attention_dim"], generator=g),
               "pooled_prompt_embeds": torch.randn(size, config["pooled_projection_dim"], generator=g)}
    return {k: v.to(device, dtype) for k, v in tensors.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routes", default="2:-2", help="the routed variant's --routes (default: 2:-2, rate 0.5)")
    p.add_argument("--depth", type=int, nargs=2, metavar=("DOUBLE", "SINGLE"), help="blocks of each stack "
                   "(default FLUX.1's 19 and 38)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latents are 1/8, packed 2×2)")
    p.add_argument("--text", type=int, default=512, help="text tokens (FLUX.1-dev's T5 length)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="finetune_flux", help="results file stem (default finetune_flux)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny FLUX, 64 image + 8 text tokens")
    args = p.parse_args(argv)
    finetune._needs("diffusers", "peft")
    device = device_or_exit(args.quick)
    cuda = device == "cuda"
    config = dict(TINY if args.quick else FLUX1)
    if args.depth:
        config["num_layers"], config["num_single_layers"] = args.depth
    side, text = (16, 8) if args.quick else (args.resolution // 8, args.text)
    dtype = torch.bfloat16 if cuda else torch.float32
    checkpointing = not args.no_gradient_checkpointing

    model = build(config, device, dtype)
    if checkpointing:
        model.enable_gradient_checkpointing()
    torch.manual_seed(0)
    trainable = finetune.add_lora(model, args.rank)
    family = finetune.FAMILIES["FluxTransformer2DModel"]
    objective = finetune.Objective()
    data = batch(config, args.batch, side, text, device, dtype)
    routed = finetune.route(model, _routes(args.routes), family, objective, data)  # the model itself, routed in place
    # both variants are the one model: `--routes none` runs its original forward (the routes suspended)
    variants = {"--routes none": lambda: original_forward(routed),
                f"--routes {args.routes}": contextlib.nullcontext}
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=1e-2, fused=cuda)

    def step(variant, number: int) -> torch.Tensor:
        generator = finetune.step_generator(0, number, 0)
        with torch.autocast(device, torch.bfloat16, enabled=cuda), variant():
            loss = objective.loss(routed, family, data, generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    flops, times, host = {}, {name: [] for name in variants}, {name: [] for name in variants}
    with attention_backends(device):
        routed.train()
        for name, variant in variants.items():
            with flop_counter_mode() as counter:
                step(variant, 0)
            flops[name] = counter.get_total_flops()
        for number in range(args.warmup + args.steps):
            order = list(variants.items()) if number % 2 == 0 else list(variants.items())[::-1]
            for name, variant in order:
                took, returned = time_step(lambda variant=variant, number=number: step(variant, number), cuda)
                if number >= args.warmup:
                    times[name].append(took)
                    host[name].append(returned)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    base, routed = variants
    rows = []
    for name in variants:
        stats = step_stats(times[name], host[name])
        rows.append({"variant": name, **stats, "flops": flops[name], "steps": args.steps,
                     "speedup": statistics.median(times[base]) / stats["median_ms"],
                     "flop_limit": flops[base] / flops[name]})
    pairs = [b / r for b, r in zip(times[base], times[routed])]
    setup = {"config": config, "batch": args.batch, "image_tokens": (side // 2) ** 2, "text_tokens": text,
             "lora_rank": args.rank, "gradient_checkpointing": checkpointing, "dtype": str(dtype),
             "peak_gib_both_variants": peak, "step_by_step_speedups": pairs}
    info = machine()
    free_memory()

    def plot(path: Path) -> None:
        with figure(path, 1, 1, figsize=(6, 3.2)) as (_, ax):
            names = [r["variant"] for r in rows]
            ax.barh(names, [r["median_ms"] for r in rows], color=["#999999", "#2a7ab9"])
            ax.errorbar([r["median_ms"] for r in rows], names, xerr=[[0] * len(rows),
                        [r["p90_ms"] - r["median_ms"] for r in rows]], fmt="none", color="black", capsize=3)
            ax.set_xlabel("train step, ms (median; bar to the 90th percentile)")
            ax.set_title(f"FLUX LoRA fine-tuning step: {rows[1]['speedup']:.2f}× (FLOP limit {rows[1]['flop_limit']:.2f}×)",
                         fontsize=9)

    body = (f"{config['num_layers']} double + {config['num_single_layers']} single blocks, "
            f"{config['num_attention_heads']} heads of {config['attention_head_dim']}, random weights; batch "
            f"{args.batch}, {(side // 2) ** 2} image + {text} text tokens; LoRA rank {args.rank} on the attention "
            f"projections; {dtype} weights{', bf16 autocast' if cuda else ''}; gradient checkpointing "
            f"{'on' if checkpointing else 'off'}; the two variants' steps in turn, {args.warmup} warm-up steps each.\n\n"
            "| variant | step (median) | p90 | fastest | speed-up | FLOP limit |\n|---|---:|---:|---:|---:|---:|\n"
            + "".join(f"| `{r['variant']}` | {r['median_ms']:.1f} ms | {r['p90_ms']:.1f} ms | {r['min_ms']:.1f} ms | "
                      f"{r['speedup']:.3f}× | {r['flop_limit']:.3f}× |\n" for r in rows)
            + f"\nStep-by-step speed-ups: {min(pairs):.3f}–{max(pairs):.3f}×. Peak memory with both variants and "
              f"their optimizer state: {peak:.1f} GiB.\n")
    out = write(args.name, info, {"rows": rows, "setup": setup}, "FLUX LoRA fine-tuning step: routed against "
                "--routes none", body, out=args.out, plot=plot)
    print(body)
    print(f"wrote {out / (args.name + '.md')}")


if __name__ == "__main__":
    main()

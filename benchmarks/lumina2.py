"""Lumina-Image 2.0 at 1024×1024 in boundary mode: TREAD with captions of different lengths per sample.

diffusers' Lumina2Transformer2DModel at its released widths and depth (26 layers of width 2304, 24 heads, 2
refiner layers; random weights) on 4096 image tokens (a 1024×1024 image: 128×128 latents over a 2×2 patch) and
captions of Gemma-2's width padded to 256 tokens, whose unmasked lengths differ per sample, as its training
scripts call it. Lumina2 lays out each sample by its caption mask's values (the caption, then the image, then
padding), which no traced graph can hold, so routekit places the route at the block calls (boundary mode) and
the route keeps the first 256 positions, which cover every caption (`keep=list(range(256))`). One train step
(forward + backward + AdamW, bf16 autocast) per variant and batch size; a batch of two or more is measured twice,
with captions of different lengths (Lumina2 then hands its blocks an attention mask, and attention runs a
masked kernel) and with captions of one length (no mask):

- vanilla;
- routekit: TREAD's default span, blocks 2 → 22 (depth − 4), rate 0.5, random selection.

"FLOP limit" is vanilla's FLOPs over the routed model's (torch's flop counter), "AdamW" the optimizer's step
timed on its own (work per parameter no route shortens), and "of the limit, AdamW aside" the speed-up of the
rest of the step over the FLOP limit.

    python benchmarks/lumina2.py               # on a GPU: batch 1, and 2 with both kinds of captions, eager
    python benchmarks/lumina2.py --quick       # CPU smoke run: a tiny Lumina2, 64 image + 8 caption tokens

Writes benchmarks/results/lumina2.{json,md,png} (or --out DIR).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import routekit as rk  # noqa: E402
from benchmarks.common import (  # noqa: E402
    RESULTS,
    attention_backends,
    device_or_exit,
    figure,
    free_memory,
    machine,
    measure,
    step_flops,
    write,
)
from routekit.model import report_of  # noqa: E402

FULL = {"hidden_size": 2304, "num_layers": 26, "num_refiner_layers": 2, "num_attention_heads": 24, "num_kv_heads": 8,
        "multiple_of": 256, "axes_dim_rope": (32, 32, 32), "axes_lens": (300, 512, 512), "cap_feat_dim": 2304}
TINY = {"hidden_size": 32, "num_layers": 8, "num_refiner_layers": 1, "num_attention_heads": 2, "num_kv_heads": 2,
        "multiple_of": 16, "axes_dim_rope": (4, 6, 6), "axes_lens": (32, 32, 32), "cap_feat_dim": 24}
# unmasked caption lengths per sample, cycled over the batch where captions differ (a batch of two or more then
# holds captions of different lengths, so the blocks take Lumina2's attention mask); the first for every sample
# where they are of one length
LENGTHS = (143, 77, 201, 54)
TINY_LENGTHS = (8, 5, 7, 3)
RATE = 0.5


def build(config: dict, device: str) -> nn.Module:
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: 2.6B parameters take minutes to initialise on a CPU
        return Lumina2Transformer2DModel(patch_size=2, in_channels=16, **config)


def inputs(config: dict, batch: int, latent: int, caption: int, lengths: tuple[int, ...], device: str,
           seed: int = 0) -> tuple[tuple, dict]:
    """Lumina2's call on latent×latent latents and captions padded to `caption` tokens, sample i's unmasked
    for the first lengths[i % len(lengths)]."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, caption, dtype=torch.bool)
    for i in range(batch):
        mask[i, :lengths[i % len(lengths)]] = True
    kwargs = {"timestep": torch.rand(batch, generator=g), "encoder_attention_mask": mask,
              "encoder_hidden_states": torch.randn(batch, caption, config["cap_feat_dim"], generator=g)}
    x = torch.randn(batch, 16, latent, latent, generator=g)
    return (x.to(device),), {k: v.to(device) for k, v in kwargs.items()}


def routed(model: nn.Module, example: tuple[tuple, dict], caption: int) -> nn.Module:
    depth = len(model.layers)
    route = rk.Route(start=2, end=depth - 4, rate=RATE, keep=list(range(caption)))
    with warnings.catch_warnings():  # the fallback to boundary mode, which the docstring says and the table shows
        warnings.simplefilter("ignore", rk.FallbackWarning)
        return rk.apply(model, route, example_inputs=example[0], example_kwargs=example[1])


def table(rows: list[dict]) -> str:
    out = ["| batch | captions | variant | tokens | median ms | p90 ms | speed-up | FLOP limit | of the limit "
           "| AdamW ms | of the limit, AdamW aside | peak GiB | first step s |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in dict.fromkeys((r["batch"], r["captions"]) for r in rows):
        group = {r["variant"]: r for r in rows if (r["batch"], r["captions"]) == key}
        base = group.get("vanilla")
        for name, r in group.items():
            speed = base["step_ms"] / r["step_ms"] if base else float("nan")
            aside = ""
            if base and name != "vanilla":
                rest = (base["step_ms"] - base["optimizer_ms"]) / (r["step_ms"] - r["optimizer_ms"])
                aside = f"{rest / r['flop_limit']:.3f}"
            out.append(f"| {key[0]} | {key[1]} | {name} | {r['tokens']} | {r['step_ms']:.1f} | {r['p90_ms']:.1f} "
                       f"| {speed:.3f}× | {r['flop_limit']:.3f}× | {speed / r['flop_limit']:.3f} | {r['optimizer_ms']:.1f} "
                       f"| {aside} | {r['peak_gib']:.1f} | {r['first_step_s']:.1f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    keys = list(dict.fromkeys((r["batch"], r["captions"]) for r in rows))
    with figure(path, figsize=(7, 4)) as (_, ax):
        for i, key in enumerate(keys):
            group = {r["variant"]: r for r in rows if (r["batch"], r["captions"]) == key}
            if "routekit" not in group or "vanilla" not in group:
                continue
            ax.bar(i, group["vanilla"]["step_ms"] / group["routekit"]["step_ms"], 0.5, color="C0")
            ax.hlines(group["routekit"]["flop_limit"], i - 0.3, i + 0.3, colors="grey", linestyles="--")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(keys)), [f"batch {b},\n{c}" for b, c in keys])
        ax.set_ylabel("train-step speed-up over vanilla (median)")
        ax.set_title("Lumina2 (26 layers), 4096 image + 256 caption tokens, route 2 → 22 in boundary mode;\n"
                     "dashed: FLOP limit", fontsize=9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 2; 2 with --quick)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny Lumina2, 64 image + 8 caption tokens")
    args = p.parse_args()
    device = device_or_exit(args.quick)
    config, latent, caption, lengths = (TINY, 16, 8, TINY_LENGTHS) if args.quick else (FULL, 128, 256, LENGTHS)
    if args.quick:
        args.steps, args.warmup = 2, 0
    args.batches = args.batches or ([2] if args.quick else [1, 2])
    info, rows = machine(), []
    info["attention"] = "SDPA, flash or memory-efficient on a GPU, in both variants"
    body = (f"Lumina2 ({config['num_layers']} layers of width {config['hidden_size']}), {(latent // 2) ** 2} image "
            f"tokens and captions padded to {caption} tokens, unmasked lengths {list(lengths)} cycled over the batch "
            f"where they differ, {lengths[0]} where they are of one length (the stream holds the longest, then the "
            f"image); routekit: route 2 → {config['num_layers'] - 4} at rate "
            f"{RATE}, keep=list(range({caption})), random selection. Median and p90 of each variant's step times.\n\n")
    example = inputs(config, 2, latent, caption, lengths, device)
    # two models of the same weights: apply routes the model it is given itself
    variants = {"vanilla": build(config, device), "routekit": routed(build(config, device), example, caption)}
    mode = report_of(variants["routekit"]).report.mode
    with attention_backends(device):
        cases = [(b, c) for b in args.batches for c in (("one length", "different") if b > 1 else ("one length",))]
        for batch, captions in cases:  # one sample holds one caption length
            used = lengths if captions == "different" else lengths[:1]
            batch_inputs = inputs(config, batch, latent, caption, used, device, seed=1)
            tokens = max(used[i % len(used)] for i in range(batch)) + (latent // 2) ** 2
            flops = {name: step_flops(m, *batch_inputs) for name, m in variants.items()}
            for name, m in variants.items():
                stats = measure(m, *batch_inputs, "eager", args.steps, args.warmup)
                rows.append({"batch": batch, "captions": captions, "variant": name, "tokens": tokens, "mode": mode,
                             "flop_limit": flops["vanilla"] / flops[name], **stats})
                print(f"batch {batch} {captions:10s} {name:9s} median {stats['step_ms']:8.2f} ms  "
                      f"p90 {stats['p90_ms']:8.2f} ms  (first step {stats['first_step_s']:.1f} s)", flush=True)
                free_memory()
                write("lumina2", info, {"rows": rows}, f"Lumina2 train step at 1024×1024, routed in {mode} mode",
                      body + table(rows), args.out, lambda path: plot(rows, path))
    print(table(rows))


if __name__ == "__main__":
    main()

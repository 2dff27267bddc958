"""FLUX at 1024×1024: routes across the double- and single-stream stacks, beside the same route written by hand.

diffusers' FluxTransformer2DModel with FLUX's widths (24 heads of 128, joint width 4096) at reduced depth (4
double + 8 single blocks), on 4096 image tokens (a 1024×1024 image: 128×128 latents, packed 2×2) and 512 text
tokens; one train step (forward + backward + AdamW, bf16 autocast) at batch 1 and 2. Variants:

- vanilla;
- routekit, single stack: SimpleTuner's single-stack route, single block 1 → -2 (rate 0.5);
- routekit, across stacks: SimpleTuner's headline route, block 2 → -2 counted over both stacks;
- hand-written, across stacks: that route written here, independently of routekit, as SimpleTuner runs it:
  image tokens only, an independent selection per sample, each sample's rows of the joint [text; image] RoPE
  table cut for it;
- routekit SPRINT, across stacks (only when asked for with --variants): the same span at SPRINT's rate 0.75,
  ending in SPRINT's fusion (`fuse="sprint"`: the deep and dense paths joined by a linear layer, samples' deep
  paths dropped at SPRINT's rate 0.1).

Every variant runs the same attention processor (`AnyRopeAttention`: FLUX's attention, with a RoPE table of one
row set for the batch or one per sample), so per-sample tables are possible and the variants run the same
kernels; routekit finds by itself that the blocks take one table per sample and selects per sample too.
"FLOP limit" is vanilla's FLOPs over the variant's (torch's flop counter); "AdamW" is the optimizer's step timed on
its own, work per parameter that no route shortens, and "of the limit, AdamW aside" the speed-up of the rest of
the step over the FLOP limit; "host" is routekit's own Python work per training call (binding the call, checking
its program's assumptions), measured apart.

    python benchmarks/flux.py                  # on a GPU: batch 1 and 2, eager
    python benchmarks/flux.py --modes eager compile
    python benchmarks/flux.py --quick          # CPU smoke run: a tiny FLUX, 64 + 8 tokens
    python benchmarks/flux.py --modes compile --batches 1 --add   # one part of a longer study
    python benchmarks/flux.py --variants vanilla "routekit SPRINT across stacks" --add

Writes benchmarks/results/flux.{json,md,png} (or --out DIR), after every measurement. With --add, the rows
already there for the batches, modes and variants this call does not measure stay, each with the commit it was measured
at: compiled FLUX takes minutes a variant to compile, so its rows come from calls of under ten minutes each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
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
    kept_rows,
    machine,
    measure,
    step_flops,
    write,
)
from routekit.model import report_of, routing_of  # noqa: E402

FULL = {"num_layers": 4, "num_single_layers": 8, "attention_head_dim": 128, "num_attention_heads": 24,
        "joint_attention_dim": 4096, "pooled_projection_dim": 768, "in_channels": 64, "axes_dims_rope": (16, 56, 56)}
TINY = {"num_layers": 4, "num_single_layers": 8, "attention_head_dim": 16, "num_attention_heads": 2,
        "joint_attention_dim": 32, "pooled_projection_dim": 16, "in_channels": 16, "axes_dims_rope": (4, 6, 6)}
START, END, RATE = 2, -2, 0.5  # SimpleTuner's documented FLUX route, over both stacks
SPRINT_RATE = 0.75  # SPRINT's drop rate in pre-training
VARIANTS = ("vanilla", "routekit single stack", "routekit across stacks", "hand-written across stacks",
            "routekit SPRINT across stacks")
DEFAULT_VARIANTS = VARIANTS[:4]
SAME_ROUTE_AS_HAND = ("routekit across stacks", "hand-written across stacks")  # SPRINT's is another route


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """FLUX's rotary embedding of x (B, H, S, D) by a table of (S, D), or one per sample (B, S, D)."""
    cos, sin = (t[:, None] if t.dim() == 3 else t[None, None] for t in (cos, sin))
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class AnyRopeAttention:
    """FLUX's joint attention (diffusers' FluxAttnProcessor), with the RoPE table for the batch or per sample."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        heads = lambda x: x.unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)  # noqa: E731  (B, H, S, D)
        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if encoder_hidden_states is not None:
            text = [heads(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
            query, key, value = (torch.cat([t, x], dim=2) for t, x in zip(text, (query, key, value)))
        if image_rotary_emb is not None:
            query, key = rotate(query, *image_rotary_emb), rotate(key, *image_rotary_emb)
        out = F.scaled_dot_product_attention(query, key, value).transpose(1, 2).flatten(2).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text, image = out.split([encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], 1)
        return attn.to_out[1](attn.to_out[0](image.contiguous())), attn.to_add_out(text.contiguous())


def build(config: dict, device: str) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, **config).to(device)
    model.set_attn_processor(AnyRopeAttention())
    return model


def inputs(config: dict, batch: int, side: int, text: int, device: str, seed: int = 0) -> tuple[tuple, dict]:
    """FLUX's call on a side×side grid of packed latents and `text` text tokens."""
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1], img_ids[..., 2] = torch.arange(side)[:, None], torch.arange(side)[None, :]
    kwargs = {"encoder_hidden_states": torch.randn(batch, text, config["joint_attention_dim"], generator=g),
              "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=g),
              "timestep": torch.rand(batch, generator=g), "img_ids": img_ids.flatten(0, 1), "txt_ids": torch.zeros(text, 3)}
    x = torch.randn(batch, side * side, config["in_channels"], generator=g)
    return (x.to(device),), {k: v.to(device) for k, v in kwargs.items()}


class HandRoutedFlux(nn.Module):
    """FLUX's forward with one TREAD route over its chain of blocks (double-stream, then single-stream; `start`
    and `end` count over both, negative from the end), written as SimpleTuner runs it: each sample keeps its own
    random image tokens and gets its own rows of the joint [text; image] RoPE table; the others wait and rejoin
    after block `end`."""

    def __init__(self, flux: nn.Module, start: int, end: int, rate: float):
        super().__init__()
        self.flux, self.rate = flux, rate
        depth = len(flux.transformer_blocks) + len(flux.single_transformer_blocks)
        self.start, self.end = start % depth, end % depth

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids):
        m = self.flux
        image = m.x_embedder(hidden_states)
        temb = m.time_text_embed(timestep.to(image.dtype) * 1000, pooled_projections)
        text = m.context_embedder(encoder_hidden_states)
        cos, sin = m.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        rope, words, (batch, tokens, width) = (cos, sin), text.shape[1], image.shape
        for i, block in enumerate([*m.transformer_blocks, *m.single_transformer_blocks]):
            if i == self.start:
                keep = tokens - int(tokens * self.rate)
                kept = torch.rand(batch, tokens, device=image.device).topk(keep, dim=1).indices.sort(dim=1).values
                waiting, image = image, image.gather(1, kept[..., None].expand(batch, keep, width))
                rope = tuple(torch.cat([t[:words].expand(batch, words, t.shape[1]), t[words:][kept]], dim=1)
                             for t in (cos, sin))
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
            if i == self.end:
                image = waiting.to(image.dtype).scatter(1, kept[..., None].expand(image.shape), image)
                rope = (cos, sin)
        return m.proj_out(m.norm_out(image, temb))


def variant(name: str, config: dict, example: tuple[tuple, dict], device: str) -> nn.Module:
    model = build(config, device)
    if name == "vanilla":
        return model
    if name == "hand-written across stacks":
        return HandRoutedFlux(model, START, END, RATE)
    route = {"routekit across stacks": lambda: rk.Route(start=START, end=END, rate=RATE),
             "routekit SPRINT across stacks": lambda: rk.Route(start=START, end=END, rate=SPRINT_RATE, fuse="sprint"),
             "routekit single stack": lambda: rk.Route(start="single_transformer_blocks.1",
                                                       end="single_transformer_blocks.-2", rate=RATE)}[name]()
    return rk.apply(model, route, example_inputs=example[0], example_kwargs=example[1])


def host_ms(model: nn.Module, args: tuple, kwargs: dict, calls: int = 200) -> float:
    """routekit's own Python work per training call: finding the call's program (binding the arguments, checking
    what the program assumed about the model); the program itself is the model's work."""
    executor = routing_of(model).executor
    model.train()
    executor.program(model, args, kwargs)
    start = time.perf_counter()
    for _ in range(calls):
        executor.program(model, args, kwargs)
    return (time.perf_counter() - start) / calls * 1e3


def table(rows: list[dict]) -> str:
    out = ["| batch | mode | variant | median ms | p90 ms | speed-up | of hand-written | FLOP limit | of the limit "
           "| AdamW ms | of the limit, AdamW aside | peak GiB | host ms | commit |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for key in dict.fromkeys((r["batch"], r["mode"]) for r in rows):
        group = {r["variant"]: r for r in rows if (r["batch"], r["mode"]) == key}
        base, hand = group.get("vanilla"), group.get("hand-written across stacks")
        for name, r in group.items():
            speed = base["step_ms"] / r["step_ms"] if base else float("nan")
            rel = f"{hand['step_ms'] / r['step_ms']:.3f}" if hand and name in SAME_ROUTE_AS_HAND else ""
            host = f"{r['host_ms']:.3f} ({r['host_ms'] / r['step_ms']:.2%})" if "host_ms" in r else ""
            adamw = aside = ""
            if "optimizer_ms" in r and base and "optimizer_ms" in base:
                adamw = f"{r['optimizer_ms']:.1f}"
                rest = (base["step_ms"] - base["optimizer_ms"]) / (r["step_ms"] - r["optimizer_ms"])
                aside = f"{rest / r['flop_limit']:.3f}"
            out.append(f"| {key[0]} | {key[1]} | {name} | {r['step_ms']:.1f} | {r['p90_ms']:.1f} | {speed:.3f}× | {rel} "
                       f"| {r['flop_limit']:.3f}× | {speed / r['flop_limit']:.3f} | {adamw} | {aside} "
                       f"| {r['peak_gib']:.1f} | {host} | {r.get('commit', '')} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    keys = list(dict.fromkeys((r["batch"], r["mode"]) for r in rows))
    with figure(path, figsize=(7, 4)) as (_, ax):
        names = [name for name in VARIANTS[1:] if any(r["variant"] == name for r in rows)]
        width = 0.8 / max(len(names), 1)
        for k, name in enumerate(names):
            speeds = []
            for key in keys:
                group = {r["variant"]: r for r in rows if (r["batch"], r["mode"]) == key}
                speeds.append(group["vanilla"]["step_ms"] / group[name]["step_ms"] if name in group else 0)
            ax.bar([i + width * k for i in range(len(keys))], speeds, width, label=name)
        for key_index, key in enumerate(keys):
            limit = next((r["flop_limit"] for r in rows if (r["batch"], r["mode"]) == key
                          and r["variant"] == "routekit across stacks"), None)
            if limit:
                ax.hlines(limit, key_index - 0.15, key_index + 0.8, colors="grey", linestyles="--")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], [f"batch {b}, {m}" for b, m in keys])
        ax.set_ylabel("train-step speed-up over vanilla (median)")
        ax.set_title("FLUX, 4 double + 8 single blocks, 4096 + 512 tokens; dashed: FLOP limit across stacks",
                     fontsize=9)
        ax.legend(fontsize=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 2; 2 with --quick)")
    p.add_argument("--modes", nargs="+", default=None, choices=["eager", "compile"],
                   help="eager and/or torch.compile of the whole model (default eager)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                   help="which variants to measure (default: all but SPRINT's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--add", action="store_true",
                   help="keep the file's rows for the batches and modes this call does not measure")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny FLUX, 64 + 8 tokens (eager unless "
                   "--modes says otherwise)")
    args = p.parse_args()
    if "vanilla" not in args.variants:
        p.error("--variants must include vanilla: every row's speed-up and FLOP limit are against it")
    device = device_or_exit(args.quick)
    config, side, text = (TINY, 8, 8) if args.quick else (FULL, 64, 512)
    if args.quick:
        args.steps, args.warmup = 2, 0
    args.modes, args.batches = args.modes or ["eager"], args.batches or ([2] if args.quick else [1, 2])
    example = inputs(config, 2, side, text, device)
    info = machine()
    measured = lambda r: r["batch"] in args.batches and r["mode"] in args.modes and r["variant"] in args.variants
    rows, shared = (kept_rows(args.out / "flux.json", measured) if args.add else []), {}
    info["attention"] = "SDPA (flash or memory-efficient on a GPU) through AnyRopeAttention in every variant"
    body = (f"FLUX widths at reduced depth ({config['num_layers']} double + {config['num_single_layers']} single "
            f"blocks), {side * side} image + {text} text tokens; routes at rate {RATE}: across stacks {START} → {END} "
            f"over the chain, single stack: single block 1 → -2; SPRINT's: {START} → {END} at rate {SPRINT_RATE}, "
            "fused. Median and p90 of each variant's step times; ")
    backends = attention_backends(device)
    backends.__enter__()
    for batch in args.batches:
        batch_inputs = inputs(config, batch, side, text, device, seed=1)
        flops = {}
        for name in [name for name in VARIANTS if name in args.variants]:
            model = variant(name, config, example, device)
            flops[name] = step_flops(model, *batch_inputs)
            for mode in args.modes:
                torch._dynamo.reset()
                stats = measure(model, *batch_inputs, mode, args.steps, args.warmup)
                if name.startswith("routekit"):
                    stats["host_ms"] = host_ms(model, *batch_inputs)
                    shared[name] = report_of(model).placed[0].shared
                rows.append({"batch": batch, "mode": mode, "variant": name, "commit": info["commit"],
                             "flop_limit": flops["vanilla"] / flops[name], **stats})
                print(f"batch {batch} {mode:7s} {name:28s} median {stats['step_ms']:8.2f} ms  p90 "
                      f"{stats['p90_ms']:8.2f} ms  (first step {stats['first_step_s']:.1f} s)", flush=True)
                selection = ", ".join(f"{k}: {'one for the batch' if v else 'per sample'}" for k, v in shared.items())
                write("flux", info, {"rows": rows, "shared": shared}, "FLUX train step at 1024×1024, routed across "
                      "its two stacks", body + f"routekit's selection ({selection}).\n\n" + table(rows), args.out,
                      lambda path: plot(rows, path))
            del model
            free_memory()
    backends.__exit__(None, None, None)
    print(table(rows))


if __name__ == "__main__":
    main()

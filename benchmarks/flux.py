"""FLUX at 1024×1024: a routed train step against its FLOP limit, beside a route written by hand.

diffusers' FluxTransformer2DModel with FLUX's widths (24 heads of 128, joint width 4096) at reduced depth,
on 4096 image tokens (a 1024×1024 image: 128×128 latents, packed 2×2) and 512 text tokens, one train step
(forward + backward + AdamW, bf16 autocast). Variants: vanilla; routekit's default route over the double-
stream stack (rate 0.5); and that route written here by hand (`HandRoutedFlux`), independently of routekit.
FLUX's RoPE table has no batch axis, so both routes keep one selection for the whole batch (routekit finds
that by itself and says so). "FLOP limit" is vanilla's FLOPs over the variant's (torch's flop counter).

    python benchmarks/flux.py                    # on a GPU: batch 2, 8 double + 4 single blocks, eager
    python benchmarks/flux.py --quick            # CPU smoke run: a tiny FLUX, 64 + 8 tokens

Writes benchmarks/results/flux.{json,md,png} (or --out DIR).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import routekit as rk  # noqa: E402
from benchmarks.common import RESULTS, device_or_exit, figure, machine, time_ms, write  # noqa: E402

FULL = {"num_layers": 8, "num_single_layers": 4, "attention_head_dim": 128, "num_attention_heads": 24,
        "joint_attention_dim": 4096, "pooled_projection_dim": 768, "in_channels": 64, "axes_dims_rope": (16, 56, 56)}
TINY = {"num_layers": 8, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
        "joint_attention_dim": 32, "pooled_projection_dim": 16, "in_channels": 16, "axes_dims_rope": (4, 6, 6)}


def build(config: dict, device: str) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, **config).to(device)


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
    """FLUX's forward written out with one TREAD route over double-stream blocks start..end: the image tokens
    kept (one subset for the batch) and their rows of the joint [text; image] RoPE table go through the route,
    the others wait and rejoin after it."""

    def __init__(self, flux: nn.Module, start: int, end: int, rate: float):
        super().__init__()
        self.flux, self.start, self.end, self.rate = flux, start, end, rate

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids):
        m = self.flux
        image = m.x_embedder(hidden_states)
        temb = m.time_text_embed(timestep.to(image.dtype) * 1000, pooled_projections)
        text = m.context_embedder(encoder_hidden_states)
        cos, sin = m.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        words, tokens = text.shape[1], image.shape[1]
        rope = (cos, sin)
        for i, block in enumerate(m.transformer_blocks):
            if i == self.start:
                kept = torch.randperm(tokens, device=image.device)[:tokens - int(tokens * self.rate)].sort().values
                waiting = image
                image = image[:, kept]
                rows = torch.cat([torch.arange(words, device=kept.device), words + kept])
                rope = (cos[rows], sin[rows])
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
            if i == self.end:
                image = waiting.to(image.dtype).index_copy(1, kept, image)
                rope = (cos, sin)
        for block in m.single_transformer_blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
        return m.proj_out(m.norm_out(image, temb))


def variant(name: str, config: dict, example: tuple[tuple, dict], device: str) -> nn.Module:
    model = build(config, device)
    route = rk.Route.default(len(model.transformer_blocks))
    if name == "vanilla":
        return model
    if name == "manual":
        return HandRoutedFlux(model, route.start, route.end, route.rate)
    return rk.apply(model, route, example_inputs=example[0], example_kwargs=example[1])


def call(model: nn.Module, args: tuple, kwargs: dict):
    out = model(*args, **kwargs)
    return out.sample if hasattr(out, "sample") else out


def step_flops(model: nn.Module, args: tuple, kwargs: dict) -> int:
    model.train()
    with FlopCounterMode(display=False) as counter, torch.autocast(args[0].device.type, torch.bfloat16,
                                                                    enabled=args[0].is_cuda):
        call(model, args, kwargs).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def measure(model: nn.Module, args: tuple, kwargs: dict, mode: str, steps: int, warmup: int) -> dict:
    cuda = args[0].is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    model.train()
    runner = torch.compile(model) if mode == "compile" else model
    target = torch.randn_like(args[0])

    def step():
        with torch.autocast(args[0].device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.mse_loss(call(runner, args, kwargs).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first = time.perf_counter() - start
    timing = time_ms(step, steps, warmup, cuda)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {"step_ms": timing["median_ms"], "min_ms": timing["min_ms"], "peak_gib": peak, "first_step_s": first}


def table(rows: list[dict]) -> str:
    out = ["| mode | variant | step ms | speed-up | vs hand-written | FLOP limit | of the limit | peak GiB |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        group = {r["variant"]: r for r in rows if r["mode"] == mode}
        base, manual = group.get("vanilla"), group.get("manual")
        for name, r in group.items():
            speed = base["step_ms"] / r["step_ms"] if base else float("nan")
            rel = f"{speed / (base['step_ms'] / manual['step_ms']):.3f}" if manual and base and name != "vanilla" else ""
            out.append(f"| {mode} | {name} | {r['step_ms']:.2f} | {speed:.3f}× | {rel} | {r['flop_limit']:.3f}× | "
                       f"{speed / r['flop_limit']:.3f} | {r['peak_gib']:.2f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    with figure(path, figsize=(6, 4)) as (_, ax):
        for k, name in enumerate(["routekit", "manual"]):
            speeds = []
            for mode in modes:
                group = {r["variant"]: r for r in rows if r["mode"] == mode}
                speeds.append(group["vanilla"]["step_ms"] / group[name]["step_ms"] if name in group else 0)
            ax.bar([i + 0.3 * k for i in range(len(modes))], speeds, 0.3, label=name)
        limit = next(r["flop_limit"] for r in rows if r["variant"] == "routekit")
        ax.axhline(limit, color="grey", ls="--", label="FLOP limit")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.15 for i in range(len(modes))], modes)
        ax.set_ylabel("train-step speed-up over vanilla")
        ax.legend(fontsize=8)


def attention_backends(device: str):
    """Flash or memory-efficient attention on a GPU: torch 2.11's cuDNN attention fails on FLUX's shapes in
    backward (`mha_graph.execute`), and the three variants must run the same kernels to be compared."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]) if device == "cuda" \
        else nullcontext()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compile"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny FLUX, 64 + 8 tokens, eager")
    args = p.parse_args()
    device = device_or_exit(args.quick)
    config, side, text = (TINY, 8, 8) if args.quick else (FULL, 64, 512)
    if args.quick:
        args.modes, args.steps, args.warmup = ["eager"], 2, 0
    example = inputs(config, 2, side, text, device)
    batch_inputs = inputs(config, args.batch, side, text, device, seed=1)
    rows, flops = [], {}
    backends = attention_backends(device)
    backends.__enter__()
    for name in ("vanilla", "routekit", "manual"):
        model = variant(name, config, example, device)
        flops[name] = step_flops(model, *batch_inputs)
        for mode in args.modes:
            torch._dynamo.reset()
            stats = measure(model, *batch_inputs, mode, args.steps, args.warmup)
            rows.append({"mode": mode, "variant": name, "flop_limit": flops["vanilla"] / flops[name], **stats})
            print(f"{mode:8s} {name:9s} {stats['step_ms']:8.2f} ms (first step {stats['first_step_s']:.1f} s)",
                  flush=True)
        if name == "routekit":
            plan = rk.report_of(model)
            shared = plan.placed[0].shared
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    backends.__exit__(None, None, None)
    info = machine()
    info["attention"] = "flash or memory-efficient SDPA" if device == "cuda" else "default"
    body = (f"FLUX widths at reduced depth ({config['num_layers']} double + {config['num_single_layers']} single "
            f"blocks), {side * side} image + {text} text tokens, batch {args.batch}; route "
            f"{rk.Route.default(config['num_layers'])!r}; routekit shares one selection by the batch: {shared}.\n\n"
            + table(rows))
    write("flux", info, {"rows": rows}, "FLUX train step at 1024×1024, routed", body, args.out,
          lambda path: plot(rows, path))
    print(table(rows))


if __name__ == "__main__":
    main()

"""Train-step throughput: vanilla vs routekit-routed vs a hand-written route, and the DAR rows, in one run.

One train step = forward + backward + AdamW under bf16 autocast. For each backbone, size, batch and
mode it reports the median and 90th-percentile step time, speed-up over vanilla, peak memory,
and the speed-up FLOPs alone would give (torch.utils.flop_counter on one step). The hand-written
route (random tokens for DiT, whole rows for the scan backbones) is written here, independently of
routekit, as the bar routekit must meet. The DAR variants (chunks of 4) replace the residual adds, alone
or with the default route. ``sprint`` is SPRINT's split (Park et al.): the first 2 and last 2 blocks on every
token, the middle on a quarter of them (rate 0.75), the span's end fused with its start (``Route(fuse="sprint")``).

    python benchmarks/throughput.py --backbone dit --sizes XL/2 --batches 256 --modes compile
    python benchmarks/throughput.py --sizes XL/2 --batches 256 --modes compile --variants vanilla dar_static_c4
    python benchmarks/throughput.py --sizes XL/2 --batches 256 --modes compile --variants dar_regions_c4 vanilla
    python benchmarks/throughput.py --sizes XL/2 --batches 256 --modes compile --variants vanilla sprint \
        --interleave --name throughput_sprint
    python benchmarks/throughput.py --backbone rwkv mamba --sizes B/2 --batches 256 --modes eager
    python benchmarks/throughput.py --sizes B/2 XL/2 --batches 32 --modes blocks     # per-block compile
    python benchmarks/throughput.py --sizes B/2 --batches 16 64 --modes graphs --variants vanilla routekit
    python benchmarks/throughput.py --quick      # CPU smoke run: tiny models, eager

Modes: ``eager``; ``compile``, the whole model under torch.compile; ``blocks``, each block compiled on its own
(DiT only: the official TREAD code and diffusers' regional compilation compile this way), the rest eager;
``graphs``, the whole model under torch.compile(mode="reduce-overhead"), which replays CUDA graphs.

Writes benchmarks/results/<name>.{json,md,png} (--name, default throughput_<backbones>). With --add, the rows
already in that file for the configurations (backbone, size, batch, mode, variant) this call does not measure
stay, each with the commit it was measured at, so a study too long for one run fills one file over several:

    python benchmarks/throughput.py --sizes B/2 --batches 16 64 --modes graphs --variants vanilla routekit \
        --name throughput_dit_graphs
    python benchmarks/throughput.py --sizes XL/2 --batches 16 64 --modes graphs --variants vanilla routekit \
        --name throughput_dit_graphs --add
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import routekit as rk
from benchmarks.common import (  # noqa: E402
    RESULTS,
    TINY,
    device_or_exit,
    figure,
    flop_counter_mode,
    free_memory,
    kept_rows,
    machine,
    scan_kernel,
    step_stats,
    time_ms,
    time_step,
    write,
)


class HandRouted(nn.Module):
    """The model's forward re-written by hand with one TREAD route: the reference routekit must match. DiT keeps an
    independent random subset of tokens per sample; the scan backbones (DiM, Diffusion-RWKV), whose blocks see
    their tokens as rows of the grid, keep whole rows per sample, as routekit's `row` selector does."""

    def __init__(self, model: nn.Module, start: int, end: int, rate: float, rows: bool = False):
        super().__init__()
        self.model, self.start, self.end, self.rate, self.rows = model, start, end, rate, rows

    def forward(self, x, t, y):
        m = self.model
        x = m.x_embedder(x) + m.pos_embed
        c = m.t_embedder(t) + m.y_embedder(y)
        batch, tokens, dim = x.shape
        for i, block in enumerate(m.blocks):
            if i == self.start:
                index = self.kept(batch, tokens, x.device).unsqueeze(-1).expand(batch, -1, dim)
                skipped = x
                x = torch.gather(x, 1, index)
            x = block(x, c)
            if i == self.end:
                x = skipped.to(x.dtype).scatter(1, index, x)
        return m.unpatchify(m.final_layer(x, c))

    def kept(self, batch: int, tokens: int, device) -> torch.Tensor:
        """(batch, kept) sorted token positions: random tokens, or the tokens of random whole rows."""
        height, width = self.model.grid if self.rows else (tokens, 1)
        keep = height - int(height * self.rate)
        lines = torch.rand(batch, height, device=device).argsort(dim=1)[:, :keep].sort(dim=1).values
        if not self.rows:
            return lines
        return (lines[:, :, None] * width + torch.arange(width, device=device)).flatten(1)


# DAR rows: (query, with the default TREAD route?, regional compilation?), all with chunk size 4
DAR_VARIANTS = {"dar_static_c4": ("static", False, False), "dar_dynamic_c4": ("dynamic", False, False),
                "dar_tread": ("static", True, False), "dar_regions_c4": ("static", False, True)}
VARIANTS = ("vanilla", "routekit", "manual", "sprint", *DAR_VARIANTS)


MODES = ("eager", "compile", "blocks", "graphs")


def build(backbone: str, size: str, variant: str, device: str, tiny: bool = False, example_batch: int = 2,
          compile_blocks: bool = False) -> nn.Module:
    module = importlib.import_module(f"backbones.{backbone}")
    torch.manual_seed(0)
    overrides = dict(TINY[backbone] if tiny else {})
    if compile_blocks:
        if backbone != "dit":
            raise SystemExit(f"--modes blocks: only the DiT backbone has a per-block compiled build, not {backbone!r}")
        overrides["compile_blocks"] = True
    with torch.device(device):
        model = module.build(size, **overrides)
    route = rk.Route.default(model.depth, selector="random" if backbone == "dit" else "row")
    if variant == "vanilla":
        return model
    if variant == "manual":
        return HandRouted(model, route.start, route.end, route.rate, rows=route.selector == "row")
    example = module.example_inputs(model, example_batch, device=device)
    if variant == "routekit":
        return rk.apply(model, routes=[route], example_inputs=example)
    if variant == "sprint":  # SPRINT's split of SiT-XL/2's 28 blocks: 2 on every token, 24 on a quarter, 2 again
        fused = rk.Route(start=2, end=model.depth - 3, rate=0.75, selector=route.selector, fuse="sprint")
        return rk.apply(model, routes=[fused], example_inputs=example)
    query, routes, regions = DAR_VARIANTS[variant]
    return rk.apply(model, routes=[route] if routes else None, residual=rk.DAR(query=query, chunk=4, regions=regions),
                    example_inputs=example)


def inputs_for(backbone: str, model: nn.Module, batch: int, device: str):
    module = importlib.import_module(f"backbones.{backbone}")
    inner = model.model if isinstance(model, HandRouted) else model
    return module.example_inputs(inner, batch, device=device, generator=torch.Generator(device).manual_seed(0))


def train_step(model: nn.Module, opt, x, t, y, autocast: bool) -> torch.Tensor:
    noise = torch.randn_like(x)
    tt = t.view(-1, 1, 1, 1)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        pred = model((1 - tt) * x + tt * noise, t, y)
    loss = F.mse_loss(pred.float(), noise - x)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def prepare(model: nn.Module, backbone: str, batch: int, mode: str, device: str) -> tuple[Callable[[], None], dict]:
    """The model's train step (AdamW, fixed inputs, compiled as `mode` says), run once: the step and what its first,
    compiling, call took."""
    cuda = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x, t, y = inputs_for(backbone, model, batch, device)
    model.train()
    # "blocks": the model was built with its blocks compiled; the rest of it (and routekit's program) runs eager
    runner = model
    if mode == "compile":
        runner = torch.compile(model)
    elif mode == "graphs":
        runner = torch.compile(model, mode="reduce-overhead")

    def step():
        train_step(runner, opt, x, t, y, cuda)

    if mode != "eager":
        cold_compile_caches()
    before, graphs_before = compile_seconds(), graph_counts()
    start = time.perf_counter()  # the first step holds the compilation: timed apart, never in the median
    step()
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    stats = {"first_step_s": first}
    if mode != "eager":
        stats["first_step_phases_s"] = first_step_phases(before, first)
        stats.update(graph_counts(graphs_before))
    return step, stats


def cold_compile_caches() -> None:
    """Make the next compilation a first one, as on a machine that never compiled these models: fresh Inductor and
    Triton cache folders, Inductor's compile workers restarted (each reads the Triton folder when it starts), and
    the compiled kernels this process holds forgotten. Without it a variant's first step found the kernels an
    earlier variant compiled ready (routekit's route and the hand-written one compile the same blocks' kernels),
    so whichever ran later looked faster to compile."""
    import tempfile

    from torch._inductor import async_compile, codecache

    root = Path(tempfile.mkdtemp(prefix="routekit-compile-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = str(root / "inductor"), str(root / "triton")
    # torch's private names: each called where this torch has it (they moved between releases)
    for owner, name in ((async_compile, "shutdown_compile_workers"),
                        (getattr(async_compile, "CompiledTritonKernels", None), "cache_clear"),
                        (codecache.PyCodeCache, "cache_clear"), (codecache.CppCodeCache, "cache_clear"),
                        (codecache.CppPythonBindingsCodeCache, "cache_clear")):  # the last two: a CPU's kernels
        if callable(getattr(owner, name, None)):
            getattr(owner, name)()
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    # routekit's kernels and the models' own; type(), for a dead weak proxy among the objects refuses isinstance
    for kernel in [o for o in gc.get_objects() if issubclass(type(o), JITFunction)]:
        getattr(kernel, "device_caches", {}).clear()


def timed(timing: dict, stats: dict, cuda: bool) -> dict:
    stats = {"step_ms": timing["median_ms"], "p90_ms": timing["p90_ms"], "min_ms": timing["min_ms"], **stats}
    if cuda:  # on a CPU the host time is the step time
        stats["step_host_ms"] = timing["step_host_ms"]
    return stats


def measure(model: nn.Module, backbone: str, batch: int, mode: str, steps: int, warmup: int, device: str,
            gpu_busy: bool = False) -> dict:
    cuda = device == "cuda"
    step, first = prepare(model, backbone, batch, mode, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    stats = timed(time_ms(step, steps, warmup, cuda), first, cuda)
    stats["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    if gpu_busy and cuda:
        stats["gpu_busy_ms"], stats["top_kernels"] = gpu_busy_ms(step)
    return stats


def measure_interleaved(models: dict[str, nn.Module], backbone: str, batch: int, mode: str, steps: int, warmup: int,
                        device: str, gpu_busy: bool = False, built: dict[str, int] | None = None) -> dict[str, dict]:
    """`measure` for several variants at once, their timed steps taken in turn (round r starts at variant r), so
    that a host whose speed drifts during the call (another tenant, clocks) slows every variant alike: a step that
    waits on the host moved 20-35% between calls, and variants timed one after another each met another host.

    All models stay on the device, so a variant's peak memory is counted as its own (`built`: the bytes building
    it allocated): those, plus what its first step left allocated (gradients, the optimiser's state), plus the
    most its warm-up steps allocated above what every model held then (at least one warm-up step)."""
    cuda = device == "cuda"
    prepared, peaks = {}, {}
    for variant, model in models.items():
        held = torch.cuda.memory_allocated() if cuda else 0
        step, first = prepare(model, backbone, batch, mode, device)
        if cuda:
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(max(warmup, 1) if cuda else warmup):
            step()
        if cuda and built is not None:
            torch.cuda.synchronize()
            own = built[variant] + kept - held  # its parameters, gradients and optimiser state
            peaks[variant] = (own + torch.cuda.max_memory_allocated() - kept) / 2**30
        prepared[variant] = step, first
    if cuda:
        torch.cuda.synchronize()  # the first timed step's host time must not include warm-up work still queued
    samples: dict[str, list[tuple[float, float]]] = {variant: [] for variant in models}
    names = list(models)
    for r in range(steps):
        for variant in names[r % len(names):] + names[:r % len(names)]:
            samples[variant].append(time_step(prepared[variant][0], cuda))
    results = {}
    for variant, (step, first) in prepared.items():
        times, host = zip(*samples[variant])
        timing = step_stats(list(times), list(host))
        results[variant] = {**timed(timing, first, cuda), "peak_gib": peaks.get(variant, float("nan")),
                            "interleaved": True}
        if gpu_busy and cuda:
            results[variant]["gpu_busy_ms"], results[variant]["top_kernels"] = gpu_busy_ms(step)
    return results


# Where a compiled model's first step goes, by torch.compile's own timers (torch._dynamo.utils): tracing the
# Python (Dynamo), the joint forward-backward graph (AOTAutograd), then Inductor for the forward graph and, in
# the first backward, for the backward graph, each with the wait for its kernels to compile; "other" is the
# rest of the step (routekit's own Triton kernels compile at their first launch, the step runs, CUDA graphs
# are recorded, graphs come out of Inductor's caches: a warm cache leaves the compile phases near 0).
PHASES = {"dynamo": "bytecode_tracing", "aot autograd": "aot_trace_joint_graph",
          "inductor forward": "compile_fx.<locals>.fw_compiler_base",
          "inductor backward": "compile_fx.<locals>.bw_compiler", "kernel compile wait": "async_compile.wait"}


def compile_seconds() -> dict[str, float]:
    """Seconds torch.compile's timers have summed so far in this process, per timer."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def graph_counts(before: dict | None = None) -> dict:
    """Graphs Dynamo has compiled and graph breaks it met so far (since `before`), with the break reasons seen
    most often: a compiled model in many pieces runs eager code between them, which CUDA graphs cannot hold."""
    from torch._dynamo.utils import counters

    reasons = dict(counters["graph_break"])
    now = {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(reasons.values()),
           "break_reasons": reasons}
    if before is None:
        return now
    new = {k: v - before["break_reasons"].get(k, 0) for k, v in reasons.items()}
    top = sorted((k for k, v in new.items() if v > 0), key=lambda k: -new[k])[:3]
    return {"graphs": now["graphs"] - before["graphs"], "graph_breaks": now["graph_breaks"] - before["graph_breaks"],
            "break_reasons": {k[:200]: new[k] for k in top}}


def first_step_phases(before: dict[str, float], first: float) -> dict[str, float]:
    """The seconds by phase (PHASES; "kernel compile wait" is inside the two Inductor phases) of a first step
    that took `first` seconds and began when the timers read `before` (``compile_seconds()``)."""
    now = compile_seconds()
    phases = {label: now.get(timer, 0.0) - before.get(timer, 0.0) for label, timer in PHASES.items()}
    phases["other"] = max(0.0, first - sum(v for k, v in phases.items() if k != "kernel compile wait"))
    return phases


def gpu_busy_ms(step, steps: int = 3, top: int = 12) -> tuple[float, list[dict]]:
    """Time the GPU spends in kernels per step (profiler): far below the step time means the step
    waits on the host (Python and kernel launches), not on the GPU. Also the `top` kernels and the
    `top` operators (by the kernel time they launch) per step: where the step's GPU time goes; and the `top`
    operators by their own host time: where a step that waits on the host spends it (the profiler's own
    overhead inflates these, alike for every variant)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    ops = [e for e in events if e.device_type == DeviceType.CPU and e.self_device_time_total > 0]

    host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.self_cpu_time_total,
                  reverse=True)

    def rows(found: list, kind: str, spent=lambda e: e.self_device_time_total) -> list[dict]:
        return [{"kind": kind, "kernel": e.key[:90], "ms": spent(e) / 1e3 / steps, "calls": e.count / steps}
                for e in found[:top]]

    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    return busy, rows(kernels, "kernel") + rows(ops, "op") + rows(host, "host", lambda e: e.self_cpu_time_total)


def step_flops(model: nn.Module, backbone: str, device: str, batch: int = 4) -> int:
    """FLOPs of one forward+backward (matmuls and attention), counted by torch's flop counter."""
    x, t, y = inputs_for(backbone, model, batch, device)
    model.train()
    counter = flop_counter_mode()
    with counter, torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=device == "cuda"):
        model(x, t, y).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def variants_of(backbone: str, asked: list[str] | None) -> list[str]:
    """The variants one backbone runs: those asked for, or by default vanilla, routekit and the hand-written
    route."""
    return list(asked) if asked is not None else ["vanilla", "routekit", "manual"]


def run(args, device: str, save=lambda rows: None, rows: list[dict] | None = None) -> list[dict]:
    """Measure every (backbone, size, batch, mode, variant) asked for, after `rows` (kept from an earlier call)."""
    rows = list(rows or [])
    for backbone in args.backbone:
        variants = variants_of(backbone, args.variants)
        for size in args.sizes:
            flops = {}
            for variant in dict.fromkeys(["vanilla", *variants]):  # vanilla's FLOPs set every row's limit
                model = build(backbone, size, variant, device, args.quick)
                flops[variant] = step_flops(model, backbone, device)
                del model
                free_memory()
            for batch in args.batches:
                for mode in args.modes:
                    measured = (_interleaved if args.interleave else _one_by_one)(args, backbone, size, batch, mode,
                                                                                 variants, device)
                    for variant, stats in measured:  # saved as each comes, so a call cut short keeps its rows
                        row = {"backbone": backbone, "size": size, "batch": batch, "mode": mode, "variant": variant,
                               "flop_limit": flops["vanilla"] / flops[variant], **stats}
                        if args.add:
                            row["commit"] = args.commit
                        rows.append(row)
                        save(rows)
    return rows


OUT_OF_MEMORY = {"step_ms": float("nan"), "p90_ms": float("nan"), "min_ms": float("nan"), "peak_gib": float("nan"),
                 "first_step_s": float("nan"), "status": "out of memory"}


def _report(backbone: str, size: str, batch: int, mode: str, variant: str, stats: dict) -> None:
    print(f"{backbone} {size} b{batch} {mode:8s} {variant:9s} {stats['step_ms']:8.2f} ms (p90 {stats['p90_ms']:.2f}) "
          f"peak {stats['peak_gib']:.1f} GiB (first step {stats['first_step_s']:.1f} s)", flush=True)


def _one_by_one(args, backbone: str, size: str, batch: int, mode: str, variants: list[str], device: str):
    """Each variant built, measured and freed in turn (its peak memory its own): yields (variant, stats)."""
    for variant in variants:
        torch._dynamo.reset()
        model = None
        try:
            model = build(backbone, size, variant, device, args.quick, compile_blocks=mode == "blocks")
            stats = measure(model, backbone, batch, mode, args.steps, args.warmup, device, args.gpu_busy)
        except torch.OutOfMemoryError:  # recorded as such; the other rows still run
            stats = dict(OUT_OF_MEMORY)
        _report(backbone, size, batch, mode, variant, stats)
        del model
        free_memory()
        yield variant, stats


def _interleaved(args, backbone: str, size: str, batch: int, mode: str, variants: list[str], device: str):
    """Every variant built, then measured together (`measure_interleaved`): yields (variant, stats)."""
    torch._dynamo.reset()
    models, built = {}, {}
    cuda = device == "cuda"
    try:
        for variant in variants:
            before = torch.cuda.memory_allocated() if cuda else 0
            models[variant] = build(backbone, size, variant, device, args.quick, compile_blocks=mode == "blocks")
            built[variant] = (torch.cuda.memory_allocated() if cuda else 0) - before
        out = measure_interleaved(models, backbone, batch, mode, args.steps, args.warmup, device, args.gpu_busy,
                                  built)
    except torch.OutOfMemoryError:  # all on the device at once: the group is out of memory together
        out = {variant: dict(OUT_OF_MEMORY) for variant in variants}
    models.clear()
    free_memory()
    for variant, stats in out.items():
        _report(backbone, size, batch, mode, variant, stats)
        yield variant, stats


def table(rows: list[dict]) -> str:
    commits = any("commit" in r for r in rows)  # rows of several calls (--add) each say their commit
    out = ["| backbone | size | batch | mode | variant | step ms (median) | p90 ms | speed-up | vs hand-written "
           "| FLOP limit | share of limit | peak GiB |" + (" commit |" if commits else ""),
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if commits else "")]
    groups = {}
    for r in rows:
        groups.setdefault((r["backbone"], r["size"], r["batch"], r["mode"]), {})[r["variant"]] = r
    for key, g in groups.items():
        base = g.get("vanilla")
        manual = g.get("manual")
        for variant, r in g.items():
            speed = base["step_ms"] / r["step_ms"] if base else float("nan")
            rel = ""  # routekit's speed-up over the hand-written route's, the same route placed two ways
            if manual and variant in ("routekit", "manual") and base:
                rel = f"{speed / (base['step_ms'] / manual['step_ms']):.3f}"
            tail = f" {r.get('commit', '')} |" if commits else ""
            if r.get("status"):
                out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {variant} | {r['status']} | | | | "
                           f"{r['flop_limit']:.3f}× | | |" + tail)
                continue
            # without a vanilla row of its configuration a row has no speed-up: blank, not nan
            share = f"{speed / r['flop_limit']:.3f}" if variant != "vanilla" and base else ""
            ratio = f"{speed:.3f}×" if base else ""
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {variant} | {r['step_ms']:.2f} | "
                       f"{r.get('p90_ms', float('nan')):.2f} | {ratio} | {rel} | {r['flop_limit']:.3f}× | {share} | "
                       f"{r['peak_gib']:.2f} |" + tail)
    together = sorted({f"{r['backbone']} {r['size']} b{r['batch']} {r['mode']}" for r in rows if r.get("interleaved")})
    if together:
        out += ["", "Timed interleaved (`--interleave`: the variants' steps taken in turn, every model on the device; a "
                "variant's peak memory is what it holds plus the most its warm-up steps allocated above what all held): "
                + ", ".join(together) + "."]
    firsts = [f"{r['backbone']} {r['size']} b{r['batch']} {r['mode']} {r['variant']}: {r['first_step_s']:.1f} s ("
              + ", ".join(f"{k} {v:.1f}" for k, v in r["first_step_phases_s"].items()) + ")"
              + (f"; {r['graphs']} graphs, {r['graph_breaks']} graph breaks" if "graphs" in r else "")
              + "".join(f"; {n}× {reason!r}" for reason, n in r.get("break_reasons", {}).items())
              for r in rows if r.get("first_step_phases_s")]
    if firsts:
        out += ["", "First (compiling) step, seconds by phase (torch.compile's timers; the kernel compile wait is "
                "inside the Inductor phases):", ""]
        out += [f"- {line}" for line in firsts]
    hosts = [f"{r['backbone']} {r['size']} b{r['batch']} {r['mode']} {r['variant']}: {r['step_host_ms']:.1f} ms of a "
             f"{r['step_ms']:.1f} ms step" for r in rows if "step_host_ms" in r]
    if hosts:
        out += ["", "Host time per step (median time a step takes to return, its kernels queued; near the step "
                "time = the step waits on the host):", ""]
        out += [f"- {line}" for line in hosts]
    busy = [f"{r['backbone']} {r['size']} b{r['batch']} {r['mode']} {r['variant']}: {r['gpu_busy_ms']:.1f} ms"
            for r in rows if "gpu_busy_ms" in r]
    if busy:
        out += ["", "GPU kernel time per step (profiler; well below the step time = the step waits on the host):", ""]
        out += [f"- {line}" for line in busy]
    for r in rows:
        if r.get("top_kernels"):
            out += ["", f"Top kernels and operators (by the kernel time they launch; host: by their own host time) "
                    f"per step, {r['backbone']} "
                    f"{r['size']} b{r['batch']} {r['mode']} {r['variant']}:", "",
                    "| kind | name | ms/step | calls/step |", "|---|---|---:|---:|"]
            out += [f"| {k.get('kind', 'kernel')} | `{k['kernel']}` | {k['ms']:.2f} | {k['calls']:.0f} |"
                    for k in r["top_kernels"]]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    groups = {}
    for r in rows:
        groups.setdefault(f"{r['backbone']} {r['size']}\nb{r['batch']} {r['mode']}", {})[r["variant"]] = r
    labels = list(groups)
    variants = [v for v in ["routekit", "manual", "dar_static_c4", "dar_dynamic_c4", "dar_tread"]
                if any(v in g for g in groups.values())]
    with figure(path, figsize=(max(6, 1.3 * len(labels)), 4)) as (_, ax):
        width = 0.8 / (len(variants) + 1)
        for k, v in enumerate(variants):
            vals = [g["vanilla"]["step_ms"] / g[v]["step_ms"] if v in g and "vanilla" in g else 0 for g in groups.values()]
            ax.bar([i + k * width for i in range(len(labels))], vals, width, label=v)
        limits = [next(iter(g.values()))["flop_limit"] if "routekit" not in g else g["routekit"]["flop_limit"]
                  for g in groups.values()]
        ax.bar([i + len(variants) * width for i in range(len(labels))], limits, width, label="FLOP limit", color="lightgrey")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + width * len(variants) / 2 for i in range(len(labels))], labels, fontsize=8)
        ax.set_ylabel("train-step speed-up over vanilla")
        ax.legend(fontsize=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", nargs="+", default=["dit"], choices=["dit", "rwkv", "mamba"])
    p.add_argument("--sizes", nargs="+", default=["B/2", "XL/2"])
    p.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    p.add_argument("--modes", nargs="+", default=None, choices=MODES,
                   help="default eager and compile (--quick: eager). eager; compile (whole model); blocks (each DiT "
                   "block compiled on its own); graphs (whole "
                   "model, mode='reduce-overhead': CUDA graphs)")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="default: vanilla, routekit and manual, the hand-written route")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--name", default=None, help="results file stem (default throughput_<backbones>)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--gpu-busy", action="store_true", help="also profile the GPU's kernel time per step")
    p.add_argument("--interleave", action="store_true",
                   help="build every variant of a configuration at once and take their timed steps in turn, so a "
                   "drifting host slows all alike; each variant's peak memory is counted apart from the others' models")
    p.add_argument("--add", action="store_true", help="keep the rows of the results file for the configurations "
                   "(backbone, size, batch, mode, variant) this call does not measure, each with its commit")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: tiny models, batch 2, two steps (eager unless --modes)")
    args = p.parse_args()
    dar = [v for v in args.variants or () if v in DAR_VARIANTS]
    if "blocks" in (args.modes or ()) and dar:
        p.error(f"--modes blocks with {', '.join(dar)}: DAR inlines the blocks, so their compiled calls would not run "
                "and the row would time DAR uncompiled; measure DAR with --modes compile (the model compiled whole)")
    if args.quick:
        args.sizes, args.batches, args.steps, args.warmup = ["S/2"], [2], 2, 0
    args.modes = args.modes or (["eager"] if args.quick else ["eager", "compile"])
    device = device_or_exit(args.quick)
    info = machine()
    info["scan_kernels"] = {b: k for b in args.backbone if (k := scan_kernel(b, device))}
    name = args.name or "throughput_" + "_".join(args.backbone)
    mixers = "".join(f"Token mixer ({b}): {k}\n\n" for b, k in info["scan_kernels"].items())

    def save(rows: list[dict]) -> None:  # after every row, so a run cut short still leaves its results
        write(name, info, {"rows": rows}, f"Train-step throughput ({', '.join(args.backbone)})", mixers + table(rows),
              args.out, lambda path: plot(rows, path))

    args.commit = info["commit"]
    # a row is replaced only by a measurement of the same variant: adding the hand-written route to a finished
    # study keeps its vanilla and routekit rows
    measured = lambda r: (r["backbone"] in args.backbone and r["size"] in args.sizes and r["batch"] in args.batches
                          and r["mode"] in args.modes and r["variant"] in variants_of(r["backbone"], args.variants))
    run(args, device, save, kept_rows(args.out / f"{name}.json", measured) if args.add else [])
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()

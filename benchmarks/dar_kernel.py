"""DAR aggregation at the SiT-XL/2 working point: naive vs torch.compile vs the fused Triton kernel.

DAR mixes S=57 sources (embedding + 56 sublayer outputs of a 28-block SiT-XL/2) of 256 tokens
by 1152 features.  The naive path stacks them and materialises several fp32 copies; the
fused kernel reads each source once.  This script measures what that buys, on one GPU:

    python benchmarks/dar_kernel.py                      # H200: batch 32 and 256, bf16
    python benchmarks/dar_kernel.py --quick --out /tmp/dar  # CPU smoke (Triton interpreter)
    python benchmarks/dar_kernel.py --launch 1,1,1,2,4,1    # the fused kernel at another launch

It checks the fused kernel against the reference first, then times forward and
forward+backward of each variant (backward = the difference), records activation memory,
sweeps the fused kernel's launch configuration around its launch (the default of
routekit.kernels.launch, or --launch in ``parse_launch("aggregate", ...)``'s form), and writes
dar_kernel.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before routekit.kernels.aggregation is imported

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import device_or_exit, free_memory  # noqa: E402
from routekit.errors import ConfigError  # noqa: E402
from routekit.kernels.launch import AggregateLaunch, aggregate_launch, parse_launch  # noqa: E402
from routekit.kernels.naive import aggregate as dar_aggregate_reference  # noqa: E402

VARIANTS = ("naive", "compiled", "fused")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, default=57, help="S: embedding + 2 per block for 28 blocks")
    parser.add_argument("--dim", type=int, default=1152, help="D: SiT-XL hidden size")
    parser.add_argument("--tokens", type=int, default=256, help="N: 256 patches of a 32x32 latent, patch 2")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--graphed", type=int, nargs="*", default=[32], metavar="BATCH",
                        help="batches at which each variant is also timed as CUDA-graph replays (no host work)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the fused kernel's launch-config sweep")
    parser.add_argument("--launch", metavar="ROWS,FWD_SOURCES,FWD_WARPS,BWD_SOURCES,BWD_WARPS,FUSED_REDUCE",
                        help="the fused kernel's launch (default: routekit's for each shape), e.g. 1,1,1,2,4,1")
    parser.add_argument("--quick", action="store_true", help="tiny shapes that run on CPU in seconds")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    try:
        args.launch = None if args.launch is None else parse_launch("aggregate", args.launch)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.quick:
        args.sources, args.dim, args.tokens, args.batches = 5, 40, 8, [2]
    return args


def launch_for(args: argparse.Namespace, batch: int) -> AggregateLaunch:
    """The fused kernel's launch at ``batch``: --launch, else routekit's default for the shape."""
    return args.launch or aggregate_launch(args.dim, batch * args.tokens)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call: triton's do_bench on GPU (L2 flushed), wall clock on CPU."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def device_ms(fn: Callable[[], object], iters: int = 20) -> float | None:
    """GPU kernel time per call (profiler): what the GPU does, without the host's launch work, which
    dominates small batches (issuing a 57-input aggregation through autograd takes the host longer
    than its kernels take at batch 32: benchmarks/dar_host_probe.py)."""
    kernels = device_kernels(fn, iters)
    return None if kernels is None else sum(kernels.values())


def device_kernels(fn: Callable[[], object], iters: int = 20) -> dict[str, float] | None:
    """GPU time per call of each kernel ``fn`` launches, in ms, by kernel name (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        synchronize()
    return {e.key: e.self_device_time_total / 1e3 / iters for e in prof.key_averages() if e.self_device_time_total}


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph, as its replay: the GPU's work without the host's, which is
    how a host-bound step runs under torch.compile's reduce-overhead mode. Warmed up on a side
    stream first, as torch.cuda.make_graphed_callables does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graphed_ms(fn, sources, query, grad) -> dict[str, float]:
    """Forward and forward+backward times of ``fn`` as CUDA-graph replays (backward = the difference)."""
    fwd = time_ms(graphed(lambda: fn(sources, query)))
    free_memory()
    total = time_ms(graphed(lambda: fwd_bwd(fn, sources, query, grad)))
    free_memory()
    return {"graph_fwd_ms": fwd, "graph_fwd_bwd_ms": total, "graph_bwd_ms": total - fwd}


def make_inputs(s: int, b: int, n: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """S separate (B, N, D) sources of varied scale (as a model's sublayers give), a (D,) query
    and an output gradient; all leaves that require grad, as in training."""
    gen = torch.Generator(device).manual_seed(seed)
    scales = torch.exp(torch.randn(s, generator=gen, device=device)).tolist()
    sources = [
        (torch.randn(b, n, d, generator=gen, device=device, dtype=dtype) * k).requires_grad_() for k in scales
    ]
    query = (torch.randn(d, generator=gen, device=device) * 2).requires_grad_()
    grad = torch.randn(b, n, d, generator=gen, device=device, dtype=dtype)
    return sources, query, grad


def fwd_bwd(fn, sources, query, grad):
    return torch.autograd.grad(fn(sources, query), [*sources, query], grad)


def check_correctness(fused, sources, query, grad) -> dict[str, float]:
    """Max abs and relative (to the reference's max magnitude) errors of output and gradients."""
    want_out = dar_aggregate_reference(sources, query)
    want = [want_out, *fwd_bwd(dar_aggregate_reference, sources, query, grad)]
    del want_out
    got_out = fused(sources, query)
    got = [got_out, *fwd_bwd(fused, sources, query, grad)]
    errors = {}
    for name, g, w in (
        ("output", got[0], want[0]),
        ("grad_sources", torch.stack(got[1:-1]), torch.stack(want[1:-1])),
        ("grad_query", got[-1], want[-1]),
    ):
        err = (g.float() - w.float()).abs().max().item()
        errors[f"{name}_max_abs"] = err
        errors[f"{name}_max_rel"] = err / max(w.float().abs().max().item(), 1e-30)
    return errors


def memory(fn, sources, query, grad) -> dict[str, float | None]:
    """GiB: peak and retained (output + saved for backward) over a forward, peak over fwd+bwd."""
    if not torch.cuda.is_available():
        return {"fwd_peak_gib": None, "fwd_retained_gib": None, "fwd_bwd_peak_gib": None}
    gib = 2.0**30
    free_memory()
    synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(sources, query)
    synchronize()
    result = {
        "fwd_peak_gib": (torch.cuda.max_memory_allocated() - base) / gib,
        "fwd_retained_gib": (torch.cuda.memory_allocated() - base) / gib,
    }
    del out
    free_memory()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = fwd_bwd(fn, sources, query, grad)
    synchronize()
    result["fwd_bwd_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / gib
    del grads
    return result


def measure(fn, sources, query, grad, graph: bool = False) -> dict[str, object]:
    """Timing and memory of one variant (with ``graph``, also as CUDA-graph replays); an OOM or a
    failure is recorded, not raised."""
    try:
        for _ in range(2):  # compile (torch.compile, Triton JIT) outside the timed region
            fwd_bwd(fn, sources, query, grad)
        fwd = time_ms(lambda: fn(sources, query))
        total = time_ms(lambda: fwd_bwd(fn, sources, query, grad))
        gpu_fwd = device_ms(lambda: fn(sources, query))
        gpu_total = device_ms(lambda: fwd_bwd(fn, sources, query, grad))
        gpu = {} if gpu_fwd is None else {"gpu_fwd_ms": gpu_fwd, "gpu_fwd_bwd_ms": gpu_total,
                                          "gpu_bwd_ms": gpu_total - gpu_fwd}
        result = {"status": "ok", "fwd_ms": fwd, "fwd_bwd_ms": total, "bwd_ms": total - fwd, **gpu,
                  **memory(fn, sources, query, grad)}  # fmt: skip
        if graph and torch.cuda.is_available():
            result.update(graphed_ms(fn, sources, query, grad))
        return result
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as exc:  # a compile failure must not lose the other variants' numbers
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        free_memory()


def sweep(sources, query, grad, default: AggregateLaunch) -> list[dict[str, object]]:
    """The fused ops timed alone (no autograd around them, so at small batches the host's launch
    work is not mistaken for kernel time) over sources per tile and warps per program, each phase
    with the other at ``default``'s; then ``default`` with the other reduction style. To retune
    routekit.kernels.launch's defaults on this GPU."""
    from dataclasses import replace

    from routekit.kernels import aggregation

    values, q = [s.detach() for s in sources], query.detach()
    _, saved, lse, _ = aggregation.aggregate_op(values, q, 1e-6, values[0].dtype, True, default.as_list())

    def forward(launch):
        return aggregation.aggregate_op(values, q, 1e-6, values[0].dtype, True, launch.as_list())

    def backward(launch):
        return aggregation.aggregate_backward_op(values, q, grad, saved, lse, 1e-6, launch.as_list())

    configs = [("fwd", replace(default, fwd_sources=bs, fwd_warps=w)) for bs in (1, 2, 4) for w in (1, 2, 4, 8)]
    configs += [("bwd", replace(default, bwd_sources=bs, bwd_warps=w)) for bs in (1, 2, 4) for w in (4, 8, 16)]
    configs += [("both", replace(default, fused_reduce=not default.fused_reduce))]
    rows = []
    for phase, launch in configs:
        try:
            row = {}
            if phase in ("fwd", "both"):
                row["fwd_ms"] = time_ms(lambda launch=launch: forward(launch))
            if phase != "fwd":
                row["bwd_ms"] = time_ms(lambda launch=launch: backward(launch))
        except Exception as exc:
            row = {"status": f"{type(exc).__name__}: {str(exc)[:120]}"}
        rows.append({"phase": phase, "launch": launch.generic(), **row})
        print(f"  sweep {rows[-1]}", flush=True)
    return rows


def environment(args: argparse.Namespace) -> dict[str, object]:
    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True)
            return done.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    interpret = os.environ.get("TRITON_INTERPRET")
    command = shlex.join(["python", *sys.argv])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "triton_interpret": interpret,
        "git_commit": os.environ.get("RK_COMMIT") or git("rev-parse", "HEAD"),
        "git_dirty": False if os.environ.get("RK_COMMIT") else bool(
            git("status", "--porcelain", "--", "routekit", "benchmarks/dar_kernel.py")),
        "command": f"TRITON_INTERPRET={interpret} {command}" if interpret else command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "shape": {
            "S": args.sources,
            "N": args.tokens,
            "D": args.dim,
            "batches": args.batches,
            "dtype": args.dtype,
            "query": "(D,) fp32",
        },
    }


def speedup(results: dict, phase: str, against: str, prefix: str = "") -> float | None:
    fused, other = results["fused"], results[against]
    key = f"{prefix}{phase}_ms"
    if key not in fused or key not in other:
        return None
    return other[key] / fused[key]


def run_batch(args: argparse.Namespace, batch: int, device: str) -> dict[str, object]:
    from routekit.kernels.aggregation import aggregate_triton

    launch = launch_for(args, batch)

    def dar_aggregate_triton(sources, query):
        return aggregate_triton(sources, query, launch=launch)

    dtype = DTYPES[args.dtype]
    sources, query, grad = make_inputs(args.sources, batch, args.tokens, args.dim, dtype, device)
    record: dict[str, object] = {"batch": batch, "launch": launch.generic()}
    try:
        record["correctness"] = check_correctness(dar_aggregate_triton, sources, query, grad)
    except torch.OutOfMemoryError:
        record["correctness"] = "OOM in the reference"
    free_memory()
    print(f"batch {batch}: fused vs reference {record['correctness']}", flush=True)

    torch._dynamo.reset()
    compiled = torch.compile(dar_aggregate_reference, dynamic=False)
    fns = {"naive": dar_aggregate_reference, "compiled": compiled, "fused": dar_aggregate_triton}
    results = {}
    for name in VARIANTS:
        results[name] = measure(fns[name], sources, query, grad, graph=batch in args.graphed)
        print(f"batch {batch}: {name} {results[name]}", flush=True)
    record["variants"] = results
    source_bytes = args.sources * batch * args.tokens * args.dim * sources[0].element_size()
    if results["fused"].get("status") == "ok":
        record["fused_source_traffic_gbps"] = {
            "fwd": source_bytes / results["fused"]["fwd_ms"] / 1e6,  # each source read once
            "bwd": 2 * source_bytes / results["fused"]["bwd_ms"] / 1e6,  # read once, gradient written once
        }
    record["speedup"] = {
        f"{prefix}{phase}_vs_{other}": speedup(results, phase, other, prefix)
        for prefix in ("", "gpu_", "graph_")
        for phase in ("fwd", "bwd")
        for other in ("naive", "compiled")
    }
    if not args.no_sweep:
        record["sweep"] = sweep(sources, query, grad, launch)
    return record


def fmt(value: object, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(report: dict) -> str:
    env = report["environment"]
    shape = env["shape"]
    lines = [
        "# DAR aggregation: naive vs torch.compile vs fused Triton",
        "",
        f"S={shape['S']} sources, N={shape['N']} tokens, D={shape['D']}, {shape['dtype']}; "
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"commit `{env['git_commit'][:12]}`{' (dirty)' if env['git_dirty'] else ''}, {env['date']}.",
        "",
        f"Command: `{env['command']}`",
        "",
        "Times are medians in ms (backward = forward+backward − forward); memory in GiB over a",
        "forward with grad-requiring sources (peak / retained for backward) and over forward+backward.",
        "",
        "| batch | variant | fwd ms | bwd ms | fwd+bwd ms | fwd peak | fwd retained | fwd+bwd peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for record in report["batches"]:
        for name, res in record["variants"].items():
            if res.get("status") != "ok":
                lines.append(f"| {record['batch']} | {name} | {res['status']} | | | | | |")
                continue
            cells = [res[k] for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms")]
            cells += [res[k] for k in ("fwd_peak_gib", "fwd_retained_gib", "fwd_bwd_peak_gib")]
            lines.append(f"| {record['batch']} | {name} | " + " | ".join(fmt(c, 3) for c in cells) + " |")
    lines += ["", "| batch | fused speed-up | fwd | bwd | fwd, GPU time | bwd, GPU time | fwd, CUDA graph "
              "| bwd, CUDA graph |", "|---|---|---|---|---|---|---|---|"]
    for record in report["batches"]:
        sp = record["speedup"]
        for other in ("naive", "compiled"):
            cells = [fmt(sp.get(f"{p}{phase}_vs_{other}")) for p in ("", "gpu_", "graph_") for phase in ("fwd", "bwd")]
            cells = [c if c == "—" else f"{c}×" for c in cells]
            lines.append(f"| {record['batch']} | vs {other} | " + " | ".join(cells) + " |")
    timings = (("gpu_", "GPU kernel time per call (profiler, no host work), ms; the speed-ups' GPU-time columns use it:"),
               ("graph_", "Each variant's forward and forward+backward captured in a CUDA graph and timed as replays "
                          "(medians, ms): the host's launch work gone for all three alike; the speed-ups' CUDA-graph "
                          "columns use it:"))
    for prefix, title in timings:
        rows = [(r["batch"], name, res) for r in report["batches"] for name, res in r["variants"].items()
                if f"{prefix}fwd_ms" in res]
        if rows:
            lines += ["", title, "", "| batch | variant | fwd | bwd | fwd+bwd |", "|---|---|---|---|---|"]
            lines += [f"| {b} | {name} | " + " | ".join(f"{res[f'{prefix}{k}_ms']:.3f}" for k in ("fwd", "bwd", "fwd_bwd"))
                      + " |" for b, name, res in rows]
    lines += ["", "Fused kernel vs reference (max abs / max relative to the reference's largest value):", ""]
    for record in report["batches"]:
        corr = record["correctness"]
        if isinstance(corr, str):
            lines.append(f"- batch {record['batch']}: {corr}")
            continue
        parts = [
            f"{k} {corr[f'{k}_max_abs']:.3g} / {corr[f'{k}_max_rel']:.3g}"
            for k in ("output", "grad_sources", "grad_query")
        ]
        lines.append(f"- batch {record['batch']}: " + "; ".join(parts))
        if "fused_source_traffic_gbps" in record:
            bw = record["fused_source_traffic_gbps"]
            lines.append(f"  fused source traffic: fwd {bw['fwd']:.0f} GB/s, bwd {bw['bwd']:.0f} GB/s")
    for record in report["batches"]:
        if "sweep" in record:
            lines += ["", f"Fused launch-config sweep at batch {record['batch']} (its launch marked *):", ""]
            lines += ["The ops timed alone (no autograd). Launch = [rows, fwd sources per tile, fwd warps, bwd "
                      "sources per tile, bwd warps, fused reduce]; a row varies the phase it names (both: the "
                      "launch with the other reduction).", "",
                      "| varied | launch | fwd ms | bwd ms |", "|---|---|---|---|"]
            default = record["launch"]
            for row in record["sweep"]:
                mark = "*" if row["launch"] == default else ""
                fwd, bwd = fmt(row.get("fwd_ms", row.get("status", "")), 3), fmt(row.get("bwd_ms", ""), 3)
                lines.append(f"| {row['phase']} | {row['launch']}{mark} | {fwd} | {bwd} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = report["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    colors = {"naive": "#999999", "compiled": "#4c72b0", "fused": "#dd8452"}
    for ax, record in zip(axes[0], batches):
        for i, phase in enumerate(("fwd", "bwd")):
            for j, name in enumerate(VARIANTS):
                res = record["variants"][name]
                x = i + (j - 1) * 0.27
                if res.get("status") == "ok":
                    value = res[f"{phase}_ms"]
                    ax.bar(x, value, 0.25, color=colors[name], label=name if i == 0 else None)
                    ax.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=7)
                else:
                    ax.bar(x, 0, 0.25, color=colors[name], label=name if i == 0 else None)
                    ax.annotate(res["status"][:5], (x, 0), ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks([0, 1], ["forward", "backward"])
        ax.set_ylabel("ms (median)")
        ax.set_title(f"batch {record['batch']}")
        ax.legend(fontsize=8)
    env, shape = report["environment"], report["environment"]["shape"]
    title = f"DAR aggregation, S={shape['S']} N={shape['N']} D={shape['D']} {shape['dtype']}"
    fig.suptitle(f"{title}, {env['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    device = device_or_exit(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "environment": environment(args),
        "launch_override": None if args.launch is None else args.launch.generic(),
        "batches": [],
    }
    print(json.dumps(report["environment"], indent=1), flush=True)
    for batch in args.batches:
        report["batches"].append(run_batch(args, batch, device))
        # Written after every batch, so a run cut short keeps what it measured.
        (args.out / "dar_kernel.json").write_text(json.dumps(report, indent=1))
        (args.out / "dar_kernel.md").write_text(markdown(report))
        plot(report, args.out / "dar_kernel.png")
    print(markdown(report))
    print(f"wrote {args.out}/dar_kernel.{{json,md,png}}")


if __name__ == "__main__":
    main()

"""DAR's aggregations of one train step, alone: per-sublayer aggregations vs two-phase chunks.

DiT-XL/2 and SiT-XL/2 have 56 sublayers; with chunk=4 a sublayer sees v_0, earlier chunks'
summaries and its own chunk's outputs, 518 source reads per forward in all. Two-phase chunks
read the shared part (v_0 and summaries) once for the chunk's four queries, then merge each
sublayer's own outputs in: "two_phase" computes the shared part's logits inside one fused prefix
kernel per chunk (ROUTEKIT_DAR_SHARED=fused), "streamed" (routekit's default) takes them from one
GEMM per shared source and weights the sources. This times the three schedules on independent random
sublayer outputs (the model's sublayers left out), forward and forward+backward, wall and GPU kernel time:

    python benchmarks/dar_schedule.py                         # H200: batch 256, bf16
    python benchmarks/dar_schedule.py --quick --out /tmp/dar  # CPU smoke (Triton interpreter)

and checks the two-phase schedules agree with the per-sublayer one (outputs and gradients). Writes
dar_schedule.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before routekit.kernels.dar_triton is imported

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import device_or_exit, header, machine, restored_env, write  # noqa: E402
from benchmarks.dar_kernel import device_kernels, device_ms, free_memory, synchronize, time_ms  # noqa: E402
from routekit.dar import sum_sources  # noqa: E402
from routekit.kernels import dar_aggregate, dar_prefix, dar_weighted_sum, source_logits  # noqa: E402

SCHEDULES = ("per_sublayer", "two_phase", "streamed")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sublayers", type=int, default=56, help="2 per block for 28 blocks")
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1152)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--kernel", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--sweep", action="store_true",
                        help="also time the two-phase schedule over prefix launch settings (ROUTEKIT_DAR_PREFIX)")
    parser.add_argument("--merge-sweep", action="store_true",
                        help="also time the streamed schedule over the merges' launch settings (ROUTEKIT_DAR_LAUNCH)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes that run on CPU in seconds")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results")
    args = parser.parse_args()
    if args.quick:
        args.sublayers, args.dim, args.tokens, args.batch = 9, 24, 4, 2
    return args


def dar_step(v0, outputs, query, chunk: int, schedule: str, kernel: str) -> list[torch.Tensor]:
    """The aggregations of one forward, as routekit's graph makes them (routekit/dar.py)."""
    closed, current, mixes = [v0], [], []
    logits = {}  # a shared source's place in ``closed`` -> (its logits for the points from ``first`` on, first)

    def shared_part(point: int, size: int):
        if schedule == "two_phase":
            return dar_prefix(closed, query[point:point + size], kernel=kernel)
        for i, v in enumerate(closed):  # each source's logits once, for every point that will read it
            logits.setdefault(i, (source_logits(v, query[point:]), point))
        z = torch.stack([logits[i][0][..., point - logits[i][1]:point - logits[i][1] + size] for i in range(len(closed))])
        return dar_weighted_sum(closed, z, kernel)

    two_phase = schedule != "per_sublayer"
    for point, v in enumerate(outputs):
        if two_phase and point % chunk == 0:
            size = min(chunk, len(outputs) - point)
            shared = shared_part(point, size) if size >= 2 else None
            first = point
        current.append(v)
        if len(current) == chunk:
            closed.append(sum_sources(current))
            current = []
        if two_phase and shared is not None:
            own = closed[-1:] if not current else current
            prefix = (shared[0][point - first], shared[1][point - first])
            mixes.append(dar_aggregate(own, query[point], kernel=kernel, prefix=prefix))
        else:
            mixes.append(dar_aggregate(closed + current, query[point], kernel=kernel))
    return mixes


def make_inputs(args, device: str, dtype: torch.dtype):
    gen = torch.Generator(device).manual_seed(0)
    shape = (args.batch, args.tokens, args.dim)
    leaves = [torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()
              for _ in range(args.sublayers + 1)]
    query = (torch.randn(args.sublayers, args.dim, generator=gen, device=device)).requires_grad_()
    grads = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(args.sublayers)]
    return leaves, query, grads


def measure(args, schedule: str, leaves, query, grads) -> dict:
    def forward():
        return dar_step(leaves[0], leaves[1:], query, args.chunk, schedule, args.kernel)

    def forward_backward():
        return torch.autograd.grad(forward(), [*leaves, query], grads)

    forward_backward()  # compile the kernels outside the timed region
    result = {"fwd_ms": time_ms(forward), "fwd_bwd_ms": time_ms(forward_backward)}
    result["bwd_ms"] = result["fwd_bwd_ms"] - result["fwd_ms"]
    gpu_fwd, kernels = device_ms(forward, iters=5), device_kernels(forward_backward, iters=5)
    if gpu_fwd is not None:
        gpu_total = sum(kernels.values())
        result.update(gpu_fwd_ms=gpu_fwd, gpu_fwd_bwd_ms=gpu_total, gpu_bwd_ms=gpu_total - gpu_fwd)
        result["kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:8])
    if torch.cuda.is_available():
        free_memory()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads_out = forward_backward()
        synchronize()
        result["fwd_bwd_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        del grads_out
    free_memory()
    return result


# [queries per op, fwd warps, bwd warps, fused reduce, reload query, rows split into head and tail] for the
# fused prefix (ROUTEKIT_DAR_PREFIX, schedule two_phase)
SWEEP = [(4, 1, 4, 1, 0, 0), (4, 1, 4, 1, 0, 1)]
# [rows, fwd sources per tile, fwd warps, bwd sources per tile, bwd warps, fused reduce] for the merges
# (ROUTEKIT_DAR_LAUNCH, schedule streamed): a merge reads 1-4 own sources, the default takes 2 per tile
MERGE_SWEEP = [(1, 1, 1, 2, 4, 1), (1, 1, 1, 1, 4, 1), (1, 1, 1, 4, 4, 1), (1, 1, 1, 2, 8, 1), (1, 2, 1, 2, 4, 1)]


def sweep(args, leaves, query, grads, variable: str = "ROUTEKIT_DAR_PREFIX", settings=SWEEP,
          schedule: str = "two_phase") -> list[dict]:
    """GPU kernel time of ``schedule`` per launch setting given through the environment ``variable``
    (the fused prefix's ``PrefixLaunch``, or the merges' ``Launch``); a setting that fails to compile is
    reported, not fatal."""
    rows = []

    def forward():
        return dar_step(leaves[0], leaves[1:], query, args.chunk, schedule, args.kernel)

    with restored_env(variable):
        for setting in settings:
            os.environ[variable] = ",".join(map(str, setting))
            try:
                torch.autograd.grad(forward(), [*leaves, query], grads)  # compile
                fwd = device_ms(forward, iters=3)
                total = device_ms(lambda: torch.autograd.grad(forward(), [*leaves, query], grads), iters=3)
                row = {"launch": list(setting), "gpu_fwd_ms": fwd, "gpu_bwd_ms": total - fwd, "gpu_fwd_bwd_ms": total}
            except Exception as exc:  # a launch that does not compile must not lose the others
                row = {"launch": list(setting), "status": f"{type(exc).__name__}: {str(exc)[:120]}"}
            rows.append(row)
            print("sweep", variable, row, flush=True)
    return rows


def agreement(args, leaves, query, grads) -> dict:
    """Per two-phase schedule: its largest difference from the per-sublayer schedule, relative to the
    per-sublayer values' largest."""
    got = {}
    for schedule in SCHEDULES:
        outs = dar_step(leaves[0], leaves[1:], query, args.chunk, schedule, args.kernel)
        got[schedule] = [torch.stack(outs).detach(), *torch.autograd.grad(outs, [*leaves, query], grads)]
    names = ["outputs", *[f"grad v{i}" for i in range(len(leaves))], "grad query"]
    result = {}
    for schedule in SCHEDULES[1:]:
        errors = {name: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                  for name, a, b in zip(names, got[schedule], got["per_sublayer"])}
        worst = max((k for k in errors if k.startswith("grad v")), key=errors.get)
        result[schedule] = {"outputs": errors["outputs"], "grad query": errors["grad query"],
                            "worst source grad": worst, "worst source grad error": errors[worst]}
    return result


def reads(args) -> dict:
    """Sources each schedule reads per forward (in units of one source)."""
    closed, current, per, two = 1, 0, 0, 0
    for point in range(args.sublayers):
        chunked = min(args.chunk, args.sublayers - point + point % args.chunk) >= 2
        if chunked and point % args.chunk == 0:
            two += closed  # the shared part, once for the chunk
        current += 1
        if current == args.chunk:
            closed, current = closed + 1, 0
        per += closed + current
        two += (current or 1) if chunked else closed + current
    return {"per_sublayer": per, "two_phase": two}


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [
        "# DAR aggregations of one train step: per sublayer vs two-phase chunks (fused prefix, streamed)", "",
        header(report["machine"]),
        f"{a['sublayers']} sublayers, chunk {a['chunk']}, batch {a['batch']}, {a['tokens']} tokens, D={a['dim']}, "
        "bf16 sources and mixes (as routekit makes them); independent random sublayer outputs. "
        f"Source reads per forward: {report['reads']['per_sublayer']} per sublayer, "
        f"{report['reads']['two_phase']} two-phase (plus the partial mixes, one write and one read each; "
        "streamed: plus one read per shared source for its logits).", "",
        "| schedule | fwd ms | bwd ms | fwd+bwd ms | GPU fwd | GPU bwd | GPU fwd+bwd | fwd+bwd peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["schedules"].items():
        cells = [r.get(k) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "gpu_fwd_ms", "gpu_bwd_ms", "gpu_fwd_bwd_ms",
                                    "fwd_bwd_peak_gib")]
        lines.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:.2f}" for c in cells) + " |")
    for name, r in report["schedules"].items():
        if r.get("kernels_ms"):
            lines += ["", f"{name}, GPU ms per forward+backward by kernel: "
                      + "; ".join(f"`{k[:40]}` {v:.2f}" for k, v in r["kernels_ms"].items())]
    per = report["schedules"]["per_sublayer"]
    key = "gpu_fwd_bwd_ms" if "gpu_fwd_bwd_ms" in per else "fwd_bwd_ms"
    lines.append("")
    for schedule, errors in report["agreement"].items():
        lines += [f"{schedule}: {per[key] / report['schedules'][schedule][key]:.2f}× faster forward+backward "
                  f"({key}) than per sublayer; largest difference from it relative to the largest value: "
                  + "; ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in errors.items()), ""]
    for key, title, fields in (("sweep", "Two-phase schedule per prefix launch", "queries per op, fwd warps, bwd "
                                "warps, fused reduce, reload query, split rows"),
                               ("merge_sweep", "Streamed schedule per merge launch", "rows, fwd sources per tile, "
                                "fwd warps, bwd sources per tile, bwd warps, fused reduce")):
        if not report.get(key):
            continue
        lines += [f"{title} [{fields}], GPU kernel time in ms (best marked *):", "", "| launch | fwd | bwd | fwd+bwd |",
                  "|---|---:|---:|---:|"]
        ok = [r for r in report[key] if "gpu_fwd_bwd_ms" in r]
        best = min(ok, key=lambda r: r["gpu_fwd_bwd_ms"]) if ok else None
        for r in report[key]:
            launch = r.get("launch", r.get("prefix"))  # "prefix" in reports before the merge sweep
            if "gpu_fwd_bwd_ms" not in r:
                lines.append(f"| {launch} | {r['status']} | | |")
                continue
            mark = "*" if r is best else ""
            lines.append(f"| {launch}{mark} | {r['gpu_fwd_ms']:.2f} | {r['gpu_bwd_ms']:.2f} | {r['gpu_fwd_bwd_ms']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, name in enumerate(SCHEDULES):
        r = report["schedules"][name]
        prefix = "gpu_" if "gpu_fwd_ms" in r else ""
        fwd, bwd = r[f"{prefix}fwd_ms"], r[f"{prefix}bwd_ms"]
        ax.barh(i, fwd, color="#4c72b0", label="forward" if i == 0 else None)
        ax.barh(i, bwd, left=fwd, color="#dd8452", label="backward" if i == 0 else None)
        ax.annotate(f"{fwd + bwd:.1f} ms", (fwd + bwd, i), va="center", fontsize=8)
    ax.set_yticks(range(len(SCHEDULES)), SCHEDULES)
    ax.set_xlabel("ms per train step (GPU kernel time)" if torch.cuda.is_available() else "ms per train step")
    ax.legend(fontsize=8)
    a = report["args"]
    ax.set_title(f"DAR, {a['sublayers']} sublayers, chunk {a['chunk']}, batch {a['batch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    device = device_or_exit(args.quick)
    leaves, query, grads = make_inputs(args, device, torch.bfloat16)
    report = {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "reads": reads(args), "agreement": agreement(args, leaves, query, grads), "schedules": {}}
    print(report["agreement"], flush=True)
    for schedule in SCHEDULES:
        report["schedules"][schedule] = measure(args, schedule, leaves, query, grads)
        print(schedule, report["schedules"][schedule], flush=True)
    if args.sweep and torch.cuda.is_available():
        report["sweep"] = sweep(args, leaves, query, grads)
        ok = [r for r in report["sweep"] if "gpu_fwd_bwd_ms" in r]
        if ok:
            print("best prefix launch", ",".join(map(str, min(ok, key=lambda r: r["gpu_fwd_bwd_ms"])["launch"])))
    if args.merge_sweep and torch.cuda.is_available():
        report["merge_sweep"] = sweep(args, leaves, query, grads, "ROUTEKIT_DAR_LAUNCH", MERGE_SWEEP, "streamed")
    out = write("dar_schedule", report, markdown(report), args.out)
    plot(report, out / "dar_schedule.png")
    print(markdown(report))


if __name__ == "__main__":
    main()

"""The first (compiling) train step of torch.compile'd variants, each in a process of its own, in turns.

A process that compiled once is no longer a fresh one: the first compilation in it also starts what later ones
find running (CUDA's and Triton's toolchains, Inductor's compile workers, imports), so in one process the variant
measured first looked slower to compile, whichever it was. Here every first step runs in a new process with
empty Inductor and Triton caches, as a user's first run meets it, and the variants take turns (round r starts at
variant r), so a machine that drifts during the call slows every variant alike. The report gives each variant's
median and range over the rounds, torch.compile's phases (median), Dynamo's graphs and Inductor's kernel count.

    python benchmarks/first_step.py --sizes B/2 --batches 256 --variants routekit manual --rounds 2
    python benchmarks/first_step.py --sizes XL/2 --batches 256 --variants vanilla routekit manual dar_static_c4

Writes benchmarks/results/<name>.{json,md,png} (--name, default first_step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, device_or_exit, figure, machine, write  # noqa: E402

VARIANTS = ("vanilla", "routekit", "manual", "sprint", "dar_static_c4", "dar_dynamic_c4", "dar_tread")


def one(backbone: str, size: str, batch: int, variant: str, quick: bool) -> dict:
    """Build `variant` and take its first compiled step in this process: its seconds, phases, graphs and the
    kernels Inductor generated for it."""
    import torch
    from torch._inductor import metrics

    from benchmarks import throughput

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = throughput.build(backbone, size, variant, device, quick)
    metrics.reset()
    _, stats = throughput.prepare(model, backbone, batch, "compile", device)
    return {**stats, "kernels": metrics.generated_kernel_count}


def fresh(args, variant: str, batch: int, size: str, code: Path | None = None) -> dict:
    """`one` in a new Python process with caches of its own, its result read from the file it writes; with
    `code`, the code Inductor generates written to that file (its log slows the compilation: not timed)."""
    with tempfile.TemporaryDirectory(prefix="routekit-first-") as root:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor", "TRITON_CACHE_DIR": f"{root}/triton"}
        if code is not None:
            env["TORCH_LOGS"] = "output_code"
        out = Path(root) / "result.json"
        program = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
                "from benchmarks.first_step import one; "
                f"json.dump(one({args.backbone!r}, {size!r}, {batch}, {variant!r}, {args.quick}), "
                f"open({str(out)!r}, 'w'), default=float)")
        with open(code or os.devnull, "w") as log:
            done = subprocess.run([sys.executable, "-c", program], env=env, stderr=log if code else None)
        if done.returncode != 0:
            return {"status": f"failed (exit {done.returncode})"}
        return json.loads(out.read_text())


def summary(samples: list[dict]) -> dict:
    """Median and range of the rounds' first steps, each phase's median, and the graphs and kernels."""
    ok = [s for s in samples if "first_step_s" in s]
    if not ok:
        return {"status": samples[-1].get("status", "failed")}
    firsts = [s["first_step_s"] for s in ok]
    phases = {k: statistics.median(s["first_step_phases_s"][k] for s in ok) for k in ok[0]["first_step_phases_s"]}
    return {"first_step_s": statistics.median(firsts), "min_s": min(firsts), "max_s": max(firsts),
            "rounds": len(ok), "firsts_s": firsts, "phases_s": phases, "graphs": ok[0].get("graphs"),
            "graph_breaks": ok[0].get("graph_breaks"), "kernels": ok[0].get("kernels")}


def table(rows: list[dict]) -> str:
    out = ["| size | batch | variant | first step s (median) | range s | × hand-written | × vanilla | rounds "
           "| graphs | graph breaks | Inductor kernels |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["size"], r["batch"]), {})[r["variant"]] = r
    for (size, batch), g in groups.items():
        for variant, r in g.items():
            if "first_step_s" not in r:
                out.append(f"| {size} | {batch} | {variant} | {r['status']} | | | | | | | |")
                continue
            ratio = {base: f"{r['first_step_s'] / g[base]['first_step_s']:.2f}" if "first_step_s" in g.get(base, {})
                     else "" for base in ("manual", "vanilla")}
            out.append(f"| {size} | {batch} | {variant} | {r['first_step_s']:.1f} | {r['min_s']:.1f}–{r['max_s']:.1f} "
                       f"| {ratio['manual']} | {ratio['vanilla']} | {r['rounds']} | {r['graphs']} "
                       f"| {r['graph_breaks']} | {r['kernels']} |")
    out += ["", "Phases of the first step, seconds, median over the rounds (torch.compile's timers; the kernel compile "
            "wait is inside the Inductor phases):", ""]
    out += [f"- {r['size']} b{r['batch']} {r['variant']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items())
            for r in rows if "phases_s" in r]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    done = [r for r in rows if "first_step_s" in r]
    with figure(path, figsize=(max(5, 1.2 * len(done)), 3.6)) as (_, ax):
        labels = [f"{r['size']} b{r['batch']}\n{r['variant']}" for r in done]
        ax.bar(range(len(done)), [r["first_step_s"] for r in done], color="tab:blue")
        ax.errorbar(range(len(done)), [r["first_step_s"] for r in done], fmt="none", ecolor="black", capsize=3,
                    yerr=[[r["first_step_s"] - r["min_s"] for r in done], [r["max_s"] - r["first_step_s"] for r in done]])
        ax.set_xticks(range(len(done)), labels, fontsize=8)
        ax.set_ylabel("first compiled step, s (median, range)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="dit", choices=["dit", "rwkv", "mamba"])
    p.add_argument("--sizes", nargs="+", default=["B/2"])
    p.add_argument("--batches", nargs="+", type=int, default=[256])
    p.add_argument("--variants", nargs="+", default=["routekit", "manual"], choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=2, help="first steps per variant, each in a fresh process")
    p.add_argument("--name", default="first_step")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--code", type=Path, default=None, help="after the timed rounds, compile each variant once more "
                   "with TORCH_LOGS=output_code and write what Inductor generated to CODE/<size>_b<batch>_<variant>.log, "
                   "to compare the variants' kernels")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny models, batch 2, one round")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds is how many first steps each variant takes, at least 1; got {args.rounds}")
    if args.quick:
        args.sizes, args.batches, args.rounds = ["S/2"], [2], 1
    device_or_exit(args.quick)
    info, rows = machine(), []
    for size in args.sizes:
        for batch in args.batches:
            samples: dict[str, list[dict]] = {v: [] for v in args.variants}
            for r in range(args.rounds):
                for variant in args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]:
                    samples[variant].append(got := fresh(args, variant, batch, size))
                    print(f"{size} b{batch} {variant}: round {r}, first step "
                          f"{got.get('first_step_s', float('nan')):.1f} s", flush=True)
            for variant in args.variants if args.code else ():
                args.code.mkdir(parents=True, exist_ok=True)
                fresh(args, variant, batch, size, args.code / f"{size.replace('/', '')}_b{batch}_{variant}.log")
            rows += [{"backbone": args.backbone, "size": size, "batch": batch, "variant": v, **summary(s)}
                     for v, s in samples.items()]
            write(args.name, info, {"rows": rows}, "First compiled train step, each in a fresh process", table(rows),
                  args.out, lambda path, rows=rows: plot(rows, path))
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()

"""Convergence per wall-clock second, seeded: vanilla vs TREAD vs DAR vs DAR+TREAD DiT on MNIST-5k.

Each run trains a shipped recipe (one method, one seed) for the same budget of training seconds
(evaluation, sampling and the first step, which holds torch.compile's compilation, are not counted) and
is scored on its EMA weights every ``--eval-every-s`` training seconds: Fréchet distance in the features of
a small MNIST classifier (lower is better) and that classifier's accuracy on class-conditional samples.
Each run writes its own result.json in its run folder; the report merges every run made under the same
settings: per method the mean and spread across seeds of the final FD and of the training seconds to
reach vanilla's final FD (the mean over vanilla's seeds), and curves with a band across seeds.

    python -m benchmarks.convergence --parallel 8 --budget-s 420     # 8 GPUs: 4 methods x 2 seeds at once,
                                                                     # one run per GPU, then the report
    python -m benchmarks.convergence --parallel 2 --methods vanilla,tread --seeds 0   # a subset; results merge
    python -m benchmarks.convergence --report                         # merge the runs made so far
    python -m benchmarks.convergence --quick --parallel 2             # CPU smoke run in seconds (tiny model)

``--parallel N`` starts one process per run with CUDA_VISIBLE_DEVICES set to one of N GPUs, at most N at a
time. Writes benchmarks/results/convergence.{json,md,png} (``--quick``: runs/convergence_quick/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, RESULTS, TINY, figure, machine, write  # noqa: E402
from recipes.config import TrainConfig, load_config, with_overrides  # noqa: E402

METHODS = ["vanilla", "tread", "dar", "dar_tread"]
QUICK = {  # a model and schedule that finish in seconds on a laptop CPU
    "model.overrides": {**TINY["dit"], "class_dropout": 0.1},
    "data.name": "synthetic", "batch": 16, "eval.samples": 50, "sampler.steps": 4, "ema.decay": 0.9,
    "optimiser.lr": 1e-3, "optimiser.warmup_steps": 0, "bf16": False, "compile": False, "log_every": 5,
}

# A small DiT on real MNIST-5k that a 2-core CPU trains ~1000 steps in a few minutes (no GPU at hand).
CPU = {
    "model.overrides": {"depth": 8, "hidden": 128, "heads": 4, "patch": 4, "class_dropout": 0.1},
    "batch": 64, "eval.samples": 200, "sampler.steps": 8, "ema.decay": 0.995, "optimiser.lr": 5e-4,
    "optimiser.warmup_steps": 50, "bf16": False, "compile": False, "log_every": 20,
}
SETTINGS = ("size", "budget_s", "eval_every_s", "quick", "cpu_preset", "compile")


def method_config(method: str, seed: int, settings: dict) -> TrainConfig:
    """The shipped recipe for method with this seed, every periodic side job off (the benchmark schedules evals)."""
    size = settings["size"].replace("/", "").lower()
    config = load_config(REPO / "recipes" / "configs" / f"dit_{size}_{method}.yaml")
    overrides: dict[str, Any] = {"steps": 10_000_000, "eval.every": 0, "sample.every": 0, "checkpoint.every": 0,
                                 "checkpoint.final": False, "seed": seed,
                                 **(QUICK if settings["quick"] else CPU if settings["cpu_preset"] else {})}
    if settings["compile"] is not None:
        overrides["compile"] = settings["compile"]
    return with_overrides(config, overrides)


def run_folder(runs: Path, method: str, seed: int) -> Path:
    return runs / f"{method}_seed{seed}"


def run_one(method: str, seed: int, settings: dict, runs: Path) -> dict:
    """Train one method and seed for the budget; writes and returns its result (or why it was skipped)."""
    import shutil

    import routekit as rk
    from recipes.train import train

    folder = run_folder(runs, method, seed)
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run folder each time
    info = machine()
    result: dict[str, Any] = {"method": method, "seed": seed, "settings": settings,
                              "run": {key: info[key] for key in ("commit", "command", "device", "date")}}
    config = method_config(method, seed, settings)
    try:
        stats = train(config, folder, budget_s=settings["budget_s"], eval_every_s=settings["eval_every_s"])
    except rk.ConfigError as error:  # e.g. a routekit without DAR: report it, run the others
        print(f"[{method} seed {seed}] skipped: {error}", file=sys.stderr)
        result["skipped"] = str(error)
    else:
        seconds = stats["train_seconds"]
        result.update(steps=stats["step"], train_seconds=seconds, first_step_seconds=stats["first_step_seconds"],
                      steps_per_s=(stats["step"] - 1) / seconds, parameters=stats["parameters"],
                      evals=stats["evals"], config=config.model_dump(mode="json"))
    finally:
        gc.collect()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(result, indent=1))
    return result


def launch_parallel(runs_wanted: list[tuple[str, int]], slots: int, args: argparse.Namespace, runs: Path) -> None:
    """One process per run, each on its own GPU (CUDA_VISIBLE_DEVICES), at most `slots` at a time."""
    free, running = list(range(slots)), []
    pending = list(runs_wanted)
    while pending or running:
        while pending and free:
            method, seed = pending.pop(0)
            slot = free.pop(0)
            folder = run_folder(runs, method, seed)
            folder.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "benchmarks.convergence", "--runs-only", "--methods", method,
                       "--seeds", str(seed), *forwarded(args)]
            log = open(runs / f"{method}_seed{seed}.log", "w")  # noqa: SIM115 - closed when the process ends
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(slot) if torch.cuda.is_available() else ""}
            print(f"[slot {slot}] {method} seed {seed}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
            running.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                            slot, log, method, seed))
        time.sleep(0.2)
        for item in [r for r in running if r[0].poll() is not None]:
            process, slot, log, method, seed = item
            log.close()
            running.remove(item)
            free.append(slot)
            if process.returncode:
                print(f"[slot {slot}] {method} seed {seed} failed ({process.returncode}); its log: "
                      f"{runs / f'{method}_seed{seed}.log'}", file=sys.stderr)


def forwarded(args: argparse.Namespace) -> list[str]:
    """The settings flags a child run needs to reproduce this command's settings."""
    flags = ["--size", args.size, "--budget-s", str(args.budget_s), "--eval-every-s", str(args.eval_every_s),
             "--runs", str(args.runs)]
    if args.compile is not None:
        flags.append("--compile" if args.compile else "--no-compile")
    return flags + [f for f, on in (("--quick", args.quick), ("--cpu-preset", args.cpu_preset)) if on]


def collect(runs: Path, settings: dict) -> list[dict]:
    """Every run result in `runs` made under `settings`, in METHODS then seed order."""
    found = []
    for path in runs.glob("*/result.json"):
        result = json.loads(path.read_text())
        if all(result["settings"].get(k) == settings[k] for k in SETTINGS):
            found.append(result)
    return sorted(found, key=lambda r: (METHODS.index(r["method"]), r["seed"]))


def time_to_reach(result: dict, target: float) -> dict | None:
    """The first evaluation at or below target FD."""
    return next((e for e in result.get("evals", []) if e["fd"] <= target), None)


def spread(values: list[float]) -> dict | None:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)} \
        if values else None


def summarise(results: list[dict]) -> dict:
    """Per method: seeds, throughput, final FD/accuracy and the seconds to reach vanilla's final FD, across seeds."""
    done = [r for r in results if r.get("evals")]
    vanilla = [r["evals"][-1]["fd"] for r in done if r["method"] == "vanilla"]
    target = statistics.fmean(vanilla) if vanilla else None
    methods = {}
    for method in METHODS:
        runs = [r for r in done if r["method"] == method]
        if not runs:
            continue
        hits = [time_to_reach(r, target) if target is not None else None for r in runs]
        methods[method] = {
            "seeds": [r["seed"] for r in runs], "steps": spread([r["steps"] for r in runs]),
            "steps_per_s": spread([r["steps_per_s"] for r in runs]),
            "first_step_seconds": spread([r["first_step_seconds"] for r in runs]),
            "final_fd": spread([r["evals"][-1]["fd"] for r in runs]),
            "final_accuracy": spread([r["evals"][-1]["accuracy"] for r in runs]),
            "seconds_to_target": spread([h["train_seconds"] for h in hits if h]),
            "reached": sum(h is not None for h in hits)}
    return {"target_fd": target, "methods": methods,
            "skipped": {f"{r['method']} seed {r['seed']}": r["skipped"] for r in results if "skipped" in r}}


def subject(settings: dict) -> str:
    if settings["quick"]:
        return "a tiny DiT on synthetic data (--quick)"
    if settings["cpu_preset"]:
        return "a small DiT (depth 8, width 128, patch 4: 64 tokens) on MNIST-5k, 2-core CPU (--cpu-preset)"
    return f"DiT-{settings['size']} on MNIST-5k"


def _fmt(s: dict | None, form: str = ".3f") -> str:
    if s is None:
        return "-"
    return f"{s['mean']:{form}}" if s["n"] == 1 else f"{s['mean']:{form}} ({s['min']:{form}}–{s['max']:{form}})"


def markdown(report: dict) -> str:
    summary, settings = report["summary"], report["settings"]
    target = summary["target_fd"]
    lines = [
        f"- feature classifier test accuracy: {report.get('classifier_test_accuracy', float('nan')):.3f}",
        "- training seconds exclude evaluation and the first step (compilation); FD: Fréchet distance in the "
        "classifier's 128-d features to the held-out test split (lower is better); accuracy: the classifier "
        "agrees with the sampled class; EMA weights, guidance and ODE steps as in each recipe.",
        f"- every run: {settings['budget_s']:g} training seconds, an evaluation every {settings['eval_every_s']:g} s; "
        "values are the mean across seeds with (min–max) when there are several.",
        "",
        "| method | seeds | steps | steps/s | first step (s) | final FD | final accuracy "
        "| seconds to vanilla's final FD | reached | speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = summary["methods"].get("vanilla", {}).get("seconds_to_target")
    for method, m in summary["methods"].items():
        hit = m["seconds_to_target"]
        speedup = f"{base['mean'] / hit['mean']:.2f}x" if hit and base and hit["mean"] else "-"
        lines.append(f"| {method} | {', '.join(map(str, m['seeds']))} | {_fmt(m['steps'], '.0f')} | "
                     f"{_fmt(m['steps_per_s'], '.2f')} | {_fmt(m['first_step_seconds'], '.1f')} | "
                     f"{_fmt(m['final_fd'])} | {_fmt(m['final_accuracy'])} | {_fmt(hit, '.0f')} | "
                     f"{m['reached']}/{len(m['seeds'])} | {speedup} |")
    for run, why in summary["skipped"].items():
        lines.append(f"| {run} | skipped: {why.splitlines()[0]} |" + " |" * 8)
    if target is not None:
        lines += ["", f"Vanilla's final FD (mean over its seeds) is {target:.3f}; a run reaches it at its first "
                      "evaluation at or below it; the speed-up is vanilla's mean time to reach it divided by the "
                      "method's (over the seeds that reached it)."]
    lines += ["", "Each run:", ""]
    lines += [f"- {r['method']} seed {r['seed']}: `{r['run']['command']}` at `{r['run']['commit']}` on "
              f"{r['run']['device']}" for r in report["runs"]]
    return "\n".join(lines) + "\n"


def _band(runs: list[dict], x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each run's curve interpolated on a common x grid (where all runs have evaluations): x, mean, min, max."""
    curves = [([e[x_key] for e in r["evals"]], [e[y_key] for e in r["evals"]]) for r in runs]
    lo, hi = max(xs[0] for xs, _ in curves), min(xs[-1] for xs, _ in curves)
    grid = np.linspace(lo, hi, 50) if hi > lo else np.array([lo])
    ys = np.array([np.interp(grid, xs, vals) for xs, vals in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def plot(report: dict, path: Path) -> None:
    with figure(path, 2, 2, figsize=(11, 8), sharey="row") as (fig, axes):
        for method in METHODS:
            runs = [r for r in report["runs"] if r["method"] == method and r.get("evals")]
            if not runs:
                continue
            for col, x_key in enumerate(("train_seconds", "step")):
                for row, y_key in enumerate(("fd", "accuracy")):
                    grid, mean, low, high = _band(runs, x_key, y_key)
                    line = axes[row, col].plot(grid, mean, marker="o" if len(grid) == 1 else None,
                                               label=f"{method} ({len(runs)} seeds)")[0]
                    axes[row, col].fill_between(grid, low, high, color=line.get_color(), alpha=0.2)
        for col, label in enumerate(("training seconds", "steps")):
            axes[1, col].set_xlabel(label)
        axes[0, 0].set_ylabel("FD (classifier features), log")
        axes[0, 0].set_yscale("log")
        axes[1, 0].set_ylabel("classifier accuracy on samples")
        axes[0, 0].legend()
        fig.suptitle(f"{subject(report['settings'])}: EMA sample quality, mean and range across seeds")


def report(settings: dict, runs: Path, out: Path, classifier_accuracy: float | None) -> None:
    results = collect(runs, settings)
    if not results:
        raise SystemExit(f"no run results under {runs} made with these settings ({settings})")
    data = {"settings": settings, "classifier_test_accuracy": classifier_accuracy, "runs": results,
            "summary": summarise(results)}
    title = f"Convergence: {subject(settings)}, {settings['budget_s']:g} s of training per run"
    write("convergence", machine(), data, title, markdown(data), out, lambda path: plot(data, path))
    print((out / "convergence.md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="B/2", choices=["S/2", "B/2"])
    parser.add_argument("--budget-s", type=float, default=420.0, help="training seconds per run")
    parser.add_argument("--eval-every-s", type=float, help="training seconds between evaluations (budget / 10)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--parallel", type=int, metavar="N",
                        help="one process per run on its own GPU, N at a time (default: the runs one after another)")
    parser.add_argument("--report", action="store_true", help="only merge the runs made so far into the report")
    parser.add_argument("--runs-only", action="store_true", help=argparse.SUPPRESS)  # a child of --parallel
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="override the recipes' compile flag")
    parser.add_argument("--quick", action="store_true", help="tiny model on synthetic data, seconds on CPU")
    parser.add_argument("--cpu-preset", action="store_true",
                        help="a small DiT (depth 8, width 128, patch 4: 64 tokens) on MNIST-5k for a CPU-only comparison")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    parser.add_argument("--runs", type=Path, help="run folders (default runs/convergence, --quick: runs/convergence_quick)")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; valid: {', '.join(METHODS)}")
    if args.quick and args.budget_s == parser.get_default("budget_s"):
        args.budget_s = 2.0
    args.eval_every_s = args.eval_every_s or args.budget_s / 10
    out = args.out or (REPO / "runs" / "convergence_quick" if args.quick else RESULTS)
    runs = args.runs = args.runs or REPO / "runs" / ("convergence_quick" if args.quick else "convergence")
    settings = {"size": args.size, "budget_s": args.budget_s, "eval_every_s": args.eval_every_s,
                "quick": args.quick, "cpu_preset": args.cpu_preset, "compile": args.compile}
    wanted = [(m, s) for m in methods for s in args.seeds]
    if args.runs_only:
        for method, seed in wanted:
            run_one(method, seed, settings, runs)
        return
    from recipes.data import load_dataset
    from recipes.metrics import load_classifier

    first = method_config(methods[0], args.seeds[0], settings)
    dataset = load_dataset(first.data.name, first.data.limit, first.data.cache_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, accuracy = load_classifier(dataset, device, first.data.cache_dir)  # trained and cached once, before any run
    if not args.report:
        if args.parallel:
            launch_parallel(wanted, args.parallel, args, runs)
        else:
            for method, seed in wanted:
                print(f"[{method} seed {seed}] {args.budget_s:g} s of training, evaluations every "
                      f"{args.eval_every_s:g} s", file=sys.stderr)
                run_one(method, seed, settings, runs)
    report(settings, runs, out, accuracy)


if __name__ == "__main__":
    main()

"""Convergence per wall-clock second: vanilla vs TREAD vs DAR vs DAR+TREAD DiT on MNIST-5k.

Each method trains from the shipped recipe for the same budget of training seconds (evaluation,
sampling and the first step, which holds torch.compile's compilation, are not counted) and is scored
on its EMA weights every ``--eval-every-s`` training seconds: Fréchet distance in the features of a
small MNIST classifier (lower is better) and that classifier's accuracy on class-conditional samples.

    python -m benchmarks.convergence                      # GPU: four methods x 240 s, DiT-S/2
    python -m benchmarks.convergence --methods vanilla    # one method per command; results merge
    python -m benchmarks.convergence --quick              # CPU smoke run in seconds (tiny model)
    python -m benchmarks.convergence --methods vanilla,dar --budget-s 230 --eval-every-s 23 --no-compile

Writes benchmarks/results/convergence.{json,md,png} (``--quick``: runs/convergence_quick/).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, RESULTS, TINY, figure, machine, write  # noqa: E402
from recipes.config import TrainConfig, load_config, with_overrides  # noqa: E402
from recipes.data import load_dataset  # noqa: E402
from recipes.metrics import load_classifier  # noqa: E402
from recipes.train import train  # noqa: E402

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


def method_config(method: str, size: str, quick: bool, compile_: bool | None, cpu: bool = False) -> TrainConfig:
    """The shipped recipe for method, with every periodic side job off (the benchmark schedules evals)."""
    config = load_config(REPO / "recipes" / "configs" / f"dit_{size.replace('/', '').lower()}_{method}.yaml")
    overrides: dict[str, Any] = {"steps": 10_000_000, "eval.every": 0, "sample.every": 0, "checkpoint.every": 0,
                                 "checkpoint.final": False, **(QUICK if quick else CPU if cpu else {})}
    if compile_ is not None:
        overrides["compile"] = compile_
    return with_overrides(config, overrides)


def run_method(method: str, config: TrainConfig, budget_s: float, eval_every_s: float, runs: Path) -> dict:
    """Train one method for the budget; its evaluations, throughput, or why it was skipped."""
    import routekit as rk

    shutil.rmtree(runs / method, ignore_errors=True)  # a fresh run folder each time
    try:
        stats = train(config, runs / method, budget_s=budget_s, eval_every_s=eval_every_s)
    except rk.ConfigError as error:  # e.g. a routekit without DAR yet: report it, run the others
        print(f"[{method}] skipped: {error}", file=sys.stderr)
        return {"method": method, "skipped": str(error)}
    finally:
        gc.collect()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    seconds = stats["train_seconds"]
    return {"method": method, "steps": stats["step"], "train_seconds": seconds,
            "first_step_seconds": stats["first_step_seconds"], "steps_per_s": (stats["step"] - 1) / seconds,
            "parameters": stats["parameters"], "evals": stats["evals"],
            "config": config.model_dump(mode="json")}


def time_to_reach(result: dict, target: float) -> dict | None:
    """The first evaluation at or below target FD."""
    return next((e for e in result.get("evals", []) if e["fd"] <= target), None)


def subject(report: dict) -> str:
    if report["quick"]:
        return "a tiny DiT on synthetic data (--quick)"
    if report.get("cpu_preset"):
        return "a small DiT (depth 8, width 128, patch 4: 64 tokens) on MNIST-5k, 2-core CPU (--cpu-preset)"
    return f"DiT-{report['size']} on MNIST-5k"


def title(report: dict) -> str:
    return f"Convergence: {subject(report)}, {report['budget_s']:g} s of training each"


def markdown(report: dict) -> str:
    """The table under the header common.write puts first; each method names the run that measured it, since
    methods may come from separate commands (their results merge)."""
    results = report["results"]
    vanilla = results.get("vanilla")
    target = vanilla["evals"][-1]["fd"] if vanilla and vanilla.get("evals") else None
    base = time_to_reach(vanilla, target) if target is not None else None
    lines = [
        f"- feature classifier test accuracy: {report.get('classifier_test_accuracy', float('nan')):.3f}",
        "- training seconds exclude evaluation and the first step (compilation); FD: Fréchet distance in the "
        "classifier's 128-d features to the held-out test split (lower is better); accuracy: the classifier "
        "agrees with the sampled class; EMA weights, guidance and ODE steps as in each recipe.",
        "",
        "| method | steps | steps/s | first step (s) | final FD | final accuracy "
        "| seconds to vanilla's final FD | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, result in results.items():
        if "skipped" in result:
            lines.append(f"| {method} | skipped: {result['skipped'].splitlines()[0]} |" + " |" * 6)
            continue
        final = result["evals"][-1] if result["evals"] else {"fd": float("nan"), "accuracy": float("nan")}
        hit = time_to_reach(result, target) if target is not None else None
        reach = f"{hit['train_seconds']:.0f} (step {hit['step']})" if hit else "not reached"
        speedup = f"{base['train_seconds'] / hit['train_seconds']:.2f}x" if hit and base and hit["train_seconds"] else "-"
        lines.append(f"| {method} | {result['steps']} | {result['steps_per_s']:.2f} | "
                     f"{result['first_step_seconds']:.1f} | {final['fd']:.3f} | {final['accuracy']:.3f} | "
                     f"{reach} | {speedup} |")
    if target is not None:
        lines += ["", f"Vanilla's final FD is {target:.3f}; the speed-up is vanilla's time to first reach it "
                      "divided by the method's."]
    runs = [f"- {m}: `{r['run']['command']}` at `{r['run']['commit']}` on {r['run']['device']}"
            for m, r in results.items() if "run" in r]
    if runs:
        lines += ["", "Each method's run:", "", *runs]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    with figure(path, 2, 2, figsize=(11, 8), sharey="row") as (fig, axes):
        for method, result in report["results"].items():
            evals = result.get("evals") or []
            if not evals:
                continue
            for col, x_key in enumerate(("train_seconds", "step")):
                xs = [e[x_key] for e in evals]
                axes[0, col].plot(xs, [e["fd"] for e in evals], marker="o", label=method)
                axes[1, col].plot(xs, [e["accuracy"] for e in evals], marker="o", label=method)
        for col, label in enumerate(("training seconds", "steps")):
            axes[1, col].set_xlabel(label)
        axes[0, 0].set_ylabel("FD (classifier features), log")
        axes[0, 0].set_yscale("log")
        axes[1, 0].set_ylabel("classifier accuracy on samples")
        axes[0, 0].legend()
        fig.suptitle(f"{subject(report)}: EMA sample quality vs training time and steps")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="S/2", choices=["S/2", "B/2"])
    parser.add_argument("--budget-s", type=float, default=240.0, help="training seconds per method")
    parser.add_argument("--eval-every-s", type=float, help="training seconds between evaluations (budget / 8)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="override the recipes' compile flag")
    parser.add_argument("--quick", action="store_true", help="tiny model on synthetic data, seconds on CPU")
    parser.add_argument("--cpu-preset", action="store_true",
                        help="a small DiT (depth 8, width 128, patch 4: 64 tokens) on MNIST-5k for a CPU-only comparison")
    parser.add_argument("--fresh", action="store_true", help="drop earlier results instead of merging into them")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; valid: {', '.join(METHODS)}")
    budget = 2.0 if args.quick and args.budget_s == parser.get_default("budget_s") else args.budget_s
    eval_every = args.eval_every_s or budget / 8
    out = args.out or (REPO / "runs" / "convergence_quick" if args.quick else RESULTS)
    runs = REPO / "runs" / ("convergence_quick" if args.quick else "convergence")

    settings = {"size": args.size, "budget_s": budget, "eval_every_s": eval_every, "quick": args.quick,
                "cpu_preset": args.cpu_preset}
    report_path = out / "convergence.json"
    report = json.loads(report_path.read_text()) if report_path.exists() and not args.fresh else {}
    if any(report.get(k) != v for k, v in settings.items()):
        report = {}  # earlier results were made under other settings: start over
    report = {**{k: v for k, v in report.items() if k not in ("machine", "commit", "command")}, **settings}
    report.setdefault("results", {})
    info = machine()
    run = {key: info[key] for key in ("commit", "command", "device", "date")}

    first = method_config(methods[0], args.size, args.quick, args.compile, args.cpu_preset)
    dataset = load_dataset(first.data.name, first.data.limit, first.data.cache_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, report["classifier_test_accuracy"] = load_classifier(dataset, device, first.data.cache_dir)  # cache it now
    for method in methods:
        print(f"[{method}] {budget:g} s of training, evaluations every {eval_every:g} s", file=sys.stderr)
        config = method_config(method, args.size, args.quick, args.compile, args.cpu_preset)
        report["results"][method] = {**run_method(method, config, budget, eval_every, runs), "run": run}
        report["results"] = {m: report["results"][m] for m in METHODS if m in report["results"]}
        write("convergence", info, report, title(report), markdown(report), out, lambda path: plot(report, path))
    print((out / "convergence.md").read_text())


if __name__ == "__main__":
    main()

"""Multi-GPU scaling of the training recipes through `accelerate launch`: DDP and FSDP2, routes and DAR.

Each run is the real recipe (`accelerate launch -m recipes.train CONFIG`) with evaluation, sampling and
checkpoints off; the per-GPU batch stays fixed (weak scaling), so the global batch grows with the GPU
count. One GPU runs the recipe plainly (DDP and FSDP have nothing to do there); N GPUs run it under DDP
(`--multi_gpu`) and under FSDP2 (recipes/configs/accelerate/fsdp2.yaml: bf16, per-block units; DAR recipes
sharded into routekit's units, without activation checkpointing). Throughput is read back from the run's
own train.jsonl: images per second between the first and the last logged step (warm-up, compilation and
launch are not counted); the peak memory per GPU is the main process's, logged there too.

    python benchmarks/scaling.py --configs recipes/configs/dit_b2_tread.yaml recipes/configs/dit_b2_dar.yaml \
        --strategies ddp fsdp --gpus 1 2 --steps 150 --log-every 25
    python benchmarks/scaling.py --quick --out /tmp/scaling   # CPU smoke run: the first recipe, one process, a tiny model

Writes benchmarks/results/scaling.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, RESULTS, TINY, figure, machine, write  # noqa: E402
from recipes.config import load_config, with_overrides  # noqa: E402

# --quick: the recipe's model shrunk until a CPU process trains a step in milliseconds, on synthetic data
QUICK = {"data.name": "synthetic", "bf16": False}


FSDP_CONFIG = REPO / "recipes" / "configs" / "accelerate" / "fsdp2.yaml"


def launch(config: str, gpus: int, per_gpu_batch: int, steps: int, log_every: int, out: Path,
           extra: tuple[str, ...] = (), strategy: str = "ddp") -> dict:
    """One `accelerate launch` of the recipe on `gpus` processes under `strategy` ("ddp" or "fsdp"; one
    process runs plainly), in a run folder under ``out``; its measured throughput and peak memory.
    ``extra``: more KEY=VALUE overrides for the recipe (the tests shrink the model with them)."""
    run_dir = out / f"{Path(config).stem}_{strategy if gpus > 1 else 'single'}_gpus{gpus}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a re-run measures afresh; the recipe refuses a folder holding a run
    overrides = [f"batch={per_gpu_batch * gpus}", "eval.every=0", "sample.every=0", "checkpoint.every=0",
                 "checkpoint.final=false", f"log_every={log_every}", "compile=false", *extra]
    recipe = load_config(config)
    precision = "bf16" if recipe.bf16 else "no"  # the launcher's must match the recipe's
    how = []
    if gpus > 1 and strategy == "ddp":
        how = ["--multi_gpu"]
    elif gpus > 1 and strategy == "fsdp":
        how = ["--config_file", str(FSDP_CONFIG)]
        if recipe.dar is not None:  # DAR runs no block forward to checkpoint
            how += ["--fsdp_activation_checkpointing", "false"]
    command = [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_machines", "1",
               "--num_processes", str(gpus), "--mixed_precision", precision, "--dynamo_backend", "no",
               "-m", "recipes.train", config, "--out", str(run_dir), "--steps", str(steps), "--set", *overrides]
    print("$", shlex.join(command), flush=True)
    began = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    wall = time.perf_counter() - began
    logs = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    logs = [r for r in logs if "loss" in r and "train_seconds" in r]
    if len(logs) < 2:
        raise SystemExit(f"{run_dir}/train.jsonl has {len(logs)} logged steps; raise --steps above 2 x --log-every")
    first, last = logs[0], logs[-1]
    steps_per_s = (last["step"] - first["step"]) / (last["train_seconds"] - first["train_seconds"])
    return {"recipe": Path(config).stem, "strategy": strategy if gpus > 1 else "single", "gpus": gpus,
            "global_batch": per_gpu_batch * gpus, "steps": last["step"], "steps_per_s": steps_per_s,
            "images_per_s": steps_per_s * per_gpu_batch * gpus, "peak_gib_per_gpu": last.get("peak_gib"),
            "final_loss": last["loss"], "wall_s": wall, "command": shlex.join(command)}


def _efficiency(row: dict, rows: list[dict]) -> float | None:
    """Weak-scaling efficiency: images/s over (GPUs x the same recipe's images/s on one GPU)."""
    base = next((r for r in rows if r["recipe"] == row["recipe"] and r["gpus"] == 1), None)
    return row["images_per_s"] / (base["images_per_s"] * row["gpus"]) if base else None


def table(rows: list[dict]) -> str:
    lines = ["| recipe | strategy | GPUs | global batch | steps/s | images/s | weak-scaling efficiency "
             "| peak GiB per GPU | final loss | wall s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        eff, peak = _efficiency(r, rows), r["peak_gib_per_gpu"]
        lines.append(f"| {r['recipe']} | {r['strategy']} | {r['gpus']} | {r['global_batch']} | {r['steps_per_s']:.2f} | "
                     f"{r['images_per_s']:.0f} | {'-' if eff is None else f'{eff:.1%}'} | "
                     f"{'-' if peak is None else f'{peak:.2f}'} | {r['final_loss']:.4f} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    with figure(path, 1, 2, figsize=(10, 3.8)) as (_, (ax, mem)):
        for recipe in dict.fromkeys(r["recipe"] for r in rows):
            single = [r for r in rows if r["recipe"] == recipe and r["gpus"] == 1]
            for strategy in ("ddp", "fsdp"):
                line = single + [r for r in rows if r["recipe"] == recipe and r["strategy"] == strategy]
                if len(line) > len(single):
                    ax.plot([r["gpus"] for r in line], [r["images_per_s"] for r in line], marker="o",
                            label=f"{recipe} {strategy}")
            if single:
                gpus = sorted({r["gpus"] for r in rows})
                ax.plot(gpus, [single[0]["images_per_s"] * g for g in gpus], ls=":", color="grey")
        ax.set_xlabel("GPUs (dotted: linear)")
        ax.set_ylabel("training images / s")
        ax.set_xticks(sorted({r["gpus"] for r in rows}))
        ax.legend(fontsize=7)
        labels = [f"{r['recipe']}\n{r['strategy']} x{r['gpus']}" for r in rows]
        mem.bar(range(len(rows)), [r["peak_gib_per_gpu"] or 0 for r in rows])
        mem.set_xticks(range(len(rows)), labels, fontsize=6, rotation=45, ha="right")
        mem.set_ylabel("peak GiB per GPU")


def quick_config(config: str, runs: Path) -> str:
    """The recipe at ``config`` with QUICK's overrides, written beside the runs: the path to launch."""
    recipe = load_config(config)
    narrow = {k: v for k, v in TINY[recipe.model.backbone].items() if k != "depth"}  # its routes name blocks
    model = {**recipe.model.overrides, **narrow}
    shrunk = with_overrides(recipe, {**QUICK, "model.overrides": model})
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / "quick.yaml"
    path.write_text(yaml.safe_dump(shrunk.model_dump(mode="json")))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["recipes/configs/dit_b2_tread.yaml",
                                                    "recipes/configs/dit_b2_dar.yaml"])
    p.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    p.add_argument("--gpus", nargs="+", type=int, default=[1, 2])
    p.add_argument("--per-gpu-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--name", default="scaling")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--runs", type=Path, help="run folders (default runs/NAME)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: the first recipe, one process, a tiny model, batch 2, 6 steps")
    args = p.parse_args()
    runs = args.runs or REPO / "runs" / args.name
    configs = args.configs
    if args.quick:
        args.gpus, args.per_gpu_batch, args.steps, args.log_every = [1], 2, 6, 2
        configs = [quick_config(configs[0], runs)]
    elif max(args.gpus) > torch.cuda.device_count():
        raise SystemExit(f"--gpus {max(args.gpus)} asked for, {torch.cuda.device_count()} CUDA devices here "
                         "(--quick runs one CPU process)")
    info = machine()
    rows = []
    for given, config in zip(args.configs, configs):
        for gpus in sorted(args.gpus):
            for strategy in (["single"] if gpus == 1 else args.strategies):
                rows.append({**launch(config, gpus, args.per_gpu_batch, args.steps, args.log_every,
                                      runs / Path(given).stem, strategy=strategy), "recipe": Path(given).stem})
                shown = ", ".join(f"`{c}`" for c in args.configs[:len(configs)])
                body = (f"Recipes: {shown} (compile off, evaluation/sampling/checkpoints off); "
                        f"{args.per_gpu_batch} images per GPU per step\n\n{table(rows)}")
                write(args.name, info, {"configs": args.configs, "rows": rows},
                      "Multi-GPU scaling through accelerate: DDP and FSDP2, weak scaling", body, args.out,
                      lambda path: plot(rows, path))
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()

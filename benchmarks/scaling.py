"""Multi-GPU scaling of the training recipe through `accelerate launch` (DDP), 1 GPU vs N GPUs.

Each run is the real recipe (`accelerate launch -m recipes.train CONFIG`) with evaluation, sampling and
checkpoints off; the per-GPU batch stays fixed (weak scaling), so the global batch grows with the GPU
count. Throughput is read back from the run's own train.jsonl: images per second between the first and
the last logged step (warm-up, compilation and launch are not counted).

    python benchmarks/scaling.py --config recipes/configs/dit_b2_tread.yaml --gpus 1 2 --steps 200 --log-every 25
    python benchmarks/scaling.py --quick --out /tmp/scaling   # CPU smoke run: one process, a tiny model

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


def launch(config: str, gpus: int, per_gpu_batch: int, steps: int, log_every: int, out: Path,
           extra: tuple[str, ...] = ()) -> dict:
    """One `accelerate launch` of the recipe on `gpus` processes; its measured throughput.
    ``extra``: more KEY=VALUE overrides for the recipe (the tests shrink the model with them)."""
    run_dir = out / f"gpus{gpus}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a re-run measures afresh; the recipe refuses a folder holding a run
    overrides = [f"batch={per_gpu_batch * gpus}", "eval.every=0", "sample.every=0", "checkpoint.every=0",
                 "checkpoint.final=false", f"log_every={log_every}", "compile=false", *extra]
    precision = "bf16" if load_config(config).bf16 else "no"  # the launcher's must match the recipe's
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--num_processes", str(gpus),
               *(["--multi_gpu"] if gpus > 1 else []), "--mixed_precision", precision, "--dynamo_backend", "no",
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
    return {"gpus": gpus, "global_batch": per_gpu_batch * gpus, "steps": last["step"],
            "steps_per_s": steps_per_s, "images_per_s": steps_per_s * per_gpu_batch * gpus,
            "final_loss": last["loss"], "wall_s": wall, "command": shlex.join(command)}


def table(rows: list[dict]) -> str:
    base = rows[0]["images_per_s"] / rows[0]["gpus"]
    lines = ["| GPUs | global batch | steps/s | images/s | scaling efficiency | final loss | wall s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['global_batch']} | {r['steps_per_s']:.2f} | {r['images_per_s']:.0f} | "
                     f"{r['images_per_s'] / (base * r['gpus']):.1%} | {r['final_loss']:.4f} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    gpus = [r["gpus"] for r in rows]
    base = rows[0]["images_per_s"] / rows[0]["gpus"]
    with figure(path, figsize=(5, 3.5)) as (_, ax):
        ax.plot(gpus, [r["images_per_s"] for r in rows], marker="o", label="measured")
        ax.plot(gpus, [base * g for g in gpus], ls="--", color="grey", label="linear")
        ax.set_xlabel("GPUs (accelerate DDP)")
        ax.set_ylabel("training images / s")
        ax.set_xticks(gpus)
        ax.legend()


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
    p.add_argument("--config", default="recipes/configs/dit_b2_tread.yaml")
    p.add_argument("--gpus", nargs="+", type=int, default=[1, 2])
    p.add_argument("--per-gpu-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--name", default="scaling")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: one process, a tiny model, batch 2, 6 steps")
    args = p.parse_args()
    runs = REPO / "runs" / args.name
    config = args.config
    if args.quick:
        args.gpus, args.per_gpu_batch, args.steps, args.log_every = [1], 2, 6, 2
        config = quick_config(args.config, runs)
    elif max(args.gpus) > torch.cuda.device_count():
        raise SystemExit(f"--gpus {max(args.gpus)} asked for, {torch.cuda.device_count()} CUDA devices here "
                         "(--quick runs one CPU process)")
    info = machine()
    rows = []
    for gpus in args.gpus:
        rows.append(launch(config, gpus, args.per_gpu_batch, args.steps, args.log_every, runs))
        body = f"Recipe: `{args.config}` (compile off, evaluation/sampling/checkpoints off)\n\n{table(rows)}"
        write(args.name, info, {"config": args.config, "rows": rows},
              f"Multi-GPU scaling (accelerate DDP, weak scaling: {args.per_gpu_batch} images per GPU per step)", body,
              args.out, lambda path: plot(rows, path))
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()

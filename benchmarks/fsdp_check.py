"""FSDP2 acceptance: routes and DAR sharded over 2 GPUs train the loss curve of one GPU without FSDP.

For each variant (DiT-XL/2 with TREAD's route 2 -> 24, and with DAR static queries, chunks of 4) two runs of
the same 20 steps, both through `accelerate launch`:

- reference: one GPU, no FSDP (bf16 autocast, as the recipes train); each step takes the world's batch as
  WORLD micro-batches, rank by rank, and averages their gradients;
- sharded: WORLD GPUs under recipes/configs/accelerate/fsdp2.yaml (bf16 mixed precision; DAR sharded into
  routekit's units by the recipes' `fsdp_shard`, routes by accelerate's per-block policy with activation
  checkpointing); each rank takes its micro-batch.

Data, noise, noise levels and route draws are seeded per (step, rank) in both runs, so the two compute the
same steps and differ by arithmetic alone: bf16 parameters and reductions under FSDP against bf16 autocast.
It checks the per-step losses agree within --rtol and that the sharded run's peak memory per GPU is below
the reference's, and writes benchmarks/results/fsdp_check.{json,md,png}.

    python benchmarks/fsdp_check.py                     # 2 GPUs: DiT-XL/2, routes and DAR, 20 steps
    python benchmarks/fsdp_check.py --quick --out DIR   # CPU smoke run of the plumbing: a tiny DiT, and the
                                                        # "sharded" run is a plain process (accelerate has no
                                                        # FSDP on CPUs; tests/test_distributed.py covers FSDP there)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, RESULTS, TINY, figure, machine, write  # noqa: E402

VARIANTS = {"routes": dict(routes=[{"start": 2, "end": 24, "rate": 0.5}], dar=None),
            "dar": dict(routes=[], dar={"query": "static", "chunk": 4})}
FSDP_CONFIG = REPO / "recipes" / "configs" / "accelerate" / "fsdp2.yaml"


# ---- one run (inside accelerate launch) --------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import accelerate

    import routekit as rk
    from backbones import dit
    from recipes.config import EDMConfig
    from recipes.objectives import make_objective
    from recipes.train import fsdp_shard

    acc = accelerate.Accelerator(mixed_precision="no" if args.quick else "bf16")
    rank, world = acc.process_index, acc.num_processes
    micro = args.world // world  # micro-batches per process and step: WORLD on the reference, 1 when sharded
    variant = VARIANTS[args.variant]
    torch.manual_seed(0)  # the same initial weights everywhere
    overrides = {**TINY["dit"], "depth": 8} if args.quick else {}
    model = dit.build(args.size, input_size=32, in_channels=4, num_classes=1000, class_dropout=0.1, **overrides)
    model = model.to(acc.device)
    example = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(0))
    routes = [rk.Route(**r) for r in variant["routes"]]
    if args.quick:
        routes = [rk.Route(start=2, end=5, rate=0.5)] if routes else []
    residual = rk.DAR(**variant["dar"]) if variant["dar"] else None
    model = rk.apply(model, routes=routes, residual=residual, example_inputs=example)
    if acc.is_fsdp2:
        model = fsdp_shard(acc, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    net, opt = acc.prepare(model, opt)
    objective = make_objective(EDMConfig())
    net.train()
    losses, times = [], []
    for step in range(args.steps):
        begin = time.perf_counter()
        total = torch.zeros((), device=acc.device)
        for m in range(micro):
            part = rank * micro + m  # which rank's share of the world's batch this is
            data = torch.Generator().manual_seed(10_000 * step + part)
            x = torch.randn(args.batch, 4, 32, 32, generator=data).to(acc.device)
            y = torch.randint(0, 1000, (args.batch,), generator=data).to(acc.device)
            torch.manual_seed(20_000 * step + part)  # noise, noise level, label dropout and route draws
            with acc.autocast():
                loss = objective.loss(net, x, y) / micro
            acc.backward(loss)
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(acc.reduce(total, "mean").item())
        times.append(time.perf_counter() - begin)
    peak = torch.tensor([torch.cuda.max_memory_allocated(acc.device) / 2**30 if acc.device.type == "cuda" else 0.0],
                        device=acc.device)
    peaks = acc.gather(peak).tolist()
    if acc.is_main_process:
        result = {"variant": args.variant, "processes": world, "fsdp": bool(acc.is_fsdp2), "micro_batches": micro,
                  "batch_per_micro": args.batch, "losses": losses, "step_s": times, "peak_gib_per_gpu": peaks}
        Path(args.result).write_text(json.dumps(result))


# ---- the orchestrator ------------------------------------------------------------------------------------------

def launch(args: argparse.Namespace, variant: str, sharded: bool, runs: Path) -> dict:
    result = runs / f"{variant}_{'fsdp' if sharded else 'reference'}.json"
    result.unlink(missing_ok=True)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--dynamo_backend", "no"]
    if sharded and not args.quick:
        launcher += ["--config_file", str(FSDP_CONFIG), "--num_processes", str(args.world)]
        if variant == "dar":  # DAR runs no block forward to checkpoint
            launcher += ["--fsdp_activation_checkpointing", "false"]
    else:
        launcher += ["--num_processes", "1", "--mixed_precision", "no" if args.quick else "bf16"]
    command = [*launcher, str(Path(__file__).resolve()), "--worker", "--variant", variant, "--size", args.size,
               "--steps", str(args.steps), "--batch", str(args.batch), "--world", str(args.world),
               "--result", str(result), *(["--quick"] if args.quick else [])]
    print("$", shlex.join(command), flush=True)
    began = time.perf_counter()
    path = os.pathsep.join(part for part in (str(REPO), os.environ.get("PYTHONPATH", "")) if part)  # keep the caller's too
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": path})
    return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - began, "command": shlex.join(command)}


def compare(reference: dict, sharded: dict, rtol: float) -> dict:
    diffs = [abs(a - b) / abs(a) for a, b in zip(reference["losses"], sharded["losses"])]
    peak_ref, peak_sharded = max(reference["peak_gib_per_gpu"]), max(sharded["peak_gib_per_gpu"])
    return {"max_rel_loss_diff": max(diffs), "mean_rel_loss_diff": sum(diffs) / len(diffs),
            "losses_agree": max(diffs) <= rtol, "peak_gib_reference": peak_ref, "peak_gib_sharded": peak_sharded,
            "memory_below": peak_sharded < peak_ref}


def table(rows: list[dict], rtol: float) -> str:
    lines = ["| variant | steps | max rel. loss diff | mean rel. loss diff | losses agree (rtol "
             f"{rtol:g}) | peak GiB/GPU: 1 GPU | peak GiB/GPU: FSDP | lower | step s: 1 GPU | step s: FSDP |",
             "|---|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    for r in rows:
        c, ref, sh = r["check"], r["reference"], r["sharded"]
        median = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2] if len(xs) > 1 else xs[0]  # noqa: E731
        lines.append(f"| {r['variant']} | {len(ref['losses'])} | {c['max_rel_loss_diff']:.2e} | "
                     f"{c['mean_rel_loss_diff']:.2e} | {'yes' if c['losses_agree'] else 'NO'} | "
                     f"{c['peak_gib_reference']:.2f} | {c['peak_gib_sharded']:.2f} | "
                     f"{'yes' if c['memory_below'] else 'NO'} | {median(ref['step_s']):.3f} | {median(sh['step_s']):.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    with figure(path, 1, len(rows), figsize=(5 * len(rows), 3.5), squeeze=False) as (_, axes):
        for ax, r in zip(axes[0], rows):
            ax.plot(r["reference"]["losses"], marker="o", label="1 GPU, no FSDP")
            ax.plot(r["sharded"]["losses"], marker="x", ls="--",
                    label=f"{r['sharded']['processes']} GPUs, FSDP2" if r["sharded"]["fsdp"] else "second run")
            ax.set_title(r["variant"])
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.legend()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--size", default="XL/2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="images per micro-batch (= per GPU when sharded)")
    p.add_argument("--world", type=int, default=2, help="GPUs of the sharded run")
    p.add_argument("--rtol", type=float, default=0.05, help="largest relative per-step loss difference accepted")
    p.add_argument("--name", default="fsdp_check")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--runs", type=Path, help="run folders (default runs/NAME)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run of the plumbing (no FSDP on CPUs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.size, args.steps, args.batch = "S/2", 3, 2
    elif torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} GPUs, {torch.cuda.device_count()} here (--quick: a CPU smoke run)")
    runs = args.runs or REPO / "runs" / args.name
    runs.mkdir(parents=True, exist_ok=True)
    info, rows = machine(), []
    for variant in args.variants:
        reference, sharded = launch(args, variant, False, runs), launch(args, variant, True, runs)
        rows.append({"variant": variant, "reference": reference, "sharded": sharded,
                     "check": compare(reference, sharded, args.rtol)})
        model = "a tiny DiT (--quick)" if args.quick else f"DiT-{args.size}"
        body = (f"{model}, 32x32x4 inputs (256 tokens), {args.world} x {args.batch} images per step, AdamW "
                f"lr 1e-4, EDM loss; data, noise and route draws seeded per (step, rank) in both runs.\n\n"
                + table(rows, args.rtol))
        write(args.name, info, {"rtol": args.rtol, "rows": rows},
              f"FSDP2 on {args.world} GPUs against 1 GPU without FSDP: routes and DAR", body, args.out,
              lambda path: plot(rows, path))
    print((args.out / f"{args.name}.md").read_text())
    if not args.quick and not all(r["check"]["losses_agree"] and r["check"]["memory_below"] for r in rows):
        raise SystemExit("FSDP acceptance failed: see the table above")


if __name__ == "__main__":
    main()

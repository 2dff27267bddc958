"""The merges' backward alone, per kernel and launch, at DiT-XL/2 batch 256 (65536 rows, D=1152, bf16).

A two-phase chunk of 4 has four merges with 1, 2, 3 and 1 own sources (the last reads the chunk's
fresh summary), 14 chunks a step: in the step the merges' backward was 28.0 ms (cd3d602), ~2 TB/s
against the forward's ~3. Each setting of ROUTEKIT_DAR_MERGE_BWD (``generic``: ``_dar_bwd_kernel``;
else ``dar_merge``'s warps, sources per tile, prefetch, split rows, fused reduce) is checked
against the generic kernel and timed per source count (GPU kernel time, profiler); the step's share
is 14 x (t1 + t2 + t3 + t1). The shared part comes as a weighted sum's (B, N, 2) state, as the
streamed schedule makes it (``dar_merge_probe_0941d86.md`` ran before that handoff: a (B, N) lse, and
each merge wrote p_A g).

    python benchmarks/dar_merge_probe.py                    # H200: results/dar_merge_probe.{json,md}
    python benchmarks/dar_merge_probe.py --quick            # tiny shapes, CPU (TRITON_INTERPRET=1): checks only
    python benchmarks/dar_merge_probe.py --best-file F      # also write the fastest correct setting to F
    python benchmarks/dar_merge_probe.py --given-dot        # merges handed their rows' g . o, as compiled steps run
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import device_or_exit, header, machine, restored_env, write  # noqa: E402
from benchmarks.dar_kernel import device_ms  # noqa: E402
from routekit.kernels import dar_triton  # noqa: E402

# ROUTEKIT_DAR_MERGE_BWD settings: "generic" or warps,tile,prefetch,split_rows,fused_reduce
SETTINGS = ["generic", "4,1,1,1,0", "4,1,0,1,0", "2,1,1,1,0", "1,1,1,1,0", "8,1,1,1,0", "4,1,1,0,0", "4,2,1,1,0",
            "4,4,1,1,0", "4,1,1,1,1", "8,1,1,0,1"]
OWN = (1, 2, 3, 1)  # a chunk's merges' own sources
CHUNKS = 14
TOLERANCE = 2e-2  # bf16 gradients, relative to the largest


def inputs(b: int, n: int, d: int, sources: int, device: str, seed: int = 0) -> dict:
    """One merge's backward operands as the streamed schedule makes them: its sources, a shared query,
    the weighted sum's (B, N, 2) state, and out and lse from a forward through the merge."""
    gen = torch.Generator(device).manual_seed(seed)
    dtype = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    own = [rand(b, n, d) for _ in range(sources)]
    query = torch.randn(d, generator=gen, device=device) * 0.1
    prefix = rand(b, n, d)
    lse0 = torch.randn(b, n, generator=gen, device=device) + math.log(8)
    prefix_lse = torch.stack([lse0, torch.zeros_like(lse0)], -1)  # the state: lse and the return slot
    cfg = dar_triton.launch_config(d, b * n)
    out, _, lse, _ = dar_triton._mix(own, query, 1e-6, dtype, False, cfg.as_list(), prefix, prefix_lse)
    grad_out = rand(b, n, d)
    return {"sources": own, "query": query, "grad_out": grad_out, "out": out, "lse": lse, "eps": 1e-6,
            "launch": cfg.as_list(), "prefix_lse": prefix_lse, "g_dot_o": (grad_out.float() * out.float()).sum(-1)}


def backward(operands: dict, setting: str, given_dot: bool = False) -> list[torch.Tensor]:
    """The merge's gradients with ``setting``; ``given_dot``: the rows' g . o handed in (not the
    generic kernel's way), as a compiled step's merges get it (``dar_triton._takes_row_dot``)."""
    os.environ["ROUTEKIT_DAR_MERGE_BWD"] = setting
    if not given_dot or setting == "generic":
        operands = {k: v for k, v in operands.items() if k != "g_dot_o"}
    grads, dq, dprefix, y = dar_triton._mix_backward(**operands)
    if grads[0].dim() == 4:  # stacked (small sources)
        grads = list(grads[0].unbind(0))
    return [*grads, dq, dprefix, y]


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-12)).item()
               for g, w in zip(got, want) if w.numel())  # (p_A g is empty after a weighted sum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness on tiny shapes only (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--best-file", type=Path, default=None, help="write the fastest correct setting here")
    parser.add_argument("--settings", nargs="*", default=SETTINGS)
    parser.add_argument("--given-dot", action="store_true", help="hand the merge kernels their rows' g . o (o not read)")
    args = parser.parse_args()
    device = device_or_exit(args.quick)
    b, n, d = (2, 5, 24) if args.quick else (256, 256, 1152)
    rows, cases = [], {s: inputs(b, n, d, s, device, seed=s) for s in sorted(set(OWN))}
    with restored_env("ROUTEKIT_DAR_MERGE_BWD"):
        want = {s: backward(ops, "generic") for s, ops in cases.items()}
        for setting in args.settings:
            row = {"setting": setting}
            try:
                given = args.given_dot and setting != "generic"
                row["max_error"] = max(max_error(backward(ops, setting, given), want[s]) for s, ops in cases.items())
                if not args.quick:
                    row["ms"] = {s: device_ms(lambda ops=ops, setting=setting, given=given: backward(ops, setting, given),
                                              iters=10)
                                 for s, ops in cases.items()}
                    row["step_ms"] = CHUNKS * sum(row["ms"][s] for s in OWN)
                    rows_read = 1 if given else 2  # g (and o); then sources read, grads written
                    moved = CHUNKS * sum(rows_read + 2 * s for s in OWN) * b * n * d * 2
                    row["tb_per_s"] = moved / row["step_ms"] / 1e9
            except Exception as exc:  # a setting that fails to compile must not lose the others
                row["status"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            print(row, flush=True)
    bad = [r for r in rows if r.get("max_error", 1.0) > TOLERANCE]
    timed = [r for r in rows if "step_ms" in r and r not in bad]
    best = min(timed, key=lambda r: r["step_ms"]) if timed else None
    info = machine()
    lines = ["# Merges' backward per kernel and launch (DiT-XL/2 b256: 65536 rows, D=1152, bf16)", "", header(info), "",
             "Settings: ROUTEKIT_DAR_MERGE_BWD (`generic` = `_dar_bwd_kernel`; else `dar_merge` warps, sources per "
             "tile, prefetch, split rows, fused reduce). Step share = 14 chunks x (t1 + t2 + t3 + t1); TB/s over "
             + ("(1 + 2S) rows of bytes per merge: `--given-dot`, each merge but the generic one handed its rows' "
                "g . o, o not read." if args.given_dot else "(2 + 2S) rows of bytes per merge."), "",
             "| setting | S=1 ms | S=2 ms | S=3 ms | step share ms | TB/s | max rel. error vs generic |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r.get("ms", {})
        cells = [f"{ms[s]:.3f}" if s in ms else "" for s in (1, 2, 3)]
        lines.append(f"| `{r['setting']}` | " + " | ".join(cells)
                     + (f" | {r['step_ms']:.2f} | {r['tb_per_s']:.2f}" if "step_ms" in r else " | | ")
                     + f" | {r.get('max_error', float('nan')):.1e} {r.get('status', '')} |")
    if best:
        lines += ["", f"Fastest within tolerance: `{best['setting']}`, {best['step_ms']:.2f} ms per step."]
    if bad:
        lines += ["", "Outside tolerance or failed: " + ", ".join(f"`{r['setting']}`" for r in bad)]
    write("dar_merge_probe" + ("_quick" if args.quick else ""), {"machine": info, "rows": rows, "best": best},
          "\n".join(lines) + "\n", args.out)
    if args.best_file and best:
        args.best_file.write_text(best["setting"])
    if bad:
        sys.exit(f"settings outside tolerance {TOLERANCE} or failed: {[r['setting'] for r in bad]}")


if __name__ == "__main__":
    main()

"""Compile every DAR Triton kernel for the H200 (sm_90) at DiT-XL/2's launch settings, without a GPU.

The CPU interpreter runs kernel bodies as Python, so code the GPU compiler rejects (a tuple holding a
dtype, a name rebound to another type in a loop) passes the interpreted tests and fails only on the
GPU. Run without TRITON_INTERPRET (``tests/test_dar_kernel.py`` does, in a subprocess); prints each
kernel and exits 1 naming those that failed. ``--resources`` adds each kernel's registers a thread and
spill stack (what limits the warps per SM), to weigh a launch change before spending GPU time on it.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from routekit.kernels import aggregation, merge, weighted_sums  # noqa: E402
from routekit.kernels.launch import DEFAULTS, aggregate_launch, head_tail  # noqa: E402

D = 1152
BF16_POINTERS = {"like_ptr", "g_ptr", "o_ptr", "out_ptr", "mix_ptr"}


def compile_sm90(kernel, constexprs: dict, warps: int):
    """Compile ``kernel`` for sm_90: bf16 sources and mixes, int64 pointer tables, fp32 elsewhere."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i64" if "table" in name else "*bf16" if name in BF16_POINTERS else "*fp32"
        else:
            signature[name] = "fp32" if name in ("eps", "scale", "norm_eps") else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def resources(compiled) -> str:
    """Registers a thread and spill stack of a compiled kernel, from its cubin (cuobjdump ships with
    Triton): the occupancy ncu would report, without a GPU. This machine's Triton may compile a few
    registers apart from the GPU machine's."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return f"no {tool} to read registers with"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        done = subprocess.run([str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True)
    usage = [line.split("Resource usage:")[-1].split() for line in done.stdout.splitlines() if "REG:" in line]
    return " ".join(f for f in (usage[0] if usage else ["(no cuobjdump report)"]) if f.startswith(("REG", "STACK")))


def cases():
    """(label, kernel, constexprs, warps) for the kernels routekit launches on the H200."""
    launch = aggregate_launch(D, 65536)
    head, tail = head_tail(D)
    common = {"BLOCK_R": launch.block_rows, "BLOCK_D": triton.next_power_of_2(D), "ALIGNED": True,
              "FUSED_REDUCE": launch.fused_reduce}
    for merges in (False, True):  # with a weighted sum's mix and state: a merge the merge kernels do not take
        yield (f"aggregation forward, merge={merges}", aggregation._dar_fwd_kernel,
               {**common, "BLOCK_S": launch.fwd_sources, "STORE_O32": False, "HAS_PREFIX": merges}, launch.fwd_warps)
        yield (f"aggregation backward, merge={merges}", aggregation._dar_bwd_kernel,
               {**common, "BLOCK_S": launch.bwd_sources, "HAS_PREFIX": merges, "DQ_PER_ROW": False}, launch.bwd_warps)
    bwd, fwd = launch.merge_bwd, launch.merge_fwd
    merge_bwd = {"BLOCK_S": bwd.tile, "HEAD": head, "TAIL": tail, "PREFETCH": bwd.prefetch,
                 "FUSED_REDUCE": bwd.fused_reduce}
    yield ("merge backward", merge._merge_bwd_kernel, {**merge_bwd, "GIVEN_DOT": False}, bwd.warps)
    for stats in (False, True):  # with stats: its rows' norm statistics, in compiled steps
        yield (f"merge forward, stats={stats}", merge._merge_fwd_kernel,
               {"HEAD": head, "TAIL": tail, "PREFETCH": fwd.prefetch, "STATS": stats}, fwd.warps)
    yield ("merge backward, handed g . o (compiled steps)", merge._merge_bwd_kernel,
           {**merge_bwd, "GIVEN_DOT": True}, bwd.warps)
    wsum = DEFAULTS["weighted_sum"]
    for split in sorted({wsum.fwd_split, 2}):
        _, h, t = weighted_sums._slices(D, split)
        yield (f"weighted sum forward, split {split}", weighted_sums._wsum_fwd_kernel,
               {"BLOCK_K": 4, "BLOCK_S": 16, "HEAD": h, "TAIL": t, "SPLIT": split}, wsum.fwd_warps)
    for split in sorted({wsum.bwd_split, 2}):
        _, h, t = weighted_sums._slices(D, split)
        yield (f"weighted sum backward, split {split}", weighted_sums._wsum_bwd_kernel,
               {"BLOCK_K": 4, "HEAD": h, "TAIL": t, "SPLIT": split}, wsum.bwd_warps)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter does not compile")
    warnings.filterwarnings("ignore")
    show = "--resources" in sys.argv[1:]
    failed = []
    for label, kernel, constexprs, warps in cases():
        try:
            compiled = compile_sm90(kernel, constexprs, warps)
            print("ok    ", label, f"({resources(compiled)}, {warps} warps)" if show else "")
        except Exception as exc:  # report every kernel, then fail
            print("FAILED", label, f"{type(exc).__name__}: {str(exc)[-800:]}")
            failed.append(label)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

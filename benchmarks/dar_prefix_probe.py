"""One chunk's prefix at DiT-XL/2 b256 shapes (8 shared sources, 4 queries, 4 merges), forward and
backward, twice; then the registers and spills Triton compiled each DAR kernel with. A target for a
profiler (benchmarks/results/ncu_prefix_858fd6a.txt):

    ncu --kernel-name regex:_dar_prefix --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python benchmarks/dar_prefix_probe.py

Needs a CUDA GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routekit.kernels import dar_aggregate, dar_prefix  # noqa: E402
from routekit.kernels import dar_triton as dt  # noqa: E402

KERNELS = ("_dar_prefix_fwd_kernel", "_dar_prefix_bwd_kernel", "_dar_fwd_kernel", "_dar_bwd_kernel")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this probe needs a CUDA GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    shape = (256, 256, 1152)

    def source():
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()

    shared, own = [source() for _ in range(8)], source()
    queries = torch.randn(4, 1152, generator=gen, device="cuda").requires_grad_()
    for _ in range(2):
        mixes, lse = dar_prefix(shared, queries, kernel="triton")
        outs = [dar_aggregate([own], queries[k], kernel="triton", prefix=(mixes[k], lse[k])) for k in range(4)]
        torch.autograd.grad(outs, [*shared, queries], [torch.randn_like(o) for o in outs])
    torch.cuda.synchronize()
    for name in KERNELS:
        caches = getattr(getattr(dt, name), "device_caches", {})
        for entry in caches.values():
            for compiled in (entry[0] if isinstance(entry, tuple) else entry).values():
                md = compiled.metadata
                print(f"{name}: {compiled.n_regs} registers, {compiled.n_spills} spills, {md.num_warps} warps, "
                      f"{md.shared} B shared memory", flush=True)


if __name__ == "__main__":
    main()

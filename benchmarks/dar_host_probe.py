"""Host time of one fused DAR aggregation at batch 32 (57 sources, d=1152, bf16): how long the
host takes to issue the forward and the backward through autograd, against the wall time, then
where that host time goes: the backward's pieces timed one by one, then cProfile and torch.profiler's
CPU table. At this size the kernels take ~1.1 ms forward + backward, so the host decides the wall time.

    python benchmarks/dar_host_probe.py                    # this checkout
    ROOT=/path/to/other/checkout python benchmarks/dar_host_probe.py   # another version of routekit

Results: benchmarks/results/dar_host_probe_*.txt. Needs a CUDA GPU.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.environ.get("ROOT", str(Path(__file__).resolve().parent.parent)))

import routekit  # noqa: E402
from routekit.kernels.dar_triton import dar_aggregate_triton  # noqa: E402

S, B, N, D = 57, 32, 256, 1152


def host_and_wall_ms(fn, iters: int = 50) -> tuple[float, float]:
    """Per call: time until the host has issued ``iters`` calls, and until the GPU has run them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - start) / iters * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / iters * 1e3


def host_us(fn, iters: int = 200) -> float:
    """Host time per call, microseconds (the GPU work it queues is not waited for), after one warm-up call."""
    fn()
    return host_and_wall_ms(fn, iters)[0] * 1e3


def backward_pieces(sources, query, grad) -> None:
    """The host work of one backward, piece by piece (this checkout's private functions; skipped
    for a ROOT that lacks them)."""
    from routekit.kernels import dar_triton as dt

    if not hasattr(dt, "_table_of"):
        print("pieces: skipped (routekit without _table_of)")
        return
    launch = dt.launch_config(D, B * N).as_list()
    out, o32, lse, _ = dt._mix(sources, query, 1e-6, sources[0].dtype, False, launch, None, None)
    stacked = torch.empty((S, B, N, D), dtype=sources[0].dtype, device="cuda")
    ready = list(stacked.unbind(0))

    class Engine(torch.autograd.Function):
        """The autograd engine's share: a Function taking and giving back 58 tensors, nothing else."""

        @staticmethod
        def forward(ctx, q, *xs):
            ctx.save_for_backward(q, *xs)
            return torch.empty_like(xs[0])

        @staticmethod
        def backward(ctx, g):
            _ = ctx.saved_tensors  # unpacked, as a real backward does
            return query, *ready

    def built():
        dt._TABLES.clear()
        return dt._pointer_table(sources)

    rows = {
        "pointer table, built": built,
        "pointer table, cached": lambda: dt._pointer_table(sources),
        "gradient buffers": lambda: dt._grad_buffers(sources),
        "unbind of the stacked gradients": lambda: stacked.unbind(0),
        "backward body (_mix_backward)": lambda: dt._mix_backward(sources, query, grad, out, lse, 1e-6, launch, None),
        "engine: a Function of 58 inputs giving 58 ready gradients": lambda: torch.autograd.grad(
            Engine.apply(query, *sources), [*sources, query], grad),
    }
    for name, fn in rows.items():
        print(f"pieces: {name}: {host_us(fn):.1f} us")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this probe needs a CUDA GPU")
    print(f"routekit from {routekit.__file__}")
    gen = torch.Generator("cuda").manual_seed(0)
    sources = [torch.randn(B, N, D, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(S)]
    query = torch.randn(D, generator=gen, device="cuda").requires_grad_()
    grad = torch.randn(B, N, D, generator=gen, device="cuda", dtype=torch.bfloat16)

    def forward():
        return dar_aggregate_triton(sources, query)

    def forward_backward():
        return torch.autograd.grad(forward(), [*sources, query], grad)

    for _ in range(5):
        forward_backward()
    out = forward()
    for name, fn in [("forward", forward), ("forward+backward", forward_backward),
                     ("backward", lambda: torch.autograd.grad(out, [*sources, query], grad, retain_graph=True))]:
        host, wall = host_and_wall_ms(fn)
        print(f"{name}: host {host:.3f} ms, wall {wall:.3f} ms")
    backward_pieces(sources, query, grad)

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        forward_backward()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            forward_backward()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()

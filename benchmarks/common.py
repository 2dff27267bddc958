"""What every benchmark shares: how a step is timed, and how a result is written and labelled; and the train
step the diffusers-model benchmarks (flux.py, lumina2.py) time.

One place for both, so that every file under benchmarks/results/ is timed the same way and says the same
things: the machine it ran on, the commit (also where the tree travels without its history: RK_COMMIT),
and the exact command that reproduces it. File names stay plain (``throughput_dit_compile``), never
carrying a commit: a re-run replaces the file and git keeps the old one.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from routekit.flops import flop_counter_mode  # noqa: F401  (the benchmarks' and tests' counter)

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
# --quick smoke runs build every backbone this small (constructor overrides): a CPU trains a step in milliseconds,
# and depth 8 leaves room for the default route 2 -> depth-4
TINY = {"dit": {"depth": 8, "hidden": 32, "heads": 2, "patch": 4}, "rwkv": {"depth": 8, "hidden": 32, "patch": 4},
        "mamba": {"depth": 8, "hidden": 32, "patch": 4}}


def commit() -> str:
    """The short commit the tree is at, with " (dirty)" when tracked files differ from it. RK_COMMIT wins:
    a machine that gets the tree without its history."""
    if os.environ.get("RK_COMMIT"):
        return os.environ["RK_COMMIT"]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()
        except OSError:
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (dirty)" if git("status", "--porcelain", "--untracked-files=no") else "")


def command() -> str:
    """The command line that ran this process, as one would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def machine() -> dict:
    """Device, versions, commit, date and the exact command: every result file carries them."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": command(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def device_or_exit(quick: bool) -> str:
    """"cuda" when there is a GPU; "cpu" only for a --quick smoke run: a full-size run on a CPU would take hours
    and measure nothing anyone trains on."""
    if torch.cuda.is_available():
        return "cuda"
    if not quick:
        sys.exit("this benchmark needs a CUDA GPU; use --quick for a CPU smoke run")
    return "cpu"


def scan_kernel(backbone: str, device: str) -> str | None:
    """Which token-mixing implementation a scan backbone's train step runs on this device (said in every result)."""
    if backbone == "mamba":
        from backbones import mamba
        name = mamba.ssd_impl(device == "cuda")
        return {"kernel": "mamba-ssm Triton SSD (mamba_chunk_scan_combined)",
                "chunked": "pure-PyTorch chunked SSD (backbones/ops/ssd.py)"}.get(name, name)
    if backbone == "rwkv":
        from backbones import rwkv
        return f"WKV '{rwkv.wkv_impl(device == 'cuda')}' (backbones/ops/wkv.py)"
    return None


def free_memory() -> None:
    """Free what the models measured so far held, before the next one is built and its peak memory read.

    A model routekit rewrote sits in reference cycles (an fx graph's nodes and the graph point at each other, and
    its modules are the model's), so `del` leaves its parameters and gradients allocated until Python's cycle
    collector happens to run, and the next row's peak would count them (a DiT-XL/2 row's peak once counted the
    row before it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_ms(step: Callable[[], object], steps: int, warmup: int, cuda: bool) -> dict[str, float]:
    """Median, 90th percentile and fastest milliseconds of ``steps`` calls of ``step``, after ``warmup`` untimed
    ones, and ``step_host_ms``: the median time a call takes to return.

    On a GPU each call sits between two CUDA events, so a call is timed from its first kernel to its last,
    and a step whose host work outlasts its kernels shows up as the longer time it is. A call returns once the
    host has queued its kernels, so ``step_host_ms`` near the step time says the step waits on the host (Python and
    launches), well below it that the GPU decides. On a CPU, wall clock (``step_host_ms`` is the step time). The
    median, because one step in twenty may meet a garbage collection or another process.
    """
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    times, host = zip(*(time_step(step, cuda) for _ in range(steps)))
    return step_stats(list(times), list(host))


def time_step(step: Callable[[], object], cuda: bool) -> tuple[float, float]:
    """One call of ``step``: its milliseconds (on a GPU from its first kernel to its last; on a CPU wall clock) and
    the milliseconds the call took to return (``time_ms`` says what each tells)."""
    if not cuda:
        start = time.perf_counter()
        step()
        took = (time.perf_counter() - start) * 1e3
        return took, took
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    step()
    host = (time.perf_counter() - start) * 1e3
    end.record()
    end.synchronize()
    return begin.elapsed_time(end), host


def step_stats(times: list[float], host: list[float]) -> dict[str, float]:
    """Median, 90th percentile and fastest of step times, and the median host time (``time_ms``'s result)."""
    ordered = sorted(times)
    return {"median_ms": statistics.median(times), "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "min_ms": ordered[0], "step_host_ms": statistics.median(host)}


def kept_rows(path: Path, measured: Callable[[dict], bool]) -> list[dict]:
    """The rows of an earlier result file that this call does not measure again (``--add``), each with the
    commit it was measured at: a study too long for one process is made by several, each replacing its
    own rows."""
    if not path.exists():
        raise SystemExit(f"--add keeps the rows of {path}, which does not exist; run once without --add")
    data = json.loads(path.read_text())
    return [{"commit": data["machine"]["commit"], **r} for r in data["rows"] if not measured(r)]


def header(info: dict) -> str:
    """The markdown lines that say where and how a result was made."""
    versions = f"torch {info['torch']}" + (f", triton {info['triton']}" if "triton" in info else "")
    return (f"Machine: {info['device']}; {versions}; commit `{info['commit']}`; {info['date']}\n\n"
            f"Command: `{info['command']}`\n")


def write(name: str, info: dict, payload: dict, title: str, body: str, out: Path | None = None,
          plot: Callable[[Path], None] | None = None) -> Path:
    """Write NAME.json (``{"machine": info, **payload}``), NAME.md (title, machine and command, body) and,
    given ``plot``, NAME.png, under ``out`` (default benchmarks/results). Returns the folder."""
    out = Path(out or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"machine": info, **payload}, indent=1, default=str))
    (out / f"{name}.md").write_text(f"# {title}\n\n{header(info)}\n{body}")
    if plot is not None:
        plot(out / f"{name}.png")
    return out


@contextlib.contextmanager
def figure(path: Path, *grid: int, **subplots) -> Iterator[tuple]:
    """``(fig, axes)`` of matplotlib's ``subplots(*grid, **subplots)``, saved to ``path`` and closed on leaving:
    the file-only backend, since benchmarks run on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=130)
    finally:
        plt.close(fig)


# --- one train step of a diffusers model (forward + backward + AdamW, bf16 autocast on a GPU) ---------------


def call(model: nn.Module, args: tuple, kwargs: dict):
    out = model(*args, **kwargs)
    return out.sample if hasattr(out, "sample") else out


def step_flops(model: nn.Module, args: tuple, kwargs: dict) -> int:
    model.train()
    with flop_counter_mode() as counter, torch.autocast(args[0].device.type, torch.bfloat16,
                                                        enabled=args[0].is_cuda):
        call(model, args, kwargs).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def measure(model: nn.Module, args: tuple, kwargs: dict, mode: str, steps: int, warmup: int) -> dict:
    cuda = args[0].is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    model.train()
    runner = torch.compile(model) if mode == "compile" else model
    target = torch.randn_like(args[0])

    def step():
        with torch.autocast(args[0].device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.mse_loss(call(runner, args, kwargs).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first = time.perf_counter() - start
    timing = time_ms(step, steps, warmup, cuda)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    # AdamW's step on its own (the gradients of the last step are still there): work per parameter, the same for
    # every variant, that no route can shorten
    optimizer = time_ms(opt.step, steps, warmup, cuda)["median_ms"]
    return {"step_ms": timing["median_ms"], "p90_ms": timing["p90_ms"], "min_ms": timing["min_ms"],
            "peak_gib": peak, "first_step_s": first, "optimizer_ms": optimizer}


def attention_backends(device: str):
    """Flash or memory-efficient attention on a GPU: torch 2.11's cuDNN attention fails on FLUX's shapes in
    backward (`mha_graph.execute`), and the variants of one benchmark must run the same kernels to be compared."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]) if device == "cuda" \
        else nullcontext()

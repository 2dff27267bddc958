"""Shared by the benchmarks: where results go, what machine and commit they ran on."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def restored_env(name: str) -> Iterator[None]:
    """Leave the environment variable ``name`` as it was found (set or unset), whatever a sweep sets it to."""
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def commit(mark_dirty: bool = False) -> str:
    """The short commit the tree is at: RK_COMMIT where the tree travels without its history (a lent GPU
    machine), else git's; with ``mark_dirty``, " (dirty)" after it when files differ from it."""
    if os.environ.get("RK_COMMIT"):
        return os.environ["RK_COMMIT"]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (dirty)" if mark_dirty and git("status", "--porcelain") else "")


def device_or_exit(quick: bool) -> str:
    """"cuda" when there is a GPU; "cpu" only for a --quick smoke run, else exit saying so."""
    if torch.cuda.is_available():
        return "cuda"
    if not quick:
        sys.exit("this benchmark needs a CUDA GPU; use --quick for a CPU smoke run")
    return "cpu"


def machine() -> dict:
    """GPU, versions, commit and the exact command: every result file carries them."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": "python " + " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    tuning = {k: v for k, v in sorted(os.environ.items()) if k.startswith("ROUTEKIT_DAR_")}
    if tuning:  # kernel launch overrides change what was measured
        info["env"] = tuning
    return info


def write(name: str, payload: dict, markdown: str, out: Path | None = None) -> Path:
    """Write NAME.json and NAME.md under `out` (default benchmarks/results)."""
    out = Path(out or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / f"{name}.md").write_text(markdown)
    return out


def header(info: dict) -> str:
    return (f"Machine: {info['device']}; torch {info['torch']}" + (f", triton {info['triton']}" if "triton" in info else "")
            + f"; commit `{info['commit']}`; {info['date']}\n\nCommand: `"
            + "".join(f"{k}={v} " for k, v in info.get("env", {}).items()) + f"{info['command']}`\n")

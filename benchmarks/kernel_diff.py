"""Where one train step's time goes against another's, kernel by kernel.

    python benchmarks/kernel_diff.py benchmarks/results/throughput_dit_dar_merge_kernels_compile_c455a17.json
    python benchmarks/kernel_diff.py A.json --variant dar_static_c4 --against B.json --against-variant dar_static_c4

Reads the per-kernel GPU times that ``throughput.py --gpu-busy`` keeps in its JSON (``all_kernels``)
and prints, as markdown, the kernels whose time differs most between the two rows, routekit's own
Triton kernels apart from the rest. Inductor numbers its generated kernels per graph, so a trailing
``_<n>`` is dropped to pair the same fused kernel across two graphs.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

ROUTEKIT_KERNELS = re.compile(r"^_(dar|wsum|merge|source)_\w*kernel$")


def kernel_times(path: Path, variant: str) -> dict[str, list[float]]:
    """{kernel name without Inductor's number: [ms per step, calls per step]} of one row of a throughput JSON."""
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r["variant"] == variant]
    if not rows:
        raise SystemExit(f"{path}: no row of variant {variant!r}")
    if "all_kernels" not in rows[0]:
        raise SystemExit(f"{path}: the {variant!r} row has no per-kernel times (run throughput.py with --gpu-busy)")
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k in rows[0]["all_kernels"]:
        if k["kind"] == "kernel":
            name = re.sub(r"_\d+$", "", k["kernel"])
            times[name][0] += k["ms"]
            times[name][1] += k["calls"]
    return dict(times)


def diff(row: dict, base: dict, top: int) -> str:
    """Markdown: totals, routekit's kernels and everything else, then the ``top`` largest differences."""
    total, base_total = sum(v[0] for v in row.values()), sum(v[0] for v in base.values())
    ours = {k: v for k, v in row.items() if ROUTEKIT_KERNELS.match(k)}
    ours_ms = sum(v[0] for v in ours.values())
    lines = [f"GPU kernel time per step: **{total:.1f} ms** against {base_total:.1f} "
             f"({total - base_total:+.1f} ms, {total / base_total - 1:+.1%}); routekit's Triton kernels "
             f"{ours_ms:.1f} ms (" + ", ".join(f"`{k}` {v[0]:.1f}" for k, v in sorted(ours.items(), key=lambda x: -x[1][0]))
             + f"); everything else {total - ours_ms - base_total:+.1f} ms against the base.", "",
             "| Δ ms | ms | calls | base ms | base calls | kernel |", "|---:|---:|---:|---:|---:|---|"]
    names = sorted(set(row) | set(base), key=lambda k: -abs(row.get(k, [0, 0])[0] - base.get(k, [0, 0])[0]))
    for k in names[:top]:
        (ms, calls), (bms, bcalls) = row.get(k, [0.0, 0.0]), base.get(k, [0.0, 0.0])
        lines.append(f"| {ms - bms:+.2f} | {ms:.2f} | {calls:.0f} | {bms:.2f} | {bcalls:.0f} | `{k[:100]}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path)
    p.add_argument("--variant", default="dar_static_c4")
    p.add_argument("--against", type=Path, default=None, help="the base's file (default: the same file)")
    p.add_argument("--against-variant", default="vanilla")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    row = kernel_times(args.file, args.variant)
    base = kernel_times(args.against or args.file, args.against_variant)
    print(f"# `{args.variant}` ({args.file.name}) against `{args.against_variant}` "
          f"({(args.against or args.file).name}), kernel by kernel\n")
    print(diff(row, base, args.top))


if __name__ == "__main__":
    main()

"""One table and one bar chart across backbones, from the throughput JSON files already measured.

    python benchmarks/summarise.py           # reads benchmarks/results/throughput_*.json
    python benchmarks/summarise.py FOLDER    # reads and writes FOLDER instead

For each (backbone, size, batch, mode) with a vanilla and a routekit row it reports the measured
speed-up, the FLOP-limit speed-up and their ratio. The newest file wins when a configuration ran twice.
Writes benchmarks/results/throughput_backbones.{json,md,png}.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, figure, machine, write  # noqa: E402

NAME = "throughput_backbones"
DEFAULT_MIXER = {"dit": "attention (SDPA)", "rwkv": "WKV 'matmul' (backbones/ops/wkv.py)",
                 "mamba": "pure-PyTorch chunked SSD (backbones/ops/ssd.py)"}


def collect(results: Path = RESULTS) -> dict:
    """(backbone, size, batch, mode) -> {variant: row}, from the newest file that holds both a vanilla and a
    routekit row for it (files with DAR rows only, or vanilla only, never split a pair)."""
    groups: dict = {}
    paths = [p for p in results.glob("throughput_*.json") if p.stem != NAME]
    for path in sorted(paths, key=lambda p: json.loads(p.read_text())["machine"]["date"]):
        data = json.loads(path.read_text())
        in_file: dict = {}
        for r in data["rows"]:
            # files from before the token mixer was recorded ran the default of their day
            mixer = data["machine"].get("scan_kernels", {}).get(r["backbone"]) or DEFAULT_MIXER[r["backbone"]]
            key = (r["backbone"], r["size"], r["batch"], r["mode"])
            in_file.setdefault(key, {})[r["variant"]] = {**r, "file": path.name, "commit": data["machine"]["commit"],
                                                         "mixer": mixer}
        groups.update({k: g for k, g in in_file.items() if "vanilla" in g and "routekit" in g})
    return groups


def rows_of(groups: dict) -> list[dict]:
    """One summary row per configuration, in a stable order."""
    rows = []
    for (backbone, size, batch, mode), g in sorted(groups.items()):
        v, r = g["vanilla"], g["routekit"]
        speed = v["step_ms"] / r["step_ms"]
        rows.append({"backbone": backbone, "size": size, "batch": batch, "mode": mode, "vanilla_ms": v["step_ms"],
                     "routed_ms": r["step_ms"], "speedup": speed, "flop_limit": r["flop_limit"],
                     "of_limit": speed / r["flop_limit"], "peak_gib": [v["peak_gib"], r["peak_gib"]],
                     "mixer": r["mixer"], "file": r["file"], "commit": r["commit"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["Each row's vanilla and routekit runs come from the same process, in the file named in the last column.",
             "", "| backbone | size | batch | mode | vanilla ms | routed ms | speed-up | FLOP limit | speed-up / limit | "
             "peak GiB vanilla → routed | token mixer | file (commit) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        # rows timed interleaved (`throughput.py --interleave`) had every variant on the device: no peak of their own
        peak = "–" if math.isnan(r["peak_gib"][0]) else f"{r['peak_gib'][0]:.1f} → {r['peak_gib'][1]:.1f}"
        lines.append(f"| {r['backbone']} | {r['size']} | {r['batch']} | {r['mode']} | {r['vanilla_ms']:.1f} | "
                     f"{r['routed_ms']:.1f} | {r['speedup']:.3f}× | {r['flop_limit']:.3f}× | {r['of_limit']:.3f} | "
                     f"{peak} | {r['mixer']} | {r['file']} ({r['commit']}) |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    labels = [f"{r['backbone']} {r['size']}\nb{r['batch']} {r['mode']}" for r in rows]
    xs = range(len(rows))
    with figure(path, figsize=(max(6, 1.2 * len(rows)), 4)) as (_, ax):
        ax.bar([x - 0.2 for x in xs], [r["speedup"] for r in rows], 0.4, label="measured (routekit)")
        ax.bar([x + 0.2 for x in xs], [r["flop_limit"] for r in rows], 0.4, label="FLOP limit", color="lightgrey")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("train-step speed-up over vanilla")
        ax.set_title("TREAD default route (rate 0.5) via routekit")
        ax.legend(fontsize=8)


def main(results: Path = RESULTS) -> None:
    rows = rows_of(collect(results))
    if not rows:
        sys.exit(f"no throughput_*.json under {results} holds a vanilla and a routekit row of one configuration")
    write(NAME, machine(), {"rows": rows}, "Routed speed-up across backbones (TREAD default route, rate 0.5)",
          table(rows), results, lambda path: plot(rows, path))
    print((results / f"{NAME}.md").read_text())


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS)

"""One table and one bar chart across backbones, from the throughput JSON files already measured.

    python benchmarks/summarise.py     # reads benchmarks/results/throughput_*.json

For each (backbone, size, batch, mode) with a vanilla and a routekit row it reports the measured
speed-up, the FLOP-limit speed-up and their ratio. The newest file wins when a configuration ran twice.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MIXER = {"dit": "attention (SDPA)", "rwkv": "WKV 'matmul' (backbones/ops/wkv.py)",
                 "mamba": "pure-PyTorch chunked SSD (backbones/ops/ssd.py)"}


def collect() -> dict:
    """(backbone, size, batch, mode) -> {variant: row}, from the newest file that holds both a vanilla and a
    routekit row for it (files with DAR rows only, or vanilla only, never split a pair)."""
    groups: dict = {}
    for path in sorted(RESULTS.glob("throughput_*.json"), key=lambda p: json.loads(p.read_text())["machine"]["date"]):
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


def main() -> None:
    groups = collect()
    lines = ["# Routed speed-up across backbones (TREAD default route, rate 0.5)", "",
             "Built by `python benchmarks/summarise.py` from the files named in the last column; each row's vanilla "
             "and routekit runs come from the same process.", "",
             "| backbone | size | batch | mode | vanilla ms | routed ms | speed-up | FLOP limit | speed-up / limit | "
             "peak GiB vanilla → routed | token mixer | file (commit) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for (backbone, size, batch, mode), g in sorted(groups.items()):
        v, r = g["vanilla"], g["routekit"]
        speed = v["step_ms"] / r["step_ms"]
        lines.append(f"| {backbone} | {size} | {batch} | {mode} | {v['step_ms']:.1f} | {r['step_ms']:.1f} | {speed:.3f}× | "
                     f"{r['flop_limit']:.3f}× | {speed / r['flop_limit']:.3f} | {v['peak_gib']:.1f} → {r['peak_gib']:.1f} | "
                     f"{r['mixer']} | {r['file']} ({r['commit']}) |")
    (RESULTS / "throughput_backbones.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(groups)
    labels = [f"{b} {s}\nb{n} {m}" for b, s, n, m in keys]
    speed = [groups[k]["vanilla"]["step_ms"] / groups[k]["routekit"]["step_ms"] for k in keys]
    limit = [groups[k]["routekit"]["flop_limit"] for k in keys]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], speed, 0.4, label="measured (routekit)")
    ax.bar([x + 0.2 for x in xs], limit, 0.4, label="FLOP limit", color="lightgrey")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("train-step speed-up over vanilla")
    ax.set_title("TREAD route via routekit on an H200 (bf16)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "throughput_backbones.png", dpi=130)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

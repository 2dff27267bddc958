"""The benchmark scripts' bookkeeping: what they report is what their inputs hold."""

import json

from benchmarks import summarise


def _write(path, date, rows, scan_kernels=None):
    machine = {"date": date, "commit": path.stem, **({"scan_kernels": scan_kernels} if scan_kernels else {})}
    path.write_text(json.dumps({"machine": machine, "rows": rows}))


def _row(variant, step_ms, backbone="dit"):
    return {"backbone": backbone, "size": "XL/2", "batch": 64, "mode": "eager", "variant": variant,
            "step_ms": step_ms, "flop_limit": 1.7 if variant == "routekit" else 1.0, "peak_gib": 1.0}


def test_summary_pairs_vanilla_and_routekit_from_one_file(tmp_path, monkeypatch):
    """A newer file with only a vanilla row (e.g. a DAR run) must not split an older measured pair."""
    monkeypatch.setattr(summarise, "RESULTS", tmp_path)
    _write(tmp_path / "throughput_a.json", "2026-01-01", [_row("vanilla", 100.0), _row("routekit", 60.0)])
    _write(tmp_path / "throughput_b.json", "2026-02-01", [_row("vanilla", 90.0), _row("dar_static_c4", 120.0)])
    (group,) = summarise.collect().values()
    assert group["vanilla"]["step_ms"] == 100.0 and group["routekit"]["file"] == "throughput_a.json"
    _write(tmp_path / "throughput_c.json", "2026-03-01", [_row("vanilla", 80.0), _row("routekit", 50.0)])
    (group,) = summarise.collect().values()
    assert (group["vanilla"]["step_ms"], group["routekit"]["step_ms"]) == (80.0, 50.0)  # the newest pair wins


def test_summary_names_the_token_mixer_each_file_ran(tmp_path, monkeypatch):
    monkeypatch.setattr(summarise, "RESULTS", tmp_path)
    rows = [_row("vanilla", 100.0, "mamba"), _row("routekit", 60.0, "mamba")]
    _write(tmp_path / "throughput_old.json", "2026-01-01", rows)
    assert "chunked" in next(iter(summarise.collect().values()))["routekit"]["mixer"]
    _write(tmp_path / "throughput_new.json", "2026-02-01", rows, scan_kernels={"mamba": "mamba-ssm Triton SSD"})
    assert next(iter(summarise.collect().values()))["routekit"]["mixer"] == "mamba-ssm Triton SSD"

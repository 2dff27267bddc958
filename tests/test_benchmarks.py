"""The benchmark scripts' bookkeeping: what they report is what their inputs hold."""

import json

import pytest

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


def test_dar_schedule_counts_the_reads_of_dit_xl_and_runs_on_cpu(tmp_path):
    """518 source reads per forward one aggregation per sublayer (56 sublayers, chunks of 4), 203 two-phase
    (14 shared parts: 1 + 2 + ... + 14 = 105; own outputs 1 + 2 + 3 + 1 per chunk); the --quick run writes its
    report and the two-phase schedules (fused prefix, streamed) agree with the per-sublayer one."""
    import argparse
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks.dar_schedule import reads

    assert reads(argparse.Namespace(sublayers=56, chunk=4)) == {"per_sublayer": 518, "two_phase": 203}
    assert reads(argparse.Namespace(sublayers=3, chunk=4)) == {"per_sublayer": 2 + 3 + 4, "two_phase": 1 + 1 + 2 + 3}
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "dar_schedule.py"
    subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)], check=True, capture_output=True)
    report = json.loads((tmp_path / "dar_schedule.json").read_text())
    assert set(report["schedules"]) == {"per_sublayer", "two_phase", "streamed"}
    for schedule in ("two_phase", "streamed"):
        errors = report["agreement"][schedule]
        assert errors["outputs"] < 1e-2 and errors["worst source grad error"] < 2e-2, (schedule, errors)
    assert (tmp_path / "dar_schedule.md").exists() and (tmp_path / "dar_schedule.png").exists()


def test_stream_probe_kernels_match_torch_under_the_interpreter():
    """The go/no-go probe for a streaming prefix times its kernels only if they are right."""
    from benchmarks import dar_stream_probe

    errors = dar_stream_probe.check("cpu")
    assert set(errors) == {"mix", "lse", "dl", "dv"} and max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("given_dot", [[], ["--given-dot"]])
def test_merge_probe_checks_every_setting_against_the_generic_kernel_on_cpu(tmp_path, given_dot):
    """The merges' probe times a setting only if its gradients match the generic kernel's; --quick checks
    them all under the interpreter (a mismatch makes it exit non-zero), also handed their rows' g . o."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "dar_merge_probe.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path), *given_dot],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    rows = json.loads((tmp_path / "dar_merge_probe_quick.json").read_text())["rows"]
    assert len(rows) > 1 and all(r["max_error"] < 1e-5 for r in rows), rows


def test_kernel_diff_pairs_inductors_numbered_kernels_and_sets_routekits_apart(tmp_path):
    from benchmarks import kernel_diff

    def row(variant, kernels):
        return {"variant": variant, "all_kernels": [{"kind": "kernel", "kernel": k, "ms": ms, "calls": 1.0}
                                                    for k, ms in kernels] + [{"kind": "op", "kernel": "aten::mm",
                                                                              "ms": 99.0, "calls": 1.0}]}

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rows": [
        row("vanilla", [("triton_poi_fused_add_7", 2.0), ("gemm", 10.0)]),
        row("dar_static_c4", [("triton_poi_fused_add_31", 1.5), ("triton_poi_fused_add_32", 1.0), ("gemm", 10.0),
                              ("_merge_bwd_kernel", 3.0), ("_wsum_fwd_kernel", 1.0)])]}))
    dar, vanilla = kernel_diff.kernel_times(path, "dar_static_c4"), kernel_diff.kernel_times(path, "vanilla")
    assert dar["triton_poi_fused_add"] == [2.5, 2.0] and vanilla["triton_poi_fused_add"] == [2.0, 1.0]
    text = kernel_diff.diff(dar, vanilla, top=3)
    assert "**16.5 ms** against 12.0 (+4.5 ms, +37.5%)" in text
    assert "routekit's Triton kernels 4.0 ms" in text and "everything else +0.5 ms" in text
    assert "| +3.00 | 3.00 | 1 | 0.00 | 0 | `_merge_bwd_kernel` |" in text
    path.write_text(json.dumps({"rows": [{"variant": "vanilla"}]}))
    with pytest.raises(SystemExit, match="--gpu-busy"):
        kernel_diff.kernel_times(path, "vanilla")

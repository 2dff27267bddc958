"""The benchmarks' bookkeeping and their CPU smoke runs: each benchmark runs end to end with --quick and
writes JSON + markdown (+ PNG) that name the machine, the commit and the exact command; what a table
reports is what its inputs hold. No test here asserts a speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common, summarise

REPO = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, *args: str) -> None:
    """Run benchmarks/<script> as a user would, from the repository root; fail with its output. One OpenMP
    thread, as conftest's one_thread gives in-process tests: tiny models on a busy 2-core box run tens of times
    faster without oversubscription."""
    env = {**os.environ, "RK_COMMIT": "abc1234", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=REPO, capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def labelled(out: Path, name: str, command: str, png: bool = True) -> dict:
    """NAME.json and NAME.md exist and carry machine, commit and command (NAME.png too); the JSON."""
    data = json.loads((out / f"{name}.json").read_text())
    assert data["machine"]["commit"] == "abc1234" and data["machine"]["command"].startswith(command)
    assert data["machine"]["device"] and data["machine"]["torch"]
    text = (out / f"{name}.md").read_text()
    assert "commit `abc1234`" in text and f"Command: `{command}" in text
    assert (out / f"{name}.png").exists() == png
    return data


# ---------------------------------------------------------------- common


def test_time_ms_times_each_step_after_the_warmup(monkeypatch):
    """The median and minimum are of the timed steps alone: warm-up steps (the slow first ones) never count."""
    durations = iter([9.0, 9.0, 0.004, 0.001, 0.003, 0.002, 0.005])  # seconds: two warm-up steps, then five
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

    def step():
        clock[0] += next(durations)

    assert common.time_ms(step, steps=5, warmup=2, cuda=False) == pytest.approx({"median_ms": 3.0, "min_ms": 1.0})
    with pytest.raises(StopIteration):  # exactly 2 + 5 calls were made
        step()


def test_machine_records_the_commit_and_the_command_as_typed_from_the_repository(monkeypatch):
    monkeypatch.setenv("RK_COMMIT", "0123abc")
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "throughput.py"), "--sizes", "XL/2", "--name", "a b"])
    info = common.machine()
    assert info["commit"] == "0123abc"
    assert info["command"] == "python benchmarks/throughput.py --sizes XL/2 --name 'a b'"
    monkeypatch.delenv("RK_COMMIT")
    assert common.commit().split()[0] not in ("", "0123abc")  # git's own answer in a checkout


def test_write_puts_machine_in_the_json_and_header_in_the_markdown(tmp_path):
    info = {"date": "2026-01-01", "commit": "abc1234", "command": "python x.py", "torch": "2", "device": "CPU"}
    drawn = []
    common.write("r", info, {"rows": [1]}, "Title", "body\n", tmp_path, plot=drawn.append)
    assert json.loads((tmp_path / "r.json").read_text()) == {"machine": info, "rows": [1]}
    assert (tmp_path / "r.md").read_text().startswith("# Title\n\nMachine: CPU; torch 2; commit `abc1234`")
    assert drawn == [tmp_path / "r.png"]


# ---------------------------------------------------------------- summarise


def _write(path, date, rows, scan_kernels=None):
    machine = {"date": date, "commit": path.stem, **({"scan_kernels": scan_kernels} if scan_kernels else {})}
    path.write_text(json.dumps({"machine": machine, "rows": rows}))


def _row(variant, step_ms, backbone="dit"):
    return {"backbone": backbone, "size": "XL/2", "batch": 64, "mode": "eager", "variant": variant,
            "step_ms": step_ms, "flop_limit": 1.7 if variant == "routekit" else 1.0, "peak_gib": 1.0}


def test_summary_pairs_vanilla_and_routekit_from_one_file(tmp_path):
    """A newer file with only a vanilla row (e.g. a DAR run) must not split an older measured pair."""
    _write(tmp_path / "throughput_a.json", "2026-01-01", [_row("vanilla", 100.0), _row("routekit", 60.0)])
    _write(tmp_path / "throughput_b.json", "2026-02-01", [_row("vanilla", 90.0), _row("dar_static_c4", 120.0)])
    (group,) = summarise.collect(tmp_path).values()
    assert group["vanilla"]["step_ms"] == 100.0 and group["routekit"]["file"] == "throughput_a.json"
    _write(tmp_path / "throughput_c.json", "2026-03-01", [_row("vanilla", 80.0), _row("routekit", 50.0)])
    (group,) = summarise.collect(tmp_path).values()
    assert (group["vanilla"]["step_ms"], group["routekit"]["step_ms"]) == (80.0, 50.0)  # the newest pair wins


def test_summary_names_the_token_mixer_each_file_ran(tmp_path):
    rows = [_row("vanilla", 100.0, "mamba"), _row("routekit", 60.0, "mamba")]
    _write(tmp_path / "throughput_old.json", "2026-01-01", rows)
    assert "chunked" in next(iter(summarise.collect(tmp_path).values()))["routekit"]["mixer"]
    _write(tmp_path / "throughput_new.json", "2026-02-01", rows, scan_kernels={"mamba": "mamba-ssm Triton SSD"})
    assert next(iter(summarise.collect(tmp_path).values()))["routekit"]["mixer"] == "mamba-ssm Triton SSD"


def test_summary_writes_its_table_and_never_reads_it_back(tmp_path):
    _write(tmp_path / "throughput_a.json", "2026-01-01", [_row("vanilla", 100.0), _row("routekit", 60.0)])
    for _ in range(2):  # the second run finds throughput_backbones.json among throughput_*.json
        run_benchmark("summarise.py", str(tmp_path))
    (row,) = labelled(tmp_path, "throughput_backbones", "python benchmarks/summarise.py")["rows"]
    assert row["speedup"] == pytest.approx(100 / 60) and row["of_limit"] == pytest.approx(100 / 60 / 1.7)
    assert "| 100.0 | 60.0 | 1.667× | 1.700× | 0.980 |" in (tmp_path / "throughput_backbones.md").read_text()


# ---------------------------------------------------------------- smoke runs


def test_throughput_quick_runs_every_kind_of_variant_and_the_two_routes_agree_on_flops(tmp_path):
    """Vanilla, routekit, the hand-written route and a DAR row, on DiT and on a scan backbone (which has no
    hand-written route). routekit and the hand-written route place the same route, so their FLOPs match; DAR's
    aggregations are no matmuls, so the FLOP counter gives the routed DAR step no more than the route alone (and
    it never counts a trace's work: the program built at apply serves the benchmark's batch)."""
    run_benchmark("throughput.py", "--quick", "--backbone", "dit", "mamba", "--variants", "vanilla", "routekit",
                  "manual", "dar_tread", "--out", str(tmp_path), "--name", "t")
    rows = labelled(tmp_path, "t", "python benchmarks/throughput.py --quick")["rows"]
    found = {(r["backbone"], r["variant"]): r for r in rows}
    assert sorted(found) == sorted([("dit", v) for v in ("vanilla", "routekit", "manual", "dar_tread")]
                                   + [("mamba", v) for v in ("vanilla", "routekit", "dar_tread")])
    assert all(r["step_ms"] > 0 and r["mode"] == "eager" for r in rows)
    assert found["dit", "vanilla"]["flop_limit"] == 1.0
    assert found["dit", "routekit"]["flop_limit"] == pytest.approx(found["dit", "manual"]["flop_limit"])
    for backbone in ("dit", "mamba"):
        assert found[backbone, "dar_tread"]["flop_limit"] <= found[backbone, "routekit"]["flop_limit"]
        assert found[backbone, "routekit"]["flop_limit"] > 1.0
    assert "Token mixer (mamba)" in (tmp_path / "t.md").read_text()


def test_scaling_quick_launches_the_recipe_and_reads_its_log(tmp_path):
    run_benchmark("scaling.py", "--quick", "--out", str(tmp_path), "--name", "scaling_test",
                  "--runs", str(tmp_path / "runs"))
    (row,) = labelled(tmp_path, "scaling_test", "python benchmarks/scaling.py --quick")["rows"]
    assert row["gpus"] == 1 and row["global_batch"] == 2 and row["steps"] == 6 and row["images_per_s"] > 0


def test_convergence_quick_runs_seeds_side_by_side_and_merges_separate_commands(tmp_path):
    """Two seeds of a method run at once (--parallel), another method by a later command; the report merges
    every run made under the same settings, says which command ran each, and summarises across seeds."""
    common_args = ("--quick", "--budget-s", "0.5", "--eval-every-s", "0.25", "--out", str(tmp_path), "--runs",
                   str(tmp_path / "runs"))
    run_benchmark("convergence.py", "--methods", "tread", "--seeds", "0", "1", "--parallel", "2", *common_args)
    run_benchmark("convergence.py", "--methods", "vanilla", "--seeds", "0", *common_args)
    data = labelled(tmp_path, "convergence", "python benchmarks/convergence.py --methods vanilla --seeds 0 --quick")
    assert [(r["method"], r["seed"]) for r in data["runs"]] == [("vanilla", 0), ("tread", 0), ("tread", 1)]
    assert all(r["steps"] > 0 and r["evals"] for r in data["runs"])
    assert "--runs-only --methods tread --seeds 1" in data["runs"][2]["run"]["command"]
    summary = data["summary"]
    assert summary["target_fd"] == data["runs"][0]["evals"][-1]["fd"]  # vanilla's one seed
    tread = summary["methods"]["tread"]
    assert tread["seeds"] == [0, 1] and tread["final_fd"]["n"] == 2
    assert tread["final_fd"]["min"] <= tread["final_fd"]["mean"] <= tread["final_fd"]["max"]
    assert "| tread | 0, 1 |" in (tmp_path / "convergence.md").read_text()


def test_fsdp_check_quick_runs_the_reference_and_the_second_run_through_accelerate(tmp_path):
    """The plumbing of the GPU acceptance script on a CPU: both runs launched, their losses compared (equal here:
    accelerate has no FSDP on CPUs, so the second run is a plain process too), the table written."""
    run_benchmark("fsdp_check.py", "--quick", "--variants", "dar", "--out", str(tmp_path), "--runs", str(tmp_path / "runs"))
    (row,) = labelled(tmp_path, "fsdp_check", "python benchmarks/fsdp_check.py --quick")["rows"]
    assert row["variant"] == "dar" and len(row["reference"]["losses"]) == 3
    assert row["check"]["max_rel_loss_diff"] == 0 and row["check"]["losses_agree"]


def test_dar_kernel_quick_checks_and_times_the_kernel_on_cpu(tmp_path):
    """The Triton kernel under the interpreter against the reference, at tiny shapes."""
    run_benchmark("dar_kernel.py", "--quick", "--out", str(tmp_path))
    assert json.loads((tmp_path / "dar_kernel.json").read_text())
    assert "python benchmarks/dar_kernel.py --quick" in (tmp_path / "dar_kernel.md").read_text()


def test_flux_quick_places_the_same_route_by_hand_and_by_routekit(tmp_path):
    """A tiny FLUX: routekit's route and the hand-written one save the same FLOPs (the same blocks see the same
    number of tokens), and both run a train step."""
    run_benchmark("flux.py", "--quick", "--out", str(tmp_path))
    rows = {r["variant"]: r for r in labelled(tmp_path, "flux", "python benchmarks/flux.py --quick")["rows"]}
    assert set(rows) == {"vanilla", "routekit", "manual"} and all(r["step_ms"] > 0 for r in rows.values())
    assert rows["routekit"]["flop_limit"] == pytest.approx(rows["manual"]["flop_limit"])
    assert rows["routekit"]["flop_limit"] > 1.0

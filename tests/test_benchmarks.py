"""The benchmarks' bookkeeping and their CPU smoke runs: each benchmark runs end to end with --quick and
writes JSON + markdown (+ PNG) that name the machine, the commit and the exact command; what a table
reports is what its inputs hold. No test here asserts a speed."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import common, convergence, summarise, throughput

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.one_end  # a benchmark's plumbing (Makefile: test-latest)


def run_benchmark(script: str, *args: str) -> None:
    """Run benchmarks/<script> as a user would, from the repository root; fail with its output. On one OpenMP
    thread, as conftest sets for every test process and its children."""
    env = {**os.environ, "RK_COMMIT": "abc1234"}
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
    """The median, 90th percentile and minimum are of the timed steps alone: warm-up steps (the slow first ones)
    never count."""
    durations = iter([9.0, 9.0, 0.004, 0.001, 0.003, 0.002, 0.005])  # seconds: two warm-up steps, then five
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

    def step():
        clock[0] += next(durations)

    assert common.time_ms(step, steps=5, warmup=2, cuda=False) == pytest.approx(
        {"median_ms": 3.0, "p90_ms": 5.0, "min_ms": 1.0, "step_host_ms": 3.0})  # on a CPU the host is the step
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


def test_summary_shows_no_peak_for_rows_timed_interleaved(tmp_path):
    """An interleaved call had every variant on the device, so its rows carry no peak (NaN): a dash, not 'nan'."""
    rows = [{**_row(v, ms), "peak_gib": float("nan"), "interleaved": True} for v, ms in (("vanilla", 90), ("routekit", 60))]
    _write(tmp_path / "throughput_i.json", "2026-01-01", rows)
    _write(tmp_path / "throughput_o.json", "2025-01-01", [{**_row(v, ms), "batch": 256} for v, ms in
                                                           (("vanilla", 90), ("routekit", 60))])
    text = summarise.table(summarise.rows_of(summarise.collect(tmp_path)))
    assert "nan" not in text and "| – |" in text and "| 1.0 → 1.0 |" in text


def test_summary_writes_its_table_and_never_reads_it_back(tmp_path):
    _write(tmp_path / "throughput_a.json", "2026-01-01", [_row("vanilla", 100.0), _row("routekit", 60.0)])
    for _ in range(2):  # the second run finds throughput_backbones.json among throughput_*.json
        run_benchmark("summarise.py", str(tmp_path))
    (row,) = labelled(tmp_path, "throughput_backbones", "python benchmarks/summarise.py")["rows"]
    assert row["speedup"] == pytest.approx(100 / 60) and row["of_limit"] == pytest.approx(100 / 60 / 1.7)
    assert "| 100.0 | 60.0 | 1.667× | 1.700× | 0.980 |" in (tmp_path / "throughput_backbones.md").read_text()


# ---------------------------------------------------------------- smoke runs


def test_throughput_quick_runs_every_kind_of_variant_and_the_two_routes_agree_on_flops(tmp_path):
    """Vanilla, routekit, the hand-written route and a DAR row, on DiT and on a scan backbone (whose hand-written
    route keeps whole rows). routekit and the hand-written route place the same route, so their FLOPs match; DAR's
    aggregations are no matmuls, so the FLOP counter gives the routed DAR step no more than the route alone (and
    it never counts a trace's work: the program built at apply serves the benchmark's batch)."""
    run_benchmark("throughput.py", "--quick", "--backbone", "dit", "mamba", "--variants", "vanilla", "routekit",
                  "manual", "dar_tread", "--out", str(tmp_path), "--name", "t")
    rows = labelled(tmp_path, "t", "python benchmarks/throughput.py --quick")["rows"]
    found = {(r["backbone"], r["variant"]): r for r in rows}
    assert sorted(found) == sorted((b, v) for b in ("dit", "mamba") for v in ("vanilla", "routekit", "manual", "dar_tread"))
    assert all(r["step_ms"] > 0 and r["mode"] == "eager" for r in rows)
    assert found["dit", "vanilla"]["flop_limit"] == 1.0
    for backbone in ("dit", "mamba"):
        assert found[backbone, "routekit"]["flop_limit"] == pytest.approx(found[backbone, "manual"]["flop_limit"])
        assert found[backbone, "dar_tread"]["flop_limit"] <= found[backbone, "routekit"]["flop_limit"]
        assert found[backbone, "routekit"]["flop_limit"] > 1.0
    assert "Token mixer (mamba)" in (tmp_path / "t.md").read_text()


def test_interleaved_timing_takes_the_variants_steps_in_turn(monkeypatch):
    """--interleave: each variant compiled and warmed first, then round r times one step of each variant starting
    at variant r, so a drift of the host during the call falls on all alike; on a CPU no peak memory is reported."""
    calls = []
    monkeypatch.setattr(throughput, "prepare",
                        lambda model, *rest: (lambda: calls.append(model), {"first_step_s": 0.5}))
    monkeypatch.setattr(throughput, "time_step", lambda step, cuda: (step(), (len(calls), 1.0))[1])
    out = throughput.measure_interleaved({"a": "A", "b": "B", "c": "C"}, "dit", 2, "eager", steps=3, warmup=1,
                                         device="cpu")
    assert "".join(calls) == "ABC" + "ABC" + "BCA" + "CAB"
    # each sample is the count of calls so far: a took the 4th, 9th and 11th step, b the 5th, 7th, 12th, c 6th, 8th, 10th
    assert out["a"]["step_ms"] == 9 and out["b"]["min_ms"] == 5 and out["c"]["p90_ms"] == 10
    assert all(r["interleaved"] and r["first_step_s"] == 0.5 and r["peak_gib"] != r["peak_gib"] for r in out.values())


def test_throughput_quick_interleaved_says_so(tmp_path):
    run_benchmark("throughput.py", "--quick", "--variants", "vanilla", "routekit", "--interleave", "--out",
                  str(tmp_path), "--name", "t")
    rows = labelled(tmp_path, "t", "python benchmarks/throughput.py --quick")["rows"]
    assert [r["variant"] for r in rows] == ["vanilla", "routekit"]
    assert all(r["interleaved"] and r["step_ms"] > 0 for r in rows)
    assert "Timed interleaved (`--interleave`" in (tmp_path / "t.md").read_text()


def test_first_step_phases_split_a_compiled_step_by_torch_compiles_own_timers():
    """The first compiled step's seconds by phase come from torch.compile's timers on this torch (a renamed timer
    would read 0 and leave everything under "other"): Dynamo and AOTAutograd both take time, and the phases add
    up to the step."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="aot_eager")
    before = throughput.compile_seconds()
    start = time.perf_counter()
    compiled(torch.randn(4, 8)).sum().backward()
    first = time.perf_counter() - start
    phases = throughput.first_step_phases(before, first)
    assert phases["dynamo"] > 0 and phases["aot autograd"] > 0 and phases["inductor forward"] == 0
    assert sum(v for k, v in phases.items() if k != "kernel compile wait") == pytest.approx(first)
    torch._dynamo.reset()


def test_graph_counts_count_the_pieces_a_compiled_model_falls_into_and_why():
    """A compiled row says how many graphs Dynamo made and which breaks split them: a model that prints between
    two layers falls into two graphs with one break, named; the same model without the print is one graph."""

    class Talks(torch.nn.Module):
        def __init__(self, talk: bool):
            super().__init__()
            self.a, self.b, self.talk = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), talk

        def forward(self, x):
            x = self.a(x)
            if self.talk:
                print("", end="")
            return self.b(x)

    counts = {}
    for talk in (True, False):
        torch._dynamo.reset()
        before = throughput.graph_counts()
        torch.compile(Talks(talk), backend="eager")(torch.randn(2, 4))
        counts[talk] = throughput.graph_counts(before)
    assert counts[True]["graphs"] == 2 and counts[True]["graph_breaks"] == 1
    assert any("print" in reason for reason in counts[True]["break_reasons"])
    assert counts[False] == {"graphs": 1, "graph_breaks": 0, "break_reasons": {}}
    torch._dynamo.reset()


def test_a_compiled_row_carries_its_graph_counts_into_the_table(monkeypatch):
    """measure() on a compiled tiny DiT (aot_eager here, Inductor on the GPU) records its graphs and breaks, and
    the table prints them with the first step's phases: what a device call reads to see a model in pieces."""
    compile_ = torch.compile
    monkeypatch.setattr(throughput.torch, "compile", lambda model, **kw: compile_(model, backend="aot_eager"))
    torch._dynamo.reset()
    model = throughput.build("dit", "S/2", "routekit", "cpu", tiny=True)
    stats = throughput.measure(model, "dit", 2, "compile", steps=2, warmup=1, device="cpu")
    assert stats["graphs"] == 1 and stats["graph_breaks"] == 0 and stats["break_reasons"] == {}
    row = {"backbone": "dit", "size": "S/2", "batch": 2, "mode": "compile", "variant": "routekit", "flop_limit": 1.4,
           **stats, "graph_breaks": 2, "break_reasons": {"Data dependent operator": 2}}
    assert "; 1 graphs, 2 graph breaks; 2× 'Data dependent operator'" in throughput.table([row])
    torch._dynamo.reset()


def test_throughput_refuses_dar_in_blocks_mode_before_measuring_anything():
    """DAR inlines blocks compiled one by one, so a blocks-mode DAR row would time DAR uncompiled under a
    compiled label: refused at the command line, naming the mode that measures it."""
    done = subprocess.run([sys.executable, "benchmarks/throughput.py", "--quick", "--modes", "blocks", "--variants",
                           "vanilla", "dar_static_c4"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "DAR inlines the blocks" in done.stderr and "--modes compile" in done.stderr


def test_scaling_quick_launches_the_recipe_and_reads_its_log(tmp_path):
    run_benchmark("scaling.py", "--quick", "--out", str(tmp_path), "--name", "scaling_test",
                  "--runs", str(tmp_path / "runs"))
    (row,) = labelled(tmp_path, "scaling_test", "python benchmarks/scaling.py --quick")["rows"]
    assert row["gpus"] == 1 and row["global_batch"] == 2 and row["steps"] == 6 and row["images_per_s"] > 0


# ---------------------------------------------------------------- convergence


def convergence_main(monkeypatch, *args: str) -> None:
    """``python benchmarks/convergence.py ARGS`` in this process (a run takes a second, a new interpreter ten)."""
    monkeypatch.setenv("RK_COMMIT", "abc1234")
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "convergence.py"), *args])
    # the wall-clock guard counts from the module's import, which in a test process was minutes of other tests ago
    monkeypatch.setattr(convergence, "STARTED", time.perf_counter())
    convergence.main(list(args))


def test_convergence_next_runs_the_plan_in_order_and_the_report_says_what_is_missing(tmp_path, monkeypatch):
    """--next takes the first missing run of the fixed plan (one seed of everything first), --run a named one;
    each writes its own result file (curves, fingerprint, machine, commit, command), pins the feature classifier
    for the runs to come, and regenerates the report, which merges them and lists what is missing."""
    folders = ("--quick", "--results", str(tmp_path / "results"), "--out", str(tmp_path), "--runs", str(tmp_path / "runs"))
    convergence_main(monkeypatch, "--next", *folders)
    assert json.loads((tmp_path / "convergence.json").read_text())["missing"][0] == "dit_b2/tread/0"
    convergence_main(monkeypatch, "--run", "dit_b2/tread/1", *folders)
    data = labelled(tmp_path, "convergence", "python benchmarks/convergence.py --run dit_b2/tread/1 --quick")
    assert (data["done"], data["planned"]) == (2, 23)
    assert data["missing"][:2] == ["dit_b2/tread/0", "dit_b2/dar/0"] and "dit_b2/tread/1" not in data["missing"]
    results = tmp_path / "results"
    assert sorted(str(p.relative_to(results)) for p in results.rglob("*.json")) == [
        "dit_b2/tread_seed1.json", "dit_b2/vanilla_seed0.json"]
    assert (results / "classifier_synthetic.pt").exists()
    vanilla = json.loads((results / "dit_b2" / "vanilla_seed0.json").read_text())
    assert vanilla["machine"]["commit"] == "abc1234" and "--next" in vanilla["machine"]["command"]
    assert vanilla["evals"][-1]["step"] == vanilla["steps"] and not vanilla["out_of_time"]
    assert {"fd", "accuracy", "train_seconds", "step"} <= set(vanilla["evals"][0]) and vanilla["log"]
    code = vanilla["fingerprint"]["code"]
    assert {"recipes/train.py", "recipes/metrics.py", "backbones/dit.py"} <= set(code) and "backbones/rwkv.py" not in code
    assert {"backbones/rwkv.py", "backbones/dit.py", "backbones/ops/wkv.py", "backbones/ops/grid.py",
            "backbones/ops/__init__.py"} <= set(convergence.code_digests("rwkv"))
    text = (tmp_path / "convergence.md").read_text()
    assert "**2 of 23 planned runs exist.**" in text and "dit_b2/dar/0" in text and "TREAD on DiT-B/2" in text
    with pytest.raises(SystemExit, match="tread_seed1.json exists"):
        convergence_main(monkeypatch, "--run", "dit_b2/tread/1", *folders)


def test_convergence_samples_a_sprint_run_with_cfg_and_pdg_at_about_equal_flops(tmp_path, monkeypatch):
    """A run with a fused route samples its final EMA with path-drop guidance beside CFG: each kind at the
    recipe's steps (CFG's is the final evaluation) and at the steps whose sampling FLOPs come nearest the other's;
    an image's FLOPs are one guided evaluation's times the sampler's network calls. The report tabulates them."""
    folders = ("--quick", "--results", str(tmp_path / "results"), "--out", str(tmp_path), "--runs", str(tmp_path / "runs"))
    convergence_main(monkeypatch, "--run", "dit_b2/sprint/0", *folders)
    result = json.loads((tmp_path / "results" / "dit_b2" / "sprint_seed0.json").read_text())
    found = {(g["kind"], g["steps"]): g for g in result["guidance"]}
    steps = result["config"]["sampler"]["steps"]
    final = result["evals"][-1]
    assert found["cfg", steps]["fd"] == final["fd"] and ("pdg", steps) in found
    for g in result["guidance"]:
        assert g["sampling_flops"] == g["guided_eval_flops"] * (2 * g["steps"] - 1)  # EDM's Heun sampler
    assert found["pdg", steps]["guided_eval_flops"] < found["cfg", steps]["guided_eval_flops"]
    assert [g["sampling_flops"] for g in result["guidance"]] == sorted(g["sampling_flops"] for g in result["guidance"])
    text = (tmp_path / "convergence.md").read_text()
    assert f"| SPRINT | PDG | {steps} |" in text and f"| SPRINT | CFG | {steps} |" in text


def test_convergence_warm_up_compiles_every_stage_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """--warm takes a few steps at each of the run's rates (SPRINT's 0.75, then its fine-tune stage's 0) and leaves
    no result, report or training folder; without --run it is refused by name."""
    folders = ("--quick", "--results", str(tmp_path / "results"), "--out", str(tmp_path), "--runs", str(tmp_path / "runs"))
    convergence_main(monkeypatch, "--warm", "--run", "dit_b2/sprint/0", *folders)
    assert "6 steps over 2 rates" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        convergence_main(monkeypatch, "--warm", "--next", *folders)
    assert "--warm warms one run's compilation" in capsys.readouterr().err


def test_convergence_holds_sprint_to_its_bar_and_says_how_pdg_compares_with_cfg(tmp_path):
    """SPRINT's bar is 0.6× vanilla's seconds at every level; its guidance records become a sentence comparing
    PDG with CFG where their sampling FLOPs are nearest."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    fake_result(plan, "dit_b2/vanilla/0", [(10, 0.25, 100.0, 0.1), (20, 0.5, 1.0, 0.9)])
    fake_result(plan, "dit_b2/sprint/0", [(15, 0.25, 5.0, 0.5), (30, 0.5, 1.0, 0.95)],
                guidance=[{"kind": "pdg", "steps": 2, "fd": 2.0, "accuracy": 0.9, "sampling_flops": 3e9},
                          {"kind": "cfg", "steps": 2, "fd": 1.0, "accuracy": 0.95, "sampling_flops": 4.5e9},
                          {"kind": "pdg", "steps": 3, "fd": 0.5, "accuracy": 0.97, "sampling_flops": 5e9}])
    text = (tmp_path / "convergence.md").read_text() if convergence.report(plan) else ""
    assert "The study's bar (each level in ≤ 0.60× vanilla's seconds" in text
    assert ("PDG at 2 steps (3.00 GFLOPs an image) FD 2, higher than CFG's 1 at 2 steps (4.50 GFLOPs, 0.67× PDG's "
            "FLOPs there)") in text
    assert "PDG at 3 steps (5.00 GFLOPs an image) FD 0.5, lower than CFG's 1" in text
    assert "| SPRINT | PDG | 3 | 5.00 | 0.5 | 0.97 | 1 |" in text


def fake_result(plan, name: str, points: list[tuple], guidance: list[dict] | None = None, **fingerprint) -> None:
    """Write a result for the named run of plan as run_one would, with evaluations (step, seconds, FD) or
    (step, seconds, FD, accuracy); accuracy 0.5 where not given; `guidance`, a fused run's guidance records."""
    run = plan.find(name)
    config = convergence.run_config(run, plan)
    steps, seconds = points[-1][0], points[-1][1]
    result = {
        "run": name, "group": run.group.name, "method": run.method, "seed": run.seed, "out_of_time": False,
        "machine": {"commit": "abc1234", "command": "python x.py", "device": "CPU", "torch": "2", "date": "2026"},
        "routekit": {"commit": "abc1234", "source": fingerprint.pop("routekit", "r1")},
        "fingerprint": {**convergence.fingerprint(run, config, "CPU", None, "e1"), **fingerprint},
        "config": config.model_dump(mode="json"), "steps": steps, "train_seconds": seconds, "steps_per_s": steps / seconds,
        "first_step_seconds": 0.1, "wall_seconds": 2.0, **({"guidance": guidance} if guidance else {}),
        "evals": [{"step": step, "train_seconds": t, "fd": fd, "accuracy": accuracy[0] if accuracy else 0.5}
                  for step, t, fd, *accuracy in points]}
    path = plan.results / run.file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def evals(*points: tuple[float, float, float]) -> dict:
    """A result with evaluations at (training seconds, FD, accuracy)."""
    return {"evals": [{"train_seconds": t, "fd": fd, "accuracy": accuracy} for t, fd, accuracy in points]}


def test_seconds_to_a_level_are_read_between_the_evaluations_that_straddle_it():
    """FD is interpolated linearly in its logarithm, accuracy linearly, both linearly in training seconds, between
    the last evaluation short of the level and the first that reaches it; reaching the level exactly counts."""
    run = evals((10, 100.0, 0.1), (20, 1.0, 0.6), (30, 2.0, 0.95))
    assert convergence.seconds_to_level(run, "fd", 10.0) == pytest.approx(15.0)  # halfway in log FD
    assert convergence.seconds_to_level(run, "fd", 3.0) == pytest.approx(10 + 10 * math.log(100 / 3) / math.log(100))
    assert convergence.seconds_to_level(run, "accuracy", 0.5) == pytest.approx(18.0)
    assert convergence.seconds_to_level(run, "accuracy", 0.9) == pytest.approx(20 + 10 * 0.3 / 0.35)
    assert convergence.seconds_to_level(run, "fd", 1.0) == 20  # exactly at an evaluation
    assert convergence.seconds_to_level(run, "fd", 1.5) == pytest.approx(10 + 10 * math.log(100 / 1.5) / math.log(100))


def test_seconds_to_a_level_are_the_first_arrival_the_first_evaluation_or_none():
    """A run that rises back above a level has still reached it at its first crossing; one whose first evaluation is
    already past the level reached it no later than then (the report marks it '≤'); one that never gets there has
    no seconds, and a run that moves away from the level never reaches it either."""
    run = evals((10, 100.0, 0.1), (20, 1.0, 0.6), (30, 50.0, 0.3))
    assert convergence.seconds_to_level(run, "fd", 10.0) == pytest.approx(15.0)
    assert convergence.seconds_to_level(run, "accuracy", 0.5) == pytest.approx(18.0)
    assert convergence.seconds_to_level(run, "fd", 200.0) == 10
    assert convergence.seconds_to_level(run, "accuracy", 0.1) == 10
    assert convergence.seconds_to_level(run, "fd", 0.5) is None
    assert convergence.seconds_to_level(run, "accuracy", 0.9) is None
    assert convergence.seconds_to_level(evals((10, 5.0, 0.5), (20, 8.0, 0.4)), "fd", 3.0) is None


def test_convergence_report_times_each_level_and_compares_with_vanilla(tmp_path):
    """The findings are computed: TREAD reaches every level sooner than vanilla (two at its first evaluation,
    marked '≤'), with its share of vanilla's seconds and the study's bar at each level; DAR reaches none, which is
    said, with no ratio, and loses; the end values and equal steps stand beside them; a run on another routekit
    source is merged and named."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    fake_result(plan, "dit_b2/vanilla/0", [(10, 0.25, 100.0, 0.1), (20, 0.5, 1.0, 0.9)])
    fake_result(plan, "dit_b2/tread/0", [(15, 0.25, 5.0, 0.5), (30, 0.5, 1.0, 0.95)], routekit="r2")
    fake_result(plan, "dit_b2/dar/0", [(8, 0.25, 200.0, 0.1), (16, 0.5, 20.0, 0.3)])
    data = convergence.report(plan)
    group = data["summary"]["groups"]["dit_b2"]
    assert group["seconds"] == 0.5 and not group["early"]
    vanilla, tread, dar = (group["methods"][m]["levels"] for m in ("vanilla", "tread", "dar"))
    assert [level["name"] for level in tread] == ["FD ≤ 10", "FD ≤ 3", "accuracy ≥ 0.5", "accuracy ≥ 0.9"]
    fd3 = 0.25 + 0.25 * math.log(5 / 3) / math.log(5)  # 5 -> 1 in log FD passes 3 at this share
    vanilla_fd3, accuracy9 = 0.25 + 0.25 * math.log(100 / 3) / math.log(100), 0.25 + 0.25 * 0.4 / 0.45
    assert [level["seconds"]["mean"] for level in tread] == pytest.approx([0.25, fd3, 0.25, accuracy9])
    assert [level["ratio"] for level in tread] == pytest.approx([0.25 / 0.375, fd3 / vanilla_fd3, 0.25 / 0.375,
                                                                 accuracy9 / 0.5])
    assert [level["at_first_evaluation"] for level in tread] == [1, 0, 1, 0]
    assert all(level["ratio"] == 1.0 for level in vanilla)
    assert all(level["reached"] == 0 and level["ratio"] is None and level["later"] == 1 for level in dar)
    assert group["methods"]["tread"]["equal_steps"]["ratio"]["mean"] == pytest.approx(5 ** (2 / 3))  # at step 20
    text = (tmp_path / "convergence.md").read_text()
    assert "TREAD on DiT-B/2 wins per training second: FD ≤ 10: ≤ 0.25 s vs vanilla's 0.375 s (0.67×), sooner in 1 " \
           "of 1 seeds; FD ≤ 3: " in text and "Per step it loses" in text
    assert "met at FD ≤ 10, accuracy ≥ 0.5 only." in text
    assert "DAR on DiT-B/2 loses per training second: FD ≤ 10: not reached (0 of 1 seed) vs vanilla's 0.375 s, " \
           "sooner in 0 of 1 seeds" in text and "At 0.5 s: FD 20 vs vanilla 1, lower in 0 of 1 seed" in text
    assert "| TREAD | 0 | ≤ 0.25; 0.67× |" in text and "| DAR | 0 | not reached (0 of 1 seed) |" in text
    assert "TREAD's FD ≤ 10: ≤ 0.25 s vs vanilla's 0.375 s (0.67×)" in data["headline"]
    assert "different routekit sources" in text and "r2: dit_b2/tread_seed0.json" in text
    assert "3 of 23 planned runs exist" in text and (tmp_path / "convergence.png").exists()


def test_convergence_report_calls_a_method_a_winner_only_where_every_seed_says_so(tmp_path):
    """Seed 0 of DAR reaches every level before vanilla's seed 0, seed 1 after vanilla's seed 1 or never: the
    verdict is 'not settled', a level one seed never reaches says how many did and gives no ratio (a mean over the
    seeds that got there would flatter it); where both seeds of TREAD arrive sooner at every level, it wins."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    for seed in (0, 1):
        fake_result(plan, f"dit_b2/vanilla/{seed}", [(10, 0.25, 100.0, 0.1), (20, 0.5, 1.0, 0.9)])
        fake_result(plan, f"dit_b2/tread/{seed}", [(10, 0.25, 50.0, 0.3), (20, 0.5, 1.0, 0.95)])
    fake_result(plan, "dit_b2/dar/0", [(10, 0.25, 10.0, 0.5), (20, 0.5, 1.0, 0.95)])
    fake_result(plan, "dit_b2/dar/1", [(10, 0.25, 100.0, 0.1), (20, 0.5, 5.0, 0.6)])
    data = convergence.report(plan)
    fd3 = data["summary"]["groups"]["dit_b2"]["methods"]["dar"]["levels"][1]
    assert fd3["per_seed"] == [pytest.approx(0.25 + 0.25 * math.log(10 / 3) / math.log(10)), None]
    assert (fd3["reached"], fd3["ratio"], fd3["sooner"], fd3["later"]) == (1, None, 1, 1)
    text = (tmp_path / "convergence.md").read_text()
    assert "DAR on DiT-B/2 is not settled per training second" in text
    assert "FD ≤ 3: 0.381 s, 1 of 2 seeds vs vanilla's 0.44 (0.44–0.44) s, sooner in 1 of 2 seeds;" in text
    assert "TREAD on DiT-B/2 wins per training second" in text


def test_convergence_report_says_a_backbone_still_at_chance_shows_only_the_first_minutes(tmp_path):
    """A backbone none of whose runs ever scores above 0.2 accuracy is reported as the first minutes of training,
    in the headline, the findings and its section, with no verdict per second or per step; one run above 0.2 is
    enough for a backbone to be read as any other."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    fake_result(plan, "rwkv_b2/vanilla/0", [(10, 0.25, 1600.0, 0.1), (20, 0.5, 400.0, 0.1)])
    fake_result(plan, "rwkv_b2/tread/0", [(15, 0.25, 1400.0, 0.1), (30, 0.5, 80.0, 0.19)])
    data = convergence.report(plan)
    group = data["summary"]["groups"]["rwkv_b2"]
    assert group["early"] and group["best_accuracy"] == 0.19
    assert "every run is still at chance accuracy when it stops (best 0.19) and none reaches any level" in data["headline"]
    assert "so its figures measure only the first minutes of training" in data["headline"]
    text = (tmp_path / "convergence.md").read_text()
    assert text.count("Diffusion-RWKV B/2: only the first minutes of training. Of its runs none reaches any level") == 2
    assert "TREAD on Diffusion-RWKV B/2, first minutes only: at 0.5 s, FD 80 vs vanilla 400" in text
    assert "wins" not in text and "loses" not in text and "Per step in these minutes" in text
    fake_result(plan, "rwkv_b2/tread/0", [(15, 0.25, 1400.0, 0.1), (30, 0.5, 80.0, 0.25)])
    data = convergence.report(plan)
    assert not data["summary"]["groups"]["rwkv_b2"]["early"] and "first minutes" not in data["headline"]


def test_convergence_refuses_to_merge_runs_whose_recipe_or_training_code_differ(tmp_path):
    """Runs of one backbone made with another recipe or other training code are refused by the report, which names
    the files on each side and the part that differs (for a recipe, the fields); other backbones do not matter."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    fake_result(plan, "dit_b2/vanilla/0", [(10, 0.5, 10.0)])
    fake_result(plan, "rwkv_b2/vanilla/0", [(10, 0.5, 10.0)], evaluator="e2")  # another backbone: no conflict
    convergence.report(plan)
    run = plan.find("dit_b2/tread/0")
    config = convergence.with_overrides(convergence.run_config(run, plan), {"batch": 32})
    code = {**convergence.code_digests("dit"), "recipes/train.py": "0000"}
    fake_result(plan, "dit_b2/tread/0", [(10, 0.5, 5.0)], code=code, **convergence.recipe_digests(config))
    stored = json.loads((plan.results / run.file).read_text())
    (plan.results / run.file).write_text(json.dumps({**stored, "config": config.model_dump(mode="json")}))
    with pytest.raises(SystemExit) as refused:
        convergence.report(plan)
    message = str(refused.value)
    assert message.startswith("refusing to merge")
    assert "dit_b2: code recipes/train.py differs: dit_b2/vanilla_seed0.json (" in message
    assert "vs dit_b2/tread_seed0.json (\"0000\")" in message
    assert "dit_b2: recipe (all but routes, dar and stages) differs" in message and "[batch: 16 vs 32]" in message
    assert "rwkv_b2" not in message


def test_convergence_merges_code_declared_the_same_and_says_so(tmp_path):
    """Training code whose hash moved for an edit that leaves the numerics alone merges once same_code.json
    declares the two hashes equal with a reason; the report prints the declaration, and a malformed file is refused
    by name. Without the declaration the same runs are refused (the twin above)."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    digest = convergence.code_digests("dit")["recipes/train.py"]
    fake_result(plan, "dit_b2/vanilla/0", [(10, 0.5, 10.0)])
    fake_result(plan, "dit_b2/tread/0", [(10, 0.5, 5.0)],
                code={**convergence.code_digests("dit"), "recipes/train.py": "0000"})
    with pytest.raises(SystemExit, match="declare its hashes equal"):
        convergence.report(plan)
    same = plan.results / convergence.SAME_CODE
    same.write_text(json.dumps([{"path": "recipes/train.py", "hashes": ["0000", digest], "why": "an import moved"}]))
    data = convergence.report(plan)
    assert data["done"] == 2 and data["same_code"][0]["why"] == "an import moved"
    text = (tmp_path / "convergence.md").read_text()
    assert (f"recipes/train.py changed between runs in a way declared not to touch the numerics (an import moved): "
            f"dit_b2/vanilla_seed0.json on {digest}; the others on 0000") in text
    same.write_text(json.dumps([{"path": "recipes/train.py", "hashes": ["0000"], "why": "x"}]))
    with pytest.raises(SystemExit, match=r"same_code.json: entry 0 must be"):
        convergence.report(plan)


def test_convergence_merges_a_run_saved_before_its_config_gained_a_field(tmp_path):
    """DAR gained `regions` (off by default) after the first DAR seed ran: that run's saved recipe lacks the
    field, and so its saved method hash differs from a later seed's. Read again by today's config, the field
    takes its default and the two seeds merge; a field that truly differs is still refused (the twin above)."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    fake_result(plan, "dit_b2/vanilla/0", [(10, 0.5, 10.0)])
    fake_result(plan, "dit_b2/dar/1", [(10, 0.5, 9.0)])
    fake_result(plan, "dit_b2/dar/0", [(10, 0.5, 8.0)], method="an older hash")
    run = plan.find("dit_b2/dar/0")
    stored = json.loads((plan.results / run.file).read_text())
    assert stored["config"]["dar"].pop("regions") is False
    (plan.results / run.file).write_text(json.dumps(stored))
    assert convergence.report(plan)["done"] == 3


def test_convergence_hashes_of_the_committed_runs_hold_now_that_the_config_has_stages():
    """Every committed run read by today's config (which has ``stages``, empty by default, and ``sampler.
    guidance_kind``, written only where set) hashes as it was saved wherever its saved recipe has every field of
    today's but ``stages`` (DAR + TREAD's first seed predates DAR's ``regions``: the test above; a TREAD route
    predates ``fuse``): gaining the fields strands no run. Every vanilla run is such a run."""
    results = sorted((REPO / "benchmarks" / "results" / "convergence").glob("*/*_seed*.json"))
    assert len(results) >= 20
    for path in results:
        saved = json.loads(path.read_text())
        today = convergence.parse_config(saved["config"])
        assert today.stages == [] and today.sampler.guidance_kind == "cfg"
        if today.model_dump(mode="json", exclude={"stages"}) == saved["config"]:
            digests = convergence.recipe_digests(today)
            assert digests == {k: saved["fingerprint"][k] for k in ("recipe", "method")}, path
        else:
            assert not path.name.startswith("vanilla"), path


def test_convergence_hashes_stages_with_the_method_where_a_recipe_sets_them(tmp_path):
    """A recipe's ``stages`` belong to its method: set, they move the method's hash and leave the recipe's (which
    every run of a backbone shares), so a SPRINT run merges with vanilla's; two seeds of one method that disagree
    on them are refused, naming the field."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    config = convergence.run_config(plan.find("dit_b2/tread/0"), plan).model_dump(mode="json")
    plain = convergence.recipe_digests(convergence.parse_config(config))
    stages = [{"step": 50, "rate": 0.25}, {"step": 100, "rate": 0.0}]
    sprint = convergence.recipe_digests(convergence.parse_config({**config, "stages": stages}))
    assert sprint["recipe"] == plain["recipe"] and sprint["method"] != plain["method"]
    runs = [{"file": f"seed{seed}.json", "config": {**config, "stages": stages[:2 - seed]}} for seed in (0, 1)]
    line = convergence._recipe_conflict(runs, "method", "sprint's routes, dar and stages")
    assert convergence._recipe_conflict(runs, "recipe", "recipe") is None
    dumped = convergence.parse_config({**config, "stages": stages}).model_dump(mode="json")["stages"]
    assert line.startswith("sprint's routes, dar and stages differs: seed0.json (")
    assert line.endswith(f"[stages: {dumped!r} vs {dumped[:1]!r}]")


def test_convergence_refuses_to_train_a_planned_run_whose_recipe_does_not_exist_yet(tmp_path):
    """A method planned before its recipe exists (SPRINT's) is listed as missing with the recipe it waits for, and
    a run of it is refused by name before anything loads."""
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    run = convergence.Run(plan.groups[0], "unwritten", 0)
    with pytest.raises(SystemExit, match=r"dit_b2/unwritten/0: its recipe recipes/configs/dit_b2_unwritten.yaml does"):
        convergence.run_config(run, plan)
    plan = dataclasses.replace(plan, groups=(dataclasses.replace(plan.groups[0], methods=("vanilla", "unwritten")),))
    assert convergence.plan_table(plan, {})[3].endswith(
        "| missing (no recipe yet: recipes/configs/dit_b2_unwritten.yaml) |")


def test_convergence_report_without_runs_names_every_planned_run_as_missing(tmp_path):
    plan = convergence.study(True, tmp_path / "results", tmp_path, tmp_path / "runs")
    (tmp_path / "convergence.png").write_text("a stale picture")
    data = convergence.report(plan)
    assert (data["done"], len(data["missing"])) == (0, 23) and not (tmp_path / "convergence.png").exists()
    text = (tmp_path / "convergence.md").read_text()
    assert "**0 of 23 planned runs exist.**" in text and "No headline yet" in text and "| 1 | dit_b2/vanilla/0 |" in text


def test_fsdp_check_quick_runs_the_reference_and_the_second_run_through_accelerate(tmp_path):
    """The plumbing of the GPU acceptance script on a CPU: both runs launched, their losses compared (equal here:
    accelerate has no FSDP on CPUs, so the second run is a plain process too), the table written."""
    run_benchmark("fsdp_check.py", "--quick", "--variants", "dar", "--out", str(tmp_path), "--runs", str(tmp_path / "runs"))
    (row,) = labelled(tmp_path, "fsdp_check", "python benchmarks/fsdp_check.py --quick")["rows"]
    assert row["variant"] == "dar" and len(row["reference"]["losses"]) == 3
    assert row["check"]["max_rel_loss_diff"] == 0 and row["check"]["losses_agree"]


def test_dar_kernel_quick_checks_and_times_the_kernel_on_cpu(tmp_path):
    """The Triton kernel under the interpreter against the reference, at tiny shapes."""
    pytest.importorskip("triton")
    from triton_interpreter import problem

    if problem():
        pytest.skip(problem())
    run_benchmark("dar_kernel.py", "--quick", "--out", str(tmp_path))
    assert json.loads((tmp_path / "dar_kernel.json").read_text())
    assert "python benchmarks/dar_kernel.py --quick" in (tmp_path / "dar_kernel.md").read_text()


def test_throughput_add_keeps_the_rows_of_configurations_another_call_measured(tmp_path):
    """A study too long for one device call: the second call (--add) measures another backbone and keeps the
    first call's rows, each row saying its commit; measuring a variant of a configuration again replaces its row,
    and another variant joins them."""
    run_benchmark("throughput.py", "--quick", "--variants", "vanilla", "--out", str(tmp_path), "--name", "t")
    run_benchmark("throughput.py", "--quick", "--backbone", "rwkv", "--variants", "vanilla", "--add",
                  "--out", str(tmp_path), "--name", "t")
    rows = labelled(tmp_path, "t", "python benchmarks/throughput.py --quick")["rows"]
    assert [(r["backbone"], r["commit"]) for r in rows] == [("dit", "abc1234"), ("rwkv", "abc1234")]
    assert "| commit |" in (tmp_path / "t.md").read_text()
    run_benchmark("throughput.py", "--quick", "--backbone", "rwkv", "--variants", "vanilla", "--add",
                  "--out", str(tmp_path), "--name", "t")
    assert [r["backbone"] for r in json.loads((tmp_path / "t.json").read_text())["rows"]] == ["dit", "rwkv"]
    # another variant of a measured configuration joins its rows instead of replacing them (a hand-written route
    # added to a finished study once dropped the vanilla row its speed-up is read against)
    run_benchmark("throughput.py", "--quick", "--backbone", "rwkv", "--variants", "routekit", "--add",
                  "--out", str(tmp_path), "--name", "t")
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [(r["backbone"], r["variant"]) for r in rows] == [("dit", "vanilla"), ("rwkv", "vanilla"),
                                                             ("rwkv", "routekit")]
    assert "nan×" not in (tmp_path / "t.md").read_text()  # routekit's speed-up is read against the kept vanilla


def test_throughput_table_leaves_a_row_without_its_vanilla_blank_not_nan():
    """A configuration measured without vanilla has no speed-up to show: its cells are empty, not 'nan×'."""
    from benchmarks.throughput import table

    row = {"backbone": "dit", "size": "B/2", "batch": 16, "mode": "graphs", "variant": "manual", "step_ms": 9.45,
           "p90_ms": 11.07, "flop_limit": 1.428, "peak_gib": 2.78}
    line = next(text for text in table([row]).splitlines() if "| manual |" in text)
    assert "nan" not in line and "| 9.45 | 11.07 |  |  | 1.428× |  | 2.78 |" in line
    # a GPU row also says how long the step took to return, against the step: the host's share
    assert "dit B/2 b16 graphs manual: 3.0 ms of a" in table([{**row, "step_host_ms": 3.0}])
    assert "Host time per step" not in table([row])


def test_flux_quick_places_the_same_cross_stack_route_by_hand_and_by_routekit(tmp_path):
    """A tiny FLUX: routekit's route across both stacks and the hand-written one save the same FLOPs (the same
    blocks see the same number of tokens), routekit selects per sample as the hand-written route does (the
    attention takes a RoPE table per sample), every variant runs a train step, and routekit's host time is
    reported. A second call with --add measures SPRINT's route beside a new vanilla, and keeps the rows of the
    variants it did not measure."""
    run_benchmark("flux.py", "--quick", "--out", str(tmp_path))
    data = labelled(tmp_path, "flux", "python benchmarks/flux.py --quick")
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"vanilla", "routekit single stack", "routekit across stacks", "hand-written across stacks"}
    assert all(r["step_ms"] > 0 and r["p90_ms"] >= r["step_ms"] for r in rows.values())
    assert rows["routekit across stacks"]["flop_limit"] == pytest.approx(rows["hand-written across stacks"]["flop_limit"])
    assert rows["routekit across stacks"]["flop_limit"] > rows["routekit single stack"]["flop_limit"] > 1.0
    assert data["shared"] == {"routekit single stack": False, "routekit across stacks": False}
    assert rows["routekit across stacks"]["host_ms"] > 0
    assert all(r["optimizer_ms"] > 0 for r in rows.values()) and "AdamW aside |" in (tmp_path / "flux.md").read_text()
    sprint = "routekit SPRINT across stacks"
    run_benchmark("flux.py", "--quick", "--variants", "vanilla", sprint, "--add", "--out", str(tmp_path))
    added = {r["variant"]: r for r in json.loads((tmp_path / "flux.json").read_text())["rows"]}
    assert set(added) == {*rows, sprint} and added["hand-written across stacks"] == rows["hand-written across stacks"]
    assert added["vanilla"] != rows["vanilla"] and added[sprint]["flop_limit"] > rows["routekit across stacks"]["flop_limit"]
    text = (tmp_path / "flux.md").read_text()
    assert all(r["commit"] for r in added.values()) and "| commit |" in text
    assert f"| 2 | eager | {sprint} |" in text and "SPRINT's: 2 → -2 at rate 0.75, fused" in text
    refused = subprocess.run([sys.executable, "benchmarks/flux.py", "--quick", "--variants", sprint, "--out",
                              str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "--variants must include vanilla" in refused.stderr  # its speed-ups' base


def test_lumina2_quick_routes_captions_of_different_lengths_in_boundary_mode(tmp_path):
    """A tiny Lumina2 with captions of different lengths per sample: routekit places the route at the block calls
    (its layout is read off the caption mask's values), the route saves FLOPs, and both variants run a train
    step at batch 1 (one caption: the blocks take no mask) and at batch 2 twice, with two caption lengths (the
    blocks take a mask) and with one (they take none)."""
    run_benchmark("lumina2.py", "--quick", "--batches", "1", "2", "--out", str(tmp_path))
    data = labelled(tmp_path, "lumina2", "python benchmarks/lumina2.py --quick --batches 1 2")
    rows = {(r["batch"], r["captions"], r["variant"]): r for r in data["rows"]}
    cases = [(1, "one length"), (2, "one length"), (2, "different")]
    assert list(rows) == [(*case, v) for case in cases for v in ("vanilla", "routekit")]
    assert all(r["mode"] == "boundary" and r["step_ms"] > 0 and r["p90_ms"] >= r["step_ms"] for r in rows.values())
    assert all(rows[(*case, "vanilla")]["tokens"] == 8 + 64 for case in cases)
    assert all(rows[(*case, "routekit")]["flop_limit"] > 1.0 for case in cases)


def test_gpu_busy_reports_where_the_host_spends_a_step_as_well_as_the_kernels(monkeypatch):
    """A step that waits on the host is read from the host rows: each operator's own host time per step. On a
    CPU there are no kernels, so the GPU time is zero and only host rows come back."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    x = torch.randn(32, 32, requires_grad=True)
    busy, rows = throughput.gpu_busy_ms(lambda: (x @ x).sum().backward(), steps=2)
    host = {r["kernel"]: r for r in rows if r["kind"] == "host"}
    assert busy == 0 and not [r for r in rows if r["kind"] == "kernel"]
    assert host["aten::mm"]["calls"] == 3 and host["aten::mm"]["ms"] > 0  # x @ x forward, two in its backward


def test_free_memory_releases_a_routed_model_that_del_alone_leaves_allocated():
    """A routed model sits in reference cycles (its fx graphs' nodes and graphs point at each other), so `del`
    leaves the model's weights allocated until the cycle collector runs, and the next variant's peak memory read
    them too. With the automatic collector off, free_memory frees both an unrouted DiT (which `del` alone frees)
    and a routed one (which it does not)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        freed = {}
        for variant in ("vanilla", "routekit"):
            model = throughput.build("dit", "S/2", variant, "cpu", tiny=True)
            weight = weakref.ref(next(model.parameters()))
            del model
            freed[variant] = weight() is None
            common.free_memory()
            assert weight() is None, f"{variant}: free_memory left the model's weights allocated"
    finally:
        gc.enable()
    assert freed["vanilla"] and not freed["routekit"], f"which models `del` alone freed: {freed}"

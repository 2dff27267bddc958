"""Convergence per training second, seeded, across backbones: does routing's speed-up survive training?

The study is a fixed plan of runs. DiT-B/2 on MNIST-5k with vanilla, TREAD, DAR, DAR + TREAD and SPRINT, three
seeds, 420 training seconds each; Diffusion-RWKV B/2 and DiM (Mamba-2) B/2 with vanilla and TREAD, two seeds, 360 s
each. One run (backbone, method, seed) is one process of at most 9 minutes on one GPU (`--wall-s`), its start,
first step (torch.compile's compilation) and evaluations included, so the study grows one run at a time. Every
run trains a shipped recipe (recipes/configs/<backbone>_<method>.yaml) for the same number of training seconds
(evaluation and the first step are not counted) with the same data order per seed, and is scored on its EMA
weights every budget_s / evals training seconds: Fréchet distance in the features of a small MNIST classifier
(lower is better) and that classifier's accuracy on class-conditional samples.

    python -m benchmarks.convergence --list                 # the plan: each run, its training seconds, whether it exists
    python -m benchmarks.convergence --next                 # train the first missing run, then the report
    python -m benchmarks.convergence --run dit_b2/tread/0   # a named run (two GPUs: one process each, with
                                                            # CUDA_VISIBLE_DEVICES=0 and =1), then the report
    python -m benchmarks.convergence --report               # merge the results that exist; name what is missing
    python -m benchmarks.convergence --quick --next         # the same plan shrunk: tiny models, synthetic data,
                                                            # half a second of training each, on a CPU

The report reads each run by the training seconds it takes to reach fixed quality levels (LEVELS: FD 10 and 3,
accuracy 0.5 and 0.9) where the curves fall steeply, and each method's share of vanilla's seconds there; the
values at the end stand beside them, but by then DiT-B/2's curves lie on the data set's floor, where seeds differ by
more than methods do. A backbone whose runs never leave chance accuracy is reported as the first minutes of
training, not as a result.

A GPU machine without internet needs what `make gpu-carry` gathers (.whl/ and .cache/: carry both). A run writes
benchmarks/results/convergence/<backbone>/<method>_seed<seed>.json (commit it as soon as it exists: the report
merges results made at different times) and the report benchmarks/results/convergence.{md,json,png}. Its
training folder (logs, no checkpoints) goes under runs/convergence/. ``--quick`` keeps everything under
runs/convergence_quick/. ``--results DIR`` reads and writes the runs in another folder (a scratch copy of the
committed ones) and ``--out DIR`` the report.

A DAR + TREAD run's first step compiles for 81-91 s on a fresh machine, which leaves its 420 training seconds a
few seconds short of the wall-clock guard. With Inductor's cache warm (a few steps of the same run into a
scratch folder first: ``--run NAME --wall-s 160 --results /tmp/w --out /tmp/wout``) the first step takes 24 s.
The seed does not change what is compiled.

What a result's fingerprint holds, and why. Runs made on different commits merge only where what they
measure is the same, so every result carries a fingerprint, and the report (and a new run, before it trains)
refuses runs of one backbone that disagree in any part of it, naming the files and the part:

- ``recipe`` and ``method``: hashes of the resolved TrainConfig (its dump, less the seed and the cache folder):
  ``recipe`` of all but routes, dar and stages, the same for every run of a backbone (what vanilla and TREAD
  share), ``method`` of routes, dar and stages, the same for every seed of a method; the message names the
  differing fields. A field the config gains later (``stages``) is hashed only where a recipe sets it, so the
  runs made before it keep their hashes;
- ``code``: a hash of each file the training numerics come from: recipes/*.py (the training loop, objective,
  data order, sampler and metrics) and the backbone's module with the backbones/ modules it imports. A byte
  hash also moves for an edit that leaves the numerics alone (an import moved); ``same_code.json`` beside the
  results declares such hashes equal, each with its reason, and the report prints every one it applied;
- ``schedule``: the budget of training seconds and the evaluation interval;
- ``device`` and ``token_mixer``: seconds are only comparable on one GPU model, and a scan backbone's speed
  depends on which scan implementation ran (mamba-ssm's Triton kernel or the PyTorch fallback);
- ``evaluator``: a hash of the feature classifier's weights. Training it again on another machine does not give
  bit-identical weights, so the first run of a plan pins its classifier next to the results
  (``classifier_<dataset>.pt``, committed with them) and every later run scores with that file.

routekit itself (routekit/**/*.py) is not in the fingerprint: it changes almost daily in ways that leave a
route's numerics alone (messages, verify, sharding, docs), and each change would otherwise strand every run
made before it; the route's numerics are held to a reference by the test suite instead. Each result records
routekit's commit and a hash of its source (``routekit``), and the report lists the runs that were made on
different routekit sources, so a reader can see it. torch's version is recorded and reported the same way.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import importlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()  # the wall-clock guard counts from here: before torch's import, seconds long

import numpy as np  # noqa: E402
import torch  # noqa: E402

if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, RESULTS, TINY, figure, machine, scan_kernel, write  # noqa: E402
from recipes.config import TrainConfig, differences, load_config, parse_config, with_overrides  # noqa: E402

# SPRINT: a route with a fused end at rate 0.75 (recipes/configs/dit_b2_sprint.yaml); planned before its recipe
# exists, so --list and the report name its runs as missing until they are made
METHODS = ("vanilla", "tread", "dar", "dar_tread", "sprint")
LABELS = {"vanilla": "vanilla", "tread": "TREAD", "dar": "DAR", "dar_tread": "DAR + TREAD", "sprint": "SPRINT"}
# A run's wall-clock limit: 570 s, not 540, as DAR's first (compiling) step takes ~70 s against vanilla's ~40,
# and at 540 its run stopped at 401 of its 420 training seconds.
WALL_S = 570.0
REPORT_S = 10.0  # wall seconds kept after the final evaluation for the result and the report
# wall seconds kept, in a run with a fused route, for sampling its final EMA three more ways (compare_guidance): as
# long as about four evaluations with the recipe's CFG (DiT-B/2's take 4-7 s on an H200)
GUIDANCE_S = 30.0
SAME_CODE = "same_code.json"  # beside the results: code hashes declared equal (load_same_code)


@dataclass(frozen=True)
class Group:
    """One backbone's part of the study: every method and seed of it trains the same budget with the same
    evaluations. ``startup_s`` (process start to the end of the first step: imports, data, model, compilation)
    and ``eval_s`` (one evaluation) are wall seconds on an H200 (see FULL_GROUPS); they give each run's planned
    wall time, which must stay under WALL_S."""

    name: str  # the result folder, and the recipes' prefix: recipes/configs/<name>_<method>.yaml
    title: str
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    budget_s: float  # training seconds per run
    evals: int  # evaluations per run, every budget_s / evals training seconds; the last at the end
    startup_s: float
    eval_s: float

    @property
    def backbone(self) -> str:
        return self.name.split("_")[0]

    @property
    def eval_every_s(self) -> float:
        return self.budget_s / self.evals

    @property
    def planned_wall_s(self) -> float:
        return self.startup_s + self.budget_s + self.evals * self.eval_s


@dataclass(frozen=True)
class Run:
    """One (backbone, method, seed): one process, one result file."""

    group: Group
    method: str
    seed: int

    @property
    def name(self) -> str:
        """How --run names it: ``dit_b2/tread/0``."""
        return f"{self.group.name}/{self.method}/{self.seed}"

    @property
    def file(self) -> Path:
        """Its result, relative to the results folder: ``dit_b2/tread_seed0.json``."""
        return Path(self.group.name) / f"{self.method}_seed{self.seed}.json"

    @property
    def recipe(self) -> Path:
        """The shipped recipe it trains: ``recipes/configs/dit_b2_tread.yaml``."""
        return REPO / "recipes" / "configs" / f"{self.group.name}_{self.method}.yaml"


@dataclass(frozen=True)
class Study:
    """A plan of runs and where its files go. Runs go in a fixed order (seed, then backbone, then method), so
    every ``--next`` takes the same next run, and one seed of everything comes first."""

    name: str  # the report's file name
    groups: tuple[Group, ...]
    overrides: dict[str, Any]  # on every recipe of the study, after the benchmark's own
    quick: bool
    results: Path  # result files and the pinned classifier
    out: Path  # the report
    runs_dir: Path  # training folders

    def runs(self) -> list[Run]:
        seeds = sorted({seed for group in self.groups for seed in group.seeds})
        return [Run(group, method, seed) for seed in seeds for group in self.groups if seed in group.seeds
                for method in group.methods]

    def find(self, name: str) -> Run:
        """The run ``--run`` names, or SystemExit listing the valid names."""
        for run in self.runs():
            if run.name == name:
                return run
        raise SystemExit(f"--run {name!r} is not in the plan; valid names (backbone/method/seed): "
                         + ", ".join(run.name for run in self.runs()))


# startup_s and eval_s plan a run's wall time. DiT-B/2's are measured (four H200 runs, seed 0): first steps of 38
# (vanilla), 57 (TREAD), 69 (DAR) and 88 s (DAR + TREAD), evaluations of 4-7 s; the DAR runs' slower first step
# makes the guard stop them 9-19 s short of 420, and the report compares at the second every run reached. RWKV's
# and Mamba's are estimates from the H200 step times in benchmarks/results/throughput_*.md (an evaluation is 35
# eager forward calls on 250 images, doubled by guidance): correct them from their first runs' result files.
FULL_GROUPS = (
    Group("dit_b2", "DiT-B/2", METHODS, (0, 1, 2), budget_s=420.0, evals=7, startup_s=90.0, eval_s=3.0),
    Group("rwkv_b2", "Diffusion-RWKV B/2", ("vanilla", "tread"), (0, 1), budget_s=360.0, evals=6,
          startup_s=20.0, eval_s=11.0),
    Group("mamba_b2", "DiM (Mamba-2) B/2", ("vanilla", "tread"), (0, 1), budget_s=360.0, evals=6,
          startup_s=60.0, eval_s=14.0),
)
# On every recipe of the study: a loss record (and a budget and deadline check) every 10 steps, not 50, as a scan
# backbone's step takes up to 0.6 s and checks 30 s apart would overshoot the budget and the evaluation times by
# as much; and 250 samples per evaluation, not 500, which halves its cost, so that the first compilation, 420 s
# of training and seven evaluations fit 9 minutes (the same samples, labels and noise for every method).
FULL_OVERRIDES: dict[str, Any] = {"log_every": 10, "eval.samples": 250}
# --quick: the same plan with models and a schedule that finish in a second on a laptop CPU
QUICK_OVERRIDES: dict[str, Any] = {
    "data.name": "synthetic", "batch": 16, "eval.samples": 50, "sampler.steps": 2, "ema.decay": 0.9,
    "optimiser.lr": 1e-3, "optimiser.warmup_steps": 0, "bf16": False, "compile": False, "log_every": 5,
}
QUICK_GROUP = {"budget_s": 0.5, "evals": 2, "startup_s": 2.0, "eval_s": 0.2}


def study(quick: bool, results: Path | None = None, out: Path | None = None, runs_dir: Path | None = None) -> Study:
    """The plan (``quick``: shrunk to seconds on a CPU), with its folders (defaults as the module says)."""
    if quick:
        base = REPO / "runs" / "convergence_quick"
        groups = tuple(dataclasses.replace(group, **QUICK_GROUP) for group in FULL_GROUPS)
        return Study("convergence", groups, QUICK_OVERRIDES, True, results or base / "results", out or base,
                     runs_dir or base / "runs")
    return Study("convergence", FULL_GROUPS, FULL_OVERRIDES, False, results or RESULTS / "convergence",
                 out or RESULTS, runs_dir or REPO / "runs" / "convergence")


def run_config(run: Run, plan: Study) -> TrainConfig:
    """The shipped recipe for the run's method with its seed; the benchmark schedules the evaluations, so every
    periodic side job is off, and the step count is out of reach (the budget ends training). A run planned before
    its recipe exists (SPRINT's) is refused by name, before anything is loaded."""
    if not run.recipe.exists():
        raise SystemExit(f"{run.name}: its recipe {run.recipe.relative_to(REPO)} does not exist yet; the plan lists "
                         "the run, which cannot train until the recipe is added")
    config = load_config(run.recipe)
    overrides: dict[str, Any] = {"steps": 10_000_000, "eval.every": 0, "sample.every": 0, "checkpoint.every": 0,
                                 "checkpoint.final": False, "seed": run.seed, **plan.overrides}
    if plan.quick:  # tiny widths at the size's depth, so the recipes' routes fit
        depth = importlib.import_module(f"backbones.{config.model.backbone}").SIZES[config.model.size]["depth"]
        overrides["model.overrides"] = {**config.model.overrides, **TINY[config.model.backbone], "depth": depth}
        overrides["data.cache_dir"] = str(plan.runs_dir / "cache")
    return with_overrides(config, overrides)


# ---------------------------------------------------------------- fingerprint


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


METHOD_FIELDS = ("routes", "dar", "stages")  # what a method changes in a recipe (stages: SPRINT's rates by step or second)
# Fields TrainConfig gained after runs were made: hashed only where a recipe sets them (not at their default), so
# the dump, and so both hashes, of every run made before a field existed stay what they were; a config without
# the field at all hashes the same way.
LATER_FIELDS = ("stages",)
UNCOMPARED = ("seed", "data.cache_dir")  # what differs between seeds, or says only where files live


def recipe_digests(config: TrainConfig) -> dict[str, str]:
    """Hashes of the resolved recipe: ``recipe``, all but the method's fields (the same for every run of a
    backbone), and ``method``, the method's fields (the same for every seed of a method)."""
    data = config.model_dump(mode="json")
    del data["seed"], data["data"]["cache_dir"]
    for key in LATER_FIELDS:
        data.pop(key, None)
    data.update(config.model_dump(mode="json", include=set(LATER_FIELDS), exclude_defaults=True))
    method = {key: data.pop(key) for key in METHOD_FIELDS if key in data}
    return {"recipe": _sha(json.dumps(data, sort_keys=True).encode()),
            "method": _sha(json.dumps(method, sort_keys=True).encode())}


def _imported_files(path: Path, package: str) -> set[Path]:
    """The modules of ``package`` (a top-level folder of the repo) that the file at path imports, relative or
    absolute, with the __init__.py of each package on their way."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
            elif (node.module or "").split(".")[0] == package:
                base = REPO
            else:
                continue
            stem = base.joinpath(*(node.module or "").split(".")) if node.module else base
            found |= {stem / alias.name for alias in node.names} | {stem}
        elif isinstance(node, ast.Import):
            found |= {REPO.joinpath(*alias.name.split(".")) for alias in node.names
                      if alias.name.split(".")[0] == package}
    files = set()
    for stem in found:
        for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
            if candidate.is_file():
                files.add(candidate)
    for file in list(files):  # the package __init__ files that run before the module
        folder = file.parent
        while folder != REPO:
            if (folder / "__init__.py").is_file():
                files.add(folder / "__init__.py")
            folder = folder.parent
    return files


def source_files(backbone: str) -> list[Path]:
    """The files a run's numerics come from: recipes/*.py, and backbones/<backbone>.py with every backbones/
    module it imports, transitively (RWKV and Mamba build on dit.py and ops/)."""
    todo = [REPO / "backbones" / f"{backbone}.py", REPO / "backbones" / "__init__.py"]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += sorted(_imported_files(path, "backbones") - seen)
    return sorted(REPO.glob("recipes/*.py")) + sorted(seen)


def code_digests(backbone: str) -> dict[str, str]:
    return {str(path.relative_to(REPO)): _sha(path.read_bytes()) for path in source_files(backbone)}


def routekit_digest() -> str:
    """A hash of routekit's Python source: recorded beside each result, never compared (see the module doc)."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "routekit").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(run: Run, config: TrainConfig, device: str, token_mixer: str | None, evaluator: str) -> dict:
    """What must agree between runs that one report compares (the module doc says why each part)."""
    return {**recipe_digests(config), "code": code_digests(run.group.backbone),
            "schedule": {"budget_s": run.group.budget_s, "eval_every_s": run.group.eval_every_s},
            "device": device, "token_mixer": token_mixer or "-", "evaluator": evaluator}


GROUP_PARTS = {  # the same for every run of a backbone, as are the recipe and the code; what to do when they differ
    "schedule": "make every run of a backbone with one plan (FULL_GROUPS)",
    "device": "make every run on one GPU model: seconds on another are not comparable",
    "token_mixer": "make every run with the same scan implementation (install mamba-ssm where the others had it)",
    "evaluator": "score every run with the pinned classifier_<dataset>.pt: commit it with the first result, "
                 "and keep it in the results folder that travels to the GPU machine",
}


def _sides(results: list[dict], key: Callable[[dict], Any]) -> dict[str, list[str]]:
    """The results' files grouped by the JSON of key(result)."""
    sides: dict[str, list[str]] = {}
    for result in results:
        sides.setdefault(json.dumps(key(result), sort_keys=True), []).append(result["file"])
    return sides


def _describe(part: str, sides: dict[str, list[str]]) -> str:
    shown = " vs ".join(f"{', '.join(files)} ({value})" for value, files in sides.items())
    return f"{part} differs: {shown}"


def _recipe_conflict(runs: list[dict], part: str, what: str) -> str | None:
    """The line for runs that disagree on a recipe part, naming the fields of the first two sides that differ.
    Each run's recipe is read again by today's config (`parse_config`), not compared by the hash it was saved
    with: a field the config gained since (DAR's `regions`) takes its default, which is what the run did (a new
    option is off by default), so the runs made before it still merge with those made after."""
    sides = _sides(runs, lambda r: recipe_digests(parse_config(r["config"]))[part])
    if len(sides) < 2:
        return None
    first, other = (next(r for r in runs if r["file"] == files[0]) for files in list(sides.values())[:2])
    fields = differences(parse_config(first["config"]), parse_config(other["config"]))
    wanted = [k for k in fields if not k.startswith(UNCOMPARED)
              and (k.split(".")[0] in METHOD_FIELDS) == (part == "method")]
    named = ", ".join(f"{k}: {fields[k][0]!r} vs {fields[k][1]!r}" for k in wanted)
    return _describe(what, sides) + (f" [{named}]" if named else "")


def load_same_code(plan: Study) -> list[dict]:
    """The code hashes declared equal (``same_code.json`` beside the results): each entry names a file, two or
    more hashes of it, and why the change between them leaves the training numerics alone (a moved import, a
    comment). A byte hash cannot tell a refactor from a change of numerics; this file is where a person says
    which it was, in the open, rather than every such edit stranding the runs made before it."""
    path = plan.results / SAME_CODE
    if not path.exists():
        return []
    entries = json.loads(path.read_text())
    form = '{"path": FILE, "hashes": [HASH, HASH, ...], "why": REASON}'
    if not isinstance(entries, list):
        raise SystemExit(f"{path} must hold a list of entries {form}, got {entries!r:.200}")
    for i, entry in enumerate(entries):
        hashes = entry.get("hashes") if isinstance(entry, dict) else None
        if not (isinstance(hashes, list) and len(hashes) >= 2 and all(isinstance(h, str) for h in hashes)
                and isinstance(entry.get("path"), str) and isinstance(entry.get("why"), str) and entry["why"].strip()):
            raise SystemExit(f"{path}: entry {i} must be {form}, got {entry!r}")
    return entries


def _canonical_code(code: dict[str, str], same_code: list[dict]) -> dict[str, str]:
    """`code` with each hash replaced by the first of its declared-equal group."""
    first = {(e["path"], h): e["hashes"][0] for e in same_code for h in e["hashes"]}
    return {path: first.get((path, digest), digest) for path, digest in code.items()}


def _listed(names: Iterable[str]) -> str:
    """``a, b and c``."""
    *rest, last = names
    return f"{', '.join(rest)} and {last}" if rest else last


def conflicts(results: list[dict], same_code: list[dict] = ()) -> list[str]:
    """One line per fingerprint part on which runs of one backbone disagree, naming the files on each side, and
    for a recipe the fields; code hashes declared equal in ``same_code`` agree. Empty when they may be merged."""
    lines = []
    for group in dict.fromkeys(r["group"] for r in results):
        runs = [r for r in results if r["group"] == group]
        line = _recipe_conflict(runs, "recipe", f"recipe (all but {_listed(METHOD_FIELDS)})")
        if line:
            lines.append(f"{group}: {line}")
        for part, fix in GROUP_PARTS.items():
            sides = _sides(runs, lambda r, part=part: r["fingerprint"][part])
            if len(sides) > 1:
                lines.append(f"{group}: " + _describe(part, sides) + f" ({fix})")
        code = {r["file"]: _canonical_code(r["fingerprint"]["code"], same_code) for r in runs}
        for path in sorted({p for digests in code.values() for p in digests}):
            sides = _sides(runs, lambda r, path=path, code=code: code[r["file"]].get(path, "absent"))
            if len(sides) > 1:
                lines.append(f"{group}: " + _describe(f"code {path}", sides))
        for method in dict.fromkeys(r["method"] for r in runs):
            line = _recipe_conflict([r for r in runs if r["method"] == method], "method",
                                    f"{method}'s {_listed(METHOD_FIELDS)}")
            if line:
                lines.append(f"{group}: {line}")
    return lines


def refuse_if_different(results: list[dict], what: str, same_code: list[dict] = ()) -> None:
    """SystemExit naming every disagreement (``conflicts``), or nothing."""
    found = conflicts(results, same_code)
    if found:
        raise SystemExit(
            f"refusing to {what}: runs of one backbone must agree on their recipe, training code, schedule, "
            "device, token mixer and evaluator, and these do not:\n" + "\n".join(f"  - {line}" for line in found)
            + "\nKeep the runs that match the code you mean to report (git rm the others, then run them again "
            f"with --next), or restore the code they were made with; where a code change leaves the numerics alone "
            f"(an import moved, a comment), declare its hashes equal, with the reason, in {SAME_CODE} beside the "
            "results.")


# ---------------------------------------------------------------- one run


def _copy(source: Path, target: Path, replace: bool = True) -> bool:
    """Copy atomically (a process beside this one never reads half a file); with ``replace=False`` only where
    target does not exist yet. Returns whether it copied."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(source, partial)
    try:
        if replace:
            partial.replace(target)
            return True
        try:
            os.link(partial, target)  # fails where another process got there first
            return True
        except FileExistsError:
            return False
    finally:
        partial.unlink(missing_ok=True)


def pin_classifier(plan: Study, config: TrainConfig, device: str) -> tuple[str, float]:
    """Make every run of the plan score with one feature classifier: the plan's pinned file when it exists
    (copied over the cache's), else the one trained here, which is pinned, unless a run beside this one pinned
    its own first. Returns its hash and test accuracy."""
    from recipes.data import load_dataset
    from recipes.metrics import classifier_path, load_classifier

    dataset = load_dataset(config.data.name, config.data.limit, config.data.cache_dir)
    cached = classifier_path(dataset, config.data.cache_dir)
    pinned = plan.results / f"classifier_{dataset.name}.pt"
    if not pinned.exists():
        load_classifier(dataset, device, config.data.cache_dir)  # trains and caches it if need be
        if _copy(cached, pinned, replace=False):
            print(f"pinned the feature classifier in {pinned}: commit it with the results", file=sys.stderr)
    _copy(pinned, cached)
    _, accuracy = load_classifier(dataset, device, config.data.cache_dir)
    return _sha(pinned.read_bytes()), accuracy


def load_results(plan: Study) -> list[dict]:
    """The plan's results that exist, in plan order, each with its file name (relative to the results folder)."""
    found = []
    for run in plan.runs():
        path = plan.results / run.file
        if path.exists():
            found.append({**json.loads(path.read_text()), "file": str(run.file)})
    return found


def run_one(run: Run, plan: Study, wall_s: float) -> dict:
    """Train one run within wall_s seconds of the process's start and write its result; returns it.

    Refuses, before any training, a run whose fingerprint disagrees with the results of its backbone that
    exist. A run that nears the wall-clock limit stops training early (``out_of_time``), still evaluates and
    still writes its result: a process killed at the limit would leave nothing."""
    from recipes.train import Trainer

    config = run_config(run, plan)
    cuda = torch.cuda.is_available()
    info = machine()
    evaluator, classifier_accuracy = pin_classifier(plan, config, "cuda" if cuda else "cpu")
    mixer = scan_kernel(run.group.backbone, "cuda" if cuda else "cpu")
    if cuda and not plan.quick and run.group.backbone == "mamba" and importlib.import_module(
            "backbones.mamba").ssd_impl(cuda=True) != "kernel":
        # the chunked PyTorch scan holds every chunk's state for the backward: at the recipe's batch it needs
        # more than an H200's 140 GiB (its first step fails), and a run on another mixer would not merge with the rest
        raise SystemExit(
            f"{run.name}: needs mamba-ssm's Triton SSD on the GPU (the pure-PyTorch chunked scan runs out of memory "
            f"at batch {config.batch}). Its Triton kernels need no build: fetch the sdist where torch imports (`pip "
            "download --no-deps --no-binary :all: --no-build-isolation mamba-ssm`), unpack it and put its `mamba_ssm` "
            "folder on PYTHONPATH")
    result: dict[str, Any] = {
        "run": run.name, "group": run.group.name, "method": run.method, "seed": run.seed, "quick": plan.quick,
        "budget_s": run.group.budget_s, "eval_every_s": run.group.eval_every_s, "wall_limit_s": wall_s,
        "machine": info, "routekit": {"commit": info["commit"], "source": routekit_digest()},
        "fingerprint": fingerprint(run, config, info["device"], mixer, evaluator)}
    existing = [r for r in load_results(plan) if r["group"] == run.group.name and r["file"] != str(run.file)]
    refuse_if_different([*existing, {**result, "config": config.model_dump(mode="json"), "file": "(this run)"}],
                        f"start {run.name}", load_same_code(plan))
    folder = plan.runs_dir / run.group.name / f"{run.method}_seed{run.seed}"
    shutil.rmtree(folder, ignore_errors=True)  # a fresh training folder each time
    print(f"[{run.name}] {run.group.budget_s:g} training seconds, an evaluation every {run.group.eval_every_s:g} s; "
          f"planned wall {run.group.planned_wall_s:.0f} s, stopped early past {wall_s:g} s", file=sys.stderr)
    trainer = Trainer(config, folder, progress=False)
    reserved = REPORT_S + (GUIDANCE_S if config.fused else 0.0)
    stats = trainer.run(budget_s=run.group.budget_s, eval_every_s=run.group.eval_every_s,
                        deadline=STARTED + wall_s - reserved)
    if config.fused:
        result["guidance"] = compare_guidance(trainer)
    log = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    seconds = stats["train_seconds"]
    result.update(
        steps=stats["step"], train_seconds=seconds, first_step_seconds=stats["first_step_seconds"],
        steps_per_s=(stats["step"] - 1) / seconds, wall_seconds=time.perf_counter() - STARTED,
        out_of_time=stats["out_of_time"], stages=stats.get("stages", []),
        stage_step_seconds=stats.get("stage_step_seconds", []), parameters=stats["parameters"],
        classifier_test_accuracy=classifier_accuracy, evals=stats["evals"],
        log=[{k: r[k] for k in ("step", "loss", "train_seconds")} for r in log],
        config=config.model_dump(mode="json"))
    path = plan.results / run.file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"[{run.name}] wrote {path}" + (" (out of time: training stopped early)" if stats["out_of_time"] else ""),
          file=sys.stderr)
    return result


WARM_STEPS = 3  # steps a warm-up takes in each stage: the first compiles, the others check it is not compiled again


def warm_up(run: Run, plan: Study) -> None:
    """Compile the run's training programs into this machine's Inductor and Triton caches, and write nothing:
    its recipe for a few steps at each stage's rate in turn (its stages moved to steps), so that the run itself,
    started next on the same machine, finds its first step and each stage's first step in the caches. A stage's
    new rate is a new program, which under torch.compile recompiles; a SPRINT run would otherwise spend about a
    minute of its wall-clock limit twice (vanilla's first step ~40 s, a routed one ~60 s)."""
    from recipes.train import Trainer

    config = run_config(run, plan)
    stages = [{"step": WARM_STEPS * (k + 1), "rate": stage.rate} for k, stage in enumerate(config.stages)]
    config = with_overrides(config, {"stages": stages})  # a stage by step begins before its step, not at a log
    folder = Path(tempfile.mkdtemp(prefix="routekit-warm-"))
    try:
        began = time.perf_counter()
        Trainer(config, folder / "run", progress=False).run(max_steps=WARM_STEPS * (len(stages) + 1))
        print(f"[{run.name}] warmed up: {WARM_STEPS * (len(stages) + 1)} steps over {len(stages) + 1} rates in "
              f"{time.perf_counter() - began:.0f} s; nothing written", file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def compare_guidance(trainer) -> list[dict]:
    """A fused (SPRINT) run's final EMA sampled with CFG and with path-drop guidance (PDG) at the recipe's
    guidance scale: each at the recipe's ODE steps, and each at the steps whose sampling FLOPs come nearest the
    other's at the recipe's steps (PDG's weak half skips the route's blocks, so at equal FLOPs it takes more
    steps). The recipe's own kind at its steps is the run's final evaluation, not sampled again. Records:
    kind, steps, FD, accuracy, FLOPs of one guided evaluation and of one image."""
    from recipes.sampling import network_calls

    sampler, objective = trainer.config.sampler, trainer.objective
    kept = lambda record: {k: float(record[k]) for k in ("fd", "accuracy", "guided_eval_flops", "sampling_flops")}
    found = {(sampler.guidance_kind, sampler.steps): kept(trainer.evals[-1])}

    def quality(kind: str, steps: int) -> dict:
        if (kind, steps) not in found:
            found[kind, steps] = kept(trainer.sample_quality(sampler.model_copy(update={"guidance_kind": kind,
                                                                                       "steps": steps})))
        return found[kind, steps]

    at_recipe = {kind: quality(kind, sampler.steps) for kind in ("cfg", "pdg")}
    for kind, other in (("cfg", "pdg"), ("pdg", "cfg")):
        per_call, target = at_recipe[kind]["guided_eval_flops"], at_recipe[other]["sampling_flops"]
        steps = min(range(1, 4 * sampler.steps + 1),
                    key=lambda n: abs(per_call * network_calls(objective, n) - target))
        quality(kind, steps)
    by_cost = sorted(found.items(), key=lambda item: item[1]["sampling_flops"])
    return [{"kind": kind, "steps": steps, "guidance": sampler.guidance, **q} for (kind, steps), q in by_cost]


# ---------------------------------------------------------------- report


def spread(values: Iterable[float]) -> dict | None:
    """Mean, min, max and count; None for no values."""
    values = list(values)
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)} \
        if values else None


def at(result: dict, x_key: str, x: float, y_key: str) -> float:
    """The run's y at x, linear between evaluations (FD in log space: it falls by factors)."""
    xs = [e[x_key] for e in result["evals"]]
    ys = [e[y_key] for e in result["evals"]]
    if y_key == "fd":
        return math.exp(float(np.interp(x, xs, np.log(ys))))
    return float(np.interp(x, xs, ys))


# The quality levels the report times every run to (how: `seconds_to_level`). They sit on the steep part of the
# curves: on DiT-B/2 (MNIST-5k) FD falls from ~200 to ~1 and accuracy rises from chance to 0.9 within two minutes
# of training, and there a method that learns faster arrives seconds earlier in every seed. FD 10 and accuracy
# 0.5: the samples have become digits; FD 3 and accuracy 0.9: nearly as good as they get here. Further on, the
# curves flatten onto the data set's floor (FD ~1, where one run's own evaluations move by a fifth) and accuracy's
# ceiling, and a time of arrival there, or a value at the end, is mostly noise.
LEVELS: tuple[tuple[str, float], ...] = (("fd", 10.0), ("fd", 3.0), ("accuracy", 0.5), ("accuracy", 0.9))
# A group none of whose runs ever scores an accuracy above this (chance is 0.1 on ten classes) stops training before
# its models draw digits: its figures describe only the first minutes of training, and the report says so.
CHANCE_BOUND = 0.2


def level_name(key: str, level: float) -> str:
    """``FD ≤ 10``, ``accuracy ≥ 0.9``: which way a level is reached."""
    return f"FD ≤ {level:g}" if key == "fd" else f"accuracy ≥ {level:g}"


def seconds_to_level(result: dict, key: str, level: float) -> float | None:
    """The training seconds at which the run first reaches level: FD at or below it, accuracy at or above it.
    Between the last evaluation short of it and the first that reaches it, the value is taken to move linearly in
    training seconds (FD linearly in its logarithm, as in `at`: it falls by factors). Where the first evaluation
    already reaches it, that evaluation's seconds: the crossing came no later, and no earlier one was measured.
    None where no evaluation reaches it."""
    scale = math.log if key == "fd" else float
    evals = result["evals"]
    for i, e in enumerate(evals):
        if (e[key] <= level) if key == "fd" else (e[key] >= level):
            if i == 0:
                return e["train_seconds"]
            before = evals[i - 1]
            share = (scale(before[key]) - scale(level)) / (scale(before[key]) - scale(e[key]))
            return before["train_seconds"] + share * (e["train_seconds"] - before["train_seconds"])
    return None


def _levels(runs: list[dict], vanilla: dict[int, dict]) -> list[dict]:
    """Per level of LEVELS: each seed's seconds to it (None: not reached), their spread over the seeds that
    reached it and how many did, how many already at the first evaluation, and against vanilla's run of the same
    seed (same data order) how many arrived sooner and how many later (a run that never arrives is later than
    one that does)."""
    found = []
    for key, level in LEVELS:
        mine = [seconds_to_level(r, key, level) for r in runs]
        pairs = [(s, seconds_to_level(vanilla[r["seed"]], key, level)) for r, s in zip(runs, mine) if r["seed"] in vanilla]
        found.append({
            "key": key, "level": level, "name": level_name(key, level), "per_seed": mine,
            "seconds": spread(s for s in mine if s is not None), "reached": sum(s is not None for s in mine),
            "at_first_evaluation": sum(s == r["evals"][0]["train_seconds"] for r, s in zip(runs, mine)),
            "pairs": len(pairs),
            "sooner": sum(s is not None and (v is None or s < v) for s, v in pairs),
            "later": sum(v is not None and (s is None or v < s) for s, v in pairs)})
    return found


def summarise_group(group: Group, results: list[dict]) -> dict:
    """Per method: throughput, the training seconds to each quality level (LEVELS) and their ratio to vanilla's,
    FD and accuracy at the training second every run of the group reached, and FD at equal steps against vanilla's
    run of the same seed. ``early``: no run of the group ever scored above CHANCE_BOUND."""
    results = [r for r in results if r["group"] == group.name]
    when = min(r["evals"][-1]["train_seconds"] for r in results)
    vanilla = {r["seed"]: r for r in results if r["method"] == "vanilla"}
    methods = {}
    for method in group.methods:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        pairs = [(r, vanilla[r["seed"]]) for r in runs if r["seed"] in vanilla]
        steps = [min(r["evals"][-1]["step"], v["evals"][-1]["step"]) for r, v in pairs]
        fd_at_step = [at(r, "step", s, "fd") for (r, _), s in zip(pairs, steps)]
        vanilla_at_step = [at(v, "step", s, "fd") for (_, v), s in zip(pairs, steps)]
        methods[method] = {
            "seeds": [r["seed"] for r in runs], "files": [r["file"] for r in runs],
            "steps": spread(r["steps"] for r in runs), "steps_per_s": spread(r["steps_per_s"] for r in runs),
            "first_step_seconds": spread(r["first_step_seconds"] for r in runs),
            "wall_seconds": spread(r["wall_seconds"] for r in runs),
            "out_of_time": [r["file"] for r in runs if r["out_of_time"]],
            "levels": _levels(runs, vanilla),
            "fd": spread(at(r, "train_seconds", when, "fd") for r in runs),
            "accuracy": spread(at(r, "train_seconds", when, "accuracy") for r in runs),
            "best_accuracy": spread(max(e["accuracy"] for e in r["evals"]) for r in runs),
            "lower_fd_than_vanilla": sum(at(r, "train_seconds", when, "fd") < at(v, "train_seconds", when, "fd")
                                         for r, v in pairs),
            "pairs": len(pairs), "guidance": _guidance(runs),
            "equal_steps": {"step": spread(steps), "fd": spread(fd_at_step), "vanilla_fd": spread(vanilla_at_step),
                            "ratio": spread(a / b for a, b in zip(fd_at_step, vanilla_at_step)),
                            "lower": sum(a < b for a, b in zip(fd_at_step, vanilla_at_step))} if pairs else None}
    # × vanilla's seconds only where every seed of both arrived: a mean over the seeds that made it would leave out
    # the slowest, and flatter whichever method lost more of them
    base = methods.get("vanilla")
    for m in methods.values():
        for mine, theirs in zip(m["levels"], base["levels"] if base else [None] * len(LEVELS)):
            whole = theirs and mine["reached"] == len(m["seeds"]) and theirs["reached"] == len(base["seeds"])
            mine["ratio"] = mine["seconds"]["mean"] / theirs["seconds"]["mean"] if whole else None
    best = max(e["accuracy"] for r in results for e in r["evals"])
    return {"title": group.title, "seconds": when, "best_accuracy": best, "early": best < CHANCE_BOUND,
            "methods": methods}


def _num(value: float) -> str:
    """Three significant figures, for FDs from 0.5 to 1500."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _fmt(s: dict | None, form: Callable[[float], str] = _num) -> str:
    if s is None:
        return "-"
    return form(s["mean"]) if s["n"] == 1 else f"{form(s['mean'])} ({form(s['min'])}–{form(s['max'])})"


def _secs(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _ratio(value: float) -> str:
    return f"{value:.2f}"


def _arrival(level: dict, seeds: int, unit: str = "") -> str:
    """A method's seconds to a level: mean (min–max) over the seeds that reached it, with their count where some
    did not; '≤' where a seed reached it at the first evaluation; 'not reached' where none did."""
    if not level["reached"]:
        return f"not reached (0 of {seeds} seed{'s' if seeds > 1 else ''})"
    text = ("≤ " if level["at_first_evaluation"] else "") + _fmt(level["seconds"], _secs) + unit
    return text if level["reached"] == seeds else f"{text}, {level['reached']} of {seeds} seeds"


def _against(mine: dict, theirs: dict, seeds: int, base_seeds: int) -> str:
    """``FD ≤ 10: 203 (187–226) s vs vanilla's 260 (260–261) s (0.78×)``."""
    return (f"{mine['name']}: {_arrival(mine, seeds, ' s')} vs vanilla's {_arrival(theirs, base_seeds, ' s')}"
            + (f" ({_times(mine)})" if mine["ratio"] is not None else ""))


def _times(level: dict) -> str:
    return "-" if level["ratio"] is None else f"{level['ratio']:.2f}×"


def _verdict(lower: int, pairs: int) -> str:
    """'wins' or 'loses' where every seed pair says so (lower, or higher, than vanilla's run of the same seed), else
    'is not settled': a verdict on the means alone would call one lucky seed a win."""
    if not pairs:
        return "is not compared yet (no vanilla run of its seeds)"
    return "wins" if lower == pairs else "loses" if lower == 0 else "is not settled"


def _level_verdict(m: dict) -> str:
    """Per training second: 'wins' where every seed reaches every level sooner than vanilla's run of the same seed,
    'loses' where every one arrives later, else 'is not settled'."""
    pairs = sum(level["pairs"] for level in m["levels"])
    if not pairs:
        return _verdict(0, 0)
    sooner, later = sum(level["sooner"] for level in m["levels"]), sum(level["later"] for level in m["levels"])
    return "wins" if sooner == pairs else "loses" if later == pairs else "is not settled"


def _seeds(lower: int, pairs: int) -> str:
    return f"lower in {lower} of {pairs} seed{'s' if pairs > 1 else ''}"


def _reached_levels(group: dict) -> str:
    """'none reaches any level (...)', or which levels some run of the group reaches."""
    reached = [name for name in (level_name(k, v) for k, v in LEVELS)
               if any(level["name"] == name and level["reached"] for m in group["methods"].values()
                      for level in m["levels"])]
    if not reached:
        return f"none reaches any level ({', '.join(level_name(k, v) for k, v in LEVELS)})"
    return f"of the levels only {', '.join(reached)} {'is' if len(reached) == 1 else 'are'} reached"


def _early(group: dict) -> str:
    """The plain sentence for a group that stopped before any run left chance accuracy."""
    return (f"{group['title']}: only the first minutes of training. Of its runs {_reached_levels(group)}, "
            f"and no run's accuracy rises above {CHANCE_BOUND:g} at any evaluation (best "
            f"{group['best_accuracy']:.3g}; chance is 0.1 on ten classes): training stops before the models draw "
            "digits, so these figures say how training starts, not how well a method trains.")


def findings(summary: dict) -> list[str]:
    """Each method against vanilla on each backbone, in words: the seconds to each level and their ratio to
    vanilla's, the values at the end, per step. Computed from the summary, nothing written by hand."""
    lines = []
    for group in summary["groups"].values():
        base = group["methods"].get("vanilla")
        when = group["seconds"]
        if group["early"]:
            lines.append(_early(group))
        for method, m in group["methods"].items():
            if method == "vanilla":
                continue
            label = f"{LABELS[method]} on {group['title']}"
            if base is None:
                lines.append(f"{label}: no vanilla run yet, nothing to compare with.")
                continue
            lower, n = m["lower_fd_than_vanilla"], len(m["seeds"])
            end = (f"FD {_fmt(m['fd'])} vs vanilla {_fmt(base['fd'])}, {_seeds(lower, m['pairs'])}; "
                   f"accuracy {_fmt(m['accuracy'])} vs vanilla {_fmt(base['accuracy'])}")
            if group["early"]:
                text = f"{label}, first minutes only: at {_secs(when)} s, {end}."
            else:
                arrivals = "; ".join(_against(mine, theirs, n, len(base["seeds"]))
                                     + f", sooner in {mine['sooner']} of {mine['pairs']} seeds"
                                     for mine, theirs in zip(m["levels"], base["levels"]))
                text = f"{label} {_level_verdict(m)} per training second: {arrivals}. At {_secs(when)} s: {end}."
                if method in BARS:
                    text += " " + _bar(m, BARS[method])
            steps = m["equal_steps"]
            if steps:
                verdict = "in these minutes" if group["early"] else f"it {_verdict(steps['lower'], m['pairs'])}"
                text += (f" Per step {verdict}: FD {_fmt(steps['fd'])} vs vanilla "
                         f"{_fmt(steps['vanilla_fd'])} at equal steps (step {_fmt(steps['step'], _secs)}), "
                         f"ratio {_fmt(steps['ratio'], _ratio)}, {_seeds(steps['lower'], m['pairs'])}.")
            lines.append(text)
            if m["guidance"]:
                lines.append(_guidance_finding(label, m["guidance"]))
    return lines


# The study's questions: does the method reach each level in at most this share of vanilla's seconds?
BARS = {"tread": 0.7, "sprint": 0.6}


def _bar(m: dict, bar: float) -> str:
    """A method against its bar at each level, every seed counted: a level some seed never reaches fails it."""
    shares = ", ".join(f"{level['name']} {_times(level)}" for level in m["levels"])
    met = [level["name"] for level in m["levels"] if level["ratio"] is not None and level["ratio"] <= bar]
    where = ("met at every level" if len(met) == len(m["levels"]) else f"met at {', '.join(met)} only" if met
             else "met at no level")
    return (f"The study's bar (each level in ≤ {bar:.2f}× vanilla's seconds, every seed reaching it): "
            f"{shares}; {where}.")


def _guidance(runs: list[dict]) -> list[dict]:
    """Per (guidance kind, ODE steps) the runs sampled their final EMA with (``compare_guidance``): FD and
    accuracy over seeds, FLOPs per image; and each PDG entry's CFG entry of the nearest FLOPs (``against``)."""
    by: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        for g in r.get("guidance", ()):
            by.setdefault((g["kind"], g["steps"]), []).append(g)
    rows = [{"kind": kind, "steps": steps, "seeds": len(found), "fd": spread(g["fd"] for g in found),
             "accuracy": spread(g["accuracy"] for g in found),
             "sampling_flops": statistics.fmean(g["sampling_flops"] for g in found)}
            for (kind, steps), found in sorted(by.items(), key=lambda item: item[1][0]["sampling_flops"])]
    cfg = [c for c in rows if c["kind"] == "cfg"]
    for row in rows:
        if row["kind"] == "pdg" and cfg:
            near = min(cfg, key=lambda c: abs(c["sampling_flops"] - row["sampling_flops"]))
            row["against"] = {"steps": near["steps"], "flops_ratio": row["sampling_flops"] / near["sampling_flops"]}
    return rows


def _guidance_finding(label: str, rows: list[dict]) -> str:
    """PDG against CFG where their sampling FLOPs per image are nearest, in words."""
    cfg = {r["steps"]: r for r in rows if r["kind"] == "cfg"}
    parts = []
    for r in rows:
        if "against" not in r:
            continue
        c = cfg[r["against"]["steps"]]
        better = "lower" if r["fd"]["mean"] < c["fd"]["mean"] else "higher"
        parts.append(f"PDG at {r['steps']} steps ({r['sampling_flops'] / 1e9:.2f} GFLOPs an image) FD "
                     f"{_fmt(r['fd'])}, {better} than CFG's {_fmt(c['fd'])} at {c['steps']} steps "
                     f"({c['sampling_flops'] / 1e9:.2f} GFLOPs, {r['against']['flops_ratio']:.2f}× PDG's FLOPs "
                     f"there); accuracy {_fmt(r['accuracy'])} vs {_fmt(c['accuracy'])}")
    return f"{label}, guidance on the final EMA at about equal sampling FLOPs: " + "; ".join(parts) + "."


def guidance_table(group: dict) -> list[str]:
    """Per method that compared guidance: each (kind, steps) with its FLOPs per image, FD and accuracy."""
    lines = []
    for method, m in group["methods"].items():
        if not m["guidance"]:
            continue
        if not lines:
            lines = ["| method | guidance | ODE steps | GFLOPs per image | FD | accuracy | seeds |",
                     "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {LABELS[method]} | {r['kind'].upper()} | {r['steps']} | {r['sampling_flops'] / 1e9:.2f} | "
                  f"{_fmt(r['fd'])} | {_fmt(r['accuracy'])} | {r['seeds']} |" for r in m["guidance"]]
    return lines


def headline(summary: dict, plan: Study) -> str:
    """The sentence the README quotes: TREAD against vanilla on each backbone that has both, the seconds to each
    level with their ratio, or, where the runs stop at chance accuracy, that they show only the first minutes."""
    parts = []
    for group in summary["groups"].values():
        tread, base = group["methods"].get("tread"), group["methods"].get("vanilla")
        if not (tread and base):
            continue
        n, when = len(tread["seeds"]), group["seconds"]
        seeds = f"{n} seed{'s' if n > 1 else ''} of TREAD, {len(base['seeds'])} of vanilla"
        if group["early"]:
            parts.append(f"on {group['title']} every run is still at chance accuracy when it stops (best "
                         f"{group['best_accuracy']:.3g}) and {_reached_levels(group)}, so its figures measure only the "
                         f"first minutes of training (FD at {_secs(when)} s: TREAD {_fmt(tread['fd'])}, vanilla "
                         f"{_fmt(base['fd'])}; {seeds})")
            continue
        arrivals = ", ".join(_against(mine, theirs, n, len(base["seeds"]))
                             for mine, theirs in zip(tread["levels"], base["levels"]))
        parts.append(f"on {group['title']} ({seeds}), TREAD's {arrivals}")
    if not parts:
        return "No headline yet: no backbone has both a vanilla and a TREAD run."
    where = "--quick: tiny models on synthetic data, no evidence" if plan.quick else "MNIST-5k, one H200 per run"
    return (f"Convergence per training second ({where}), training seconds to fixed quality levels, TREAD against "
            "vanilla (× vanilla's seconds): " + "; ".join(parts) + ".")


def plan_table(plan: Study, done: dict[str, dict]) -> list[str]:
    missing = [run for run in plan.runs() if str(run.file) not in done]
    lines = ["| # | run | training s | evaluations | planned wall s | status |", "|---:|---|---:|---|---:|---|"]
    for number, run in enumerate(plan.runs(), 1):
        result = done.get(str(run.file))
        if result:
            status = (f"done: `{run.file}`, {result['wall_seconds']:.0f} s wall, "
                      f"commit {result['machine']['commit'][:7]}"
                      + (", out of time" if result["out_of_time"] else ""))
        else:
            status = ("**next**" if missing and run == missing[0] else "missing") + (
                "" if run.recipe.exists() else f" (no recipe yet: {run.recipe.relative_to(REPO)})")
        lines.append(f"| {number} | {run.name} | {run.group.budget_s:g} | {run.group.evals} (every "
                     f"{run.group.eval_every_s:g} s) | {run.group.planned_wall_s:.0f} | {status} |")
    return lines


def level_table(group: dict) -> list[str]:
    """Per method: the training seconds to each level with their ratio to vanilla's, and the values at the end."""
    when = group["seconds"]
    lines = ["| method | seeds | " + " | ".join(f"s to {level_name(k, v)}" for k, v in LEVELS)
             + f" | FD at {_secs(when)} s | accuracy at {_secs(when)} s |",
             "|---|---|" + "---:|" * (len(LEVELS) + 2)]
    for method, m in group["methods"].items():
        cells = [_arrival(level, len(m["seeds"])) + (f"; {_times(level)}" if level["ratio"] is not None else "")
                 for level in m["levels"]]
        lines.append(f"| {LABELS[method]} | {', '.join(map(str, m['seeds']))} | {' | '.join(cells)} | "
                     f"{_fmt(m['fd'])} | {_fmt(m['accuracy'])} |")
    return lines


def group_table(group: dict) -> list[str]:
    """Per method: steps and their rate, the first step, wall time, and FD at equal steps against vanilla's."""
    lines = ["| method | seeds | steps | steps/s | first step (s) | wall (s) | FD at equal steps / vanilla's |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for method, m in group["methods"].items():
        ratio = _fmt(m["equal_steps"]["ratio"], _ratio) if m["equal_steps"] else "-"
        lines.append(f"| {LABELS[method]} | {', '.join(map(str, m['seeds']))} | {_fmt(m['steps'], _secs)} | "
                     f"{_fmt(m['steps_per_s'], lambda v: f'{v:.2f}')} | {_fmt(m['first_step_seconds'], _secs)} | "
                     f"{_fmt(m['wall_seconds'], _secs)} | {ratio} |")
    return lines


def notes(results: list[dict], same_code: list[dict] = ()) -> list[str]:
    """What differs between merged runs without refusing them: routekit's source, torch's version, training code
    declared the same."""
    found = []
    for entry in same_code:
        by_hash = {h: [r["file"] for r in results if r["fingerprint"]["code"].get(entry["path"]) == h]
                   for h in entry["hashes"][1:]}
        held = "; ".join(f"{', '.join(files)} on {h}" for h, files in by_hash.items() if files)
        if held:
            found.append(f"- {entry['path']} changed between runs in a way declared not to touch the numerics "
                         f"({entry['why']}): {held}; the others on {entry['hashes'][0]}")
    for what, key in (("routekit source", lambda r: r["routekit"]["source"]),
                      ("torch version", lambda r: r["machine"]["torch"])):
        sides = _sides(results, key)
        if len(sides) > 1:
            found.append(f"- The runs were made on different {what}s (recorded, not refused; see the module doc): "
                         + "; ".join(f"{json.loads(value)}: {', '.join(files)}" for value, files in sides.items()))
    late = [r["file"] for r in results if r["out_of_time"]]
    if late:
        found.append(f"- Stopped early by the wall-clock guard (fewer training seconds than planned): {', '.join(late)}")
    return found


def markdown(data: dict, plan: Study) -> str:
    summary, results = data["summary"], data["runs"]
    lines = [f"**{data['headline']}**", "",
             f"**{data['done']} of {data['planned']} planned runs exist.** "
             + (f"Missing, in the order `--next` runs them: {', '.join(data['missing'])}." if data["missing"]
                else "None is missing."), ""]
    if data["findings"]:
        lines += ["## Findings", "", *(f"- {line}" for line in data["findings"]), ""]
    for name, group in summary["groups"].items():
        spec = next(g for g in plan.groups if g.name == name)
        lines += [f"## {group['title']}", "", *([f"**{_early(group)}**", ""] if group["early"] else []),
                  f"{spec.budget_s:g} training seconds per run, {spec.evals} evaluations (every {spec.eval_every_s:g} s). "
                  f"Training seconds to each level, mean (min–max) over seeds, and × vanilla's; FD and accuracy at "
                  f"the end are read at {_secs(group['seconds'])} s, the training second every run below reached.", "",
                  *level_table(group), "", *group_table(group), ""]
        table = guidance_table(group)
        if table:
            lines += ["Guidance on the final EMA weights (recipe's scale), each kind at the recipe's ODE steps and at "
                      "the steps whose sampling FLOPs come nearest the other kind's: FD and accuracy against what "
                      "drawing one image computes.", "", *table, ""]
    lines += ["## How it is measured", "",
              "- Training seconds exclude evaluation and the first step (compilation); every curve is also drawn "
              "against steps. FD: Fréchet distance in the feature classifier's 128-d features to the held-out test "
              "split (lower is better); accuracy: the classifier agrees with the sampled class; EMA weights, guidance "
              "and ODE steps as in each recipe; the same classifier (pinned), labels and sampling noise for every run.",
              "- Values are the mean across seeds with (min–max) when there are several. A run's value at a training "
              "second or step is interpolated between its evaluations (FD in log space).",
              "- Seconds to a level: the training second at which a run first reaches it (FD at or below it, "
              "accuracy at or above it), interpolated between the evaluation before and the first that reaches it, "
              "linearly in training seconds (FD linearly in its logarithm, as it falls by factors; accuracy "
              "linearly). '≤' where a run already reaches it at its first evaluation (the crossing came no later); "
              "'not reached' where no evaluation does, and a mean over the seeds that did, with their count, where "
              "some did not. × vanilla's: the method's mean seconds over vanilla's, given only where every seed of "
              "both reached the level. Sooner: against vanilla's run of the same seed (same data order). The levels "
              f"({', '.join(level_name(k, v) for k, v in LEVELS)}) sit where the curves fall steeply (why: LEVELS "
              "in benchmarks/convergence.py); a method is said to win per training second where every seed reaches "
              f"every level sooner than vanilla's. A backbone none of whose runs ever scores above {CHANCE_BOUND:g} "
              "accuracy (chance: 0.1) is said to show only the first minutes of training.",
              "- FD at equal steps / vanilla's: against vanilla's run of the same seed (same data order), at the "
              "fewer of the two runs' steps.", ""]
    extra = notes(results, data["same_code"])
    if extra:
        lines += ["## Notes", "", *extra, ""]
    lines += ["## Plan", "", *plan_table(plan, {r["file"]: r for r in results}), ""]
    if results:
        lines += ["## Runs", ""]
        lines += [f"- `{r['file']}`: `{r['machine']['command']}` at `{r['machine']['commit'][:7]}` on "
                  f"{r['machine']['device']}, torch {r['machine']['torch']}, {r['machine']['date']}" for r in results]
    return "\n".join(lines) + "\n"


def _band(runs: list[dict], x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each run's curve interpolated on a common x grid (where all runs have evaluations): x, mean, min, max."""
    lo = max(r["evals"][0][x_key] for r in runs)
    hi = min(r["evals"][-1][x_key] for r in runs)
    grid = np.linspace(lo, hi, 50) if hi > lo else np.array([lo])
    ys = np.array([[at(r, x_key, x, y_key) for x in grid] for r in runs])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def plot(data: dict, path: Path) -> None:
    """Per backbone (a row): FD and accuracy against training seconds and against steps, a band across seeds, and
    the levels the report times (dashed)."""
    groups = list(data["summary"]["groups"])
    columns = [("train_seconds", "fd"), ("step", "fd"), ("train_seconds", "accuracy"), ("step", "accuracy")]
    with figure(path, len(groups), 4, figsize=(18, 4 * len(groups)), squeeze=False) as (fig, axes):
        for row, name in enumerate(groups):
            for method in METHODS:
                runs = [r for r in data["runs"] if r["group"] == name and r["method"] == method]
                if not runs:
                    continue
                for col, (x_key, y_key) in enumerate(columns):
                    grid, mean, low, high = _band(runs, x_key, y_key)
                    line = axes[row, col].plot(grid, mean, marker="o" if len(grid) == 1 else None,
                                               label=f"{LABELS[method]} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")[0]
                    axes[row, col].fill_between(grid, low, high, color=line.get_color(), alpha=0.2)
            title, when = data["summary"]["groups"][name]["title"], data["summary"]["groups"][name]["seconds"]
            for col, (x_key, y_key) in enumerate(columns):
                axis = axes[row, col]
                if x_key == "train_seconds":  # where the report reads every run
                    axis.axvline(when, color="gray", linestyle=":", linewidth=1)
                for key, level in LEVELS:  # the levels the report times every run to
                    if key == y_key:
                        axis.axhline(level, color="gray", linestyle="--", linewidth=0.8)
                        axis.text(1.0, level, f" {level:g}", transform=axis.get_yaxis_transform(), fontsize=8,
                                  color="gray", va="center")
                axis.set_xlabel("training seconds" if x_key == "train_seconds" else "steps")
                axis.set_ylabel(f"{title}: " + ("FD (log)" if y_key == "fd" else "accuracy on samples"))
                if y_key == "fd":
                    axis.set_yscale("log")
            axes[row, 0].legend()
        fig.suptitle("EMA sample quality, mean and range across seeds")


def report(plan: Study) -> dict:
    """Merge the plan's results that exist into NAME.{md,json,png} (no picture without results), or refuse
    results that disagree (``conflicts``). Returns the report's data."""
    results, same_code = load_results(plan), load_same_code(plan)
    refuse_if_different(results, "merge these results", same_code)
    planned = plan.runs()
    done = {r["file"] for r in results}
    groups = {g.name: summarise_group(g, results) for g in plan.groups if any(r["group"] == g.name for r in results)}
    summary = {"groups": groups}
    data = {"planned": len(planned), "done": len(results), "same_code": same_code,
            "missing": [run.name for run in planned if str(run.file) not in done],
            "headline": headline(summary, plan), "findings": findings(summary), "summary": summary, "runs": results,
            "plan": [{"run": run.name, "file": str(run.file), "budget_s": run.group.budget_s,
                      "eval_every_s": run.group.eval_every_s, "planned_wall_s": run.group.planned_wall_s}
                     for run in planned]}
    title = "Convergence per training second: TREAD and DAR against vanilla, seeded, across backbones" + (
        " (--quick)" if plan.quick else "")
    if not results:
        (plan.out / f"{plan.name}.png").unlink(missing_ok=True)  # no stale picture beside a report without runs
    write(plan.name, machine(), data, title, markdown(data, plan), plan.out,
          (lambda path: plot(data, path)) if results else None)
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--list", action="store_true", help="print the plan with each run's status")
    action.add_argument("--next", action="store_true", help="train the first missing run of the plan, then report")
    action.add_argument("--run", metavar="BACKBONE/METHOD/SEED", help="train this run (e.g. dit_b2/tread/0), then report")
    action.add_argument("--report", action="store_true", help="merge the results that exist; say what is missing")
    parser.add_argument("--quick", action="store_true",
                        help="the plan shrunk to tiny models on synthetic data: seconds on a CPU")
    parser.add_argument("--warm", action="store_true",
                        help="with --run: compile the run's programs into this machine's caches (a few steps at each "
                        "stage's rate) and write nothing; the run itself, next on the same machine, then starts warm")
    parser.add_argument("--wall-s", type=float, default=WALL_S,
                        help=f"wall seconds a run may take from the process's start (default {WALL_S:g}); training "
                        "stops early to leave room for the final evaluation and the files")
    parser.add_argument("--results", type=Path, help="result files (default benchmarks/results/convergence)")
    parser.add_argument("--out", type=Path, help="the report's folder (default benchmarks/results)")
    parser.add_argument("--runs", type=Path, help="training folders (default runs/convergence)")
    args = parser.parse_args(argv)
    plan = study(args.quick, args.results, args.out, args.runs)
    if args.warm:
        if not args.run:
            parser.error("--warm warms one run's compilation: name it with --run BACKBONE/METHOD/SEED")
        warm_up(plan.find(args.run), plan)
        return
    if args.list:
        done = {r["file"]: r for r in load_results(plan)}
        print("\n".join(plan_table(plan, done)))
        print(f"\n{len(done)} of {len(plan.runs())} planned runs exist.")
        return
    if args.next or args.run:
        if args.run:
            run = plan.find(args.run)
            if (plan.results / run.file).exists():
                raise SystemExit(f"{plan.results / run.file} exists; to make {run.name} again, delete that file "
                                 "first (git rm it if it is committed)")
        else:
            done = {r["file"] for r in load_results(plan)}
            run = next((r for r in plan.runs() if str(r.file) not in done), None)
            if run is None:
                print(f"all {len(plan.runs())} planned runs exist", file=sys.stderr)
        if run is not None:
            run_one(run, plan, args.wall_s)
    data = report(plan)
    print(f"{data['headline']}\n{data['done']} of {data['planned']} planned runs exist"
          + (f"; next: {data['missing'][0]}" if data["missing"] else ""))


if __name__ == "__main__":
    main()

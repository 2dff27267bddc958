"""The peers' own model tests, run on routed models: is a routed model a drop-in for the user's?

    python -m benchmarks.peer_suites --out benchmarks/results/peer_suites

Runs diffusers' model tests (Flux, Wan, SD3) and transformers' ModelTesterMixin (Llama, ViT) twice with pytest,
on CPU and offline: plain, as their authors run them, and routed, where every model a test builds is routed right
after it is built with the test's own dummy inputs (`benchmarks/peers/plugin.py`). Writes OUT.json and OUT.md:
per suite the counts of both runs, every test that passes plain and fails routed with the first line of its
error and, where the difference is by design, the reason (`EXPECTED`, the only way a failure is excused), and
every model routekit refused (with its message) or that the dummy inputs could not drive.

The test trees come from each peer's repository at the installed version's tag (`--git PACKAGE=SOURCE@REV`: a URL
or a local git directory, for where that tag cannot be had), then from the installed version's sdist for files the
repository gave none (transformers ships its shared test files there), then, for a file neither supplied, from
`benchmarks/peers/standins/`; the result records where the files came from.
They are kept under `--cache` (git-ignored), never committed. Not part of CI: it needs those trees.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import common

REPO = common.REPO
STANDINS = Path(__file__).resolve().parent / "peers" / "standins"
ROUTE = {"start": 0, "end": 1, "rate": 0.5}
TEST_DEPENDENCIES = ("parameterized",)  # imported by transformers' test_modeling_common; installed into --cache

# Mixins left out of the diffusers suites, and why: quantization backends, parallelism and single-file
# checkpoints need packages, several processes or the hub that this run has not; torch.compile tests take minutes
# each on a CPU; LoRA hot-swapping and attention backends are compile- and GPU-kernel tests.
DIFFUSERS_LEFT_OUT = ("Compile", "Parallel", "Quanto", "GGUF", "BitsAndBytes", "TorchAo", "ModelOpt", "SDNQ",
                      "Backend", "HotSwap", "SingleFile", "Neuron")
DIFFUSERS_SELECT = "not (" + " or ".join(DIFFUSERS_LEFT_OUT) + ")"


@dataclass(frozen=True)
class Suite:
    name: str
    package: str
    file: str  # the test module, relative to the tree
    select: str  # pytest -k
    classes: tuple[str, ...]  # "module:Class" of the models to route
    init: dict = field(default_factory=dict)  # over a diffusers tester's get_init_dict (both runs)


SUITES = (
    Suite("diffusers Flux", "diffusers", "tests/models/transformers/test_models_transformer_flux.py",
          DIFFUSERS_SELECT, ("diffusers:FluxTransformer2DModel",)),
    Suite("diffusers Flux (2 + 2 blocks)", "diffusers", "tests/models/transformers/test_models_transformer_flux.py",
          DIFFUSERS_SELECT, ("diffusers:FluxTransformer2DModel",), init={"num_layers": 2, "num_single_layers": 2}),
    Suite("diffusers Wan", "diffusers", "tests/models/transformers/test_models_transformer_wan.py",
          DIFFUSERS_SELECT, ("diffusers:WanTransformer3DModel",)),
    Suite("diffusers SD3", "diffusers", "tests/models/transformers/test_models_transformer_sd3.py",
          DIFFUSERS_SELECT, ("diffusers:SD3Transformer2DModel",)),
    Suite("transformers Llama", "transformers", "tests/models/llama/test_modeling_llama.py", "LlamaModelTest",
          tuple(f"transformers:Llama{c}" for c in ("Model", "ForCausalLM", "ForSequenceClassification",
                                                   "ForQuestionAnswering", "ForTokenClassification"))),
    Suite("transformers ViT", "transformers", "tests/models/vit/test_modeling_vit.py", "ViTModelTest",
          ("transformers:ViTModel", "transformers:ViTForImageClassification", "transformers:ViTForMaskedImageModeling")),
)

# Files a tree may lack where the peer's repository cannot be reached: path in the tree -> stand-in.
STANDIN_FILES = {
    "transformers": {
        "tests/models/llama/test_modeling_llama.py": "transformers_llama.py",
        "tests/models/vit/test_modeling_vit.py": "transformers_vit.py",
        "tests/generation/test_utils.py": "transformers_generation.py",
        "tests/exporters/test_export.py": "transformers_export.py",
    },
}

# The differences by design, and only these: (pattern over "Class::test", reason), excusing a test only where it ran
# on a routed model and routekit refused none of its models. Routes change what the model
# computes in train() mode (blocks see a subset of tokens, drawn at random each call): a test that compares a
# routed model's training-mode outputs against the plain model's, or two training calls against each other, sees
# them differ. Anything else that passes plain and fails routed is a defect.
EXPECTED: tuple[tuple[str, str], ...] = (
    (r"LoRA::test_lora_fuse_nan$",
     "runs a freshly built model, so in train() mode, and expects every output NaN after LoRA weights of inf are fused "
     "into the blocks' attention; the tokens a route sets aside skip the routed blocks (here all of them), so their "
     "outputs stay finite. Routes change training outputs by design; in eval() the routed model's outputs are all NaN"),
)


def expected_reason(test: str, routed: bool, refused: bool) -> str | None:
    """The reason `test` may fail routed, if it is listed and ran on a routed model that routekit did not refuse."""
    if not routed or refused:
        return None
    return next((reason for pattern, reason in EXPECTED if re.search(pattern, test)), None)


# ---- the trees -------------------------------------------------------------------------------------------------

def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=True, capture_output=True, text=True, **kwargs)


def _sdist(package: str, version: str, cache: Path) -> Path:
    """The package's sdist, downloaded once into cache/sdist."""
    folder = cache / "sdist"
    found = sorted(folder.glob(f"{package}-{version}.tar.gz"))
    if not found:
        _run(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(folder),
             f"{package}=={version}")
        found = sorted(folder.glob(f"{package}-{version}.tar.gz"))
    return found[0]


def _git_dir(package: str, source: str, rev: str, cache: Path) -> Path:
    """A git directory holding `rev`: `source` itself if local, else a shallow clone of it into cache/src."""
    if Path(source).exists():
        return Path(source)
    clone = cache / "src" / f"{package}-{rev}"
    if not clone.exists():
        _run("git", "clone", "--quiet", "--depth", "1", "--branch", rev, "--filter=blob:none", "--no-checkout",
             source, str(clone))
    return clone / ".git"


def obtain(package: str, cache: Path, git: str | None) -> dict:
    """cache/PACKAGE-VERSION/tests, built afresh: the repository's tests/ at one revision (`git`: SOURCE@REV, default
    the public repository at tag vVERSION), then the sdist's test files where it gave none (all of them where the
    repository cannot be reached), then stand-ins for what is still missing. Returns its record."""
    version = importlib.metadata.version(package)
    tree = cache / f"{package}-{version}"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    origin: dict[str, str] = {}

    source, _, rev = (git or f"https://github.com/huggingface/{package}@v{version}").rpartition("@")
    record = {"version": version, "git": f"{source}@{rev}"}
    try:  # one revision's whole tests/ folder, so that its files agree with each other
        git_dir = _git_dir(package, source, rev, cache)
        record["git_commit"] = _run("git", "--git-dir", str(git_dir), "rev-parse", f"{rev}^{{commit}}").stdout.strip()
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", rev, "tests"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(tree)], input=archive, check=True)
        origin.update({str(p.relative_to(tree)): f"git {rev}" for p in tree.rglob("*") if p.is_file()})
    except (subprocess.CalledProcessError, OSError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        record["git_error"] = (detail.decode() if isinstance(detail, bytes) else detail).strip().splitlines()[-1:]

    sdist = _sdist(package, version, cache)  # the installed version's own test files, where the repository gave none
    record.update(sdist=sdist.name, sdist_sha256=_sha256(sdist))
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            path = Path(*parts[1:])
            if member.isfile() and len(parts) > 2 and parts[1] == "tests" and str(path) not in origin:
                (tree / path).parent.mkdir(parents=True, exist_ok=True)
                (tree / path).write_bytes(tar.extractfile(member).read())
                origin[str(path)] = "sdist"

    for path, standin in STANDIN_FILES.get(package, {}).items():
        if path not in origin:
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(STANDINS / standin, tree / path)
            origin[path] = f"stand-in benchmarks/peers/standins/{standin}"
    for path in list(origin):  # every folder on the way a package, as in the repository
        for folder in Path(path).parents:
            init = tree / folder / "__init__.py"
            if folder != Path(".") and not init.exists():
                init.touch()
    (tree / "pytest.ini").write_text("[pytest]\n")  # the tree is pytest's root, not this repository
    record["files"] = dict(Counter(o if not o.startswith("stand-in") else "stand-in" for o in origin.values()))
    record["standins"] = {p: o for p, o in origin.items() if o.startswith("stand-in")}
    record["tree"] = str(tree.relative_to(REPO) if tree.is_relative_to(REPO) else tree)
    return record


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_dependencies(cache: Path) -> Path:
    """cache/site with the test-only packages the venv lacks (pip install --target)."""
    site = cache / "site"
    missing = [name for name in TEST_DEPENDENCIES if not (site / name).exists() and not _importable(name)]
    if missing:
        _run(sys.executable, "-m", "pip", "install", "--quiet", "--target", str(site), *missing)
    return site


def _importable(name: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode == 0


# ---- running a suite -------------------------------------------------------------------------------------------

def run(suite: Suite, tree: Path, mode: str, scratch: Path, site: Path, workers: int) -> dict:
    """One pytest run of `suite` in `tree`: {"tests": {id: outcome}, "events": [...], "seconds": s}."""
    tag = re.sub(r"\W+", "_", suite.name).strip("_") + f"_{mode}"
    junit, events = scratch / f"{tag}.xml", scratch / f"{tag}.events.jsonl"
    events.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(site)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "RK_PEER_MODE": mode, "RK_PEER_EVENTS": str(events), "RK_PEER_CLASSES": ",".join(suite.classes),
           "RK_PEER_ROUTE": json.dumps(ROUTE), "RK_PEER_INIT": json.dumps(suite.init)}
    cmd = [sys.executable, "-m", "pytest", suite.file, "-k", suite.select, "-p", "no:cacheprovider",
           "-p", "benchmarks.peers.plugin", "-q", "-W", "ignore", "--runxfail", f"--junitxml={junit}",
           "-o", "junit_family=xunit1"]
    # --runxfail: an xfail mark would turn a routed failure into a skip and hide its error; both runs go without
    if workers > 1:
        cmd += ["-n", str(workers)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    broken = junit.exists() and "collection failure" in junit.read_text()
    if not junit.exists() or broken:
        raise SystemExit(f"{suite.name} ({mode}): the suite did not collect (exit {done.returncode}):\n"
                         f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    lines = events.read_text().splitlines() if events.exists() else []
    return {"tests": outcomes(junit), "events": [json.loads(line) for line in lines], "seconds": round(seconds, 1)}


def outcomes(junit: Path) -> dict[str, dict]:
    """{"Class::test": {"outcome": passed|failed|skipped, "error": first line}} from pytest's JUnit XML."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        test = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            found[test] = {"outcome": "failed", "error": first_line(bad)}
        elif case.find("skipped") is not None:
            found[test] = {"outcome": "skipped", "error": f"skipped: {(case.find('skipped').get('message') or '')[:300]}"}
        else:
            found[test] = {"outcome": "passed"}
    return found


def first_line(element: ET.Element) -> str:
    """The error's first line; for a bare `AssertionError`, the assertion that failed."""
    message = (element.get("message") or "").strip().splitlines()
    line = message[0] if message else ""
    if re.fullmatch(r"[\w.]*(Error|Exception)?:?\s*(assert .*)?", line) or len(line) < 20:
        source = [s[1:].strip() for s in (element.text or "").splitlines() if s.startswith(">")]
        if source:
            line = f"{line} at `{source[-1]}`".strip()
    return line[:400]


# ---- comparing -------------------------------------------------------------------------------------------------

def compare(plain: dict, routed: dict) -> dict:
    """Counts of both runs, the tests that pass plain and not routed, and what happened to the models."""
    count = lambda r: dict(Counter(t["outcome"] for t in r["tests"].values()))
    held = lambda kind: {e["test"].split("::", 1)[1] for e in routed["events"] if e["event"] == kind and e["test"]}
    routed_tests, refused_tests = held("routed"), held("refused")
    lost = []
    for test, was in sorted(plain["tests"].items()):
        now = routed["tests"].get(test, {"outcome": "missing"})
        if was["outcome"] == "passed" and now["outcome"] != "passed":
            lost.append({"test": test, "outcome": now["outcome"], "error": now.get("error", ""),
                         "expected": expected_reason(test, test in routed_tests, test in refused_tests)})
    gained = [t for t, now in sorted(routed["tests"].items())
              if now["outcome"] == "passed" and plain["tests"].get(t, {}).get("outcome") != "passed"]
    passed_routed = [t for t, now in routed["tests"].items() if now["outcome"] == "passed"]
    return {
        "plain": count(plain), "routed": count(routed), "seconds": {"plain": plain["seconds"], "routed": routed["seconds"]},
        "lost": lost, "gained": gained,
        "passed_with_a_routed_model": sum(t in routed_tests for t in passed_routed),
        "models": dict(Counter(e["event"] for e in routed["events"])),
        "same_object": sorted({e["same_object"] for e in routed["events"] if e["event"] == "routed"}),
        "refused": _grouped(routed["events"], "refused"), "unfit": _grouped(routed["events"], "unfit"),
    }


def _grouped(events: list[dict], kind: str) -> list[dict]:
    groups: dict[tuple, list[str]] = {}
    for e in events:
        if e["event"] == kind:
            key = (e["class"], e.get("error", ""), e["message"])
            groups.setdefault(key, []).append(e["test"].split("::", 1)[1] if e["test"] else "?")
    return [{"class": c, "error": err, "message": m, "tests": sorted(set(ts))} for (c, err, m), ts in groups.items()]


# ---- the report ------------------------------------------------------------------------------------------------

def markdown(trees: dict, suites: dict) -> str:
    rows = ["| suite | plain pass / fail / skip | routed pass / fail / skip | lost (unexpected) | lost (by design) "
            "| models routed / refused / unfit | seconds (plain, routed) |", "|---|---|---|---:|---:|---|---|"]
    triple = lambda c: f"{c.get('passed', 0)} / {c.get('failed', 0)} / {c.get('skipped', 0)}"
    for name, s in suites.items():
        unexpected = sum(not x["expected"] for x in s["lost"])
        m = s["models"]
        rows.append(f"| {name} | {triple(s['plain'])} | {triple(s['routed'])} | {unexpected} | "
                    f"{len(s['lost']) - unexpected} | {m.get('routed', 0)} / {m.get('refused', 0)} / "
                    f"{m.get('unfit', 0)} | {s['seconds']['plain']}, {s['seconds']['routed']} |")
    total = sum(not x["expected"] for s in suites.values() for x in s["lost"])
    out = [f"Route: `rk.Route(**{ROUTE})` on every model a test builds, with the test's own dummy inputs. "
           f"**{total} tests pass on the plain model and fail on the routed one, not by design.**", "", *rows, ""]
    out += ["## Test trees", "", "| package | version | sdist | repository | files by origin | stand-ins |",
            "|---|---|---|---|---|---|"]
    for package, t in trees.items():
        repo = f"`{t['git']}`" + (f" ({t['git_commit'][:10]})" if "git_commit" in t else
                                  f": unreachable ({'; '.join(t.get('git_error', []))})")
        out.append(f"| {package} | {t['version']} | `{t['sdist']}` | {repo} | "
                   f"{', '.join(f'{k}: {v}' for k, v in t['files'].items())} | "
                   f"{', '.join(f'`{p}`' for p in t['standins']) or '–'} |")
    for name, s in suites.items():
        out += ["", f"## {name}", ""]
        if s["lost"]:
            out += ["| test | routed | first line of the error | expected? |", "|---|---|---|---|"]
            out += [f"| `{x['test']}` | {x['outcome']} | {_cell(x['error'])} | {x['expected'] or '**no**'} |"
                    for x in s["lost"]]
        else:
            out.append("Every test that passes on the plain model passes on the routed one.")
        out.append("")
        returned = {(True,): "the model itself", (False,): "a new object"}.get(tuple(s["same_object"]), "both")
        out.append(f"Models built: {', '.join(f'{v} {k}' for k, v in s['models'].items()) or 'none'}; `apply` "
                   f"returned {returned}; {s['passed_with_a_routed_model']} of the routed run's passes held a "
                   "routed model.")
        for kind, title in (("refused", "Refused by routekit"), ("unfit", "Not routed: the dummy inputs do not fit")):
            for g in s[kind]:
                out.append(f"- {title}: {g['class']} in {len(g['tests'])} test(s) (`{g['tests'][0]}`…): "
                           f"{g['error'] + ': ' if g['error'] else ''}{_cell(g['message'])}")
        if s["gained"]:
            out.append(f"- Pass routed, not plain: {', '.join(f'`{t}`' for t in s['gained'])}")
    out += ["", "## Differences by design (`EXPECTED` in `benchmarks/peer_suites.py`)", ""]
    out += ["| pattern | reason |", "|---|---|", *(f"| `{p}` | {r} |" for p, r in EXPECTED)] if EXPECTED else ["None."]
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=common.RESULTS / "peer_suites", help="writes OUT.json and OUT.md")
    parser.add_argument("--cache", type=Path, default=REPO / ".cache" / "peers")
    parser.add_argument("--git", action="append", default=[], metavar="PACKAGE=SOURCE@REV",
                        help="where a peer's repository is (a URL or a git directory) and which revision")
    parser.add_argument("--suites", nargs="*", help="names of the suites to run (default: all)")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers per run")
    args = parser.parse_args(argv)
    git = dict(g.split("=", 1) for g in args.git)
    suites = [s for s in SUITES if not args.suites or s.name in args.suites]
    started = time.perf_counter()
    args.cache.mkdir(parents=True, exist_ok=True)
    site = test_dependencies(args.cache)
    trees = {p: obtain(p, args.cache, git.get(p)) for p in dict.fromkeys(s.package for s in suites)}
    scratch = args.cache / "runs"
    scratch.mkdir(exist_ok=True)
    results = {}
    for suite in suites:
        tree = REPO / trees[suite.package]["tree"]  # relative to the repository, or absolute
        plain = run(suite, tree, "plain", scratch, site, args.workers)
        routed = run(suite, tree, "routed", scratch, site, args.workers)
        results[suite.name] = {"file": suite.file, "select": suite.select, "classes": suite.classes,
                               "init": suite.init, **compare(plain, routed)}
        s = results[suite.name]
        print(f"{suite.name}: plain {s['plain']}, routed {s['routed']}, lost {len(s['lost'])} "
              f"({sum(not x['expected'] for x in s['lost'])} unexpected)", flush=True)
    info = {**common.machine(), "command": "python -m benchmarks.peer_suites " + " ".join(argv or sys.argv[1:]),
            "seconds": round(time.perf_counter() - started), "route": ROUTE,
            "peers": {p: t["version"] for p, t in trees.items()}}
    payload = {"trees": trees, "suites": results, "expected": [list(e) for e in EXPECTED]}
    common.write(args.out.name, info, payload, "The peers' model tests on routed models",
                 markdown(trees, results),
                 out=args.out.parent)


if __name__ == "__main__":
    main()

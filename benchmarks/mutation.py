"""Mutation testing of routekit's route core: do the tests notice when the code is wrong? (Not part of CI.)

Each mutant is one classic operator change to one place of a core module, made on its syntax tree: a comparison
flipped or its boundary moved, `and`/`or` swapped or one operand of it dropped, a `not` removed, a condition
negated, an arithmetic operator swapped, an int or float constant off by one, a bool flipped, a statement removed
(a call, a `raise`, an assignment into an attribute or item), a return value replaced by None, `continue`/`break`
swapped, the first two positional arguments of a call swapped, `min`/`max` or `any`/`all` swapped. Text that only
words a message is not mutated (f-strings, the arguments of a `raise`, `__repr__`-like methods: `MESSAGE_ONLY`).

The whole suite is far too slow to run per mutant, so:

1. `coverage` runs the fast test files (`TESTS`) once, recording for every test the core lines it executes
   (a line tracer) and how long it takes; lines run at import count as covered by every test.
2. `run` makes each mutant in a forked child of a process that has already imported torch and the test
   dependencies (the mutant replaces one module's code before routekit is imported: nothing is written to disk),
   and runs the tests covering the mutated lines, fastest first, up to `--budget` seconds of their baseline
   time, stopping at the first failure (Hypothesis without shrinking). Killed: a test failed or errored;
   timeout: it ran past twice its baseline; survived: every chosen test passed; uncovered: no test runs it.
3. `--only-survivors` runs the survivors of the last result again (after new tests: the coverage is recorded
   afresh whenever a core module or a test file changes), keeping each mutant's first outcome too.

    python benchmarks/mutation.py run --sample 400 --seed 21     # coverage first, if not cached
    python benchmarks/mutation.py run --only-survivors
    python benchmarks/mutation.py show 'plan:47:swap:527'          # a mutant's diff
    python benchmarks/mutation.py report                           # mutation.md again, from mutation.json

Results: benchmarks/results/mutation.json (every mutant run, with its latest outcome) and mutation.md (scores per
module, and every survivor with the test that kills it now, why it is equivalent (`EQUIVALENT`), or the fault of
the code it shows (`BUGS`)).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import importlib.abc
import importlib.util
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a file: make the repo's packages importable
    sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
CACHE = Path(os.environ.get("RK_MUTATION_CACHE", Path(tempfile.gettempdir()) / "routekit-mutation"))
CORE = ("trace", "calls", "fxcompat", "values", "analysis", "graphs", "findings", "sides", "tokens", "probe", "residuals",
        "plan", "rewrite", "model", "programs", "routing", "selectors", "verify", "dar", "hooks", "record")
TESTS = ("test_trace", "test_routes", "test_errors", "test_boundary", "test_dar", "test_fuzz", "test_keep",
         "test_positions", "test_selectors", "test_verify", "test_backbones_shared", "test_mutants")
# functions whose only product is the wording of a message or a repr: mutating them measures no law of the code
MESSAGE_ONLY = {"__repr__", "extra_repr", "describe", "block_listing", "_listing", "_short", "user_location",
                "suggestion"}

# Survivors that no test can kill, each with why: the mutant computes what the original computes.
EQUIVALENT: dict[str, str] = {
    "trace:243:loop:1091": "dead branch: `bind_arguments` applies the defaults, so every parameter is in "
                           "`bound.arguments` and the `continue` never runs",
    "trace:290:remove:559": "`BaseException.__new__` stores the arguments anyway; nothing reads an `_Untraceable`'s "
                            "args or message, only its `qualname` and `cause`",
    "trace:389:const:1232": "stack traces are metadata on the nodes: no routekit code reads them, and the generated "
                            "code only gains comments",
    "trace:531:drop:2199/0": "`memo[id(memo)]` is deepcopy's keep-alive list, never a Module, Parameter or Proxy: the "
                             "isinstance test alone already passes it over",
    "analysis:142:drop:1297/1": "only call_function nodes have a callable target: `target is operator.getitem` "
                                "implies `op == 'call_function'`",
    "analysis:530:cmp:3245/0NotEq": "tensors have no `.cat` method, so no call_method node is a cat; with every "
                                    "call_method let through, its first argument is the tensor itself, never a list "
                                    "of parts, and `_cat_split` returns None as before",
    "analysis:530:drop:1935/0": "a string target `cat` belongs to a call_method (tensors have none) or to a module "
                                "named `cat` whose first argument is a tensor, not a list: `_cat_split` returns None "
                                "either way",
    "analysis:643:drop:4776/0": "fx puts the placeholders first, so the first node whose target is the argument's "
                                "name is its placeholder",
    "analysis:645:swap:1075": "torch's `tree_unflatten` takes its two arguments in either order (it swaps a TreeSpec "
                              "passed first)",
    "plan:42:const:203": "`make_plan`, which makes every RoutePlan a route runs, passes `shared`; the default is never "
                         "read",
    "plan:168:const:2259": "sorted by their ends, neighbouring routes overlap exactly when any two do (with no "
                           "overlapping neighbours each start lies after every earlier end): the same requests are "
                           "refused, only the pair the message names may differ",
    "plan:211:negate:1254": "only the wording of the error changes (whether it suggests `keep=[...]`)",
    "plan:302:swap:1953": "the same pairs are compared; `allclose` scales its tolerance by its second argument, which "
                          "moves the verdict only for differences within 1e-5·|a−b| of the bound, where no probe lands",
    "plan:312:return:458": "every request that reaches this branch (a grid selector without a grid) is refused by "
                           "`_check_blocks_of` before the count is used; a grid that does not fit is refused earlier, "
                           "by `_checked_keep`",
    "rewrite:74:drop:531/0": "`by_name.get(None)` is None, as the guard gives",
    "rewrite:271:boolop:362/And": "it retraces blocks the original reuses, at the count their trace was made at or "
                                  "one their trace does not depend on: the same body and adds",
    "rewrite:355:drop:1594/1": "a plain `nn.LayerNorm` (checked first) takes one input, so its call reading the merge "
                               "has args `(node,)` or a keyword, which `not norm.kwargs` refuses",
    "model:89:swap:702": "torch's `tree_unflatten` takes its two arguments in either order",
    "model:226:const:449": "`apply`, assemble's only caller, passes `check_finite`",
    "routing:145:drop:452/0": "a RouteSelect gets a grid source only when its plan's grid was not given "
                              "(`place_routes`, `Hooks.attach`), and then its own grid is None",
    "routing:201:binop:281/Sub": "subtracting the uniform [0, 1) draw instead of adding it keeps the tiers "
                                 "4·forced + 2·chosen apart and still breaks ties uniformly at random",
    "verify:188:cmp:866/0LtE": "the slot is read off the block call both runs make the same way, so a positional slot "
                               "always lies within the positional arguments",
    "verify:188:drop:506/1": "as above: a positional slot always lies within the positional arguments",
    "hooks:34:const:165": "`apply` runs the routed forward once (the dry run) before returning the model, and that "
                          "call leaves `active` False: nothing runs while it is True",
    "hooks:152:drop:304/2": "the grid module is the one whose output was a (B, C, H, W) or (B, C, T, H, W) image when "
                            "recorded; a module gives outputs of one rank",
    "record:171:swap:850": "the tensors are only searched for CUDA devices: their order does not matter",
    "record:186:const:1096": "any fixed seed gives both measuring runs the same random draws",
}

# Survivors that show a fault of the code rather than of the tests: reported, not fixed (the fix is not a few
# clearly right lines), so no test holds the faulty behaviour in place.
BUGS: dict[str, str] = {
    "analysis:295:boolop:4105/And": "boundary mode: a block argument that is an object registered with pytree (a "
                                    "generation cache) keeps the recording's fx Nodes in `SideInput.meta` "
                                    "(`_meta_of` does not look into it, `record._call_graph` did), so its `kind` reads "
                                    "'constant' and `fake_block_inputs` hands the Nodes to every probe: `block_runs` "
                                    "is False for the block at any token count (`_needs_whole_rows`, `_shared`, "
                                    "`_resolved` then decide on a failed probe). The mutant describes the Nodes, as "
                                    "graph mode does; whether rebuilding such an object from TensorMetas is safe "
                                    "for real caches is the open question. Fixed after the run: `_meta_of` rebuilds "
                                    "a registered object around the values where the recording put nodes in it, an "
                                    "object holding a per-token tensor is refused by the plan by name, and a type "
                                    "registered without key paths is taken whole by `trace.call_spec` "
                                    "(tests/test_boundary.py::test_a_pytree_registered_context_object_...)",
}


# What the runs met besides the mutants (the report carries it).
NOTES = ("Before any mutant ran, the suite was red on main: `tests/test_routes.py::test_eval_output_is_bit_identical_"
         "to_the_original` failed, because `verify`'s kept-token check read a one-block route's output after boundary "
         "mode's scatter hook had put it back into the whole stream (`routekit/verify.py`, fixed in 1aa2f66: its hook "
         "goes first). Every run here is on that tree's routekit/.")


# ---- mutants ----------------------------------------------------------------------------------------------------

_CMP = {ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.Lt: [ast.LtE, ast.GtE], ast.LtE: [ast.Lt, ast.Gt],
        ast.Gt: [ast.GtE, ast.LtE], ast.GtE: [ast.Gt, ast.Lt], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is],
        ast.In: [ast.NotIn], ast.NotIn: [ast.In]}
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
        ast.Mod: ast.FloorDiv, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr, ast.Pow: ast.Mult}
# builtins that raise on their first two arguments swapped, whatever the code around them: no test is needed
_NO_SWAP = {"isinstance", "issubclass", "getattr", "setattr", "hasattr"}
_NAMES = {"min": "max", "max": "min", "any": "all", "all": "any"}
_SYMBOL = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.And: "and", ast.Or: "or", ast.Add: "+",
           ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.BitOr: "|",
           ast.BitAnd: "&", ast.Pow: "**"}


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One change to one module: which node (its position in `ast.walk` order), what is done to it, where."""

    module: str
    node: int  # index of the node in ast.walk(tree)
    kind: str
    arg: object  # what the kind needs: the comparison's op index and new op, the operand dropped, ...
    line: int
    end_line: int
    description: str

    @property
    def id(self) -> str:
        """Stable while the module's source is: `plan:170:cmp:2113/0Gt` (module, line, kind, node/arg)."""
        return f"{self.module}:{self.line}:{self.kind}:{self.node}" + ("" if self.arg is None else f"/{self.arg}")


def source_path(module: str) -> Path:
    return REPO / "routekit" / f"{module}.py"


def _skipped(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, f-strings, raise messages, message-only functions,
    `if TYPE_CHECKING:` blocks."""
    skip: set[int] = set()

    def all_of(node):
        skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            all_of(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in MESSAGE_ONLY:
                all_of(node)
            if node.returns is not None:
                all_of(node.returns)
            for a in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs, node.args.vararg,
                      node.args.kwarg]:
                if a is not None and a.annotation is not None:
                    all_of(a.annotation)
        elif isinstance(node, ast.AnnAssign):
            all_of(node.annotation)
        elif isinstance(node, ast.JoinedStr):
            all_of(node)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            all_of(node.exc)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            all_of(node)
    return skip


def _text(node: ast.AST, limit: int = 70) -> str:
    text = ast.unparse(node).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def mutants(module: str) -> list[Mutant]:
    """Every mutant of one core module, in a fixed order."""
    tree = ast.parse(source_path(module).read_text())
    skip = _skipped(tree)
    found = []

    def add(i, node, kind, arg, what):
        found.append(Mutant(module, i, kind, arg, node.lineno, getattr(node, "end_lineno", node.lineno) or node.lineno,
                            what))

    for i, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                for new in _CMP.get(type(op), []):
                    add(i, node, "cmp", f"{j}{new.__name__}", f"{_text(node)}: {_SYMBOL[type(op)]} → {_SYMBOL[new]}")
        elif isinstance(node, ast.BoolOp):
            other = ast.Or if isinstance(node.op, ast.And) else ast.And
            add(i, node, "boolop", other.__name__, f"{_text(node)}: {_SYMBOL[type(node.op)]} → {_SYMBOL[other]}")
            for j, value in enumerate(node.values):
                add(i, node, "drop", j, f"{_text(node)}: drop `{_text(value, 40)}`")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(i, node, "unnot", None, f"{_text(node)}: remove `not`")
        elif isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            new = _BIN[type(node.op)]
            add(i, node, "binop", new.__name__, f"{_text(node)}: {_SYMBOL[type(node.op)]} → {_SYMBOL[new]}")
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BIN:
            new = _BIN[type(node.op)]
            add(i, node, "augop", new.__name__, f"{_text(node)}: {_SYMBOL[type(node.op)]}= → {_SYMBOL[new]}=")
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
            add(i, node, "const", None, f"{node.value!r} → {node.value + 1!r} (line {node.lineno}: "
                                        f"col {node.col_offset})")
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            add(i, node, "const", None, f"{node.value!r} → {not node.value!r} (line {node.lineno})")
        elif isinstance(node, ast.Call):
            positional = [a for a in node.args if not isinstance(a, ast.Starred)]
            if len(positional) == len(node.args) >= 2 and ast.dump(node.args[0]) != ast.dump(node.args[1]) \
                    and not (isinstance(node.func, ast.Name) and node.func.id in _NO_SWAP):
                add(i, node, "swap", None, f"{_text(node)}: swap the first two arguments")
            if isinstance(node.func, ast.Name) and node.func.id in _NAMES:
                add(i, node, "name", _NAMES[node.func.id], f"{_text(node)}: {node.func.id} → {_NAMES[node.func.id]}")
        elif isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            add(i, node, "return", None, f"{_text(node)} → return None")
        elif isinstance(node, (ast.Continue, ast.Break)):
            add(i, node, "loop", None, f"{_text(node)} → {'break' if isinstance(node, ast.Continue) else 'continue'}")
        if isinstance(node, (ast.If, ast.While, ast.IfExp)) and not isinstance(node.test, (ast.Compare, ast.BoolOp)) \
                and not (isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)) \
                and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            add(i, node.test, "negate", None, f"{_text(node.test)} → not ({_text(node.test)})")
        if isinstance(node, ast.comprehension):
            for j, cond in enumerate(node.ifs):
                if not isinstance(cond, (ast.Compare, ast.BoolOp, ast.UnaryOp)):
                    add(i, cond, "negif", j, f"... if {_text(cond)} → if not ({_text(cond)})")
        if isinstance(node, ast.stmt) and _removable(node):
            add(i, node, "remove", None, f"remove `{_text(node)}`")
    return found


def _removable(node: ast.stmt) -> bool:
    if isinstance(node, ast.Expr):
        return not isinstance(node.value, ast.Constant)
    if isinstance(node, (ast.Raise, ast.AugAssign, ast.Delete)):
        return True
    if isinstance(node, ast.Assign):
        return any(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets)
    return False


def _replace(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for field, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, field, new)
            return
        if isinstance(value, list):
            for k, item in enumerate(value):
                if item is old:
                    value[k] = new
                    return
    raise ValueError("node not found in its parent")


def mutated_tree(m: Mutant) -> ast.Module:
    """The module's tree with the mutant applied."""
    tree = ast.parse(source_path(m.module).read_text())
    nodes = list(ast.walk(tree))
    parents = {id(child): node for node in nodes for child in ast.iter_child_nodes(node)}
    node = nodes[m.node]

    def put(new):
        _replace(parents[id(node)], node, ast.copy_location(new, node))

    if m.kind == "cmp":
        j, new = int(m.arg[0]), m.arg[1:]
        node.ops[j] = getattr(ast, new)()
    elif m.kind == "boolop":
        node.op = getattr(ast, m.arg)()
    elif m.kind == "drop":
        rest = [v for j, v in enumerate(node.values) if j != m.arg]
        put(rest[0] if len(rest) == 1 else ast.BoolOp(node.op, rest))
    elif m.kind == "unnot":
        put(node.operand)
    elif m.kind in ("binop", "augop"):
        node.op = getattr(ast, m.arg)()
    elif m.kind == "const":
        node.value = (not node.value) if type(node.value) is bool else node.value + 1
    elif m.kind == "swap":
        node.args[0], node.args[1] = node.args[1], node.args[0]
    elif m.kind == "name":
        node.func = ast.copy_location(ast.Name(m.arg, ast.Load()), node.func)
    elif m.kind == "return":
        node.value = ast.copy_location(ast.Constant(None), node.value)
    elif m.kind == "loop":
        put(ast.Break() if isinstance(node, ast.Continue) else ast.Continue())
    elif m.kind == "negate":
        node.test = ast.copy_location(ast.UnaryOp(ast.Not(), node.test), node.test)
    elif m.kind == "negif":
        cond = node.ifs[m.arg]
        node.ifs[m.arg] = ast.copy_location(ast.UnaryOp(ast.Not(), cond), cond)
    elif m.kind == "remove":
        put(ast.Pass())
    else:
        raise ValueError(m.kind)
    return ast.fix_missing_locations(tree)


def all_mutants() -> list[Mutant]:
    return [m for module in CORE for m in mutants(module)]


# ---- which tests cover which lines ------------------------------------------------------------------------------

def _digest() -> str:
    """What the coverage depends on: the core modules and the test files."""
    h = hashlib.sha256()
    for path in sorted([source_path(m) for m in CORE] + [REPO / "tests" / f"{t}.py" for t in TESTS]):
        if path.exists():
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


class _LineCoverage:
    """pytest plugin: per test, the (module, line) of the core it executes, and its duration."""

    def __init__(self):
        self.files = {str(source_path(m)): m for m in CORE}
        self.lines: dict[str, set] = {}
        self.seconds: dict[str, float] = {}
        self.current: set | None = None
        self.at_import: set = set()
        self.failed: list[str] = []
        sys.settrace(self._global)

    def _global(self, frame, event, arg):
        module = self.files.get(frame.f_code.co_filename)
        if module is None:
            return None
        target = self.current if self.current is not None else self.at_import

        def local(frame, event, arg):
            if event == "line":
                target.add((module, frame.f_lineno))
            return local

        target.add((module, frame.f_code.co_firstlineno))
        return local

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = set()
        sys.settrace(self._global)
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            self.seconds[item.nodeid] = time.perf_counter() - start
            self.lines[item.nodeid] = self.current
            self.current = None

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid)


def coverage(force: bool = False) -> dict:
    """The per-test coverage of the current tree (cached by the content of the core and the test files), recorded
    in a forked child: this process must not import routekit, or no mutant's child would import its mutant."""
    path = CACHE / f"coverage-{_digest()}.json"
    if force or not path.exists():
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _record_coverage(path)
                code = 0
            finally:
                os._exit(code)
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            sys.exit("recording the coverage failed")
    return json.loads(path.read_text())


def _record_coverage(path: Path) -> None:
    os.chdir(REPO)
    plugin = _LineCoverage()
    files = [f"tests/{t}.py" for t in TESTS if (REPO / "tests" / f"{t}.py").exists()]
    start = time.perf_counter()
    code = pytest.main([*files, "-q", "-p", "no:cacheprovider", "-W", "ignore"], plugins=[plugin])
    sys.settrace(None)
    if code != 0 or plugin.failed:
        raise SystemExit(f"the tests fail without any mutant ({plugin.failed}); fix them first")
    data = {"tests": {t: {"seconds": s, "lines": sorted(plugin.lines[t])} for t, s in plugin.seconds.items()},
            "at_import": sorted(plugin.at_import), "seconds": time.perf_counter() - start}
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    print(f"coverage of {len(data['tests'])} tests in {data['seconds']:.0f} s -> {path}", flush=True)


def _covered_index(cov: dict) -> dict:
    """{(module, line): [tests that run it]}."""
    index = defaultdict(list)
    for t, d in cov["tests"].items():
        for module, line in d["lines"]:
            index[(module, line)].append(t)
    return index


def choose(cov: dict, index: dict, m: Mutant, budget: float) -> list[tuple[str, float]]:
    """(test, baseline seconds) of the tests that run the mutant's lines (every test, for a line run at import),
    fastest first, as many as fit `budget` seconds (at least one; every one with budget 0)."""
    lines = {(m.module, line) for line in range(m.line, m.end_line + 1)}
    if lines & {tuple(x) for x in cov["at_import"]}:
        tests = set(cov["tests"])
    else:
        tests = {t for key in lines for t in index.get(key, ())}
    ordered = sorted(((t, cov["tests"][t]["seconds"]) for t in tests), key=lambda td: (td[1], td[0]))
    if budget <= 0:
        return ordered
    chosen, total = [], 0.0
    for t, s in ordered:
        if chosen and total + s > budget:
            break
        chosen.append((t, s))
        total += s
    return chosen


# ---- running one mutant -----------------------------------------------------------------------------------------

class _MutatedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one routekit module from a mutated syntax tree instead of its file."""

    def __init__(self, name: str, path: Path, code):
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(self.code, module.__dict__)


class _Select:
    """pytest plugin for a mutant's run: only the chosen tests, in the chosen order; the first failure recorded."""

    def __init__(self, order: list[str]):
        self.order = {t: k for k, t in enumerate(order)}
        self.failed: str | None = None

    def pytest_collection_modifyitems(self, session, config, items):
        items[:] = sorted((i for i in items if i.nodeid in self.order), key=lambda i: self.order[i.nodeid])

    def pytest_runtest_logreport(self, report):
        if report.failed and self.failed is None:
            self.failed = report.nodeid


def _preload() -> None:
    """Import once, in the parent, what every child needs but routekit and the tests: a child then starts fast."""
    import hypothesis  # noqa: F401
    import networkx  # noqa: F401
    import pydantic  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401
    import torch.fx  # noqa: F401

    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    torch.set_num_threads(1)
    from hypothesis import Phase, settings

    # the same examples as CI, without shrinking: a failure is all a mutant's run needs
    settings.register_profile("mutation", derandomize=True, database=None, deadline=None,
                              phases=(Phase.explicit, Phase.reuse, Phase.generate))


def run_one(m: Mutant, tests: list[tuple[str, float]], timeout: float) -> tuple[str, str | None, float]:
    """(outcome, first failing test, seconds) of one mutant in a forked child."""
    if not tests:
        return "uncovered", None, 0.0
    code = compile(mutated_tree(m), str(source_path(m.module)), "exec")
    report = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
    report.close()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: the mutant in place, then the tests
        status = 3
        try:
            os.environ["HYPOTHESIS_PROFILE"] = "mutation"
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            sys.meta_path.insert(0, _MutatedModule(f"routekit.{m.module}", source_path(m.module), code))
            names = [t for t, _ in tests]
            files = sorted({t.split("::")[0] for t in names})
            select = _Select(names)
            status = pytest.main([*files, "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore"], plugins=[select])
            Path(report.name).write_text(json.dumps({"failed": select.failed}))
        finally:
            os._exit(int(status))
    deadline = start + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.perf_counter() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.unlink(report.name)
            return "timeout", None, time.perf_counter() - start
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    try:
        failed = json.loads(Path(report.name).read_text() or "{}").get("failed")
    except (OSError, ValueError):
        failed = None
    os.unlink(report.name)
    if code == 0:
        return "survived", None, seconds
    if code == 5:  # no test collected: the chosen tests are gone
        return "uncovered", None, seconds
    return "killed", failed or f"pytest exit {code} (collection or import failed)", seconds


# ---- the commands -----------------------------------------------------------------------------------------------

def sample(every: list[Mutant], size: int | None, seed: int) -> list[Mutant]:
    """A deterministic sample, stratified by module: each module's share of `size`, drawn with `seed`."""
    if size is None or size >= len(every):
        return every
    by_module = defaultdict(list)
    for m in every:
        by_module[m.module].append(m)
    rng = random.Random(seed)
    chosen = []
    for module in CORE:
        group = by_module[module]
        k = round(size * len(group) / len(every))
        chosen += sorted(rng.sample(group, k), key=lambda m: m.node)
    return chosen


def _load() -> dict:
    path = RESULTS / "mutation.json"
    return json.loads(path.read_text()) if path.exists() else {}


def command_run(args) -> None:
    from benchmarks.common import machine

    every = all_mutants()
    by_id = {m.id: m for m in every}
    previous = _load()
    if args.only_survivors:
        ids = [r["id"] for r in previous["mutants"] if r["status"] in ("survived", "uncovered")]
        todo = [by_id[i] for i in ids]
    elif args.only:
        todo = [by_id[i] for i in args.only]
    else:
        todo = sample(every, args.sample, args.seed)
    cov = coverage()
    index = _covered_index(cov)
    _preload()
    os.chdir(REPO)
    if any(name == "routekit" or name.startswith("routekit.") for name in sys.modules):
        sys.exit("routekit is imported in this process: the mutants' children would run the unmutated code")
    records = {r["id"]: r for r in previous.get("mutants", [])} if (args.only_survivors or args.only) else {}
    start = time.perf_counter()
    for k, m in enumerate(todo):
        tests = choose(cov, index, m, args.budget)
        baseline = sum(s for _, s in tests)
        status, killer, seconds = run_one(m, tests, timeout=2 * baseline + 20)
        record = records.get(m.id, {"id": m.id, "module": m.module, "line": m.line, "kind": m.kind,
                                    "mutation": m.description, "runs": []})
        record["runs"].append({"status": status, "killer": killer, "tests": len(tests), "seconds": round(seconds, 2),
                               "budget": args.budget})
        record["status"], record["killer"] = status, killer
        records[m.id] = record
        print(f"[{k + 1}/{len(todo)}] {status:9s} {seconds:5.1f}s {len(tests):3d} tests  {m.id}  {m.description}",
              flush=True)
    elapsed = time.perf_counter() - start
    runs = previous.get("runs", []) if (args.only_survivors or args.only) else []
    runs.append({**machine(), "mutants": len(todo), "seconds": round(elapsed), "budget": args.budget,
                 "sample": args.sample, "seed": args.seed, "coverage_seconds": round(cov["seconds"]),
                 "tests": len(cov["tests"])})
    generated = defaultdict(int)
    for m in every:
        generated[m.module] += 1
    data = {"generated": dict(generated), "runs": runs, "mutants": sorted(records.values(), key=_order)}
    write_report(data)


def _order(record: dict):
    return CORE.index(record["module"]), record["line"], record["id"]


def write_report(data: dict) -> None:
    """mutation.json and mutation.md: the runs' records with each survivor's verdict (`EQUIVALENT`, `BUGS`) and
    the scores per module."""
    for r in data["mutants"]:
        r.pop("equivalent", None), r.pop("bug", None)
        if r["status"] in ("survived", "uncovered") and r["id"] in EQUIVALENT:
            r["equivalent"] = EQUIVALENT[r["id"]]
        if r["status"] in ("survived", "uncovered") and r["id"] in BUGS:
            r["bug"] = BUGS[r["id"]]
    data["summary"] = {}
    rows, survivors = [], []
    totals = defaultdict(int)
    for module in CORE:
        records = [r for r in data["mutants"] if r["module"] == module]
        count = defaultdict(int)
        for r in records:
            status = r["status"]
            if status in ("survived", "uncovered") and r["id"] in EQUIVALENT:
                status = "equivalent"
            count[status] += 1
            if r["status"] in ("survived", "uncovered"):
                survivors.append(r)
            first = r["runs"][0]["status"]
            if first in ("survived", "uncovered") and status in ("killed", "timeout"):
                count["killed_by_new_tests"] += 1
        detected = count["killed"] + count["timeout"]
        judged = len(records) - count["equivalent"]
        score = f"{100 * detected / judged:.1f}%" if judged else "–"
        first_detected = detected - count["killed_by_new_tests"]
        first_score = f"{100 * first_detected / judged:.1f}%" if judged else "–"
        data["summary"][module] = {"generated": data["generated"][module], "sampled": len(records),
                                   **{k: count[k] for k in ("killed", "timeout", "survived", "uncovered", "equivalent",
                                                            "killed_by_new_tests")},
                                   "score_before": first_score, "score": score}
        rows.append(f"| {module} | {data['generated'][module]} | {len(records)} | {count['killed']} | {count['timeout']} "
                    f"| {count['survived']} | {count['uncovered']} | {count['equivalent']} | "
                    f"{count['killed_by_new_tests']} | {first_score} | {score} |")
        for key in ("killed", "timeout", "survived", "uncovered", "equivalent", "killed_by_new_tests"):
            totals[key] += count[key]
        totals["sampled"] += len(records)
        totals["generated"] += data["generated"][module]
    judged = totals["sampled"] - totals["equivalent"]
    detected = totals["killed"] + totals["timeout"]
    rows.append(f"| **all** | {totals['generated']} | {totals['sampled']} | {totals['killed']} | {totals['timeout']} | "
                f"{totals['survived']} | {totals['uncovered']} | {totals['equivalent']} | {totals['killed_by_new_tests']} "
                f"| {100 * (detected - totals['killed_by_new_tests']) / judged:.1f}% | **{100 * detected / judged:.1f}%** |")
    first = data["runs"][0]
    killed_later = [r for r in data["mutants"] if r["runs"][0]["status"] in ("survived", "uncovered")
                    and r["status"] in ("killed", "timeout")]
    lines = ["# Mutation testing of the route core", "",
             "What share of small wrong changes to routekit's route core (trace, analysis, plan, rewrite, model, routing, "
             "selectors, verify, dar, hooks, record) the tests notice. How the mutants are made and run: "
             "`benchmarks/mutation.py`'s docstring.", "",
             "| module | mutants generated | sampled | killed | timeout | survived | uncovered | equivalent | "
             "killed by new tests | score before | score now |",
             "|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
             "Score: (killed + timeout) / (sampled − equivalent). *Score before*: by the tests as they were "
             "(tests/test_mutants.py absent); *score now*: with it.", "",
             "## How", "",
             f"- Mutants: every operator mutation of the eleven modules ({totals['generated']}); run: a sample of "
             f"{totals['sampled']}, drawn per module in proportion to its mutants with `random.Random({first['seed']})` "
             "(`sample`); the survivors then ran again with tests/test_mutants.py.",
             f"- Tests per mutant: those of {', '.join(f'tests/{t}.py' for t in TESTS)} that run a mutated line, "
             f"fastest first, up to {first['budget']:g} s of their baseline time, stopping at the first failure. The "
             "slower files (real models, recipes, kernels, distributed, compile) are not run: a survivor may be one "
             "that only they kill, and is then killed here by a fast test of its own.",
             f"- {NOTES}", "", "## Runs", ""]
    for run in data["runs"]:
        lines.append(f"- `{run['command']}`: {run['mutants']} mutants in {run['seconds']} s ({run['device']}, "
                     f"torch {run['torch']}, python {run['python']}, commit {run['commit']}, {run['date']}); the "
                     f"coverage of its {run['tests']} tests (recorded once per tree) took {run['coverage_seconds']} s")
    lines += ["", "## Survivors killed by the new tests (tests/test_mutants.py)", "",
              "| mutant | change | killed by |", "|---|---|---|"]
    lines += [f"| `{r['id']}` | {_code(r['mutation'])} | `{r['killer'].split('::')[-1]}` |" for r in killed_later]
    lines += ["", "## Equivalent mutants", "", "| mutant | change | why no test can kill it |", "|---|---|---|"]
    lines += [f"| `{r['id']}` | {_code(r['mutation'])} | {EQUIVALENT[r['id']]} |" for r in survivors
              if r["id"] in EQUIVALENT]
    lines += ["", "## Survivors that reveal a fault of the code (reported, not fixed)", "", "| mutant | change | fault |",
              "|---|---|---|"]
    lines += [f"| `{r['id']}` | {_code(r['mutation'])} | {BUGS[r['id']]} |" for r in survivors if r["id"] in BUGS]
    rest = [r for r in survivors if r["id"] not in EQUIVALENT and r["id"] not in BUGS]
    if rest:
        lines += ["", "## Survivors not yet explained", "", "| mutant | change |", "|---|---|"]
        lines += [f"| `{r['id']}` | {_code(r['mutation'])} |" for r in rest]
    data["summary"]["all"] = {"generated": totals["generated"], "sampled": totals["sampled"],
                              **{k: totals[k] for k in ("killed", "timeout", "survived", "uncovered", "equivalent",
                                                        "killed_by_new_tests")},
                              "score_before": f"{100 * (detected - totals['killed_by_new_tests']) / judged:.1f}%",
                              "score": f"{100 * detected / judged:.1f}%"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mutation.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    (RESULTS / "mutation.md").write_text("\n".join(lines) + "\n")


def _code(text: str) -> str:
    """Markdown inline code for text that may hold backticks."""
    return "`` " + text.replace("|", "\\|") + " ``"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="count the mutants per module")
    sub.add_parser("coverage", help="record which tests run which core lines (cached)")
    run = sub.add_parser("run", help="run mutants")
    run.add_argument("--sample", type=int, default=None, help="mutants to draw (stratified by module); default all")
    run.add_argument("--seed", type=int, default=21)
    run.add_argument("--budget", type=float, default=8.0,
                     help="seconds of baseline test time per mutant (fastest covering tests first); 0: all")
    run.add_argument("--only", nargs="+", help="these mutant ids")
    run.add_argument("--only-survivors", action="store_true", help="the survivors of benchmarks/results/mutation.json")
    sub.add_parser("report", help="rewrite mutation.md from mutation.json")
    show = sub.add_parser("show", help="print a mutant's code")
    show.add_argument("id")
    args = parser.parse_args()
    if args.command == "list":
        counts = defaultdict(int)
        for m in all_mutants():
            counts[m.module] += 1
        print(dict(counts), sum(counts.values()))
    elif args.command == "coverage":
        coverage(force=True)
    elif args.command == "run":
        command_run(args)
    elif args.command == "report":
        write_report(_load())
    elif args.command == "show":
        m = {m.id: m for m in all_mutants()}[args.id]
        new = ast.unparse(mutated_tree(m)).splitlines()
        old = ast.unparse(ast.parse(source_path(m.module).read_text())).splitlines()
        import difflib

        print("\n".join(difflib.unified_diff(old, new, lineterm="", n=2)))


if __name__ == "__main__":
    main()

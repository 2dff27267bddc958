"""Command line: `routekit inspect MODULE:FACTORY`, `routekit demo` (also `python -m routekit ...`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

from .config import DAR, Route
from .errors import RoutekitError


def _routes(text: str | None):
    """`default`, or `start:end[:rate[:selector[:sprint]]]` separated by commas (`sprint`: SPRINT's fused end)."""
    if text in (None, "", "none"):
        return None
    if text == "default":
        return "default"
    routes = []
    for part in text.split(","):
        fields = part.split(":")
        if not 2 <= len(fields) <= 5 or (len(fields) == 5 and fields[4] != "sprint"):
            raise RoutekitError(f"--routes {part!r}: expected start:end[:rate[:selector[:sprint]]], e.g. 2:8, "
                                "2:8:0.5:random or 2:-3:0.75:random:sprint (SPRINT's fused end)")
        try:
            kw = {"start": int(fields[0]), "end": int(fields[1])}
            if len(fields) > 2:
                kw["rate"] = float(fields[2])
        except ValueError:
            raise RoutekitError(f"--routes {part!r}: start and end are block indices and rate a number in [0, 1), "
                                "e.g. 2:8:0.5") from None
        if len(fields) > 3:
            kw["selector"] = fields[3]
        if len(fields) > 4:
            kw["fuse"] = "sprint"
        routes.append(Route(**kw))
    return routes


def _grid(text: str | None):
    """`H,W` or `T,H,W`."""
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        raise RoutekitError(f"--grid {text!r}: expected the token grid as H,W or T,H,W, e.g. 16,16") from None


def _dar(text: str | None):
    """`static`, `static_t` or `dynamic`, optionally `:chunk`."""
    if text is None:
        return None
    query, _, chunk = text.partition(":")
    try:
        return DAR(query=query, chunk=int(chunk) if chunk else None)
    except ValueError:
        raise RoutekitError(f"--dar {text!r}: expected a query (static, static_t, dynamic) and optionally a chunk "
                            "size, e.g. static_t:4") from None


def _callable(spec: str, what: str):
    """`package.module:name` → (the callable, its module), the module imported from the current folder too
    (as `python -c` would: the `routekit` script itself does not look there)."""
    if ":" not in spec:
        raise RoutekitError(f"{what}: expected MODULE:NAME (e.g. mymodel:Tiny for Tiny in ./mymodel.py), got {spec!r}")
    module_name, name = spec.split(":", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RoutekitError(f"{what}: cannot import {module_name!r} ({err}); give a module in this folder "
                            f"({os.getcwd()}) or one that is installed") from None
    if not callable(getattr(module, name, None)):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise RoutekitError(f"{what}: {module_name} has no {name!r}; callables there: {', '.join(names)}")
    return getattr(module, name), module


def _shapes(texts: list[str]) -> tuple[torch.Tensor, ...]:
    """`--shape 4,3,32,32` (once per positional input) → random float tensors of those shapes."""
    try:
        return tuple(torch.randn(*(int(v) for v in text.replace("x", ",").split(","))) for text in texts)
    except ValueError:
        raise RoutekitError(f"--shape {' '.join(texts)!r}: expected each input's shape as sizes separated by commas, "
                            "e.g. --shape 4,3,32,32") from None


def _example(model, module, args) -> tuple:
    """The example call `inspect` traces: random tensors of the --shape sizes, --inputs MODULE:FN(model, batch), or
    the model's module's own example_inputs(model, batch)."""
    if args.shape:
        return _shapes(args.shape)
    if args.inputs:
        make, _ = _callable(args.inputs, "--inputs")
    elif callable(getattr(module, "example_inputs", None)):
        make = module.example_inputs
    else:
        raise RoutekitError(f"{module.__name__} defines no example_inputs(model, batch): give the example call's input "
                            "shapes (--shape 4,3,32,32, once per positional input) or a function that makes them "
                            "(--inputs MODULE:FN, called as FN(model, batch))")
    example = make(model, args.batch)
    return example if isinstance(example, tuple) else (example,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="routekit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="print what routekit finds in a model (and draw it)")
    ins.add_argument("target", help="MODULE:FACTORY (the factory called without arguments gives the model), e.g. "
                     "mymodel:Tiny for ./mymodel.py")
    ins.add_argument("--shape", action="append", metavar="SIZES",
                     help="an example input's shape, e.g. 4,3,32,32 (once per positional input; random values)")
    ins.add_argument("--inputs", metavar="MODULE:FN", help="FN(model, batch) gives the example call's inputs "
                     "(default: the model module's own example_inputs)")
    ins.add_argument("--batch", type=int, default=2, help="the batch --inputs or example_inputs is asked for")
    ins.add_argument("--routes", default=None, help="'default' or start:end[:rate[:selector[:sprint]]],...")
    ins.add_argument("--stack", default=None, help="the block container to route, where several chains exist")
    ins.add_argument("--grid", default=None, help="the token grid H,W (or T,H,W) where none is found")
    ins.add_argument("--dar", default=None, help="plan DAR too: static, static_t or dynamic[:chunk]")
    ins.add_argument("--draw", default=None, metavar="PNG")
    demo = sub.add_parser("demo", help="inspect, route, verify and time a small DiT on this machine")
    demo.add_argument("--steps", type=int, default=6, help="timed steps of each model (at least 5)")
    demo.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            from .inspection import inspect

            factory, module = _callable(args.target, "inspect")
            model = factory()
            report = inspect(model, _example(model, module, args), routes=_routes(args.routes),
                             residual=_dar(args.dar), grid=_grid(args.grid), stack=args.stack)
            print(report)
            if args.draw:
                print(f"drew {report.draw(args.draw)}")
        else:
            from .demo import run_demo

            if args.steps < 5:
                raise RoutekitError(f"--steps {args.steps}: the demo times at least 5 steps of each model, or their "
                                    "median says nothing; give --steps 5 or more")
            run_demo(steps=args.steps, batch=args.batch)
    except RoutekitError as err:
        print(f"routekit: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

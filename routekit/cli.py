"""Command line: `routekit inspect MODULE:FACTORY`, `routekit demo` (also `python -m routekit ...`)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .config import DAR, Route
from .errors import RoutekitError


def _routes(text: str | None):
    """`default`, or `start:end[:rate[:selector]]` separated by commas."""
    if text in (None, "", "none"):
        return None
    if text == "default":
        return "default"
    routes = []
    for part in text.split(","):
        fields = part.split(":")
        if not 2 <= len(fields) <= 4:
            raise RoutekitError(f"--routes {part!r}: expected start:end[:rate[:selector]], e.g. 2:8 or 2:8:0.5:random")
        try:
            kw = {"start": int(fields[0]), "end": int(fields[1])}
            if len(fields) > 2:
                kw["rate"] = float(fields[2])
        except ValueError:
            raise RoutekitError(f"--routes {part!r}: start and end are block indices and rate a number in [0, 1), "
                                "e.g. 2:8:0.5") from None
        if len(fields) > 3:
            kw["selector"] = fields[3]
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


def _load(spec: str):
    """`package.module:factory` → (model, module) with the factory called without arguments."""
    if ":" not in spec:
        raise RoutekitError(f"expected MODULE:FACTORY (e.g. backbones.dit:DiT_S_2), got {spec!r}")
    module_name, factory = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RoutekitError(f"cannot import {module_name!r} ({err}); give a module importable from here "
                            "(run from the folder that holds it, or pip install it)") from None
    if not callable(getattr(module, factory, None)):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise RoutekitError(f"{module_name} has no {factory!r}; callables there: {', '.join(names)}")
    return getattr(module, factory)(), module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="routekit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="print what routekit finds in a model (and draw it)")
    ins.add_argument("target", help="MODULE:FACTORY; the module must define example_inputs(model, batch)")
    ins.add_argument("--batch", type=int, default=2)
    ins.add_argument("--routes", default=None, help="'default' or start:end[:rate[:selector]],...")
    ins.add_argument("--stack", default=None, help="the block container to route, where several chains exist")
    ins.add_argument("--grid", default=None, help="the token grid H,W (or T,H,W) where none is found")
    ins.add_argument("--dar", default=None, help="plan DAR too: static, static_t or dynamic[:chunk]")
    ins.add_argument("--draw", default=None, metavar="PNG")
    demo = sub.add_parser("demo", help="inspect, route, verify and time DiT-S/2 on this machine")
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            from .inspection import inspect

            model, module = _load(args.target)
            if not hasattr(module, "example_inputs"):
                raise RoutekitError(f"{module.__name__} defines no example_inputs(model, batch) to trace with")
            report = inspect(model, module.example_inputs(model, args.batch), routes=_routes(args.routes),
                             residual=_dar(args.dar), grid=_grid(args.grid), stack=args.stack)
            print(report)
            if args.draw:
                print(f"drew {report.draw(args.draw)}")
        else:
            from .demo import run_demo

            run_demo(steps=args.steps, batch=args.batch)
    except RoutekitError as err:
        print(f"routekit: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

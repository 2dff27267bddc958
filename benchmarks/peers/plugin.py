"""A pytest plugin that hands the peers' own tests routed models: `pytest -p benchmarks.peers.plugin`.

With RK_PEER_MODE=routed, every model of the classes RK_PEER_CLASSES names ("diffusers:FluxTransformer2DModel,…")
that a test builds, by calling the class, by `from_config` or by `from_pretrained`, is routed right after it is
built, as a user would route it: `rk.apply(model, routes=rk.Route(**RK_PEER_ROUTE), example_kwargs=inputs)`, with
the test's own dummy inputs (a diffusers tester's `get_dummy_inputs()`, a transformers tester's
`prepare_config_and_inputs_for_common()` through `_prepare_for_class`). The test then holds what `apply` returned:
a new object, or the model itself routed in place; either way the class call hands it back (its `__new__` builds
and routes, and `__init__` does not run twice).

What happened to each model goes to RK_PEER_EVENTS as JSON lines: "routed"; "refused" (routekit raised: the test
gets the error, as a user would); "unfit" (the tester's dummy inputs do not run on this model even unrouted, e.g.
a test that changed the config's sizes: the test keeps the model unrouted, and the result lists it). With
RK_PEER_MODE=plain nothing is patched: the same tests on the same tree, as their authors run them.

RK_PEER_INIT (JSON) updates a diffusers tester's `get_init_dict()` in both modes (a wider model than the tester's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import random
import sys

import pytest
import torch
import torch.utils._pytree as pytree

MODE = os.environ.get("RK_PEER_MODE", "plain")
EVENTS = os.environ.get("RK_PEER_EVENTS")
INIT = json.loads(os.environ.get("RK_PEER_INIT") or "{}")

_item: pytest.Item | None = None  # the test running now
_fresh: set[int] = set()  # objects the patched __new__ just built: their __init__ has run
_busy = 0  # > 0 while a patched class builds (from_pretrained's own construction is routed after loading)


def _event(kind: str, model_class: type, **fields) -> None:
    if EVENTS:
        with open(EVENTS, "a") as f:
            f.write(json.dumps({"test": _item.nodeid if _item else None, "event": kind,
                                "class": model_class.__name__, **fields}) + "\n")


@contextlib.contextmanager
def _rng_kept():
    """Preparing example inputs draws random numbers; the test must draw the same ones as in the plain run."""
    streams = [random] + [m.global_rng for name, m in list(sys.modules.items())
                          if name.endswith("test_modeling_common") and hasattr(m, "global_rng")]
    states = [s.getstate() for s in streams]
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            for s, state in zip(streams, states):
                s.setstate(state)
            if np_state is not None:
                np.random.set_state(np_state)


def example_kwargs(model_class: type) -> dict:
    """The running test's own dummy inputs for `model_class`."""
    test = getattr(_item, "instance", None)
    with _rng_kept():
        if hasattr(test, "get_dummy_inputs"):  # diffusers' BaseModelTesterConfig
            return dict(test.get_dummy_inputs())
        tester = getattr(test, "model_tester", None)
        if tester is not None and hasattr(tester, "prepare_config_and_inputs_for_common"):  # transformers
            _, inputs = tester.prepare_config_and_inputs_for_common()
            return dict(test._prepare_for_class(inputs, model_class))
    raise LookupError(f"no tester with dummy inputs for {model_class.__name__} in {_item.nodeid if _item else '?'}")


def _in_dtype(kwargs: dict, model: torch.nn.Module) -> dict:
    """The inputs in the model's floating dtype (a test that loads the model in float16 feeds it float16)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return kwargs
    dtype = dtypes.pop()
    cast = lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return pytree.tree_map(cast, kwargs)


def _runs_unrouted(model: torch.nn.Module, kwargs: dict) -> bool:
    training = model.training
    try:
        with _rng_kept(), torch.no_grad():
            model.eval()(**kwargs)
        return True
    except Exception:
        return False
    finally:
        model.train(training)


def route(model: torch.nn.Module) -> torch.nn.Module:
    """`model` routed as a user would route it; the model itself where the dummy inputs cannot drive it."""
    import routekit as rk

    cls = type(model)
    if any(p.is_meta for p in model.parameters()):
        _event("unfit", cls, message="built on the meta device (its weights come later)")
        return model
    try:
        kwargs = _in_dtype(example_kwargs(cls), model)
    except Exception as err:
        _event("unfit", cls, message=f"no dummy inputs: {type(err).__name__}: {err}")
        return model
    route_args = json.loads(os.environ.get("RK_PEER_ROUTE") or '{"start": 0, "end": 1, "rate": 0.5}')
    try:
        routed = rk.apply(model, routes=rk.Route(**route_args), example_kwargs=kwargs)
    except Exception as err:
        if not _runs_unrouted(model, kwargs):
            _event("unfit", cls, message=f"the tester's dummy inputs do not run on this model: {type(err).__name__}: "
                                         f"{str(err).splitlines()[0] if str(err) else ''}")
            return model
        _event("refused", cls, error=type(err).__name__, message=str(err))
        raise
    _event("routed", cls, same_object=routed is model, routed_class=type(routed).__name__)
    return routed


def _patch(cls: type) -> None:
    """Route every `cls` a test builds: by calling the class (and so `from_config`), or by `from_pretrained`."""
    original_init = cls.__init__

    def __new__(klass, *args, **kwargs):
        model = object.__new__(klass)
        if klass is not cls or _busy or not (args or kwargs):  # unpickling, copying, a subclass, a nested build
            return model
        with _building():
            original_init(model, *args, **kwargs)
        routed = route(model)
        if isinstance(routed, klass):  # type.__call__ runs its __init__ next: the patched one, which skips it
            _fresh.add(id(routed))
        return routed

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        if id(self) in _fresh:
            _fresh.discard(id(self))
            return
        original_init(self, *args, **kwargs)

    cls.__new__ = staticmethod(__new__)
    cls.__init__ = __init__
    if hasattr(cls, "from_pretrained"):
        loader = cls.from_pretrained.__func__

        @functools.wraps(loader)
        def from_pretrained(klass, *args, **kwargs):
            with _building():
                loaded = loader(klass, *args, **kwargs)
            if klass is not cls:
                return loaded
            if isinstance(loaded, tuple):  # output_loading_info=True
                return (route(loaded[0]), *loaded[1:])
            return route(loaded)

        cls.from_pretrained = classmethod(from_pretrained)


@contextlib.contextmanager
def _building():
    global _busy
    _busy += 1
    try:
        yield
    finally:
        _busy -= 1


def _classes() -> list[type]:
    found = []
    for spec in filter(None, os.environ.get("RK_PEER_CLASSES", "").split(",")):
        module, name = spec.split(":")
        found.append(getattr(importlib.import_module(module), name))
    return found


def pytest_configure(config):
    if MODE == "routed":
        for cls in _classes():
            _patch(cls)


def _widened(test) -> None:
    """RK_PEER_INIT over the tester's get_init_dict, once per tester class."""
    for klass in type(test).__mro__:
        get = klass.__dict__.get("get_init_dict")
        if get is None:
            continue
        if not getattr(get, "_rk_peer", False):
            @functools.wraps(get)
            def get_init_dict(self, *args, _get=get, **kwargs):
                return {**_get(self, *args, **kwargs), **INIT}

            get_init_dict._rk_peer = True
            klass.get_init_dict = get_init_dict
        return


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    global _item
    _item = item
    if INIT and getattr(item, "instance", None) is not None:
        _widened(item.instance)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _item
    yield
    _item = None

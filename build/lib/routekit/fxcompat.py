"""The private part of torch.fx that tracing with concrete values needs, detected per torch release.

trace.py runs every node as it records it, so while fx traces, real modules must run with fx's "symbolic
tracing" flag cleared (`not_fx_tracing`). torch keeps the flag privately and has moved it between releases; it
is detected here, with a fallback, so a torch release that moves it does not silently turn graph mode off.
(fx's nn.Module patches need nothing private: the tracer's own `call_module` and `getattr` pass real calls
through, see trace.py.)
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx


def _fx_flag_switch():
    """How to clear torch.fx's "symbolic tracing" flag while concrete values run.

    Under the flag a torch.compile'd module refuses to run ("Detected that you are using FX to symbolically
    trace a dynamo-optimized function") and ProxyableClassMeta classes build proxies. torch keeps the flag
    privately and has moved it (a module global up to 2.13, a thread-local behind `_is_fx_tracing_context`
    from 2.14), so each is detected, never assumed. Where neither exists, Dynamo's own switch for nested
    compiles (`force_compile_during_fx_trace`) lets compiled modules run under the flag.
    """
    fx_trace = torch.fx._symbolic_trace
    if callable(getattr(fx_trace, "_is_fx_tracing_context", None)):
        return "thread-local", lambda: fx_trace._is_fx_tracing_context(False)
    if isinstance(getattr(fx_trace, "_is_fx_tracing_flag", None), bool):
        return "module-global", lambda: _module_flag_cleared(fx_trace)
    return "dynamo-config", _dynamo_compiles_under_fx


@contextlib.contextmanager
def _module_flag_cleared(fx_trace):
    flag = fx_trace._is_fx_tracing_flag
    fx_trace._is_fx_tracing_flag = False
    try:
        yield
    finally:
        fx_trace._is_fx_tracing_flag = flag


def _dynamo_compiles_under_fx():
    import torch._dynamo

    return torch._dynamo.config.patch(force_compile_during_fx_trace=True, error_on_nested_fx_trace=False)


FX_FLAG_SWITCH, not_fx_tracing = _fx_flag_switch()

"""Every kernel entry point is held against its reference in ``routekit.kernels.naive`` (forward values
and gradients), and both obey DAR's laws.

Without CUDA the Triton kernels run in Triton's CPU interpreter; tensors stay small so the file
finishes in a few minutes on two cores.
"""

import copy
import dataclasses
import linecache
import math
import os

import torch

if not torch.cuda.is_available():
    # `triton.jit` chooses interpreter or compiler when a kernel module is imported, so this
    # must precede the first import of routekit.kernels.aggregation (conftest.py sets it too).
    # Triton being imported earlier, e.g. by torch._dynamo, is harmless: it reads the
    # variable lazily.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from routekit.errors import ConfigError, InputError  # noqa: E402
from routekit.kernels import (  # noqa: E402
    DarInputError,
    UnknownKernelError,
    aggregate,
    merge_with_stats,
    naive,
    source_logits,
    weighted_sum,
)
from routekit.kernels.launch import DEFAULTS, AggregateLaunch, aggregate_launch, parse_launch  # noqa: E402

triton = pytest.importorskip("triton")
from routekit.kernels import aggregation, merge, tables, weighted_sums  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(aggregation._dar_fwd_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "routekit.kernels.aggregation was imported before TRITON_INTERPRET=1 was set, so its kernels "
        "were compiled for a GPU this machine lacks; set the variable in tests/conftest.py",
        allow_module_level=True,
    )
if DEVICE == "cpu":
    from triton_interpreter import problem  # noqa: E402

    if problem():
        pytest.skip(problem(), allow_module_level=True)

# Largest error allowed, as a fraction of max(1, the largest magnitude in the expected tensor).
# fp32 runs the same fp32 math in another order; bf16 outputs and gradients may also round to
# the neighbouring bf16 value (one ulp is 2**-8 of the magnitude), so allow about two ulps.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# A bf16 mix's backward reads g . o from the bf16 output itself (as routekit's models run: the mix is
# bf16 and no fp32 copy is kept), one rounding the reference does not make: source gradients move by
# up to two bf16 steps, and the query gradient, a sum over rows and sources of w (g . v - g . o) v
# whose terms cancel, by up to ~2% of its largest value.
GRAD_BF16 = {"grad sources": 2e-2, "grad query": 3e-2}
FAST = settings(max_examples=25, deadline=None)
ELEMENT_BUDGET = 24_000  # S * B * N * D per example, to keep the interpreter quick


@dataclass(frozen=True)
class Case:
    """One random DAR problem; tensors are built from ``seed`` so shrinking stays meaningful."""

    s: int
    b: int
    n: int
    d: int
    dtype: torch.dtype
    query_shape: str  # "d", "b1d" or "bnd"
    as_list: bool
    query_scale: float
    seed: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stacked sources, query, output gradient) on DEVICE."""
        gen = torch.Generator().manual_seed(self.seed)
        scales = torch.exp(torch.randn(self.s, 1, 1, 1, generator=gen))
        sources = torch.randn(self.s, self.b, self.n, self.d, generator=gen) * scales
        b, n, d = self.b, self.n, self.d
        shape = {"d": (d,), "b1d": (b, 1, d), "bnd": (b, n, d)}[self.query_shape]
        query = torch.randn(shape, generator=gen) * self.query_scale
        grad = torch.randn(self.b, self.n, self.d, generator=gen)
        return tuple(t.to(DEVICE, self.dtype) for t in (sources, query, grad))


@st.composite
def cases(draw, dtypes=(torch.float32, torch.bfloat16)) -> Case:
    s = draw(st.integers(1, 64))
    d = draw(st.integers(1, 130))
    b = draw(st.integers(1, 3))
    n = min(draw(st.integers(1, 17)), max(1, ELEMENT_BUDGET // (s * b * d)))
    return Case(
        s=s,
        b=b,
        n=n,
        d=d,
        dtype=draw(st.sampled_from(dtypes)),
        query_shape=draw(st.sampled_from(["d", "b1d", "bnd"])),
        as_list=draw(st.booleans()),
        query_scale=draw(st.floats(0.0, 4.0)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def run(fn, sources: torch.Tensor, query: torch.Tensor, grad: torch.Tensor, as_list: bool):
    """Output and (stacked source gradient, query gradient) of ``fn`` on fresh leaves."""
    leaves = [v.clone().requires_grad_() for v in sources] if as_list else [sources.clone().requires_grad_()]
    q = query.clone().requires_grad_()
    out = fn(leaves if as_list else leaves[0], q)
    *grad_sources, grad_query = torch.autograd.grad(out, [*leaves, q], grad)
    return out, torch.stack(grad_sources) if as_list else grad_sources[0], grad_query


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    err = (actual.double() - expected.double()).abs().max().item()
    bound = rel * max(1.0, expected.double().abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def triton_kernel(sources, query, eps=1e-6):
    return aggregate(sources, query, eps, kernel="triton")


def torch_kernel(sources, query, eps=1e-6):
    return aggregate(sources, query, eps, kernel="torch")


BOTH = pytest.mark.parametrize("kernel", [torch_kernel, triton_kernel], ids=["torch", "triton"])
pytestmark = pytest.mark.one_end  # Triton's interpreter, the same Triton at both ends (Makefile: test-latest)


@FAST
@given(cases())
def test_triton_forward_and_gradients_equal_the_reference(case: Case):
    sources, query, grad = case.tensors()
    fused = run(triton_kernel, sources, query, grad, case.as_list)
    expected = run(naive.aggregate, sources, query, grad, case.as_list)
    for name, got, want in zip(("output", "grad sources", "grad query"), fused, expected):
        rel = GRAD_BF16.get(name, TOLERANCE[case.dtype]) if case.dtype == torch.bfloat16 else TOLERANCE[case.dtype]
        assert_close(got, want, rel, f"{name} of {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_reference_at_model_width(dtype):
    """D=1152 (SiT-XL) pads to 2048 lanes and puts two rows in a program, one of them masked."""
    case = Case(5, 1, 3, 1152, dtype, "d", True, 2.0, seed=7)
    fused = run(triton_kernel, *case.tensors(), as_list=True)
    expected = run(naive.aggregate, *case.tensors(), as_list=True)
    for name, got, want in zip(("output", "grad sources", "grad query"), fused, expected):
        assert_close(got, want, TOLERANCE[dtype], name)


@pytest.mark.parametrize(
    "layout",
    ["permuted stack", "stack slice with odd offset", "non-contiguous list", "query with stride"],
)
def test_triton_handles_any_memory_layout(layout):
    case = Case(6, 2, 5, 37, torch.float32, "bnd", layout.endswith("list"), 2.0, seed=3)
    sources, query, grad = case.tensors()
    if layout == "permuted stack":
        sources = sources.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "stack slice with odd offset":
        sources = torch.cat([sources[:1], sources])[1:]  # per-source slices start unaligned
    elif layout == "non-contiguous list":
        sources = torch.cat([sources, sources], dim=-1)[..., ::2]
    else:
        query = torch.cat([query, query], dim=-1)[..., ::2]
    fused = run(triton_kernel, sources, query, grad, case.as_list)
    expected = run(naive.aggregate, sources, query, grad, case.as_list)
    for name, got, want in zip(("output", "grad sources", "grad query"), fused, expected):
        assert_close(got, want, TOLERANCE[torch.float32], f"{name} ({layout})")


def test_triton_gradients_flow_to_whichever_inputs_need_them():
    case = Case(4, 2, 3, 16, torch.float32, "d", True, 1.0, seed=5)
    sources, query, grad = case.tensors()
    q = query.clone().requires_grad_()
    (fused,) = torch.autograd.grad(triton_kernel(list(sources), q), q, grad)
    (expected,) = torch.autograd.grad(naive.aggregate(list(sources), q), q, grad)
    assert_close(fused, expected, TOLERANCE[torch.float32], "grad query")
    leaves = [v.clone().requires_grad_() for v in sources]
    fused = torch.autograd.grad(triton_kernel(leaves, query), leaves, grad)
    expected = torch.autograd.grad(naive.aggregate(leaves, query), leaves, grad)
    assert_close(torch.stack(fused), torch.stack(expected), TOLERANCE[torch.float32], "grad sources")


@pytest.mark.parametrize("shared", [True, False], ids=["one allocation", "one each"])
def test_source_gradients_are_right_in_one_allocation_or_one_each(shared, monkeypatch):
    """Small sources get their gradients as views of one allocation (less host work per backward),
    large ones a tensor each (each freed as soon as it is consumed)."""
    monkeypatch.setattr(aggregation, "SHARED_GRAD_MAX_BYTES", 1 << 30 if shared else 0)
    sources, query, grad = Case(5, 2, 3, 24, torch.bfloat16, "d", True, 2.0, seed=13).tensors()
    leaves = [v.clone().requires_grad_() for v in sources]
    fused = torch.autograd.grad(triton_kernel(leaves, query), leaves, grad)
    expected = torch.autograd.grad(naive.aggregate(leaves, query), leaves, grad)
    assert_close(torch.stack(fused), torch.stack(expected), GRAD_BF16["grad sources"], "grad sources")
    storages = {g.untyped_storage().data_ptr() for g in fused}
    assert len(storages) == (1 if shared else len(fused))


def test_pointer_tables_are_built_once_per_set_of_addresses_and_stay_right(monkeypatch):
    """A backward finds its forward's table (same sources) in the cache; a table is keyed by the
    addresses it holds, so new tensors at new addresses get a new, right table, and the cache is bounded."""
    monkeypatch.setattr(tables, "_TABLES", {})
    monkeypatch.setattr(tables, "TABLE_CACHE_SIZE", 3)
    sources, query, grad = Case(4, 2, 3, 24, torch.float32, "d", True, 2.0, seed=5).tensors()
    leaves = [v.clone().requires_grad_() for v in sources]
    fused = torch.autograd.grad(triton_kernel(leaves, query), leaves, grad)
    first = dict(tables._TABLES)
    # forward sources, gradient buffers (one stacked allocation)
    assert len(first) == 2
    keys = [k[1:] for k in first]
    assert [v.data_ptr() for v in leaves] in [list(k) for k in keys]
    for key, (table, _) in first.items():
        assert table.tolist() == list(key[1:])
    again = [v.clone().requires_grad_() for v in sources]  # new addresses while the first are alive
    second = torch.autograd.grad(triton_kernel(again, query), again, grad)
    assert len(tables._TABLES) <= 3
    expected = torch.autograd.grad(naive.aggregate(leaves, query), leaves, grad)
    for got in (fused, second):
        assert_close(torch.stack(got), torch.stack(expected), TOLERANCE[torch.float32], "grad sources")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_a_captured_cuda_graph_stays_right_after_its_tables_leave_the_cache(monkeypatch):
    """A forward and backward captured in a CUDA graph (as torch.compile's reduce-overhead mode
    does) replays right on new input values, even after every cached pointer table was evicted and
    the pinned host memory its table copies came from was handed out again."""
    monkeypatch.setattr(tables, "_TABLES", {})
    monkeypatch.setattr(tables, "_GRAPH_TABLES", [])
    sources, query, grad = Case(6, 2, 5, 48, torch.float32, "d", True, 2.0, seed=11).tensors()
    leaves = [v.clone().requires_grad_() for v in sources]
    q = query.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture, as torch.cuda.make_graphed_callables does
            torch.autograd.grad(triton_kernel(leaves, q), [*leaves, q], grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_kernel(leaves, q)
        grads = torch.autograd.grad(out, [*leaves, q], grad)
    tables._TABLES.clear()
    junk = [torch.full((64,), -1, dtype=torch.int64).pin_memory() for _ in range(16)]
    new_sources, new_query, _ = Case(6, 2, 5, 48, torch.float32, "d", True, 2.0, seed=12).tensors()
    with torch.no_grad():
        for leaf, value in zip(leaves, new_sources):
            leaf.copy_(value)
        q.copy_(new_query)
    graph.replay()
    torch.cuda.synchronize()
    expected = run(naive.aggregate, new_sources, new_query, grad, as_list=True)
    got = (out, torch.stack(grads[:-1]), grads[-1])
    for name, g, w in zip(("output", "grad sources", "grad query"), got, expected):
        assert_close(g, w, TOLERANCE[torch.float32], name)
    del junk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_without_autograd_gives_the_same_output(dtype):
    """Under no_grad nothing is saved for backward and bf16 skips the fp32 output copy."""
    sources, query, _ = Case(9, 2, 7, 50, dtype, "b1d", True, 2.0, seed=11).tensors()
    with torch.no_grad():
        fused = triton_kernel(list(sources), query)
    assert_close(fused, naive.aggregate(list(sources), query), TOLERANCE[dtype], "no-grad output")


@BOTH
@FAST
@given(case=cases(dtypes=(torch.float32,)))
def test_zero_query_gives_the_uniform_mean_of_the_sources(kernel, case: Case):
    sources, query, _ = case.tensors()
    out = kernel(list(sources) if case.as_list else sources, torch.zeros_like(query))
    assert_close(out, sources.mean(0), TOLERANCE[torch.float32], "zero-query output")


# With eps=0 the zero rows that pad a program's last block divide by zero; they are never stored.
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning",
                            "ignore:All-NaN slice:RuntimeWarning")
@BOTH
@FAST
@given(case=cases(dtypes=(torch.float32,)), factor=st.floats(0.125, 8.0))
def test_scaling_all_sources_keeps_the_weights_so_the_output_scales(kernel, case: Case, factor: float):
    """RMSNorm makes each key scale-free (exactly so with eps=0), hence the softmax weights."""
    sources, query, _ = case.tensors()
    out = kernel(sources, query, eps=0.0)
    scaled = kernel(sources * factor, query, eps=0.0)
    assert_close(scaled, out * factor, TOLERANCE[torch.float32] * factor, "scaled output")


@BOTH
@FAST
@given(case=cases(dtypes=(torch.float32,)), data=st.data())
def test_source_order_does_not_matter(kernel, case: Case, data):
    sources, query, _ = case.tensors()
    order = data.draw(st.permutations(range(case.s)))
    assert_close(kernel(sources[order], query), kernel(sources, query), TOLERANCE[torch.float32], "permuted")


def test_auto_kernel_uses_the_triton_kernel_only_on_cuda():
    sources, query, _ = Case(3, 1, 2, 8, torch.float32, "d", False, 1.0, seed=1).tensors()
    expected = triton_kernel if DEVICE == "cuda" else naive.aggregate
    assert torch.equal(aggregate(sources, query), expected(sources, query))


def test_unknown_kernel_names_the_valid_ones():
    sources, query, _ = Case(2, 1, 2, 8, torch.float32, "d", False, 1.0, seed=1).tensors()
    with pytest.raises(UnknownKernelError, match="'cuda'.*auto, triton, torch") as info:
        aggregate(sources, query, kernel="cuda")
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


BAD_INPUTS = {
    "query of the wrong width": (lambda v, q: (v, q[..., :-1]), r"query must end in D=8"),
    "query batch that does not broadcast": (lambda v, q: (v, q.expand(3, 1, 8)), r"does not broadcast"),
    "3-D stacked sources": (lambda v, q: (v[0], q), r"stacked sources must be 4-D"),
    "empty source list": (lambda v, q: ([], q), r"at least one source"),
    "sources of different shapes": (lambda v, q: ([v[0], v[1, :, :1]], q), r"source 1 is \(2, 1, 8\)"),
}


@BOTH
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_shapes_are_rejected_with_a_message_naming_them(kernel, bad):
    sources, query, _ = Case(2, 2, 3, 8, torch.float32, "d", False, 1.0, seed=1).tensors()
    transform, message = BAD_INPUTS[bad]
    with pytest.raises(DarInputError, match=message) as info:
        kernel(*transform(sources, query))
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_a_compiled_aggregation_names_bad_inputs_as_an_eager_one_does(bad):
    """Under torch.compile a list of sources is checked by the op's fake, which runs as plain Python (Dynamo would
    step through the checks at every aggregation of a model): the trace stops with the same message."""
    sources, query, _ = Case(2, 2, 3, 8, torch.float32, "d", False, 1.0, seed=1).tensors()
    transform, message = BAD_INPUTS[bad]
    torch._dynamo.reset()
    compiled = torch.compile(lambda v, q: aggregate(v, q, kernel="triton"), backend="eager", fullgraph=True)
    v, q = transform(sources, query)
    with pytest.raises(Exception, match=message):  # a list, as routekit's graphs pass it, where it is one
        compiled(list(v.unbind(0)) if isinstance(v, torch.Tensor) and v.dim() == 4 else v, q)


def test_triton_kernel_stays_inside_a_compiled_graph():
    """A custom op, not a graph break: fullgraph=True compiles it, and forward and gradients hold."""
    sources, query, grad = Case(4, 2, 3, 24, torch.float32, "b1d", True, 2.0, seed=9).tensors()
    torch._dynamo.reset()
    compiled = torch.compile(lambda v, q: aggregate(v, q, kernel="triton"), backend="aot_eager", fullgraph=True)
    got = run(compiled, sources, query, grad, as_list=True)
    expected = run(naive.aggregate, sources, query, grad, as_list=True)
    for name, g, w in zip(("output", "grad sources", "grad query"), got, expected):
        assert_close(g, w, TOLERANCE[torch.float32], name)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bf16_sources_mix_into_the_requested_dtype(out_dtype):
    """DAR keeps bf16 sources (autocast) but returns the residual stream's dtype."""
    sources, query, grad = Case(6, 2, 5, 40, torch.bfloat16, "d", True, 2.0, seed=4).tensors()
    for kernel in ("triton", "torch"):
        fn = lambda v, q, kernel=kernel: aggregate(v, q, kernel=kernel, out_dtype=out_dtype)  # noqa: E731
        out, grad_sources, grad_query = run(fn, sources, query, grad.to(out_dtype), as_list=True)
        assert out.dtype == out_dtype and grad_sources.dtype == torch.bfloat16
        want = naive.aggregate(list(sources), query, out_dtype=torch.float64)
        assert_close(out.double(), want, TOLERANCE[torch.bfloat16], f"{kernel} output")


@pytest.mark.parametrize("shared_grads", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_pass_torch_library_opcheck(out_dtype, shared_grads, monkeypatch):
    """Schema, fake (meta) kernels and autograd registration agree with the real kernels, also for a
    source laid out column-major, as torch.compile may hand one over: a fake that copied its strides
    once promised a layout the kernel does not write."""
    monkeypatch.setattr(aggregation, "SHARED_GRAD_MAX_BYTES", 1 << 30 if shared_grads else 0)
    sources, query, grad = Case(3, 2, 5, 24, torch.bfloat16, "b1d", True, 2.0, seed=2).tensors()
    sources = [s.clone() for s in sources]
    sources[1] = sources[1].transpose(1, 2).contiguous().transpose(1, 2)  # strides (N*D, 1, N)
    sources = [s.requires_grad_() for s in sources]
    query = query.float().requires_grad_()
    launch = parse_launch("aggregate", "1,2,1,2,1,0").as_list()  # one row, two sources a tile: the last half padding
    args = (sources, query, 1e-6, out_dtype, True, launch)
    torch.library.opcheck(aggregation.aggregate_op, args)
    out, o32, lse, _ = aggregation.aggregate_op(*args)
    saved = o32 if o32.numel() else out
    backward_args = ([s.detach() for s in sources], query.detach(), grad.to(out_dtype), saved.detach(), lse.detach(),
                     1e-6, launch)
    torch.library.opcheck(aggregation.aggregate_backward_op, backward_args)


@pytest.mark.parametrize("query_shape", ["d", "b1d", "bnd"])
def test_source_tiles_and_the_fused_reduction_equal_the_reference(query_shape):
    """Sources reduced several at a time (a padded last tile), through one multi-operand tl.reduce
    in the interpreter (on the GPU only 2048-lane rows use it, tested at model width above)."""
    sources, query, grad = Case(5, 2, 8, 12, torch.float32, query_shape, True, 2.0, seed=6).tensors()
    launch = parse_launch("aggregate", f"2,2,1,4,1,{int(DEVICE == 'cpu')}")
    fused = run(lambda v, q: aggregation.aggregate_triton(v, q, launch=launch), sources, query, grad, True)
    expected = run(naive.aggregate, sources, query, grad, True)
    for name, got, want in zip(("output", "grad sources", "grad query"), fused, expected):
        assert_close(got, want, TOLERANCE[torch.float32], f"{name} ({query_shape})")


def test_every_launch_is_parsed_from_its_form_or_refused_naming_it():
    """One parser for every kernel's launch (what benchmarks/dar_kernel.py --launch takes): "aggregate"
    keeps the default merges; a value of the wrong count, type or size is refused with the form."""
    agg = parse_launch("aggregate", "2,1,4,2,8,0")
    assert agg.generic() == [2, 1, 4, 2, 8, 0]
    assert (agg.merge_fwd, agg.merge_bwd) == (DEFAULTS["merge_fwd"], DEFAULTS["merge_bwd"])
    assert AggregateLaunch.from_list(agg.as_list()) == agg
    assert parse_launch("merge_bwd", "2,4,0,1,1").as_list() == [2, 4, 0, 1, 1]
    assert parse_launch("weighted_sum", "4,1,1,2").as_list() == [4, 1, 1, 2]
    bad = {"aggregate": ("1,1,2", "1,1,2,1,8,1,9", "a,b,c,d,e,f", "0,1,1,1,1,1", "1,1,0,1,1,1"),
           "merge_fwd": ("3,1,1,1,0", "4,3,1,1,0", "4,1,1,1", "generic"),
           "weighted_sum": ("4,1", "4,1,3,1", "0,1,1,1")}
    for kind, values in bad.items():
        for text in values:
            with pytest.raises(ConfigError, match=rf"{kind} launch '{text}': expected \d integers"):
                parse_launch(kind, text)
    with pytest.raises(ConfigError, match="unknown launch kind 'prefix'; valid kinds are aggregate, merge_fwd"):
        parse_launch("prefix", "1,1")


def test_default_launches_are_the_measured_ones():
    """The launch every kernel runs with by default at DiT-XL/2's width (D=1152, padded to 2048 lanes):
    the generic kernels one row a program, forward one source a tile on one warp, backward two on four."""
    launch = aggregate_launch(1152, 65536)
    assert launch.generic()[:5] == [1, 1, 1, 2, 4]
    assert launch.merge_fwd == launch.merge_bwd == parse_launch("merge_bwd", "1,1,1,1,0")
    assert DEFAULTS["weighted_sum"] == parse_launch("weighted_sum", "1,1,4,1")


@pytest.mark.parametrize(("d", "expected"), [(1152, (1024, 128)), (24, (16, 8)), (70, (64, 8)), (1024, (1024, 0)),
                                             (3, (2, 1)), (1, (1, 0)), (96, (64, 32)), (112, (128, 0))])
def test_rows_split_into_a_head_and_tail_only_where_lanes_are_saved(d, expected):
    from routekit.kernels.launch import head_tail

    assert head_tail(d) == expected


def test_a_kernel_call_leaves_the_public_names_to_the_functions():
    """``routekit.kernels.aggregate`` and ``weighted_sum`` stay the functions after the Triton modules are
    imported (a submodule of the same name would take the package's attribute on its first import)."""
    import routekit.kernels as kernels

    sources, query, grad = Case(2, 1, 2, 8, torch.float32, "d", True, 1.0, seed=1).tensors()
    weighted_sum(list(sources), torch.randn(2, 1, 2, 3, device=DEVICE), "triton")
    aggregate(sources, query, kernel="triton")
    assert kernels.aggregate is aggregate and kernels.weighted_sum is weighted_sum


# --- two-phase chunks: a weighted sum of the shared sources, merged per sublayer ------------------------

# The mix is kept in the sources' dtype, and so is its gradient: in bf16 one more rounding each.
CHUNK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class ChunkCase:
    """K aggregations sharing ``shared`` sources, aggregation k adding ``own[k]`` sources of its own."""

    shared: int
    own: tuple[int, ...]
    b: int
    n: int
    d: int
    dtype: torch.dtype
    seed: int

    def tensors(self):
        """(shared sources, each aggregation's own sources, each aggregation's output gradient) on DEVICE."""
        gen = torch.Generator().manual_seed(self.seed)
        b, n, d = self.b, self.n, self.d

        def source():
            return (torch.randn(b, n, d, generator=gen) * math.exp(torch.randn((), generator=gen).item()))

        shared = [source() for _ in range(self.shared)]
        own = [[source() for _ in range(m)] for m in self.own]
        grads = [torch.randn(b, n, d, generator=gen) for _ in self.own]
        move = lambda ts: [t.to(DEVICE, self.dtype) for t in ts]  # noqa: E731
        return move(shared), [move(o) for o in own], [g.to(DEVICE) for g in grads]


@st.composite
def chunk_cases(draw) -> ChunkCase:
    shared = draw(st.integers(1, 12))
    own = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=5)))
    d = draw(st.integers(1, 70))
    b = draw(st.integers(1, 3))
    n = min(draw(st.integers(1, 9)), max(1, ELEMENT_BUDGET // ((shared + sum(own)) * b * d)))
    return ChunkCase(shared, own, b, n, d, draw(st.sampled_from([torch.float32, torch.bfloat16])),
                     draw(st.integers(0, 2**31 - 1)))


def chunk_outputs(case: ChunkCase, kernel: str | None, timestep: bool, *, launch: AggregateLaunch | None = None,
                  wsum_launch=None):
    """The K fp32 outputs and the gradients of shared sources, own sources, static queries w_k and (with
    ``timestep``) e(t), for the loss sum_k <out_k, grad_k>, queries w_k (+ e(t)): two-phase with ``kernel``
    (each shared source's logits from ``source_logits``, their weighted sum, then a merge per aggregation),
    or (None) one reference aggregation each. ``launch`` / ``wsum_launch``: the Triton merges' / weighted
    sum's launch (``kernel="triton"``)."""
    shared, own, grads = case.tensors()
    gen = torch.Generator().manual_seed(case.seed + 1)
    w = (torch.randn(len(case.own), case.d, generator=gen) * 2).to(DEVICE).requires_grad_()
    temb = torch.randn(case.b, 1, case.d, generator=gen).to(DEVICE).requires_grad_() if timestep else None
    shared = [t.requires_grad_() for t in shared]
    own = [[t.requires_grad_() for t in o] for o in own]
    queries = [w[k] + temb if timestep else w[k] for k in range(len(case.own))]
    if kernel is None:
        outs = [naive.aggregate(shared + o, queries[k], out_dtype=torch.float32) for k, o in enumerate(own)]
    else:
        logits = torch.stack([source_logits(v, w, temb) for v in shared])  # (S, B, N, K)
        if wsum_launch is None:
            mixes, lse = weighted_sum(shared, logits, kernel)
        else:
            mixes, lse = weighted_sums.weighted_sum_triton(shared, logits, wsum_launch)
        if launch is None:
            outs = [aggregate(o, queries[k], kernel=kernel, out_dtype=torch.float32, prefix=(mixes[k], lse[k]))
                    for k, o in enumerate(own)]
        else:
            outs = [aggregation.aggregate_triton(o, queries[k], out_dtype=torch.float32, prefix=(mixes[k], lse[k]),
                                                 launch=launch) for k, o in enumerate(own)]
    loss = sum((out * g).sum() for out, g in zip(outs, grads))
    flat_own = [t for o in own for t in o]
    wanted = [*shared, *flat_own, w, *([temb] if timestep else [])]
    got = torch.autograd.grad(loss, wanted)
    n = len(shared)
    return [torch.stack(outs), torch.stack(got[:n]), torch.stack(got[n:n + len(flat_own)]), *got[n + len(flat_own):]]


CHUNK_NAMES = ("outputs", "grad shared", "grad own", "grad w", "grad e(t)")


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@settings(max_examples=10, deadline=None)  # each example is a whole chunk's forward and backward in the interpreter
@given(case=chunk_cases(), timestep=st.booleans())
def test_two_phase_chunk_equals_one_aggregation_over_all_sources(kernel, case: ChunkCase, timestep: bool):
    """The shared part as a weighted sum of the sources from their logits, made by one GEMM per source
    (static and static_t queries): forward and every gradient, through the logits back to the sources,
    queries and e(t), and through the Triton merges' backward shortcut."""
    got = chunk_outputs(case, kernel, timestep)
    want = chunk_outputs(case, None, timestep)
    for name, g, w in zip(CHUNK_NAMES, got, want):
        assert_close(g, w, CHUNK_TOLERANCE[case.dtype], f"{kernel} {name} of {case}")


@pytest.mark.parametrize("setting", ["4,1,2,2", "2,1,4,4", "1,2,1,2"])
def test_weighted_sums_split_into_slices_of_rows_equal_the_reference(setting):
    """Launches that split rows: each row's lanes cut among programs (D=10 by 4: slices of 3 with a head of 2
    and a tail of 1, the last slice past D masked), the logits' gradient summed over slices."""
    case = ChunkCase(shared=5, own=(1, 2, 3, 1), b=2, n=3, d=10, dtype=torch.float32, seed=21)
    got = chunk_outputs(case, "triton", True, wsum_launch=parse_launch("weighted_sum", setting))
    want = chunk_outputs(case, None, True)
    for name, g, w in zip(CHUNK_NAMES, got, want, strict=True):
        assert_close(g, w, CHUNK_TOLERANCE[torch.float32], f"{name} ({setting})")


@pytest.mark.parametrize("setting", ["4,1,1,1,0", "1,2,0,1,0", "2,4,1,0,0", "2,2,1,1,0"])
@pytest.mark.parametrize("timestep", [False, True], ids=["static", "static_t"])
def test_merge_kernels_equal_the_reference_over_several_rows_per_program(setting, timestep, monkeypatch):
    """The merges' own kernels (``merge``: one, two or four sources per tile, with or without the next
    row's loads in flight, rows as a head and tail or padded) walking several rows per program (the query
    gradient summed in registers, the last program's rows partly past N), their state carrying g . o and
    each merge's lse back to the weighted sum; a merge of more sources than they take falls back to the
    generic kernels, which do the same."""
    from routekit.kernels.launch import sample_split

    few = lambda b, n, r, s=1: sample_split(b, n, r, s, programs=4)  # noqa: E731
    monkeypatch.setattr(aggregation, "sample_split", few)
    monkeypatch.setattr(merge, "sample_split", few)
    calls, forwards = [], []
    real, real_fwd = merge.merge_backward, merge.merge_forward
    monkeypatch.setattr(merge, "merge_backward", lambda *a: calls.append(a[10]) or real(*a))
    monkeypatch.setattr(merge, "merge_forward", lambda *a: forwards.append(a[7]) or real_fwd(*a))
    case = ChunkCase(shared=3, own=(1, 3, 4, 5), b=2, n=5, d=10, dtype=torch.float32, seed=9)
    launch = dataclasses.replace(aggregate_launch(case.d, case.b * case.n), merge_fwd=parse_launch("merge_fwd", setting),
                                 merge_bwd=parse_launch("merge_bwd", setting))
    got, want = chunk_outputs(case, "triton", timestep, launch=launch), chunk_outputs(case, None, timestep)
    for name, g, w in zip(CHUNK_NAMES[:4 + timestep], got, want, strict=True):
        assert_close(g, w, CHUNK_TOLERANCE[torch.float32], f"{name} ({setting})")
    assert sorted(calls) == sorted(forwards) == [1, 3, 4]  # the merge of 5 sources took the generic kernels


def test_source_logits_gradients_pass_gradcheck():
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(5, 8, generator=gen, dtype=torch.float64).requires_grad_()
    temb = torch.randn(2, 1, 8, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda v, w, temb: source_logits(v, w, temb, 1e-6), (v, w, temb))
    assert torch.autograd.gradcheck(lambda v, w: source_logits(v, w, None, 1e-6), (v, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("timestep", [False, True], ids=["static", "static_t"])
def test_source_logits_equal_the_reference_forward_and_backward(dtype, timestep):
    """The logits GEMM and its hand-written backward against autograd through ``naive.source_logits``:
    fp32 logits, and gradients to the source (in its dtype), the queries and e(t)."""
    gen = torch.Generator().manual_seed(8)
    v = (torch.randn(3, 7, 40, generator=gen) * 2).to(DEVICE, dtype)
    w = (torch.randn(6, 40, generator=gen) * 3).to(DEVICE)
    temb = torch.randn(3, 1, 40, generator=gen).to(DEVICE) if timestep else None
    dz = torch.randn(3, 7, 6, generator=gen).to(DEVICE)

    def run_logits(fn):
        leaves = [t.clone().requires_grad_() for t in (v, w, *([temb] if timestep else []))]
        z = fn(leaves[0], leaves[1], leaves[2] if timestep else None)
        return [z, *torch.autograd.grad(z, leaves, dz)]

    got, want = run_logits(source_logits), run_logits(naive.source_logits)
    rel = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]  # the source's gradient is rounded to bf16
    names = ("logits", "grad v", "grad w", "grad e(t)")[:3 + timestep]
    for name, g, ww in zip(names, got, want, strict=True):
        assert g.dtype == ww.dtype, name
        assert_close(g.float(), ww.float(), rel if name == "grad v" else 1e-5, f"{name} ({dtype})")


def test_split_gemm_of_two_fp32_matrices_keeps_about_sixteen_bits():
    """The source gradient's dzr @ w as one bf16 GEMM over high and low halves of both factors: within
    2^-14 of the exact product (one bf16 GEMM would be off by ~2^-8)."""
    from routekit.kernels.logits import _mm_split

    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(200, 52, generator=gen) * 3, torch.randn(52, 96, generator=gen)
    exact = a.double() @ b.double()
    error = ((_mm_split(a, b, torch.bfloat16).double() - exact).abs().max() / exact.abs().max()).item()
    plain = ((a.bfloat16().double() @ b.bfloat16().double() - exact).abs().max() / exact.abs().max()).item()
    assert error < 2**-14 < plain, (error, plain)
    low = _mm_split(a, b, torch.bfloat16, torch.bfloat16)  # what CUDA runs for bf16 sources: one rounding more
    assert low.dtype == torch.bfloat16
    assert ((low.double() - exact).abs() <= exact.abs() * 2**-8 + 2**-14 * exact.abs().max()).all()


def test_source_logits_stay_fp32_under_autocast():
    """Logits and their gradients are fp32 math even inside a bf16 autocast region (where a plain
    matmul would run, and round its result, in bf16)."""
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(2, 3, 40, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    w = (torch.randn(6, 40, generator=gen) * 3).to(DEVICE).requires_grad_()
    temb = torch.randn(2, 1, 40, generator=gen).to(DEVICE).requires_grad_()
    dz = torch.randn(2, 3, 6, generator=gen).to(DEVICE)
    plain = source_logits(v, w, temb)
    want = torch.autograd.grad(plain, [v, w, temb], dz)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        mixed = source_logits(v, w, temb)
        got = torch.autograd.grad(mixed, [v, w, temb], dz)
    assert mixed.dtype == torch.float32
    assert_close(mixed, plain, 1e-6, "logits under autocast")
    for name, g, ww in zip(("v", "w", "e(t)"), got, want):
        assert_close(g, ww, 1e-6, f"grad {name} under autocast")


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_weighted_sum_refuses_logits_that_do_not_fit_its_sources(kernel):
    sources = [torch.randn(2, 3, 8, device=DEVICE) for _ in range(4)]
    with pytest.raises(DarInputError, match=r"\(S, B, N, K\) = \(4, 2, 3, K\)"):
        weighted_sum(sources, torch.randn(3, 2, 3, 2, device=DEVICE), kernel)


def test_the_triton_merge_refuses_a_prefix_that_is_not_a_triton_weighted_sums_state():
    mix = torch.randn(2, 3, 8, device=DEVICE)
    with pytest.raises(DarInputError, match=r"\(2, 3, 8\) and \(2, 3, 2\).*\(B, N\) log-sum-exp merges only with "
                                            r"kernel='torch'"):
        aggregate([mix], torch.zeros(8, device=DEVICE), kernel="triton", prefix=(mix, torch.zeros(2, 3, device=DEVICE)))


def test_weighted_sum_ops_pass_torch_library_opcheck():
    gen = torch.Generator().manual_seed(4)
    sources = [torch.randn(2, 3, 24, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(3)]
    logits = torch.randn(3, 2, 3, 2, generator=gen).to(DEVICE).requires_grad_()
    torch.library.opcheck(weighted_sums.weighted_sum_op, (sources, logits, [4, 1, 2, 2]))
    mixes, state = weighted_sums.weighted_sum_op(sources, logits, [4, 1, 2, 2])
    assert state.shape == (2, 2, 3, 2) and not state[..., 1].any()  # (K, B, N, 2): lse and a zero slot
    lse = state[..., 0].detach()
    grad_mixes = [torch.randn_like(m) for m in mixes]
    torch.library.opcheck(weighted_sums.weighted_sum_backward_op, ([s.detach() for s in sources], logits.detach(), lse,
                                                                   grad_mixes, torch.randn_like(lse), [4, 1, 2, 2]))


def test_a_mix_no_merge_reads_gets_no_gradient_and_the_rest_stay_right():
    """A weighted sum of two mixes whose second no merge reads (autograd hands it zero gradients): the
    sources' and logits' gradients are the reference's, finite (no exp(logit - 0) weights, no inf * 0)."""
    gen = torch.Generator().manual_seed(12)
    sources = [(torch.randn(2, 3, 16, generator=gen) * 3).to(DEVICE).requires_grad_() for _ in range(3)]
    own = [torch.randn(2, 3, 16, generator=gen).to(DEVICE).requires_grad_()]
    logits = torch.randn(3, 2, 3, 2, generator=gen)
    logits[..., 1] += 100  # exp(100) overflows fp32: the unread mix's weights must stay a softmax
    logits = logits.to(DEVICE).requires_grad_()
    query = torch.randn(16, generator=gen).to(DEVICE)
    grad = torch.randn(2, 3, 16, generator=gen).to(DEVICE)

    def gradients(kernel):
        mixes, lse = weighted_sum(sources, logits, kernel)
        out = aggregate(own, query, kernel=kernel, out_dtype=torch.float32, prefix=(mixes[0], lse[0]))
        return torch.autograd.grad((out * grad).sum(), [*sources, *own, logits])

    for i, (g, w) in enumerate(zip(gradients("triton"), gradients("torch"), strict=True)):
        assert torch.isfinite(g).all(), f"gradient {i} not finite"
        assert_close(g, w, 1e-5, f"gradient {i}")


def merge_case(dtype, seed):
    """A weighted sum of 3 shared sources for 2 merges, and merge 1's own 2 sources, query (one per sample)
    and output gradient: leaves that require grad, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(2, 5, 24, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(3)]
    own = [(torch.randn(2, 5, 24, generator=gen) * 3 + 1).to(DEVICE, dtype).requires_grad_() for _ in range(2)]
    logits = torch.randn(3, 2, 5, 2, generator=gen).to(DEVICE).requires_grad_()
    query = torch.randn(2, 1, 24, generator=gen).to(DEVICE).requires_grad_()
    grad = torch.randn(2, 5, 24, generator=gen).to(DEVICE, dtype)
    return sources, own, logits, query, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_merge_given_its_rows_g_dot_o_equals_the_reference(dtype, monkeypatch):
    """Under torch.compile (the custom op and its registered autograd) a merge gets its rows' g . o from
    torch ops, for Inductor to fuse into the norm backward that makes g, and its kernel skips o; eager, the
    kernel reads o. Both give the reference's gradients, and each takes the path it should; a g . o handed
    to an aggregation the merge kernels do not run is refused."""
    sources, own, logits, query, grad = merge_case(dtype, 13)
    launch = aggregate_launch(24, 10).as_list()
    given = []
    real = merge.merge_backward
    monkeypatch.setattr(merge, "merge_backward", lambda *a: given.append(a[-1] is not None) or real(*a))

    def gradients(path):
        mixes, state = weighted_sum(sources, logits, "torch" if path == "reference" else "triton")
        if path == "reference":
            out = naive.aggregate(own, query, 1e-6, prefix=(mixes[1], state[1]))
        elif path == "op":
            out = aggregation.aggregate_op(list(own), query, 1e-6, dtype, False, launch, mixes[1], state[1])[0]
        else:
            out = aggregation._EagerMix.apply(query, 1e-6, dtype, False, launch, mixes[1], state[1], *own)
        return torch.autograd.grad((out.float() * grad.float()).sum(), [*sources, *own, logits, query])

    want = gradients("reference")
    for path, dot in (("eager", False), ("op", True)):
        given.clear()
        got = gradients(path)
        assert given == [dot], path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, CHUNK_TOLERANCE[dtype], f"gradient {i} ({path}, {dtype})")
    with torch.no_grad():  # the op's schema and fake agree with its kernel when it is handed g . o
        mixes, state = weighted_sum(sources, logits, "triton")
        out, _, lse, _ = aggregation.aggregate_op(own, query, 1e-6, dtype, False, launch, mixes[1], state[1])
    g_dot_o = (grad.float() * out.float()).sum(-1)
    torch.library.opcheck(aggregation.aggregate_backward_op, ([o.detach() for o in own], query.detach(), grad, out, lse,
                                                              1e-6, launch, state[1], g_dot_o))
    x = torch.randn(2, 5, 24, device=DEVICE)
    with pytest.raises(DarInputError, match=r"g \. o is taken only by a merge's own kernel"):
        aggregation._mix_backward([x], query.detach(), x, x, torch.zeros(2, 5, device=DEVICE), 1e-6, launch, None,
                                  torch.zeros(2, 5, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_with_stats_equals_the_reference_forward_and_backward(dtype, monkeypatch):
    """Under torch.compile a merge gives its rows' LayerNorm statistics from the kernel that holds each row:
    the mix and its rows' (mean, 1/std), and the gradients through both (as a LayerNorm of the mix feeds
    them back), equal ``naive.merge_with_stats``'s. Eager, and with the reference kernel, there are none."""
    sources, own, logits, query, grad = merge_case(dtype, 17)
    grad = grad.float()
    with_stats = []
    real = merge.merge_forward
    monkeypatch.setattr(merge, "merge_forward", lambda *a: with_stats.append(a[10] is not None) or real(*a))
    assert merge_with_stats(own, query, 1e-6, "torch", prefix=(own[0], own[0][..., 0]), norm_eps=1e-5) is None
    mixes, state = weighted_sum(sources, logits, "triton")
    assert merge_with_stats(own, query, 1e-6, "triton", prefix=(mixes[1], state[1]), norm_eps=1e-5) is None  # eager
    monkeypatch.setattr(aggregation, "_compiling", lambda: True)  # as inside a trace: the custom op's path

    def normed(fn, kernel):
        mixes, state = weighted_sum(sources, logits, kernel)
        mix, stats = fn(own, query, 1e-6, prefix=(mixes[1], state[1]), norm_eps=1e-5)
        normed = (mix.float() - stats[..., :1]) * stats[..., 1:]  # what the folded LayerNorm computes
        loss = (normed * grad).sum() + (mix.float() * grad).sum()
        return [mix, stats, *torch.autograd.grad(loss, [*sources, *own, logits, query])]

    got = normed(lambda *a, **k: merge_with_stats(*a[:3], "triton", **k), "triton")
    want = normed(naive.merge_with_stats, "torch")
    assert with_stats == [True]
    names = ("mix", "stats", "grad shared", "grad shared", "grad shared", "grad own", "grad own", "grad logits",
             "grad query")
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype, name
        assert_close(g.float(), w.float(), CHUNK_TOLERANCE[dtype], f"{name} ({dtype})")
    var, mean = torch.var_mean(got[0].float(), -1, correction=0)  # the statistics of the rows as returned
    assert_close(got[1], torch.stack([mean, torch.rsqrt(var + 1e-5)], -1), 1e-5, "stats of the returned rows")
    launch = aggregate_launch(24, 10).as_list()
    detached = ([o.detach() for o in own], query.detach(), 1e-6, dtype, False, launch, mixes[1].detach(),
                state[1].detach(), 1e-5)
    torch.library.opcheck(aggregation.aggregate_op, detached)
    with pytest.raises(DarInputError, match="row statistics come only from a merge's own kernel"):
        aggregation._mix(*detached[:6], None, None, 1e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA autocast and Inductor's GPU kernels")
def test_a_folded_norm_under_cuda_autocast_gives_what_the_layer_norm_gave(monkeypatch):
    """Compiled by Inductor under CUDA autocast, where F.layer_norm computes and returns fp32, the folded
    norm (statistics from the merge kernel) returns fp32 and the values of a LayerNorm of the merge."""
    from routekit.dar import layer_norm_of_merge
    gen = torch.Generator(DEVICE).manual_seed(23)
    sources = [torch.randn(2, 5, 24, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(3)]
    own = [torch.randn(2, 5, 24, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 3 + 1 for _ in range(2)]
    logits = torch.randn(3, 2, 5, 2, generator=gen, device=DEVICE)
    query = torch.randn(2, 1, 24, generator=gen, device=DEVICE)
    with_stats = []
    real = merge.merge_forward
    monkeypatch.setattr(merge, "merge_forward", lambda *a: with_stats.append(a[10] is not None) or real(*a))

    def folded():
        mixes, state = weighted_sum(sources, logits, "triton")
        return layer_norm_of_merge(own, query, mixes[1], state[1], 1e-5, 1e-6, "triton")

    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = torch.compile(folded, fullgraph=True)()
        mixes, state = weighted_sum(sources, logits, "triton")
        want = F.layer_norm(aggregate(own, query, kernel="triton", prefix=(mixes[1], state[1])), (24,), eps=1e-5)
    assert with_stats[0] and not with_stats[-1], with_stats
    assert got.dtype == want.dtype == torch.float32
    assert_close(got, want, 1e-5, "folded norm")


def test_the_reference_refuses_a_triton_weighted_sums_state():
    mix = torch.randn(2, 3, 8, device=DEVICE)
    with pytest.raises(DarInputError, match=r"must be \(B, N\) = \(2, 3\).*kernel='triton'"):
        aggregate([mix], torch.zeros(8, device=DEVICE), kernel="torch", prefix=(mix, torch.zeros(2, 3, 2, device=DEVICE)))


def test_every_kernel_compiles_for_the_h200():
    """The interpreter runs kernel bodies as Python; the GPU compiler is stricter (it rejects, e.g., a tuple
    holding a dtype). tests/sm90_compile.py compiles each kernel for sm_90, no GPU needed, and with
    --resources reads each one's registers."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(script), "--resources"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("ok ") == 12, done.stdout
    assert done.stdout.count("REG:") in (0, 12), done.stdout  # registers read from each cubin, where cuobjdump is


@pytest.mark.parametrize(("query", "route"), [("static", False), ("static_t", False), ("static", True)])
def test_a_dit_streams_its_chunks_through_the_triton_kernels_as_through_the_reference(query, route):
    """DAR c2 on a small DiT, train mode: the Triton path (source logits, weighted sums, merges)
    gives the reference path's output and gradients, eager and under torch.compile (fullgraph); with a
    route over blocks 2..3 too, whose chunks read gathered shared sources with their own logits."""
    import routekit as rk
    from backbones import dit
    from routekit.model import routing_of

    torch.manual_seed(0)
    model = dit.DiT(depth=5 if route else 3, hidden=24, heads=2, patch=2, input_size=4, in_channels=2, num_classes=5,
                    class_dropout=0.0).to(DEVICE)
    with torch.no_grad():  # off adaLN-Zero's start, where every sublayer's output and gradient is zero
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(DEVICE) * 0.1)
    x, t, y = torch.randn(2, 2, 4, 4, device=DEVICE), torch.rand(2, device=DEVICE), torch.tensor([1, 3], device=DEVICE)

    def routed(kernel):
        out = rk.apply(copy.deepcopy(model), routes=[rk.Route(start=2, end=3)] if route else None,
                       residual=rk.DAR(query=query, chunk=2, kernel=kernel), example_inputs=(x, t, y))
        with torch.no_grad():
            out.routekit.dar.query.normal_(generator=torch.Generator(DEVICE).manual_seed(1))
        return out.train()

    def outputs(m):
        torch.manual_seed(2)  # the same kept tokens in every run
        loss = m(x, t, y).square().mean()
        params = [p for p in m.parameters() if p.requires_grad]
        return [loss.detach(), *torch.autograd.grad(loss, params)]

    want = outputs(routed("torch"))
    fused = routed("triton")
    (bucket,) = [b for (train, _, _), b in routing_of(fused).executor.programs.items() if train]
    (program,) = bucket.values()
    assert "shared_part" in "".join(linecache.getlines(program.fn.__code__.co_filename))
    torch._dynamo.reset()
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    for name, got in (("eager", outputs(fused)), ("compiled", outputs(compiled))):
        for i, (g, w) in enumerate(zip(got, want)):  # relative to each gradient's size (most are ~1e-2)
            size = w.abs().max().clamp_min(1e-30)
            assert_close(g / size, w / size, 1e-5, f"{name} output/gradient {i}")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_a_dit_with_dar_trains_under_cuda_graphs_as_without():
    """torch.compile's reduce-overhead mode captures DAR's Triton ops in its CUDA graphs and replays
    them step after step on new inputs: each step's loss and gradients equal the reference path's.
    (Weights moved off DiT's zero init, where the loss and every gradient are exactly zero.)"""
    import routekit as rk
    from backbones import dit

    torch.manual_seed(0)
    model = dit.DiT(depth=3, hidden=24, heads=2, patch=2, input_size=4, in_channels=2, num_classes=5,
                    class_dropout=0.0).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    example = (torch.randn(2, 2, 4, 4, device=DEVICE), torch.rand(2, device=DEVICE), torch.tensor([1, 3], device=DEVICE))

    def with_dar(kernel):
        out = rk.apply(model, residual=rk.DAR(query="static_t", chunk=2, kernel=kernel), example_inputs=example)
        with torch.no_grad():
            out.routekit.dar.query.normal_(generator=torch.Generator(DEVICE).manual_seed(1))
        return out.train()

    def outputs(m, inputs):
        torch.compiler.cudagraph_mark_step_begin()
        loss = m(*inputs).square().mean()
        params = [p for p in m.parameters() if p.requires_grad]
        return [t.detach().clone() for t in (loss, *torch.autograd.grad(loss, params))]  # replays reuse memory

    reference = with_dar("torch")
    torch._dynamo.reset()
    graphed = torch.compile(with_dar("triton"), mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(DEVICE).manual_seed(3)
    for step in range(4):
        inputs = (torch.randn(2, 2, 4, 4, device=DEVICE, generator=gen), torch.rand(2, device=DEVICE, generator=gen),
                  torch.randint(0, 5, (2,), device=DEVICE, generator=gen))
        for i, (g, w) in enumerate(zip(outputs(graphed, inputs), outputs(reference, inputs))):
            assert_close(g, w, 1e-4, f"step {step}, output/gradient {i}")

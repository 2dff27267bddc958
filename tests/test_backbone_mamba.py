"""DiM / ZigMa backbone: chunked SSD equals the token loop, scan orders, mamba-ssm shim, plain forward."""

import sys

import pytest
import torch
from backbone_helpers import assert_same_values_and_grads, inputs, perturb, small_mamba
from hypothesis import given, settings
from hypothesis import strategies as st

from backbones import mamba
from backbones.ops.grid import snake
from backbones.ops.ssd import ssd_chunked, ssd_reference

small = small_mamba


def ssd_args(batch, n, groups, heads_per_group, headdim, state, seed, dt_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    heads = groups * heads_per_group
    args = (torch.randn(batch, n, heads, headdim, generator=gen),
            dt_scale * torch.rand(batch, n, heads, generator=gen) + 1e-3,
            -4 * torch.rand(heads, generator=gen),
            torch.randn(batch, n, groups, state, generator=gen),
            torch.randn(batch, n, groups, state, generator=gen))
    return [a.requires_grad_() for a in args]


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 2), n=st.integers(1, 45), groups=st.integers(1, 2),
       heads_per_group=st.integers(1, 2), headdim=st.integers(1, 4), state=st.integers(1, 5),
       chunk=st.sampled_from([1, 4, 7, 16, 64]), seed=st.integers(0, 2**16))
def test_chunked_ssd_equals_the_recurrence(batch, n, groups, heads_per_group, headdim, state, chunk, seed):
    args = ssd_args(batch, n, groups, heads_per_group, headdim, state, seed)
    assert_same_values_and_grads(lambda *a: ssd_chunked(*a, chunk=chunk), ssd_reference, args)


def test_chunked_ssd_is_exact_under_strong_decay():
    # per-token decays down to exp(-40): whole chunks forget everything, nothing may become nan
    args = ssd_args(2, 40, 1, 2, 3, 4, seed=5, dt_scale=10.0)
    assert_same_values_and_grads(lambda *a: ssd_chunked(*a, chunk=8), ssd_reference, args)


def test_ssd_of_the_b2_shape_runs_in_bounded_memory():
    x, dt, A, B, C = (a.detach() for a in ssd_args(8, 256, 1, 24, 64, 64, seed=0, dt_scale=0.1))
    assert ssd_chunked(x, dt, A, B, C).shape == (8, 256, 24, 64)


@pytest.mark.skipif(not torch.cuda.is_available() or mamba._load_kernel()[0] is None,
                    reason="needs CUDA and mamba-ssm's Triton SSD kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_ssm_kernel_equals_the_chunked_scan_on_cuda(dtype):
    x, dt, A, B, C = (a.detach().cuda() for a in ssd_args(4, 256, 1, 12, 64, 64, seed=3, dt_scale=0.1))
    x, B, C = (a.to(dtype).requires_grad_() for a in (x, B, C))
    dt, A = dt.requires_grad_(), A.requires_grad_()
    args = (x, dt, A, B, C)
    out = mamba.mamba_kernel()(*args, 64)
    ref = ssd_chunked(*args, chunk=64)
    # Errors relative to the largest magnitude: the kernel's fp32 matmuls run in TF32 (10-bit
    # mantissa), so both dtypes are held to about a few units in the last place of bf16/TF32.
    bound = 2e-2 if dtype == torch.bfloat16 else 5e-3
    weight = torch.randn_like(out, dtype=torch.float32)
    pairs = [("output", out, ref)] + list(zip(["dx", "ddt", "dA", "dB", "dC"],
                                               torch.autograd.grad((out.float() * weight).sum(), args),
                                               torch.autograd.grad((ref.float() * weight).sum(), args)))
    for name, got, want in pairs:
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
        assert error < bound, f"{name}: error {error:.3g} of the largest magnitude (bound {bound})"


def test_snake_reverses_odd_rows_and_is_its_own_inverse():
    x = torch.arange(12.0).view(1, 12, 1)
    assert snake(x, 4).flatten().tolist() == [0, 1, 2, 3, 7, 6, 5, 4, 8, 9, 10, 11]
    assert torch.equal(snake(snake(x, 4), 4), x)


def scan_order_last(block: mamba.DiMBlock, rows: int) -> int:
    """Grid index of the token the block scans last: only its own output may depend on it."""
    order = torch.arange(rows * block.width, dtype=torch.float).view(1, -1, 1)
    if block.zigzag:
        order = snake(order, block.width)
    return int(order.flatten()[0 if block.reverse else -1])


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("rows", [3, 4])
def test_each_block_scans_in_its_direction_and_order(zigzag, index, rows):
    block = small(zigzag=zigzag).blocks[index]
    assert block.reverse == (index % 2 == 1) and block.zigzag == zigzag
    x = torch.randn(1, rows * 8, 32)
    last = scan_order_last(block, rows)
    moved = x.clone()
    moved[:, last] += 1.0
    changed = (block.scan(moved) - block.scan(x)).abs().sum(-1).flatten() > 0
    assert changed.nonzero().flatten().tolist() == [last]  # causal: nothing scanned earlier sees it


def test_without_the_kernel_forcing_it_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # "not installed", whatever this machine has
    mamba._load_kernel.cache_clear()
    monkeypatch.setattr(mamba, "SSD_IMPL", "kernel")
    try:
        with pytest.raises(ImportError, match="MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip"):
            small().blocks[0](torch.randn(2, 64, 32), torch.randn(2, 32))
    finally:
        mamba._load_kernel.cache_clear()


@pytest.fixture
def triton_only_mamba_ssm(tmp_path, monkeypatch):
    """A stand-in for mamba-ssm installed without its CUDA extension: the package __init__ fails,
    the Triton module imports. Its kernel is the reference scan, so results can be compared."""
    triton_dir = tmp_path / "mamba_ssm" / "ops" / "triton"
    triton_dir.mkdir(parents=True)
    (tmp_path / "mamba_ssm" / "__init__.py").write_text("import selective_scan_cuda\n")
    (tmp_path / "mamba_ssm" / "ops" / "__init__.py").write_text("")
    (triton_dir / "__init__.py").write_text("")
    (triton_dir / "ssd_combined.py").write_text(
        "import torch\n"
        "from backbones.ops.ssd import ssd_reference\n"
        "calls = []\n"
        "def _mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk_size):\n"
        "    calls.append(('forward', chunk_size))\n"
        "    return ssd_reference(x, dt, A, B, C).contiguous(), None\n"
        "def _mamba_chunk_scan_combined_bwd(dout, x, dt, A, B, C, out, chunk_size):\n"
        "    calls.append(('backward', chunk_size))\n"
        "    _, vjp = torch.func.vjp(ssd_reference, x, dt, A, B, C)  # a custom op runs below autograd\n"
        "    return (*vjp(dout), None, None, None, None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mamba._load_kernel.cache_clear()
    yield
    mamba._load_kernel.cache_clear()
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]


def test_shim_loads_the_triton_kernel_when_the_package_init_fails(triton_only_mamba_ssm, monkeypatch):
    mamba.mamba_kernel()
    assert mamba._load_kernel()[0].__name__ == "mamba_ssm.ops.triton.ssd_combined"
    assert "mamba_ssm" not in sys.modules  # the bare stand-in is gone again
    calls = sys.modules["mamba_ssm.ops.triton.ssd_combined"].calls
    block = perturb(small()).blocks[1]
    x, c = torch.randn(2, 64, 32), torch.randn(2, 32)
    auto = block(x, c)  # CPU tensors: the chunked scan even though a kernel imports
    assert calls == []
    monkeypatch.setattr(mamba, "SSD_IMPL", "kernel")
    kernel_out = block(x, c)
    torch.testing.assert_close(kernel_out, auto, atol=1e-5, rtol=1e-5)
    kernel_out.square().sum().backward()
    assert calls == [("forward", block.mixer.chunk), ("backward", block.mixer.chunk)]


def test_the_kernel_is_a_custom_op_with_a_true_fake_and_backward(triton_only_mamba_ssm):
    """torch.library's own check: the fake (what compile sees) matches the kernel's shapes, dtypes and
    strides, and the registered backward gives the kernel's gradients."""
    mamba.mamba_kernel()
    args = [a.detach().requires_grad_() for a in ssd_args(2, 24, 1, 2, 4, 3, seed=1)]
    torch.library.opcheck(torch.ops.backbones.mamba_ssd.default, (*args, 8))
    got = torch.ops.backbones.mamba_ssd(*args, 8)
    want = ssd_reference(*[a.detach().requires_grad_() for a in args])
    torch.testing.assert_close(got, want)


def test_choosing_the_scan_does_not_break_a_compiled_graph(triton_only_mamba_ssm):
    """Reading whether mamba-ssm imports inside a compiled forward broke the graph at every block (Dynamo
    cannot trace an import); the answer is a constant to Dynamo now. fullgraph fails on any break."""
    torch._dynamo.reset()
    choose = torch.compile(lambda x: x * len(mamba.ssd_impl(cuda=True)), backend="eager", fullgraph=True)
    assert choose(torch.ones(1)).item() == len("kernel")


@pytest.mark.parametrize("routed", [False, True])
def test_a_dim_on_the_kernel_compiles_to_one_graph(triton_only_mamba_ssm, monkeypatch, routed):
    """mamba-ssm's autograd.Function breaks Dynamo's graph at its Triton launches, one piece per block (more
    when routed) that CUDA graphs cannot hold; as a custom op the scan is one node of one graph."""
    import routekit as rk

    monkeypatch.setattr(mamba, "SSD_IMPL", "kernel")
    model = small()
    args = inputs(model)
    if routed:
        model = rk.apply(model, rk.Route(start=1, end=1, selector="row"), example_inputs=args)
    torch._dynamo.reset()
    compiled = torch.compile(model.train(), backend="aot_eager", fullgraph=True)
    compiled(*args).square().mean().backward()
    calls = sys.modules["mamba_ssm.ops.triton.ssd_combined"].calls
    assert [kind for kind, _ in calls].count("backward") == len(model.blocks)


def test_unknown_ssd_impl_lists_the_valid_ones(monkeypatch):
    monkeypatch.setattr(mamba, "SSD_IMPL", "cuda")
    with pytest.raises(ValueError, match="'kernel', 'chunked', 'reference'"):
        small().blocks[0](torch.randn(2, 64, 32), torch.randn(2, 32))


@pytest.mark.parametrize("mlp_ratio", [0.0, 4.0])
def test_forward_returns_an_image(mlp_ratio):
    model = perturb(small(mlp_ratio=mlp_ratio, learn_sigma=True))
    assert (model.blocks[0].mlp is None) == (mlp_ratio == 0)
    x, t, y = inputs(model)
    out = model(x, t, y)
    assert out.shape == (2, 8, 16, 16) and torch.isfinite(out).all()


def test_non_square_input_and_grid():
    model = perturb(small(input_size=(8, 16)))
    assert mamba.grid(model) == (4, 8) and model.blocks[0].width == 8
    x, t, y = inputs(model)
    assert model(x, t, y).shape == x.shape


def test_zigzag_block_refuses_a_partial_row_and_a_raster_block_needs_no_grid():
    x, c = torch.randn(2, 20, 32), torch.randn(2, 32)
    with pytest.raises(ValueError, match="8-token-wide grid"):
        small().blocks[0](x, c)
    assert small(zigzag=False).blocks[0](x, c).shape == x.shape



@pytest.mark.parametrize("size, millions", [("S/2", 34.2), ("B/2", 133.3)])
def test_sizes_build_with_their_parameter_counts(size, millions):
    with torch.device("meta"):
        model = mamba.build(size)
        named = getattr(mamba, "DiM_" + size.replace("/", "_"))()
    assert len(model.blocks) == mamba.SIZES[size]["depth"] and mamba.grid(model) == (16, 16)
    assert [b.reverse for b in model.blocks[:4]] == [False, True, False, True]
    for m in (model, named):
        assert abs(sum(p.numel() for p in m.parameters()) / 1e6 - millions) < 0.1


def test_unknown_size_lists_the_valid_ones():
    with pytest.raises(ValueError, match="S/2, B/2"):
        mamba.build("L/2")


@pytest.mark.skipif(not torch.cuda.is_available() or mamba._load_kernel()[0] is None,
                    reason="needs CUDA and mamba-ssm's Triton SSD kernel")
def test_the_eager_scan_replayed_from_cuda_graphs_computes_what_the_custom_op_does():
    """Eager, the scan and its backward replay CUDA graphs captured per input signature: the same kernels on the
    same values, so the same output bits as the custom op, at each token count a route gives a block (the
    gradients up to the order of mamba-ssm's atomic adds)."""
    for tokens in (256, 128, 256):
        x, dt, A, B, C = (a.detach().cuda() for a in ssd_args(4, tokens, 1, 12, 64, 64, seed=tokens, dt_scale=0.1))
        x, B, C = (a.to(torch.bfloat16) for a in (x, B, C))
        weight = torch.randn(x.shape, device="cuda")
        results = []
        for scan in (lambda *a: mamba.mamba_kernel()(*a, 64), lambda *a: mamba._EagerScan.apply(*a, 64)):
            args = [a.clone().requires_grad_() for a in (x, dt, A, B, C)]
            out = scan(*args)
            results.append([out, *torch.autograd.grad((out.float() * weight).sum(), args)])
        (out, *grads), (want_out, *want_grads) = results
        assert torch.equal(out, want_out)
        for got, want in zip(grads, want_grads):
            assert (got.float() - want.float()).abs().max() <= 1e-4 * want.float().abs().max()
    assert any(replay is not None for replay in mamba._replays.values())

"""Diffusion-RWKV: the three WKV forms agree, blocks take whole rows only, adaLN-Zero, a plain forward."""

import pytest
import torch
from backbone_helpers import assert_same_values_and_grads, inputs, perturb, small_rwkv
from hypothesis import given, settings
from hypothesis import strategies as st

from backbones import rwkv
from backbones.ops.grid import grid_rows, shift_2d
from backbones.ops.wkv import wkv_chunked, wkv_matmul, wkv_reference

small = small_rwkv


def wkv_args(batch, n, c, seed, key_scale=2.0, decay=0.5, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    args = (torch.rand(c, generator=gen) * decay, torch.randn(c, generator=gen),
            key_scale * torch.randn(batch, n, c, generator=gen), torch.randn(batch, n, c, generator=gen))
    return [a.requires_grad_(requires_grad) for a in args]


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), n=st.integers(1, 70), c=st.integers(1, 6),
       chunk=st.sampled_from([1, 3, 8, 16, 64]), seed=st.integers(0, 2**16))
def test_chunked_wkv_equals_the_definition(batch, n, c, chunk, seed):
    args = wkv_args(batch, n, c, seed)
    assert_same_values_and_grads(lambda *a: wkv_chunked(*a, chunk=chunk), wkv_reference, args)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), n=st.integers(1, 70), c=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_matmul_wkv_equals_the_definition(batch, n, c, seed):
    assert_same_values_and_grads(wkv_matmul, wkv_reference, wkv_args(batch, n, c, seed))


def test_matmul_wkv_in_bf16_is_close():
    w, u, k, v = wkv_args(2, 64, 16, seed=0, requires_grad=False)
    out = wkv_matmul(w, u, k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), wkv_reference(w, u, k, v), atol=0.05, rtol=0.05)


def test_chunked_wkv_is_exact_for_keys_spread_far_beyond_exp_range():
    # keys spread over about +-300: a per-sequence maximum alone would underflow whole chunks to 0/0
    args = wkv_args(2, 50, 4, seed=3, key_scale=100.0, decay=0.3)
    assert_same_values_and_grads(lambda *a: wkv_chunked(*a, chunk=8), wkv_reference, args, atol=1e-4)


@pytest.mark.parametrize("fn", [wkv_reference, wkv_chunked, wkv_matmul])
def test_a_huge_bonus_cannot_overflow(fn):
    w, _, k, v = wkv_args(2, 20, 3, seed=1, requires_grad=False)
    out = fn(w, torch.full((3,), 500.0), k, v)  # exp(500) is inf in fp32; the own token dominates
    torch.testing.assert_close(out, v)


def test_wkv_impl_is_chosen_by_device_and_overridable(monkeypatch):
    calls = []
    monkeypatch.setitem(rwkv.WKV_IMPLS, "chunked", lambda *a: calls.append("chunked") or wkv_chunked(*a))
    block = perturb(small()).blocks[0]
    x, c = torch.randn(2, 64, 32), torch.randn(2, 32)
    auto = block(x, c)
    assert calls == ["chunked"]  # CPU tensors
    monkeypatch.setattr(rwkv, "WKV_IMPL", "reference")
    torch.testing.assert_close(block(x, c), auto, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(rwkv, "WKV_IMPL", "triton")
    with pytest.raises(ValueError, match="reference, chunked, matmul"):
        block(x, c)


def test_wkv_of_the_b2_shape_runs_in_bounded_memory():
    w, u, k, v = wkv_args(8, 256, 768, seed=0, requires_grad=False)
    assert wkv_chunked(w, u, k, v).shape == (8, 256, 768)


def test_shift_2d_takes_each_quarter_from_one_neighbour():
    rows, width, dim = 3, 4, 9  # one channel past 4 quarters stays unshifted
    x = torch.randn(2, rows * width, dim)
    img, out = x.view(2, rows, width, dim), shift_2d(x, width).view(2, rows, width, dim)
    for h in range(rows):
        for w in range(width):
            zero = torch.zeros(2, 2)
            left = img[:, h, w - 1, 0:2] if w > 0 else zero
            right = img[:, h, w + 1, 2:4] if w < width - 1 else zero
            above = img[:, h - 1, w, 4:6] if h > 0 else zero
            below = img[:, h + 1, w, 6:8] if h < rows - 1 else zero
            expected = torch.cat([left, right, above, below, img[:, h, w, 8:]], dim=1)
            assert torch.equal(out[:, h, w], expected)


def test_grid_rows_refuses_partial_rows():
    assert grid_rows(48, 16) == 3
    with pytest.raises(ValueError, match="whole rows"):
        grid_rows(50, 16)


@pytest.mark.parametrize("learn_sigma", [False, True])
def test_forward_returns_an_image(learn_sigma):
    model = perturb(small(learn_sigma=learn_sigma))
    x, t, y = inputs(model)
    out = model(x, t, y)
    assert out.shape == (2, 8 if learn_sigma else 4, 16, 16) and torch.isfinite(out).all()


def test_non_square_input_and_grid():
    model = perturb(small(input_size=(8, 16)))
    assert rwkv.grid(model) == (4, 8) and model.blocks[0].width == 8
    x, t, y = inputs(model)
    assert model(x, t, y).shape == x.shape


def test_block_refuses_a_partial_row():
    block = small().blocks[0]
    with pytest.raises(ValueError, match="8-token-wide grid"):
        block(torch.randn(2, 20, 32), torch.randn(2, 32))



@pytest.mark.parametrize("size, millions", [("S/2", 34.6), ("B/2", 137.4), ("L/2", 204.7)])
def test_sizes_build_with_their_parameter_counts(size, millions):
    with torch.device("meta"):
        model = rwkv.build(size)
        named = getattr(rwkv, "DRWKV_" + size.replace("/", "_"))()
    assert len(model.blocks) == rwkv.SIZES[size]["depth"] and rwkv.grid(model) == (16, 16)
    for m in (model, named):
        assert abs(sum(p.numel() for p in m.parameters()) / 1e6 - millions) < 0.1


def test_unknown_size_lists_the_valid_ones():
    with pytest.raises(ValueError, match="S/2, B/2, L/2"):
        rwkv.build("XL/2")

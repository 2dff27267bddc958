"""The DiT/SiT backbone: paper sizes, shapes, adaLN-Zero init, label dropout, and fx-traceability."""

import pytest
import torch
import torch.fx as fx

from backbones import dit

PAPER = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}


def small(**overrides) -> dit.DiT:
    """A tiny S-family model that runs in milliseconds on CPU."""
    return dit.build("S/2", **{"depth": 2, "input_size": 16, **overrides})


def inputs(model: dit.DiT, batch: int = 2, seed: int = 0):
    return dit.example_inputs(model, batch, generator=torch.Generator().manual_seed(seed))


def test_sizes_are_the_papers_twelve():
    assert set(dit.SIZES) == {f"{name}/{p}" for name in PAPER for p in (2, 4, 8)}
    for size, cfg in dit.SIZES.items():
        name, patch = size.split("/")
        assert (cfg["depth"], cfg["hidden"], cfg["heads"], cfg["patch"]) == (*PAPER[name], int(patch))


@pytest.mark.parametrize("size", list(dit.SIZES))
def test_every_size_builds_with_its_shape(size):
    cfg = dit.SIZES[size]
    with torch.device("meta"):
        model = dit.build(size)
        named = getattr(dit, "DiT_" + size.replace("/", "_"))()
    for m in (model, named):
        assert dict(depth=m.depth, hidden=m.hidden, heads=m.heads, patch=m.patch) == cfg
        assert len(m.blocks) == cfg["depth"]
        assert m.blocks[0].attn.qkv.in_features == cfg["hidden"]
        assert dit.grid(m) == (32 // cfg["patch"],) * 2


@pytest.mark.parametrize("size, millions", [("XL/2", 675), ("B/2", 130), ("S/2", 33)])
def test_parameter_counts_match_the_paper(size, millions):
    with torch.device("meta"):
        model = dit.build(size, learn_sigma=True)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e6 - millions) / millions < 0.02


@pytest.mark.parametrize("patch", [2, 4, 8])
@pytest.mark.parametrize("learn_sigma", [False, True])
def test_forward_returns_an_image(patch, learn_sigma):
    model = small(patch=patch, learn_sigma=learn_sigma)
    x, t, y = inputs(model)
    out = model(x, t, y)
    assert out.shape == (2, 8 if learn_sigma else 4, 16, 16)


def test_non_square_input_and_grid():
    model = small(input_size=(16, 32), patch=8)
    assert dit.grid(model) == (2, 4)
    x, t, y = inputs(model)
    assert x.shape == (2, 4, 16, 32)
    assert model(x, t, y).shape == x.shape


def test_unpatchify_inverts_patch_order():
    model = small(patch=4)
    image = torch.randn(2, 4, 16, 16)
    (h, w), p = model.grid, model.patch
    tokens = image.reshape(2, 4, h, p, w, p).permute(0, 2, 4, 3, 5, 1).reshape(2, h * w, p * p * 4)
    assert torch.equal(model.unpatchify(tokens), image)


def test_output_is_exactly_zero_at_init_then_moves():
    model = small()
    x, t, y = inputs(model)
    assert torch.count_nonzero(model(x, t, y)) == 0
    with torch.no_grad():
        for p in model.final_layer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert torch.count_nonzero(model(x, t, y)) > 0


def test_every_block_is_the_identity_at_init():
    model = small()
    x, c = torch.randn(2, 64, 384), torch.randn(2, 384)
    for block in model.blocks:
        assert torch.equal(block(x, c), x)


def test_block_accepts_any_token_count():
    block = small().blocks[0]
    assert block(torch.randn(3, 5, 384), torch.randn(3, 384)).shape == (3, 5, 384)


def test_label_dropout_only_in_train_mode():
    model = small(class_dropout=1.0, num_classes=10)
    table = model.y_embedder.embedding_table.weight
    assert table.shape[0] == 11
    y = torch.arange(10)
    model.eval()
    assert torch.equal(model.y_embedder(y), table[y])
    model.train()
    assert torch.equal(model.y_embedder(y), table[10].expand(10, -1))


def test_label_dropout_rate_is_roughly_class_dropout():
    model = small(class_dropout=0.1, num_classes=10).train()
    torch.manual_seed(0)
    embedded = model.y_embedder(torch.zeros(4000, dtype=torch.long))
    dropped = (embedded != model.y_embedder.embedding_table.weight[0]).any(dim=1)
    assert 0.07 < dropped.float().mean() < 0.13


def test_forward_accepts_the_null_class():
    model = small(num_classes=10).eval()
    x, t, _ = inputs(model)
    assert model(x, t, torch.full((2,), 10)).shape == x.shape


def test_pos_embed_is_a_fixed_persistent_buffer():
    model = small()
    assert "pos_embed" in model.state_dict()
    assert all(name != "pos_embed" for name, _ in model.named_parameters())
    assert model.pos_embed.shape == (1, 64, 384)


def test_example_inputs_are_deterministic_and_valid():
    model = small(num_classes=10)
    a, b = inputs(model, 5, seed=3), inputs(model, 5, seed=3)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], inputs(model, 5, seed=4)[0])
    x, t, y = a
    assert x.shape == (5, 4, 16, 16) and x.dtype == torch.float32
    assert t.shape == (5,) and t.is_floating_point() and ((t >= 0) & (t < 1)).all()
    assert y.shape == (5,) and y.dtype == torch.long and ((y >= 0) & (y < 10)).all()


def test_bad_size_and_shapes_are_refused():
    with pytest.raises(ValueError, match="XL/2"):
        dit.build("M/2")
    with pytest.raises(ValueError):
        dit.build("S/8", input_size=20)


@pytest.mark.parametrize("train", [True, False])
def test_fx_trace_matches_eager(train):
    model = small(patch=4).train(train)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # leave adaLN-Zero so the comparison is not 0 == 0
    x, t, y = inputs(model, 4)
    traced = fx.symbolic_trace(model)
    torch.manual_seed(1)
    expected = model(x, t, y)
    torch.manual_seed(1)
    assert torch.equal(traced(x, t, y), expected)


def test_each_block_has_two_residual_adds():
    graph = fx.symbolic_trace(small().blocks[0]).graph
    stream = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "x")
    adds = 0
    while True:
        nxt = [n for n in stream.users if n.op == "call_function" and n.target.__name__ == "add"]
        if not nxt:
            break
        (stream,) = nxt
        adds += 1
    assert adds == 2
    assert next(n for n in graph.nodes if n.op == "output").args[0] is stream

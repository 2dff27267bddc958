"""Laws of the routed model (routekit/model.py): what `apply` returns runs the owner's training graph (dropout
included) at any batch size, shares the model's parameters through checkpoint loads, checks outputs when asked,
and refuses example calls and routes it cannot honour.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import D, Tokens, built, tokens, train_out
from torch import nn

import routekit as rk
from routekit.errors import ConfigError, InputError


def test_the_training_graph_keeps_the_owners_dropout():
    class Dropped(Tokens):
        def forward(self, x):
            h = F.dropout(self.embed(x), 0.5, self.training)  # traced as the mode it is traced in
            for block in self.blocks:
                h = block(h)
            return h

    model, x = built(Dropped), tokens()
    model.eval()  # apply traces the training graph whatever mode the model is in
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=x)
    assert rk.verify(model, routed, x).train == "rate 0 bit-identical"


def test_a_routed_model_runs_a_call_of_another_batch_size():
    model = built(Tokens)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens(batch=2))
    assert train_out(routed, tokens(batch=3)).shape == (3, 6, D)


def test_loading_a_checkpoint_copies_into_the_routed_models_own_parameters():
    model = built(Tokens)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    weight = routed.embed.weight
    checkpoint = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    routed.load_state_dict(checkpoint)
    assert routed.embed.weight is weight and model.embed.weight is weight
    checkpoint["embed.weight"].zero_()
    assert torch.equal(weight, model.state_dict()["embed.weight"]) and weight.abs().sum() > 0


def test_a_dar_model_loads_the_original_checkpoint_strictly_keeping_its_queries():
    model = built(Tokens)
    routed = rk.apply(model, residual=rk.DAR(kernel="torch"), example_inputs=tokens())
    with torch.no_grad():
        routed.routekit.dar.query.fill_(0.5)
    result = routed.load_state_dict(model.state_dict())
    assert result.unexpected_keys == [] and result.missing_keys == []  # strict, and the queries keep their values
    assert (routed.routekit.dar.query == 0.5).all()


def test_a_routed_forward_returns_non_finite_outputs_unless_asked_to_check():
    model = built(Tokens)
    routed = rk.apply(model, rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens())
    bad = tokens()
    bad[0, 0, 0] = float("nan")
    assert train_out(routed, bad).isnan().any()
    checking = rk.apply(built(Tokens), rk.Route(start=1, end=2, rate=0.5), example_inputs=tokens(), check_finite=True)
    with pytest.raises(rk.NonFiniteError):
        train_out(checking, bad)


def test_example_kwargs_keyed_by_anything_but_names_are_refused_saying_so():
    with pytest.raises(InputError, match="keyword arguments by name"):
        rk.apply(built(Tokens), example_inputs=tokens(), example_kwargs={1: tokens()})


def test_a_route_that_would_change_the_training_output_shapes_is_refused():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            return x + self.fc(x), x.flatten(1)  # a per-sample value whose size is the token count's

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Flat() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x, flat = block(x)
            return x, flat

    with pytest.raises(ConfigError, match="output shapes"):
        rk.apply(built(Owner), rk.Route(start=1, end=2, rate=0.5), example_inputs=torch.randn(2, 6, D))

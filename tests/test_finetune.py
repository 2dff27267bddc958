"""`python -m routekit.finetune` end to end on tiny diffusers models saved with `save_pretrained`: LoRA training
with a route under `accelerate launch` on the CPU, a bit-exact resume, SimpleTuner's tread_config, Wan, the
baseline, and the errors a user meets first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
from safetensors.torch import load_file  # noqa: E402

from routekit import finetune  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def tiny_flux(folder: Path, samples: int = 4) -> tuple[Path, Path]:
    """A FLUX.1-shaped transformer (guidance-distilled, as FLUX.1-dev) in a pipeline's layout, and cached samples:
    16-channel latents of 8×8 (16 tokens packed 2×2), 6 text tokens."""
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6), guidance_embeds=True)
    model.save_pretrained(folder / "model" / "transformer")
    g = torch.Generator().manual_seed(1)
    (folder / "data").mkdir()
    for i in range(samples):
        torch.save({"latents": torch.randn(16, 8, 8, generator=g), "prompt_embeds": torch.randn(6, 24, generator=g),
                    "pooled_prompt_embeds": torch.randn(16, generator=g)}, folder / "data" / f"{i:03d}.pt")
    return folder / "model", folder / "data"


def tiny_wan(folder: Path, samples: int = 3) -> tuple[Path, Path]:
    """A Wan-shaped video transformer saved alone, and cached samples: 4-channel latents of 2 frames of 8×8."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=16, ffn_dim=64, num_layers=8, rope_max_seq_len=32)
    model.save_pretrained(folder / "wan")
    g = torch.Generator().manual_seed(1)
    (folder / "wan-data").mkdir()
    for i in range(samples):
        torch.save({"latents": torch.randn(4, 2, 8, 8, generator=g), "prompt_embeds": torch.randn(5, 24, generator=g)},
                   folder / "wan-data" / f"{i}.pt")
    return folder / "wan", folder / "wan-data"


def fresh_accelerator_state() -> None:
    """Each in-process run starts its own accelerate state (it is a process-wide singleton)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_launched_flux_lora_run_with_a_route_resumes_bit_exactly(tmp_path):
    model, data = tiny_flux(tmp_path)
    common = ["--model", str(model), "--data", str(data), "--steps", "4", "--batch-size", "2", "--rank", "4",
              "--checkpoint-every", "2", "--routes", "2:-2", "--warmup", "2", "--lr", "1e-3"]
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "-m", "routekit.finetune", *common, "--output", str(run)],
                          cwd=tmp_path, env=ONE_THREAD, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "it/s" not in done.stderr and "trained 4 steps" in done.stdout  # no bar off a terminal
    history = [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4] and all(h["loss"] > 0 for h in history)
    assert [h["lr"] for h in history] == [5e-4, 1e-3, 1e-3, 1e-3]  # two steps of warm-up
    assert (run / "loss.png").stat().st_size > 1000 and {"checkpoint-2", "checkpoint-4"} <= {p.name for p in run.iterdir()}
    lora = load_file(run / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") and "lora_" in k for k in lora)
    assert not any(k.startswith("transformer.") for k in load_file(run / "checkpoint-2" / "lora.safetensors"))
    assert (run / "checkpoint-2" / "lora.safetensors").stat().st_size < 200_000  # the frozen weights are not saved

    # the same run, stopped after step 2 and resumed in another folder: the same steps, bit for bit
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(run / "checkpoint-2", again / "checkpoint-2")
    fresh_accelerator_state()
    assert finetune.main([*common, "--output", str(again), "--resume", "latest"]) == 0
    assert (again / "loss.jsonl").read_text() == (run / "loss.jsonl").read_text()
    resumed = load_file(again / "pytorch_lora_weights.safetensors")
    assert resumed.keys() == lora.keys() and all(torch.equal(resumed[k], lora[k]) for k in lora)

    # the LoRA weights load into the model as diffusers reads them, and they moved from their zero start
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(model / "transformer")
    loaded.load_lora_adapter(str(run / "pytorch_lora_weights.safetensors"), prefix="transformer", adapter_name="run")
    weights = {n.replace(".run", ""): p for n, p in loaded.named_parameters() if "lora_" in n}
    assert weights.keys() == {k.removeprefix("transformer.") for k in lora}
    assert all(torch.equal(weights[k.removeprefix("transformer.")].detach(), v) for k, v in lora.items())
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)


def test_the_route_changes_training_and_the_tread_config_is_simpletuners(tmp_path):
    """--routes none trains the plain model; SimpleTuner's tread_config gives the same steps as the route it means
    (2 → -2 at rate 0.5), and other steps than the baseline's."""
    model, data = tiny_flux(tmp_path)
    common = ["--model", str(model), "--data", str(data), "--steps", "2", "--rank", "4", "--lr", "1e-3"]
    losses = {}
    tread = json.dumps({"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]})
    for name, extra in (("none", ["--routes", "none"]), ("route", ["--routes", "2:-2:0.5"]),
                        ("tread", ["--tread-config", tread])):
        fresh_accelerator_state()
        assert finetune.main([*common, *extra, "--output", str(tmp_path / name)]) == 0
        losses[name] = (tmp_path / name / "loss.jsonl").read_text()
    assert losses["tread"] == losses["route"] and losses["none"] != losses["route"]


def test_wan_trains_in_bf16_with_gradient_checkpointing(tmp_path, monkeypatch):
    model, data = tiny_wan(tmp_path)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    fresh_accelerator_state()
    out = tmp_path / "run"
    assert finetune.main(["--model", str(model), "--data", str(data), "--output", str(out), "--steps", "2",
                          "--rank", "4", "--routes", "default", "--gradient-checkpointing"]) == 0
    fresh_accelerator_state()
    history = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all(0 < h["loss"] < 100 for h in history)
    assert load_file(out / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("change, said", [
    (lambda m, d: ["--model", str(d)], "no config.json"),
    (lambda m, d: ["--data", str(m)], "no .pt or .safetensors"),
    (lambda m, d: ["--tread-config", "{routes"], "--tread-config: not JSON"),
    (lambda m, d: ["--routes", "2:99"], "99"),
    (lambda m, d: ["--routes", "2:-2", "--resume", "latest"], "no checkpoint"),
])
def test_a_bad_argument_is_named_with_the_fix(tmp_path, capsys, change, said):
    model, data = tiny_flux(tmp_path, samples=1)
    argv = ["--model", str(model), "--data", str(data), "--output", str(tmp_path / "run"), "--steps", "1"]
    fresh_accelerator_state()
    assert finetune.main([*argv, *change(model, data)]) == 2
    assert said in capsys.readouterr().err


def test_a_sample_of_another_shape_is_named(tmp_path):
    _, data = tiny_flux(tmp_path, samples=2)
    torch.save({"latents": torch.randn(16, 4, 4), "prompt_embeds": torch.randn(6, 24),
                "pooled_prompt_embeds": torch.randn(16)}, data / "001.pt")
    samples = finetune.Samples(data, finetune.FAMILIES["FluxTransformer2DModel"])
    with pytest.raises(finetune.InputError, match=r"001.pt has latents \(16, 4, 4\) where 000.pt has latents"):
        samples.batch([0, 1], "cpu")


def test_step_indices_cover_each_epoch_once_and_follow_from_the_step_alone():
    order = [i for step in range(5) for i in finetune.step_indices(step, 10, 4, seed=3)]
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    assert finetune.step_indices(3, 10, 4, seed=3) == order[12:16]
    assert finetune.step_indices(0, 10, 4, seed=4) != order[:4]


def test_the_finetune_benchmark_times_both_variants_and_writes_its_files(tmp_path):
    """`python -m benchmarks.finetune --quick`: a tiny FLUX through the finetune command's step, routed and not,
    written as JSON, markdown and PNG with the machine, the commit and the command."""
    pytest.importorskip("matplotlib")
    from benchmarks import finetune as bench

    bench.main(["--quick", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "finetune_flux.json").read_text())
    assert {"commit", "command", "device"} <= set(data["machine"])
    base, routed = data["rows"]
    assert base["variant"] == "--routes none" and routed["variant"] == "--routes 2:-2"
    assert routed["flops"] < base["flops"] and routed["flop_limit"] > 1.2
    assert len(data["setup"]["step_by_step_speedups"]) == 2
    assert "| `--routes 2:-2` |" in (tmp_path / "finetune_flux.md").read_text()
    assert (tmp_path / "finetune_flux.png").stat().st_size > 1000

"""Every file in examples/ runs as a user runs it (its own process, from a folder outside the checkout) on its
small default model, and the README's first example runs as printed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
NEEDS = {"flux_tread_config.py": "diffusers", "wan_video.py": "diffusers", "llama_lm.py": "transformers",
         "timm_vit.py": "timm"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def test_every_example_is_listed_with_what_it_needs():
    assert {p.name for p in EXAMPLES} == set(NEEDS)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_example_trains_verifies_and_keeps_inference(path, tmp_path):
    if importlib.util.find_spec(NEEDS[path.name]) is None:
        pytest.skip(f"{path.name} needs {NEEDS[path.name]}, not installed here")
    done = subprocess.run([sys.executable, str(path), "--steps", "2"], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verified:" in done.stdout and "step 2: loss" in done.stdout, done.stdout[-2000:]
    assert "eval output equals the unrouted model's: True" in done.stdout


def test_the_readmes_first_example_runs_as_printed(tmp_path):
    first = re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    (tmp_path / "first.py").write_text(first)
    done = subprocess.run([sys.executable, "first.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

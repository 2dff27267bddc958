# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv with the pinned CPU torch (an unpinned torch would pull a multi-GB CUDA build when no GPU is
# present), then the package with its dev extra. `make test` also builds .venv-latest with the newest torch release
# (a CUDA build that runs on the CPU; pip's cache keeps re-installs cheap) plus torchvision and timm, and runs the
# whole suite in both: the two ends of the torch range routekit claims on CPU.
PYTHON ?= python3
PINNED_TORCH := 2.13.0
LATEST_REQUIREMENTS := .ci/requirements-latest.txt
LATEST_TORCH := $(shell sed -n 's/^torch==//p' $(LATEST_REQUIREMENTS))
# A machine may cap torch through pip's configuration (a `constraint` in /etc/xdg/pip) below the release the tests
# claim; the newest end installs past it, or pip would refuse it, or, in the second install, take torch back down.
UNCAPPED := PIP_CONSTRAINT=/dev/null
LATEST_NEEDS_GIB := 10

VENV := .venv
LATEST := .venv-latest
STAMP := $(VENV)/.routekit-installed
LATEST_STAMP := $(LATEST)/.routekit-installed
PYTEST := -m pytest -n 2 --dist loadfile

.PHONY: demo test test-pinned test-latest lint clean gpu-carry

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(VENV)/bin/python -m pip install -q torch; \
	else $(VENV)/bin/python -m pip install -q torch==$(PINNED_TORCH); fi
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(LATEST_STAMP): pyproject.toml $(LATEST_REQUIREMENTS)
	@free=$$(df -Pk . "$${TMPDIR:-/tmp}" | awk 'NR > 1 {print int($$4 / 1048576)}' | sort -n | head -1); \
	if [ "$$free" -lt $(LATEST_NEEDS_GIB) ]; then \
	  echo "make test-latest: torch $(LATEST_TORCH)'s CUDA build needs about $(LATEST_NEEDS_GIB) GiB free here and in" \
	       "$${TMPDIR:-/tmp} (its download and its $(LATEST) of ~6 GiB); $$free GiB is free. Free disk space" \
	       "(old clones, venvs, caches), or run \`make test-pinned\` for the pinned end of the range only." >&2; \
	  exit 1; fi
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(UNCAPPED) $(LATEST)/bin/python -m pip install -q -r $(LATEST_REQUIREMENTS)
	$(UNCAPPED) $(LATEST)/bin/python -m pip install -q -e '.[dev,timm]'
	touch $(LATEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/routekit demo

test: test-pinned test-latest

test-pinned: $(STAMP)
	@echo "== tests on torch $$($(VENV)/bin/python -c 'import torch; print(torch.__version__)') =="
	$(VENV)/bin/python $(PYTEST)

# Tests marked one_end run at the pinned end only: what they hold does not change with torch (the DAR kernels in
# Triton's interpreter, the same Triton at both ends; the benchmarks' and the command line's plumbing; the zoo in
# bf16), and the pinned end is the nearer to the GPU machines' torch.
test-latest: $(LATEST_STAMP)
	@echo "== tests on torch $$($(LATEST)/bin/python -c 'import torch; print(torch.__version__)') =="
	$(LATEST)/bin/python $(PYTEST) -m "not one_end"

lint: $(STAMP)
	$(VENV)/bin/ruff check routekit backbones recipes tests benchmarks examples

# What a GPU machine without internet needs beside its torch, transformers and accelerate to run the benchmarks
# and the convergence study: routekit's pure dependencies, diffusers and peft as wheels for its Python (.whl/, installed
# there with --no-deps), MNIST-5k as an npz and mamba-ssm's Triton kernels (its sdist's package folder, put on
# PYTHONPATH: no CUDA build) under .cache/. Run it here, with internet, and carry both folders.
GPU_PYTHON ?= 3.12
MAMBA_SSM ?= 2.3.2.post1
gpu-carry: $(STAMP)
	mkdir -p .whl .cache/site
	$(VENV)/bin/python -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) \
	  --platform manylinux2014_x86_64 -d .whl pydantic tqdm
	$(VENV)/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) -d .whl diffusers peft
	$(VENV)/bin/python -m recipes.data --export .cache/routekit/mnist5k.npz
	rm -rf .cache/mamba-src && mkdir -p .cache/mamba-src
	$(VENV)/bin/python -c "import json, urllib.request as r; \
	  files = json.load(r.urlopen('https://pypi.org/pypi/mamba-ssm/json'))['releases']['$(MAMBA_SSM)']; \
	  sdist = next(f for f in files if f['packagetype'] == 'sdist'); \
	  r.urlretrieve(sdist['url'], '.cache/mamba-src/mamba-ssm.tar.gz')"
	tar xzf .cache/mamba-src/mamba-ssm.tar.gz -C .cache/mamba-src && rm -rf .cache/site/mamba_ssm && \
	  cp -r .cache/mamba-src/mamba_ssm-*/mamba_ssm .cache/site/ && rm -rf .cache/mamba-src
	@ls .whl .cache/site .cache/routekit

clean:
	rm -rf $(VENV) $(LATEST)

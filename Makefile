# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv, install CPU torch 2.13.0 when no GPU is present (an unpinned
# torch would pull a multi-GB CUDA build), then the package with its dev extra.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.routekit-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/routekit demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check routekit backbones recipes tests benchmarks

clean:
	rm -rf $(VENV)

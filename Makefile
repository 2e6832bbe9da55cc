# Everything installs into .venv from scratch (torch 2.13.0, then this package). This project's
# machines have the CPU wheel locally; from PyPI add TORCH_PIP_ARGS="--index-url
# https://download.pytorch.org/whl/cpu" for the CPU build (the default there is CUDA's).
PY      ?= python3
TORCH_PIP_ARGS ?=
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTEST  := $(BIN)/python -m pytest
# DeepSpeed builds its CPU shared-memory op on first use (about a minute here). Built into the
# venv, not the user-wide ~/.cache/torch_extensions: two venvs sharing that cache rebuilt it for
# each other at every launch, and a build killed midway left its lock file there, on which every
# later DeepSpeed launch on the machine waited forever.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: install demo test test-fast test-gpu gpu-wheels bench bench-load clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# A regular (non-editable) install: it carries the .pth hook that auto-activates the plugin.
install: $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q ".[test]"

demo: install
	DS_ACCELERATOR=cpu $(BIN)/python scripts/demo.py

test: install
	DS_ACCELERATOR=cpu $(PYTEST) -v --durations=15

test-fast: install
	$(PYTEST) -q -m "not slow"

# On a multi-GPU runner, with a CUDA build of torch already in $(PY)'s environment: the DeepSpeed
# multi-rank tests with NCCL on the visible GPUs, plus the CUDA-only tests.
test-gpu:
	$(PY) -m pip install -q ".[test]"
	ASYNC_CKPT_TEST_BACKEND=nccl $(PY) -m pytest -v -rs -m "slow or gpu" tests/integration/test_deepspeed_multiproc.py tests/unit/test_cuda.py

# For a lent single-GPU machine that cannot fetch packages (docs/gpu_results.md): the wheels it
# lacks, into .whl/; there, `python3 scripts/gpu_check.py run --out $OUT` runs every GPU check.
gpu-wheels: install
	$(BIN)/python scripts/gpu_check.py wheels

bench: install
	DS_ACCELERATOR=cpu $(BIN)/python scripts/bench_checkpoint.py --out docs/bench_results/latest.json

bench-load: install
	DS_ACCELERATOR=cpu $(BIN)/python scripts/bench_load.py --out docs/bench_results/load.json

clean:
	rm -rf $(VENV) build *.egg-info demo_out bench_out

# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# On a machine without a GPU the CPU build of torch is installed; GPU users pick another build, e.g.
#   make train TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# The oldest torch the unit and distributed tiers pass on (`make test-torch-floor`; README, "Install").
TORCH_FLOOR ?= 2.11.0
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch>=$(TORCH_FLOOR)
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_INDEX ?=
PIP_INDEX_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install train test test-all test-unit test-distributed test-torch-floor reproduce lint format benchmark clean \
	gpu-check gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Stamp file: reinstall only when the package metadata changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q $(PIP_INDEX_ARGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

train: install
	$(BIN)/lightning-dist-train $(ARGS)

# --durations: the slowest tests are listed at the end of every run, so a test that grows slow is seen.
# `slow` marks the few end-to-end runs whose mechanisms also have faster tests here (the README lists them);
# `make test-all` runs them too.
# Two pytest workers, each taking whole files (module fixtures are computed once): most multi-process tests spend
# much of their time waiting (process start-up, rendezvous, polling), which the other worker's test fills.
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15 -m "not slow" $(PYTEST_ARGS)

test-all: install
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15 $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest tests/unit tests/test_configs.py $(PYTEST_ARGS)

test-distributed: install
	$(BIN)/python -m pytest tests/distributed $(PYTEST_ARGS)

# The floor in pyproject.toml, checked: a separate environment with torch==$(TORCH_FLOOR). PyPI has torch 2.11.0 only as
# a CUDA build (about 5 GB with its nvidia wheels), which runs on a CPU machine too; TORCH_INDEX=.../whl/cpu for the
# CPU build where that index is reachable.
test-torch-floor:
	$(MAKE) VENV=.venv-floor TORCH_SPEC="torch==$(TORCH_FLOOR)" install
	.venv-floor/bin/python -c "import torch; print('torch', torch.__version__)"
	.venv-floor/bin/python -m pytest -n 2 --dist loadfile -m "not slow" tests/unit tests/distributed $(PYTEST_ARGS)

# Every CPU recipe against its golden file (loss per step, resumed at half; tokens/s and memory within bands).
reproduce: install
	for recipe in tiny_ddp_cpu tiny_tp_cpu tiny_pp_cpu; do $(BIN)/lightning-dist-reproduce $$recipe || exit 1; done

# On a GPU machine, one command (at most ~8 minutes on one H100, no network): the GPU tests (every layout's first and
# last rank rehearsed on the one GPU, no host sync on quiet steps, an async checkpoint resumed), the app against a plain
# loop (eager and compiled, GPT and HF Llama at 1.24B), one table into docs/benchmarks.md. It runs on the GPU image's own
# python (torch, Lightning, transformers) from this checkout; what that image lacks (Hydra, OmegaConf) comes from .whl/,
# made beforehand by `make gpu-wheels` on a machine with network.
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/lightning-dist-gpu-site
gpu-check:
	@if ! $(GPU_PYTHON) -c "import hydra, omegaconf" 2>/dev/null; then \
	  test -d .whl || { echo "gpu-check: Hydra / OmegaConf are missing and .whl/ is absent; run 'make gpu-wheels' where there is network"; exit 1; }; \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$$PWD:$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py --write-docs $(ARGS)

# The pure-Python wheels a GPU image usually lacks, for `make gpu-check` there (antlr4 ships as an sdist: built here).
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d .whl hydra-core==1.3.2 omegaconf==2.3.0
	$(BIN)/python -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d .whl torchao==0.18.0  # parallelism.float8

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) outputs multirun wandb .pytest_cache .ruff_cache

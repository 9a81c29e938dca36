# `make train` and `make test` each install everything into .venv (CPU torch only) and run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: install train test test-slow lint bench gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

install: $(BIN)/python
	# torch is pinned to the CPU wheel first, so nothing later pulls a CUDA build
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[dev,hf]"

train: install
	$(BIN)/python train.py $(ARGS)

# The tests run as on a fresh machine: $PIPELAUNCH_CACHE (profiles, overheads, optimizer costs) is
# a new empty directory, removed afterwards. TEST_CACHE=dir reuses that one instead (kept).
TEST_CACHE ?=
FRESH_CACHE = cache="$(TEST_CACHE)"; [ -n "$$cache" ] || { cache=$$(mktemp -d -t pipelaunch-cache.XXXXXX) && \
	trap 'rm -rf "$$cache"' EXIT; }; echo "PIPELAUNCH_CACHE=$$cache"; PIPELAUNCH_CACHE="$$cache"

# Two workers (pytest-xdist): most tests keep one core busy, so the suite takes about 2/3 of the
# time it takes alone; each test's processes carry its own marker (tests/conftest.py).
test: install
	@$(FRESH_CACHE) $(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25 $(ARGS)

test-slow: install
	@$(FRESH_CACHE) $(BIN)/python -m pytest -q -m slow $(ARGS)

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python bench/compare_torch_pipelining.py

# The CUDA path end to end on one GPU (bench/gpu_smoke.py; report in $(OUT)/gpu_smoke.json). No
# install step: a GPU machine runs it with its own torch (`source .gpu/setup.sh` first, see docs/gpu.md).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
# Then calibrates the device's hardware file (pipeline/planner/measure/calibrate.py): the efficiencies its
# matmuls, memory-bound ops and launches reach against the datasheet file naming it (conf/hardware/).
gpu-check:
	$(GPU_PYTHON) bench/gpu_smoke.py $(if $(OUT),--out $(OUT),)
	$(GPU_PYTHON) -m pipelaunch.pipeline.planner.measure.calibrate --base auto --out $(or $(OUT),gpu_smoke_out)/hardware_calibrated.yaml

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

# `make train` and `make test` each install everything into .venv (CPU torch only) and run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: install train test test-slow lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

install: $(BIN)/python
	# torch is pinned to the CPU wheel first, so nothing later pulls a CUDA build
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[dev,hf]"

train: install
	$(BIN)/python train.py $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

test-slow: install
	$(BIN)/python -m pytest -q -m slow $(ARGS)

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python bench/compare_torch_pipelining.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

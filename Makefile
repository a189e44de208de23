# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint typecheck unit proto bench bench-runtime clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,runtime]'
	touch $(STAMP)

setup: $(STAMP)

## Run the service on the embedded default (gRPC 127.0.0.1:50051, metrics 127.0.0.1:9400).
serve: setup
	$(BIN)/kvservice serve

## Lint, type-check and run the whole test suite.
test: lint typecheck unit

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/pytest

## Regenerate the protobuf/gRPC modules from proto/.
proto: setup
	$(BIN)/python tools/gen_proto.py

## The core allocator benchmark (ops/s across pool sizes).
bench: setup
	$(BIN)/python -m benchmarks.bench_core

## Paged decode attention vs dense attention (time, GB/s, ratio) on this machine.
bench-runtime: setup
	$(BIN)/python -m benchmarks.bench_paged_attention

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

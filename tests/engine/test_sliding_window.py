"""A model whose every layer attends to a sliding window (Mistral-style) on the real
engine: vLLM lays out one sliding-window KV cache group, and kvservice frees the
blocks the window leaves behind exactly as vLLM's manager does, preempting and
hitting the prefix cache alike: in-process, and remotely on a server started with the
layout the engine names (``--kv-cache-groups sliding_window:64``). On a server of
another layout the engine refuses to start, naming the flag that fixes it.
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
from tests.engine.test_generation import check_returned, server_args

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


def test_remote_refuses_a_pool_of_another_layout_naming_the_fix(
    windowed_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's default layout: full attention.
    with child_server(server_args(CACHING)) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.target)
        with pytest.raises(
            ServerConfigMismatchError,
            match=rf"KV cache groups: vLLM sliding_window:{WINDOW}, kvservice full_attention "
            rf"\(start kvservice with --kv-cache-groups sliding_window:{WINDOW}\)",
        ):
            run_engine(windowed_model, EngineWorkload(0), CACHING, SCHEDULER_CLS)


@pytest.mark.parametrize("name", ["preempting", "caching"])
def test_remote_generates_the_stock_tokens(
    windowed_model: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The server laid out as the engine named, with vLLM's max_num_batched_tokens (the
    pool check and the admission gate count a window plus one batch, as vLLM's) and
    its prefix-cache retention (which out-of-window blocks stay cached)."""
    setup = {"preempting": PREEMPTING, "caching": CACHING}[name]
    workload = EngineWorkload(0, max_tokens=(40, 120), aborts={10: ("req-0",)})
    expected = run_engine(windowed_model, workload, setup)
    args = [
        *server_args(setup),
        f"--kv-cache-groups=sliding_window:{WINDOW}",
        f"--max-num-batched-tokens={setup.max_num_batched_tokens}",
        # vLLM's default: of the window's blocks, cache only what a replay needs.
        "--prefix-cache-retention-interval=0",
    ]
    with child_server(args) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.target)
        actual = run_engine(windowed_model, workload, setup, SCHEDULER_CLS)
        check_returned(server.target)
    assert actual.outcome() == expected.outcome()

"""Retention sent with a completion (``vllm_xargs``) on the real CPU engine: vLLM's
OpenAI server with kvservice's scheduler in-process, a pinned budget and the priority
policy. A system prompt sent plainly is evicted by a churn of long unique prompts (LRU,
as stock vLLM does); one sent with Dynamo's ``cache_control`` TTL, or with a high
priority, still hits after the same churn (vLLM's own prefix-cache counter)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvservice.integrations.vllm.engine_driver import SCHEDULER_CLS
from kvservice.integrations.vllm.tiny_model import SPECIAL_TOKENS, VOCAB_SIZE, text
from tests.engine.test_openai_server import (
    BLOCK_SIZE,
    HITS,
    NUM_BLOCKS,
    VLLMServer,
    complete,
    metric,
    scrape,
    start_vllm,
    stop_vllm,
    wait_healthy,
)

_rng = random.Random(28)
_WORDS = range(len(SPECIAL_TOKENS), VOCAB_SIZE)
SYSTEM_BLOCKS = 4
# Six prompts of 13 blocks: more than the 64-block pool holds beside anything else.
CHURN = [[_rng.choice(_WORDS) for _ in range(13 * BLOCK_SIZE)] for _ in range(6)]


def _system_prompt() -> list[int]:
    return [_rng.choice(_WORDS) for _ in range(SYSTEM_BLOCKS * BLOCK_SIZE)]


def send(server: VLLMServer, tokens: list[int], xargs: dict[str, Any] | None = None) -> None:
    complete(server, text(tokens), max_tokens=1, vllm_xargs=xargs)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "KVSERVICE_EVICTION_POLICY": "priority",
        "KVSERVICE_MAX_PINNED_FRACTION": "0.25",
    }
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "KVSERVICE_TARGET"):
        env.pop(key, None)
    vllm = start_vllm("retention", tiny_model, SCHEDULER_CLS, env, tmp_path_factory.mktemp("r"))
    try:
        wait_healthy([vllm])
        yield vllm
    finally:
        stop_vllm(vllm)


def hits_after_churn(server: VLLMServer, xargs: dict[str, Any] | None) -> float:
    """The prefix-cache hits of a system prompt's second completion, after the churn."""
    system = _system_prompt()
    send(server, [*system, _rng.choice(_WORDS)], xargs)
    for prompt in CHURN:
        send(server, [*prompt, _rng.choice(_WORDS)])
    before = metric(scrape(f"{server.url}/metrics"), HITS)
    send(server, [*system, _rng.choice(_WORDS)])
    return metric(scrape(f"{server.url}/metrics"), HITS) - before


def test_the_pool_is_small_enough_for_the_churn_to_evict() -> None:
    assert len(CHURN) * 13 > NUM_BLOCKS


@pytest.mark.parametrize(
    ("xargs", "kept"),
    [
        (None, False),
        ({"cache_control": "5m"}, True),
        ({"kvservice_priority": 90}, True),
        ({"kvservice_priority": 10}, False),
    ],
)
def test_a_completion_keeps_its_system_prompt_through_churn_when_it_asks(
    server: VLLMServer, xargs: dict[str, Any] | None, kept: bool
) -> None:
    assert hits_after_churn(server, xargs) == (SYSTEM_BLOCKS * BLOCK_SIZE if kept else 0)

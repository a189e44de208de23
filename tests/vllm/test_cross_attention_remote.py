"""An encoder-decoder model's pool (full attention and cross attention, Whisper-style)
served remotely: ``kvservice serve --kv-cache-groups full_attention,cross_attention``,
the engine's startup check accepting it, and every allocation (cross-attention blocks
sized by each request's encoder input) answered as vLLM's own manager answers it."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request

from kvservice.client import KVClient
from kvservice.integrations.vllm import KVServiceKVCacheManager
from kvservice.integrations.vllm.server_link import ServerConfigMismatchError
from tests.servers import server_in_thread
from tests.vllm.test_remote_failures import POOL

NUM_BLOCKS = 48
COMMON = {"block_size": 16, "num_kv_heads": 4, "head_size": 16, "dtype": torch.float16}
SERVER = dataclasses.replace(
    POOL,
    num_blocks=NUM_BLOCKS,
    kv_cache_groups="full_attention,cross_attention",
    max_num_encoder_input_tokens=200,
    enable_caching=False,
)


def _config() -> Any:
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["decoder"], FullAttentionSpec(**COMMON)),
            KVCacheGroupSpec(["cross"], CrossAttentionSpec(**COMMON)),
        ],
    )


def _manager(cls: type) -> Any:
    return cls(
        kv_cache_config=_config(),
        max_model_len=512,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=False,
    )


def _run(manager: Any) -> list[Any]:
    """Seeded admissions with encoder inputs, decodes and frees; every answer."""
    rng = random.Random(0)
    answers: list[Any] = []
    live: list[Request] = []
    for i in range(30):
        manager.new_step_starts()
        request = Request(
            f"r{i}",
            [rng.randrange(50) for _ in range(rng.randrange(5, 60))],
            SamplingParams(max_tokens=8),
            None,
        )
        encoder = rng.randrange(1, 200)
        blocks = manager.allocate_slots(request, request.num_tokens, num_encoder_tokens=encoder)
        answers.append(None if blocks is None else blocks.get_block_ids())
        if blocks is not None:
            request.num_computed_tokens = request.num_tokens
            live.append(request)
        for running in list(live):
            running.append_output_token_ids(rng.randrange(50))
            step = manager.allocate_slots(running, 1)
            answers.append(None if step is None else step.get_block_ids())
            running.num_computed_tokens += 1
            if rng.random() < 0.1 or step is None:
                running.status = running.status.FINISHED_STOPPED
                manager.free(running)
                live.remove(running)
        manager.take_kv_cache_block_copies()  # the step's end: remotely, its round trip
        answers.append(manager.block_pool.get_num_free_blocks())
    return answers


def test_an_encoder_decoder_pool_is_served_remotely_as_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    expected = _run(_manager(VllmManager))
    assert any(a is None for a in expected)  # the pool ran out: admissions were refused
    with server_in_thread(SERVER) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.handle.target)
        ours = _manager(KVServiceKVCacheManager)
        assert _run(ours) == expected
        ours.close()
        with KVClient(server.handle.target) as client:
            assert client.audit().ok
            assert [g.kind for g in client.get_cache_config().groups] == [
                "full_attention",
                "cross_attention",
            ]


def test_a_pool_without_the_cross_attention_group_is_named_at_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = dataclasses.replace(SERVER, kv_cache_groups="full_attention")
    with server_in_thread(config) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.handle.target)
        with pytest.raises(
            ServerConfigMismatchError, match="--kv-cache-groups full_attention,cross_attention"
        ):
            _manager(KVServiceKVCacheManager)

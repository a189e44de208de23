"""Which KV connectors ``KVServiceScheduler`` takes: those that drive vLLM's scheduler
through the manager's methods; not those that bind vLLM's own GPU ``BlockPool``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvservice.integrations.vllm import KVServiceKVCacheManager, KVServiceScheduler
from kvservice.integrations.vllm.testing import (
    SchedulerSetup,
    block_hasher,
    build_scheduler,
    vllm_config,
)


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)


def test_the_offloading_connector_is_taken() -> None:
    scheduler = build_scheduler(SchedulerSetup(offload_cpu_bytes=1 << 20), KVServiceScheduler)
    try:
        assert type(scheduler.connector).__name__ == "OffloadingConnector"
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize(
    ("connector", "binding"),
    [("SimpleCPUOffloadConnector", "bind_gpu_block_pool")],
)
def test_a_connector_binding_vllms_block_pool_is_refused_by_name(
    connector: str, binding: str
) -> None:
    config = vllm_config(SchedulerSetup())
    config.kv_transfer_config = KVTransferConfig(kv_connector=connector, kv_role="kv_both")
    with pytest.raises(NotImplementedError, match=f"{connector}.*{binding}"):
        KVServiceScheduler(vllm_config=config, kv_cache_config=None)


def test_a_multi_connector_is_checked_connector_by_connector() -> None:
    config = vllm_config(SchedulerSetup())
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"},
            ]
        },
    )
    with pytest.raises(NotImplementedError, match="SimpleCPUOffloadConnector"):
        KVServiceScheduler(vllm_config=config, kv_cache_config=None)


def test_a_connector_on_a_mamba_align_model_is_refused() -> None:
    setup = SchedulerSetup(
        num_blocks=200, groups=(("full", 16, 0), ("mamba", 16, 0)), offload_cpu_bytes=1 << 20
    )
    with pytest.raises(NotImplementedError, match='Mamba "align"'):
        build_scheduler(setup, KVServiceScheduler)


def _manager_pair() -> tuple[Any, Any]:
    """vLLM's manager and kvservice's, in-process, on a pool of two attention groups of
    different precisions: vLLM then zeroes fresh blocks (``needs_kv_cache_zeroing``)."""
    common_spec: dict[str, Any] = {"block_size": 16, "num_kv_heads": 1, "head_size": 8}
    config = KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["a"], FullAttentionSpec(**common_spec, dtype=torch.float32)),
            KVCacheGroupSpec(["b"], FullAttentionSpec(**common_spec, dtype=torch.float16)),
        ],
    )
    assert config.needs_kv_cache_zeroing
    common: dict[str, Any] = {
        "kv_cache_config": config,
        "max_model_len": 256,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
    }
    return VllmManager(**common), KVServiceKVCacheManager(**common)


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=block_hasher(16)
    )


def test_truncated_hits_and_zeroing_again_answer_as_vllms_manager() -> None:
    """``truncate_computed_blocks`` (a connector's load covers a hit's tail) and
    ``record_blocks_for_zeroing`` (a failed load's blocks), against vLLM's manager."""
    init_none_hash(sha256)
    answers = []
    for manager in _manager_pair():
        prompt = list(range(1, 70))
        first = _request("first", prompt)
        assert manager.allocate_slots(first, first.num_tokens)
        first.num_computed_tokens = first.num_tokens
        fresh = manager.take_new_block_ids()
        second = _request("second", prompt)
        hit, num_hit, _ = manager.get_computed_blocks(second)
        truncated = manager.truncate_computed_blocks(hit, 32)
        manager.record_blocks_for_zeroing("first", 32)
        answers.append(
            (
                fresh,
                num_hit,
                hit.get_block_ids(),
                truncated.get_block_ids(),
                manager.take_new_block_ids(),
            )
        )
    assert answers[0] == answers[1]
    assert answers[0][3] != answers[0][2] and answers[0][4]  # both did something

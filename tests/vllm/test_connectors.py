"""Which KV connectors ``KVServiceScheduler`` takes: those that drive vLLM's scheduler
through the manager's methods; not those that bind vLLM's own GPU ``BlockPool``."""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig

from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.testing import SchedulerSetup, build_scheduler, vllm_config


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

"""vLLM's ``AsyncScheduler``, once with its built-in manager and once with kvservice's
(``KVServiceScheduler`` builds ``KVServiceAsyncScheduler`` when async scheduling is
on), driven in the engine's batch-queue order, must decide the same step for step."""

from __future__ import annotations

import dataclasses

import pytest

from kvservice.integrations.vllm import KVServiceAsyncScheduler, KVServiceScheduler
from tests.vllm.async_harness import BatchQueueWorkload
from tests.vllm.scheduler_harness import SchedulerSetup, build_scheduler, first_difference
from tests.vllm.test_scheduler_differential import SETUPS as SYNC_SETUPS
from tests.vllm.test_scheduler_differential import WORKLOADS

SETUPS = {
    name: dataclasses.replace(SYNC_SETUPS[name], async_scheduling=True)
    for name in (
        "full",
        "preempting",
        "hybrid-full-sliding-window",
        "chunked-prefill",
        "256-running",
    )
}


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)


def test_the_named_class_builds_the_async_variant() -> None:
    scheduler = build_scheduler(SETUPS["full"], KVServiceScheduler)
    assert type(scheduler) is KVServiceAsyncScheduler
    sync = build_scheduler(SchedulerSetup(), KVServiceScheduler)
    assert type(sync) is KVServiceScheduler


@pytest.mark.parametrize("name", list(SETUPS))
@pytest.mark.parametrize("seed", [0, 1])
def test_in_process_matches_vllms_async_scheduler(name: str, seed: int) -> None:
    setup = SETUPS[name]
    salts = (None, "tenant-a") if seed else (None,)
    traffic = {"hash_block_size": setup.hash_block, **WORKLOADS.get(name, {})}
    expected = BatchQueueWorkload(seed, salts=salts, **traffic).run(build_scheduler(setup))
    actual = BatchQueueWorkload(seed, salts=salts, **traffic).run(
        build_scheduler(setup, KVServiceScheduler)
    )
    assert first_difference(expected, actual) is None

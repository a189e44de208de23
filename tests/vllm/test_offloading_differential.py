"""vLLM's CPU offloading (``--kv-offloading-size``: the native ``OffloadingConnector``)
on kvservice's manager: vLLM 0.33's scheduler with the connector's scheduler side and
a fake worker (``offload_harness``), once with vLLM's built-in ``KVCacheManager`` and
once with kvservice's, must decide alike step for step: every ``SchedulerOutput``, every
load and store (GPU blocks and CPU chunks), the requests waiting for a load, usage,
prefix-cache and connector stats, and every KV event published, the GPU pool's and the
offload tier's (``medium="CPU"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from kvservice.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.offloading import KVServiceOffloadingManager
from tests.server.support import SMALL_POOL
from tests.servers import ThreadedServer, server_in_thread
from tests.vllm.offload_harness import EngineOrderOffloadWorkload, OffloadWorkload
from tests.vllm.scheduler_harness import SchedulerSetup, build_scheduler, first_difference
from tests.vllm.test_scheduler_differential import run_remote

# 4 KiB a block in these setups: 1 << 18 bytes is a CPU tier of 64 chunks, smaller
# than the GPU pool, so the tier evicts.
SMALL_TIER = 1 << 18
LARGE_TIER = 1 << 21

SETUPS = {
    "lru": SchedulerSetup(num_blocks=80, max_model_len=1024, offload_cpu_bytes=SMALL_TIER),
    "arc": SchedulerSetup(
        num_blocks=80,
        max_model_len=1024,
        offload_cpu_bytes=SMALL_TIER,
        offload_eviction_policy="arc",
    ),
    "recompute-failed-loads": SchedulerSetup(
        num_blocks=80,
        max_model_len=1024,
        offload_cpu_bytes=LARGE_TIER,
        kv_load_failure_policy="recompute",
    ),
    "store-threshold": SchedulerSetup(
        num_blocks=80,
        max_model_len=1024,
        offload_cpu_bytes=SMALL_TIER,
        offload_extra=(("store_threshold", 2),),
    ),
    # Loads within the step's budget run before the forward pass (synchronous); a
    # failed one is evicted from the prefix cache (evict_blocks, under "fail").
    "sync-loads": SchedulerSetup(
        num_blocks=80,
        max_model_len=1024,
        offload_cpu_bytes=LARGE_TIER,
        offload_extra=(("sync_load_budget_bytes", 1 << 20),),
    ),
    "preempting": SchedulerSetup(
        num_blocks=40,
        max_num_batched_tokens=256,
        max_model_len=512,
        offload_cpu_bytes=LARGE_TIER,
        kv_load_failure_policy="recompute",
    ),
    "hybrid-full-sliding-window": SchedulerSetup(
        num_blocks=160,
        groups=(("full", 16, 0), ("sliding_window", 16, 64)),
        max_model_len=1024,
        offload_cpu_bytes=LARGE_TIER,
    ),
    "no-prefix-caching": SchedulerSetup(
        num_blocks=80,
        max_model_len=1024,
        enable_prefix_caching=False,
        offload_cpu_bytes=LARGE_TIER,
    ),
}
# Traffic that comes back to earlier prompts after the GPU pool has evicted them.
TRAFFIC: dict[str, Any] = {"num_requests": 80, "repeat_rate": 0.4, "max_tokens": (1, 40)}


def _workload(seed: int, setup: SchedulerSetup, engine_order: bool) -> OffloadWorkload:
    failures = 0.15 if setup.enable_prefix_caching else 0.0
    if engine_order:
        return EngineOrderOffloadWorkload(seed, load_failure_rate=failures, **TRAFFIC)
    return OffloadWorkload(seed, load_failure_rate=failures, **TRAFFIC)


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)


def _run(setup: SchedulerSetup, scheduler_cls: type | None, seed: int, engine_order: bool) -> Any:
    scheduler = build_scheduler(setup, scheduler_cls)
    try:
        return _workload(seed, setup, engine_order).run(scheduler)
    finally:
        scheduler.shutdown()


def _totals(trace: list[Any]) -> dict[str, int]:
    transfers = [s["transfers"] for s in trace if s["transfers"] is not None]
    return {
        "loads": sum(len(t["loads"]) for t in transfers),
        "stores": sum(len(t["stores"]) for t in transfers),
        "cpu_events": sum(1 for s in trace for e in s["events"] if e.medium == "CPU"),
        "async_loads": sum(1 for t in transfers for job in t["loads"] if not job[-1]),
        "waited": sum(1 for s in trace if s["waiting_for_kv"]),
    }


@pytest.mark.parametrize("name", sorted(SETUPS))
@pytest.mark.parametrize("seed", [0, 1])
def test_offloading_decides_as_vllms_manager(name: str, seed: int) -> None:
    setup = SETUPS[name]
    expected = _run(setup, None, seed, engine_order=False)
    actual = _run(setup, KVServiceScheduler, seed, engine_order=False)
    assert first_difference(expected, actual) is None
    totals = _totals(expected)
    # The runs exercised the tier: CPU hits loaded back, stores, the tier's events.
    if setup.enable_prefix_caching:
        assert totals["loads"] > 0, totals
    assert totals["stores"] > 0 and totals["cpu_events"] > 0, totals


@pytest.mark.parametrize("name", ["lru", "recompute-failed-loads", "hybrid-full-sliding-window"])
def test_offloading_with_async_scheduling_decides_as_vllms_async_scheduler(name: str) -> None:
    """Two steps in flight: vLLM defers the frees of a connector that loads
    (``pop_blocks_for_free``, then ``block_pool.free_blocks`` once the step is done)."""
    setup = SchedulerSetup(**{**SETUPS[name].__dict__, "async_scheduling": True})
    expected = _run(setup, None, 3, engine_order=True)
    actual = _run(setup, KVServiceScheduler, 3, engine_order=True)
    assert first_difference(expected, actual) is None
    totals = _totals(expected)
    assert totals["async_loads"] > 0 and totals["waited"] > 0, totals


REMOTE_CASES = [
    ("lru", "sync", False),
    ("sync-loads", "sync", False),
    ("sync-loads", "overlap", True),
    ("recompute-failed-loads", "sync", False),
    ("preempting", "overlap", False),
    ("hybrid-full-sliding-window", "sync", False),
    ("lru", "sync", True),
    ("recompute-failed-loads", "overlap", True),
    ("hybrid-full-sliding-window", "sync", True),
]


@pytest.mark.parametrize(("name", "confirm", "engine_order"), REMOTE_CASES)
def test_remote_offloading_decides_as_vllms_manager(
    name: str, confirm: str, engine_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connector's calls travel in the step (deferred frees as ``free`` keeping the
    blocks for the session, ``evict_blocks``, ``remove_skipped_blocks``), one round trip
    a step; the server's audit passes and every block comes back."""
    setup = SETUPS[name]
    if engine_order:
        setup = SchedulerSetup(**{**setup.__dict__, "async_scheduling": True})
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    expected = _run(setup, None, 3, engine_order)
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    actual = run_remote(setup, _workload(3, setup, engine_order), monkeypatch)
    assert first_difference(expected, actual) is None
    assert _totals(expected)["loads"] > 0


# kvservice's own offload index (``KVServiceOffloadingSpec``) under kvservice's manager.
KVSERVICE_INDEX = (
    ("spec_name", "KVServiceOffloadingSpec"),
    ("spec_module_path", "kvservice.integrations.vllm.offloading"),
)


@pytest.mark.parametrize(
    ("name", "remote", "engine_order"),
    [
        ("lru", False, False),
        ("arc", False, False),
        ("store-threshold", False, True),
        ("lru", True, False),
        ("sync-loads", True, True),
    ],
)
def test_kvservice_manager_and_index_decide_as_vllms(
    name: str, remote: bool, engine_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both layers kvservice's: its manager for the GPU pool and its index for the CPU
    tier, against vLLM's manager and ``CPUOffloadingManager``."""
    stock = SETUPS[name]
    if engine_order:
        stock = SchedulerSetup(**{**stock.__dict__, "async_scheduling": True})
    ours = SchedulerSetup(
        **{**stock.__dict__, "offload_extra": stock.offload_extra + KVSERVICE_INDEX}
    )
    expected = _run(stock, None, 3, engine_order)
    if remote:
        actual = run_remote(ours, _workload(3, ours, engine_order), monkeypatch)
    else:
        actual = _run(ours, KVServiceScheduler, 3, engine_order)
    assert first_difference(expected, actual) is None
    assert _totals(expected)["loads"] > 0


# The same index served by a kvservice server (OffloadStep): the engine's index is then
# its replica, checked by the server once a step.
@contextlib.contextmanager
def index_server(published: list[KVCacheEvent]) -> Iterator[ThreadedServer]:
    """A server with KV events on; ``published`` gets every event it publishes."""
    with server_in_thread(dataclasses.replace(SMALL_POOL, kv_events=True)) as server:
        events = server.server.events
        assert events is not None
        server.call(lambda: events.add_listener(published.extend))
        yield server


def offload_manager(scheduler: Any) -> KVServiceOffloadingManager:
    manager = scheduler.connector.connector_scheduler.manager
    assert isinstance(manager, KVServiceOffloadingManager)
    return manager


def server_offload_counts(server: ThreadedServer) -> dict[str, float]:
    registry = server.server.metrics.registry
    labels = server.server.metrics.labels
    names = ("keys_stored_total", "keys_loaded_total", "keys_evicted_total", "tiers")
    return {
        name: registry.get_sample_value(f"kvservice_offload_{name}", labels) or 0.0
        for name in names
    }


@pytest.mark.parametrize(
    ("name", "kv_manager", "engine_order"),
    [
        ("lru", "vllm", False),
        ("arc", "vllm", True),
        ("store-threshold", "kvservice", False),
        ("sync-loads", "kvservice", True),
        ("hybrid-full-sliding-window", "vllm", False),
        ("lru", "remote", False),
    ],
)
def test_kvservice_serves_the_index_and_the_engine_decides_as_vllms(
    name: str, kv_manager: str, engine_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvservice_target``: the index runs on a kvservice server, one OffloadStep a
    step, under vLLM's own GPU manager or kvservice's (in-process or remote); the
    engine decides exactly as with vLLM's ``CPUOffloadingManager``, the server agrees
    with every answer, counts the tier's stores, loads and evictions, publishes its
    chunks as KV events (medium "CPU"), and drops the index with the session."""
    stock = SETUPS[name]
    if engine_order:
        stock = SchedulerSetup(**{**stock.__dict__, "async_scheduling": True})
    expected = _run(stock, None, 3, engine_order)
    published: list[KVCacheEvent] = []
    with index_server(published) as server:
        served = (*KVSERVICE_INDEX, ("kvservice_target", server.target))
        ours = SchedulerSetup(**{**stock.__dict__, "offload_extra": stock.offload_extra + served})
        workload = _workload(3, ours, engine_order)
        if kv_manager == "remote":
            actual = run_remote(ours, workload, monkeypatch)
        else:
            scheduler = build_scheduler(
                ours, KVServiceScheduler if kv_manager == "kvservice" else None
            )
            actual = workload.run(scheduler)
            link = offload_manager(scheduler).link
            assert link is not None
            assert 0 < link.round_trips <= len(actual)
            assert server_offload_counts(server)["tiers"] == 1
            scheduler.shutdown()
        counts = server_offload_counts(server)
    assert first_difference(expected, actual) is None
    assert _totals(expected)["loads"] > 0
    # The scheduler's shutdown ended the index's session: the server dropped it.
    assert counts["tiers"] == 0
    assert counts["keys_stored_total"] > 0 and counts["keys_loaded_total"] > 0, counts
    if name in ("lru", "arc"):
        assert counts["keys_evicted_total"] > 0
    # The pool of this server is idle: every event is the tier's.
    kinds = {type(event) for event in published}
    assert BlockStored in kinds and kinds <= {BlockStored, BlockRemoved}, kinds
    assert (BlockRemoved in kinds) == (counts["keys_evicted_total"] > 0)
    assert all(event.medium == "CPU" for event in published)  # type: ignore[union-attr]

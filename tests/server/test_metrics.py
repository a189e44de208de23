"""The Prometheus endpoint, scraped over real HTTP while requests come and go."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.app import KVCacheServer, ServerHandle
from kvservice.server.config import ServerConfig
from kvservice.server.metrics import ClientTracker
from tests.server.support import SMALL_POOL, add, admit, allocate, free, lookup, tokens
from tests.servers import Stub, raw_stub, running_server

LABELS = {"model_name": "test-model", "engine": "0"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


METERED = dataclasses.replace(SMALL_POOL, metrics_port=0)


@pytest.fixture
def server_config() -> ServerConfig:
    return METERED


@pytest.fixture
def metered(server: KVCacheServer, stub: Stub) -> tuple[ServerHandle, Stub]:
    """The server's handle (its metrics URL) and a stub to it."""
    return server.handle, stub


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        body: bytes = response.read()
    return body.decode()


async def scrape(handle: ServerHandle) -> Samples:
    assert handle.metrics_url is not None
    # The endpoint runs in its own thread; fetch off the loop anyway.
    text = await asyncio.to_thread(_fetch, handle.metrics_url)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({**LABELS, **labels}.items()))]


async def test_usage_and_prefix_counters_move(metered: tuple[ServerHandle, Stub]) -> None:
    """Usage follows allocations; the prefix cache _total counters count looked-up
    and hit tokens; allocation outcomes are counted by result."""
    handle, stub = metered
    start = await scrape(handle)
    assert value(start, "vllm:kv_cache_usage_perc") == 0.0
    assert value(start, "vllm:prefix_cache_queries_total") == 0.0
    assert value(start, "kvservice_free_blocks") == 10

    await add(stub, "a", tokens(48))
    await admit(stub, "a")
    mid = await scrape(handle)
    assert value(mid, "vllm:kv_cache_usage_perc") == pytest.approx(0.3)
    assert value(mid, "kvservice_used_blocks") == 3
    assert value(mid, "vllm:prefix_cache_queries_total") == 48
    assert value(mid, "kvservice_allocations_total", result="ok") == 1

    await free(stub, "a", pb.FREE_MODE_FINISH)
    await add(stub, "b", tokens(48))
    await admit(stub, "b")
    await add(stub, "big", tokens(128, start=900))
    await lookup(stub, "big")
    assert (await allocate(stub, "big", 128)).outcome == pb.ALLOCATION_OUTCOME_NO_SPACE
    with pytest.raises(grpc.aio.AioRpcError):
        await allocate(stub, "big", -1)

    end = await scrape(handle)
    assert value(end, "vllm:prefix_cache_queries_total") == 48 + 48 + 128
    assert value(end, "vllm:prefix_cache_hits_total") == 32
    assert value(end, "kvservice_allocations_total", result="ok") == 2
    assert value(end, "kvservice_allocations_total", result="no_space") == 1
    assert value(end, "kvservice_allocations_total", result="invalid") == 1


async def test_a_step_reports_the_pool_as_its_calls_one_by_one() -> None:
    """A Step reports the pool to the metrics once, at its end, yet every series ends
    where the same operations sent as unary calls leave it (same pool, same ids)."""
    ops = [
        pb.StepOperation(
            add_request=pb.AddRequestRequest(request_id="a", prompt_token_ids=tokens(48))
        ),
        pb.StepOperation(get_computed_blocks=pb.GetComputedBlocksRequest(request_id="a")),
        pb.StepOperation(allocate_slots=pb.AllocateSlotsRequest(request_id="a", num_new_tokens=48)),
        pb.StepOperation(
            add_request=pb.AddRequestRequest(request_id="b", prompt_token_ids=tokens(48))
        ),
        pb.StepOperation(get_computed_blocks=pb.GetComputedBlocksRequest(request_id="b")),
        pb.StepOperation(allocate_slots=pb.AllocateSlotsRequest(request_id="b", num_new_tokens=48)),
        pb.StepOperation(
            free_request=pb.FreeRequestRequest(request_id="a", mode=pb.FREE_MODE_PREEMPT)
        ),
        pb.StepOperation(allocate_slots=pb.AllocateSlotsRequest(request_id="zz", num_new_tokens=1)),
    ]
    scraped: list[Samples] = []
    for batched in (False, True):
        async with running_server(METERED) as server, raw_stub(server) as stub:
            if batched:
                await stub.Step(pb.StepRequest(step_id=1, ops=ops))
            else:
                for op in ops:
                    kind = op.WhichOneof("op")
                    assert kind is not None
                    rpc = "".join(part.title() for part in kind.split("_"))
                    # The last one is refused either way.
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await getattr(stub, rpc)(getattr(op, kind))
            scraped.append(await scrape(server.handle))
    names = (
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "kvservice_free_blocks",
        "kvservice_used_blocks",
    )
    one_by_one, stepped = scraped
    for name in names:
        assert value(stepped, name) == value(one_by_one, name), name
    for result in ("ok", "no_space", "invalid"):
        assert value(stepped, "kvservice_allocations_total", result=result) == value(
            one_by_one, "kvservice_allocations_total", result=result
        )
    assert value(stepped, "vllm:prefix_cache_queries_total") == 96
    assert value(stepped, "kvservice_used_blocks") == 3


async def test_cache_config_info(metered: tuple[ServerHandle, Stub]) -> None:
    """vllm:cache_config_info carries the block size and pool size as labels."""
    handle, _ = metered
    samples = await scrape(handle)
    [labels] = [dict(lbls) for name, lbls in samples if name == "vllm:cache_config_info"]
    assert labels["block_size"] == "16"
    assert labels["num_gpu_blocks"] == "11"
    assert labels["model_name"] == "test-model"
    assert labels["engine"] == "0"


async def test_servers_do_not_share_metrics(metered: tuple[ServerHandle, Stub]) -> None:
    """Each server has its own registry: a second one starts at zero."""
    handle, stub = metered
    await add(stub, "a", tokens(48))
    await admit(stub, "a")
    async with running_server(METERED) as other:
        assert other.handle.metrics_port != handle.metrics_port
        assert value(await scrape(other.handle), "vllm:kv_cache_usage_perc") == 0.0
    assert value(await scrape(handle), "vllm:kv_cache_usage_perc") > 0


EXPECTED_FAMILIES = {
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info",
    "kvservice_free_blocks",
    "kvservice_used_blocks",
    "kvservice_cached_blocks",
    "kvservice_evictions_total",
    "kvservice_allocations_total",
    "kvservice_rpc_duration_seconds_bucket",
    "kvservice_rpc_in_flight",
    "kvservice_active_requests",
    "kvservice_active_clients",
    "kvservice_events_published_total",
    "kvservice_events_dropped_total",
}


async def test_every_series_is_exported_with_both_labels(
    metered: tuple[ServerHandle, Stub],
) -> None:
    """Every series of the service is on /metrics, labelled model_name and engine."""
    handle, stub = metered
    await stub.GetUsage(pb.GetUsageRequest())
    samples = await scrape(handle)
    names = {name for name, _ in samples}
    assert names >= EXPECTED_FAMILIES
    for name, labels in samples:
        if name in EXPECTED_FAMILIES:
            assert {"model_name": "test-model", "engine": "0"}.items() <= dict(labels).items()


async def test_service_series_move(metered: tuple[ServerHandle, Stub]) -> None:
    """Preemptions, cached blocks, evictions on reuse, active requests and clients,
    and the per-method RPC histogram follow what the calls did."""
    handle, stub = metered
    client = (("x-client-id", "sched-a"),)
    await add(stub, "a", tokens(48))
    await admit(stub, "a")
    await free(stub, "a", pb.FREE_MODE_PREEMPT)
    await stub.GetUsage(pb.GetUsageRequest(), metadata=client)
    await stub.GetUsage(pb.GetUsageRequest(), metadata=(("x-client-id", "sched-b"),))
    mid = await scrape(handle)
    assert value(mid, "vllm:num_preemptions_total") == 1
    assert value(mid, "kvservice_cached_blocks") == 3
    assert value(mid, "kvservice_active_requests") == 1
    assert value(mid, "kvservice_active_clients") == 2
    assert value(mid, "kvservice_rpc_duration_seconds_count", method="AddRequest") == 1
    assert value(mid, "kvservice_rpc_in_flight", method="AddRequest") == 0

    # 8 new blocks: the 7 never-used ones, then the oldest cached one (evicted).
    await add(stub, "big", tokens(128, start=900))
    await allocate(stub, "big", 128)
    end = await scrape(handle)
    assert value(end, "kvservice_evictions_total", reason="reuse") == 1
    assert value(end, "kvservice_evictions_total", reason="invalidated") == 0
    assert value(end, "kvservice_cached_blocks") == 2
    assert value(end, "kvservice_active_requests") == 2


class TestClientTracker:
    def test_window_and_open_streams(self) -> None:
        """A client counts while a stream is open and for the window after its last
        call; calls without a client id are not counted."""
        now = [0.0]
        tracker = ClientTracker(window_s=60, clock=lambda: now[0])
        tracker.seen("a")
        tracker.seen(None)
        tracker.open_stream("b")
        assert tracker.count() == 2
        now[0] = 100.0
        assert tracker.count() == 1  # "a" aged out; "b" still streams
        tracker.close_stream("b")
        now[0] = 159.0
        assert tracker.count() == 1
        now[0] = 161.0
        assert tracker.count() == 0

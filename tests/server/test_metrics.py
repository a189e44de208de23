"""The Prometheus endpoint, scraped over real HTTP while requests come and go."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.server import ServerHandle, serve_in_background
from kvservice.server.gen import kv_cache_service_pb2 as pb
from kvservice.server.gen import kv_cache_service_pb2_grpc as pb_grpc
from tests.server.support import SMALL_POOL, Stub, add, admit, allocate, free, lookup, tokens

LABELS = {"model_name": "test-model", "engine": "0"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
async def metered() -> AsyncIterator[tuple[ServerHandle, Stub]]:
    config = dataclasses.replace(SMALL_POOL, metrics_port=0)
    async with (
        serve_in_background(config) as handle,
        grpc.aio.insecure_channel(handle.target) as channel,
    ):
        yield handle, pb_grpc.KVCacheServiceStub(channel)


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
    async with serve_in_background(dataclasses.replace(SMALL_POOL, metrics_port=0)) as other:
        assert other.metrics_port != handle.metrics_port
        assert value(await scrape(other), "vllm:kv_cache_usage_perc") == 0.0
    assert value(await scrape(handle), "vllm:kv_cache_usage_perc") > 0

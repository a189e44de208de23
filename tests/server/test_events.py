"""KV events over SubscribeEvents: a real server with --kv-events and the real clients.

Every check ends by comparing what a subscriber folded from the stream with the
pool's own prefix cache map, read from the server object between RPCs. Reads wait
for a known sequence number (the server's ``last_sequence``), never for time; the
timeout is only a safety net.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncGenerator

import pytest

from kvservice.client import (
    AllBlocksCleared,
    AsyncKVClient,
    BlockRemoved,
    BlockStored,
    CachedBlocksView,
    CacheSnapshot,
    EventStreamItem,
    FailedPreconditionError,
    KVClient,
    StepBuilder,
    SubscriberDroppedError,
)
from kvservice.core.kv_cache_block import get_block_hash, get_group_id
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.events import EventLog
from kvservice.server.settings import load_settings
from tests.server.support import SMALL_POOL, tokens
from tests.servers import THREAD_TIMEOUT_S, running_server, server_in_thread

EVENTS_POOL = dataclasses.replace(SMALL_POOL, kv_events=True)
LABELS = {"model_name": "test-model", "engine": "0"}
Items = AsyncGenerator[EventStreamItem, None]


def pool_view(server: KVCacheServer) -> Counter[tuple[int, bytes]]:
    """The pool's prefix cache map as (group, hash) -> number of blocks."""
    cache = server.table.manager.block_pool.cached_block_hash_to_block
    return Counter({(get_group_id(k), get_block_hash(k)): len(cache.blocks_of(k)) for k in cache})


def event_log(server: KVCacheServer) -> EventLog:
    assert server.events is not None
    return server.events


async def next_item(items: Items) -> EventStreamItem:
    return await asyncio.wait_for(anext(items), THREAD_TIMEOUT_S)


async def catch_up(server: KVCacheServer, items: Items, view: CachedBlocksView) -> None:
    """Fold items until the view has every event the server published."""
    while view.sequence < event_log(server).last_sequence:
        view.apply(await next_item(items))


async def cache(client: AsyncKVClient, request_id: str, prompt: list[int]) -> None:
    """Admit a request (lookup, allocate with the hit) and finish it: its full blocks
    stay cached, free."""
    await client.add_request(request_id, prompt)
    hit = await client.get_computed_blocks(request_id)
    assert await client.allocate_slots(request_id, len(prompt) - hit.num_computed_tokens, hit)
    await client.free(request_id)


async def churn(client: AsyncKVClient, tag: str) -> None:
    """Stores, evictions (the pool has 10 blocks) and duplicate keys."""
    await cache(client, f"{tag}-a", tokens(48))
    await cache(client, f"{tag}-b", tokens(128, start=1000))  # evicts part of "a"
    # Two requests with one prompt, allocated without a lookup: both cache the same
    # keys, so the map holds two blocks per key.
    for rid in (f"{tag}-d1", f"{tag}-d2"):
        await client.add_request(rid, tokens(32, start=5000))
        assert await client.allocate_slots(rid, 32)
    for rid in (f"{tag}-d1", f"{tag}-d2"):
        await client.free(rid)
    await cache(client, f"{tag}-a2", tokens(48))


@pytest.fixture
def server_config() -> ServerConfig:
    return EVENTS_POOL


async def test_late_subscriber_starts_from_a_snapshot(
    server: KVCacheServer, client: AsyncKVClient
) -> None:
    await churn(client, "before")
    items = client.subscribe_events()
    snapshot = await next_item(items)
    assert isinstance(snapshot, CacheSnapshot)
    assert snapshot.sequence == event_log(server).last_sequence > 0
    view = CachedBlocksView()
    view.apply(snapshot)
    assert view.counts == pool_view(server)
    assert 2 in view.counts.values()  # the duplicated keys are counted

    await churn(client, "after")
    seen: list[int] = []
    while view.sequence < event_log(server).last_sequence:
        item = await next_item(items)
        seen.append(item.sequence)
        view.apply(item)
    assert seen == list(range(snapshot.sequence + 1, view.sequence + 1))  # no gap
    assert view.counts == pool_view(server)
    await items.aclose()
    server.audit()


async def test_resubscribe_gets_only_the_missed_events(
    server: KVCacheServer, client: AsyncKVClient
) -> None:
    view = CachedBlocksView()
    items = client.subscribe_events()
    view.apply(await next_item(items))
    await churn(client, "one")
    await catch_up(server, items, view)
    await items.aclose()

    await churn(client, "two")  # missed while disconnected
    resumed = client.subscribe_events(view.sequence, view.log_id)
    first = await next_item(resumed)
    assert not isinstance(first, CacheSnapshot)
    assert first.sequence == view.sequence + 1
    view.apply(first)
    await catch_up(server, resumed, view)
    assert view.counts == pool_view(server)
    await resumed.aclose()


async def test_resubscribe_past_the_buffer_or_from_another_log_gets_a_snapshot() -> None:
    config = dataclasses.replace(EVENTS_POOL, kv_events_buffer_size=2)
    async with running_server(config) as server, AsyncKVClient(server.handle.target) as client:
        await churn(client, "x")
        assert event_log(server).last_sequence > 3
        for from_sequence, log_id in ((1, ""), (event_log(server).last_sequence, "other")):
            items = client.subscribe_events(from_sequence, log_id)
            snapshot = await next_item(items)
            assert isinstance(snapshot, CacheSnapshot)
            view = CachedBlocksView()
            view.apply(snapshot)
            assert view.counts == pool_view(server)
            await items.aclose()


async def test_event_fields_and_reset(server: KVCacheServer, client: AsyncKVClient) -> None:
    items = client.subscribe_events()
    empty = await next_item(items)
    assert isinstance(empty, CacheSnapshot) and empty.blocks == () and empty.sequence == 0
    await cache(client, "a", tokens(40))
    stored = await next_item(items)
    assert isinstance(stored, BlockStored)
    assert stored.sequence == 1 and stored.log_id == empty.log_id
    assert len(stored.block_hashes) == 2 and stored.parent_block_hash is None
    assert stored.token_ids == tuple(tokens(32))
    assert (stored.block_size, stored.group_idx, stored.medium) == (16, 0, "GPU")
    assert stored.kv_cache_spec_kind == "full_attention"

    assert await client.reset_prefix_cache()
    cleared = await next_item(items)
    assert isinstance(cleared, AllBlocksCleared) and cleared.sequence == 2
    assert pool_view(server) == Counter()

    view = CachedBlocksView()
    for earlier in (empty, stored, cleared):
        view.apply(earlier)
    assert view.counts == Counter()
    await cache(client, "big", tokens(128, start=1000))
    await cache(client, "other", tokens(48, start=9000))  # evicts "big" blocks
    kinds = set()
    while view.sequence < event_log(server).last_sequence:
        item = await next_item(items)
        kinds.add(type(item))
        view.apply(item)
    assert kinds == {BlockStored, BlockRemoved}
    assert view.counts == pool_view(server)
    await items.aclose()


async def test_a_slow_subscriber_is_dropped() -> None:
    """One Step caches three prompts: three events at once, without the server loop
    ever yielding, overflow a queue of one, whatever the timing."""
    config = dataclasses.replace(EVENTS_POOL, kv_events_queue_size=1)
    async with running_server(config) as server, AsyncKVClient(server.handle.target) as client:
        items = client.subscribe_events()
        assert isinstance(await next_item(items), CacheSnapshot)
        step = StepBuilder()
        for i in range(3):
            step.add_request(f"r{i}", tokens(16, start=100 * i))
            step.allocate_slots(f"r{i}", 16)
        assert (await client.step(step)).ok
        with pytest.raises(SubscriberDroppedError, match="resubscribe"):
            while True:
                await next_item(items)
        assert event_log(server).num_subscribers == 0
        registry = server.metrics.registry
        assert registry.get_sample_value("kvservice_events_published_total", LABELS) == 3
        # The one queued and the one that did not fit.
        assert registry.get_sample_value("kvservice_events_dropped_total", LABELS) == 2
        # The server kept serving, and a resubscribe from 0 catches up.
        items = client.subscribe_events()
        view = CachedBlocksView()
        view.apply(await next_item(items))
        assert view.counts == pool_view(server) and len(view.counts) == 3
        await items.aclose()


async def test_off_answers_failed_precondition() -> None:
    async with (
        running_server(SMALL_POOL) as server,
        AsyncKVClient(server.handle.target, client_id="test-scheduler") as client,
    ):
        with pytest.raises(FailedPreconditionError, match="--kv-events"):
            await anext(client.subscribe_events())


def test_sync_client_subscribes() -> None:
    with (
        server_in_thread(EVENTS_POOL) as running,
        KVClient(running.target) as client,
    ):
        items = client.subscribe_events()
        snapshot = next(items)
        assert isinstance(snapshot, CacheSnapshot) and snapshot.blocks == ()
        client.add_request("a", tokens(32))
        assert client.allocate_slots("a", 32) is not None
        stored = next(items)
        assert isinstance(stored, BlockStored) and stored.sequence == 1
        items.close()


def test_the_setting() -> None:
    assert not load_settings({}, {}).server.kv_events
    assert load_settings({"kv_events": True}, {}).server.kv_events
    on = load_settings({}, {"KVSERVICE_KV_EVENTS": "1", "KVSERVICE_KV_EVENTS_QUEUE_SIZE": "7"})
    assert (on.server.kv_events, on.server.kv_events_queue_size) == (True, 7)
    server = KVCacheServer(EVENTS_POOL)
    assert server.table.manager.block_pool.enable_kv_cache_events

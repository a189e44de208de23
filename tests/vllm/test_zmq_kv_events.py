"""The ZMQ KV event stream of a real server (real gRPC and real ZMQ, loopback, free
ports), read by a subscriber built from vLLM 0.33.0's own classes.

Every check compares what that subscriber decoded with the pool itself (its prefix
cache map, read between calls) and with what vLLM's own ``KVCacheManager`` emits for
the same requests. Reads wait for a known sequence number, never for time; timeouts
are only a safety net.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvservice.client import AsyncKVClient, CachedBlocksView, CacheSnapshot, StepBuilder
from kvservice.client import BlockRemoved as GrpcRemoved
from kvservice.client import BlockStored as GrpcStored
from kvservice.request_table.tenancy import tenant_cache_salt
from kvservice.server import turns
from kvservice.server.zmq_events.wire import int_block_hash
from tests.server.support import HYBRID_POOL, tokens
from tests.server.test_tenants import write_tokens_file
from tests.servers import running_server
from tests.vllm.support import (
    ZMQ_ON,
    ZMQ_POOL,
    VllmReference,
    VllmSubscriber,
    metric,
    server_keys,
    settle,
)

# 23 usable blocks of 16 tokens: the workload below evicts all the time.
DIFF_POOL = dataclasses.replace(ZMQ_POOL, num_blocks=24)
PREFIXES = [tokens(32, start=10_000 * (i + 1)) for i in range(3)]


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


class Workload:
    """A seeded scheduler-like run, each move made on the server (RPCs; the decodes of
    a round in one Step) and on vLLM's own manager, whose answers must agree."""

    def __init__(self, client: AsyncKVClient, reference: VllmReference, seed: int) -> None:
        self.client = client
        self.reference = reference
        self.rng = random.Random(seed)
        self.num_tokens: dict[str, int] = {}
        self.next_id = 0
        self.max_len = DIFF_POOL.max_model_len - 1

    async def run(self, rounds: int) -> None:
        for _ in range(rounds):
            if self.rng.random() < 0.6:
                await self.admit()
            if self.num_tokens and self.rng.random() < 0.8:
                await self.decode_all()
            if self.num_tokens and self.rng.random() < 0.3:
                await self.free(self.rng.choice(sorted(self.num_tokens)))

    def prompt(self) -> list[int]:
        rng = self.rng
        prefix = rng.choice(PREFIXES)[: rng.choice((0, 16, 32))]
        return prefix + [rng.randrange(50_000) for _ in range(rng.randrange(1, 48))]

    async def admit(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = self.prompt()
        await self.client.add_request(rid, prompt)
        hit = await self.client.get_computed_blocks(rid)
        ours = await self.client.allocate_slots(rid, len(prompt) - hit.num_computed_tokens, hit)
        assert (ours is not None) == self.reference.admit(rid, prompt)
        self.num_tokens[rid] = len(prompt)
        if ours is None:
            await self.free(rid)

    async def decode_all(self) -> None:
        for rid in [r for r, n in self.num_tokens.items() if n >= self.max_len]:
            await self.free(rid)
        step = StepBuilder()
        sampled = {rid: self.rng.randrange(50_000) for rid in sorted(self.num_tokens)}
        handles = {}
        for rid, token in sampled.items():
            step.append_tokens(rid, [token])
            handles[rid] = step.allocate_slots(rid, 1)
        results = await self.client.step(step)
        full = []
        for rid, token in sampled.items():
            self.num_tokens[rid] += 1
            fits = results[handles[rid]] is not None
            assert fits == self.reference.decode(rid, token)
            if not fits:
                full.append(rid)
        for rid in full:  # after the step, as the server saw it
            await self.free(rid)

    async def free(self, rid: str) -> None:
        await self.client.free(rid)
        self.reference.free(rid)
        del self.num_tokens[rid]


async def test_vllm_subscriber_rebuilds_the_pool_and_matches_vllms_own_events(
    zmq_context: zmq.asyncio.Context,
) -> None:
    """A subscriber connected from the start decodes every batch, without a gap; the
    keys it rebuilds are the pool's, and its events, flattened, are field for field
    what vLLM's KVCacheManager emitted for the same requests, in the order of the
    server's own event log (SubscribeEvents)."""
    async with (
        running_server(DIFF_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        subscriber = VllmSubscriber(zmq_context, server)
        grpc_items = client.subscribe_events()
        view = CachedBlocksView()
        snapshot = await anext(grpc_items)
        assert isinstance(snapshot, CacheSnapshot)
        view.apply(snapshot)
        reference = VllmReference(DIFF_POOL)
        await Workload(client, reference, seed=16).run(rounds=120)

        last = await settle(server)
        await subscriber.catch_up(last)
        assert subscriber.next_sequence == last + 1
        assert subscriber.events == reference.events
        assert subscriber.keys == server_keys(server)
        stored = [e for e in subscriber.events if isinstance(e, BlockStored)]
        assert len(stored) > 50 and any(e.parent_block_hash is not None for e in stored)
        assert any(type(e).__name__ == "BlockRemoved" for e in subscriber.events)
        # One Step, one batch: a round's decodes can cache several blocks at once.
        assert any(len(batch.events) > 1 for batch in subscriber.batches)

        # One source of truth: each event of the log is in exactly one batch, in the
        # log's order.
        event_log = server.events
        assert event_log is not None
        assert len(subscriber.events) == event_log.last_sequence
        for expected in subscriber.events:
            item = await anext(grpc_items)
            view.apply(item)
            assert type(item).__name__ == type(expected).__name__
            if isinstance(item, GrpcStored | GrpcRemoved):
                assert [int_block_hash(h) for h in item.block_hashes] == expected.block_hashes
                assert item.group_idx == expected.group_idx
        assert {(g, int_block_hash(h)): n for (g, h), n in view.counts.items()} == subscriber.keys
        assert metric(server, "kvservice_kv_event_zmq_batches_published_total") == last + 1
        assert metric(server, "kvservice_kv_event_zmq_batches_dropped_total") == 0
        await grpc_items.aclose()
        subscriber.close()
        server.audit()


async def test_a_late_subscriber_replays_then_follows_live(
    zmq_context: zmq.asyncio.Context,
) -> None:
    """Connected after the workload, on a topic: the replay socket gives it every
    batch so far, the SUB socket the later ones; its keys are the pool's throughout."""
    config = dataclasses.replace(
        DIFF_POOL, kv_events_config=dataclasses.replace(ZMQ_ON, topic="kv@pool-0")
    )
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        reference = VllmReference(config)
        workload = Workload(client, reference, seed=7)
        await workload.run(rounds=60)
        late = VllmSubscriber(zmq_context, server)
        await late.catch_up(await settle(server))
        assert late.replays >= 1 and late.next_sequence > 10
        assert late.keys == server_keys(server)
        assert late.events == reference.events

        await workload.run(rounds=40)
        await late.catch_up(await settle(server))
        assert late.keys == server_keys(server)
        assert late.events == reference.events
        late.close()


async def test_a_stalled_subscriber_overflows_alone_and_the_server_keeps_serving(
    zmq_context: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscriber that stops reading fills its kernel buffers, then its hwm: the
    publisher counts the overflow and goes on; every Step is served, each batch
    handed on. A subscriber reading meanwhile gets every batch; the stalled one, once
    it reads again, finds the gap, replays and ends with the pool's keys."""
    # One batch per Step is counted below: no Step may pause (a garbage collection
    # inside one can take a whole slice of CPU time and split its batch in two).
    monkeypatch.setattr(turns, "SLICE_S", 60.0)
    config = dataclasses.replace(
        ZMQ_POOL,
        num_blocks=65,
        max_model_len=128,
        kv_events_config=dataclasses.replace(ZMQ_ON, hwm=16, buffer_steps=100_000),
    )
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        # Alone at first, so the overflow counted is its own.
        stalled = VllmSubscriber(zmq_context, server, rcvhwm=1, rcvbuf=4096)
        rng = random.Random(3)
        served = 0

        async def step() -> None:
            nonlocal served
            builder = StepBuilder()
            for i in range(4):
                rid = f"s{served}-{i}"
                builder.add_request(rid, [rng.randrange(50_000) for _ in range(128)])
                builder.allocate_slots(rid, 128)
                builder.free(rid)
            assert (await client.step(builder)).ok
            served += 1

        overflows = "kvservice_kv_event_zmq_subscriber_overflows_total"
        # Far more data than the kernel can buffer for the stalled socket (4 MiB).
        while metric(server, overflows) == 0 and served < 20_000:
            await step()
        assert metric(server, overflows) >= 1
        reader = VllmSubscriber(zmq_context, server)
        for _ in range(200):  # more while the stalled one lags
            await step()
        last = await settle(server)
        assert last + 1 == served  # one batch per Step, each handed on

        await reader.catch_up(last)
        assert reader.keys == server_keys(server)
        # The thread published every batch (the reader has the last one) and the
        # hand-off never dropped one.
        assert metric(server, "kvservice_kv_event_zmq_batches_published_total") == served
        assert metric(server, "kvservice_kv_event_zmq_batches_dropped_total") == 0
        await stalled.catch_up(last)
        assert stalled.replays >= 1  # what it lost came from the replay socket
        assert stalled.keys == server_keys(server)
        assert stalled.events == reader.events
        stalled.close()
        reader.close()


async def test_bytes_hashes_on_a_hybrid_pool(zmq_context: zmq.asyncio.Context) -> None:
    """With int hashes off, vLLM's decoder reads the full hash bytes; the Mamba group's
    events carry its kind, and the keys of both groups are the pool's."""
    config = dataclasses.replace(
        HYBRID_POOL, kv_events_config=ZMQ_ON, kv_events_int_block_hashes=False
    )
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        subscriber = VllmSubscriber(zmq_context, server)
        for i, length in enumerate((24, 40, 36, 64)):
            rid = f"h{i}"
            await client.add_request(rid, tokens(length))
            hit = await client.get_computed_blocks(rid)
            assert await client.allocate_slots(rid, length - hit.num_computed_tokens, hit)
            await client.free(rid)
        await subscriber.catch_up(await settle(server))
        assert subscriber.keys == server_keys(server, int_hashes=False)
        stored = [e for e in subscriber.events if isinstance(e, BlockStored)]
        assert {e.kv_cache_spec_kind for e in stored} == {"full_attention", "mamba"}
        assert all(len(h) == 32 for e in stored for h in e.block_hashes)
        subscriber.close()


async def test_tenants_hashes_are_apart_and_their_salt_is_in_the_extra_keys(
    zmq_context: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """One stream carries every tenant's events. The same prompt from two tenants is
    two chains of hashes (the tenant's salt enters the first block's hash), and the
    first block's extra keys carry that salt, as vLLM publishes a request's
    cache_salt."""
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {"alpha": {"tokens": ["a" * 24]}, "beta": {"tokens": ["b" * 24]}},
    )
    config = dataclasses.replace(ZMQ_POOL, auth_tokens_file=tokens_file)
    async with running_server(config) as server:
        subscriber = VllmSubscriber(zmq_context, server)
        for token in ("a" * 24, "b" * 24):
            async with AsyncKVClient(
                server.handle.target, token=token, allow_insecure_token=True
            ) as client:
                await client.add_request("same-id", tokens(32))
                assert await client.allocate_slots("same-id", 32)
        await subscriber.catch_up(await settle(server))
        alpha, beta = [e for e in subscriber.events if isinstance(e, BlockStored)]
        assert not set(alpha.block_hashes) & set(beta.block_hashes)
        assert alpha.token_ids == beta.token_ids == tokens(32)
        assert alpha.extra_keys == [(tenant_cache_salt("alpha", None),), None]
        assert beta.extra_keys == [(tenant_cache_salt("beta", None),), None]
        subscriber.close()


async def test_connect_mode_publishes_to_a_router_that_binds(
    zmq_context: zmq.asyncio.Context,
) -> None:
    """vLLM's grammar: an endpoint naming a host is connected to (the router binds its
    SUB socket, as llm-d's indexer does); no replay socket is needed."""
    router = zmq_context.socket(zmq.SUB)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    router.setsockopt(zmq.SUBSCRIBE, b"")
    config = dataclasses.replace(
        ZMQ_POOL,
        kv_events_config=dataclasses.replace(
            ZMQ_ON, endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None
        ),
    )
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        assert server.kv_event_publisher is not None
        assert server.kv_event_publisher.endpoint == f"tcp://127.0.0.1:{port}"
        # Until the connection is up a batch may go nowhere: send until one arrives.
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        received = None
        for i in range(1_000):
            await client.add_request(f"c{i}", tokens(16, start=100 * i))
            assert await client.allocate_slots(f"c{i}", 16)
            await client.free(f"c{i}")
            if await router.poll(10):
                received = await router.recv_multipart()
                break
        assert received is not None
        topic, sequence, payload = received
        (event,) = decoder.decode(payload).events
        assert isinstance(event, BlockStored) and event.block_size == 16
        assert topic == b"" and int.from_bytes(sequence, "big") <= i
    router.close(linger=0)


async def test_reset_reaches_the_subscriber(zmq_context: zmq.asyncio.Context) -> None:
    """ResetPrefixCache is vLLM's AllBlocksCleared: the subscriber forgets every key."""
    async with (
        running_server(ZMQ_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        subscriber = VllmSubscriber(zmq_context, server)
        await client.add_request("a", tokens(48))
        assert await client.allocate_slots("a", 48)
        await client.free("a")
        assert await client.reset_prefix_cache()
        await subscriber.catch_up(await settle(server))
        assert [type(e).__name__ for e in subscriber.events] == [
            "BlockStored",
            "AllBlocksCleared",
        ]
        assert subscriber.keys == server_keys(server) == {}
        subscriber.close()

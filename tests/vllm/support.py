"""A router-side ZMQ subscriber and a reference manager, both built from vLLM 0.33.0's
own classes, and the server-side facts they are compared with."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvservice.core.kv_cache_block import get_block_hash, get_group_id
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.zmq_events.config import KVEventsConfig
from kvservice.server.zmq_events.publisher import ZmqEventPublisher as OurPublisher
from kvservice.server.zmq_events.wire import int_block_hash
from tests.server.support import SMALL_POOL
from tests.servers import THREAD_TIMEOUT_S

Key = tuple[int, Any]  # (group, block hash in the stream's form)
LABELS = {"model_name": "test-model", "engine": "0"}
# A SUB socket quiet this long (ms) is asked nothing more: the replay socket is. Only
# which path serves a batch depends on it, never the outcome.
IDLE_MS = 200

# Both sockets on free loopback ports (the bind host defaults to 127.0.0.1).
ZMQ_ON = KVEventsConfig(
    enable_kv_cache_events=True,
    publisher="zmq",
    endpoint="tcp://*:0",
    replay_endpoint="tcp://*:0",
)
ZMQ_POOL = dataclasses.replace(SMALL_POOL, kv_events_config=ZMQ_ON)


def publisher(server: KVCacheServer) -> OurPublisher:
    assert server.kv_event_publisher is not None
    return server.kv_event_publisher


def server_keys(server: KVCacheServer, int_hashes: bool = True) -> Counter[Key]:
    """The pool's prefix cache map as (group, hash) -> blocks, hashes in the stream's form."""
    cache = server.table.manager.block_pool.cached_block_hash_to_block
    form = int_block_hash if int_hashes else bytes
    return Counter(
        {(get_group_id(k), form(get_block_hash(k))): len(cache.blocks_of(k)) for k in cache}
    )


def metric(server: KVCacheServer, name: str) -> float:
    value = server.metrics.registry.get_sample_value(name, LABELS)
    assert value is not None, name
    return value


async def settle(server: KVCacheServer) -> int:
    """Let the loop cut the batch of the last calls; the last batch's sequence."""
    while publisher(server).pending_events:
        await asyncio.sleep(0)
    return publisher(server).last_sequence


class VllmSubscriber:
    """What a KV-aware router runs: a SUB socket decoded with vLLM's
    ``msgspec.msgpack.Decoder(KVEventBatch)``, and the replay socket for the batches
    the SUB socket missed (it joined late, or fell behind). Keeps every batch in
    sequence order, without a gap, and the (group, hash) keys they leave cached."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        server: KVCacheServer,
        *,
        rcvhwm: int | None = None,
        rcvbuf: int | None = None,
    ) -> None:
        ours = publisher(server)
        self.sub = context.socket(zmq.SUB)
        if rcvhwm is not None:
            self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf is not None:
            self.sub.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sub.connect(ours.endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, ours.config.topic.encode())
        self.replay = context.socket(zmq.DEALER)
        assert ours.replay_endpoint is not None
        self.replay.connect(ours.replay_endpoint)
        self.topic = ours.config.topic.encode()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.batches: list[KVEventBatch] = []
        self.keys: Counter[Key] = Counter()
        self.replays = 0

    @property
    def next_sequence(self) -> int:
        return len(self.batches)

    @property
    def events(self) -> list[Any]:
        return [event for batch in self.batches for event in batch.events]

    async def catch_up(self, last_sequence: int) -> None:
        """Apply every batch up to ``last_sequence`` from the SUB socket; a gap there
        (it joined late, or fell behind) or a quiet socket asks the replay socket."""
        async with asyncio.timeout(THREAD_TIMEOUT_S):
            while self.next_sequence <= last_sequence:
                if not await self.sub.poll(IDLE_MS):
                    await self.replay_from(self.next_sequence)
                    continue
                topic, sequence, payload = await self.sub.recv_multipart()
                assert topic == self.topic
                seq = int.from_bytes(sequence, "big")
                if seq > self.next_sequence:
                    await self.replay_from(self.next_sequence)
                if seq == self.next_sequence:
                    self.apply(payload)

    async def replay_from(self, start: int) -> None:
        """vLLM's replay protocol: ask with the start sequence, read to the end marker."""
        self.replays += 1
        await self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            empty, topic, sequence, payload = await self.replay.recv_multipart()
            assert empty == b""
            if sequence == ZmqEventPublisher.END_SEQ:
                assert (topic, payload) == (b"", b"")
                return
            assert topic == self.topic
            seq = int.from_bytes(sequence, "big")
            assert seq <= self.next_sequence, f"batch {self.next_sequence} left the buffer"
            if seq == self.next_sequence:
                self.apply(payload)

    def apply(self, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self.keys[(event.group_idx, block_hash)] += 1
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.keys[(event.group_idx, block_hash)] -= 1
            else:
                assert isinstance(event, AllBlocksCleared)
                self.keys.clear()
        self.keys = +self.keys  # drop the keys no block holds any more
        self.batches.append(batch)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


def vllm_hashed_request(
    request_id: str, prompt: list[int], algo: str, block_size: int = 16, **kwargs: Any
) -> Request:
    """vLLM's own ``Request`` for ``prompt``, its blocks hashed by vLLM's own block
    hasher with ``algo`` (its none hash set for ``algo`` first, as the engine sets it);
    ``kwargs`` go to the ``Request`` (a ``cache_salt``...)."""
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=64),
        None,
        block_hasher=get_request_block_hasher(block_size, hash_fn),
        **kwargs,
    )


class VllmReference:
    """vLLM 0.33.0's ``KVCacheManager`` (events on, the server's pool, block size and
    hash) driven as vLLM's scheduler drives it; ``events`` is everything it emitted."""

    def __init__(self, config: ServerConfig) -> None:
        hash_fn = get_hash_fn_by_name(config.hash_algo)
        init_none_hash(hash_fn)
        block_size = config.block_size
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_size=config.head_size,
            dtype=torch.float32,
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=config.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0"], spec)],
        )
        self.manager = KVCacheManager(
            kv_cache_config,
            max_model_len=config.max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        self._requests: dict[str, Request] = {}
        self.events: list[Any] = []

    def admit(self, request_id: str, prompt: list[int]) -> bool:
        """Lookup then allocate the whole prompt with the hit; False when it does not fit."""
        request = Request(
            request_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=self._hasher
        )
        self._requests[request_id] = request
        hit, num_hit, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, len(prompt) - num_hit, num_hit, hit)
        self._take()
        if new is None:
            return False
        request.num_computed_tokens = len(prompt)
        return True

    def decode(self, request_id: str, token: int) -> bool:
        """Append one sampled token and allocate its slot; False when it does not fit."""
        request = self._requests[request_id]
        request.append_output_token_ids(token)
        new = self.manager.allocate_slots(request, 1)
        self._take()
        if new is None:
            return False
        request.num_computed_tokens += 1
        return True

    def free(self, request_id: str) -> None:
        self.manager.free(self._requests.pop(request_id))
        self._take()

    def _take(self) -> None:
        self.events.extend(self.manager.take_events())

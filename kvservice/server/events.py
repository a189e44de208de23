"""The KV event log behind ``SubscribeEvents``: sequence numbers, a buffer, subscribers.

The manager (built with ``enable_kv_cache_events``) queues vLLM's events as the pool
changes; the request table hands them to ``EventLog.publish`` right after every
change (``RequestTable`` with an ``events`` sink), so between two RPCs the manager
holds no unpublished event and the pool's hash map is exactly what the published events
describe. That is what lets a snapshot taken between RPCs be tagged with
``last_sequence``.

Each event is numbered (1, 2, 3... with no gap), turned into its protobuf message
once, kept in a bounded ring buffer (for subscribers that resume) and offered to every
subscriber's bounded queue. Publishing never waits: a subscriber whose queue is full is
dropped (its stream ends with RESOURCE_EXHAUSTED) instead of slowing the server.
Listeners (the ZMQ publisher, ``zmq_events``) get the same events in the same order.

Like the request table, it is not thread safe: one asyncio loop owns it, and nothing here
awaits except a subscriber waiting on its own queue.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from kvservice.core.kv_cache_block import get_block_hash, get_group_id
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvservice.protocol.gen import kv_cache_service_pb2 as pb

DEFAULT_BUFFER_SIZE = 100_000
DEFAULT_SUBSCRIBER_QUEUE_SIZE = 10_000
# Keys per snapshot message: ~40 bytes each on the wire, so a part stays far below the
# default 4 MiB message limit.
SNAPSHOT_PART_SIZE = 16_384


class EventCounters(Protocol):
    """Where published and dropped events are counted (the Prometheus counters)."""

    def inc(self, amount: float = 1) -> None: ...


# Receives every run of events right after the log numbered them, in the log's order
# (the ZMQ publisher); it must not wait.
EventListener = Callable[[Sequence[KVCacheEvent]], None]


class SubscriberDroppedError(Exception):
    """The subscriber's queue overflowed; it was dropped and must resubscribe."""


class _Overflow:
    """Put in a dropped subscriber's (emptied) queue to wake its stream."""


_OVERFLOW = _Overflow()


class _Subscriber:
    __slots__ = ("queue",)

    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[pb.SubscribeEventsResponse | _Overflow] = asyncio.Queue(size)


def event_to_pb(event: KVCacheEvent, out: pb.SubscribeEventsResponse) -> None:
    """Fill ``out``'s payload with ``event`` (vLLM's fields, ``extra_keys`` in vLLM's
    untagged event form: see ``add_extra_keys``)."""
    if isinstance(event, BlockStored):
        stored = out.block_stored
        stored.block_hashes.extend(event.block_hashes)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        stored.token_ids.extend(event.token_ids)
        stored.block_size = event.block_size
        if event.lora_id is not None:
            stored.lora_id = event.lora_id
        if event.medium is not None:
            stored.medium = event.medium
        if event.lora_name is not None:
            stored.lora_name = event.lora_name
        if event.group_idx is not None:
            stored.group_idx = event.group_idx
        stored.kv_cache_spec_kind = event.kv_cache_spec_kind or ""
        if event.kv_cache_spec_sliding_window is not None:
            stored.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
        if event.extra_keys:
            add_extra_keys(stored.extra_keys, event.extra_keys)
        for tokens in event.lookahead_token_ids or ():
            stored.lookahead_token_ids.add().token_ids.extend(tokens)
    elif isinstance(event, BlockRemoved):
        removed = out.block_removed
        removed.block_hashes.extend(event.block_hashes)
        if event.medium is not None:
            removed.medium = event.medium
        if event.group_idx is not None:
            removed.group_idx = event.group_idx
    elif isinstance(event, AllBlocksCleared):
        out.all_blocks_cleared.SetInParent()
    else:  # pragma: no cover - the union is closed
        raise TypeError(f"unknown KV event {event!r}")


def add_extra_keys(field: Any, extra_keys: Sequence[tuple[Any, ...] | None]) -> None:
    """Append one ``BlockExtraKeys`` per block to a repeated field: vLLM's untagged
    event keys (``to_event_extra_keys``), a string (LoRA name, cache salt), an
    ``(identifier, offset)`` pair (a multimodal item) or bytes (a prompt embeddings
    digest) each; a block without keys (None) gets none."""
    for keys in extra_keys:
        block = field.add()
        for key in keys or ():
            if isinstance(key, str):
                block.keys.add(text=key)
            elif isinstance(key, bytes):
                block.keys.add(digest=key)
            else:
                identifier, offset = key
                block.keys.add(mm=pb.MultiModalKey(identifier=identifier, offset=offset))


class EventLog:
    """Numbered KV events of one manager, a buffer of recent ones, and subscribers."""

    def __init__(
        self,
        manager: KVCacheManager,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        subscriber_queue_size: int = DEFAULT_SUBSCRIBER_QUEUE_SIZE,
        published: EventCounters | None = None,
        dropped: EventCounters | None = None,
    ) -> None:
        if buffer_size < 1 or subscriber_queue_size < 1:
            raise ValueError("the event buffer and subscriber queues hold at least one event")
        self._manager = manager
        # Random per start: a subscriber's sequence from an earlier server process
        # must not be mistaken for one of ours.
        self.log_id = secrets.token_hex(8)
        self.last_sequence = 0
        self._buffer: deque[pb.SubscribeEventsResponse] = deque(maxlen=buffer_size)
        self._queue_size = subscriber_queue_size
        self._subscribers: set[_Subscriber] = set()
        self._published = published
        self._dropped = dropped
        self._listeners: list[EventListener] = []

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def add_listener(self, listener: EventListener) -> None:
        """Hand every later run of events to ``listener`` too."""
        self._listeners.append(listener)

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Number, buffer and fan out ``events``; never waits."""
        count = 0
        for event in events:
            self.last_sequence += 1
            message = pb.SubscribeEventsResponse(sequence=self.last_sequence, log_id=self.log_id)
            event_to_pb(event, message)
            # Shared by the buffer and every subscriber: never mutated after this.
            self._buffer.append(message)
            count += 1
            for subscriber in list(self._subscribers):
                self._offer(subscriber, message)
        if count and self._published is not None:
            self._published.inc(count)
        for listener in self._listeners:
            listener(events)

    def _offer(self, subscriber: _Subscriber, message: pb.SubscribeEventsResponse) -> None:
        try:
            subscriber.queue.put_nowait(message)
        except asyncio.QueueFull:
            self._drop(subscriber)

    def _drop(self, subscriber: _Subscriber) -> None:
        self._subscribers.discard(subscriber)
        queue = subscriber.queue
        # The queued events and the one that did not fit never reach this subscriber.
        lost = queue.qsize() + 1
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(_OVERFLOW)
        if self._dropped is not None:
            self._dropped.inc(lost)

    def _backlog(self, from_sequence: int, log_id: str) -> list[pb.SubscribeEventsResponse] | None:
        """The buffered events after ``from_sequence``; None when they cannot all be
        given (no sequence, another log, or older than the buffer)."""
        if from_sequence == 0 or from_sequence > self.last_sequence:
            return None
        if log_id and log_id != self.log_id:
            return None
        oldest = self._buffer[0].sequence if self._buffer else self.last_sequence + 1
        if from_sequence < oldest - 1:
            return None
        skip = from_sequence - (oldest - 1)
        return [self._buffer[i] for i in range(skip, len(self._buffer))]

    def snapshot(self) -> list[pb.SubscribeEventsResponse]:
        """The cached keys now, as snapshot parts tagged with ``last_sequence``.

        O(cached keys), on the loop: the map must not change while it is read.
        """
        cache = self._manager.block_pool.cached_block_hash_to_block
        blocks = [
            pb.CachedBlockHash(
                block_hash=get_block_hash(key),
                group_idx=get_group_id(key),
                num_blocks=len(cache.blocks_of(key)),
            )
            for key in cache
        ]
        parts = []
        for start in range(0, max(len(blocks), 1), SNAPSHOT_PART_SIZE):
            part = pb.SubscribeEventsResponse(sequence=self.last_sequence, log_id=self.log_id)
            part.snapshot.blocks.extend(blocks[start : start + SNAPSHOT_PART_SIZE])
            part.snapshot.complete = start + SNAPSHOT_PART_SIZE >= len(blocks)
            parts.append(part)
        return parts

    async def subscribe(
        self, from_sequence: int = 0, log_id: str = ""
    ) -> AsyncIterator[pb.SubscribeEventsResponse]:
        """The stream of one subscriber: a snapshot or the missed events, then every
        new event. Raises ``SubscriberDroppedError`` when it fell too far behind."""
        # No await until the subscriber is registered: the snapshot (or backlog) and
        # the first queued event then meet exactly at ``last_sequence``.
        first = self._backlog(from_sequence, log_id)
        if first is None:
            first = self.snapshot()
        subscriber = _Subscriber(self._queue_size)
        self._subscribers.add(subscriber)
        try:
            for message in first:
                yield message
            while True:
                item = await subscriber.queue.get()
                if isinstance(item, _Overflow):
                    raise SubscriberDroppedError(
                        f"subscriber fell more than {self._queue_size} events behind and was "
                        f"dropped; resubscribe from the last sequence received"
                    )
                yield item
        finally:
            self._subscribers.discard(subscriber)

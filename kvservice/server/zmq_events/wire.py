"""vLLM 0.33.0's KV event wire structs (``vllm/distributed/kv_events.py``), written
here so the product never imports vLLM, and the core's events turned into them.

Same class names, field names, field order, defaults and msgspec options as vLLM's:
a batch encodes as the array ``[ts, events, data_parallel_rank]`` and each event as a
map tagged ``"type": "<class name>"`` whose fields left at their default are omitted,
so ``msgspec.msgpack.Decoder(vllm...KVEventBatch)`` reads these bytes, and vLLM's
encoder writes the same bytes for the same values (tests/vllm/test_zmq_wire.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvservice.core import kv_events as core

# vLLM's ``ExternalBlockHash``: the hash bytes, or (vLLM's default) an int.
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


def int_block_hash(block_hash: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``
    (its default): the hash's last 8 bytes as an unsigned big-endian int."""
    return int.from_bytes(block_hash[-8:], "big")


def _bytes_block_hash(block_hash: bytes) -> bytes:
    return block_hash


class WireEncoder:
    """Encodes the core's events as one vLLM ``KVEventBatch`` payload.

    ``int_block_hashes`` picks vLLM's hash form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``:
    an int by default, else the full bytes). ``data_parallel_rank`` is what vLLM's
    publisher stamps on every batch (its DP rank; 0 without data parallelism).
    """

    def __init__(self, int_block_hashes: bool = True, data_parallel_rank: int = 0) -> None:
        self._hash: Callable[[bytes], ExternalBlockHash] = (
            int_block_hash if int_block_hashes else _bytes_block_hash
        )
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: Sequence[core.KVCacheEvent], ts: float) -> bytes:
        batch = KVEventBatch(ts, [self.event(e) for e in events], self._rank)
        return self._encoder.encode(batch)

    def event(self, event: core.KVCacheEvent) -> WireEvent:
        """The wire event of ``event``: each field the core's event has (a field it
        lacks, e.g. ``session_id``, stays at vLLM's default, None)."""
        convert = self._hash
        if isinstance(event, core.BlockStored):
            parent = event.parent_block_hash
            return BlockStored(
                [convert(h) for h in event.block_hashes],
                None if parent is None else convert(parent),
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
                event.lora_name,
                event.extra_keys,
                event.group_idx,
                event.kv_cache_spec_kind,
                event.kv_cache_spec_sliding_window,
                lookahead_token_ids=event.lookahead_token_ids,
            )
        if isinstance(event, core.BlockRemoved):
            return BlockRemoved(
                [convert(h) for h in event.block_hashes], event.medium, event.group_idx
            )
        if isinstance(event, core.AllBlocksCleared):
            return AllBlocksCleared()
        raise TypeError(f"unknown KV event {event!r}")  # pragma: no cover - closed union

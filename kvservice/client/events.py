"""KV events as plain values: what ``subscribe_events`` yields, and a view to fold them.

A subscription yields one ``CacheSnapshot`` first when the server could not resume
from the sequence given (the snapshot's parts are merged here), then one event per
message, each with its gap-free ``sequence``. ``CachedBlocksView`` folds them into the
set of cached blocks the server holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvservice.protocol.gen import kv_cache_service_pb2 as pb


@dataclass(frozen=True, slots=True)
class CachedBlockHash:
    """One prefix cache key of a snapshot: a block hash (external form, no group
    suffix), its group, and how many physical blocks hold it."""

    block_hash: bytes
    group_idx: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """The cached keys as of ``sequence`` (every event up to it included). Carries no
    tokens nor parent hashes: the server keeps none for cached blocks."""

    sequence: int
    log_id: str
    blocks: tuple[CachedBlockHash, ...]


# One extra key of a block in vLLM's untagged event form: a LoRA name or cache salt
# (str), a multimodal item's (identifier, offset in the block), a prompt embeddings
# digest (bytes).
ExtraKey = str | bytes | tuple[str, int]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """vLLM's BlockStored: full blocks of one request entered the prefix cache.
    ``extra_keys`` holds one entry per block hash (None for a block without extra
    keys), as vLLM's ``to_event_extra_keys``, or is None when no block has any."""

    sequence: int
    log_id: str
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None
    extra_keys: tuple[tuple[ExtraKey, ...] | None, ...] | None = None
    # The tokens after each block its hash also covers (lookahead block hashes).
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """vLLM's BlockRemoved: one cache entry per hash left the prefix cache."""

    sequence: int
    log_id: str
    block_hashes: tuple[bytes, ...]
    medium: str | None
    group_idx: int | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """vLLM's AllBlocksCleared: the whole prefix cache was reset."""

    sequence: int
    log_id: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventStreamItem = CacheSnapshot | KVEvent


def event_from_pb(msg: pb.SubscribeEventsResponse) -> KVEvent:
    """The event one (non-snapshot) message carries."""
    kind = msg.WhichOneof("payload")
    seq, log_id = msg.sequence, msg.log_id
    if kind == "block_stored":
        s = msg.block_stored
        return BlockStored(
            seq,
            log_id,
            tuple(s.block_hashes),
            s.parent_block_hash if s.HasField("parent_block_hash") else None,
            tuple(s.token_ids),
            s.block_size,
            s.lora_id if s.HasField("lora_id") else None,
            s.medium if s.HasField("medium") else None,
            s.lora_name if s.HasField("lora_name") else None,
            s.group_idx if s.HasField("group_idx") else None,
            s.kv_cache_spec_kind or None,
            s.kv_cache_spec_sliding_window if s.HasField("kv_cache_spec_sliding_window") else None,
            tuple(_block_keys(block) for block in s.extra_keys) if s.extra_keys else None,
            tuple(tuple(t.token_ids) for t in s.lookahead_token_ids)
            if s.lookahead_token_ids
            else None,
        )
    if kind == "block_removed":
        r = msg.block_removed
        return BlockRemoved(
            seq,
            log_id,
            tuple(r.block_hashes),
            r.medium if r.HasField("medium") else None,
            r.group_idx if r.HasField("group_idx") else None,
        )
    if kind == "all_blocks_cleared":
        return AllBlocksCleared(seq, log_id)
    raise ValueError(f"unexpected SubscribeEvents payload {kind!r}")


def _block_keys(block: pb.BlockExtraKeys) -> tuple[ExtraKey, ...] | None:
    """One block's keys as vLLM's event carries them (None: the block has none)."""
    keys: list[ExtraKey] = []
    for key in block.keys:
        kind = key.WhichOneof("key")
        if kind == "text":
            keys.append(key.text)
        elif kind == "digest":
            keys.append(key.digest)
        elif kind == "mm":
            keys.append((key.mm.identifier, key.mm.offset))
        else:
            raise ValueError(f"unexpected extra key {key!r}")
    return tuple(keys) if keys else None


class StreamDecoder:
    """Turns the stream's messages into items: snapshot parts are held until the last
    one, then given as one ``CacheSnapshot``."""

    def __init__(self) -> None:
        self._parts: list[CachedBlockHash] = []

    def feed(self, msg: pb.SubscribeEventsResponse) -> EventStreamItem | None:
        """The item ``msg`` completes; None for a snapshot part that is not the last."""
        if msg.WhichOneof("payload") != "snapshot":
            return event_from_pb(msg)
        self._parts.extend(
            CachedBlockHash(b.block_hash, b.group_idx, b.num_blocks) for b in msg.snapshot.blocks
        )
        if not msg.snapshot.complete:
            return None
        blocks, self._parts = tuple(self._parts), []
        return CacheSnapshot(msg.sequence, msg.log_id, blocks)


class CachedBlocksView:
    """The server's prefix cache as ``(group_idx, block_hash) -> number of blocks``,
    kept up to date from a subscription; ``sequence`` and ``log_id`` are what to
    resubscribe with after a disconnect."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, bytes]] = Counter()
        self.sequence = 0
        self.log_id = ""

    def apply(self, item: EventStreamItem) -> None:
        """Fold one item in; raises ``ValueError`` on a sequence gap (a missed event)."""
        if isinstance(item, CacheSnapshot):
            self.counts = Counter({(b.group_idx, b.block_hash): b.num_blocks for b in item.blocks})
        else:
            if item.sequence != self.sequence + 1:
                raise ValueError(
                    f"event sequence {item.sequence} after {self.sequence}: events were missed"
                )
            self._apply_event(item)
        self.sequence = item.sequence
        self.log_id = item.log_id

    def _apply_event(self, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.counts.clear()
            return
        group = event.group_idx or 0
        for block_hash in event.block_hashes:
            key = (group, block_hash)
            if isinstance(event, BlockStored):
                self.counts[key] += 1
            else:
                self.counts[key] -= 1
                if self.counts[key] <= 0:
                    del self.counts[key]

"""Extra builders and oracles for the core conformance tests (beside ``helpers.py``).

The reference hash functions here are written straight on hashlib / pickle / cbor2 /
xxhash so the tests do not check kvservice's hashing against itself.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

from kvservice.core.block_pool import BlockPool
from kvservice.core.kv_cache_block import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from kvservice.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from kvservice.core.kv_cache_manager import KVCacheManager

# -- reference hash functions ---------------------------------------------------------


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return bytes(cbor2.dumps(obj, canonical=True))


def ref_sha256(obj: Any) -> bytes:
    return hashlib.sha256(_pickled(obj)).digest()


def ref_sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(_cbor(obj)).digest()


def ref_xxhash(obj: Any) -> bytes:
    return bytes(xxhash.xxh3_128_digest(_pickled(obj)))


def ref_xxhash_cbor(obj: Any) -> bytes:
    return bytes(xxhash.xxh3_128_digest(_cbor(obj)))


REF_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": ref_sha256,
    "sha256_cbor": ref_sha256_cbor,
    "xxhash": ref_xxhash,
    "xxhash_cbor": ref_xxhash_cbor,
}

DEFAULT_SEED = "vllm-none-hash"


# -- specs ----------------------------------------------------------------------------


def full(block_size: int = 16, dtype: str = "float32", heads: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=1, dtype=dtype)


def sliding(
    block_size: int, window: int, dtype: str = "float32", heads: int = 1
) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=1,
        dtype=dtype,
        sliding_window=window,
    )


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float32",
        attention_chunk_size=chunk,
    )


# -- state snapshots ------------------------------------------------------------------


def map_contents(pool: BlockPool) -> dict[bytes, list[int]]:
    """The prefix cache map as ``key -> block ids`` (first inserted first)."""
    cache = pool.cached_block_hash_to_block
    return {key: [b.block_id for b in cache.blocks_of(key)] for key in cache}


@dataclass(frozen=True)
class Snapshot:
    free_queue: list[int]
    num_free: int
    ref_counts: list[int]
    block_hashes: list[bytes | None]
    hash_map: dict[bytes, list[int]]
    tables: list[dict[str, list[int]]]
    num_cached: list[dict[str, int]]
    num_events: int


def snapshot(manager: KVCacheManager) -> Snapshot:
    """Everything a refused call must leave as it was."""
    pool = manager.block_pool
    singles = manager.coordinator.single_type_managers
    return Snapshot(
        free_queue=[b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        num_free=pool.get_num_free_blocks(),
        ref_counts=[b.ref_cnt for b in pool.blocks],
        block_hashes=[b.block_hash for b in pool.blocks],
        hash_map=map_contents(pool),
        tables=[
            {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
            for m in singles
        ],
        num_cached=[dict(m.num_cached_block) for m in singles],
        num_events=len(pool.kv_event_queue),
    )


# -- cache manipulation ---------------------------------------------------------------


def cache_by_hand(pool: BlockPool, block: KVCacheBlock, block_hash: BlockHash, gid: int) -> None:
    """Make ``block`` the cache entry of ``block_hash`` in group ``gid``."""
    key = make_block_hash_with_group_id(block_hash, gid)
    block.set_block_hash(key)
    pool.cached_block_hash_to_block.insert(key, block)


@contextmanager
def evicted(
    pool: BlockPool, block_hashes: Sequence[BlockHash], entries: Sequence[tuple[int, int]]
) -> Iterator[None]:
    """Temporarily drop the cache entries ``(hash index, group id)``; restore on exit.

    There is no public delete, so the entry is evicted the way a connector would
    (``_maybe_evict_cached_block``) and re-inserted afterwards."""
    dropped: list[tuple[KVCacheBlock, BlockHash, int]] = []
    for index, gid in entries:
        key = make_block_hash_with_group_id(block_hashes[index], gid)
        block = pool.cached_block_hash_to_block.get_one_block(key)
        assert block is not None, f"hash {index} is not cached in group {gid}"
        assert pool._maybe_evict_cached_block(block)
        dropped.append((block, block_hashes[index], gid))
    try:
        yield
    finally:
        for block, block_hash, gid in dropped:
            cache_by_hand(pool, block, block_hash, gid)


def cached_hash_indices(
    manager: KVCacheManager, block_hashes: Sequence[BlockHash], gid: int
) -> set[int]:
    """Indices of ``block_hashes`` that have a cache entry in group ``gid``."""
    lookup = manager.block_pool.cached_block_hash_to_block.get_one_block
    return {
        i
        for i, h in enumerate(block_hashes)
        if lookup(make_block_hash_with_group_id(h, gid)) is not None
    }

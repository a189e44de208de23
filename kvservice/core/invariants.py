"""An audit of the pool's invariants, for tests, benchmarks and the service's self-check.

``check_invariants(manager)`` walks every block, the free queue, the hash map and every
block table, and raises ``InvariantViolationError`` naming the first broken rule. It is O(N)
in the pool size: an audit, not something for the hot path.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvservice.core.kv_cache_block import KVCacheBlock

if TYPE_CHECKING:
    from kvservice.core.kv_cache_manager import KVCacheManager


class InvariantViolationError(AssertionError):
    """The allocator's state is inconsistent: a bug, never a caller mistake."""


def _fail(message: str) -> None:
    raise InvariantViolationError(message)


def _queued_blocks(manager: KVCacheManager) -> list[KVCacheBlock]:
    queue = manager.block_pool.free_block_queue
    seen: set[int] = set()
    blocks: list[KVCacheBlock] = []
    prev = queue.fake_free_list_head
    curr = prev.next_free_block
    while curr is not queue.fake_free_list_tail:
        if curr is None:
            _fail(f"free queue broken after block {prev.block_id}: next is None")
        assert curr is not None
        if curr.prev_free_block is not prev:
            _fail(f"free queue: block {curr.block_id}'s prev link does not point back")
        if curr.block_id < 0:  # a priority level's sentinel
            prev, curr = curr, curr.next_free_block
            continue
        if curr.block_id in seen:
            _fail(f"free queue: block {curr.block_id} is queued twice")
        seen.add(curr.block_id)
        blocks.append(curr)
        prev, curr = curr, curr.next_free_block
    if queue.fake_free_list_tail.prev_free_block is not prev:
        _fail("free queue: the tail sentinel does not point back at the last block")
    if len(blocks) != queue.num_free_blocks:
        _fail(f"free queue holds {len(blocks)} blocks but counts {queue.num_free_blocks}")
    return blocks


def check_invariants(manager: KVCacheManager) -> None:
    """Raise ``InvariantViolationError`` unless every block is either free (ref 0, queued
    exactly once) or owned (ref = number of block-table entries holding it plus the
    holds kept for copy-on-write copies), the hash map and the blocks' hashes agree, a
    copy's ends stay held until the copy is taken, and no block a request may still
    write into is shared."""
    pool = manager.block_pool
    null = pool.null_block
    if not null.is_null or null.block_id != 0 or null.block_hash is not None:
        _fail("block 0 must be the unhashed null block")
    queued = _queued_blocks(manager)
    queued_ids = {b.block_id for b in queued}
    if null.block_id in queued_ids:
        _fail("the null block is in the free queue")

    table_holders: Counter[int] = Counter()
    for group_id, single in enumerate(manager.coordinator.single_type_managers):
        for request_id, blocks in single.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if len(ids) != len(set(ids)):
                _fail(f"group {group_id}: request {request_id!r} holds a block twice: {ids}")
            table_holders.update(ids)
            if single.num_cached_block.get(request_id, 0) > len(blocks):
                _fail(f"group {group_id}: request {request_id!r} caches more blocks than it holds")
    _check_writable_blocks_unshared(manager, table_holders)
    holders = table_holders + _copy_holds(manager, queued_ids) + _pin_holds(manager)

    for block in pool.blocks[1:]:
        if block.is_null:
            _fail(f"block {block.block_id} is marked null")
        if block.ref_cnt != holders[block.block_id]:
            _fail(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{holders[block.block_id]} block-table entries hold it"
            )
        if (block.ref_cnt == 0) != (block.block_id in queued_ids):
            _fail(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} disagrees with queue membership"
            )

    _check_hash_map(manager)


def _copy_holds(manager: KVCacheManager, queued_ids: set[int]) -> Counter[int]:
    """The references held for copies, one on each end: queued ones (their ends must
    stay out of the free queue, so neither is handed to a new owner before the copy is
    taken) and taken ones whose holds the caller has not released yet."""
    holds: Counter[int] = Counter(manager.retained_holds)
    for group_id, single in enumerate(manager.coordinator.single_type_managers):
        for src, dst in single.pending_cow_copies:
            holds.update((src.block_id, dst.block_id))
            if src.is_null or dst.is_null or src is dst:
                _fail(f"group {group_id}: copy {src.block_id} -> {dst.block_id} is malformed")
            for end in (src, dst):
                if end.ref_cnt < 1 or end.block_id in queued_ids:
                    _fail(
                        f"group {group_id}: block {end.block_id} of the pending copy "
                        f"{src.block_id} -> {dst.block_id} is free before the copy was taken"
                    )
    return holds


def _pin_holds(manager: KVCacheManager) -> Counter[int]:
    """One reference per pin on each block it holds, which must carry the pin's key."""
    holds: Counter[int] = Counter()
    retention = manager.block_pool.retention_policy
    if retention is None:
        return holds
    cache = manager.block_pool.cached_block_hash_to_block
    for pin in retention.pins.values():
        for key, block in pin.held.items():
            if key not in pin.keys or block not in cache.blocks_of(key):
                _fail(f"pin {pin.pin_id!r} holds block {block.block_id} under a key it lacks")
            if pin not in retention.holders.get(block.block_id, []):
                _fail(f"pin {pin.pin_id!r} holds block {block.block_id} unrecorded")
            holds[block.block_id] += 1
    if sum(holds.values()) != sum(len(pins) for pins in retention.holders.values()):
        _fail("the pins' holds and the pool's record of them disagree")
    return holds


def _check_writable_blocks_unshared(manager: KVCacheManager, table_holders: Counter[int]) -> None:
    """A block at or past a request's cached prefix may still be written by it, so no
    other block-table entry may hold it (a hit ending inside a block gets a copy)."""
    for group_id, single in enumerate(manager.coordinator.single_type_managers):
        for request_id, blocks in single.req_to_blocks.items():
            for block in blocks[single.num_cached_block.get(request_id, 0) :]:
                if not block.is_null and table_holders[block.block_id] > 1:
                    _fail(
                        f"group {group_id}: block {block.block_id}, which request "
                        f"{request_id!r} may still write, is shared by "
                        f"{table_holders[block.block_id]} block-table entries"
                    )


def _check_hash_map(manager: KVCacheManager) -> None:
    """The map files each block exactly under the keys it carries: its primary
    ``block_hash`` and its aliases (partial entries beside a longer key)."""
    pool = manager.block_pool
    cache = pool.cached_block_hash_to_block
    mapped: set[tuple[int, bytes]] = set()
    for key in cache:
        for block in cache.blocks_of(key):
            if (block.block_id, key) in mapped:
                _fail(f"hash map: block {block.block_id} is filed twice under one key")
            mapped.add((block.block_id, key))
    carried: set[tuple[int, bytes]] = set()
    for block in pool.blocks:
        aliases = pool.aliases_of(block)
        if block.block_hash is None:
            if aliases:
                _fail(f"block {block.block_id} has alias keys but no primary key")
            continue
        if block.block_hash in aliases:
            _fail(f"block {block.block_id} carries its primary key as an alias too")
        carried.add((block.block_id, block.block_hash))
        carried.update((block.block_id, key) for key in aliases)
    if carried != mapped:
        missing = sorted(block_id for block_id, _ in carried - mapped)[:5]
        stray = sorted(block_id for block_id, _ in mapped - carried)[:5]
        _fail(
            f"blocks {missing} carry keys missing from the map; the map files blocks "
            f"{stray} under keys they do not carry"
        )
    if not pool.enable_caching and carried:
        _fail("caching is off but blocks carry hashes")

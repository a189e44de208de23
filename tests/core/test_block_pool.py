"""``BlockHashToBlockMap`` and ``BlockPool`` (catalogue 16, 17, 23, 26, 51, 52)."""

from __future__ import annotations

import pytest

from kvservice.core.block_hashing import BlockHasher
from kvservice.core.block_pool import BlockHashToBlockMap, BlockPool
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_block import KVCacheBlock, make_block_hash_with_group_id
from kvservice.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice.core.request import Request
from tests.core.support import cache_by_hand, map_contents


def pool_queue(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def hashed_request(tokens: list[int], block_size: int, algo: str = "sha256") -> Request:
    return Request("req", tokens, BlockHasher(block_size, algo))


class TestBlockHashToBlockMap:
    def test_single_block_per_key(self) -> None:
        """51: pop with a wrong block id returns None and keeps the entry; the right id
        removes the key."""
        cache = BlockHashToBlockMap()
        keys = [make_block_hash_with_group_id(bytes([i]), 0) for i in range(3)]
        blocks = [KVCacheBlock(i) for i in range(3)]
        for key, block in zip(keys, blocks, strict=True):
            cache.insert(key, block)
        assert len(cache) == 3
        for key, block in zip(keys, blocks, strict=True):
            assert cache.get_one_block(key) is block

        assert cache.pop(keys[0], 1) is None
        assert cache.get_one_block(keys[0]) is blocks[0]
        assert len(cache) == 3

        assert cache.pop(keys[0], 0) is blocks[0]
        assert cache.get_one_block(keys[0]) is None
        assert len(cache) == 2
        assert cache.pop(keys[0], 0) is None

    def test_multiple_blocks_per_key(self) -> None:
        """52: duplicates queue under one key; lookups see the first inserted, and pops
        remove only the named block."""
        cache = BlockHashToBlockMap()
        key0 = make_block_hash_with_group_id(b"k0", 0)
        key1 = make_block_hash_with_group_id(b"k1", 0)
        b0, b1, b10, b11 = (KVCacheBlock(i) for i in (0, 1, 10, 11))
        cache.insert(key0, b0)
        cache.insert(key0, b1)
        cache.insert(key1, b10)
        cache.insert(key1, b11)
        assert len(cache) == 2
        assert cache.num_blocks() == 4

        for key, first, second, missing in ((key0, b0, b1, 2), (key1, b10, b11, 12)):
            assert cache.get_one_block(key) is first
            assert cache.blocks_of(key) == [first, second]
            assert cache.pop(key, first.block_id) is first
            assert cache.get_one_block(key) is second
            assert cache.pop(key, second.block_id) is second
            assert cache.pop(key, missing) is None
            assert cache.get_one_block(key) is None
        assert len(cache) == 0

    def test_pop_of_a_later_duplicate_keeps_the_first(self) -> None:
        """Popping a duplicate that is not the first leaves the first as the lookup."""
        cache = BlockHashToBlockMap()
        key = make_block_hash_with_group_id(b"k", 0)
        first, second, third = (KVCacheBlock(i) for i in (4, 5, 6))
        for block in (first, second, third):
            cache.insert(key, block)
        assert cache.pop(key, 5) is second
        assert cache.get_one_block(key) is first
        assert cache.blocks_of(key) == [first, third]


class TestBlockPoolBasics:
    def test_block_zero_is_the_null_block(self) -> None:
        """The pool pops block 0 as the null block: it is marked null and not free."""
        pool = BlockPool(5, True, hash_block_size=16)
        assert pool.null_block is pool.blocks[0]
        assert pool.null_block.is_null
        assert pool.get_num_free_blocks() == 4
        assert pool_queue(pool) == [1, 2, 3, 4]

    def test_non_positive_size_is_rejected(self) -> None:
        """A pool of zero blocks is an invalid argument (ValueError)."""
        with pytest.raises(InvalidArgumentError):
            BlockPool(0, True, hash_block_size=16)
        with pytest.raises(ValueError):
            BlockPool(-3, True, hash_block_size=16)

    def test_get_new_blocks_in_queue_order_with_one_reference(self) -> None:
        """New blocks come from the front of the free queue with ref_cnt 1."""
        pool = BlockPool(6, True, hash_block_size=16)
        got = pool.get_new_blocks(3)
        assert [b.block_id for b in got] == [1, 2, 3]
        assert all(b.ref_cnt == 1 for b in got)
        assert pool.get_num_free_blocks() == 2

    def test_get_new_blocks_beyond_free_count(self) -> None:
        """Asking for more blocks than are free raises ValueError and takes nothing."""
        pool = BlockPool(4, True, hash_block_size=16)
        with pytest.raises(ValueError, match="Cannot get 4 free blocks"):
            pool.get_new_blocks(4)
        assert pool.get_num_free_blocks() == 3

    def test_get_usage(self) -> None:
        """Usage is 1 - free / (N - 1), and 0 for a pool holding only the null block."""
        pool = BlockPool(11, True, hash_block_size=16)
        assert pool.get_usage() == 0.0
        held = pool.get_new_blocks(5)
        assert pool.get_usage() == pytest.approx(0.5)
        pool.free_blocks(held)
        assert pool.get_usage() == 0.0
        assert BlockPool(1, True, hash_block_size=16).get_usage() == 0.0

    def test_touch_takes_free_block_out_of_queue(self) -> None:
        """touch removes a ref-0 block from the free queue and counts the reference."""
        pool = BlockPool(5, True, hash_block_size=16)
        block = pool.blocks[3]
        pool.touch([block])
        assert block.ref_cnt == 1
        assert pool_queue(pool) == [1, 2, 4]
        pool.touch([block])
        assert block.ref_cnt == 2
        assert pool.get_num_free_blocks() == 3

    def test_touch_skips_the_null_block(self) -> None:
        """Touching the null block never tries to unlink it from the free queue."""
        pool = BlockPool(3, True, hash_block_size=16)
        pool.touch([pool.null_block])
        assert pool.get_num_free_blocks() == 2


class TestFreeBlocksPolicy:
    def test_unhashed_prepended_hashed_appended(self) -> None:
        """Freed unhashed blocks go to the front in the given order, hashed ones to the
        back in the given order."""
        pool = BlockPool(8, True, hash_block_size=4)
        b1, b2, b3, b4 = pool.get_new_blocks(4)
        cache_by_hand(pool, b2, b"h2", 0)
        cache_by_hand(pool, b3, b"h3", 0)
        assert pool_queue(pool) == [5, 6, 7]
        pool.free_blocks([b1, b2, b3, b4])
        assert pool_queue(pool) == [1, 4, 5, 6, 7, 2, 3]
        assert all(b.ref_cnt == 0 for b in (b1, b2, b3, b4))

    def test_caching_disabled_prepends_everything(self) -> None:
        """With caching off every freed block is prepended (reused first, LIFO)."""
        pool = BlockPool(8, False, hash_block_size=4)
        b1, b2, b3, b4 = pool.get_new_blocks(4)
        pool.free_blocks([b3, b1, b4, b2])
        assert pool_queue(pool) == [3, 1, 4, 2, 5, 6, 7]

    def test_shared_block_stays_out_until_last_reference(self) -> None:
        """A block with two references re-enters the queue only at ref_cnt 0."""
        pool = BlockPool(4, True, hash_block_size=4)
        (block,) = pool.get_new_blocks(1)
        pool.touch([block])
        pool.free_blocks([block])
        assert block.ref_cnt == 1
        assert block.block_id not in pool_queue(pool)
        pool.free_blocks([block])
        assert pool_queue(pool)[0] == block.block_id

    def test_null_block_is_never_freed(self) -> None:
        """Freeing the null block leaves it out of the free queue."""
        pool = BlockPool(4, True, hash_block_size=4)
        pool.free_blocks([pool.null_block])
        assert 0 not in pool_queue(pool)
        assert pool.get_num_free_blocks() == 3


class TestCacheFullBlocks:
    @pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
    def test_cache_blocks(self, algo: str) -> None:
        """16: caching blocks 0-2 then block 2-3 of a 14-token request adds one map key
        per full block, each the request's hash with group id 0."""
        pool = BlockPool(5, True, hash_block_size=4)
        req = hashed_request(list(range(14)), 4, algo)
        assert len(req.block_hashes) == 3
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
        assert len(pool.cached_block_hash_to_block) == 2
        blocks += pool.get_new_blocks(1)
        pool.cache_full_blocks(req, blocks, 2, 3, 4, 0)
        assert len(pool.cached_block_hash_to_block) == 3
        for block, block_hash in zip(blocks, req.block_hashes, strict=True):
            assert block.block_hash == make_block_hash_with_group_id(block_hash, 0)

    def test_already_cached_range_is_a_no_op(self) -> None:
        """cache_full_blocks with num_cached >= num_full changes nothing."""
        pool = BlockPool(5, True, hash_block_size=4, enable_kv_cache_events=True)
        req = hashed_request(list(range(8)), 4)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, blocks, 2, 2, 4, 0)
        assert len(pool.cached_block_hash_to_block) == 0
        assert pool.take_events() == []

    def test_cache_blocks_multi_group(self) -> None:
        """17: keys are per group; get_cached_block hits only if every listed group
        holds the hash."""
        pool = BlockPool(10, True, hash_block_size=4)
        req = hashed_request(list(range(12)), 4)
        h0, h1, h2 = req.block_hashes
        group0 = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, group0, 0, 2, 4, 0)
        group1 = pool.get_new_blocks(3)
        pool.cache_full_blocks(req, group1, 0, 3, 4, 1)
        assert len(pool.cached_block_hash_to_block) == 5

        assert pool.get_cached_block(h0, [0]) == [group0[0]]
        assert pool.get_cached_block(h1, [0]) == [group0[1]]
        assert pool.get_cached_block(h2, [0]) is None
        assert pool.get_cached_block(h0, [1]) == [group1[0]]
        assert pool.get_cached_block(h1, [1]) == [group1[1]]
        assert pool.get_cached_block(h2, [1]) == [group1[2]]
        assert pool.get_cached_block(h0, [0, 1]) == [group0[0], group1[0]]
        assert pool.get_cached_block(h1, [0, 1]) == [group0[1], group1[1]]
        assert pool.get_cached_block(h2, [0, 1]) is None

    def test_null_blocks_are_skipped(self) -> None:
        """Null placeholders in a block table are never hashed or mapped."""
        pool = BlockPool(8, True, hash_block_size=1)
        req = hashed_request([10, 11, 12, 13], 1)
        new0 = pool.get_new_blocks(1)[0]
        new1, new2 = pool.get_new_blocks(2)
        table = [new0, pool.null_block, new1, new2]
        pool.cache_full_blocks(req, table, 0, 4, 1, 0)
        assert pool.null_block.block_hash is None
        assert len(pool.cached_block_hash_to_block) == 3
        assert pool.get_cached_block(req.block_hashes[1], [0]) is None

    def test_null_parent_block_hash(self) -> None:
        """26: the BlockStored parent is the logical previous block's hash even when
        that position holds the null block."""
        pool = BlockPool(8, True, hash_block_size=1, enable_kv_cache_events=True)
        req = hashed_request([10, 11, 12, 13], 1)
        new0 = pool.get_new_blocks(1)[0]
        new1, new2 = pool.get_new_blocks(2)
        table = [new0, pool.null_block, new1, new2]
        pool.cache_full_blocks(req, table, 2, 4, 1, 0)

        events = pool.take_events()
        assert len(events) == 1
        event = events[0]
        assert isinstance(event, BlockStored)
        assert event.parent_block_hash == req.block_hashes[1]
        assert event.block_hashes == req.block_hashes[2:4]
        assert event.token_ids == [12, 13]
        assert event.block_size == 1
        assert event.group_idx == 0
        assert event.medium == "GPU"
        assert event.kv_cache_spec_kind is None
        assert pool.null_block.block_hash is None


class TestEviction:
    def test_maybe_evict_cached_block(self) -> None:
        """23 (adapted to skip the null block): eviction drops exactly the named block
        from its key, leaving duplicates and other keys alone."""
        pool = BlockPool(5, True, hash_block_size=16)
        b1, b2, b3, b4 = pool.blocks[1:5]
        h0 = make_block_hash_with_group_id(b"10", 1000)
        h1 = make_block_hash_with_group_id(b"20", 2000)
        h2 = make_block_hash_with_group_id(b"30", 3000)
        cache_by_hand(pool, b1, b"10", 1000)
        cache_by_hand(pool, b2, b"20", 2000)
        cache_by_hand(pool, b3, b"30", 3000)
        cache_by_hand(pool, b4, b"10", 1000)
        assert map_contents(pool) == {h0: [1, 4], h1: [2], h2: [3]}

        assert pool._maybe_evict_cached_block(b2)
        assert b2.block_hash is None
        assert map_contents(pool) == {h0: [1, 4], h2: [3]}
        assert pool._maybe_evict_cached_block(b1)
        assert map_contents(pool) == {h0: [4], h2: [3]}
        assert pool._maybe_evict_cached_block(b3)
        assert map_contents(pool) == {h0: [4]}
        assert pool._maybe_evict_cached_block(b4)
        assert map_contents(pool) == {}
        assert not pool._maybe_evict_cached_block(b4)

    def test_reused_cached_block_loses_its_hash(self) -> None:
        """get_new_blocks evicts the cache entry of a popped block and emits
        BlockRemoved with its group."""
        pool = BlockPool(3, True, hash_block_size=4, enable_kv_cache_events=True)
        b1, b2 = pool.get_new_blocks(2)
        cache_by_hand(pool, b1, b"aa", 2)
        pool.free_blocks([b1, b2])
        assert pool_queue(pool) == [2, 1]
        got = pool.get_new_blocks(2)
        assert [b.block_id for b in got] == [2, 1]
        assert b1.block_hash is None
        assert len(pool.cached_block_hash_to_block) == 0
        assert pool.take_events() == [BlockRemoved(block_hashes=[b"aa"], medium="GPU", group_idx=2)]

    def test_evict_blocks_drops_hash_only(self) -> None:
        """evict_blocks removes cache entries but leaves ref counts and the queue as
        they were; unhashed ids are ignored."""
        pool = BlockPool(6, True, hash_block_size=4)
        b1, b2, b3 = pool.get_new_blocks(3)
        cache_by_hand(pool, b1, b"x1", 0)
        cache_by_hand(pool, b2, b"x2", 0)
        pool.free_blocks([b2])
        queue_before = pool_queue(pool)
        pool.evict_blocks({1, 2, 3})
        assert b1.block_hash is None and b2.block_hash is None
        assert len(pool.cached_block_hash_to_block) == 0
        assert [b1.ref_cnt, b2.ref_cnt, b3.ref_cnt] == [1, 0, 1]
        assert pool_queue(pool) == queue_before

    def test_evict_blocks_out_of_range(self) -> None:
        """evict_blocks with an id outside the pool is an invalid argument, and nothing
        is evicted."""
        pool = BlockPool(4, True, hash_block_size=4)
        (b1,) = pool.get_new_blocks(1)
        cache_by_hand(pool, b1, b"x1", 0)
        with pytest.raises(InvalidArgumentError):
            pool.evict_blocks({1, 4})
        assert b1.block_hash is not None


class TestPoolReset:
    def test_reset_refused_while_blocks_are_held(self) -> None:
        """reset_prefix_cache returns False while a request holds a block and keeps the
        map."""
        pool = BlockPool(4, True, hash_block_size=4, enable_kv_cache_events=True)
        (b1,) = pool.get_new_blocks(1)
        cache_by_hand(pool, b1, b"x1", 0)
        assert pool.reset_prefix_cache() is False
        assert len(pool.cached_block_hash_to_block) == 1
        assert pool.take_events() == []

    def test_reset_clears_every_hash(self) -> None:
        """Once everything is free, reset empties the map, clears every block's hash
        and emits AllBlocksCleared."""
        pool = BlockPool(4, True, hash_block_size=4, enable_kv_cache_events=True)
        b1, b2 = pool.get_new_blocks(2)
        cache_by_hand(pool, b1, b"x1", 0)
        cache_by_hand(pool, b2, b"x2", 0)
        pool.free_blocks([b2, b1])
        assert pool.reset_prefix_cache() is True
        assert len(pool.cached_block_hash_to_block) == 0
        assert all(b.block_hash is None for b in pool.blocks)
        assert pool.take_events() == [AllBlocksCleared()]
        assert pool.get_num_free_blocks() == 3

    def test_take_events_without_events_enabled(self) -> None:
        """A pool without events enabled always returns an empty event list."""
        pool = BlockPool(4, True, hash_block_size=4)
        req = hashed_request(list(range(8)), 4)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
        assert pool.take_events() == []

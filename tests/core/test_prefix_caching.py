"""Prefix caching through ``KVCacheManager`` with one full-attention group (catalogue 2,
10-15, 20-22), using the newest free policy: unhashed blocks are prepended to the free
queue, hashed blocks appended."""

from __future__ import annotations

import pytest

from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_block import make_block_hash_with_group_id
from tests.core.helpers import (
    decode,
    finish,
    free_queue_ids,
    full_spec,
    hashed_ids,
    ids,
    make_manager,
    prefill,
    tokens,
)
from tests.core.support import DEFAULT_SEED, REF_HASH_FNS, snapshot

COMMON = tokens((0, 16), (1, 16), (2, 16))


class TestPrefill:
    @pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
    def test_prefill(self, algo: str) -> None:
        """2: hits, ref counts, free-queue order and eviction order across three
        requests sharing a 48-token prefix and one unrelated 160-token request."""
        m = make_manager(11, hash_algo=algo)
        pool = m.block_pool
        ref = REF_HASH_FNS[algo]

        req0 = m.new_request("0", [*COMMON, *[3] * 7])
        assert len(req0.block_hashes) == 3
        hit, num_hit, new = prefill(m, req0)
        assert (ids(hit), num_hit, ids(new)) == (([],), 0, ([1, 2, 3, 4],))
        parent = ref(DEFAULT_SEED)
        for i, block_id in enumerate((1, 2, 3)):
            parent = ref((parent, tuple(COMMON[16 * i : 16 * (i + 1)]), None))
            block = pool.blocks[block_id]
            assert block.block_hash == make_block_hash_with_group_id(parent, 0)
            assert block.ref_cnt == 1
        assert pool.blocks[4].block_hash is None
        assert pool.blocks[4].ref_cnt == 1

        req1 = m.new_request("1", [*COMMON, *[4] * 5])
        hit, num_hit, new = prefill(m, req1)
        assert (ids(hit), num_hit, ids(new)) == (([1, 2, 3],), 48, ([5],))
        assert [pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
        assert pool.get_num_free_blocks() == 5

        finish(m, req0)
        finish(m, req1)
        assert pool.get_num_free_blocks() == 10
        assert free_queue_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

        req2 = m.new_request("2", [*COMMON, *[5] * 6])
        hit, num_hit, new = prefill(m, req2)
        assert (ids(hit), num_hit, ids(new)) == (([1, 2, 3],), 48, ([5],))
        assert pool.get_num_free_blocks() == 6
        assert all(b.ref_cnt == 0 for b in pool.free_block_queue.get_all_free_blocks())

        finish(m, req2)
        req3 = m.new_request("3", [99] * 160)
        hit, num_hit, new = prefill(m, req3)
        assert (ids(hit), num_hit) == (([],), 0)
        assert ids(new) == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
        assert pool.get_num_free_blocks() == 0
        queue = pool.free_block_queue
        assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail

    def test_prefill_plp(self) -> None:
        """10: a request that skips reading the cache still writes it; a later
        identical skipping request gets fresh blocks that duplicate the cached hashes."""
        m = make_manager(11)
        pool = m.block_pool
        prompt0 = [*COMMON, *[3] * 7]

        req0 = m.new_request("0", prompt0, skip_reading_prefix_cache=True)
        hit, num_hit, new = prefill(m, req0)
        assert (ids(hit), num_hit, ids(new)) == (([],), 0, ([1, 2, 3, 4],))
        assert hashed_ids(m) == {1, 2, 3}
        req0_hashes = [pool.blocks[i].block_hash for i in (1, 2, 3)]

        req1 = m.new_request("1", [*COMMON, *[4] * 5])
        hit, num_hit, new = prefill(m, req1)
        assert (ids(hit), num_hit, ids(new)) == (([1, 2, 3],), 48, ([5],))

        finish(m, req0)
        finish(m, req1)
        assert free_queue_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

        req2 = m.new_request("2", prompt0, skip_reading_prefix_cache=True)
        hit, num_hit, new = prefill(m, req2)
        assert (ids(hit), num_hit) == (([],), 0)
        assert ids(new) == ([5, 4, 6, 7],)
        assert [pool.blocks[i].block_hash for i in (5, 4, 6)] == req0_hashes
        assert all(pool.blocks[i].ref_cnt == 1 for i in (5, 4, 6, 7))
        # Lookups still see the first inserted copies.
        probe = m.new_request("3", prompt0)
        hit, num_hit, _ = m.get_computed_blocks(probe)
        assert (ids(hit), num_hit) == (([1, 2, 3],), 48)


class TestDecode:
    def test_decode(self) -> None:
        """11: decode tokens fill the last block before a new one is allocated; a block
        is hashed as soon as it is full."""
        m = make_manager(11)
        req0 = m.new_request("0", [*COMMON, *[3] * 7])
        _, _, new = prefill(m, req0)
        assert ids(new) == ([1, 2, 3, 4],)

        req0.append_output_token_ids([8] * 4)
        new = m.allocate_slots(req0, 4)
        assert new is not None and ids(new) == ([],)
        req0.num_computed_tokens += 4
        check_invariants(m)
        blocks = m.get_blocks("0").blocks[0]
        assert blocks[-1].block_hash is None

        req0.append_output_token_ids([9] * 19)
        new = m.allocate_slots(req0, 19)
        assert ids(new) == ([5],)
        req0.num_computed_tokens += 19
        check_invariants(m)
        blocks = m.get_blocks("0").blocks[0]
        assert blocks[-2].block_hash is not None
        assert blocks[-1].block_hash is None
        assert len(req0.block_hashes) == 4

    def test_decode_one_token_at_a_time(self) -> None:
        """Single-token decode steps allocate exactly at block boundaries."""
        m = make_manager(11)
        req = m.new_request("0", [1] * 15)
        prefill(m, req)
        assert m.get_block_ids("0") == ([1],)
        assert ids(decode(m, req, 7)) == ([],)
        assert ids(decode(m, req, 7)) == ([2],)
        assert hashed_ids(m) == {1}


class TestEviction:
    def test_evict(self) -> None:
        """12: freeing puts a request's unhashed tail in front and its hashed blocks at
        the back, tail first; a later hit touches the prefix and reuses the front."""
        m = make_manager(11)
        req0 = m.new_request("0", list(range(87)))
        _, _, new = prefill(m, req0)
        assert ids(new) == ([1, 2, 3, 4, 5, 6],)
        req1 = m.new_request("1", list(range(87, 135)))
        _, _, new = prefill(m, req1)
        assert ids(new) == ([7, 8, 9],)
        assert m.block_pool.get_num_free_blocks() == 1

        finish(m, req0)
        assert free_queue_ids(m) == [6, 10, 5, 4, 3, 2, 1]
        finish(m, req1)
        assert free_queue_ids(m) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
        assert m.block_pool.get_num_free_blocks() == 10

        req2 = m.new_request("2", list(range(35)))
        hit, num_hit, new = prefill(m, req2)
        assert (ids(hit), num_hit, ids(new)) == (([1, 2],), 32, ([6],))
        assert m.block_pool.get_num_free_blocks() == 7

    def test_hash_block_correct_reuse(self) -> None:
        """13: a cached free block reused by a shorter request loses its hash."""
        m = make_manager(2)
        req = m.new_request("0", list(range(16)))
        _, _, new = prefill(m, req)
        assert ids(new) == ([1],)
        assert hashed_ids(m) == {1}
        finish(m, req)

        req = m.new_request("1", list(range(15)))
        _, num_hit, new = prefill(m, req)
        assert (num_hit, ids(new)) == (0, ([1],))
        assert m.block_pool.blocks[1].block_hash is None
        assert len(m.block_pool.cached_block_hash_to_block) == 0

    def test_computed_blocks_not_evicted(self) -> None:
        """14: a hit block is touched before allocation, so another free block is
        evicted instead of it."""
        m = make_manager(3)
        req0 = m.new_request("0", list(range(16)))
        _, _, new = prefill(m, req0)
        assert ids(new) == ([1],)
        req1 = m.new_request("1", list(range(16, 32)))
        _, _, new = prefill(m, req1)
        assert ids(new) == ([2],)
        finish(m, req0)
        finish(m, req1)
        assert free_queue_ids(m) == [1, 2]

        req2 = m.new_request("2", list(range(32)))
        hit, num_hit, new = prefill(m, req2)
        assert (ids(hit), num_hit, ids(new)) == (([1],), 16, ([2],))
        assert m.block_pool.blocks[1].ref_cnt == 1

    def test_hit_capped_at_num_tokens_minus_one(self) -> None:
        """A prompt made of exactly cached blocks hits all but its last block."""
        m = make_manager(11)
        prefill(m, m.new_request("0", [*COMMON, 9]))
        hit, num_hit, _ = m.get_computed_blocks(m.new_request("1", COMMON))
        assert (ids(hit), num_hit) == (([1, 2],), 32)

    def test_lookup_takes_no_references(self) -> None:
        """get_computed_blocks leaves ref counts and the free queue untouched."""
        m = make_manager(11)
        req0 = m.new_request("0", [*COMMON, 9])
        prefill(m, req0)
        finish(m, req0)
        req = m.new_request("1", [*COMMON, 5])
        before = snapshot(m)
        m.get_computed_blocks(req)
        m.get_computed_blocks(req)
        assert snapshot(m) == before


class TestCachingDisabled:
    def test_basic_prefix_caching_disabled(self) -> None:
        """15: with caching off nothing is hashed or hit, and a full pool refuses."""
        m = make_manager(5, full_spec(4), enable_caching=False)
        req1 = m.new_request("1", list(range(10)))
        hit, num_hit, new = prefill(m, req1)
        assert (ids(hit), num_hit, ids(new)) == (([],), 0, ([1, 2, 3],))
        finish(m, req1)

        req2 = m.new_request("2", list(range(16)))
        hit, num_hit, new = prefill(m, req2)
        assert (num_hit, ids(new)) == (0, ([3, 2, 1, 4],))
        assert hashed_ids(m) == set()

        req3 = m.new_request("3", list(range(4)))
        before = snapshot(m)
        assert m.allocate_slots(req3, 4) is None
        assert snapshot(m) == before
        check_invariants(m)

    def test_disabled_free_order_is_lifo(self) -> None:
        """With caching off freed blocks are all prepended: the last freed block is
        reused first."""
        m = make_manager(5, full_spec(4), enable_caching=False)
        req = m.new_request("1", list(range(12)))
        prefill(m, req)
        finish(m, req)
        assert free_queue_ids(m) == [3, 2, 1, 4]


class TestNoRoom:
    def test_prefill_not_enough_free_blocks_with_computed_blocks(self) -> None:
        """20: a refused allocation leaves the hit blocks' ref counts, the queue and the
        map exactly as they were."""
        m = make_manager(11)
        pool = m.block_pool
        req0 = m.new_request("0", COMMON)
        _, _, new = prefill(m, req0)
        assert ids(new) == ([1, 2, 3],)

        req1 = m.new_request("1", COMMON * 2)
        hit, num_hit, new = prefill(m, req1)
        assert (ids(hit), num_hit, ids(new)) == (([1, 2, 3],), 48, ([4, 5, 6],))
        finish(m, req1)
        assert [pool.blocks[i].ref_cnt for i in range(1, 7)] == [1, 1, 1, 0, 0, 0]

        req2 = m.new_request("2", [7] * 32)
        _, _, new = prefill(m, req2)
        assert ids(new) == ([7, 8],)
        assert pool.get_num_free_blocks() == 5

        req3 = m.new_request("3", COMMON * 3)
        hit, num_hit, _ = m.get_computed_blocks(req3)
        assert (ids(hit), num_hit) == (([1, 2, 3, 4, 5, 6],), 96)
        before = snapshot(m)
        assert m.allocate_slots(req3, 48, 96, hit) is None
        assert snapshot(m) == before
        assert [pool.blocks[i].ref_cnt for i in range(1, 7)] == [1, 1, 1, 0, 0, 0]
        check_invariants(m)


class TestResetPrefixCache:
    def test_reset_prefix_cache(self) -> None:
        """21: reset is refused while blocks are held and clears every hash once all
        requests are freed."""
        m = make_manager(11)
        req0 = m.new_request("0", [*COMMON, *[3] * 7])
        _, _, new = prefill(m, req0)
        assert ids(new) == ([1, 2, 3, 4],)
        req1 = m.new_request("1", [*COMMON, *[4] * 7])
        hit, num_hit, new = prefill(m, req1)
        assert (ids(hit), num_hit, ids(new)) == (([1, 2, 3],), 48, ([5],))

        keys_before = set(m.block_pool.cached_block_hash_to_block)
        assert m.reset_prefix_cache() is False
        assert set(m.block_pool.cached_block_hash_to_block) == keys_before
        assert len(keys_before) == 3

        finish(m, req0)
        finish(m, req1)
        assert m.reset_prefix_cache() is True
        assert len(m.block_pool.cached_block_hash_to_block) == 0
        assert all(b.block_hash is None for b in m.block_pool.blocks)
        check_invariants(m)

        again = m.new_request("2", [*COMMON, 1])
        _, num_hit, _ = m.get_computed_blocks(again)
        assert num_hit == 0

    def test_prefix_cache_stats_disabled(self) -> None:
        """22: without log_stats there are no prefix cache stats through lookup,
        allocation and reset."""
        m = make_manager(11)
        assert m.prefix_cache_stats is None
        req = m.new_request("0", [*COMMON, 1])
        prefill(m, req)
        assert m.prefix_cache_stats is None
        finish(m, req)
        assert m.reset_prefix_cache() is True
        assert m.prefix_cache_stats is None
        assert m.make_prefix_cache_stats() is None


class TestUsageAndCommonPrefix:
    def test_usage_counts_held_blocks_only(self) -> None:
        """usage is the fraction of usable blocks held; cached free blocks count as free."""
        m = make_manager(11)
        assert m.usage == 0.0
        req = m.new_request("0", [*COMMON, 1])
        prefill(m, req)
        assert m.usage == pytest.approx(0.4)
        finish(m, req)
        assert m.usage == 0.0
        assert hashed_ids(m) == {1, 2, 3}

    def test_num_common_prefix_blocks(self) -> None:
        """Leading blocks held by every request holding blocks count as common."""
        m = make_manager(11)
        a = m.new_request("a", [*COMMON, 1])
        b = m.new_request("b", [*COMMON[:32], 5, 5])
        prefill(m, a)
        prefill(m, b)
        assert m.get_num_common_prefix_blocks("a") == [2]
        assert m.get_num_common_prefix_blocks("b") == [2]
        finish(m, b)
        assert m.get_num_common_prefix_blocks("a") == [4]

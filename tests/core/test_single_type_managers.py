"""Single-type managers on a bare ``BlockPool`` (catalogue S11-S14, S16, S18).

"Cached block i" means the hash of logical block i is entered pointing at
``pool.blocks[i + 10]``, so a returned block id reveals its logical index.
"""

from __future__ import annotations

import random

import pytest

from kvservice.core.block_pool import BlockPool
from kvservice.core.kv_cache_block import BlockHash, KVCacheBlock
from kvservice.core.single_type_kv_cache_manager import (
    CacheHitQuery,
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from tests.core.support import cache_by_hand, chunked, full, sliding

T, F = True, False


def fake_hashes(n: int) -> list[BlockHash]:
    return [f"block-{i}".encode() for i in range(n)]


def pool_with_cached(pattern: list[bool], block_size: int) -> tuple[BlockPool, list[BlockHash]]:
    """A pool where logical block i is cached at ``blocks[i + 10]`` when pattern[i]."""
    pool = BlockPool(100, True, hash_block_size=block_size)
    hashes = fake_hashes(len(pattern))
    for i, cached in enumerate(pattern):
        if cached:
            cache_by_hand(pool, pool.blocks[i + 10], hashes[i], 0)
    return pool, hashes


def held_table(pool: BlockPool, first_id: int, count: int) -> list[KVCacheBlock]:
    """Blocks ``first_id..`` taken out of the free queue with one reference each, as a
    request's block table."""
    table = pool.blocks[first_id : first_id + count]
    pool.touch(table)
    return table


def table_ids(table: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in table]


def queue_front(pool: BlockPool, n: int) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()[:n]]


_RNG = random.Random(1234)
RANDOM8 = [_RNG.random() < 0.5 for _ in range(8)]


class TestChunkedLocalFindLongestCacheHit:
    @pytest.mark.parametrize(
        ("pattern", "tail", "expected_len"),
        [
            ([T], 0, 1),
            ([T], 1, 1),
            ([T, F], 0, 2),
            ([T, F], 1, 2),
            ([T, T], 0, 2),
            ([T, T], 1, 2),
            ([T, T, F], 0, 2),
            ([T, T, F], 1, 2),
            ([T, T, T], 0, 3),
            ([T, T, T], 1, 3),
            ([T, T, T, F], 0, 4),
            ([T, T, T, F], 1, 4),
            ([*RANDOM8, T], 1, 9),
            ([*RANDOM8, F], 1, 8),
            ([*RANDOM8, T, T], 1, 10),
            ([*RANDOM8, T, F], 0, 10),
            ([*RANDOM8, F, T], 0, 10),
            ([*RANDOM8, F, F], 0, 10),
            ([*RANDOM8, T, F], 1, 10),
            ([*RANDOM8, F, T], 1, 10),
            ([*RANDOM8, F, F], 1, 10),
        ],
    )
    def test_possible_cached_prefix(
        self, pattern: list[bool], tail: int, expected_len: int
    ) -> None:
        """S11: blocks before the current chunk are null; from the chunk start the hit
        runs left to right until the first miss."""
        block_size, chunk = 2, 4
        spec = chunked(block_size, chunk)
        pool, hashes = pool_with_cached(pattern, block_size)
        max_length = len(pattern) * block_size + tail
        lists, hit_length = ChunkedLocalAttentionManager.find_longest_cache_hit(
            hashes, max_length, CacheHitQuery([0], pool, spec, block_size)
        )
        (blocks,) = lists
        assert len(blocks) == expected_len
        assert hit_length == expected_len * block_size
        num_null = (max_length // chunk * chunk) // block_size
        for i, block in enumerate(blocks):
            if i < num_null:
                assert block is pool.null_block
            else:
                assert block is pool.blocks[i + 10]

    def test_lookup_takes_no_references(self) -> None:
        """The search returns blocks without touching their ref counts or the queue."""
        spec = chunked(2, 4)
        pool, hashes = pool_with_cached([T, T, T], 2)
        free_before = pool.get_num_free_blocks()
        ChunkedLocalAttentionManager.find_longest_cache_hit(
            hashes, 6, CacheHitQuery([0], pool, spec, 2)
        )
        assert pool.get_num_free_blocks() == free_before
        assert all(b.ref_cnt == 0 for b in pool.blocks)


class TestSlidingWindowFindLongestCacheHit:
    @pytest.mark.parametrize(
        ("pattern", "expected_len"),
        [
            ([F] * 10, 0),
            ([T], 1),
            ([T, F], 1),
            ([T, T], 2),
            ([T, T, F], 2),
            ([T, T, T], 3),
            ([T, T, T, F], 3),
            ([T, T, F, T, F, F, T, T, F, T, T, T], 12),
            ([T, T, F, T, F, F, T, T, F, F, F], 8),
            ([T, T, F, T, F, F, T, T, F, F, F, T], 8),
        ],
    )
    def test_possible_cached_prefix(self, pattern: list[bool], expected_len: int) -> None:
        """S12: window 4 at block size 2 needs two consecutive cached blocks, found
        right to left; earlier positions are null, and a run reaching block 0 counts
        even when shorter."""
        block_size = 2
        spec = sliding(block_size, 4)
        pool, hashes = pool_with_cached(pattern, block_size)
        lists, hit_length = SlidingWindowManager.find_longest_cache_hit(
            hashes, len(pattern) * block_size, CacheHitQuery([0], pool, spec, block_size)
        )
        (blocks,) = lists
        assert len(blocks) == expected_len
        assert hit_length == expected_len * block_size
        if all(not b.is_null for b in blocks):
            assert blocks == [pool.blocks[i + 10] for i in range(len(blocks))]
        else:
            assert all(b is pool.null_block for b in blocks[:-2])
            assert blocks[-2:] == [pool.blocks[len(blocks) - 2 + 10], pool.blocks[len(blocks) + 9]]

    def test_docstring_example(self) -> None:
        """Block size 4, window 8, blocks 2 and 3 cached: [NULL, NULL, B2, B3]."""
        spec = sliding(4, 8)
        pool, hashes = pool_with_cached([F, F, T, T], 4)
        (blocks,), hit_length = SlidingWindowManager.find_longest_cache_hit(
            hashes, 16, CacheHitQuery([0], pool, spec, 4)
        )
        assert blocks == [pool.null_block, pool.null_block, pool.blocks[12], pool.blocks[13]]
        assert hit_length == 16


class TestFullAttentionFindLongestCacheHit:
    def test_left_to_right_stops_at_first_miss(self) -> None:
        """Full attention takes the cached prefix up to the first miss."""
        spec = full(2)
        pool, hashes = pool_with_cached([T, T, F, T], 2)
        (blocks,), hit_length = FullAttentionManager.find_longest_cache_hit(
            hashes, 8, CacheHitQuery([0], pool, spec, 2)
        )
        assert blocks == [pool.blocks[10], pool.blocks[11]]
        assert hit_length == 4

    def test_max_length_and_alignment(self) -> None:
        """The hit is bounded by max_length and rounded down to the alignment."""
        spec = full(2)
        pool, hashes = pool_with_cached([T, T, T, T], 2)
        (blocks,), hit_length = FullAttentionManager.find_longest_cache_hit(
            hashes, 7, CacheHitQuery([0], pool, spec, 2)
        )
        assert (len(blocks), hit_length) == (3, 6)
        (blocks,), hit_length = FullAttentionManager.find_longest_cache_hit(
            hashes, 8, CacheHitQuery([0], pool, spec, 4)
        )
        assert (len(blocks), hit_length) == (4, 8)
        (blocks,), hit_length = FullAttentionManager.find_longest_cache_hit(
            hashes, 7, CacheHitQuery([0], pool, spec, 4)
        )
        assert (len(blocks), hit_length) == (2, 4)


class TestRemoveSkippedBlocks:
    def test_chunked_local_remove_skipped_blocks(self) -> None:
        """S13: chunk 4 at block size 2 frees whole chunks before the current one."""
        pool = BlockPool(1100, True, hash_block_size=2)
        manager = ChunkedLocalAttentionManager(chunked(2, 4), pool, True, 0)
        original = list(range(1000, 1011))
        table = held_table(pool, 1000, 11)
        manager.req_to_blocks["r"] = table

        manager.remove_skipped_blocks("r", 0)
        assert table_ids(table) == original
        manager.remove_skipped_blocks("r", 4)
        assert table_ids(table) == [0, 0, *original[2:]]
        manager.remove_skipped_blocks("r", 6)
        assert table_ids(table) == [0, 0, *original[2:]]
        manager.remove_skipped_blocks("r", 12)
        assert table_ids(table) == [0] * 6 + original[6:]
        assert all(pool.blocks[i].ref_cnt == 0 for i in range(1000, 1006))

    def test_sliding_window_remove_skipped_blocks(self) -> None:
        """S14: window 4 skips n - 3 tokens; newly freed blocks go later block first."""
        pool = BlockPool(1100, True, hash_block_size=2)
        manager = SlidingWindowManager(sliding(2, 4), pool, True, 0)
        original = list(range(1000, 1011))
        table = held_table(pool, 1000, 11)
        manager.req_to_blocks["r"] = table

        manager.remove_skipped_blocks("r", 0)
        assert table_ids(table) == original
        manager.remove_skipped_blocks("r", 4)
        assert table_ids(table) == original
        manager.remove_skipped_blocks("r", 5)
        assert table_ids(table) == [0, *original[1:]]
        manager.remove_skipped_blocks("r", 6)
        assert table_ids(table) == [0, *original[1:]]
        manager.remove_skipped_blocks("r", 7)
        assert table_ids(table) == [0, 0, *original[2:]]
        assert queue_front(pool, 1) == [1001]
        manager.remove_skipped_blocks("r", 11)
        assert table_ids(table) == [0] * 4 + original[4:]
        assert queue_front(pool, 2) == [1003, 1002]
        assert all(pool.blocks[i].ref_cnt == 0 for i in range(1000, 1004))

    def test_full_attention_never_frees_early(self) -> None:
        """Full attention skips no tokens, so nothing is removed."""
        pool = BlockPool(20, True, hash_block_size=2)
        manager = FullAttentionManager(full(2), pool, True, 0)
        table = held_table(pool, 10, 5)
        manager.req_to_blocks["r"] = table
        manager.remove_skipped_blocks("r", 10)
        assert table_ids(table) == [10, 11, 12, 13, 14]

    def test_skipped_token_counts(self) -> None:
        """Sliding window skips n - w + 1 tokens; chunked local skips whole chunks."""
        pool = BlockPool(4, True, hash_block_size=4)
        sw = SlidingWindowManager(sliding(4, 4), pool, True, 0)
        assert [sw.get_num_skipped_tokens(n) for n in (0, 3, 7)] == [0, 0, 4]
        local = ChunkedLocalAttentionManager(chunked(4, 8), pool, True, 0)
        assert [local.get_num_skipped_tokens(n) for n in (7, 8, 13)] == [0, 8, 8]


class TestGetNumBlocksToAllocate:
    @pytest.mark.parametrize(
        "manager_cls",
        [SlidingWindowManager, ChunkedLocalAttentionManager],
        ids=["sliding_window_S16", "chunked_local_S18"],
    )
    def test_counts_evictable_hits(
        self, manager_cls: type[SlidingWindowManager | ChunkedLocalAttentionManager]
    ) -> None:
        """S16/S18: 40 tokens with 10 free hit blocks needs 20; with 5 null + 5 free
        hits, 15."""
        block_size = 2
        pool = BlockPool(100, True, hash_block_size=block_size)
        spec = sliding(block_size, 4) if manager_cls is SlidingWindowManager else chunked(2, 4)
        manager = manager_cls(spec, pool, True, 0)
        hits_1 = [KVCacheBlock(i + 1) for i in range(10)]
        hits_2 = [pool.null_block] * 5 + [KVCacheBlock(i + 1) for i in range(5)]
        assert manager.get_num_blocks_to_allocate("1", 20 * block_size, hits_1, 0) == 20
        assert manager.get_num_blocks_to_allocate("2", 20 * block_size, hits_2, 0) == 15

    def test_referenced_hits_are_not_counted(self) -> None:
        """Hit blocks other requests already hold take nothing from the free queue."""
        pool = BlockPool(100, True, hash_block_size=2)
        manager = FullAttentionManager(full(2), pool, True, 0)
        hits = held_table(pool, 10, 4)
        assert manager.get_num_blocks_to_allocate("r", 20, hits, 8) == 6

    def test_running_request_counts_only_growth(self) -> None:
        """A running request needs only the blocks beyond the ones it holds."""
        pool = BlockPool(100, True, hash_block_size=2)
        manager = FullAttentionManager(full(2), pool, True, 0)
        manager.allocate_new_blocks("r", 6)
        manager.num_cached_block["r"] = 0
        assert manager.get_num_blocks_to_allocate("r", 6, [], 6) == 0
        assert manager.get_num_blocks_to_allocate("r", 9, [], 6) == 2

    def test_admission_cap_applies_only_when_asked(self) -> None:
        """The window admission cap bounds the prediction only with
        apply_admission_cap."""
        pool = BlockPool(100, True, hash_block_size=2)
        spec = sliding(2, 8)
        manager = SlidingWindowManager(spec, pool, True, 0, max_admission_blocks_per_request=4)
        assert manager.get_num_blocks_to_allocate("r", 16, [], 0) == 8
        assert manager.get_num_blocks_to_allocate("r", 16, [], 0, apply_admission_cap=True) == 4

"""Hybrid models: several KV cache groups agreeing on one prefix hit (catalogue 3, 41,
42, 43, 53, 54)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_block import BlockHash
from kvservice.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvservice.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import finish, ids, make_manager, prefill, tokens
from tests.core.support import cached_hash_indices, evicted, full, sliding, snapshot

COMMON = tokens((0, 16), (1, 16), (2, 16))


def hybrid_full_sw_sw() -> KVCacheManager:
    """[Full, SW 32, SW 32] at block size 16 with 21 blocks."""
    return make_manager(21, full(16), sliding(16, 32), sliding(16, 32))


def hit_lengths(manager: KVCacheManager, prompt: list[int]) -> tuple[int, list[int]]:
    """(hit tokens, entries per group list) of a lookup for ``prompt``."""
    req = manager.new_request("probe", prompt)
    hit, num_hit, _ = manager.get_computed_blocks(req)
    return num_hit, [len(group) for group in hit.blocks]


class TestPrefillHybridModel:
    def test_prefill_and_hit(self) -> None:
        """3: every group gets its own blocks; a shared 48-token prefix hits full
        attention fully and each window group only on its last two blocks."""
        m = hybrid_full_sw_sw()
        assert isinstance(m.coordinator, HybridKVCacheCoordinator)
        pool = m.block_pool

        req0 = m.new_request("0", [*COMMON, *[3] * 7])
        hit, num_hit, new = prefill(m, req0)
        assert num_hit == 0
        assert ids(new) == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
        for gid, table in enumerate(([1, 2, 3], [5, 6, 7], [9, 10, 11])):
            for block_id, block_hash in zip(table, req0.block_hashes, strict=True):
                assert pool.blocks[block_id].block_hash == block_hash + gid.to_bytes(4, "big")
        assert all(pool.blocks[i].block_hash is None for i in (4, 8, 12))

        req1 = m.new_request("1", [*COMMON, *[4] * 5])
        hit, num_hit, new = prefill(m, req1)
        assert num_hit == 48
        assert ids(hit) == ([1, 2, 3], [0, 6, 7], [0, 10, 11])
        assert ids(new) == ([13], [14], [15])
        for block_id in (1, 2, 3, 6, 7, 10, 11):
            assert pool.blocks[block_id].ref_cnt == 2
        assert pool.blocks[5].ref_cnt == pool.blocks[9].ref_cnt == 1
        assert m.get_block_ids("1") == ([1, 2, 3, 13], [0, 6, 7, 14], [0, 10, 11, 15])

    @pytest.mark.parametrize(
        ("entries", "expected_blocks"),
        [
            ([(0, 1), (0, 2)], 3),
            ([(0, 0)], 0),
            ([(2, 0), (2, 1), (2, 2)], 2),
            ([(2, 0)], 2),
            ([(2, 1)], 2),
            ([(2, 2)], 2),
            ([(2, 0), (0, 1), (0, 2)], 0),
        ],
        ids=[
            "sw-block0-dropped",
            "full-block0-dropped",
            "last-block-all-groups",
            "last-full-block",
            "last-sw-block-group1",
            "last-sw-block-group2",
            "last-full-and-first-sw",
        ],
    )
    def test_partial_hits(self, entries: Sequence[tuple[int, int]], expected_blocks: int) -> None:
        """3: with some (hash index, group) entries evicted the joint hit shrinks to
        the given number of blocks, and every group list has that many entries."""
        m = hybrid_full_sw_sw()
        prompt = [*COMMON, *[3] * 7]
        req0 = m.new_request("0", prompt)
        prefill(m, req0)
        req1 = m.new_request("1", [*COMMON, *[4] * 5])
        prefill(m, req1)
        before = snapshot(m)

        probe_prompt = [*COMMON, *[9] * 5]
        hashes: list[BlockHash] = req0.block_hashes
        with evicted(m.block_pool, hashes, entries):
            num_hit, lengths = hit_lengths(m, probe_prompt)
            assert num_hit == expected_blocks * 16
            assert lengths == [expected_blocks] * 3
        assert snapshot(m) == before
        assert hit_lengths(m, probe_prompt) == (48, [3, 3, 3])
        check_invariants(m)

    def test_free_returns_every_group(self) -> None:
        """Freeing a hybrid request returns all its blocks in every group."""
        m = hybrid_full_sw_sw()
        req0 = m.new_request("0", [*COMMON, *[3] * 7])
        prefill(m, req0)
        finish(m, req0)
        assert m.block_pool.get_num_free_blocks() == 20
        assert m.coordinator.get_blocks("0") == ([], [], [])


def different_block_size_manager(num_blocks: int = 100) -> KVCacheManager:
    """[Full bs 32 fp16, SW bs 16 fp32 window 32]: equal page sizes, hash block 16."""
    return make_manager(num_blocks, full(32, "float16"), sliding(16, 32))


class TestDifferentBlockSize:
    def test_different_block_size(self) -> None:
        """41: the joint hit is a multiple of the 32-token scheduler block; losing one
        window block drops it from 96 to 64 tokens although the window group alone
        could reach 80."""
        m = different_block_size_manager()
        assert m.hash_block_size == 16
        assert m.scheduler_block_size == 32
        prompt = list(range(160))
        req0 = m.new_request("0", prompt)
        new = m.allocate_slots(req0, 112)
        assert ids(new) == ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11])
        req0.num_computed_tokens = 112
        check_invariants(m)

        for length in (113, 97):
            num_hit, lengths = hit_lengths(m, prompt[:length])
            assert (num_hit, lengths) == (96, [3, 6])

        req1 = m.new_request("1", prompt[:113])
        hit, _, _ = m.get_computed_blocks(req1)
        assert ids(hit) == ([1, 2, 3], [0, 0, 0, 0, 9, 10])

        assert 6 not in cached_hash_indices(m, req0.block_hashes, 1)
        with evicted(m.block_pool, req0.block_hashes, [(5, 1)]):
            for length in (113, 97):
                num_hit, lengths = hit_lengths(m, prompt[:length])
                assert (num_hit, lengths) == (64, [2, 4])
            hit, _, _ = m.get_computed_blocks(m.new_request("2", prompt[:113]))
            assert ids(hit) == ([1, 2], [0, 0, 7, 8])

    def test_hybrid_cache_blocks_clamped_to_lcm(self) -> None:
        """43: [Full bs 32, SW bs 16 w 32] caches SW hashes 0-5 of 112 tokens; hash 6
        ends past the last 32-token boundary and is not cached."""
        m = make_manager(100, full(32, "float16"), sliding(16, 32))
        req = m.new_request("0", list(range(112)))
        prefill(m, req)
        assert len(req.block_hashes) == 7
        assert cached_hash_indices(m, req.block_hashes, 1) == {0, 1, 2, 3, 4, 5}
        full_view = [req.block_hashes[i] for i in (1, 3, 5)]
        assert cached_hash_indices(m, full_view, 0) == {0, 1, 2}

    def test_hybrid_cache_blocks_swa_tail_window_only(self) -> None:
        """42: [Full bs 32, SW bs 8 w 8] caches only the last window block of each
        32-token segment (hashes 3 and 7 of 64 tokens)."""
        m = make_manager(40, full(32, "float16"), sliding(8, 8, heads=2))
        req = m.new_request("0", list(range(64)))
        prefill(m, req)
        assert len(req.block_hashes) == 8
        assert cached_hash_indices(m, req.block_hashes, 1) == {3, 7}
        assert cached_hash_indices(m, [req.block_hashes[3], req.block_hashes[7]], 0) == {0, 1}

        num_hit, lengths = hit_lengths(m, [*range(64), 1000])
        assert (num_hit, lengths) == (64, [2, 8])


ADMISSION_PROMPT = list(range(512))


def admission_manager(num_blocks: int) -> KVCacheManager:
    """[Full bs 16, SW bs 16 w 64], max_model_len 1024, 128 tokens in flight."""
    return make_manager(
        num_blocks,
        full(16),
        sliding(16, 64),
        max_model_len=1024,
        max_in_flight_tokens=128,
    )


class TestAdmissionCap:
    def test_window_cap_value(self) -> None:
        """The SW admission cap is cdiv(min(w - 1 + in_flight, max_len), bs) + 1 = 13."""
        spec = sliding(16, 64)
        assert spec.max_admission_blocks_per_request(128, 1024) == 13

    def test_can_fit_full_sequence_swa_cap_admits_long_prompt(self) -> None:
        """53: 78 blocks admit a 512-token prompt under full_sequence_must_fit: 32 full
        blocks plus a window group capped at 13."""
        m = admission_manager(64 + 13 + 1)
        req = m.new_request("0", ADMISSION_PROMPT)
        new = m.allocate_slots(req, 16, full_sequence_must_fit=True)
        assert ids(new) == ([1], [2])
        check_invariants(m)

    @pytest.mark.parametrize(("num_blocks", "admitted"), [(46, True), (45, False)])
    def test_cap_is_what_decides(self, num_blocks: int, admitted: bool) -> None:
        """53 sharpened: with 45 free blocks (uncapped need 64, capped 45) the prompt is
        admitted; with 44 it is refused and nothing changes."""
        m = admission_manager(num_blocks)
        req = m.new_request("0", ADMISSION_PROMPT)
        before = snapshot(m)
        new = m.allocate_slots(req, 16, full_sequence_must_fit=True)
        assert (new is not None) == admitted
        if not admitted:
            assert snapshot(m) == before
        check_invariants(m)

    def test_full_attention_still_gates_oversized(self) -> None:
        """54: with 5 blocks a 256-token prompt is refused under full_sequence_must_fit
        (full attention needs 16 blocks)."""
        m = admission_manager(5)
        req = m.new_request("0", list(range(256)))
        before = snapshot(m)
        assert m.allocate_slots(req, 16, full_sequence_must_fit=True) is None
        assert snapshot(m) == before
        assert m.allocate_slots(req, 16) is not None
        check_invariants(m)

"""EAGLE: a drafter recomputes the last hit block, so hits give one block back
(catalogue 4, 35, 36, 37), once per joint hit in hybrid models."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from kvservice.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import finish, ids, make_config, make_manager, prefill, tokens
from tests.core.support import cached_hash_indices, chunked, evicted, full, sliding

COMMON96 = tokens(*((i, 16) for i in range(6)))


def lookup(manager: KVCacheManager, prompt: list[int]) -> tuple[int, list[int]]:
    req = manager.new_request("probe", prompt)
    hit, num_hit, _ = manager.get_computed_blocks(req)
    return num_hit, [len(group) for group in hit.blocks]


class TestEagleSingleGroup:
    def test_eagle_enabled_removes_last_block(self) -> None:
        """35: 48 cached tokens hit 16 for the same 48-token prompt (cap, then drop)."""
        m = make_manager(10, full(16), use_eagle=True)
        req = m.new_request("0", [0] * 48)
        prefill(m, req)
        finish(m, req)
        assert lookup(m, [0] * 48) == (16, [1])

    def test_eagle_with_partial_blocks(self) -> None:
        """36: two full cached blocks and a partial one: the drop leaves one block."""
        m = make_manager(10, full(16), use_eagle=True)
        req = m.new_request("0", list(range(37)))
        prefill(m, req)
        finish(m, req)
        assert lookup(m, list(range(37))) == (16, [1])

    def test_eagle_with_sliding_window(self) -> None:
        """37: window 16 needs 1 block, 2 with EAGLE; after the drop one block is left,
        and without block 0 nothing can match."""
        m = make_manager(10, sliding(16, 16), use_eagle=True)
        req = m.new_request("0", list(range(37)))
        prefill(m, req)
        finish(m, req)
        assert lookup(m, list(range(37))) == (16, [1])
        with evicted(m.block_pool, req.block_hashes, [(0, 0)]):
            assert lookup(m, list(range(37))) == (0, [0])

    def test_without_eagle_the_same_prompt_hits_more(self) -> None:
        """The drop is EAGLE's: the same history without it hits 32 tokens."""
        m = make_manager(10, full(16))
        req = m.new_request("0", list(range(37)))
        prefill(m, req)
        finish(m, req)
        assert lookup(m, list(range(37))) == (32, [2])


def eagle_hybrid() -> KVCacheManager:
    """[Full, SW 48, SW 48] at block size 16, 31 blocks, every group read by EAGLE."""
    return make_manager(31, full(16), sliding(16, 48), sliding(16, 48), use_eagle=True)


class TestEagleHybrid:
    def test_prefill_hybrid_model_eagle(self) -> None:
        """4: the joint hit drops one block once (80 of 96 tokens), window groups keep
        a window plus nulls, and the allocation takes fresh blocks per group."""
        m = eagle_hybrid()
        req0 = m.new_request("0", [*COMMON96, *[6] * 7])
        _, _, new0 = prefill(m, req0)
        assert ids(new0) == (list(range(1, 8)), list(range(8, 15)), list(range(15, 22)))
        req1 = m.new_request("1", [*COMMON96, *[7] * 5])
        hit, num_hit, new1 = prefill(m, req1)
        assert num_hit == 80
        assert ids(hit) == ([1, 2, 3, 4, 5], [0, 0, 10, 11, 12], [0, 0, 17, 18, 19])
        assert ids(new1) == ([22, 23], [24, 25], [26, 27])

    @pytest.mark.parametrize(
        ("entries", "expected_blocks"),
        [
            ([(0, 1), (0, 2)], 5),  # window groups lose block 0: not needed for the hit
            ([(0, 0)], 0),  # full attention loses block 0: no prefix at all
            ([(5, 0), (5, 1), (5, 2)], 4),  # the last block in every group
            ([(5, 0)], 4),  # the last full-attention block
            ([(4, 1)], 3),  # the second-to-last window block of group 1
            ([(4, 2)], 3),  # ... of group 2
            ([(5, 0), (0, 1), (0, 2)], 4),  # one coordinated drop, not two
        ],
    )
    def test_partial_hits(self, entries: Sequence[tuple[int, int]], expected_blocks: int) -> None:
        """4: hit lengths with some cache entries missing."""
        m = eagle_hybrid()
        req0 = m.new_request("0", [*COMMON96, *[6] * 7])
        prefill(m, req0)
        with evicted(m.block_pool, req0.block_hashes, entries):
            num_hit, lengths = lookup(m, [*COMMON96, *[7] * 5])
        assert num_hit == expected_blocks * 16
        assert lengths == [expected_blocks] * 3

    def test_only_marked_groups_drop(self) -> None:
        """With the drafter's group marked, only its spec group searches as EAGLE; the
        joint hit still gives back one block."""
        config = make_config(31, full(16), sliding(16, 48))
        groups = [
            config.kv_cache_groups[0],
            KVCacheGroupSpec(["draft"], sliding(16, 48), is_eagle_group=True),
        ]
        config = type(config)(config.num_blocks, [], groups)
        m = KVCacheManager(config, 8192, use_eagle=True)
        assert [s.use_eagle for s in m.coordinator.single_type_managers] == [False, True]
        req0 = m.new_request("0", [*COMMON96, *[6] * 7])
        prefill(m, req0)
        assert lookup(m, [*COMMON96, *[7] * 5]) == (80, [5, 5])

    def test_eagle_group_caches_one_block_past_the_boundary(self) -> None:
        """Hybrid caching stops at the last scheduler-block boundary (64 of 80 tokens),
        except in an EAGLE group, which also caches the block after it for its drop."""
        config = make_config(40, full(32))
        groups = [
            config.kv_cache_groups[0],
            KVCacheGroupSpec(["draft"], sliding(16, 16), is_eagle_group=True),
        ]
        m = KVCacheManager(type(config)(40, [], groups), 8192, use_eagle=True)
        req = m.new_request("0", list(range(80)))
        prefill(m, req)
        # Full attention's block i is fingerprinted by fine hash 2i + 1.
        assert cached_hash_indices(m, req.block_hashes, 0) == {1, 3}
        assert cached_hash_indices(m, req.block_hashes, 1) == {0, 1, 2, 3, 4}

    def test_chunked_local_attention_refuses_eagle(self) -> None:
        """A drafter cannot read chunked local attention: refused at construction."""
        with pytest.raises(InvalidArgumentError, match="EAGLE"):
            make_manager(10, chunked(16, 32), use_eagle=True)


class TestEagleWindowGroupCatalogue:
    """Catalogue 38-40 and 50: a sliding-window EAGLE group (block 8) beside full
    attention (block 32), hash block 8."""

    @staticmethod
    def manager(*groups: KVCacheGroupSpec, retention: int | None = None) -> KVCacheManager:
        config = KVCacheConfig(100, [], list(groups), prefix_cache_retention_interval=retention)
        return KVCacheManager(config, 8192, use_eagle=True, hash_block_size=8)

    @staticmethod
    def two_groups() -> tuple[KVCacheGroupSpec, KVCacheGroupSpec]:
        return (
            KVCacheGroupSpec(["attn"], full(32, "float16")),
            KVCacheGroupSpec(["draft"], sliding(8, 8), is_eagle_group=True),
        )

    def test_eagle_swa_alignment_caches_extra_block(self) -> None:
        """38: a primed and freed 128-token prompt replays a hit that is nonzero and a
        multiple of the 32-token scheduler block (96: the cap, then the drop)."""
        m = self.manager(*self.two_groups())
        req = m.new_request("0", list(range(128)))
        prefill(m, req)
        finish(m, req)
        num_hit, _ = lookup(m, list(range(128)))
        assert num_hit == 96

    def test_eagle_swa_boundary_caches_post_boundary_block(self) -> None:
        """39: 40 tokens: the window group caches hashes 3 and 4 (the block before the
        32-token boundary and the one after it), so the prompt plus one token hits 32."""
        m = self.manager(*self.two_groups())
        req = m.new_request("0", list(range(40)))
        prefill(m, req)
        assert {3, 4} <= cached_hash_indices(m, req.block_hashes, 1)
        assert lookup(m, [*range(40), 999]) == (32, [1, 4])

    def test_eagle_grouped_swa_siblings_use_same_cache_mask(self) -> None:
        """40: a main window group and an MTP drafter window group cache the same
        hashes (4 and 8 among them); 72 tokens plus one hit 64."""
        m = self.manager(
            KVCacheGroupSpec(["attn"], full(32)),
            KVCacheGroupSpec(["main"], sliding(8, 8)),
            KVCacheGroupSpec(["mtp"], sliding(8, 8), is_eagle_group=True),
        )
        req = m.new_request("0", list(range(72)))
        prefill(m, req)
        main = cached_hash_indices(m, req.block_hashes, 1)
        assert main == cached_hash_indices(m, req.block_hashes, 2)
        assert {4, 8} <= main
        assert lookup(m, [*range(72), 999])[0] == 64

    def test_hybrid_local_kv_retention_mtp_reuses_latest_boundary(self) -> None:
        """50: retention 0, 127 tokens: the drafter window group caches only hashes 7
        and 8 (around the replay boundary 64); the same prompt hits 64, lists [2, 8]."""
        m = self.manager(*self.two_groups(), retention=0)
        req = m.new_request("0", list(range(127)))
        prefill(m, req)
        assert cached_hash_indices(m, req.block_hashes, 1) == {7, 8}
        assert lookup(m, list(range(127))) == (64, [2, 8])

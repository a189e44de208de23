"""Partial-block (fine-grained) prefix hits with copy-on-write, as vLLM 0.33 enables
them: a hybrid model with a Mamba "align" group whose block is larger than the hash
block. Scenarios from the reference catalogue §11.5 with exact block ids.

Block ids follow from the pool's order: block 0 is the null block, a fresh pool hands
out 1, 2, 3, ... and freed hashed blocks go to the back of the free queue.
"""

from __future__ import annotations

import pytest

from kvservice.core.block_pool import BlockPool
from kvservice.core.errors import FailedPreconditionError
from kvservice.core.invariants import InvariantViolationError, check_invariants
from kvservice.core.kv_cache_block import KVCacheBlock, make_block_hash_with_group_id
from kvservice.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvservice.core.kv_cache_manager import KVCacheBlockCopy, KVCacheBlocks, KVCacheManager
from kvservice.core.request import Request
from kvservice.core.single_type_kv_cache_manager import CacheHitQuery, FullAttentionManager
from tests.core.helpers import finish, free_queue_ids, ids, make_manager, prefill
from tests.core.support import full, sliding
from tests.core.test_mamba import mamba

# Three hash blocks of 2 tokens and one more token: the prompt's last reusable hash
# boundary is 6 (a resend hits at most num_prompt_tokens - 1 = 6 tokens).
PROMPT = [0, 0, 1, 1, 2, 2, 3]


def manager(*specs: object, num_blocks: int = 20) -> KVCacheManager:
    return make_manager(num_blocks, *specs, hash_block_size=2)  # type: ignore[arg-type]


def take_and_release(m: KVCacheManager) -> list[KVCacheBlockCopy]:
    taken = m.take_kv_cache_block_copies()
    m.free_retained_blocks(taken.retained_blocks)
    check_invariants(m)
    return taken.copies


def compute(m: KVCacheManager, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
    """One chunk of a running request (or the first chunk of one without a hit): as
    vLLM's scheduler stops a prefill at the prompt's last reusable hash boundary."""
    new = m.allocate_slots(request, num_new_tokens)
    if new is not None:
        request.num_computed_tokens += num_new_tokens
    check_invariants(m)
    return new


def state(m: KVCacheManager, *block_ids: int) -> list[tuple[int, int | None]]:
    """(ref_cnt, cached prefix length) of the blocks."""
    return [
        (m.block_pool.blocks[i].ref_cnt, m.block_pool.blocks[i].block_hash_num_tokens)
        for i in block_ids
    ]


def coordinator(m: KVCacheManager) -> HybridKVCacheCoordinator:
    assert isinstance(m.coordinator, HybridKVCacheCoordinator)
    return m.coordinator


class TestEnablement:
    def test_mamba_align_with_a_larger_block_turns_partial_hits_on(self) -> None:
        """Full bs 2 + Mamba align bs 4, hash 2: hits are aligned to the hash block."""
        c = coordinator(manager(full(2), mamba(4, "align")))
        assert c.enable_partial_hash_hits
        assert c.alignment_tokens == 2

    @pytest.mark.parametrize(
        "specs",
        [
            (full(4), mamba(4, "all")),  # no align group
            (full(2), mamba(2, "align")),  # Mamba block == hash block
            (full(4), sliding(4, 8), mamba(4, "align")),  # a window needs aligned hits
        ],
    )
    def test_off_otherwise(self, specs: tuple[object, ...]) -> None:
        """Off without an align group larger than the hash block, or when a group
        cannot look hits up per hash block (a window of 4-token blocks)."""
        c = coordinator(manager(*specs))
        assert not c.enable_partial_hash_hits
        assert c.alignment_tokens == c.scheduler_block_size

    def test_window_of_one_hash_block_keeps_them(self) -> None:
        """A window group whose block is one hash block is aligned anyway."""
        assert coordinator(
            manager(full(4), sliding(2, 4), mamba(4, "align"))
        ).enable_partial_hash_hits

    def test_window_disables_and_the_hit_falls_to_the_mamba_block(self) -> None:
        """With the window group partial hits are off: the same 8-token replay of a
        10-token prompt hits 8 tokens (the Mamba block), never 10 - 2."""
        m = manager(full(4), sliding(4, 8), mamba(4, "align"), num_blocks=40)
        prompt = [*PROMPT, 3, 3, 4, 4]
        req0 = m.new_request("0", prompt[:8])
        prefill(m, req0)
        hit, num_hit, _ = m.get_computed_blocks(m.new_request("1", [*prompt[:8], 9]))
        assert num_hit == 8
        assert [len(group) for group in hit.blocks] == [2, 2, 2]


class TestPromptTailEntries:
    def test_prompt_registers_its_last_reusable_boundary(self) -> None:
        """A prefill chunk ending on the prompt's last reusable hash boundary (6 of 7
        tokens) registers the Mamba state there: the state block (table index 1) is
        the entry of group 1 for the prefix hash at 6."""
        m = manager(full(2), mamba(4, "align"))
        req0 = m.new_request("0", PROMPT)
        assert ids(compute(m, req0, 6)) == ([1, 2, 3], [0, 4])
        source = m.block_pool.blocks[4]
        assert source.block_hash_num_tokens == 6
        assert source.block_hash == make_block_hash_with_group_id(req0.block_hashes[2], 1)

    def test_boundary_is_the_prompt_length_minus_one_rounded_down(self) -> None:
        """vLLM's _cache_partial_tail_block: num_prompt_tokens - 1 rounded down to the
        hash block. A 6-token prompt's boundary is 4 (a block boundary here: nothing
        partial), not 6: a request extending it hits 4 tokens and copies nothing."""
        m = manager(full(4), mamba(4, "align"))
        req0 = m.new_request("0", PROMPT[:6])
        assert ids(compute(m, req0, 4)) == ([1], [2])
        m.new_step_starts()
        assert ids(compute(m, req0, 2)) == ([3], [4])
        assert state(m, 1, 2, 3, 4) == [(1, 4), (1, 4), (1, None), (1, None)]
        m.new_step_starts()
        hit, num_hit, new = prefill(m, m.new_request("1", [*PROMPT[:6], 9]))
        assert (num_hit, ids(hit), ids(new)) == (4, ([1], [2]), ([5], [6]))
        assert m.take_kv_cache_block_copies().copies == []

    def test_attention_entry_survives_its_block_filling_up(self) -> None:
        """The full-attention entry at 6 (inside block [4, 8)) is registered again as a
        second key once the block fills and gets its full key: later requests still
        hit 6 tokens there."""
        m = manager(full(4), mamba(4, "align"))
        req0 = m.new_request("0", PROMPT)
        compute(m, req0, 6)
        block = m.block_pool.blocks[2]
        key6 = make_block_hash_with_group_id(req0.block_hashes[2], 0)
        assert (block.block_hash, block.block_hash_num_tokens) == (key6, 6)
        m.new_step_starts()
        compute(m, req0, 1)
        req0.append_output_token_ids(8)
        m.new_step_starts()
        compute(m, req0, 1)  # 8 tokens: block [4, 8) is full
        key8 = make_block_hash_with_group_id(req0.block_hashes[3], 0)
        assert (block.block_hash, block.block_hash_num_tokens) == (key8, 8)
        assert m.block_pool.aliases_of(block) == {key6}
        assert m.block_pool.cached_block_hash_to_block.get_one_block(key6) is block


class TestMambaPartialHit:
    def test_hybrid_mamba_align_partial_hash_hit(self) -> None:
        """§11.5: Full bs 2, Mamba bs 4. req1 hits req0's state at 6 ([3, 2] blocks) in
        the next step, and allocating 4 tokens swaps a private copy into Mamba table
        index 1 and queues (source, copy); both ends are held until released."""
        m = manager(full(2), mamba(4, "align"))
        req0 = m.new_request("0", PROMPT)
        compute(m, req0, 6)
        m.new_step_starts()
        req1 = m.new_request("1", [*PROMPT, 3, 3, 4])
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert (num_hit, ids(hit)) == (6, ([1, 2, 3], [0, 4]))
        # Two full-attention blocks; the Mamba state block and the copy.
        assert m.probe(req1).num_blocks_to_allocate == 4
        new = m.allocate_slots(req1, 4, num_hit, hit)
        assert ids(new) == ([5, 6], [7, 8])
        assert m.get_block_ids("1") == ([1, 2, 3, 5, 6], [0, 7, 8])
        # The source keeps its entry, held by req0's table and for the copy; the copy by
        # req1's table and for the copy.
        assert state(m, 4, 7) == [(2, 6), (2, 8)]
        check_invariants(m)
        taken = m.take_kv_cache_block_copies()
        assert taken.copies == [KVCacheBlockCopy(4, 7)]
        assert [b.block_id for b in taken.retained_blocks] == [4, 7]
        m.free_retained_blocks(taken.retained_blocks)
        assert state(m, 4, 7) == [(1, 6), (1, 8)]
        assert m.take_kv_cache_block_copies().copies == []

    def test_a_state_cached_this_step_waits_for_the_next(self) -> None:
        """req1 hits the state req0 cached in this very step: refused (None) and
        nothing attached, until new_step_starts."""
        m = manager(full(2), mamba(4, "align"))
        m.new_step_starts()  # the caller announces its steps
        compute(m, m.new_request("0", PROMPT), 6)
        req1 = m.new_request("1", [*PROMPT, 3, 3, 4])
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert num_hit == 6
        assert m.allocate_slots(req1, 4, num_hit, hit) is None
        assert m.coordinator.get_blocks("1") == ([], [])
        assert state(m, 4) == [(1, 6)]
        check_invariants(m)

    def test_prediction_counts_the_copy_and_a_refusal_changes_nothing(self) -> None:
        """With one block too few, the partial hit is refused (None) and no reference,
        copy or table entry is left behind."""
        m = manager(full(2), mamba(4, "align"), num_blocks=9)
        compute(m, m.new_request("0", PROMPT), 6)  # 4 of the 8 usable blocks
        assert m.allocate_slots(m.new_request("x", [5]), 1) is not None  # 2 more
        m.new_step_starts()
        req1 = m.new_request("1", [*PROMPT, 3, 3, 4])
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert m.allocate_slots(req1, 4, num_hit, hit) is None  # 4 needed, 2 free
        assert state(m, 4) == [(1, 6)]
        assert m.take_kv_cache_block_copies().copies == []
        assert m.coordinator.get_blocks("1") == ([], [])
        check_invariants(m)

    def test_owner_continuing_moves_its_partial_entry(self) -> None:
        """§11.5 owner CoW: req0 computing past 6 keeps writing its own state block (no
        new Mamba entry in its answer) and the entry moves to a private copy. The copy
        holds the source too (ref 2: req0's table and the copy), the destination only
        its hold; they are released source first. A request hitting the moved entry in
        the same step waits a step."""
        m = manager(full(2), mamba(4, "align"))
        req0 = m.new_request("0", PROMPT)
        compute(m, req0, 6)
        m.new_step_starts()
        assert m.probe(req0, 1).num_blocks_to_allocate == 2  # full block + the move
        assert ids(compute(m, req0, 1)) == ([5], [])
        assert m.get_block_ids("0") == ([1, 2, 3, 5], [0, 4])
        source, moved = m.block_pool.blocks[4], m.block_pool.blocks[6]
        assert source.block_hash is None
        assert moved.block_hash == make_block_hash_with_group_id(req0.block_hashes[2], 1)
        assert state(m, 4, 6) == [(2, None), (1, 6)]

        req1 = m.new_request("1", [*PROMPT, 3, 3, 4])
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert (num_hit, ids(hit)) == (6, ([1, 2, 3], [0, 6]))
        assert not m.probe(req1).would_fit
        assert m.allocate_slots(req1, 4, num_hit, hit) is None
        check_invariants(m)

        taken = m.take_kv_cache_block_copies()
        assert taken.copies == [KVCacheBlockCopy(4, 6)]
        assert [b.block_id for b in taken.retained_blocks] == [4, 6]
        m.free_retained_blocks(taken.retained_blocks)
        assert state(m, 4, 6) == [(1, None), (0, 6)]  # the moved entry: free, cached
        m.new_step_starts()
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert ids(m.allocate_slots(req1, 4, num_hit, hit)) == ([7, 8], [9, 10])
        assert take_and_release(m) == [KVCacheBlockCopy(6, 9)]

    def test_hit_ending_on_a_block_boundary_needs_no_copy(self) -> None:
        """The state at 8 ends a Mamba block: attached as is, nothing copied."""
        m = manager(full(2), mamba(4, "align"))
        prefill(m, m.new_request("0", [*PROMPT[:6], 3, 3]))
        m.new_step_starts()
        _, num_hit, new = prefill(m, m.new_request("1", [*PROMPT[:6], 3, 3, 4]))
        assert num_hit == 8
        assert ids(new) == ([6], [7])
        assert m.take_kv_cache_block_copies().copies == []


class TestFullAttentionPartialHit:
    def test_hybrid_full_attention_partial_hash_hit_uses_cow(self) -> None:
        """§11.5: Full bs 4. req1 hits 6 tokens with lists of [2, 2]; the new full block
        differs from the partial source, copies are queued in both groups, and each
        source is held (ref 1) until the retained blocks are freed, source then
        destination: freed blocks that were cached join the back of the free queue in
        that order."""
        m = manager(full(4), mamba(4, "align"))
        req0 = m.new_request("0", PROMPT)
        assert ids(compute(m, req0, 6)) == ([1, 2], [0, 3])
        # The prompt's last reusable hash boundary (6) is a partial entry in both groups.
        assert state(m, 2, 3) == [(1, 6), (1, 6)]
        finish(m, req0)
        m.new_step_starts()

        req1 = m.new_request("1", [*PROMPT, 3, 3, 4])
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert (num_hit, ids(hit)) == (6, ([1, 2], [0, 3]))
        # Two free hit blocks touched + one new block + the full copy; one touched +
        # the Mamba state block + the Mamba copy.
        assert m.probe(req1).num_blocks_to_allocate == 7
        new = m.allocate_slots(req1, 4, num_hit, hit)
        assert ids(new) == ([4, 5], [6, 7])
        assert m.get_block_ids("1") == ([1, 4, 5], [0, 6, 7])
        assert state(m, 2, 3, 4, 6) == [(1, 6), (1, 6), (2, 8), (2, 8)]
        check_invariants(m)
        taken = m.take_kv_cache_block_copies()
        assert taken.copies == [KVCacheBlockCopy(2, 4), KVCacheBlockCopy(3, 6)]
        assert [b.block_id for b in taken.retained_blocks] == [2, 4, 3, 6]
        check_invariants(m)  # taken, not released: still held
        req1.num_computed_tokens = 10
        finish(m, req1)
        m.free_retained_blocks(taken.retained_blocks)
        assert state(m, 2, 3, 4, 6) == [(0, 6), (0, 6), (0, 8), (0, 8)]
        assert free_queue_ids(m)[-4:] == [2, 4, 3, 6]
        check_invariants(m)
        with pytest.raises(FailedPreconditionError, match="released once"):
            m.free_retained_blocks(taken.retained_blocks)

    def test_copy_targets_start_uncached_with_delayed_caching(self) -> None:
        """§11.5: with delay_cache_blocks the copies carry no hash; sources keep theirs."""
        m = manager(full(4), mamba(4, "align"))
        compute(m, m.new_request("0", PROMPT), 6)
        m.new_step_starts()
        req1 = m.new_request("1", [*PROMPT, 3, 3, 4])
        hit, num_hit, _ = m.get_computed_blocks(req1)
        new = m.allocate_slots(req1, 4, num_hit, hit, delay_cache_blocks=True)
        assert new is not None
        assert [b.block_hash for group in new.blocks for b in group] == [None] * 4
        assert m.block_pool.blocks[2].block_hash_num_tokens == 6

    def test_partial_mamba_state_truncates_the_full_attention_hit(self) -> None:
        """§11.5: full attention cached to 8 tokens, the Mamba state only at 6: the
        joint hit is 6 tokens and the full-attention list is cut to 2 blocks (the hit
        ends inside the second one)."""
        m = manager(full(4), mamba(4, "align"), num_blocks=30)
        compute(m, m.new_request("a", PROMPT), 6)
        longer = [*PROMPT[:6], 3, 3, 4, 4]
        _, _, new = prefill(m, m.new_request("b", longer, skip_reading_prefix_cache=True))
        assert ids(new) == ([4, 5, 6], [0, 0, 7])
        m.new_step_starts()
        hit, num_hit, _ = m.get_computed_blocks(m.new_request("c", [*longer, 5, 5]))
        assert (num_hit, ids(hit)) == (6, ([1, 5], [0, 3]))


class TestEagleRewindsOneHashUnit:
    @staticmethod
    def pool_with(entries: dict[int, int]) -> tuple[BlockPool, list[bytes]]:
        """A pool (hash block 2) where fine hash i is cached on block ``entries[i]``."""
        pool = BlockPool(20, True, hash_block_size=2)
        hashes = [bytes([i]) * 4 for i in range(4)]
        for fine_index, block_id in entries.items():
            block: KVCacheBlock = pool.blocks[block_id]
            key = make_block_hash_with_group_id(hashes[fine_index], 0)
            block.set_block_hash(key, (fine_index + 1) * 2)
            pool.cached_block_hash_to_block.insert(key, block)
        return pool, hashes

    @pytest.mark.parametrize(
        ("entries", "eagle", "expected"),
        [
            ({1: 10, 3: 11}, False, (8, [10, 11])),  # two full blocks
            ({1: 10, 3: 11}, True, (6, [10, 11])),  # EAGLE gives back one hash unit
            ({1: 10, 2: 11}, False, (6, [10, 11])),  # one full block + partial at 6
            ({1: 10, 2: 11}, True, (4, [10])),
        ],
    )
    def test_full_attention_eagle_drops_one_hash_unit(
        self, entries: dict[int, int], eagle: bool, expected: tuple[int, list[int]]
    ) -> None:
        """§11.5: FullAttentionManager lookup, block 4, max_length 8, alignment 2."""
        pool, hashes = self.pool_with(entries)
        blocks, length = FullAttentionManager.find_longest_cache_hit(
            hashes, 8, CacheHitQuery([0], pool, full(4), 2, use_eagle=eagle)
        )
        assert (length, [b.block_id for b in blocks[0]]) == expected


class TestInvariants:
    def test_a_copy_source_handed_out_is_caught(self) -> None:
        """Dropping the hold on a pending copy's source (a bug) is reported."""
        m = manager(full(4), mamba(4, "align"))
        req0 = m.new_request("0", PROMPT)
        compute(m, req0, 6)
        finish(m, req0)
        m.new_step_starts()
        prefill(m, m.new_request("1", [*PROMPT, 3, 3]))
        source = m.block_pool.blocks[2]
        m.block_pool.free_blocks([source])  # the hold is gone: source is free again
        with pytest.raises(InvariantViolationError, match="free before the copy was taken"):
            check_invariants(m)

    def test_a_shared_writable_block_is_caught(self) -> None:
        """A partially hit block left in the table (no copy swapped in) is shared by
        two requests at a position one of them will write: reported."""
        m = manager(full(4), mamba(4, "align"))
        compute(m, m.new_request("0", PROMPT), 6)
        m.new_step_starts()
        req1 = m.new_request("1", [*PROMPT, 3, 3])
        prefill(m, req1)
        single = m.coordinator.single_type_managers[0]
        source = m.block_pool.blocks[2]
        single.req_to_blocks["1"][1] = source  # undo the swap, as a buggy allocator would
        with pytest.raises(InvariantViolationError, match="may still write"):
            check_invariants(m)

"""Admission policy of ``allocate_slots``: watermark, reserved blocks,
full_sequence_must_fit, lookahead (catalogue U36) and delay_cache_blocks."""

from __future__ import annotations

import pytest

from kvservice.core.invariants import check_invariants
from kvservice.core.request import RequestStatus
from tests.core.helpers import full_spec, hashed_ids, ids, make_manager, prefill
from tests.core.support import snapshot


class TestWatermark:
    def test_watermark_blocks_waiting_request(self) -> None:
        """A waiting request is refused when its blocks plus the watermark exceed the
        free count while other requests are scheduled."""
        m = make_manager(11, watermark=0.2)
        assert m.watermark_blocks == 2
        req = m.new_request("0", [1] * 144)
        before = snapshot(m)
        assert m.allocate_slots(req, 144) is None
        assert snapshot(m) == before
        assert m.allocate_slots(req, 128) is not None
        check_invariants(m)

    def test_watermark_ignored_without_scheduled_requests(self) -> None:
        """With nothing else scheduled the watermark does not apply."""
        m = make_manager(11, watermark=0.2)
        req = m.new_request("0", [1] * 144)
        assert ids(m.allocate_slots(req, 144, has_scheduled_reqs=False)) == (list(range(1, 10)),)
        check_invariants(m)

    @pytest.mark.parametrize("status", [RequestStatus.WAITING, RequestStatus.PREEMPTED])
    def test_watermark_applies_to_waiting_and_preempted(self, status: RequestStatus) -> None:
        """Both waiting and preempted requests are held to the watermark."""
        m = make_manager(11, watermark=0.2)
        req = m.new_request("0", [1] * 144)
        req.status = status
        assert m.allocate_slots(req, 144) is None

    def test_watermark_ignored_for_running_request(self) -> None:
        """A running request may dip into the watermark."""
        m = make_manager(11, watermark=0.2)
        req = m.new_request("0", [1] * 16)
        prefill(m, req)
        assert req.status == RequestStatus.RUNNING
        req.append_output_token_ids([2] * 128)
        new = m.allocate_slots(req, 128)
        assert ids(new) == (list(range(2, 10)),)
        assert m.block_pool.get_num_free_blocks() == 1
        check_invariants(m)


class TestReservedBlocks:
    @pytest.mark.parametrize(("reserved", "fits"), [(2, True), (3, False)])
    def test_reserved_blocks_shrink_capacity(self, reserved: int, fits: bool) -> None:
        """reserved_blocks are subtracted from the free count before the check."""
        m = make_manager(11)
        req = m.new_request("0", [1] * 128)
        before = snapshot(m)
        new = m.allocate_slots(req, 128, reserved_blocks=reserved)
        assert (new is not None) == fits
        if not fits:
            assert snapshot(m) == before
        check_invariants(m)

    def test_reserved_blocks_add_to_watermark(self) -> None:
        """Watermark and reserved blocks both count against the free blocks."""
        m = make_manager(11, watermark=0.1)
        req = m.new_request("0", [1] * 128)
        assert m.allocate_slots(req, 128, reserved_blocks=1) is not None
        m2 = make_manager(11, watermark=0.1)
        req2 = m2.new_request("0", [1] * 128)
        assert m2.allocate_slots(req2, 128, reserved_blocks=2) is None


class TestFullSequenceMustFit:
    def test_chunk_refused_when_whole_prompt_cannot_fit(self) -> None:
        """A first chunk is refused if the whole prompt could not fit, although the
        chunk itself would."""
        m = make_manager(10)
        req = m.new_request("0", [1] * 160)
        before = snapshot(m)
        assert m.allocate_slots(req, 16, full_sequence_must_fit=True) is None
        assert snapshot(m) == before
        assert ids(m.allocate_slots(req, 16)) == ([1],)
        check_invariants(m)

    def test_chunk_admitted_when_whole_prompt_fits(self) -> None:
        """A first chunk is admitted when the whole prompt fits."""
        m = make_manager(11)
        req = m.new_request("0", [1] * 160)
        assert ids(m.allocate_slots(req, 16, full_sequence_must_fit=True)) == ([1],)
        check_invariants(m)

    def test_gate_counts_prefix_hits(self) -> None:
        """Cached hit blocks that are already held reduce what the whole prompt needs."""
        m = make_manager(11)
        first = m.new_request("a", [7] * 97)
        prefill(m, first)
        assert m.block_pool.get_num_free_blocks() == 3
        req = m.new_request("b", [*[7] * 96, *[8] * 48])
        hit, num_hit, _ = m.get_computed_blocks(req)
        assert num_hit == 96
        new = m.allocate_slots(req, 16, num_hit, hit, full_sequence_must_fit=True)
        assert ids(new) == ([8],)
        check_invariants(m)


class TestLookahead:
    def test_allocate_with_lookahead(self) -> None:
        """U36: with block size 4, 3 new + 2 lookahead tokens take 2 blocks, and 3 + 4
        still take 2 (a 3-token prompt: the core rejects vLLM's empty prompt)."""
        for lookahead in (2, 2, 4):
            m = make_manager(10, full_spec(4), max_model_len=100)
            req = m.new_request("0", [0, 1, 2])
            new = m.allocate_slots(req, 3, num_lookahead_tokens=lookahead)
            assert new is not None
            assert len(new.get_block_ids()[0]) == 2
            check_invariants(m)

    def test_lookahead_slots_are_not_hashed(self) -> None:
        """Lookahead slots are allocated but never hashed, only blocks within the
        request's tokens."""
        m = make_manager(10, full_spec(4), max_model_len=100)
        req = m.new_request("0", [1, 2, 3, 4, 5])
        new = m.allocate_slots(req, 5, num_lookahead_tokens=4)
        assert ids(new) == ([1, 2, 3],)
        assert hashed_ids(m) == {1}
        check_invariants(m)

    def test_lookahead_clamped_to_max_model_len(self) -> None:
        """Slots beyond max_model_len are not allocated for lookahead."""
        m = make_manager(20, full_spec(4), max_model_len=16)
        req = m.new_request("0", list(range(12)))
        new = m.allocate_slots(req, 12, num_lookahead_tokens=10)
        assert ids(new) == ([1, 2, 3, 4],)
        check_invariants(m)


class TestDelayCacheBlocks:
    def test_delayed_blocks_are_cached_by_the_next_allocation(self) -> None:
        """With delay_cache_blocks the blocks are not hashed until a later allocation
        of the request caches them."""
        m = make_manager(11)
        req = m.new_request("0", [3] * 40)
        new = m.allocate_slots(req, 40, delay_cache_blocks=True)
        assert ids(new) == ([1, 2, 3],)
        assert hashed_ids(m) == set()
        check_invariants(m)
        other = m.new_request("1", [3] * 40)
        assert m.get_computed_blocks(other)[1] == 0

        req.num_computed_tokens = 40
        req.append_output_token_ids(9)
        assert ids(m.allocate_slots(req, 1)) == ([],)
        assert hashed_ids(m) == {1, 2}
        assert m.get_computed_blocks(other)[1] == 32
        check_invariants(m)

    def test_caching_disabled_ignores_delay(self) -> None:
        """With caching off no block is hashed whatever delay_cache_blocks says."""
        m = make_manager(11, enable_caching=False)
        req = m.new_request("0", [3] * 40)
        assert m.allocate_slots(req, 40) is not None
        assert hashed_ids(m) == set()


class TestExternalComputedTokens:
    def test_external_tokens_get_blocks_without_new_tokens(self) -> None:
        """Tokens a connector will load get blocks even with num_new_tokens 0."""
        m = make_manager(11)
        req = m.new_request("0", [5] * 40)
        new = m.allocate_slots(req, 0, num_external_computed_tokens=32)
        assert new is not None
        assert m.get_block_ids("0") == ([1, 2],)
        check_invariants(m)

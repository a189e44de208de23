"""KV cache events (catalogue 25-30) and prefix cache statistics (U25, U26)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.invariants import check_invariants
from kvservice.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice.core.stats import CachingMetrics, PrefixCacheStats
from tests.core.helpers import finish, make_manager, prefill
from tests.core.support import full, sliding
from tests.core.test_mamba import mamba


def stored_events(events: Sequence[object]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


class TestKVCacheEvents:
    @pytest.mark.parametrize("n", [2, 3, 10])
    def test_kv_cache_events(self, n: int) -> None:
        """25: one BlockStored per caching call; reusing the cached blocks without a
        lookup emits one BlockRemoved per block, then a BlockStored; a reset emits
        AllBlocksCleared."""
        m = make_manager(n + 1, enable_kv_cache_events=True)
        req = m.new_request("0", [0] * (16 * n))
        assert m.allocate_slots(req, 16 * n) is not None
        check_invariants(m)
        events = m.take_events()
        assert len(events) == 1
        stored = events[-1]
        assert isinstance(stored, BlockStored)
        assert len(stored.block_hashes) == n == len(m.block_pool.cached_block_hash_to_block)
        assert len(stored.token_ids) == 16 * len(stored.block_hashes)
        assert stored.block_hashes == req.block_hashes
        assert stored.parent_block_hash is None
        assert stored.block_size == 16
        assert stored.medium == "GPU"
        assert stored.lora_id is None and stored.lora_name is None
        assert stored.group_idx == 0
        assert stored.kv_cache_spec_kind == "full_attention"
        assert stored.kv_cache_spec_sliding_window is None
        assert stored.extra_keys == [None] * n
        assert m.take_events() == []

        finish(m, req)
        again = m.new_request("1", [0] * (16 * n))
        assert m.allocate_slots(again, 16 * n) is not None
        check_invariants(m)
        events = m.take_events()
        assert len(events) == n + 1
        stored_hashes = set(stored.block_hashes)
        for event in events[:n]:
            assert isinstance(event, BlockRemoved)
            assert len(event.block_hashes) == 1
            assert event.block_hashes[0] in stored_hashes
            assert event.medium == "GPU"
            assert event.group_idx == 0
        last = events[n]
        assert isinstance(last, BlockStored)
        assert len(last.block_hashes) == n

        finish(m, again)
        assert m.reset_prefix_cache() is True
        events = m.take_events()
        assert isinstance(events[-1], AllBlocksCleared)
        assert len(m.block_pool.cached_block_hash_to_block) == 0

    def test_parent_of_a_later_call(self) -> None:
        """A BlockStored for blocks cached during decode names the previous block's hash
        as parent and carries only the newly cached tokens."""
        m = make_manager(11, enable_kv_cache_events=True)
        req = m.new_request("0", list(range(20)))
        prefill(m, req)
        m.take_events()
        req.append_output_token_ids(list(range(100, 112)))
        assert m.allocate_slots(req, 12) is not None
        check_invariants(m)
        (event,) = m.take_events()
        assert isinstance(event, BlockStored)
        assert event.parent_block_hash == req.block_hashes[0]
        assert event.block_hashes == [req.block_hashes[1]]
        assert event.token_ids == [*range(16, 20), *range(100, 112)]

    @pytest.mark.parametrize("n", [2, 3, 10])
    def test_kv_cache_events_with_lora(self, n: int) -> None:
        """27 (adapted): a LoRA request's BlockStored carries its adapter name (lora_id
        stays None without an int id) and extra keys; without LoRA lora_name is None."""
        m = make_manager(n + 1, enable_kv_cache_events=True)
        req = m.new_request("0", [0] * (16 * n), lora_name="test_lora")
        assert m.allocate_slots(req, 16 * n) is not None
        check_invariants(m)
        (event,) = m.take_events()
        assert isinstance(event, BlockStored)
        assert event.lora_name == "test_lora"
        assert event.lora_id is None
        assert len(event.block_hashes) == n
        assert event.block_size == 16
        assert event.extra_keys == [("test_lora",)] * n

        plain = make_manager(n + 1, enable_kv_cache_events=True)
        plain_req = plain.new_request("0", [0] * (16 * n))
        assert plain.allocate_slots(plain_req, 16 * n) is not None
        (plain_event,) = plain.take_events()
        assert isinstance(plain_event, BlockStored)
        assert plain_event.lora_name is None and plain_event.lora_id is None
        assert set(plain_event.block_hashes).isdisjoint(event.block_hashes)

    @pytest.mark.parametrize(
        ("gid", "kind", "window"),
        [(0, "full_attention", None), (1, "sliding_window", 8)],
    )
    def test_block_stored_event_group_idx(self, gid: int, kind: str, window: int | None) -> None:
        """28 (Full + SW): blocks cached under group g give one event annotated with
        that group's spec kind and window."""
        m = make_manager(5, full(4), sliding(4, 8), enable_kv_cache_events=True)
        pool = m.block_pool
        req = m.new_request("0", list(range(8)))
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, blocks, 0, 2, 4, gid)
        (event,) = m.take_events()
        assert isinstance(event, BlockStored)
        assert event.group_idx == gid
        assert event.kv_cache_spec_kind == kind
        assert event.kv_cache_spec_sliding_window == window

    def test_block_stored_event_group_idx_multiple_groups(self) -> None:
        """29: one allocation in a [Full, SW 128] model stores one event per group with
        (0, full_attention, None) and (1, sliding_window, 128)."""
        m = make_manager(20, full(16), sliding(16, 128), enable_kv_cache_events=True)
        req = m.new_request("0", list(range(32)))
        assert m.allocate_slots(req, 32) is not None
        check_invariants(m)
        events = stored_events(list(m.take_events()))
        assert [
            (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events
        ] == [(0, "full_attention", None), (1, "sliding_window", 128)]
        assert all(len(e.block_hashes) == 2 for e in events)

    def test_block_stored_event_group_idx_out_of_bounds(self) -> None:
        """30: an event for a group the manager does not have passes through
        unannotated."""
        m = make_manager(5, enable_kv_cache_events=True)
        pool = m.block_pool
        req = m.new_request("0", list(range(16)))
        pool.cache_full_blocks(req, pool.get_new_blocks(1), 0, 1, 16, 1)
        (event,) = m.take_events()
        assert isinstance(event, BlockStored)
        assert event.group_idx == 1
        assert event.kv_cache_spec_kind is None
        assert event.kv_cache_spec_sliding_window is None

    def test_block_removed_carries_group(self) -> None:
        """31 (adapted): blocks evicted on reuse give one BlockRemoved each with the
        group they were cached under."""
        m = make_manager(5, full(4), sliding(4, 8), enable_kv_cache_events=True)
        pool = m.block_pool
        req = m.new_request("0", list(range(8)))
        blocks = pool.get_new_blocks(4)
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 1)
        m.take_events()
        pool.free_blocks(blocks)
        pool.get_new_blocks(4)
        events = m.take_events()
        assert len(events) == 2
        assert all(isinstance(e, BlockRemoved) and e.group_idx == 1 for e in events)

    def test_events_disabled(self) -> None:
        """Without events enabled take_events always returns an empty list."""
        m = make_manager(11)
        req = m.new_request("0", list(range(40)))
        prefill(m, req)
        finish(m, req)
        m.reset_prefix_cache()
        assert m.take_events() == []


class TestCachingMetrics:
    def test_metrics(self) -> None:
        """U25: the hit rate covers the most recent max_recent_requests requests and a
        reset clears everything."""
        metrics = CachingMetrics(max_recent_requests=5)
        assert metrics.hit_rate == 0.0
        assert metrics.empty

        metrics.observe(PrefixCacheStats(requests=1, queries=20, hits=9))
        assert metrics.hit_rate == pytest.approx(0.45)
        metrics.observe(PrefixCacheStats(requests=4, queries=80, hits=16))
        assert metrics.hit_rate == pytest.approx(0.25)
        metrics.observe(PrefixCacheStats(requests=1, queries=10, hits=2))
        assert (
            metrics.aggregated_requests,
            metrics.aggregated_query_total,
            metrics.aggregated_query_hit,
        ) == (5, 90, 18)
        assert metrics.hit_rate == pytest.approx(0.2)
        assert not metrics.empty

        metrics.observe(PrefixCacheStats(reset=True))
        assert metrics.hit_rate == 0.0
        assert (
            metrics.aggregated_requests,
            metrics.aggregated_query_total,
            metrics.aggregated_query_hit,
        ) == (0, 0, 0)
        assert len(metrics.query_queue) == 0

    def test_metrics_empty_stats(self) -> None:
        """U26: empty stats are ignored, and the newest entry is kept even when it alone
        exceeds the window."""
        metrics = CachingMetrics(max_recent_requests=5)
        for requests, queries, hits in ((1, 20, 9), (4, 80, 16), (1, 10, 2)):
            metrics.observe(PrefixCacheStats(requests=requests, queries=queries, hits=hits))
        metrics.observe(PrefixCacheStats())
        assert (
            metrics.aggregated_requests,
            metrics.aggregated_query_total,
            metrics.aggregated_query_hit,
        ) == (5, 90, 18)
        assert metrics.hit_rate == pytest.approx(0.2)

        metrics.observe(PrefixCacheStats(requests=11, queries=20, hits=10))
        assert list(metrics.query_queue) == [(11, 20, 10)]
        assert metrics.hit_rate == pytest.approx(0.5)
        metrics.observe(PrefixCacheStats(requests=22, queries=40, hits=30))
        assert list(metrics.query_queue) == [(22, 40, 30)]
        assert metrics.hit_rate == pytest.approx(0.75)

    def test_reset_method(self) -> None:
        """reset() empties the window."""
        metrics = CachingMetrics(max_recent_requests=5)
        metrics.observe(PrefixCacheStats(requests=1, queries=4, hits=2))
        metrics.reset()
        assert metrics.empty and metrics.hit_rate == 0.0


class TestPrefixCacheStats:
    def test_lookups_count_tokens(self) -> None:
        """Each lookup records the request's tokens as queries and the hit tokens as
        hits; make_prefix_cache_stats hands them over and starts afresh."""
        m = make_manager(11, log_stats=True)
        a = m.new_request("a", [1] * 40)
        prefill(m, a)
        b = m.new_request("b", [*[1] * 32, 2, 2])
        prefill(m, b)
        stats = m.make_prefix_cache_stats()
        assert stats is not None
        assert (stats.requests, stats.queries, stats.hits) == (2, 74, 32)
        assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (
            0,
            0,
            0,
        )
        fresh = m.make_prefix_cache_stats()
        assert fresh is not None and fresh.requests == 0

    def test_preempted_requests_counted_apart(self) -> None:
        """A preempted request's lookup goes to the preempted counters only."""
        m = make_manager(11, log_stats=True)
        req = m.new_request("a", [1] * 40)
        prefill(m, req)
        m.free(req)
        req.preempt()
        m.make_prefix_cache_stats()
        prefill(m, req)
        stats = m.make_prefix_cache_stats()
        assert stats is not None
        assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
        assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (
            1,
            40,
            32,
        )

    def test_skipped_lookup_not_recorded(self) -> None:
        """A request that skips reading the cache records no query."""
        m = make_manager(11, log_stats=True)
        m.get_computed_blocks(m.new_request("a", [1] * 40, skip_reading_prefix_cache=True))
        stats = m.make_prefix_cache_stats()
        assert stats is not None and stats.requests == 0

    def test_reset_flags_stats(self) -> None:
        """A successful prefix cache reset marks the current stats as reset."""
        m = make_manager(11, log_stats=True)
        assert m.reset_prefix_cache() is True
        stats = m.make_prefix_cache_stats()
        assert stats is not None and stats.reset is True


class TestEventExtraKeys:
    """BlockStored carries one extra-keys entry per block, in the untagged form vLLM
    publishes (``to_event_extra_keys``); values observed on vLLM 0.33.0."""

    def test_one_untagged_entry_per_block(self) -> None:
        """The salt on block 0, an image on block 1, nothing on block 2 (None); a
        LoRA adapter's name on every block, with its int id as lora_id."""
        m = make_manager(20, full(4), enable_kv_cache_events=True)
        req = m.new_request(
            "0", list(range(12)), cache_salt="s", mm_features=[MultiModalFeature("img", 5, 2)]
        )
        assert m.allocate_slots(req, 12) is not None
        (event,) = m.take_events()
        assert isinstance(event, BlockStored)
        assert event.extra_keys == [("s",), (("img", 1),), None]
        lora = m.new_request(
            "1", list(range(100, 112)), lora_name="a", lora_path="/a", lora_int_id=7
        )
        assert m.allocate_slots(lora, 12) is not None
        (event,) = m.take_events()
        assert isinstance(event, BlockStored)
        assert (event.lora_id, event.lora_name) == (7, "a")
        assert event.extra_keys == [("a",)] * 3

    def test_a_coarser_group_keys_its_whole_block(self) -> None:
        """A Mamba group of 8-token blocks hashed every 4 tokens: its block's entry
        holds the keys of all 8 tokens (the image at 5, the salt)."""
        m = make_manager(20, full(4), mamba(8, "align"), enable_kv_cache_events=True)
        req = m.new_request(
            "0", list(range(12)), cache_salt="s", mm_features=[MultiModalFeature("img", 5, 2)]
        )
        assert m.allocate_slots(req, 8) is not None
        attention, state = stored_events(m.take_events())
        assert (attention.block_size, attention.extra_keys) == (4, [("s",), (("img", 1),)])
        assert (state.block_size, state.extra_keys) == (8, [(("img", 5), "s")])

    def test_partial_entries_carry_their_hash_blocks_keys(self) -> None:
        """The prompt's partial entry at 4 (inside 8-token blocks) is published as one
        hash block of 4 tokens, in each group, with that window's keys."""
        m = make_manager(
            20, full(8), mamba(8, "align"), hash_block_size=4, enable_kv_cache_events=True
        )
        req = m.new_request(
            "0", [1, 2, 3, 4, 5, 6, 7], cache_salt="s", mm_features=[MultiModalFeature("img", 2, 3)]
        )
        assert m.allocate_slots(req, 4) is not None
        events = stored_events(m.take_events())
        assert [(e.group_idx, e.block_size, e.token_ids) for e in events] == [
            (0, 4, [1, 2, 3, 4]),
            (1, 4, [1, 2, 3, 4]),
        ]
        for event in events:
            assert event.block_hashes == [req.block_hashes[0]]
            assert event.parent_block_hash is None
            assert event.extra_keys == [(("img", 2), "s")]

    def test_a_call_caching_only_null_blocks_is_reported(self) -> None:
        """A Mamba "align" group whose newly full blocks are all null padding still
        reports the call: a BlockStored without hashes (extra_keys None)."""
        m = make_manager(20, full(8), mamba(8, "align"), enable_kv_cache_events=True)
        req = m.new_request("0", list(range(20)), cache_salt="s")
        assert m.allocate_slots(req, 20) is not None
        attention, state = stored_events(m.take_events())
        assert attention.extra_keys == [("s",), None]
        assert (state.block_hashes, state.extra_keys, len(state.token_ids)) == ([], None, 16)

"""``KVCacheManager.probe``: the answer of an allocation, without the allocation."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus
from tests.core.helpers import finish, make_manager, prefill, tokens
from tests.core.support import full, sliding, snapshot

PREFIX = tokens((0, 16), (1, 16), (2, 16))


def _stats_total(manager: KVCacheManager) -> tuple[int, int]:
    stats = manager.prefix_cache_stats
    assert stats is not None
    return stats.queries, stats.hits


class TestProbe:
    def test_admission_probe_matches_allocation(self) -> None:
        """A waiting request's probe reports the hit, the blocks it would take and that
        it fits, and then allocate_slots takes exactly that many."""
        m = make_manager(11, log_stats=True)
        prefill(m, m.new_request("a", [*PREFIX, 3]))
        b = m.new_request("b", [*PREFIX, 4, 4])
        before = snapshot(m)
        stats_before = _stats_total(m)
        probe = m.probe(b)
        assert snapshot(m) == before
        assert _stats_total(m) == stats_before
        assert (probe.num_hit_tokens, probe.num_new_tokens) == (48, 2)
        assert probe.would_fit
        free_before = m.block_pool.get_num_free_blocks()
        prefill(m, b)
        assert free_before - m.block_pool.get_num_free_blocks() == probe.num_blocks_to_allocate

    def test_probe_leaves_lru_order_of_free_cached_blocks(self) -> None:
        """Probing a hit on free cached blocks does not take them out of the free queue."""
        m = make_manager(11)
        a = m.new_request("a", [*PREFIX, 3])
        prefill(m, a)
        finish(m, a)
        before = snapshot(m)
        probe = m.probe(m.new_request("b", [*PREFIX, 9]))
        assert probe.num_hit_tokens == 48
        # The three hit blocks are free: touching them would consume free capacity.
        assert probe.num_blocks_to_allocate == 4
        assert snapshot(m) == before

    def test_probe_predicts_no_space(self) -> None:
        """When allocate_slots would answer None, the probe says it would not fit."""
        m = make_manager(5)
        prefill(m, m.new_request("a", [7] * 40))
        b = m.new_request("b", [8] * 40)
        probe = m.probe(b)
        assert not probe.would_fit
        assert probe.num_free_blocks == 1
        _, _, new = prefill(m, b)
        assert new is None

    def test_running_request_probe_counts_window_releases(self) -> None:
        """For a sliding-window request the probe counts the out-of-window blocks the
        allocation would release first, without releasing them."""
        m = make_manager(6, sliding(4, 4), max_model_len=64)
        r = m.new_request("r", list(range(8)))
        prefill(m, r)
        assert m.block_pool.get_num_free_blocks() == 3
        for token in range(8, 12):
            r.append_output_token_ids(token)
        before = snapshot(m)
        probe = m.probe(r, num_new_tokens=4)
        assert snapshot(m) == before
        # Tokens 0..7 computed; the next window starts at token 5: block 0 would go.
        assert probe.num_free_blocks == 4
        assert probe.would_fit
        new = m.allocate_slots(r, 4)
        assert new is not None
        assert sum(len(g) for g in new.blocks) == probe.num_blocks_to_allocate


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_probe_agrees_with_allocate_slots(seed: int) -> None:
    """Over random admissions and decodes, the probe's would_fit equals whether
    allocate_slots returned blocks, and its block count equals the free-count drop."""
    rng = random.Random(seed)
    m = make_manager(12, full(4), max_model_len=256)
    running: list[Request] = []
    for step in range(40):
        if running and rng.random() < 0.6:
            req = rng.choice(running)
            req.append_output_token_ids(rng.randrange(4))
            probe = m.probe(req, num_new_tokens=1)
            free_before = m.block_pool.get_num_free_blocks()
            new = decode_without_append(m, req)
        else:
            req = m.new_request(f"r{step}", [rng.randrange(3) for _ in range(rng.randint(1, 20))])
            probe = m.probe(req)
            free_before = m.block_pool.get_num_free_blocks()
            _, _, new = prefill(m, req)
            if new is not None:
                running.append(req)
        assert probe.would_fit == (new is not None)
        if new is not None:
            assert free_before - m.block_pool.get_num_free_blocks() == probe.num_blocks_to_allocate
        if running and rng.random() < 0.2:
            victim = running.pop(rng.randrange(len(running)))
            finish(m, victim)


def decode_without_append(m: KVCacheManager, req: Request) -> object:
    new = m.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
        req.status = RequestStatus.RUNNING
    return new


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), windowed=st.booleans())
def test_num_blocks_needed_is_the_net_free_count_drop(seed: int, windowed: bool) -> None:
    """``num_blocks_needed`` (what a per-owner block quota admits against) equals the
    drop of the free count across the allocation that follows, window releases
    included, and changes nothing itself."""
    rng = random.Random(seed)
    spec = sliding(4, 8) if windowed else full(4)
    m = make_manager(16, spec, max_model_len=256)
    running: list[Request] = []
    for step in range(40):
        if running and rng.random() < 0.6:
            req = rng.choice(running)
            req.append_output_token_ids(rng.randrange(4))
            before = snapshot(m)
            needed = m.num_blocks_needed(req, 1)
            assert snapshot(m) == before
            free_before = m.block_pool.get_num_free_blocks()
            new = decode_without_append(m, req)
        else:
            req = m.new_request(f"r{step}", [rng.randrange(3) for _ in range(rng.randint(1, 20))])
            hit, num_hit, _ = m.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            needed = m.num_blocks_needed(req, num_new, num_hit, hit)
            free_before = m.block_pool.get_num_free_blocks()
            new = m.allocate_slots(req, num_new, num_hit, hit)
            if new is not None:
                req.num_computed_tokens = req.num_tokens
                req.status = RequestStatus.RUNNING
                running.append(req)
        if new is not None:
            assert free_before - m.block_pool.get_num_free_blocks() == needed
        if running and rng.random() < 0.2:
            finish(m, running.pop(rng.randrange(len(running))))

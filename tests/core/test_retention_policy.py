"""Retention policies beyond vLLM's LRU: eviction priorities with durations, and
pinned prefixes with TTLs and a budget (core/retention_policy.py)."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.core.errors import FailedPreconditionError, InvalidArgumentError, QuotaExceededError
from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request
from kvservice.core.retention_policy import RetentionConfig, TokenRangeRetention
from tests.core.helpers import finish, free_queue_ids, make_manager, prefill, tokens

BS = 16


def run(manager: KVCacheManager, request_id: str, prompt: list[int], **kwargs: object) -> Request:
    """Admit, compute and finish a request: its full blocks end up cached and free."""
    request = manager.new_request(request_id, prompt, **kwargs)  # type: ignore[arg-type]
    _, _, new = prefill(manager, request)
    assert new is not None
    finish(manager, request)
    return request


def cached_ids(manager: KVCacheManager, request: Request) -> list[int]:
    cache = manager.block_pool.cached_block_hash_to_block
    ids = []
    for block_hash in request.block_hashes:
        block = cache.get_one_block(block_hash + (0).to_bytes(4, "big"))
        if block is not None:
            ids.append(block.block_id)
    return ids


def priority(value: int, duration_s: float | None = None) -> RetentionConfig:
    return RetentionConfig((TokenRangeRetention(0, None, value, duration_s),))


# -- priorities ----------------------------------------------------------------------


def test_lower_priorities_are_evicted_first_lru_within_a_priority() -> None:
    m = make_manager(32, eviction_policy="priority")
    high = run(m, "high", tokens((1, 2 * BS + 1)), retention=priority(80))
    low = run(m, "low", tokens((2, 2 * BS + 1)), retention=priority(10))
    plain_a = run(m, "a", tokens((3, 2 * BS + 1)))
    plain_b = run(m, "b", tokens((4, 2 * BS + 1)))
    queue = free_queue_ids(m)
    # Unhashed blocks first, then priority 10, then the default (35) in LRU order,
    # then 80. A request's blocks are freed tail first.
    hashed_order = [i for i in queue if m.block_pool.blocks[i].block_hash is not None]
    assert hashed_order == (
        cached_ids(m, low)[::-1]
        + cached_ids(m, plain_a)[::-1]
        + cached_ids(m, plain_b)[::-1]
        + cached_ids(m, high)[::-1]
    )
    # Churn that evicts all but two cached blocks keeps the high-priority prefix.
    m.block_pool.get_new_blocks(m.block_pool.get_num_free_blocks() - 2)
    assert set(cached_ids(m, high)) == {b.block_id for b in m.block_pool.free_block_queue}


def test_a_priority_reverts_after_its_duration_to_the_front_of_the_default() -> None:
    m = make_manager(32, eviction_policy="priority")
    m.expire_retention(100.0)
    high = run(m, "high", tokens((1, BS + 1)), retention=priority(90, duration_s=5.0))
    plain = run(m, "plain", tokens((2, BS + 1)))
    [high_block] = cached_ids(m, high)
    [plain_block] = cached_ids(m, plain)
    assert m.block_pool.blocks[high_block].priority == 90
    m.expire_retention(104.9)
    assert free_queue_ids(m)[-1] == high_block
    m.expire_retention(105.0)
    assert m.block_pool.blocks[high_block].priority == 35
    queue = free_queue_ids(m)
    assert queue.index(high_block) < queue.index(plain_block) == len(queue) - 1
    assert m.retention_policy is not None
    assert m.retention_policy.stats.priorities_expired == 1
    check_invariants(m)


def test_decode_blocks_take_the_decode_priority() -> None:
    config = RetentionConfig((TokenRangeRetention(0, BS, 70),), decode_priority=5)
    assert config.block_priority(0, BS, 20) == (70, None)
    assert config.block_priority(BS, 2 * BS, 20) == (35, None)  # prompt, no range
    assert config.block_priority(2 * BS, 3 * BS, 20) == (5, None)


def test_overlapping_ranges_give_a_block_the_highest_priority() -> None:
    config = RetentionConfig(
        (TokenRangeRetention(0, 20, 60, 3.0), TokenRangeRetention(10, None, 90, 7.0))
    )
    assert config.block_priority(0, 16, 40) == (90, 7.0)
    assert config.block_priority(32, 48, 40) == (90, 7.0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: TokenRangeRetention(0, None, 101).check(),
        lambda: TokenRangeRetention(5, 5, 50).check(),
        lambda: TokenRangeRetention(0, None, 50, 0.0).check(),
        lambda: RetentionConfig(decode_priority=-1),
    ],
)
def test_malformed_retention_is_refused(build: object) -> None:
    with pytest.raises(InvalidArgumentError):
        build()  # type: ignore[operator]


def test_priorities_need_the_priority_policy() -> None:
    m = make_manager(16)
    with pytest.raises(FailedPreconditionError, match="--eviction-policy priority"):
        m.new_request("r", tokens((1, 20)), retention=priority(50))
    with pytest.raises(InvalidArgumentError, match="eviction policy 'mru'"):
        make_manager(16, eviction_policy="mru")


def _churn(m: KVCacheManager, rng: random.Random, steps: int) -> list[list[int]]:
    """Random admissions and finishes; the free queue after every step."""
    live: list[Request] = []
    seen: list[list[int]] = []
    for step in range(steps):
        if live and (rng.random() < 0.4 or len(live) > 4):
            finish(m, live.pop(rng.randrange(len(live))))
        else:
            prompt = tokens((rng.randrange(3), rng.randrange(1, 3 * BS)), (step, rng.randrange(40)))
            request = m.new_request(f"r{step}", prompt)
            if prefill(m, request)[2] is not None:
                live.append(request)
        seen.append(free_queue_ids(m))
    return seen


def test_the_priority_policy_with_no_priorities_evicts_exactly_as_lru() -> None:
    lru = make_manager(24)
    by_priority = make_manager(24, eviction_policy="priority")
    assert _churn(lru, random.Random(7), 300) == _churn(by_priority, random.Random(7), 300)


# -- pins ----------------------------------------------------------------------------


def test_a_pin_keeps_its_prefix_through_churn_that_evicts_it_under_lru() -> None:
    prompt = tokens((9, 3 * BS))
    outcomes = {}
    for pinned in (False, True):
        m = make_manager(12, max_pinned_fraction=0.5)
        if pinned:
            m.pin_prefix("acme", prompt, now=0.0)  # before it is cached: joins later
        run(m, "system", [*prompt, 1])
        for i in range(6):
            run(m, f"churn{i}", tokens((i + 10, 4 * BS)))
        reader = m.new_request("reader", [*prompt, 2])
        outcomes[pinned] = m.get_computed_blocks(reader)[1]
    assert outcomes == {False: 0, True: 3 * BS}


def test_pinned_blocks_count_as_used_and_unpinning_frees_them_to_the_back() -> None:
    m = make_manager(16, max_pinned_fraction=0.5)
    prompt = tokens((9, 2 * BS))
    system = run(m, "system", [*prompt, 1])
    free_before = m.block_pool.get_num_free_blocks()
    pin = m.pin_prefix("acme", prompt, now=0.0)
    assert len(pin.held) == 2 and pin.pin_id == system.block_hashes[1].hex()[:32]
    assert m.block_pool.get_num_free_blocks() == free_before - 2
    assert m.usage == pytest.approx(2 / 15)
    check_invariants(m)
    assert m.unpin_prefix("acme", pin.pin_id)
    assert not m.unpin_prefix("acme", pin.pin_id)
    assert free_queue_ids(m)[-2:] == cached_ids(m, system)[:2]
    assert m.usage == 0.0
    check_invariants(m)


def test_a_pin_expires_after_its_ttl_and_a_hit_refreshes_it_when_asked() -> None:
    prompt = tokens((9, BS))
    for refresh in (False, True):
        m = make_manager(16, max_pinned_fraction=0.5)
        pin = m.pin_prefix("acme", prompt, now=0.0, ttl_s=10.0, refresh_on_hit=refresh)
        run(m, "system", [*prompt, 1])
        m.expire_retention(8.0)
        run(m, "reader", [*prompt, 2])  # hits the pinned block at t=8
        m.expire_retention(12.0)
        assert m.list_pins() == ([pin] if refresh else [])
        m.expire_retention(18.0)
        assert m.list_pins() == []
        assert m.block_pool.get_num_free_blocks() == 15
        check_invariants(m)


def test_pinning_again_refreshes_the_pin_and_tenants_pin_separately() -> None:
    m = make_manager(16, max_pinned_fraction=0.5)
    prompt = tokens((9, 2 * BS))
    run(m, "system", [*prompt, 1])
    first = m.pin_prefix("acme", prompt, now=0.0, ttl_s=5.0)
    again = m.pin_prefix("acme", prompt, now=3.0, ttl_s=5.0)
    other = m.pin_prefix("globex", prompt, now=3.0)
    assert again is first and first.expires_at == 8.0
    assert [p.tenant for p in m.list_pins()] == ["acme", "globex"]
    assert m.list_pins("globex") == [other]
    block = m.block_pool.blocks[next(iter(first.held.values())).block_id]
    assert block.ref_cnt == 2
    assert not m.unpin_prefix("globex", "not-a-pin")
    check_invariants(m)


def test_a_pin_over_the_budget_is_refused_and_changes_nothing() -> None:
    m = make_manager(11, max_pinned_fraction=0.3)  # 3 of 10 blocks
    m.pin_prefix("acme", tokens((1, 2 * BS)), now=0.0)
    with pytest.raises(QuotaExceededError, match="pinned budget of 3 blocks"):
        m.pin_prefix("acme", tokens((2, 2 * BS)), now=0.0)
    assert len(m.list_pins()) == 1
    with pytest.raises(QuotaExceededError, match="pinning is off"):
        make_manager(11).pin_prefix("acme", tokens((1, BS)), now=0.0)
    with pytest.raises(InvalidArgumentError, match="do not fill one block"):
        m.pin_prefix("acme", tokens((1, BS - 1)), now=0.0)
    with pytest.raises(InvalidArgumentError, match="needs a tenant"):
        m.pin_prefix("", tokens((1, BS)), now=0.0)
    check_invariants(m)


def test_evicting_a_pinned_block_lets_the_pin_wait_and_a_reset_keeps_pins() -> None:
    m = make_manager(16, max_pinned_fraction=0.5)
    prompt = tokens((9, 2 * BS))
    pin = m.pin_prefix("acme", prompt, now=0.0)
    system = run(m, "system", [*prompt, 1])
    first_block = cached_ids(m, system)[0]
    m.evict_blocks({first_block})
    assert len(pin.held) == 1
    check_invariants(m)
    assert m.reset_prefix_cache()
    assert pin.held == {} and m.list_pins() == [pin]
    assert m.block_pool.get_num_free_blocks() == 15
    check_invariants(m)
    run(m, "again", [*prompt, 1])
    assert len(pin.held) == 2
    check_invariants(m)


# -- every operation keeps the invariants ----------------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "finish", "pin", "unpin", "tick", "evict", "reset"]),
        st.integers(0, 1_000),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, policy=st.sampled_from(["lru", "priority"]))
def test_random_operations_keep_the_pool_whole(ops: list[tuple[str, int]], policy: str) -> None:
    m = make_manager(20, eviction_policy=policy, max_pinned_fraction=0.4)
    live: list[Request] = []
    now = 0.0
    prefixes = [tokens((p, BS * (1 + p % 3))) for p in range(4)]
    for i, (op, arg) in enumerate(ops):
        prefix = prefixes[arg % 4]
        if op == "admit":
            retention = (
                RetentionConfig(
                    (TokenRangeRetention(0, None, arg % 101, float(arg % 7 + 1)),),
                    decode_priority=arg % 50,
                )
                if policy == "priority" and arg % 2
                else None
            )
            request = m.new_request(f"r{i}", [*prefix, i, arg], retention=retention)
            if prefill(m, request)[2] is not None:
                live.append(request)
        elif op == "finish" and live:
            finish(m, live.pop(arg % len(live)))
        elif op == "pin":
            with contextlib.suppress(QuotaExceededError):  # over budget: changes nothing
                m.pin_prefix(f"t{arg % 2}", prefix, now=now, ttl_s=float(arg % 9 + 1))
        elif op == "unpin" and m.list_pins():
            pin = m.list_pins()[arg % len(m.list_pins())]
            assert m.unpin_prefix(pin.tenant, pin.pin_id)
        elif op == "tick":
            now += arg % 5
            m.expire_retention(now)
        elif op == "evict":
            m.evict_blocks({arg % 20})
        elif op == "reset":
            m.reset_prefix_cache()
        check_invariants(m)
    for request in live:
        finish(m, request)
    for pin in m.list_pins():
        m.unpin_prefix(pin.tenant, pin.pin_id)
    assert m.block_pool.get_num_free_blocks() == 19
    check_invariants(m)

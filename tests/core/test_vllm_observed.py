"""The allocator vectors observed from vLLM 0.33.0 (one full-attention group,
block_size 16, 11 blocks, sha256): same block ids, same hits, same ``None``s."""

from __future__ import annotations

from kvservice.core.request import RequestStatus
from tests.core.helpers import (
    decode,
    finish,
    free_queue_ids,
    hashed_ids,
    ids,
    make_manager,
    prefill,
    tokens,
)

PREFIX = tokens((0, 16), (1, 16), (2, 16))


def test_observed_scenario() -> None:
    """Steps 1-10 of vllm-0.33-observed.md, in order, on one manager."""
    m = make_manager(11)

    # 1. prefill A = prefix + seven 3s
    a = m.new_request("A", PREFIX + [3] * 7)
    hit, num_hit, new = prefill(m, a)
    assert (ids(hit), num_hit, ids(new)) == (([],), 0, ([1, 2, 3, 4],))
    assert len(a.block_hashes) == 3
    assert hashed_ids(m) == {1, 2, 3}

    # 2. prefill B = prefix + five 4s while A runs
    b = m.new_request("B", PREFIX + [4] * 5)
    hit, num_hit, new = prefill(m, b)
    assert (ids(hit), num_hit, ids(new)) == (([1, 2, 3],), 48, ([5],))
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    assert m.block_pool.get_num_free_blocks() == 5

    # 3. ten decode steps for A: only the tenth allocates
    allocated = [ids(decode(m, a, 50 + i)) for i in range(10)]
    assert allocated[:9] == [([],)] * 9
    assert allocated[9] == ([6],)
    assert m.get_block_ids("A") == ([1, 2, 3, 4, 6],)
    assert hashed_ids(m) == {1, 2, 3, 4}

    # 4. free A then B
    finish(m, a)
    finish(m, b)
    assert m.block_pool.get_num_free_blocks() == 10
    assert free_queue_ids(m) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    assert hashed_ids(m) == {1, 2, 3, 4}

    # 5. C hits the free-but-cached prefix
    c = m.new_request("C", PREFIX + [5] * 6)
    hit, num_hit, new = prefill(m, c)
    assert (ids(hit), num_hit, ids(new)) == (([1, 2, 3],), 48, ([5],))
    assert m.block_pool.get_num_free_blocks() == 6
    finish(m, c)

    # 6. D = 160 tokens of 99 takes every block, in eviction order
    d = m.new_request("D", [99] * 160)
    hit, num_hit, new = prefill(m, d)
    assert (num_hit, ids(new)) == (0, ([5, 6, 7, 8, 9, 10, 4, 3, 2, 1],))
    assert m.block_pool.get_num_free_blocks() == 0
    assert len(hashed_ids(m)) == 10

    # 7. E with a full pool: the prefix was evicted, and there is no room
    e = m.new_request("E", [*PREFIX, 7])
    hit, num_hit, new = prefill(m, e)
    assert (num_hit, new) == (0, None)
    assert m.coordinator.get_blocks("E") == ([],)

    # 8. free D, retry E
    finish(m, d)
    assert free_queue_ids(m) == [1, 2, 3, 4, 10, 9, 8, 7, 6, 5]
    hit, num_hit, new = prefill(m, e)
    assert (num_hit, ids(new)) == (0, ([1, 2, 3, 4],))

    # 9. D2 hits six blocks but needs ten: None, and nothing changes
    d2 = m.new_request("D2", [99] * 160)
    hit, num_hit, new = prefill(m, d2)
    assert (ids(hit), num_hit, new) == (([5, 6, 7, 8, 9, 10],), 96, None)
    assert m.block_pool.get_num_free_blocks() == 6
    assert all(m.block_pool.blocks[i].ref_cnt == 0 for i in (5, 6, 7, 8, 9, 10))
    finish(m, e)
    hit, num_hit, new = prefill(m, d2)
    assert (num_hit, ids(new)) == (96, ([4, 3, 2, 1],))
    assert m.block_pool.get_num_free_blocks() == 0
    finish(m, d2)

    # 10. a prompt of exactly three cached blocks hits only two (cap at num_tokens - 1)
    f = m.new_request("F", [99] * 48)
    hit, num_hit, _ = m.get_computed_blocks(f)
    assert (ids(hit), num_hit) == (([5, 6],), 32)
    assert f.status == RequestStatus.WAITING

"""The allocator vectors observed from vLLM 0.33.0, replayed over gRPC through the
blocking client: the same block ids, hits and Nones as in-process
(tests/core/test_vllm_observed.py)."""

from __future__ import annotations

import dataclasses

from kvservice.client import Allocation, BlockIds, KVClient, RequestStatus
from kvservice.core.invariants import check_invariants
from tests.server.support import SMALL_POOL
from tests.servers import server_in_thread

PREFIX = [0] * 16 + [1] * 16 + [2] * 16
# vLLM's setup: one full-attention group, 16-token blocks, 11 blocks, sha256. D (160
# tokens) is the longest sequence, so that is max_model_len here.
VECTOR_POOL = dataclasses.replace(SMALL_POOL, max_model_len=160)


def prefill(client: KVClient, request_id: str) -> tuple[BlockIds, int, Allocation | None]:
    """Look up the cached prefix, then allocate the rest of the prompt attaching it."""
    hit = client.get_computed_blocks(request_id)
    num_tokens = client.get_request(request_id).num_tokens
    allocation = client.allocate_slots(request_id, num_tokens - hit.num_computed_tokens, hit)
    return hit.block_ids, hit.num_computed_tokens, allocation


def new_ids(allocation: Allocation | None) -> BlockIds | None:
    return None if allocation is None else allocation.new_block_ids


def test_observed_scenario_over_grpc() -> None:
    """Steps 1-10 of vllm-0.33-observed.md, in order, on one server."""
    with server_in_thread(VECTOR_POOL) as running, KVClient(running.target) as c:
        # 1. prefill A = prefix + seven 3s
        assert c.add_request("A", [*PREFIX, *[3] * 7]).num_block_hashes == 3
        hit, num_hit, new = prefill(c, "A")
        assert (hit, num_hit, new_ids(new)) == (((),), 0, ((1, 2, 3, 4),))

        # 2. prefill B = prefix + five 4s while A runs: blocks 1-3 shared
        c.add_request("B", [*PREFIX, *[4] * 5])
        hit, num_hit, new = prefill(c, "B")
        assert (hit, num_hit, new_ids(new)) == (((1, 2, 3),), 48, ((5,),))
        assert c.get_usage().num_free_blocks == 5

        # 3. ten decode steps for A: only the tenth allocates
        allocated = []
        for i in range(10):
            c.append_tokens("A", [50 + i])
            allocated.append(new_ids(c.allocate_slots("A", 1)))
        assert allocated == [((),)] * 9 + [((6,),)]
        assert c.get_block_ids("A") == ((1, 2, 3, 4, 6),)

        # 4. free A then B
        c.free("A")
        assert c.free("B").num_free_blocks == 10

        # 5. C hits the free-but-cached prefix
        c.add_request("C", [*PREFIX, *[5] * 6])
        hit, num_hit, new = prefill(c, "C")
        assert (hit, num_hit, new_ids(new)) == (((1, 2, 3),), 48, ((5,),))
        assert c.get_usage().num_free_blocks == 6
        c.free("C")

        # 6. D = 160 tokens of 99 takes every block, in eviction order
        c.add_request("D", [99] * 160)
        hit, num_hit, new = prefill(c, "D")
        assert (num_hit, new_ids(new)) == (0, ((5, 6, 7, 8, 9, 10, 4, 3, 2, 1),))
        assert c.get_usage().num_free_blocks == 0

        # 7. E with a full pool: the prefix was evicted, and there is no room
        c.add_request("E", [*PREFIX, 7])
        hit, num_hit, new = prefill(c, "E")
        assert (num_hit, new) == (0, None)
        assert c.get_block_ids("E") == ((),)
        assert c.get_request("E").status is RequestStatus.WAITING

        # 8. free D, retry E: the free queue is [1, 2, 3, 4, 10, ...]
        c.free("D")
        hit, num_hit, new = prefill(c, "E")
        assert (num_hit, new_ids(new)) == (0, ((1, 2, 3, 4),))

        # 9. D2 hits six blocks but needs ten: None, and nothing changes
        c.add_request("D2", [99] * 160)
        hit, num_hit, new = prefill(c, "D2")
        assert (hit, num_hit, new) == (((5, 6, 7, 8, 9, 10),), 96, None)
        assert c.get_usage().num_free_blocks == 6
        c.free("E")
        hit, num_hit, new = prefill(c, "D2")
        assert (num_hit, new_ids(new)) == (96, ((4, 3, 2, 1),))
        assert c.get_usage().num_free_blocks == 0
        c.free("D2")

        # 10. a prompt of exactly three cached blocks hits only two
        c.add_request("F", [99] * 48)
        hit_f = c.get_computed_blocks("F")
        assert (hit_f.block_ids, hit_f.num_computed_tokens) == (((5, 6),), 32)
        assert c.get_request("F").status is RequestStatus.WAITING

        running.call(lambda: check_invariants(running.server.table.manager))

"""``ServerRequests``: what a server has of each request of a scheduler's replica, and
so what each call records on the step (read back from the Step message the log
builds): only the tokens, hashes, computed-token counts and frees the server lacks."""

from __future__ import annotations

from typing import Any

import pytest

from kvservice.client.step import StepBuilder
from kvservice.client.step_link import SentStep, StepLink
from kvservice.client.types import ComputedBlocks
from kvservice.core.allocation_options import PLAIN_ALLOCATION, allocation_options
from kvservice.core.request import Request
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.replication import ServerRequests

BLOCK = 4


def never_sent(step: StepBuilder) -> SentStep:
    raise AssertionError("these tests only build steps")


def tracker(sends_hashes: bool = False, lookahead: int = 0) -> tuple[ServerRequests, StepLink]:
    link = StepLink(never_sent, "test")
    return ServerRequests(link, sends_hashes, BLOCK, lookahead), link


def sent(link: StepLink) -> list[tuple[str, Any]]:
    """The step's operations as (kind, the message's body), and a new log after them."""
    step, _ = link.log.build()
    link.log = type(link.log)()
    ops: list[tuple[str, Any]] = []
    for op in step.to_pb().ops:
        kind = op.WhichOneof("op")
        assert kind is not None
        ops.append((kind, getattr(op, kind)))
    return ops


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def test_a_request_the_server_lacks_records_nothing_until_it_is_added() -> None:
    requests, link = tracker()
    assert not requests.send_tokens("r", [1, 2, 3], 3, [])
    assert "r" not in requests
    assert not link.log
    assert requests.add("r", 3, []) is None  # the server hashes: no hashes to send
    assert "r" in requests
    assert requests.send_tokens("r", [1, 2, 3], 3, [])
    assert not link.log  # the prompt is the add_request's, recorded by the caller


def test_only_the_tokens_the_server_lacks_are_appended() -> None:
    requests, link = tracker()
    requests.add("r", 3, [])
    tokens = [1, 2, 3, 4]
    assert requests.send_tokens("r", tokens, 4, [])
    assert requests.send_tokens("r", tokens, 4, [])  # nothing new the second time
    tokens += [5, 6]
    assert requests.send_tokens("r", tokens, 6, [])
    ((kind, append),) = sent(link)
    assert (kind, append.request_id, list(append.token_ids)) == ("append_tokens", "r", [4, 5, 6])


def test_the_engines_hashes_go_once_each_with_the_tokens_that_complete_them() -> None:
    """The prompt's full blocks' hashes with the add; then each hash with the append
    whose token completes its block, none twice."""
    requests, link = tracker(sends_hashes=True)
    tokens = list(range(6))
    chain = hashes(2)
    assert requests.add("r", 6, chain[:1]) == chain[:1]
    tokens.append(6)
    requests.send_tokens("r", tokens, 7, chain[:1])  # no block completed
    tokens.append(7)
    requests.send_tokens("r", tokens, 8, chain)
    requests.send_tokens("r", tokens, 8, chain)
    ((kind, append),) = sent(link)
    assert (kind, list(append.token_ids), list(append.block_hashes)) == (
        "append_tokens",
        [6, 7],
        chain[1:],
    )


def test_a_lookahead_hash_waits_for_the_tokens_after_its_block() -> None:
    requests, link = tracker(sends_hashes=True, lookahead=1)
    chain = hashes(1)
    # 4 prompt tokens fill a block, but its hash covers the token after it too.
    assert requests.add("r", 4, chain) == []
    requests.send_tokens("r", [0, 1, 2, 3, 4], 5, chain)
    ((kind, column),) = sent(link)
    assert (kind, list(column.token_ids), list(column.block_hashes)) == (
        "append_tokens_batch",
        [4],
        chain,
    )


def test_the_computed_tokens_go_only_where_the_scheduler_counted_otherwise() -> None:
    requests, link = tracker()
    requests.add("r", 8, [])
    requests.allocated("r", 8, 0, 0, None, 0, PLAIN_ALLOCATION, ((1, 2),), ())
    # The server now counts 8 computed tokens, as the scheduler does after the step.
    requests.allocated("r", 1, 8, 0, None, 0, PLAIN_ALLOCATION, ((),), ())
    # Rejected draft tokens: the scheduler counts 7, which the server must be told.
    requests.allocated("r", 1, 7, 0, None, 0, PLAIN_ALLOCATION, ((),), ())
    ops = sent(link)
    batches = [body for kind, body in ops if kind == "allocate_slots_batch"]
    singles = [body for kind, body in ops if kind == "allocate_slots"]
    assert [list(b.request_ids) for b in batches] == [["r", "r"]]
    (single,) = singles
    assert single.HasField("num_computed_tokens") and single.num_computed_tokens == 7


def test_a_refused_allocation_leaves_the_servers_count_as_it_was() -> None:
    requests, link = tracker()
    requests.add("r", 8, [])
    requests.allocated("r", 8, 0, 0, None, 0, PLAIN_ALLOCATION, None, ())
    requests.allocated("r", 8, 0, 0, None, 0, PLAIN_ALLOCATION, ((1, 2),), ())
    ops = sent(link)
    assert [kind for kind, _ in ops] == ["allocate_slots_batch"]
    assert not any(kind == "allocate_slots" for kind, _ in ops)


def test_options_and_a_hit_travel_with_the_allocation() -> None:
    requests, link = tracker()
    requests.add("r", 8, [])
    hit = ComputedBlocks(((5,),), 4, 4)
    options = allocation_options(num_lookahead_tokens=2)
    requests.allocated("r", 4, 0, 3, hit, 4, options, ((6,),), ())
    ((kind, body),) = sent(link)
    assert kind == "allocate_slots"
    assert (body.num_lookahead_tokens, body.num_in_flight_tokens) == (2, 3)
    assert not body.HasField("num_computed_tokens")
    assert body.num_new_computed_tokens == 4
    assert [list(group.block_ids) for group in body.new_computed_block_ids] == [[5]]


def test_a_cache_blocks_call_counts_only_when_it_covers_a_new_block() -> None:
    requests, _ = tracker()
    assert requests.covers_new_blocks("r", BLOCK)
    assert not requests.covers_new_blocks("r", BLOCK + 3)
    assert requests.covers_new_blocks("r", 2 * BLOCK)


@pytest.mark.parametrize(
    ("finished", "mode"), [(True, "FREE_MODE_FINISH"), (False, "FREE_MODE_PREEMPT")]
)
def test_a_free_reaches_the_server_only_for_a_request_it_has(finished: bool, mode: str) -> None:
    requests, link = tracker(sends_hashes=True)
    assert not requests.freed("never-added", finished, keep_blocks=False)
    assert not link.log
    requests.add("r", 4, hashes(1))
    requests.allocated("r", 4, 0, 0, None, 0, PLAIN_ALLOCATION, ((1,),), ())
    sent(link)
    assert requests.freed("r", finished, keep_blocks=True)
    ((kind, body),) = sent(link)
    assert (kind, list(body.request_ids), list(body.keep_blocks)) == ("free_batch", ["r"], [True])
    assert pb.FreeMode.Name(body.modes[0]) == mode
    # Finished: forgotten; preempted: it comes back with nothing computed.
    assert ("r" in requests) is not finished
    if not finished:
        requests.allocated("r", 4, 0, 0, None, 0, PLAIN_ALLOCATION, ((2,),), ())
        ((kind, body),) = sent(link)
        assert kind == "allocate_slots_batch"


def replica_request(tokens: list[int], chain: list[bytes]) -> Request:
    """A replica's request whose token and hash lists are the engine's (shared, as the
    vLLM manager's replica shares vLLM's)."""
    request = Request("r", tokens[:1])
    request.all_token_ids = tokens
    request.block_hashes = chain
    return request


@pytest.mark.parametrize("windowed", [False, True])
def test_an_allocation_is_recorded_from_the_replicas_request(windowed: bool) -> None:
    requests, link = tracker(sends_hashes=True)
    requests.windowed = windowed
    tokens, chain = [1, 2, 3], hashes(0)
    request = replica_request(tokens, chain)
    request.num_computed_tokens, request.num_in_flight_tokens = 3, 2
    # The server lacks the request: nothing is recorded, the caller adds it first.
    assert not requests.record_allocation(request, 1, PLAIN_ALLOCATION, ((),), ())
    assert not link.log
    requests.add("r", 3, chain)
    requests.allocated("r", 3, 0, 0, None, 0, PLAIN_ALLOCATION, ((1,),), ())
    sent(link)
    # The engine appends a token that completes a block, then allocates a slot.
    tokens.append(4)
    chain.extend(hashes(1))
    assert requests.record_allocation(request, 1, PLAIN_ALLOCATION, ((2,),), ())
    ops = sent(link)
    assert [kind for kind, _ in ops] == (
        ["append_tokens_batch", "allocate_slots"]
        if windowed
        else ["append_tokens_batch", "allocate_slots_batch"]
    )
    (_, appended), (_, allocation) = ops
    assert (list(appended.token_ids), list(appended.block_hashes)) == ([4], chain)
    if windowed:
        assert allocation.num_in_flight_tokens == 2
    else:
        assert (list(allocation.request_ids), list(allocation.num_new_tokens)) == (["r"], [1])
    # The server's count moved on as the scheduler's does: the next step's goes plain.
    requests.allocated("r", 1, 4, 0, None, 0, PLAIN_ALLOCATION, ((),), ())
    assert [kind for kind, _ in sent(link)] == ["allocate_slots_batch"]

"""``Admit``: a whole step's admissions in one call, deciding exactly what a scheduler
deciding them one ``GetComputedBlocks`` + ``AllocateSlots`` pair at a time would."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.client import AdmitOptions, AdmitStopReason, AsyncKVClient, StepBuilder
from kvservice.core.allocation_options import AllocationOptions
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.admission import AdmitArgs, AdmitStop, admit
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import AllocateArgs, FreeMode, NewRequest
from kvservice.server.config import ServerConfig, build_manager
from tests.server.fuzz_support import table_state
from tests.server.support import HYBRID_POOL, SMALL_POOL, add, allocate, expect_error, tokens
from tests.servers import raw_stub, running_server

BLOCK = SMALL_POOL.block_size
MUST_FIT = AdmitOptions(full_sequence_must_fit=True)
TENANT = ""


def fresh_table(
    quotas: dict[str, int] | None = None, config: ServerConfig = SMALL_POOL
) -> RequestTable:
    return RequestTable(build_manager(config), quotas=quotas)


def one_by_one(table: RequestTable, args: AdmitArgs, tenant: str = TENANT) -> tuple[Any, ...]:
    """The oracle: the scheduler's loop (vLLM's ``schedule`` for waiting requests),
    one lookup and one allocate_slots per request."""
    budget = args.token_budget
    admitted: list[tuple[Any, ...]] = []
    for request_id in args.request_ids:
        if budget <= 0:
            return tuple(admitted), AdmitStop.BUDGET_SPENT
        hit = table.get_computed_blocks(request_id, tenant)
        remaining = table.get_request(request_id, tenant).num_tokens - hit.num_computed_tokens
        if not args.enable_chunked_prefill and remaining > budget:
            return tuple(admitted), AdmitStop.NEEDS_CHUNKING
        num_new_tokens = min(remaining, budget)
        allocation = table.allocate_slots(
            request_id,
            AllocateArgs(
                num_new_tokens=num_new_tokens,
                num_new_computed_tokens=hit.num_computed_tokens,
                new_computed_block_ids=tuple(tuple(g) for g in hit.block_ids)
                if hit.num_computed_tokens
                else (),
                options=AllocationOptions(
                    num_lookahead_tokens=args.num_lookahead_tokens,
                    full_sequence_must_fit=args.full_sequence_must_fit,
                ),
            ),
            tenant,
        )
        if allocation.new_block_ids is None:
            return tuple(admitted), AdmitStop.NO_SPACE
        admitted.append(
            (
                request_id,
                hit,
                num_new_tokens,
                allocation.new_block_ids,
                allocation.block_copies_to_apply,
            )
        )
        budget -= num_new_tokens
    return tuple(admitted), AdmitStop.ALL_ADMITTED


def in_one_call(table: RequestTable, args: AdmitArgs, tenant: str = TENANT) -> tuple[Any, ...]:
    result = admit(table, args, tenant)
    admitted = tuple(
        (
            a.request_id,
            a.hit,
            a.num_new_tokens,
            a.allocation.new_block_ids,
            a.allocation.block_copies_to_apply,
        )
        for a in result.admitted
    )
    return admitted, result.stop


# A pool and the length of the chunks its prompts share: whole blocks on the plain
# pool; on the hybrid one (8-token blocks hashed every 4 tokens) half blocks, so hits
# end inside a block and take copy-on-write copies.
POOLS = {"full": (SMALL_POOL, BLOCK), "hybrid": (HYBRID_POOL, 4)}


def prompts(chunk: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, 3), min_size=1, max_size=5).map(
        lambda chunks: [t for c in chunks for t in tokens(chunk, start=100 * c)]
    )


@pytest.mark.parametrize("pool", sorted(POOLS))
@settings(max_examples=50, deadline=None)
@given(
    data=st.data(),
    token_budget=st.integers(0, 120),
    enable_chunked_prefill=st.booleans(),
    num_lookahead_tokens=st.integers(0, 20),
    full_sequence_must_fit=st.booleans(),
)
def test_admit_decides_as_the_scheduler_loop_does(
    pool: str,
    data: st.DataObject,
    token_budget: int,
    enable_chunked_prefill: bool,
    num_lookahead_tokens: int,
    full_sequence_must_fit: bool,
) -> None:
    """Two identical pools: one admits in one call, the other one request at a time.
    Same admissions (hits, token shares, block ids, copies), same stop, and the same
    pool afterwards, down to the free queue's order and the prefix cache counters."""
    config, chunk = POOLS[pool]
    cached = data.draw(st.lists(prompts(chunk), max_size=3))
    waiting = data.draw(st.lists(prompts(chunk), min_size=1, max_size=5))
    twins = fresh_table(config=config), fresh_table(config=config)
    for table in twins:
        # Earlier requests, finished: their blocks stay cached for the lookups.
        for i, prompt in enumerate(cached):
            table.add_request(NewRequest(f"old-{i}", prompt), TENANT)
            table.allocate_slots(f"old-{i}", AllocateArgs(num_new_tokens=len(prompt)), TENANT)
            table.free(f"old-{i}", FreeMode.FINISH, TENANT)
        for i, prompt in enumerate(waiting):
            table.add_request(NewRequest(f"w-{i}", prompt), TENANT)
    args = AdmitArgs(
        [f"w-{i}" for i in range(len(waiting))],
        token_budget,
        enable_chunked_prefill,
        num_lookahead_tokens,
        full_sequence_must_fit,
    )
    assert in_one_call(twins[0], args) == one_by_one(twins[1], args)
    assert table_state(twins[0]) == table_state(twins[1])
    for table in twins:
        table.audit()


def test_each_stop_reason() -> None:
    table = fresh_table()
    for name, n in (("a", 40), ("b", 40), ("c", 100), ("d", 30)):
        table.add_request(NewRequest(name, tokens(n, start=1000 * ord(name))), TENANT)
    # Budget for a and most of b: b gets a chunk, then nothing is left for c.
    result = admit(table, AdmitArgs(["a", "b", "c"], 70), TENANT)
    assert [(a.request_id, a.num_new_tokens) for a in result.admitted] == [("a", 40), ("b", 30)]
    assert result.stop is AdmitStop.BUDGET_SPENT
    # Without chunked prefill, c (100 tokens) does not fit a budget of 64.
    result = admit(table, AdmitArgs(["c"], 64, enable_chunked_prefill=False), TENANT)
    assert (result.admitted, result.stop) == ([], AdmitStop.NEEDS_CHUNKING)
    # c needs 7 blocks; a and b hold 3 + 2 of the 10.
    result = admit(table, AdmitArgs(["c", "d"], 500), TENANT)
    assert (result.admitted, result.stop) == ([], AdmitStop.NO_SPACE)
    result = admit(table, AdmitArgs(["d"], 500), TENANT)
    assert [a.request_id for a in result.admitted] == ["d"]
    assert result.stop is AdmitStop.ALL_ADMITTED
    table.audit()


def test_a_tenants_quota_stops_admission_with_its_refusal() -> None:
    table = fresh_table(quotas={"t": 4})
    table.add_request(NewRequest("a", tokens(48)), "t")
    table.add_request(NewRequest("b", tokens(48, start=500)), "t")
    result = admit(table, AdmitArgs(["a", "b"], 500), "t")
    assert [a.request_id for a in result.admitted] == ["a"]
    assert result.stop is AdmitStop.QUOTA
    assert result.stop_error is not None and "quota of 4" in str(result.stop_error)
    assert table.get_request("b", "t").num_computed_tokens == 0
    table.audit()


@pytest.mark.parametrize(
    ("request_ids", "budget", "lookahead", "code", "words"),
    [
        ([], 10, 0, grpc.StatusCode.INVALID_ARGUMENT, "request_ids is empty"),
        (["w", "w"], 10, 0, grpc.StatusCode.INVALID_ARGUMENT, "named twice"),
        (["w"], -1, 0, grpc.StatusCode.INVALID_ARGUMENT, "token_budget = -1"),
        (["w"], 10, -2, grpc.StatusCode.INVALID_ARGUMENT, "num_lookahead_tokens = -2"),
        (["w", "ghost"], 10, 0, grpc.StatusCode.NOT_FOUND, "'ghost' is not known"),
        (["w", "r"], 10, 0, grpc.StatusCode.FAILED_PRECONDITION, "request_ids[1] = 'r' is running"),
    ],
)
async def test_a_refused_admit_changes_nothing(
    request_ids: list[str], budget: int, lookahead: int, code: grpc.StatusCode, words: str
) -> None:
    """Every id is checked before the first lookup: the refusal names the field and
    the value, and no request, block or prefix cache counter moved."""
    async with running_server(SMALL_POOL) as server, raw_stub(server) as stub:
        await add(stub, "w", tokens(20))
        await add(stub, "r", tokens(20, start=50))
        await allocate(stub, "r", 20)
        before = table_state(server.table)
        message = await expect_error(
            stub.Admit(
                pb.AdmitRequest(
                    request_ids=request_ids, token_budget=budget, num_lookahead_tokens=lookahead
                )
            ),
            code,
        )
        assert words in message
        assert table_state(server.table) == before


async def test_unary_and_step_admit_answer_alike_and_the_client_decodes_them() -> None:
    """``KVClient.admit`` over the unary RPC and ``StepBuilder.admit`` inside a Step
    (with ``omit_request_state``) on twin servers: the same admissions."""
    answers = []
    for via_step in (False, True):
        async with (
            running_server(SMALL_POOL) as server,
            AsyncKVClient(server.handle.target) as client,
        ):
            await client.add_request("sys", tokens(32))
            assert await client.allocate_slots("sys", 32) is not None
            await client.free("sys")
            for name in ("x", "y", "z"):
                await client.add_request(name, tokens(32) + tokens(8, start=ord(name) * 10))
            if via_step:
                step = StepBuilder(omit_request_state=True)
                handle = step.admit(["x", "y", "z"], 90, MUST_FIT)
                result = (await client.step(step))[handle]
            else:
                result = await client.admit(["x", "y", "z"], 90, MUST_FIT)
                assert result.admitted[0].allocation.request.num_computed_tokens == 40
            answers.append(
                [
                    (
                        a.request_id,
                        a.hit.num_computed_tokens,
                        a.num_new_tokens,
                        a.allocation.new_block_ids,
                    )
                    for a in result.admitted
                ]
            )
            assert result.stop_reason is AdmitStopReason.ALL_ADMITTED
    unary, stepped = answers
    assert unary == stepped
    # Each hits the 32-token system prompt and computes its own 8 tokens.
    assert [(rid, hit, n) for rid, hit, n, _ in unary] == [("x", 32, 8), ("y", 32, 8), ("z", 32, 8)]

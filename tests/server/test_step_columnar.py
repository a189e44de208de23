"""The columnar Step operations (AppendTokensBatch, AllocateSlotsBatch, FreeBatch,
LookupAllocateBatch, AddRequestBatch) and the builder that coalesces into them:
whatever the sequence, a coalescing and a non-coalescing ``StepBuilder`` read the
same result through every handle and leave the same pool behind; a batch malformed
as a whole is refused and changes nothing; NO_SPACE and refusals mid-batch answer per
entry, as single operations do."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvservice.client import (
    AllocateOptions,
    Allocation,
    BlockIds,
    ComputedBlocks,
    FreeMode,
    KVClient,
    NotRunError,
    OpHandle,
    RequestNotFoundError,
    RunHandle,
    StepBuilder,
    StepResults,
)
from kvservice.core.request import Request
from kvservice.protocol import pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.config import ServerConfig
from tests.server import support
from tests.server.fuzz_support import (
    CALL_TIMEOUT_S,
    finish_everything,
    fuzz_settings,
    table_state,
)
from tests.server.support import SMALL_POOL, tokens
from tests.servers import ThreadedServer, server_in_thread

BLOCK = SMALL_POOL.block_size
# The small pool with zeroing on: every allocation lists its fresh blocks to zero.
ZEROING_POOL = dataclasses.replace(SMALL_POOL, needs_kv_cache_zeroing=True, none_hash_seed="c")
HYBRID_POOL = dataclasses.replace(support.HYBRID_POOL, none_hash_seed="c")
# No zeroing, runtime or event sink: the request table's inline decode paths
# (``allocate_new_tokens``, ``append_token``) answer the columnar entries.
PLAIN_POOL = dataclasses.replace(SMALL_POOL, none_hash_seed="c")
OPS_FIELD = "ops"


@dataclasses.dataclass
class Twin:
    """A server in a thread, a typed client and a raw stub to it."""

    server: ThreadedServer
    client: KVClient
    stub: pb_grpc.KVCacheServiceStub

    def state(self) -> tuple[Any, ...]:
        return self.server.call(lambda: table_state(self.server.server.table))

    def finish(self) -> None:
        finish_everything(self.server, self.stub)


@contextlib.contextmanager
def twin(config: ServerConfig) -> Iterator[Twin]:
    with (
        server_in_thread(config) as server,
        KVClient(server.target) as client,
        grpc.insecure_channel(server.target) as channel,
    ):
        yield Twin(server, client, pb_grpc.KVCacheServiceStub(channel))


@pytest.fixture(
    scope="module",
    params=[ZEROING_POOL, HYBRID_POOL, PLAIN_POOL],
    ids=["zeroing", "hybrid", "plain"],
)
def twins(request: pytest.FixtureRequest) -> Iterator[tuple[Twin, Twin]]:
    """Two identical servers: the first gets coalesced steps, the second the same
    operations one message operation each, so their histories stay equal."""
    with twin(request.param) as coalesced, twin(request.param) as plain:
        yield coalesced, plain


# -- operations -------------------------------------------------------------------------

IDS = ("a", "b", "c", "d", "unknown")
PROMPTS = (tokens(BLOCK), tokens(2 * BLOCK + 3), tokens(5), tokens(3 * BLOCK, start=900))
Op = tuple[Any, ...]


def apply(builder: StepBuilder, op: Op) -> OpHandle[Any]:
    """Add one drawn operation to ``builder``; its handle."""
    kind, rid, arg = op
    if kind == "add":
        return builder.add_request(rid, PROMPTS[arg])
    if kind == "append":
        return builder.append_tokens(rid, arg)
    if kind == "allocate":
        return builder.allocate_slots(rid, arg)
    if kind == "allocate_lookahead":
        return builder.allocate_slots(rid, 1, options=AllocateOptions(num_lookahead_tokens=arg))
    if kind == "admit":
        return builder.admit([rid, "b"], arg)
    if kind == "free":
        return builder.free(rid, FreeMode.PREEMPT if arg else FreeMode.FINISH)
    if kind == "lookup":
        return builder.get_computed_blocks(rid)
    if kind == "get":
        return builder.get_request(rid)
    return builder.get_usage()


ids = st.sampled_from(IDS)
# Decode-heavy, as a scheduler's steps are: runs of one-token appends and plain
# allocations, broken by everything else (and by bad tokens and counts).
ops = st.one_of(
    st.tuples(st.just("append"), ids, st.lists(st.integers(0, 50), min_size=1, max_size=1)),
    st.tuples(st.just("append"), ids, st.lists(st.integers(0, 50), min_size=1, max_size=1)),
    st.tuples(st.just("append"), ids, st.sampled_from(([-1], [2**40], [3, 4], [0] * 70))),
    st.tuples(st.just("allocate"), ids, st.sampled_from((1, 1, 2, BLOCK, 2 * BLOCK + 3))),
    # Big enough that a run of them meets a full pool (10 blocks) and answers NO_SPACE.
    st.tuples(st.just("allocate"), ids, st.sampled_from((4 * BLOCK, 6 * BLOCK))),
    st.tuples(st.just("allocate"), ids, st.sampled_from((1, 1, 3, 0, -2, 200))),
    st.tuples(st.just("add"), ids, st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("admit"), ids, st.sampled_from((1, 40, 500))),
    st.tuples(st.just("allocate_lookahead"), ids, st.integers(0, 20)),
    st.tuples(st.just("free"), ids, st.booleans()),
    st.tuples(st.sampled_from(("lookup", "get", "usage")), ids, st.none()),
)


def outcome(results: StepResults, handle: OpHandle[Any]) -> tuple[Any, ...]:
    """What a handle reads: its value, or its error's type, code and message."""
    error = results.error(handle)
    if error is not None:
        with pytest.raises(type(error)):
            results[handle]
        return ("error", type(error), error.code, error.message)
    return ("ok", results[handle])


def send(twin: Twin, plan: list[Op], coalesce: bool, **flags: bool) -> list[tuple[Any, ...]]:
    """Send ``plan`` as one step; what each handle reads, then the step's totals."""
    builder = StepBuilder(omit_request_state=flags["omit"], coalesce=coalesce)
    handles = [apply(builder, op) for op in plan]
    assert len(builder) == len(plan)
    results = twin.client.step(builder, stop_on_error=flags["stop_on_error"])
    errors = {i: (type(e), e.code, e.message) for i, e in results.errors.items()}
    assert list(errors) == sorted(errors)
    read = [outcome(results, handle) for handle in handles]
    return [*read, ("totals", len(results), results.ok, errors)]


def num_wire_ops(plan: list[Op]) -> int:
    """The message operations a coalescing builder sends for ``plan``."""
    builder = StepBuilder()
    for op in plan:
        apply(builder, op)
    return len(builder.to_pb().ops)


# Each example starts by adding most ids, so that allocations mostly name known
# requests and fill the pool.
prelude = st.lists(
    st.tuples(st.just("add"), st.sampled_from(IDS[:4]), st.integers(0, len(PROMPTS) - 1)),
    min_size=2,
    max_size=4,
)


@fuzz_settings(40)
@given(
    first=prelude,
    steps=st.lists(st.lists(ops, min_size=1, max_size=14), min_size=1, max_size=4),
    omit=st.booleans(),
    stop_on_error=st.booleans(),
)
def test_coalescing_reads_the_same_through_every_handle(
    twins: tuple[Twin, Twin],
    first: list[Op],
    steps: list[list[Op]],
    omit: bool,
    stop_on_error: bool,
) -> None:
    """Random steps, decode-heavy and mixing bad ids, tokens and counts, sent through
    a coalescing and a non-coalescing builder to twin servers: every handle reads the
    same value or error (NO_SPACE as None, refusals, not-run after a failure), the
    step's error map and totals agree, and the pools end identical."""
    coalesced, plain = twins
    try:
        for plan in [first, *steps]:
            got = send(coalesced, plan, True, omit=omit, stop_on_error=stop_on_error)
            want = send(plain, plan, False, omit=omit, stop_on_error=stop_on_error)
            assert got == want, plan
            assert coalesced.state() == plain.state(), plan
    finally:
        coalesced.finish()
        plain.finish()


# A run of entries for one batch call: one-token appends or plain allocations, with bad
# tokens, counts and ids among them.
runs = st.tuples(
    st.sampled_from(("append", "allocate")),
    st.lists(st.tuples(ids, st.sampled_from((1, 1, 2, BLOCK, 0, -2, 200))), max_size=6),
)


@fuzz_settings(30)
@given(
    first=prelude,
    plan=st.lists(st.one_of(runs, ops), min_size=1, max_size=6),
    stop_on_error=st.booleans(),
)
def test_batch_calls_read_as_their_single_operations(
    twins: tuple[Twin, Twin], first: list[Op], plan: list[Any], stop_on_error: bool
) -> None:
    """``append_tokens_batch`` and ``allocate_slots_batch``, mixed with single
    operations, against the same entries sent one operation each: each run's
    ``rows`` read every entry's value, or raise the first failed entry's error; the
    step's indices and errors agree, and the pools end identical."""
    coalesced, plain = twins
    try:
        send(coalesced, first, True, omit=True, stop_on_error=False)
        send(plain, first, False, omit=True, stop_on_error=False)
        batched = StepBuilder(omit_request_state=True)
        single = StepBuilder(omit_request_state=True, coalesce=False)
        pairs: list[tuple[Any, list[OpHandle[Any]]]] = []
        for item in plan:
            if item[0] not in ("append", "allocate") or not isinstance(item[1], list):
                pairs.append((apply(batched, item), [apply(single, item)]))
                continue
            kind, entries = item
            request_ids = [request_id for request_id, _ in entries]
            values = [value for _, value in entries]
            run: RunHandle[Any]
            handles: list[OpHandle[Any]]
            if kind == "append":
                run = batched.append_tokens_batch(request_ids, values)
                handles = [single.append_tokens(r, [v]) for r, v in entries]
            else:
                run = batched.allocate_slots_batch(request_ids, values)
                handles = [single.allocate_slots(r, v) for r, v in entries]
            assert run.num_entries == len(handles)
            if handles:
                assert run.index == handles[0].index
            pairs.append((run, handles))
        assert len(batched) == len(single)
        got = coalesced.client.step(batched, stop_on_error=stop_on_error)
        want = plain.client.step(single, stop_on_error=stop_on_error)
        assert {i: (type(e), e.message) for i, e in got.errors.items()} == {
            i: (type(e), e.message) for i, e in want.errors.items()
        }
        for handle, handles in pairs:
            if isinstance(handle, OpHandle):
                assert outcome(got, handle) == outcome(want, handles[0])
                continue
            errors = [error for error in map(want.error, handles) if error is not None]
            if errors:
                with pytest.raises(type(errors[0])) as raised:
                    got.rows(handle)
                assert raised.value.message == errors[0].message
            else:
                rows: list[Any] = got.rows(handle)
                assert rows == [want[h] for h in handles]
                if any(isinstance(row, Allocation) for row in rows):
                    assert_columns_match(got, handle, rows)
        assert coalesced.state() == plain.state()
    finally:
        coalesced.finish()
        plain.finish()


def assert_columns_match(
    results: StepResults, run: RunHandle[Allocation | None], rows: list[Allocation | None]
) -> None:
    """``allocations_match`` (the remote-step link's check on the columns) agrees with
    the decoded ``rows``, and sees any one entry answered otherwise."""
    answers = [None if row is None else row.new_block_ids for row in rows]
    copies = any(row and (row.block_copies_to_apply or row.block_copies_applied) for row in rows)
    assert results.allocations_match(run, answers) is not copies
    for index, answer in enumerate(answers):
        other = ((10**6,),) if answer is None else None
        assert not results.allocations_match(run, [*answers[:index], other, *answers[index + 1 :]])


def test_a_batch_call_that_the_message_refuses_leaves_the_builder_as_it_was() -> None:
    """A bad id, a value past int64 or columns of different lengths raise when added,
    and the builder sends what it held before: no half-added run, no empty batch."""
    builder = StepBuilder()
    builder.get_usage()
    before = builder.to_pb().SerializeToString()
    with pytest.raises(TypeError):
        builder.allocate_slots_batch(["a", 5], [1, 1])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        builder.append_tokens_batch(["a", "b"], [1, 2**70])
    with pytest.raises(ValueError, match="2 request ids but 1 values"):
        builder.allocate_slots_batch(["a", "b"], [1])
    assert builder.allocate_slots_batch([], []).num_entries == 0
    assert builder.to_pb().SerializeToString() == before
    assert len(builder) == 1
    builder.allocate_slots_batch(["a"], [1])
    builder.allocate_slots("b", 1)  # joins the open run
    assert len(builder) == 3 and len(builder.to_pb().ops) == 2


def test_a_decode_step_travels_as_two_columnar_operations() -> None:
    """The builder really coalesces: a decode step's appends and allocations are one
    AppendTokensBatch and one AllocateSlotsBatch; any other operation (or an append of
    two tokens, or an allocation with options) breaks a run."""
    decode = [("append", r, [1]) for r in "abcd"] + [("allocate", r, 1) for r in "abcd"]
    assert num_wire_ops(decode) == 2
    broken = [*decode[:2], ("append", "c", [1, 2]), *decode[2:6], ("get", "a", None)]
    broken += [("allocate_lookahead", "b", 1), ("allocate", "c", 1)]
    # batch(a, b), append c, batch(c, d), batch(a, b), get, allocate+options, batch(c)
    assert num_wire_ops(broken) == 7
    assert len(StepBuilder(coalesce=False).to_pb().ops) == 0


# -- the wire contract, raw ---------------------------------------------------------------


def step(twin: Twin, *operations: pb.StepOperation, **flags: bool) -> pb.StepResponse:
    response: pb.StepResponse = twin.stub.Step(
        pb.StepRequest(ops=operations, **flags), timeout=CALL_TIMEOUT_S
    )
    return response


def appends(request_ids: list[str], token_ids: list[int]) -> pb.StepOperation:
    batch = pb.AppendTokensBatch(request_ids=request_ids, token_ids=token_ids)
    return pb.StepOperation(append_tokens_batch=batch)


def allocations(request_ids: list[str], num_new_tokens: list[int]) -> pb.StepOperation:
    batch = pb.AllocateSlotsBatch(request_ids=request_ids, num_new_tokens=num_new_tokens)
    return pb.StepOperation(allocate_slots_batch=batch)


@pytest.fixture
def zeroing() -> Iterator[Twin]:
    with twin(ZEROING_POOL) as server:
        yield server


@pytest.mark.parametrize(
    ("operation", "message"),
    [
        (appends([], []), "append_tokens_batch: request_ids must hold at least one request"),
        (appends(["a", "b"], [1]), "token_ids has 1 values for 2 request_ids"),
        (allocations(["a"], [1, 1]), "num_new_tokens has 2 values for 1 request_ids"),
        (allocations([], []), "allocate_slots_batch: request_ids must hold at least one"),
    ],
)
def test_a_malformed_batch_is_refused_whole_and_changes_nothing(
    zeroing: Twin, operation: pb.StepOperation, message: str
) -> None:
    """No entry, or uneven columns: INVALID_ARGUMENT for the operation, naming the
    column and the counts, and no entry ran (the valid ones included)."""
    assert_refused_whole(zeroing, operation, message)


def assert_refused_whole(zeroing: Twin, operation: pb.StepOperation, message: str) -> None:
    """``operation``, sent with requests a and b known, is refused as a whole
    (INVALID_ARGUMENT, ``message`` in its words) and changes nothing."""
    zeroing.client.add_request("a", tokens(BLOCK))
    zeroing.client.add_request("b", tokens(BLOCK))
    before = zeroing.state()
    response = step(zeroing, operation)
    (result,) = response.results
    assert result.WhichOneof("result") == "error"
    assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert message in result.error.message
    assert zeroing.state() == before
    zeroing.finish()


def test_no_space_mid_batch_answers_that_entry_and_the_rest_still_run(zeroing: Twin) -> None:
    """10 free blocks: a takes 3, b asks for 8 (no room: NO_SPACE, nothing changed), c
    then takes 2. The columns hold a's and c's blocks and a 0 count for b, and every
    fresh block is listed to zero under its own entry."""
    for rid in "abc":
        zeroing.client.add_request(rid, tokens(BLOCK))
    response = step(zeroing, allocations(["a", "b", "c"], [3 * BLOCK, 8 * BLOCK, 2 * BLOCK]))
    batch = response.results[0].allocate_slots_batch
    assert (batch.num_requests, batch.num_run, list(batch.no_space)) == (3, 3, [1])
    assert not batch.errors
    assert (batch.num_groups, list(batch.num_new_blocks)) == (1, [3, 0, 2])
    assert len(set(batch.new_block_ids)) == 5
    assert list(batch.num_block_ids_to_zero) == [3, 0, 2]
    assert sorted(batch.block_ids_to_zero) == sorted(batch.new_block_ids)
    assert len(batch.requests) == 3
    assert [r.num_computed_tokens for r in batch.requests] == [3 * BLOCK, 0, 2 * BLOCK]
    assert zeroing.client.get_request("b").num_computed_tokens == 0
    zeroing.finish()


def test_refused_entries_answer_alone_and_later_entries_run(zeroing: Twin) -> None:
    """An unknown id and a negative token are refused with the single operation's
    status and message, each at its index; the entries around them ran."""
    zeroing.client.add_request("a", tokens(BLOCK))
    zeroing.client.add_request("b", tokens(BLOCK))
    response = step(zeroing, appends(["a", "nope", "b", "a"], [5, 6, -1, 7]))
    batch = response.results[0].append_tokens_batch
    assert (batch.num_requests, batch.num_run) == (4, 4)
    errors = [(e.index, e.code) for e in batch.errors]
    assert errors == [(1, 5), (2, 3)]  # NOT_FOUND, INVALID_ARGUMENT
    single = zeroing.stub.Step(
        pb.StepRequest(
            ops=[
                pb.StepOperation(
                    append_tokens=pb.AppendTokensRequest(request_id="b", token_ids=[-1])
                )
            ]
        ),
        timeout=CALL_TIMEOUT_S,
    )
    assert batch.errors[1].message == single.results[0].error.message
    assert zeroing.client.get_request("a").num_tokens == BLOCK + 2
    assert zeroing.client.get_request("b").num_tokens == BLOCK
    zeroing.finish()


def test_stop_on_error_stops_the_batch_and_the_step(zeroing: Twin) -> None:
    """Under stop_on_error the batch stops at its refused entry (counted in num_run),
    a later batch answers its own response with nothing run, and a later single
    operation CANCELLED; through the builder, each handle after the refusal reads
    NotRunError, and ``errors`` lists the refusal and every skipped handle."""
    zeroing.client.add_request("a", tokens(BLOCK))
    zeroing.client.add_request("b", tokens(BLOCK))
    before = zeroing.state()
    response = step(
        zeroing,
        appends(["a", "nope", "b"], [1, 2, 3]),
        pb.StepOperation(get_usage=pb.GetUsageRequest()),
        allocations(["a", "b"], [1, 1]),
        stop_on_error=True,
    )
    first, usage, later = response.results
    assert (first.append_tokens_batch.num_run, first.append_tokens_batch.num_requests) == (2, 3)
    assert usage.error.code == grpc.StatusCode.CANCELLED.value[0]
    assert later.WhichOneof("result") == "allocate_slots_batch"
    assert (later.allocate_slots_batch.num_run, later.allocate_slots_batch.num_requests) == (0, 2)
    assert zeroing.state() != before  # a's append ran
    assert zeroing.client.get_request("b").num_tokens == BLOCK

    builder = StepBuilder()
    handles = [builder.append_tokens(r, [1]) for r in ("a", "nope", "b")]
    skipped = builder.get_usage()
    results = zeroing.client.step(builder, stop_on_error=True)
    assert results.error(handles[0]) is None
    assert isinstance(results.error(handles[1]), RequestNotFoundError)
    assert isinstance(results.error(handles[2]), NotRunError)
    assert isinstance(results.error(skipped), NotRunError)
    assert sorted(results.errors) == [1, 2, 3]
    assert not results.ok and len(results) == 4
    zeroing.finish()


def test_each_entry_counts_against_the_step_limit() -> None:
    """max_step_ops 2: a one-operation step whose batch holds 3 entries is refused
    whole (INVALID_ARGUMENT, nothing run), as three single operations would be."""
    config = dataclasses.replace(ZEROING_POOL, max_step_ops=2)
    with twin(config) as server:
        server.client.add_request("a", tokens(BLOCK))
        before = server.state()
        with pytest.raises(grpc.RpcError) as info:
            step(server, appends(["a", "a", "a"], [1, 2, 3]))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "has 3 operations" in (info.value.details() or "")
        assert server.state() == before
        assert len(step(server, appends(["a", "a"], [1, 2])).results) == 1
        server.finish()


@pytest.mark.parametrize("runtime", ["none", "torch"])
def test_copies_and_zeroing_columns_match_single_answers(runtime: str) -> None:
    """A partial-block hit on the hybrid pool, then its owner decoding on: every
    allocation's blocks, blocks to zero (or zeroed by the co-located runtime) and
    copy-on-write copies read the same coalesced as alone, the columnar rows
    included."""
    config = dataclasses.replace(HYBRID_POOL, runtime=runtime, device="cpu")
    with twin(config) as coalesced, twin(config) as plain:
        answers: list[list[Any]] = []
        for server, coalesce in ((coalesced, True), (plain, False)):
            client = server.client
            # req0's first chunk ends on its prompt's last reusable boundary (a partial
            # entry, as vLLM 0.33 registers num_prompt_tokens - 1 rounded down).
            client.add_request("req0", [11, 12, 13, 14, 19])
            assert client.allocate_slots("req0", 4, client.get_computed_blocks("req0"))
            client.add_request("req1", [11, 12, 13, 14, 15, 16, 17, 18])
            hit = client.get_computed_blocks("req1")
            assert hit.num_computed_tokens == 4
            builder = StepBuilder(coalesce=coalesce)
            handles: list[OpHandle[Any]] = [
                builder.allocate_slots("req1", 4, hit),
                builder.append_tokens("req0", [15]),
                builder.allocate_slots("req0", 1),
                builder.allocate_slots("req1", 1),
                builder.append_tokens("req0", [16]),
                builder.allocate_slots("req0", 5),
            ]
            results = client.step(builder)
            answers.append([results[h] for h in handles])
        assert answers[0] == answers[1]
        assert coalesced.state() == plain.state()
        # req0's plain allocation (a columnar entry when coalesced) moves the partial
        # Mamba entry it owns to a private copy: the copy columns carry it.
        owner = answers[0][2]
        assert isinstance(owner, Allocation)
        # The zeroing columns carry the attention blocks of the columnar entries (a
        # Mamba state is never zeroed, as in vLLM).
        rows = [answers[0][i] for i in (2, 3, 5)]
        if runtime == "none":
            assert owner.block_copies_to_apply and not owner.block_ids_to_zero
            assert any(row.block_ids_to_zero for row in rows)
        else:
            assert owner.block_copies_applied and not owner.block_ids_zeroed
            assert any(row.block_ids_zeroed for row in rows)
        coalesced.finish()
        plain.finish()


def test_a_session_stream_carries_columnar_operations(zeroing: Twin) -> None:
    """The same decode step over StepStream (a session) as over Step: columnar on the
    wire, each handle reading its own allocation and request state."""
    client = zeroing.client
    for rid in "ab":
        client.add_request(rid, tokens(BLOCK))
        assert client.allocate_slots(rid, BLOCK) is not None
    session = client.session()
    try:
        builder = StepBuilder()
        appended = [builder.append_tokens(rid, [9]) for rid in "ab"]
        allocated = [builder.allocate_slots(rid, 1) for rid in "ab"]
        assert len(builder.to_pb().ops) == 2
        results = session.step(builder)
    finally:
        session.close()
    for rid, handle in zip("ab", appended, strict=True):
        state = results[handle]
        assert (state.request_id, state.num_tokens) == (rid, BLOCK + 1)
    blocks = [results[handle] for handle in allocated]
    assert all(a is not None and len(a.new_block_ids[0]) == 1 for a in blocks)
    assert [a.block_ids_to_zero for a in blocks if a] == [a.new_block_ids[0] for a in blocks if a]
    assert results.ok and len(results) == 4
    zeroing.finish()


@pytest.mark.parametrize("coalesce", [True, False])
def test_a_value_the_message_refuses_leaves_the_builder_as_it_was(coalesce: bool) -> None:
    """A token or count past int64 raises when added, coalescing or not, and the
    builder sends exactly what it held before (no half-added entry, no empty batch)."""
    builder = StepBuilder(coalesce=coalesce)
    builder.append_tokens("a", [1])
    before = builder.to_pb().SerializeToString()
    with pytest.raises(ValueError):
        builder.append_tokens("b", [2**70])
    with pytest.raises(ValueError):
        builder.allocate_slots("b", 2**70)
    assert builder.to_pb().SerializeToString() == before
    assert len(builder) == 1
    builder.allocate_slots("a", 1)
    assert len(builder) == 2 and len(builder.to_pb().ops) == 2


def test_a_run_joined_mid_batch_is_checked_on_its_own_rows(zeroing: Twin) -> None:
    """Two plain-allocation runs share one AllocateSlotsBatch: the second's columns
    start after the first's blocks and no-room row, and each run matches its own
    answers only."""
    for rid in "abc":
        zeroing.client.add_request(rid, tokens(BLOCK))
    builder = StepBuilder(omit_request_state=True)
    first = builder.allocate_slots_batch(["a", "b"], [3 * BLOCK, 8 * BLOCK])
    second = builder.allocate_slots_batch(["c"], [2 * BLOCK])
    assert (first.wire, second.wire, second.row) == (0, 0, 2)
    results = zeroing.client.step(builder)
    a, b = results.rows(first)
    (c,) = results.rows(second)
    assert a is not None and b is None and c is not None
    assert results.allocations_match(first, [a.new_block_ids, None])
    assert results.allocations_match(second, [c.new_block_ids])
    assert not results.allocations_match(second, [a.new_block_ids])
    assert not results.allocations_match(first, [a.new_block_ids, c.new_block_ids])
    zeroing.finish()


def test_rows_that_all_fitted_are_checked_block_by_block(zeroing: Twin) -> None:
    """Where no row answered no room, the columns are compared flattened: the same
    counts with other ids, ids moved between rows, or another number of groups do not
    match."""
    for rid in "abc":
        zeroing.client.add_request(rid, tokens(BLOCK))
    builder = StepBuilder(omit_request_state=True)
    run = builder.allocate_slots_batch(["a", "b", "c"], [2 * BLOCK, BLOCK, 1])
    results = zeroing.client.step(builder)
    rows = results.rows(run)
    assert all(row is not None for row in rows)
    (a,), (b,), (c,) = [row.new_block_ids for row in rows if row is not None]
    assert (len(a), len(b), len(c)) == (2, 1, 1)
    assert results.allocations_match(run, [(a,), (b,), (c,)])
    assert not results.allocations_match(run, [((a[1], a[0]),), (b,), (c,)])
    assert not results.allocations_match(run, [((a[0], b[0]),), ((a[1],),), (c,)])
    assert not results.allocations_match(run, [(a[:1],), (a[1:] + b,), (c,)])
    assert not results.allocations_match(run, [(a, ()), (b, ()), (c, ())])
    assert not results.allocations_match(run, [(a,), (c,), (b,)])
    zeroing.finish()


# -- the admissions and frees of a scheduler step (LookupAllocateBatch, FreeBatch) ----


def entry_handles(run: RunHandle[Any]) -> list[OpHandle[Any]]:
    """A handle per entry of ``run``, reading each entry alone."""
    return [
        OpHandle(run.index + i, lambda value: value, run.wire, run.row + i)
        for i in range(run.num_entries)
    ]


def single_step(twin: Twin, add: Any, omit: bool) -> tuple[Any, ...]:
    """``add(builder)``'s one operation sent as a step of its own: its outcome."""
    builder = StepBuilder(omit_request_state=omit, coalesce=False)
    handle = add(builder)
    return outcome(twin.client.step(builder), handle)


def lookup_then_allocate(
    twin: Twin, request_id: str, num: int, omit: bool, options: AllocateOptions | None = None
) -> tuple[Any, ...]:
    """What a scheduler does for a waiting request, one step each: the lookup, then
    the allocation that attaches the hit it answered; (the hit, the allocation)."""
    looked = single_step(twin, lambda b: b.get_computed_blocks(request_id), omit)
    if looked[0] != "ok":
        return looked
    hit = looked[1]
    allocated = single_step(twin, lambda b: b.allocate_slots(request_id, num, hit, options), omit)
    if allocated[0] != "ok":
        return allocated
    return ("ok", (hit, allocated[1]))


def warm_up(twin: Twin, plan: list[Op]) -> None:
    """Add ``plan``'s requests, admit each whole and finish it: their full blocks stay
    cached, for the same prompts added again to hit."""
    send(twin, plan, False, omit=True, stop_on_error=False)
    for _, rid, prompt in plan:
        lookup_then_allocate(twin, rid, len(PROMPTS[prompt]), True)
        single_step(twin, lambda b, rid=rid: b.free(rid, FreeMode.FINISH), True)


admissions = st.lists(
    st.tuples(ids, st.sampled_from((1, BLOCK, 2 * BLOCK + 3, 3 * BLOCK, 8 * BLOCK, 0, -2))),
    min_size=1,
    max_size=6,
)


# vLLM's admissions: its defaults, the full prompt reserved (its default
# scheduler_reserve_full_isl), the first admission of an idle scheduler, lookahead.
admission_options = st.sampled_from(
    (
        None,
        AllocateOptions(full_sequence_must_fit=True),
        AllocateOptions(full_sequence_must_fit=True, has_scheduled_reqs=False),
        AllocateOptions(num_lookahead_tokens=3, reserved_blocks=2),
        AllocateOptions(num_lookahead_tokens=-1),
    )
)


@fuzz_settings(30)
@given(
    first=prelude,
    entries=admissions,
    options=admission_options,
    warm=st.booleans(),
    omit=st.booleans(),
    stop_on_error=st.booleans(),
)
def test_an_admission_entry_answers_as_a_lookup_then_its_allocation(
    twins: tuple[Twin, Twin],
    first: list[Op],
    entries: list[tuple[str, int]],
    options: AllocateOptions | None,
    warm: bool,
    omit: bool,
    stop_on_error: bool,
) -> None:
    """``lookup_allocate_batch`` against the same admissions made the way a scheduler
    makes them one by one (a lookup, then the allocation attaching its answer): with
    prefix hits or without, on every pool, each entry reads the same (hit,
    allocation), NO_SPACE or error (the lookup's, as for a request already running,
    or the allocation's), entries after a refusal under stop_on_error read NotRunError,
    the columns check agrees with the rows, and the pools end identical. The
    batch's options reach every entry's allocation (bad ones refuse every entry)."""
    coalesced, plain = twins
    try:
        for server in twins:
            if warm:
                warm_up(server, first)
            send(server, first, False, omit=True, stop_on_error=False)
        builder = StepBuilder(omit_request_state=omit)
        request_ids, nums = [r for r, _ in entries], [n for _, n in entries]
        run = builder.lookup_allocate_batch(request_ids, nums, options)
        results = coalesced.client.step(builder, stop_on_error=stop_on_error)
        got = [outcome(results, handle) for handle in entry_handles(run)]
        want: list[tuple[Any, ...]] = []
        for rid, num in entries:
            want.append(lookup_then_allocate(plain, rid, num, omit, options))
            if stop_on_error and want[-1][0] != "ok":
                break
        assert got[: len(want)] == want
        assert all(read[1] is NotRunError for read in got[len(want) :])
        if all(read[0] == "ok" for read in got):
            hits = [hit for _, (hit, _) in got]
            answers = [None if a is None else a.new_block_ids for _, (_, a) in got]
            copies = any(a and a.block_copies_to_apply for _, (_, a) in got)
            assert results.lookups_allocations_match(run, hits, answers) is not copies
            assert_hits_checked(results, run, hits, answers)
        assert coalesced.state() == plain.state()
    finally:
        coalesced.finish()
        plain.finish()


def assert_hits_checked(
    results: StepResults,
    run: RunHandle[Any],
    hits: list[ComputedBlocks],
    answers: list[BlockIds | None],
) -> None:
    """``lookups_allocations_match`` (checked on the columns) sees any one entry's hit
    answered otherwise: its token count, its boundary, a block more, fewer, moved to
    another entry, or another number of groups."""
    for index, hit in enumerate(hits):
        groups = hit.block_ids
        others = [
            dataclasses.replace(hit, num_computed_tokens=hit.num_computed_tokens + 1),
            dataclasses.replace(hit, shared_prefix_boundary=hit.shared_prefix_boundary + 1),
            dataclasses.replace(hit, block_ids=((*groups[0], 10**6), *groups[1:])),
            dataclasses.replace(hit, block_ids=(*groups, ())),
        ]
        if groups[0]:
            others.append(dataclasses.replace(hit, block_ids=(groups[0][1:], *groups[1:])))
        for other in others:
            changed = [*hits[:index], other, *hits[index + 1 :]]
            assert not results.lookups_allocations_match(run, changed, answers)
    # A block moved from one entry's hit to the next one's: the same ids in order.
    for index in range(len(hits) - 1):
        here, there = hits[index].block_ids, hits[index + 1].block_ids
        if here[0]:
            moved = [
                *hits[:index],
                dataclasses.replace(hits[index], block_ids=(here[0][:-1], *here[1:])),
                dataclasses.replace(
                    hits[index + 1], block_ids=((here[0][-1], *there[0]), *there[1:])
                ),
                *hits[index + 2 :],
            ]
            assert not results.lookups_allocations_match(run, moved, answers)


frees = st.lists(st.tuples(ids, st.booleans(), st.booleans()), min_size=1, max_size=6)


@fuzz_settings(30)
@given(first=prelude, running=st.lists(ids, max_size=4), entries=frees, stop_on_error=st.booleans())
def test_a_free_entry_answers_as_a_single_free(
    twins: tuple[Twin, Twin],
    first: list[Op],
    running: list[str],
    entries: list[tuple[str, bool, bool]],
    stop_on_error: bool,
) -> None:
    """``free_batch`` against the same frees sent one operation each: finishing and
    preempting waiting, running and unknown requests, keeping their blocks or not
    (refused without a session), each entry reads None or the single free's error,
    and the pools end identical."""
    coalesced, plain = twins
    try:
        for server in twins:
            send(server, first, False, omit=True, stop_on_error=False)
            send(
                server,
                [("allocate", r, BLOCK) for r in running],
                False,
                omit=True,
                stop_on_error=False,
            )
        modes = [FreeMode.PREEMPT if preempt else FreeMode.FINISH for _, preempt, _ in entries]
        builder = StepBuilder()
        run = builder.free_batch([r for r, _, _ in entries], modes, [k for _, _, k in entries])
        single = StepBuilder(coalesce=False)
        handles = [
            single.free(r, mode, keep) for (r, _, keep), mode in zip(entries, modes, strict=True)
        ]
        got = coalesced.client.step(builder, stop_on_error=stop_on_error)
        want = plain.client.step(single, stop_on_error=stop_on_error)
        for mine, theirs in zip(entry_handles(run), handles, strict=True):
            read, expected = outcome(got, mine), outcome(want, theirs)
            assert read == (expected if expected[0] == "error" else ("ok", None))
        assert {i: e.message for i, e in got.errors.items()} == {
            i: e.message for i, e in want.errors.items()
        }
        assert coalesced.state() == plain.state()
    finally:
        coalesced.finish()
        plain.finish()


def frees_of(request_ids: list[str], modes: list[int], keep: list[bool]) -> pb.StepOperation:
    batch = pb.FreeBatch(request_ids=request_ids, keep_blocks=keep)
    batch.modes.extend(modes)  # type: ignore[arg-type]  # also values past the enum
    return pb.StepOperation(free_batch=batch)


def admissions_of(request_ids: list[str], num_new_tokens: list[int]) -> pb.StepOperation:
    batch = pb.LookupAllocateBatch(request_ids=request_ids, num_new_tokens=num_new_tokens)
    return pb.StepOperation(lookup_allocate_batch=batch)


@pytest.mark.parametrize(
    ("operation", "message"),
    [
        (frees_of([], [], []), "free_batch: request_ids must hold at least one request"),
        (frees_of(["a", "b"], [2], []), "modes has 1 values for 2 request_ids"),
        (frees_of(["a", "b"], [2, 2], [True]), "keep_blocks has 1 values for 2 request_ids"),
        (admissions_of(["a"], [1, 1]), "num_new_tokens has 2 values for 1 request_ids"),
        (admissions_of([], []), "lookup_allocate_batch: request_ids must hold at least one"),
    ],
)
def test_a_malformed_admission_or_free_batch_is_refused_whole(
    zeroing: Twin, operation: pb.StepOperation, message: str
) -> None:
    assert_refused_whole(zeroing, operation, message)


def test_an_admission_batch_answers_hits_and_blocks_in_columns(zeroing: Twin) -> None:
    """a's prompt cached, then b (a's prompt again) and c (another) admitted in one
    batch: b's lookup hits a's full blocks and its allocation attaches them, c misses;
    the columns hold b's hit, then each entry's new blocks, to zero under its own
    entry, and a third entry for a request already running is refused by its lookup."""
    prompt = tokens(2 * BLOCK + 3)
    zeroing.client.add_request("a", prompt)
    assert lookup_then_allocate(zeroing, "a", len(prompt), True)[0] == "ok"
    zeroing.client.free("a", FreeMode.FINISH)
    zeroing.client.add_request("b", prompt)
    zeroing.client.add_request("c", tokens(BLOCK, start=500))
    response = step(zeroing, admissions_of(["b", "c", "b"], [3, BLOCK, 1]))
    batch = response.results[0].lookup_allocate_batch
    assert (batch.num_requests, batch.num_run) == (3, 3)
    assert [(e.index, e.code) for e in batch.errors] == [(2, 9)]  # FAILED_PRECONDITION
    assert list(batch.num_computed_tokens) == [2 * BLOCK, 0, 0]
    assert list(batch.num_hit_blocks) == [2, 0, 0]
    columns = batch.allocations
    assert (columns.num_requests, columns.num_run, list(columns.errors)) == (3, 3, [])
    assert list(columns.num_new_blocks) == [1, 1, 0]
    assert list(columns.num_block_ids_to_zero) == [1, 1, 0]
    assert zeroing.client.get_request("b").num_computed_tokens == 2 * BLOCK + 3
    zeroing.finish()


def test_admissions_with_other_options_travel_in_a_batch_of_their_own() -> None:
    """Entries join the open batch only with its options; a connector's arguments or
    a computed-token count cannot travel in one (ValueError, the builder unchanged)."""
    builder = StepBuilder()
    reserve = AllocateOptions(full_sequence_must_fit=True)
    first = builder.lookup_allocate_batch(["a"], [4], reserve)
    second = builder.lookup_allocate_batch(["b"], [4], reserve)
    third = builder.lookup_allocate_batch(["c"], [4])
    assert (first.wire, second.wire, second.row, third.wire) == (0, 0, 1, 1)
    ops = builder.to_pb().ops
    assert ops[0].lookup_allocate_batch.full_sequence_must_fit
    assert not ops[1].lookup_allocate_batch.full_sequence_must_fit
    before = builder.to_pb().SerializeToString()
    for options in (
        AllocateOptions(num_external_computed_tokens=16),
        AllocateOptions(delay_cache_blocks=True),
        AllocateOptions(num_computed_tokens=3),
        AllocateOptions(num_in_flight_tokens=1),
    ):
        with pytest.raises(ValueError, match="allocate singly"):
            builder.lookup_allocate_batch(["d"], [4], options)
    assert builder.to_pb().SerializeToString() == before


# -- AddRequestBatch ----------------------------------------------------------------------

TRUSTING_POOL = dataclasses.replace(PLAIN_POOL, trust_client_block_hashes=True)
# An empty prompt and one past max_model_len are refused per entry.
ADD_PROMPTS: tuple[list[int], ...] = (*PROMPTS, [], tokens(PLAIN_POOL.max_model_len + 1))


@pytest.fixture(scope="module", params=[TRUSTING_POOL, ZEROING_POOL], ids=["trusting", "not"])
def add_twins(request: pytest.FixtureRequest) -> Iterator[tuple[Twin, Twin]]:
    """Two identical servers, trusting client hashes or not (every client_hashed
    request then refused)."""
    with twin(request.param) as coalesced, twin(request.param) as plain:
        yield coalesced, plain


def claimed_hashes(twin: Twin, prompt: list[int], kind: str | None) -> list[bytes] | None:
    """The hashes a client sends with ``prompt``: none (the server hashes), the
    server's own (all, or all but the last), or ones it refuses (a hash of another
    length, one more than the prompt's full blocks)."""
    if kind is None:
        return None
    hasher = twin.server.server.table.manager.block_hasher
    own = list(Request("probe", prompt, hasher).block_hashes) if prompt else []
    return {
        "own": own,
        "short": own[:-1],
        "bad": [b"x" * 3, *own][: max(1, len(own))],
        "many": [*own, b"h" * 32],
    }[kind]


def request_hashes(twin: Twin) -> dict[str, tuple[bytes, ...]]:
    table = twin.server.server.table
    return twin.server.call(
        lambda: {rid: tuple(r.block_hashes) for rid, r in table._requests.items()}
    )


new_requests = st.lists(
    st.tuples(
        st.sampled_from((*IDS, "")),
        st.integers(0, len(ADD_PROMPTS) - 1),
        st.sampled_from((None, None, "own", "short", "bad", "many")),
    ),
    min_size=1,
    max_size=6,
)


@fuzz_settings(30)
@given(first=prelude, entries=new_requests, stop_on_error=st.booleans())
def test_a_new_request_entry_answers_as_a_single_add_request(
    add_twins: tuple[Twin, Twin],
    first: list[Op],
    entries: list[tuple[str, int, str | None]],
    stop_on_error: bool,
) -> None:
    """``add_request_batch`` against the same requests sent as single AddRequests: new
    ids, ids already known or repeated in the batch, an empty id, empty and too long
    prompts, hashes the server takes or refuses (or every client_hashed one, on a
    server that does not trust them), under stop_on_error or not. Each entry reads
    None or the single AddRequest's error, with its message; the requests hold the
    same hashes and the pools end identical. An entry hashed otherwise than the one
    before it opens a batch of its own."""
    coalesced, plain = add_twins
    try:
        for server in add_twins:
            send(server, first, False, omit=True, stop_on_error=False)
        builder = StepBuilder()
        single = StepBuilder(coalesce=False)
        runs, handles = [], []
        for rid, prompt_index, hashes_kind in entries:
            prompt = ADD_PROMPTS[prompt_index]
            hashes = claimed_hashes(coalesced, prompt, hashes_kind)
            batch_hashes = None if hashes is None else [hashes]
            runs.append(builder.add_request_batch([rid], [prompt], batch_hashes))
            handles.append(single.add_request(rid, prompt, block_hashes=hashes))
        changes = sum((a[2] is None) != (b[2] is None) for a, b in itertools.pairwise(entries))
        assert len(builder.to_pb().ops) == changes + 1
        got = coalesced.client.step(builder, stop_on_error=stop_on_error)
        want = plain.client.step(single, stop_on_error=stop_on_error)
        for run, theirs in zip(runs, handles, strict=True):
            (mine,) = entry_handles(run)
            read, expected = outcome(got, mine), outcome(want, theirs)
            assert read == (expected if expected[0] == "error" else ("ok", None))
        assert {i: e.message for i, e in got.errors.items()} == {
            i: e.message for i, e in want.errors.items()
        }
        assert request_hashes(coalesced) == request_hashes(plain)
        assert coalesced.state() == plain.state()
    finally:
        coalesced.finish()
        plain.finish()


def new_requests_of(
    request_ids: list[str],
    packed: bytes,
    counts: list[int],
    hashes: Sequence[bytes] = (),
    num_hashes: Sequence[int] = (),
    client_hashed: bool = False,
) -> pb.StepOperation:
    batch = pb.AddRequestBatch(
        request_ids=request_ids,
        packed_prompt_token_ids=packed,
        num_prompt_tokens=counts,
        client_hashed=client_hashed,
        block_hashes=hashes,
        num_block_hashes=num_hashes,
    )
    return pb.StepOperation(add_request_batch=batch)


EIGHT = pack_token_ids(range(8))


@pytest.mark.parametrize(
    ("operation", "message"),
    [
        (new_requests_of([], b"", []), "add_request_batch: request_ids must hold at least one"),
        (new_requests_of(["x"], EIGHT, [4, 4]), "num_prompt_tokens has 2 values for 1"),
        (new_requests_of(["x"], EIGHT + b"1", [8]), "holds 33 bytes, not a multiple of 4"),
        (new_requests_of(["x", "y"], EIGHT, [4, 3]), "add up to the 8 packed prompt ids"),
        (new_requests_of(["x", "y"], EIGHT, [9, -1]), "must be counts >= 0"),
        (
            new_requests_of(["x"], EIGHT, [8], [b"h" * 32], [1]),
            "block_hashes and num_block_hashes are for a client_hashed batch only",
        ),
        (
            new_requests_of(["x", "y"], EIGHT, [4, 4], [b"h" * 32], [1], client_hashed=True),
            "num_block_hashes has 1 values for 2 request_ids",
        ),
        (
            new_requests_of(["x"], EIGHT, [8], [b"h" * 32], [2], client_hashed=True),
            "add up to the 1 hashes",
        ),
    ],
)
def test_a_malformed_new_request_batch_is_refused_whole(
    zeroing: Twin, operation: pb.StepOperation, message: str
) -> None:
    assert_refused_whole(zeroing, operation, message)


def test_a_new_request_batch_the_builder_cannot_pack_leaves_it_as_it_was() -> None:
    """An id outside 4 unsigned bytes, a hash that is not bytes or uneven columns:
    ValueError or TypeError, and the builder sends what it held before (here, an
    open batch the failed call would have joined)."""
    builder = StepBuilder()
    builder.add_request_batch(["a"], [[1, 2]])
    hashed = builder.add_request_batch(["b"], [[3]], [[]])
    before = builder.to_pb().SerializeToString()
    with pytest.raises(ValueError, match="prompt 1 of the batch holds a token id outside"):
        builder.add_request_batch(["c", "d"], [[1], [2**32]], [[], []])
    with pytest.raises(TypeError):
        builder.add_request_batch(["c"], [[1]], [["not bytes"]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1 request ids but 2 prompts"):
        builder.add_request_batch(["c"], [[1], [2]])
    assert builder.to_pb().SerializeToString() == before
    assert len(builder) == 2
    joined = builder.add_request_batch(["e"], [[4]], [[]])
    assert (joined.wire, joined.row) == (hashed.wire, hashed.row + 1)


# -- AppendTokensBatch with hashes ----------------------------------------------------------

hashed_appends = st.lists(
    st.tuples(
        st.sampled_from(("a", "b", "c", "unknown")),
        st.integers(0, 50),
        st.sampled_from((None, "one", "one", "bad", "two")),
    ),
    min_size=1,
    max_size=8,
)


@fuzz_settings(30)
@given(entries=hashed_appends, omit=st.booleans(), stop_on_error=st.booleans())
def test_a_hashed_append_entry_answers_as_a_single_append(
    add_twins: tuple[Twin, Twin],
    entries: list[tuple[str, int, str | None]],
    omit: bool,
    stop_on_error: bool,
) -> None:
    """``append_tokens_batch`` with hashes against the same appends sent one operation
    each: client_hashed requests one token short of a full block, each entry's token
    with no hash, the hash of the block it completes, one of another length, or one
    too many (the second append of a request completes no block). Each entry reads
    what its single append reads, the requests hold the same hashes and the pools end
    identical (on a server that does not trust hashes, no request was added)."""
    coalesced, plain = add_twins
    try:
        for server in add_twins:
            prelude_step = StepBuilder(coalesce=False)
            for index, rid in enumerate("abc"):
                prelude_step.add_request(rid, tokens(BLOCK - 1, start=100 * index), block_hashes=[])
            server.client.step(prelude_step)
        hasher = coalesced.server.server.table.manager.block_hasher
        size = len(Request("probe", tokens(BLOCK), hasher).block_hashes[0])
        hashes = [
            {None: [], "one": [bytes([t]) * size], "bad": [b"x"], "two": [bytes([t]) * size] * 2}[
                kind
            ]
            for _, t, kind in entries
        ]
        builder = StepBuilder(omit_request_state=omit)
        run = builder.append_tokens_batch(
            [r for r, _, _ in entries], [t for _, t, _ in entries], hashes
        )
        single = StepBuilder(omit_request_state=omit, coalesce=False)
        handles = [
            single.append_tokens(r, [t], h) for (r, t, _), h in zip(entries, hashes, strict=True)
        ]
        got = coalesced.client.step(builder, stop_on_error=stop_on_error)
        want = plain.client.step(single, stop_on_error=stop_on_error)
        for mine, theirs in zip(entry_handles(run), handles, strict=True):
            assert outcome(got, mine) == outcome(want, theirs)
        assert request_hashes(coalesced) == request_hashes(plain)
        assert coalesced.state() == plain.state()
    finally:
        coalesced.finish()
        plain.finish()


@pytest.mark.parametrize(
    ("counts", "hashes", "message"),
    [
        ([1, 0, 0], [b"h" * 32], "num_block_hashes has 3 values for 2 request_ids (at most one"),
        ([1], [], "num_block_hashes must be counts >= 0 that add up to the 0 hashes sent"),
        ([], [b"h" * 32], "add up to the 1 hashes sent, got []"),
        ([-1, 1], [], "must be counts >= 0"),
    ],
)
def test_an_append_batch_whose_hash_counts_do_not_cut_its_hashes_is_refused_whole(
    zeroing: Twin, counts: list[int], hashes: list[bytes], message: str
) -> None:
    operation = appends(["a", "b"], [1, 2])
    operation.append_tokens_batch.num_block_hashes.extend(counts)
    operation.append_tokens_batch.block_hashes.extend(hashes)
    assert_refused_whole(zeroing, operation, message)


def test_the_server_keeps_a_packed_prompt_packed() -> None:
    """A prompt that came packed, alone or in an AddRequestBatch, is held as 4-byte ids
    (no Python int per id); an appended id past 32 bits (the append's field is int64)
    turns that request's ids into ints, losing none, and hashes go on as before."""
    with twin(PLAIN_POOL) as pair:
        prompt = tokens(2 * BLOCK + 3)
        builder = StepBuilder()
        builder.add_request("single", prompt)
        builder.add_request_batch(["batched", "other"], [prompt, prompt[:5]])
        pair.client.step(builder)

        def held() -> dict[str, tuple[str, int, list[int], int]]:
            return {
                rid: (
                    type(r.all_token_ids).__name__,
                    getattr(r.all_token_ids, "itemsize", 0),
                    list(r.all_token_ids),
                    len(r.block_hashes),
                )
                for rid, r in pair.server.server.table._requests.items()  # test-only peek
            }

        hashed = len(prompt) // BLOCK
        assert pair.server.call(held) == {
            "single": ("array", 4, prompt, hashed),
            "batched": ("array", 4, prompt, hashed),
            "other": ("array", 4, prompt[:5], 0),
        }
        for rid in ("single", "batched"):
            pair.client.allocate_slots(rid, len(prompt))
        pair.client.append_tokens("single", [2**40])
        pair.client.append_tokens("batched", [7])
        grown = pair.server.call(held)
        assert grown["single"] == ("list", 0, [*prompt, 2**40], hashed)
        assert grown["batched"] == ("array", 4, [*prompt, 7], hashed)
        pair.client.append_tokens("single", [1] * (BLOCK - 4))
        pair.client.append_tokens("batched", [1] * (BLOCK - 4))
        assert pair.server.call(held)["single"][3] == hashed + 1
        pair.finish()

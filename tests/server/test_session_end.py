"""A session's end is an operation of the table's turn, and nothing outlives it.

A large Step pauses holding the table's turn (``turns``). A session may end meanwhile
(its other StepStream breaks): the end then frees what the session owns once the Step
gives the turn back, and the Step, re-checking its session after each pause, stops
(its later operations answer FAILED_PRECONDITION). Nothing the session owned is left
ownerless, the blocks and copy holds that Step took included; the audit reports any
request or copy hold whose session has ended.

The pause is made deterministic: every operation is a slice (``SLICE_S`` 0), and the
Step is held at one pause until the test has broken the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, FreeMode, NewRequest
from kvservice.server import turns
from kvservice.server.app import KVCacheServer
from tests.server.support import HYBRID_POOL, SMALL_POOL, ids, tokens, usage
from tests.server.test_partial_hits_remote import CHUNK, PROMPT
from tests.server.test_sessions import metric, open_session, session_md
from tests.servers import Stub, raw_stub, running_server

PLAIN = dataclasses.replace(SMALL_POOL, num_blocks=201, audit_interval_s=0)
HYBRID = dataclasses.replace(HYBRID_POOL, num_blocks=201, audit_interval_s=0)
NUM_REQUESTS = 40
# The pause (counted from 1) at which the Step is held while the stream breaks.
HELD_AT = 10
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
WAIT_TIMEOUT_S = 30.0


class PauseGate:
    """Holds a Step at its ``at``-th pause until ``resume`` is set."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.count = 0
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()


@pytest.fixture
def gate() -> PauseGate:
    return PauseGate(HELD_AT)


def hold(monkeypatch: pytest.MonkeyPatch, gate: PauseGate) -> None:
    """From now on every operation is a slice, and the ``gate.at``-th pause is held
    (installed once the test's setup has run its own steps)."""
    original = turns.Slices.pause

    async def pause(slices: turns.Slices) -> None:
        gate.count += 1
        if gate.count == gate.at:
            gate.paused.set()
            await gate.resume.wait()
        await original(slices)

    monkeypatch.setattr(turns, "SLICE_S", 0.0)
    monkeypatch.setattr(turns.Slices, "pause", pause)


async def wait_until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_TIMEOUT_S
    while not await condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.fixture
async def plain() -> AsyncIterator[KVCacheServer]:
    async with running_server(PLAIN) as server:
        yield server


@pytest.fixture
async def hybrid() -> AsyncIterator[KVCacheServer]:
    async with running_server(HYBRID) as server:
        yield server


async def open_stream(stub: Stub, session_id: str) -> grpc.aio.StreamStreamCall:
    """A StepStream under the session, known to the server (one step answered)."""
    call = stub.StepStream(metadata=session_md(session_id))
    step = pb.StepRequest(ops=[pb.StepOperation(new_step_starts=pb.NewStepStartsRequest())])
    await call.write(pb.StepStreamRequest(step=step))
    await call.read()
    return call


async def break_stream_while_held(
    stub: Stub,
    gate: PauseGate,
    session_id: str,
    call: grpc.aio.StreamStreamCall,
    step: pb.StepRequest,
) -> pb.StepResponse:
    """Run ``step`` unary under the session; at the held pause cancel the session's
    stream, wait for the server to end the session, then let the Step go on."""
    running = asyncio.ensure_future(stub.Step(step, metadata=session_md(session_id)))
    await asyncio.wait_for(gate.paused.wait(), WAIT_TIMEOUT_S)
    call.cancel()

    async def ended() -> bool:
        # KeepAlive does not take the table's turn: it answers while the Step holds it.
        try:
            await stub.KeepAlive(pb.KeepAliveRequest(session_id=session_id))
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
            return True
        return False

    await wait_until(ended, "the broken stream to end the session")
    assert not running.done()  # still held in its pause
    gate.resume.set()
    response: pb.StepResponse = await asyncio.wait_for(running, WAIT_TIMEOUT_S)
    return response


def split_results(response: pb.StepResponse) -> tuple[int, list[pb.StepResult]]:
    """(operations run before the session ended, the refused rest); every operation
    run succeeded, every later one answers FAILED_PRECONDITION naming the end."""
    results = list(response.results)
    run = 0
    while run < len(results) and not results[run].HasField("error"):
        run += 1
    refused = results[run:]
    for result in refused:
        assert result.error.code == _FAILED_PRECONDITION, result.error.message
        assert "has ended" in result.error.message, result.error.message
    return run, refused


def sharing(n: int) -> list[int]:
    """A prompt whose first chunk is the source's (a partial hit), then its own."""
    return [*PROMPT[:CHUNK], 100 + n, 101 + n, 102 + n, 103 + n]


async def audit_ok(stub: Stub) -> pb.AuditResponse:
    report: pb.AuditResponse = await stub.Audit(pb.AuditRequest())
    assert report.ok, list(report.violations)
    return report


async def test_a_paused_step_stops_when_its_session_breaks_and_leaves_nothing(
    plain: KVCacheServer, gate: PauseGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with raw_stub(plain) as stub:
        session = (await open_session(stub, ttl_s=600)).session_id
        call = await open_stream(stub, session)
        ops = []
        for n in range(NUM_REQUESTS):
            rid = f"r{n}"
            ops.append(
                pb.StepOperation(
                    add_request=pb.AddRequestRequest(request_id=rid, prompt_token_ids=tokens(16))
                )
            )
            ops.append(
                pb.StepOperation(
                    allocate_slots=pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=16)
                )
            )
        hold(monkeypatch, gate)
        response = await break_stream_while_held(
            stub, gate, session, call, pb.StepRequest(step_id=7, ops=ops)
        )
        run, refused = split_results(response)
        # Stopped at the held pause: what ran before stays run, the rest was refused.
        assert len(response.results) == len(ops)
        assert 0 < run < len(ops) and refused
        # The session's end freed everything it owned, what the Step added included.
        now = await usage(stub)
        assert (now.num_requests, now.num_used_blocks) == (0, 0)
        assert plain.sessions.num_sessions == 0
        assert plain.sessions.num_owned_requests == 0
        assert metric(plain, "kvservice_session_expirations_total", reason="stream_broken") == 1
        added = (run + 1) // 2
        assert metric(plain, "kvservice_requests_reclaimed_total") == added
        report = await audit_ok(stub)
        assert (report.num_held_blocks, report.num_requests) == (0, 0)


async def test_a_step_keeping_copy_holds_leaves_none_when_its_session_breaks(
    hybrid: KVCacheServer, gate: PauseGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mamba 'align' with hash blocks of 4: each allocation's partial hit keeps copy
    holds for the session; those the Step took go with the session too."""
    async with raw_stub(hybrid) as stub:
        session = (await open_session(stub, ttl_s=600)).session_id
        md = session_md(session)
        await stub.AddRequest(
            pb.AddRequestRequest(request_id="src", prompt_token_ids=PROMPT), metadata=md
        )
        await stub.GetComputedBlocks(pb.GetComputedBlocksRequest(request_id="src"), metadata=md)
        await stub.AllocateSlots(
            pb.AllocateSlotsRequest(request_id="src", num_new_tokens=CHUNK), metadata=md
        )
        # The hit every request sharing the source's first chunk gets.
        await stub.AddRequest(
            pb.AddRequestRequest(request_id="probe", prompt_token_ids=sharing(0)), metadata=md
        )
        hit = await stub.GetComputedBlocks(
            pb.GetComputedBlocksRequest(request_id="probe"), metadata=md
        )
        assert hit.num_computed_tokens == CHUNK
        hit_ids = [pb.BlockIds(block_ids=group) for group in ids(hit.block_ids)]
        ops = []
        for n in range(NUM_REQUESTS // 2):
            rid = f"h{n}"
            ops += [
                pb.StepOperation(
                    add_request=pb.AddRequestRequest(request_id=rid, prompt_token_ids=sharing(n))
                ),
                pb.StepOperation(get_computed_blocks=pb.GetComputedBlocksRequest(request_id=rid)),
                pb.StepOperation(
                    allocate_slots=pb.AllocateSlotsRequest(
                        request_id=rid,
                        num_new_tokens=CHUNK,
                        num_new_computed_tokens=CHUNK,
                        new_computed_block_ids=hit_ids,
                    )
                ),
            ]
        call = await open_stream(stub, session)
        hold(monkeypatch, gate)
        response = await break_stream_while_held(
            stub, gate, session, call, pb.StepRequest(ops=ops, keep_copy_holds=True)
        )
        run, refused = split_results(response)
        assert 0 < run < len(ops) and refused
        copies = [c for r in response.results[:run] for c in r.allocate_slots.block_copies_to_apply]
        assert copies  # the Step did keep holds before the session ended
        assert not hybrid.table.manager.retained_holds
        assert hybrid.table.copy_hold_owners() == {}
        now = await usage(stub)
        assert (now.num_requests, now.num_used_blocks) == (0, 0)
        assert hybrid.sessions.num_sessions == 0
        await audit_ok(stub)


async def test_a_unary_call_waiting_for_the_turn_rechecks_its_session(
    plain: KVCacheServer, gate: PauseGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AddRequest under a session that ends while it waits for the turn (behind a
    paused Step) is refused FAILED_PRECONDITION and adds nothing."""
    async with raw_stub(plain) as stub:
        session = (await open_session(stub, ttl_s=600)).session_id
        call = await open_stream(stub, session)
        ops = [
            pb.StepOperation(new_step_starts=pb.NewStepStartsRequest()) for _ in range(2 * HELD_AT)
        ]
        hold(monkeypatch, gate)
        # A sessionless Step holds the turn; the AddRequest queues behind it.
        stepping = asyncio.ensure_future(stub.Step(pb.StepRequest(ops=ops)))
        await asyncio.wait_for(gate.paused.wait(), WAIT_TIMEOUT_S)
        adding = asyncio.ensure_future(
            stub.AddRequest(
                pb.AddRequestRequest(request_id="late", prompt_token_ids=tokens(8)),
                metadata=session_md(session),
            )
        )
        await wait_until(lambda: _waiting_for_turn(plain), "the AddRequest to queue")
        call.cancel()

        async def ended() -> bool:
            return plain.sessions.num_sessions == 0 or not _live(plain, session)

        await wait_until(ended, "the broken stream to end the session")
        gate.resume.set()
        await stepping
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await adding
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        now = await usage(stub)
        assert (now.num_requests, now.num_used_blocks) == (0, 0)
        await audit_ok(stub)


async def _waiting_for_turn(server: KVCacheServer) -> bool:
    """Whether a call waits for the table's turn (test-only peek at the lock)."""
    return bool(server.turn._lock._waiters)


def _live(server: KVCacheServer, session_id: str) -> bool:
    try:
        server.sessions.check_live(session_id, DEFAULT_TENANT)
    except Exception:
        return False
    return True


class TestAuditOwnership:
    async def test_a_request_of_an_ended_session_is_reported(self, plain: KVCacheServer) -> None:
        """A request added under a session that no longer exists, holding blocks: the
        audit names it and its blocks (the state the old broken-stream path left)."""
        async with raw_stub(plain) as stub:
            session = (await open_session(stub, ttl_s=600)).session_id
            await stub.CloseSession(pb.CloseSessionRequest(session_id=session, free_requests=True))
            # Test-only: a request added under the ended session, bypassing the RPCs.
            plain.table.add_request(NewRequest("orphan", tokens(32)), DEFAULT_TENANT, session)
            plain.table.allocate_slots("orphan", AllocateArgs(num_new_tokens=32), DEFAULT_TENANT)
            report = await stub.Audit(pb.AuditRequest())
            assert not report.ok
            assert any(
                "'orphan'" in v and "ended" in v and "2 blocks" in v for v in report.violations
            ), list(report.violations)
            plain.table.free("orphan", FreeMode.FINISH, DEFAULT_TENANT)
            await audit_ok(stub)

    async def test_copy_holds_of_an_ended_session_are_reported(self, hybrid: KVCacheServer) -> None:
        async with raw_stub(hybrid) as stub:
            await stub.AddRequest(pb.AddRequestRequest(request_id="src", prompt_token_ids=PROMPT))
            await stub.GetComputedBlocks(pb.GetComputedBlocksRequest(request_id="src"))
            await stub.AllocateSlots(
                pb.AllocateSlotsRequest(request_id="src", num_new_tokens=CHUNK)
            )
            table = hybrid.table
            prompt = [*PROMPT[:CHUNK], 100, 101, 102, 103]
            table.add_request(NewRequest("h", prompt), DEFAULT_TENANT)
            hit = table.get_computed_blocks("h", DEFAULT_TENANT)
            # Test-only: holds kept for a session that does not exist.
            with table.batched((DEFAULT_TENANT, "gone")):
                table.allocate_slots(
                    "h", AllocateArgs(CHUNK, hit.num_computed_tokens, hit.block_ids), DEFAULT_TENANT
                )
            assert table.copy_hold_owners()
            report = await stub.Audit(pb.AuditRequest())
            assert not report.ok
            assert any("copy holds" in v and "'gone'" in v for v in report.violations), list(
                report.violations
            )
            table.release_copy_holds(DEFAULT_TENANT, "gone")
            await audit_ok(stub)


class TestDeferredTurnWork:
    async def test_runs_at_once_when_the_table_is_free(self) -> None:
        turn = turns.TableTurn()
        done: list[str] = []
        turn.defer(lambda: done.append("now"))
        assert done == ["now"]

    async def test_runs_as_the_turn_is_given_back_before_any_waiter(self) -> None:
        turn = turns.TableTurn()
        done: list[str] = []
        async with turn:
            waiter = asyncio.ensure_future(turn.run(lambda: done.append("waiter")))
            await asyncio.sleep(0)
            turn.defer(lambda: done.append("deferred"))
            turn.defer(lambda: 1 / 0)  # logged; the others still run
            turn.defer(lambda: done.append("second"))
            assert done == []
        await waiter
        assert done == ["deferred", "second", "waiter"]

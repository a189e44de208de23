"""No single call holds the event loop for more than a slice, and what a client can
make the server log stays bounded (issue 27, items 3 and 4).

* A unary ``Admit`` and a Step's ``Admit`` and columnar batches pause between their
  entries, holding the table's turn, and answer exactly what they answer run whole;
  a refused Admit still changes nothing.
* A session's end frees its requests a slice at a time, the turn held from the first
  free to the last: a call that touches the table waits and never sees it half done;
  calls that do not touch it go on.
* Refusals and session churn are logged within a budget (a summary line for the
  rest) and counted in the metrics; per-tenant gauges of sessions and streams.
* The garbage collector's full collections run in the table's turn, never inside a
  Step; the stall and GC watches measure what they say.

Pauses are made deterministic as in ``test_session_end``: every entry is a slice
(``SLICE_S`` 0), and a gate holds the work at one pause while the test looks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.core.errors import InvalidArgumentError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import NewRequest
from kvservice.server import log as server_log
from kvservice.server import loop_watch, turns
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig, build_kv_cache_config, build_manager
from kvservice.server.log import SUPPRESSED_EVENT, LineBudget
from kvservice.server.sessions import SessionPolicy, SessionRegistry
from kvservice.server.settings import load_settings
from kvservice.server.slice_clock import SliceClock
from tests.server.support import SMALL_POOL, tokens
from tests.server.test_sessions import metric, open_session, session_md
from tests.server.test_tenants import TOKENS, auth, write_tokens_file
from tests.servers import Stub, raw_stub, running_server

POOL = dataclasses.replace(
    SMALL_POOL, num_blocks=301, max_model_len=256, audit_interval_s=0, max_step_ops=4096
)
WAIT_TIMEOUT_S = 30.0


class Gate:
    """Counts pauses; holds the ``at``-th until ``resume`` is set (0: holds none)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.count = 0
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Every entry a slice from now on, each pause counted (none held until a test
    sets ``gate.at``)."""
    gate = Gate()
    original = turns.Slices.pause

    async def pause(slices: turns.Slices) -> None:
        gate.count += 1
        if gate.count == gate.at:
            gate.paused.set()
            await gate.resume.wait()
        await original(slices)

    monkeypatch.setattr(turns, "SLICE_S", 0.0)
    monkeypatch.setattr(turns.Slices, "pause", pause)
    return gate


@pytest.fixture
async def server() -> AsyncIterator[KVCacheServer]:
    async with running_server(POOL) as server:
        yield server


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_TIMEOUT_S
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def add_many(
    stub: Stub, ids: list[str], lengths: list[int], md: tuple[tuple[str, str], ...] = ()
) -> None:
    ops = [
        pb.StepOperation(
            add_request=pb.AddRequestRequest(request_id=rid, prompt_token_ids=tokens(n, i))
        )
        for i, (rid, n) in enumerate(zip(ids, lengths, strict=True))
    ]
    response = await stub.Step(pb.StepRequest(ops=ops), metadata=md)
    assert not [r for r in response.results if r.HasField("error")]


async def health_answers(server: KVCacheServer) -> None:
    """grpc.health.v1 answers (it never touches the table)."""
    async with grpc.aio.insecure_channel(server.handle.target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def held_meanwhile(
    server: KVCacheServer, stub: Stub, gate: Gate, call: Awaitable[Any]
) -> tuple[Any, pb.GetUsageResponse]:
    """Run ``call`` until the gate holds it at a pause; meanwhile a health check
    answers and a GetUsage (a table call) waits for the turn. Then let it go on: the
    usage answered after it, never during."""
    running = asyncio.ensure_future(call)
    await asyncio.wait_for(gate.paused.wait(), WAIT_TIMEOUT_S)
    assert server.turn.taken
    await health_answers(server)
    usage = asyncio.ensure_future(stub.GetUsage(pb.GetUsageRequest()))
    await asyncio.sleep(0.05)  # any time at all: it cannot run while the turn is held
    assert not usage.done() and not running.done()
    gate.resume.set()
    result = await asyncio.wait_for(running, WAIT_TIMEOUT_S)
    return result, await asyncio.wait_for(usage, WAIT_TIMEOUT_S)


# -- Admit ------------------------------------------------------------------------------


ADMIT_IDS = [f"r{i}" for i in range(100)]
ADMIT_LENGTHS = [8 + (i * 7) % 40 for i in range(100)]


async def admit_on_fresh_server(
    request: pb.AdmitRequest, whole: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[pb.AdmitResponse | str, pb.GetUsageResponse, int]:
    """(the Admit's answer or its refusal, the usage after it, pauses taken) on a
    new server holding the same 100 waiting requests."""
    pauses = 0
    original = turns.Slices.pause

    async def counted(slices: turns.Slices) -> None:
        nonlocal pauses
        pauses += 1
        await original(slices)

    async with running_server(POOL) as server, raw_stub(server) as stub:
        await add_many(stub, ADMIT_IDS, ADMIT_LENGTHS)
        with monkeypatch.context() as patch:
            patch.setattr(turns, "SLICE_S", 1e9 if whole else 0.0)
            patch.setattr(turns.Slices, "pause", counted)
            try:
                answer: pb.AdmitResponse | str = await stub.Admit(request)
            except grpc.aio.AioRpcError as err:
                answer = f"{err.code().name}: {err.details()}"
        usage = await stub.GetUsage(pb.GetUsageRequest())
        report = await stub.Audit(pb.AuditRequest())
        assert report.ok, list(report.violations)
    return answer, usage, pauses


@pytest.mark.parametrize(
    "request_",
    [
        # The pool runs out part-way through a chunk.
        pb.AdmitRequest(request_ids=ADMIT_IDS, token_budget=10**6, enable_chunked_prefill=True),
        # The budget is spent exactly at a chunk's end (32 requests).
        pb.AdmitRequest(
            request_ids=ADMIT_IDS,
            token_budget=sum(ADMIT_LENGTHS[:32]),
            enable_chunked_prefill=True,
        ),
        # Chunked prefill off: a request past the budget left stops it.
        pb.AdmitRequest(request_ids=ADMIT_IDS, token_budget=sum(ADMIT_LENGTHS[:40]) + 3),
        # Refused, all or nothing: an unknown id, a repeated one, past the first chunk.
        pb.AdmitRequest(request_ids=[*ADMIT_IDS[:90], "nope"], token_budget=10**6),
        pb.AdmitRequest(request_ids=[*ADMIT_IDS[:70], "r3"], token_budget=10**6),
    ],
    ids=["no-space", "budget-at-chunk-end", "needs-chunking", "unknown-id", "repeated-id"],
)
async def test_a_sliced_admit_answers_what_a_whole_one_does(
    request_: pb.AdmitRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, whole_usage, _ = await admit_on_fresh_server(request_, True, monkeypatch)
    sliced, sliced_usage, pauses = await admit_on_fresh_server(request_, False, monkeypatch)
    assert sliced == whole
    assert sliced_usage == whole_usage
    if isinstance(sliced, str):  # refused: nothing ran, nothing paused
        assert pauses == 0
        assert sliced_usage.num_used_blocks == 0
    else:
        assert pauses >= len(sliced.admitted) // 32 >= 1
        assert sliced.admitted


async def test_a_long_admit_lets_other_calls_through_and_table_calls_wait(
    server: KVCacheServer, gate: Gate
) -> None:
    async with raw_stub(server) as stub:
        await add_many(stub, ADMIT_IDS, [8] * 100)
        gate.at = gate.count + 2
        admitted, usage = await held_meanwhile(
            server,
            stub,
            gate,
            stub.Admit(pb.AdmitRequest(request_ids=ADMIT_IDS, token_budget=10**6)),
        )
        assert len(admitted.admitted) == 100
        # The usage ran after the whole Admit, not between two of its chunks.
        assert usage.num_used_blocks == 100


async def test_a_step_admit_and_batches_pause_between_entries(
    server: KVCacheServer, gate: Gate
) -> None:
    async with raw_stub(server) as stub:
        ids = [f"b{i}" for i in range(80)]
        await add_many(stub, ids, [8] * 80)
        before = gate.count
        step = pb.StepRequest(
            ops=[
                pb.StepOperation(admit=pb.AdmitRequest(request_ids=ids[:40], token_budget=10**6)),
                pb.StepOperation(
                    allocate_slots_batch=pb.AllocateSlotsBatch(
                        request_ids=[*ids[40:], "missing"], num_new_tokens=[8] * 41
                    )
                ),
                pb.StepOperation(
                    append_tokens_batch=pb.AppendTokensBatch(
                        request_ids=ids[:40], token_ids=[1] * 40
                    )
                ),
            ]
        )
        response = await stub.Step(step)
        admit, batch, appends = response.results
        assert len(admit.admit.admitted) == 40
        assert batch.allocate_slots_batch.num_run == 41
        assert [e.index for e in batch.allocate_slots_batch.errors] == [40]
        assert appends.append_tokens_batch.num_run == 40
        # Every chunk of the Admit and every entry of the batches was a slice.
        assert gate.count - before >= 40 // 32 + 41 + 40
        report = await stub.Audit(pb.AuditRequest())
        assert report.ok, list(report.violations)


# -- session ends ---------------------------------------------------------------------


async def test_closing_a_large_session_frees_it_in_slices_and_nobody_sees_it_half_done(
    server: KVCacheServer, gate: Gate
) -> None:
    async with raw_stub(server) as stub:
        session = (await open_session(stub, ttl_s=600)).session_id
        ids = [f"s{i}" for i in range(60)]
        await add_many(stub, ids, [8] * 60, session_md(session))
        await stub.Admit(pb.AdmitRequest(request_ids=ids, token_budget=10**6))
        gate.at = gate.count + 10
        closed, usage = await held_meanwhile(
            server,
            stub,
            gate,
            stub.CloseSession(pb.CloseSessionRequest(session_id=session, free_requests=True)),
        )
        assert closed.num_requests_freed == 60
        assert (usage.num_requests, usage.num_used_blocks) == (0, 0)
        assert server.sessions.num_sessions == 0
        assert metric(server, "kvservice_sessions_closed_total", reason="client") == 1
        report = await stub.Audit(pb.AuditRequest())
        assert report.ok, list(report.violations)


async def test_a_broken_stream_ends_a_large_session_in_slices_holding_the_turn(
    server: KVCacheServer, gate: Gate
) -> None:
    """The table is free when the stream breaks: the end's first slice runs at once,
    the rest in a task that keeps the turn until the last free."""
    async with raw_stub(server) as stub:
        session = (await open_session(stub, ttl_s=600)).session_id
        ids = [f"t{i}" for i in range(60)]
        await add_many(stub, ids, [8] * 60, session_md(session))
        await stub.Admit(pb.AdmitRequest(request_ids=ids, token_budget=10**6))
        call = stub.StepStream(metadata=session_md(session))
        await call.write(
            pb.StepStreamRequest(
                step=pb.StepRequest(
                    ops=[pb.StepOperation(new_step_starts=pb.NewStepStartsRequest())]
                )
            )
        )
        await call.read()
        gate.at = gate.count + 5
        call.cancel()
        await asyncio.wait_for(gate.paused.wait(), WAIT_TIMEOUT_S)
        assert server.turn.taken
        await health_answers(server)
        # The session refuses calls from its end's first moment...
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.KeepAlive(pb.KeepAliveRequest(session_id=session))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # ...and is still counted as ending (its requests have an owner that frees them).
        assert server.sessions.num_sessions == 1
        usage = asyncio.ensure_future(stub.GetUsage(pb.GetUsageRequest()))
        audit = asyncio.ensure_future(stub.Audit(pb.AuditRequest()))
        await asyncio.sleep(0.05)
        assert not usage.done() and not audit.done()
        gate.resume.set()
        now = await asyncio.wait_for(usage, WAIT_TIMEOUT_S)
        assert (now.num_requests, now.num_used_blocks) == (0, 0)
        report = await asyncio.wait_for(audit, WAIT_TIMEOUT_S)
        assert report.ok, list(report.violations)
        await wait_until(lambda: server.sessions.num_sessions == 0, "the session to go")
        assert metric(server, "kvservice_sessions_closed_total", reason="stream_broken") == 1
        assert metric(server, "kvservice_requests_reclaimed_total") == 60


def test_an_ended_session_with_no_end_in_progress_is_reported() -> None:
    """What the audit allows an ending session (its end frees what it owns), it does
    not allow one ended with nothing on the way to free it."""
    table = RequestTable(build_manager(SMALL_POOL))
    registry = SessionRegistry(table, SessionPolicy())
    session = registry.open(DEFAULT_TENANT, 10.0, "s", 0).session
    table.add_request(NewRequest("r", tokens(8)), DEFAULT_TENANT, session.session_id)
    session.ended = "test: ended with no SessionEnd"
    found = registry.violations()
    assert any("'r'" in v and "ended" in v for v in found), found


class TestTableTurn:
    class Work(turns.Resumable):
        """``slices_left`` more slices after the first (run at once)."""

        def __init__(self, slices_left: int, log: list[str]) -> None:
            self.left = slices_left
            self.log = log

        def __call__(self) -> turns.Resumable | None:
            self.log.append("first")
            return self if self.left else None

        def resume(self, slices: turns.Slices) -> bool:
            self.left -= 1
            self.log.append("slice")
            return self.left == 0

    async def test_resumable_work_keeps_the_turn_until_done(self) -> None:
        turn = turns.TableTurn()
        done: list[str] = []
        turn.defer(self.Work(3, done))
        assert done == ["first"] and turn.taken
        waiter = asyncio.ensure_future(turn.run(lambda: done.append("waiter")))
        await asyncio.wait_for(waiter, WAIT_TIMEOUT_S)
        assert done == ["first", "slice", "slice", "slice", "waiter"]
        assert not turn.taken
        await turn.drain()

    async def test_resumable_work_deferred_behind_a_holder_runs_before_waiters(self) -> None:
        turn = turns.TableTurn()
        done: list[str] = []
        async with turn:
            waiter = asyncio.ensure_future(turn.run(lambda: done.append("waiter")))
            await asyncio.sleep(0)
            turn.defer(self.Work(2, done))
            assert done == []
        await asyncio.wait_for(waiter, WAIT_TIMEOUT_S)
        assert done == ["first", "slice", "slice", "waiter"]

    def test_without_a_loop_the_work_runs_whole(self) -> None:
        turn = turns.TableTurn()
        done: list[str] = []
        turn.defer(self.Work(2, done))
        assert done == ["first", "slice", "slice"] and not turn.taken


# -- logs and metrics -------------------------------------------------------------------


class TestLineBudget:
    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    def test_the_first_lines_then_a_count(self) -> None:
        clock = self.Clock()
        budget = LineBudget(burst=3, interval_s=10.0, clock=clock)
        with structlog.testing.capture_logs() as logs:
            logger = structlog.get_logger("test")
            for i in range(10):
                budget.info(logger, "rpc refused", "NOT_FOUND", n=i)
            budget.info(logger, "rpc refused", "INTERNAL", n=99)  # a kind of its own
            clock.now = 10.0
            budget.info(logger, "rpc refused", "NOT_FOUND", n=10)
        events = [(e["event"], e.get("n"), e.get("num_suppressed")) for e in logs]
        assert events == [
            ("rpc refused", 0, None),
            ("rpc refused", 1, None),
            ("rpc refused", 2, None),
            ("rpc refused", 99, None),
            (SUPPRESSED_EVENT, None, 7),
            ("rpc refused", 10, None),
        ]
        assert logs[4]["of"] == "rpc refused" and logs[4]["key"] == "NOT_FOUND"
        assert budget.num_suppressed == 7

    async def test_the_count_is_written_when_the_interval_ends(self) -> None:
        budget = LineBudget(burst=1, interval_s=0.05)
        with structlog.testing.capture_logs() as logs:
            logger = structlog.get_logger("test")
            for _ in range(5):
                budget.info(logger, "session opened")
            await wait_until(
                lambda: any(e["event"] == SUPPRESSED_EVENT for e in logs), "the summary"
            )
        assert [e.get("num_suppressed") for e in logs] == [None, 4]


async def test_refusals_and_session_churn_are_logged_within_a_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_log, "LINES_PER_INTERVAL", 3)
    monkeypatch.setattr(server_log, "LINE_INTERVAL_S", 0.2)
    async with running_server(POOL) as server, raw_stub(server) as stub:
        with structlog.testing.capture_logs() as logs:
            for _ in range(20):
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.GetRequest(pb.GetRequestRequest(request_id="nope"))
            for _ in range(10):
                session = (await open_session(stub, ttl_s=600)).session_id
                await stub.CloseSession(pb.CloseSessionRequest(session_id=session))

            def summaries() -> dict[str, int]:
                return {
                    e["of"]: e["num_suppressed"] for e in logs if e["event"] == SUPPRESSED_EVENT
                }

            await wait_until(lambda: len(summaries()) == 3, "the three summaries")
        lines = [e["event"] for e in logs]
        assert lines.count("rpc refused") == 3
        assert lines.count("session opened") == 3
        assert lines.count("session closed") == 3
        assert summaries() == {"rpc refused": 17, "session opened": 7, "session closed": 7}
        # The metrics count every one.
        assert metric(server, "kvservice_sessions_opened_total") == 10
        assert metric(server, "kvservice_sessions_closed_total", reason="client") == 10
        assert metric(server, "kvservice_rpc_duration_seconds_count", method="GetRequest") == 20


async def test_per_tenant_session_and_stream_gauges(tmp_path: Path) -> None:
    tokens_file = write_tokens_file(
        tmp_path / "t.toml",
        {name: {"tokens": [TOKENS[name]]} for name in ("alpha", "beta")},
    )
    config = dataclasses.replace(POOL, auth_tokens_file=tokens_file)
    async with running_server(config) as server, raw_stub(server) as stub:

        def gauge(name: str, tenant: str) -> float | None:
            labels = {**server.metrics.labels, "tenant": tenant}
            value: float | None = server.metrics.registry.get_sample_value(name, labels)
            return value

        for _ in range(3):
            await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600), metadata=auth("alpha"))
        beta = await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600), metadata=auth("beta"))
        streams = [stub.StepStream(metadata=auth("beta")) for _ in range(2)]
        step = pb.StepRequest(ops=[pb.StepOperation(new_step_starts=pb.NewStepStartsRequest())])
        for call in streams:
            await call.write(pb.StepStreamRequest(step=step))
            await call.read()
        assert gauge("kvservice_tenant_sessions", "alpha") == 3
        assert gauge("kvservice_tenant_sessions", "beta") == 1
        assert gauge("kvservice_tenant_step_streams", "beta") == 2
        assert gauge("kvservice_tenant_step_streams", "alpha") == 0
        for call in streams:
            await call.done_writing()
            while await call.read() != grpc.aio.EOF:
                pass
        await stub.CloseSession(
            pb.CloseSessionRequest(session_id=beta.session_id), metadata=auth("beta")
        )
        await wait_until(lambda: server.sessions.num_streams() == 0, "the streams to close")
        assert gauge("kvservice_tenant_step_streams", "beta") is None
        assert gauge("kvservice_tenant_sessions", "beta") is None
        assert gauge("kvservice_tenant_sessions", "alpha") == 3


# -- the collector and the watches ------------------------------------------------------


async def test_full_collections_run_in_the_tables_turn_and_thresholds_come_back() -> None:
    saved = gc.get_threshold()
    turn = turns.TableTurn()
    collections = loop_watch.FullCollections(0.001, turn.run)
    collections.start()
    try:
        assert gc.get_threshold() == (saved[0], saved[1], loop_watch.NEVER)
        async with turn:  # a Step in progress: no full collection until it is done
            await asyncio.sleep(0.05)
            assert collections.num_collections == 0
        await wait_until(lambda: collections.num_collections > 0, "a full collection")
    finally:
        await collections.stop()
    assert gc.get_threshold() == saved


async def test_the_watches_measure_stalls_and_collections() -> None:
    stalls = loop_watch.StallWatch(interval_s=0.01)
    collections = loop_watch.GcWatch(inside=lambda: True)
    stalls.start()
    collections.start()
    try:
        await asyncio.sleep(0.03)  # a tick is pending
        time.sleep(0.05)  # the loop held: the pending tick fires at least 0.04 s late
        await asyncio.sleep(0.03)
        gc.collect()
    finally:
        collections.stop()
        await stalls.stop()
    assert stalls.longest_s >= 0.039
    assert stalls.longest_cpu_s > 0
    assert collections.num_collections >= 1 and collections.num_inside >= 1
    assert collections.longest_by_generation[2] > 0


async def test_the_server_exports_stalls_and_collector_pauses(server: KVCacheServer) -> None:
    await asyncio.sleep(0.05)
    gc.collect()
    assert metric(server, "kvservice_event_loop_stall_seconds_count") > 0
    assert metric(server, "kvservice_gc_pause_seconds_count", generation="2") >= 1


def test_gc_full_collection_interval_is_a_setting(tmp_path: Path) -> None:
    flag = load_settings({"gc_full_collection_interval": 5.0}, {})
    assert flag.server.gc_full_collection_interval_s == 5.0
    env = load_settings({}, {"KVSERVICE_GC_FULL_COLLECTION_INTERVAL": "0"})
    assert env.server.gc_full_collection_interval_s == 0.0
    assert ServerConfig().gc_full_collection_interval_s == 60.0
    with pytest.raises(InvalidArgumentError, match="gc_full_collection_interval"):
        KVCacheServer(dataclasses.replace(SMALL_POOL, gc_full_collection_interval_s=-1.0))


def test_loop_stall_interval_is_a_setting() -> None:
    flag = load_settings({"loop_stall_interval": 0.05}, {})
    assert flag.server.loop_stall_interval_s == 0.05
    env = load_settings({}, {"KVSERVICE_LOOP_STALL_INTERVAL": "0"})
    assert env.server.loop_stall_interval_s == 0.0
    assert ServerConfig().loop_stall_interval_s == loop_watch.STALL_INTERVAL_S
    for bad in (-0.01, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="loop_stall_interval must be finite"):
            KVCacheServer(dataclasses.replace(SMALL_POOL, loop_stall_interval_s=bad))


async def test_the_stall_watch_wakes_at_the_interval_set_and_not_at_all_at_0() -> None:
    """A server whose watch is off exports no stall observation (and wakes for none);
    one set to 0.05 s ticks at that pace."""
    async with running_server(dataclasses.replace(POOL, loop_stall_interval_s=0.0)) as off:
        await asyncio.sleep(0.1)
        assert off.stalls.num_ticks == 0
        assert metric(off, "kvservice_event_loop_stall_seconds_count") == 0
    async with running_server(dataclasses.replace(POOL, loop_stall_interval_s=0.05)) as slow:
        assert slow.stalls.interval_s == 0.05
        await wait_until(lambda: slow.stalls.num_ticks >= 2, "two ticks of the stall watch")
        assert metric(slow, "kvservice_event_loop_stall_seconds_count") >= 2


def test_a_sliding_window_pool_too_small_names_max_in_flight_tokens() -> None:
    config = dataclasses.replace(SMALL_POOL, num_blocks=16, max_model_len=128, sliding_window=64)
    with pytest.raises(InvalidArgumentError) as info:
        build_kv_cache_config(config)
    message = str(info.value)
    assert "--max-in-flight-tokens" in message and "--num-blocks" in message, message
    # Lowering it as told is enough here: a window plus 16 tokens in flight.
    build_kv_cache_config(dataclasses.replace(config, max_in_flight_tokens=16))


def test_a_slice_ends_on_cpu_time_and_reads_it_only_when_it_could_be_spent() -> None:
    """On a busy machine the clock runs ahead of the thread's CPU time (here 4 times
    as fast): the slice is due exactly when its CPU time is spent, not when the clock
    passes it; and once the clock has passed its deadline, the CPU time (a system
    call) is read again only when it could have reached its own, not on every check
    (12 reads here, against the 38 checks after the clock passed its deadline)."""
    clock = {"wall": 0.0, "cpu": 0.0}
    reads: list[float] = []

    def cpu() -> float:
        reads.append(clock["cpu"])
        return clock["cpu"]

    slice_s = 0.005
    slice_clock = SliceClock(slice_s, wall=lambda: clock["wall"], cpu=cpu)
    reads.clear()  # the start's read
    tick = 0.0001
    checks_after_clock = 0
    while not slice_clock.due():
        assert clock["cpu"] < slice_s
        checks_after_clock += clock["wall"] >= slice_s
        clock["wall"] += 4 * tick
        clock["cpu"] += tick
    assert clock["cpu"] == pytest.approx(slice_s)
    assert len(reads) <= checks_after_clock // 2


def test_slices_read_the_slice_and_clocks_as_they_are_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``turns.SLICE_S`` and ``turns.time`` are read when Slices are built (a test
    sets them so); WHOLE is never due, though this thread has spent far more than a
    slice of CPU time since it was built (at import, on the real clocks)."""
    now = {"t": 100.0}

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            return now["t"]

        @staticmethod
        def thread_time() -> float:
            return now["t"]

    monkeypatch.setattr(turns, "time", FakeTime)
    monkeypatch.setattr(turns, "SLICE_S", 0.5)
    slices = turns.Slices()
    assert slices.clock.slice_s == 0.5
    now["t"] += 0.4
    assert not slices.clock.due()
    now["t"] += 0.1
    assert slices.clock.due()
    assert not turns.WHOLE.clock.due()

"""Faults injected into real processes: a server given SIGTERM with calls in flight,
a client killed with SIGKILL in the middle of a StepStream, and a retried call.

Servers and clients here are separate OS processes (``kvservice serve``, a Python
child), so the signals hit what they hit in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvservice.bench.server import free_port
from kvservice.client import AsyncKVClient, KVServiceError, StepBuilder
from kvservice.protocol import OPERATION_ID_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.app import SERVICE_NAME
from tests.server.fuzz_support import table_state
from tests.server.support import SMALL_POOL, tokens
from tests.servers import TIMEOUT_S, ThreadedServer, kvservice_serve, server_in_thread

Code = grpc.StatusCode
# How a call is refused once shutdown began: UNAVAILABLE from the draining server (or
# a connection going away), CANCELLED when grpc stopped before a handler took it.
REFUSED_AT_SHUTDOWN = (Code.UNAVAILABLE, Code.CANCELLED)


class ServerLog:
    """The JSON log lines of a ``kvservice serve`` child, read as they come (the pipe
    is drained all along, so a chatty server never blocks on a full pipe)."""

    def __init__(self, stream: asyncio.StreamReader, seen: list[dict[str, Any]]) -> None:
        self._stream = stream
        self._seen = seen  # the lines read before
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while line := await self._stream.readline():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                async with self._changed:
                    self._seen.append(record)
                    self._changed.notify_all()
        async with self._changed:
            self._seen.append({"event": "<eof>"})
            self._changed.notify_all()

    async def wait_for(self, event: str) -> dict[str, Any]:
        async with self._changed:
            while True:
                for record in self._seen:
                    if record.get("event") == event:
                        return record
                    if record.get("event") == "<eof>":
                        raise AssertionError(f"the server exited before logging {event!r}")
                await asyncio.wait_for(self._changed.wait(), TIMEOUT_S)


@dataclass
class ServeProcess:
    process: asyncio.subprocess.Process
    log: ServerLog
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def serve_logged(*flags: str) -> AsyncIterator[ServeProcess]:
    """``kvservice serve`` on a free port (``tests.servers.kvservice_serve``), its log
    read from the startup line on; killed at the end if still running."""
    async with kvservice_serve("--num-blocks=64", "--max-model-len=256", *flags) as started:
        process, serving = started
        assert process.stdout is not None
        yield ServeProcess(process, ServerLog(process.stdout, [serving]), serving["port"])


def admit_ops(step: StepBuilder, request_id: str, num_tokens: int) -> None:
    step.add_request(request_id, tokens(num_tokens, start=sum(map(ord, request_id))))
    step.allocate_slots(request_id, num_tokens)


def heavy_step(request_id: str) -> StepBuilder:
    """A step that admits one request and then does enough read-only work to keep the
    server's loop busy for a while (tens of milliseconds)."""
    step = StepBuilder()
    admit_ops(step, request_id, 20)
    for _ in range(2000):
        step.get_usage()
    return step


def steps_in_a_handler(metrics_url: str) -> float:
    """The server's ``kvservice_rpc_in_flight{method="Step"}``, read from its metrics
    endpoint (a thread of its own: it answers while a Step holds the event loop)."""
    with urllib.request.urlopen(metrics_url, timeout=TIMEOUT_S) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvservice_rpc_in_flight" and sample.labels["method"] == "Step":
                return float(sample.value)
    return 0.0


async def test_sigterm_finishes_in_flight_calls_and_refuses_new_ones() -> None:
    """SIGTERM while a StepStream is open and Step calls are in flight: every call
    whose handler had started completes in full (at least one, seen in a handler
    through the metrics endpoint before the signal), every later one is refused having
    changed nothing, the open stream keeps being served until it closes, new calls are
    refused (UNAVAILABLE), and the process exits 0."""
    async with (
        serve_logged("--shutdown-grace=60", "--metrics", f"--metrics-port={free_port()}") as server,
        AsyncKVClient(server.target, client_id="sigterm") as client,
    ):
        serving = await server.log.wait_for("serving")
        session = client.session()
        step = StepBuilder()
        admit_ops(step, "stream-0", 40)
        assert (await session.step(step)).ok
        in_flight: list[asyncio.Future[Any]] = []
        while len(in_flight) < 24:  # the pool holds 64 blocks
            in_flight += [
                asyncio.ensure_future(client.step(heavy_step(f"unary-{len(in_flight) + i}")))
                for i in range(8)
            ]
            caught = False
            while not caught and not all(call.done() for call in in_flight):
                caught = await asyncio.to_thread(steps_in_a_handler, serving["metrics_url"]) > 0
            if caught:
                break
        assert caught, "no Step was ever seen in a handler"
        server.process.send_signal(signal.SIGTERM)
        await server.log.wait_for("shutting down")
        outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
        applied = set()
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                # Not yet in a handler when the drain began: refused before it ran
                # (checked below through the stream).
                assert isinstance(outcome, KVServiceError), outcome
                assert outcome.code in REFUSED_AT_SHUTDOWN, outcome
            else:
                assert outcome.ok and len(outcome) == 2002
                applied.add(f"unary-{i}")
        # The Step seen in a handler before the signal was not cut short.
        assert applied

        # A new call, on a new connection or on the open one, is refused by the
        # draining server, saying so.
        async with AsyncKVClient(server.target, timeout=TIMEOUT_S) as late:
            with pytest.raises(KVServiceError) as refused:
                await late.get_usage()
            assert refused.value.code is Code.UNAVAILABLE
            assert "shutting down" in str(refused.value)
        with pytest.raises(KVServiceError) as refused:
            await client.get_usage()
        assert refused.value.code is Code.UNAVAILABLE

        # The stream opened before the signal is still served: it decodes, and it
        # sees exactly the unary steps that answered OK.
        step = StepBuilder()
        step.append_tokens("stream-0", [7])
        decode = step.allocate_slots("stream-0", 1)
        states = {f"unary-{i}": step.get_request(f"unary-{i}") for i in range(len(in_flight))}
        results = await session.step(step)
        assert results[decode] is not None
        found = {rid for rid, handle in states.items() if results.error(handle) is None}
        assert found == applied
        print(
            f"\nsigterm: {len(applied)} of {len(in_flight)} Steps in flight completed, "
            f"{len(in_flight) - len(applied)} refused unapplied; the open stream was served"
        )
        await session.close()

        await asyncio.wait_for(server.log.wait_for("stopped"), TIMEOUT_S)
        assert await asyncio.wait_for(server.process.wait(), TIMEOUT_S) == 0


# -- a client killed with SIGKILL ----------------------------------------------------

# The doomed client: a separate Python process that opens a StepStream (under a
# session in the lease tests), admits two requests, reports the blocks it got on
# stdout and then waits to be killed. Raw stub only, so it depends on nothing but the
# generated code. argv: target, mode (plain | stream | unary), lease seconds.
DOOMED_CLIENT = textwrap.dedent(
    """
    import json, queue, sys, time
    import grpc
    from kvservice.protocol.gen import kv_cache_service_pb2 as pb
    from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc

    target, mode, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    stub = pb_grpc.KVCacheServiceStub(grpc.insecure_channel(target))
    metadata = ()
    if mode != "plain":
        opened = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=ttl, client_name="doomed"))
        metadata = (("x-kvservice-session", opened.session_id),)
    ops = []
    for rid, n in (("doomed-0", 40), ("doomed-1", 24)):
        prompt = list(range(500, 500 + n)) if rid == "doomed-0" else list(range(900, 900 + n))
        ops.append(pb.StepOperation(add_request=pb.AddRequestRequest(
            request_id=rid, prompt_token_ids=prompt)))
        ops.append(pb.StepOperation(allocate_slots=pb.AllocateSlotsRequest(
            request_id=rid, num_new_tokens=n)))
    step = pb.StepRequest(step_id=1, ops=ops)
    if mode == "unary":
        response = stub.Step(step, metadata=metadata)
    else:
        outbound = queue.SimpleQueue()
        outbound.put(pb.StepStreamRequest(step=step))
        def messages():
            while True:
                yield outbound.get()
        # Held in a name: a stream whose call object is collected is cancelled.
        responses = stub.StepStream(messages(), metadata=metadata)
        response = next(responses).step
    tables = {
        r.allocate_slots.request.request_id: list(r.allocate_slots.new_block_ids[0].block_ids)
        for r in response.results if r.WhichOneof("result") == "allocate_slots"
    }
    print(json.dumps(tables), flush=True)
    time.sleep(3600)
    """
)
FAULT_POOL = SMALL_POOL


@contextlib.contextmanager
def doomed_client(target: str, mode: str, lease_s: float = 0.0) -> Iterator[dict[str, list[int]]]:
    """Run the doomed client until it holds its blocks, yield its block tables, and
    SIGKILL it when the block exits (if the test has not already)."""
    process = subprocess.Popen(
        [sys.executable, "-c", DOOMED_CLIENT, target, mode, str(lease_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline()
        assert line, f"the client died before allocating: {process.stderr.read()}"
        yield json.loads(line)
    finally:
        process.kill()
        process.wait(TIMEOUT_S)


def in_flight_rpcs(server: ThreadedServer) -> float:
    registry = server.server.metrics.registry
    return sum(
        s.value
        for family in registry.collect()
        if family.name == "kvservice_rpc_in_flight"
        for s in family.samples
    )


def wait_until(server: ThreadedServer, condition: Any, what: str, timeout_s: float) -> None:
    """Poll ``condition()`` on the server's loop until it holds (``timeout_s`` is a
    safety net, or the bound the caller asserts)."""
    loop = asyncio.new_event_loop()
    try:
        deadline = loop.time() + timeout_s
        while not server.call(condition):
            assert loop.time() < deadline, f"not {what} after {timeout_s} s"
            loop.run_until_complete(asyncio.sleep(0.02))
    finally:
        loop.close()


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT_S
        )
    status: int = reply.status
    return status


def held_by(server: ThreadedServer, request_ids: list[str]) -> dict[str, list[int]]:
    """The block table of each of ``request_ids`` the server still knows."""
    manager = server.server.table.manager

    def tables() -> dict[str, list[int]]:
        known = server.server.table._requests  # test-only peek
        return {rid: list(manager.get_block_ids(rid)[0]) for rid in request_ids if rid in known}

    return server.call(tables)


def test_killed_client_mid_stream_leaves_the_server_healthy() -> None:
    """A client SIGKILLed with a StepStream open and blocks held: the server notices
    the broken stream, keeps serving (health SERVING, a full lifecycle for another
    client), stays consistent (audit), and the orphaned requests hold exactly the
    blocks they were given, nothing lost, until freed, after which the pool is whole.
    (Without a session nothing owns them; the lease test below covers that.)"""
    with server_in_thread(FAULT_POOL) as server:
        with doomed_client(server.target, "plain") as told:
            assert held_by(server, list(told)) == told
        wait_until(server, lambda: in_flight_rpcs(server) == 0, "the stream closed", TIMEOUT_S)
        assert health(server.target) == health_pb2.HealthCheckResponse.SERVING
        server.call(server.server.audit)
        assert held_by(server, list(told)) == told
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)
            stub.AddRequest(pb.AddRequestRequest(request_id="next", prompt_token_ids=tokens(20)))
            allocated = stub.AllocateSlots(
                pb.AllocateSlotsRequest(request_id="next", num_new_tokens=20)
            )
            assert allocated.outcome == pb.ALLOCATION_OUTCOME_OK
            for rid in [*told, "next"]:
                stub.FreeRequest(pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH))
        usage = server.call(server.server.table.usage)
        assert (usage.num_requests, usage.num_used_blocks) == (0, 0)
        server.call(server.server.audit)


# -- leases: the killed client's blocks come back --------------------------------------

LEASE_S = 2.0
# What the deadline allows beyond the lease: the reaper's tick (a tenth of the shortest
# lease) and a loaded 2-core machine's scheduling delays.
LEASE_SLACK_S = 5.0


def counter_total(server: ThreadedServer, name: str) -> float:
    registry = server.server.metrics.registry
    return server.call(
        lambda: sum(
            s.value
            for family in registry.collect()
            if family.name == name
            for s in family.samples
            if s.name == f"{name}_total"
        )
    )


def expirations(server: ThreadedServer, reason: str) -> float:
    """Sessions the server ended for ``reason`` (ttl or stream_broken)."""
    registry = server.server.metrics.registry
    name = "kvservice_session_expirations"
    return server.call(
        lambda: sum(
            s.value
            for family in registry.collect()
            if family.name == name
            for s in family.samples
            if s.name == f"{name}_total" and s.labels.get("reason") == reason
        )
    )


def audit_rpc(target: str) -> pb.AuditResponse:
    """The server's own audit over its Audit RPC: it must find nothing wrong."""
    with grpc.insecure_channel(target) as channel:
        report: pb.AuditResponse = pb_grpc.KVCacheServiceStub(channel).Audit(
            pb.AuditRequest(), timeout=TIMEOUT_S
        )
    assert report.ok and not report.violations, report
    return report


@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_killed_client_blocks_return_within_the_lease(mode: str) -> None:
    """A client holding blocks under a session is SIGKILLed (with its StepStream
    open, or between unary calls): its requests are freed, counted as reclaimed,
    before the lease (plus the reaper's slack) has run out, and the pool is whole."""
    with server_in_thread(FAULT_POOL) as server:
        reclaimed_before = counter_total(server, "kvservice_requests_reclaimed")
        expired_before = expirations(server, "stream_broken" if mode == "stream" else "ttl")
        with doomed_client(server.target, mode, LEASE_S) as told:
            assert held_by(server, list(told)) == told
        killed_at = time.monotonic()
        # The child is dead: the stream broke (stream mode) or nobody renews (unary).
        wait_until(
            server,
            lambda: not set(told) & set(server.server.table._requests),
            "freed within the lease",
            LEASE_S + LEASE_SLACK_S,
        )
        print(f"\nlease ({mode}): blocks back {time.monotonic() - killed_at:.2f} s after SIGKILL")
        usage = server.call(server.server.table.usage)
        assert (usage.num_requests, usage.num_used_blocks) == (0, 0)
        assert usage.num_free_blocks == usage.num_blocks - 1
        assert counter_total(server, "kvservice_requests_reclaimed") - reclaimed_before == 2
        # Why the session ended: the broken stream, or the lease running out.
        reason = "stream_broken" if mode == "stream" else "ttl"
        assert expirations(server, reason) - expired_before == 1
        server.call(server.server.audit)
        audit_rpc(server.target)


# -- idempotent retries ----------------------------------------------------------------


def with_id(operation_id: str) -> tuple[tuple[str, str], ...]:
    return ((OPERATION_ID_KEY, operation_id),)


def test_retried_call_is_applied_once() -> None:
    """A mutating call sent again with its operation id gets the first answer back
    and changes nothing: AddRequest does not answer ALREADY_EXISTS, AllocateSlots
    does not allocate twice; the same id on another request is refused."""
    with server_in_thread(FAULT_POOL) as server, grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        add = pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(40))
        first = stub.AddRequest(add, metadata=with_id("op-add"))
        assert stub.AddRequest(add, metadata=with_id("op-add")) == first
        with pytest.raises(grpc.RpcError) as again:  # the control: a new call is refused
            stub.AddRequest(add, metadata=with_id("op-add-2"))
        assert again.value.code() == Code.ALREADY_EXISTS

        allocate = pb.AllocateSlotsRequest(request_id="r", num_new_tokens=40)
        first_allocation = stub.AllocateSlots(allocate, metadata=with_id("op-alloc"))
        before = server.call(lambda: table_state(server.server.table))
        retried = stub.AllocateSlots(allocate, metadata=with_id("op-alloc"))
        assert retried == first_allocation
        assert server.call(lambda: table_state(server.server.table)) == before
        state = stub.GetRequest(pb.GetRequestRequest(request_id="r")).request
        assert state.num_computed_tokens == 40
        assert stub.GetUsage(pb.GetUsageRequest()).num_used_blocks == 3

        with pytest.raises(grpc.RpcError) as reused:
            stub.AllocateSlots(
                pb.AllocateSlotsRequest(request_id="r", num_new_tokens=1),
                metadata=with_id("op-alloc"),
            )
        assert reused.value.code() == Code.INVALID_ARGUMENT
        assert "op-alloc" in (reused.value.details() or "")
        assert server.call(lambda: table_state(server.server.table)) == before
        server.call(server.server.audit)


def test_call_cancelled_in_flight_then_retried_is_applied_once() -> None:
    """The real fault: a Step is cancelled in flight (its answer lost; it may or may
    not have run) and retried with the same operation id until it answers. Each
    request ends admitted exactly once, holding exactly its blocks."""
    with server_in_thread(FAULT_POOL) as server, grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.KVCacheServiceStub(ch)
        for i in range(4):
            rid, step = f"s{i}", StepBuilder()
            admit_ops(step, rid, 16)
            message = step.to_pb(step_id=i)
            stub.Step.future(message, metadata=with_id(f"op-{i}")).cancel()
            response = stub.Step(message, metadata=with_id(f"op-{i}"), timeout=TIMEOUT_S)
            assert all(r.WhichOneof("result") != "error" for r in response.results), response
            state = stub.GetRequest(pb.GetRequestRequest(request_id=rid)).request
            assert state.num_computed_tokens == 16
            table = stub.GetBlockIds(pb.GetBlockIdsRequest(request_id=rid)).block_ids
            assert len(table[0].block_ids) == 1
        assert stub.GetUsage(pb.GetUsageRequest()).num_used_blocks == 4
        server.call(server.server.audit)

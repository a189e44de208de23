"""A hostile client at the default limits, on loopback, while a prober polls health.

The shapes of issue 27, each at the server's default limits, one after another on a
real server (on its own loop in a thread, so its loop stalls are its own):

* 16,384 requests (the per-tenant limit; one more is refused) added by Steps of
  4,096 operations (the per-step limit; one more operation is refused), all admitted
  by one unary Admit, then a 4,096-entry AllocateSlotsBatch, then freed by Steps of
  4,096 frees;
* 1,024 sessions opened and closed (the per-tenant limit; one more is refused), one
  of them owning 4,096 requests;
* 256 StepStreams open at once (the per-tenant limit; one more is refused);
* prompts carrying 4,096 multimodal items of 256-character identifiers (the
  per-prompt limits; one more item, or one more character, is refused);
* a session ended by its broken stream while a 4,096-operation Step runs under it.

Meanwhile a task polls grpc.health.v1. The test prints the health p99 and longest
wait, the server's longest loop stall and its longest garbage-collector pause
(``pytest -s``), and asserts only what does not depend on timing: every limit refused
what it should, and at the end the pool is exact (the audit passes, no block is used,
no request, session, owned request or stream is left).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.protocol import SESSION_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.request_table.limits import RequestLimits
from kvservice.server.config import ServerConfig
from tests.servers import ThreadedServer, server_in_thread

LIMITS = RequestLimits()
DEFAULTS = ServerConfig()
NUM_REQUESTS = LIMITS.max_requests_per_tenant  # 16,384
STEP_OPS = DEFAULTS.max_step_ops  # 4,096
NUM_SESSIONS = DEFAULTS.max_sessions_per_tenant  # 1,024
NUM_STREAMS = DEFAULTS.max_step_streams_per_tenant  # 256
MM_ITEMS = LIMITS.max_mm_items_per_prompt  # 4,096
MM_ID_CHARS = LIMITS.max_mm_identifier_length  # 256
PROMPT = 16  # one block each
# Every limit at its default; a pool large enough that the limits, not the blocks,
# are what a hostile client meets: every request admitted, then one block more each
# for the batch.
CONFIG = dataclasses.replace(
    DEFAULTS,
    port=0,
    metrics_port=None,
    num_blocks=NUM_REQUESTS + STEP_OPS + 1024,
    audit_interval_s=0,
    shutdown_grace_s=0,
)
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
CONCURRENCY = 128
WAIT_TIMEOUT_S = 60.0


class HealthProbe:
    """A task polling grpc.health.v1 on a channel of its own, recording each answer's
    time. It shares the test's loop (and the process's GIL) with the hostile client,
    so its waits include the client's own work (building a 4,096-operation Step,
    reading a 16,384-entry answer), not only the server's: an upper bound."""

    def __init__(self, target: str) -> None:
        self._target = target
        self.latencies: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HealthProbe:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self._target) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            while not self._stop.is_set():
                start = time.perf_counter()
                reply = await check(health_pb2.HealthCheckRequest())
                self.latencies.append(time.perf_counter() - start)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                await asyncio.sleep(0.005)

    def p99(self) -> float:
        if len(self.latencies) < 2:
            return max(self.latencies, default=0.0)
        return statistics.quantiles(self.latencies, n=100)[98]


async def refused(call: Awaitable[Any], code: grpc.StatusCode, names: str) -> None:
    """``call`` fails with ``code`` and a message naming ``names`` (its limit)."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        assert err.code() == code, err.details()
        assert names in (err.details() or ""), err.details()
        return
    raise AssertionError(f"not refused: expected {code.name} naming {names}")


async def in_batches(calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    results: list[Any] = []
    for start in range(0, len(calls), CONCURRENCY):
        results += await asyncio.gather(*(c() for c in calls[start : start + CONCURRENCY]))
    return results


def add_ops(prefix: str, start: int, count: int) -> list[pb.StepOperation]:
    return [
        pb.StepOperation(
            add_request=pb.AddRequestRequest(
                request_id=f"{prefix}{i}",
                prompt_token_ids=[(i + t) % 30_000 for t in range(PROMPT)],
            )
        )
        for i in range(start, start + count)
    ]


def md(session_id: str) -> tuple[tuple[str, str]]:
    return ((SESSION_KEY, session_id),)


def no_errors(response: pb.StepResponse) -> None:
    errors = [r.error for r in response.results if r.HasField("error")]
    assert not errors, errors[:3]


async def requests_admitted_batched_and_freed(stub: pb_grpc.KVCacheServiceStub) -> None:
    ids = [f"r{i}" for i in range(NUM_REQUESTS)]
    for start in range(0, NUM_REQUESTS, STEP_OPS):
        no_errors(await stub.Step(pb.StepRequest(ops=add_ops("r", start, STEP_OPS))))
    await refused(
        stub.AddRequest(pb.AddRequestRequest(request_id="one-more", prompt_token_ids=[1])),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "max_requests_per_tenant",
    )
    admitted = await stub.Admit(
        pb.AdmitRequest(
            request_ids=ids, token_budget=NUM_REQUESTS * PROMPT, enable_chunked_prefill=True
        )
    )
    assert len(admitted.admitted) == NUM_REQUESTS
    assert admitted.stop_reason == pb.ADMIT_STOP_REASON_ALL_ADMITTED
    batch = pb.AllocateSlotsBatch(request_ids=ids[:STEP_OPS], num_new_tokens=[PROMPT] * STEP_OPS)
    answer = await stub.Step(
        pb.StepRequest(ops=[pb.StepOperation(allocate_slots_batch=batch)], omit_request_state=True)
    )
    (result,) = answer.results
    assert result.allocate_slots_batch.num_run == STEP_OPS
    assert not result.allocate_slots_batch.errors and not result.allocate_slots_batch.no_space
    over = [pb.StepOperation(get_usage=pb.GetUsageRequest())] * (STEP_OPS + 1)
    await refused(
        stub.Step(pb.StepRequest(ops=over)), grpc.StatusCode.INVALID_ARGUMENT, str(STEP_OPS)
    )
    finish = pb.FreeRequestRequest(mode=pb.FREE_MODE_FINISH)
    for start in range(0, NUM_REQUESTS, STEP_OPS):
        ops = [
            pb.StepOperation(free_request=pb.FreeRequestRequest(request_id=rid, mode=finish.mode))
            for rid in ids[start : start + STEP_OPS]
        ]
        no_errors(await stub.Step(pb.StepRequest(ops=ops, omit_request_state=True)))


async def sessions_opened_and_closed(stub: pb_grpc.KVCacheServiceStub) -> None:
    opened = await in_batches(
        [lambda: stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600))] * NUM_SESSIONS
    )
    await refused(
        stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "max_sessions_per_tenant",
    )
    sessions = [o.session_id for o in opened]
    # One owns a Step's worth of requests: its end frees them a slice at a time.
    no_errors(
        await stub.Step(pb.StepRequest(ops=add_ops("s", 0, STEP_OPS)), metadata=md(sessions[0]))
    )
    freed = await in_batches(
        [
            partial(stub.CloseSession, pb.CloseSessionRequest(session_id=s, free_requests=True))
            for s in sessions
        ]
    )
    assert sum(f.num_requests_freed for f in freed) == STEP_OPS


async def streams_opened_at_once(stub: pb_grpc.KVCacheServiceStub) -> None:
    step = pb.StepStreamRequest(
        step=pb.StepRequest(ops=[pb.StepOperation(new_step_starts=pb.NewStepStartsRequest())])
    )

    async def open_one() -> grpc.aio.StreamStreamCall:
        call = stub.StepStream()
        await call.write(step)
        await call.read()
        return call

    async def open_past_the_limit() -> None:
        # Refused as it opens, before any message: writing to it first would race the
        # refusal (a write to a call already ended fails in the client, as INTERNAL).
        await stub.StepStream().read()

    calls = await in_batches([open_one] * NUM_STREAMS)
    await refused(
        open_past_the_limit(), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_step_streams_per_tenant"
    )

    async def close(call: grpc.aio.StreamStreamCall) -> None:
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:
            pass

    await in_batches([partial(close, c) for c in calls])


async def multimodal_items_at_the_limits(stub: pb_grpc.KVCacheServiceStub) -> None:
    def prompt(rid: str, num_items: int, id_chars: int) -> pb.AddRequestRequest:
        items = [
            pb.MultiModalFeature(identifier=f"{rid}-{n}".ljust(id_chars, "x"), offset=0, length=1)
            for n in range(num_items)
        ]
        return pb.AddRequestRequest(request_id=rid, prompt_token_ids=[7], mm_features=items)

    for n in range(4):
        await stub.AddRequest(prompt(f"mm{n}", MM_ITEMS, MM_ID_CHARS))
    await refused(
        stub.AddRequest(prompt("too-many", MM_ITEMS + 1, 8)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_mm_items_per_prompt",
    )
    await refused(
        stub.AddRequest(prompt("too-long", 1, MM_ID_CHARS + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_mm_identifier_length",
    )
    for n in range(4):
        await stub.FreeRequest(pb.FreeRequestRequest(request_id=f"mm{n}", mode=pb.FREE_MODE_FINISH))


async def session_ended_mid_step(
    stub: pb_grpc.KVCacheServiceStub, threaded: ThreadedServer
) -> None:
    session = (await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600))).session_id
    call = stub.StepStream(metadata=md(session))
    await call.write(
        pb.StepStreamRequest(
            step=pb.StepRequest(ops=[pb.StepOperation(new_step_starts=pb.NewStepStartsRequest())])
        )
    )
    await call.read()
    ops = add_ops("m", 0, STEP_OPS)
    for n in range(0, STEP_OPS, 2):  # and allocations: blocks held when the end comes
        ops[n + 1] = pb.StepOperation(
            allocate_slots=pb.AllocateSlotsRequest(request_id=f"m{n}", num_new_tokens=PROMPT)
        )
    running = asyncio.ensure_future(stub.Step(pb.StepRequest(ops=ops), metadata=md(session)))
    await asyncio.sleep(0.001)
    call.cancel()  # the session ends: before the Step, during it, or after it
    try:
        response = await running
    except grpc.aio.AioRpcError as err:  # ended before the Step had the table's turn
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    else:
        codes = {r.error.code for r in response.results if r.HasField("error")}
        assert codes <= {grpc.StatusCode.FAILED_PRECONDITION.value[0]}, codes
    await wait_on_server(threaded, lambda: threaded.server.sessions.num_sessions == 0)


async def wait_on_server(threaded: ThreadedServer, condition: Callable[[], bool]) -> None:
    """Until ``condition()``, read on the server's loop, holds (a safety timeout only)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_TIMEOUT_S
    while not await asyncio.to_thread(threaded.call, condition):
        assert loop.time() < deadline, "timed out waiting for the server"
        await asyncio.sleep(0.01)


def refusals(threaded: ThreadedServer, reason: str) -> float:
    metrics = threaded.server.metrics
    value = metrics.registry.get_sample_value(
        "kvservice_refusals_total", {**metrics.labels, "tenant": "", "reason": reason}
    )
    return value or 0.0


async def test_hostile_shapes_at_the_default_limits() -> None:
    with server_in_thread(CONFIG) as threaded:
        server = threaded.server
        started = time.perf_counter()
        async with (
            grpc.aio.insecure_channel(threaded.target, options=CHANNEL_OPTIONS) as channel,
            HealthProbe(threaded.target) as health,
        ):
            stub = pb_grpc.KVCacheServiceStub(channel)
            await requests_admitted_batched_and_freed(stub)
            await sessions_opened_and_closed(stub)
            await streams_opened_at_once(stub)
            await multimodal_items_at_the_limits(stub)
            await session_ended_mid_step(stub, threaded)
            await wait_on_server(threaded, lambda: server.sessions.num_streams() == 0)
            report = await stub.Audit(pb.AuditRequest())
            usage = await stub.GetUsage(pb.GetUsageRequest())
        elapsed = time.perf_counter() - started
        print(
            f"\nhostile load: {elapsed:.1f} s; health p99 {health.p99() * 1000:.1f} ms, "
            f"longest {max(health.latencies) * 1000:.1f} ms over {len(health.latencies)} "
            f"checks; longest loop stall {server.stalls.longest_s * 1000:.1f} ms "
            f"({server.stalls.longest_cpu_s * 1000:.1f} ms of CPU); longest GC pause "
            f"{server.collections.longest_s * 1000:.1f} ms "
            f"({server.collections.longest_inside_s * 1000:.1f} ms in the table's turn)"
        )
        # The pool is exact: nothing held, nobody left, and the audit agrees.
        assert report.ok, list(report.violations)
        assert (usage.num_requests, usage.num_used_blocks) == (0, 0)
        assert (report.num_sessions, report.num_owned_requests) == (0, 0)
        left = threaded.call(
            lambda: (server.sessions.num_sessions, server.sessions.num_owned_requests)
        )
        assert left == (0, 0)
        # Each limit refused, and counted, what went past it.
        for reason in (
            "max_requests_per_tenant",
            "max_sessions_per_tenant",
            "max_step_streams_per_tenant",
            "max_mm_items_per_prompt",
            "max_mm_identifier_length",
        ):
            assert refusals(threaded, reason) == 1, reason

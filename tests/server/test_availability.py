"""Availability under hostile load, against a real `kvservice serve` on a
1,000,000-block pool: while one client sends the largest messages the limits allow
(AddRequest with every string field and multimodal item at its limit, and Steps of
the most operations within the message size) and another runs concurrent audits,
a third client's health checks and GetUsage calls must all be answered.

Only what is not a timing is asserted: every answer arrives, nothing is lost (every
request the load added is finished, the held ones are intact), and the audit passes.
The third client's latencies (p50, p99, max) are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.protocol import pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.request_table.limits import RequestLimits
from kvservice.server.config import ServerConfig
from kvservice.server.servicer import KVCacheServicer
from kvservice.server.turns import Slices
from tests.server.support import SMALL_POOL
from tests.servers import TIMEOUT_S, ThreadedServer, kvservice_serve, server_in_thread

NUM_BLOCKS = 1_000_000
MAX_MODEL_LEN = 16_000  # 1,000 blocks of 16 tokens
NUM_HELD = 100  # requests of MAX_MODEL_LEN tokens: 100,000 blocks held during the audits
LIMITS = RequestLimits()
MAX_MESSAGE_BYTES = ServerConfig().max_message_bytes
MAX_STEP_OPS = ServerConfig().max_step_ops
CONCURRENT_AUDITS = 4
AUDIT_ROUNDS = 2


def prompt(n: int) -> bytes:
    return pack_token_ids(range(n * MAX_MODEL_LEN, (n + 1) * MAX_MODEL_LEN))


def largest_add_request(n: int) -> pb.AddRequestRequest:
    """Every string at its length limit, the most multimodal items, the longest prompt."""
    message = pb.AddRequestRequest(
        request_id=f"{n:08d}".ljust(LIMITS.max_request_id_length, "r"),
        packed_prompt_token_ids=prompt(NUM_HELD + n),
        cache_salt="s" * LIMITS.max_cache_salt_length,
        lora_name="l" * LIMITS.max_lora_name_length,
    )
    spacing = MAX_MODEL_LEN // LIMITS.max_mm_items_per_prompt
    message.mm_features.extend(
        pb.MultiModalFeature(
            identifier=f"{n:04d}{k:06d}".ljust(LIMITS.max_mm_identifier_length, "i"),
            offset=k * spacing,
            length=spacing,
        )
        for k in range(LIMITS.max_mm_items_per_prompt)
    )
    assert message.ByteSize() < MAX_MESSAGE_BYTES
    return message


def largest_step(n: int) -> tuple[pb.StepRequest, list[str]]:
    """As many AddRequests as one Step may carry within the message size: each with a
    prompt as long as that allows."""
    tokens_each = (MAX_MESSAGE_BYTES - 256 * 1024) // (4 * MAX_STEP_OPS)
    step = pb.StepRequest(step_id=n)
    ids = []
    for k in range(MAX_STEP_OPS):
        request_id = f"step-{n}-{k}"
        ids.append(request_id)
        start = (n * MAX_STEP_OPS + k) * tokens_each
        step.ops.add().add_request.CopyFrom(
            pb.AddRequestRequest(
                request_id=request_id,
                packed_prompt_token_ids=pack_token_ids(range(start, start + tokens_each)),
            )
        )
    assert step.ByteSize() < MAX_MESSAGE_BYTES
    return step, ids


async def timed(latencies: list[float], call: Callable[[], Awaitable[Any]]) -> None:
    start = time.perf_counter()
    await call()
    latencies.append(time.perf_counter() - start)


def summary(name: str, latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (
        f"{name}: n={len(ordered)} p50={statistics.median(ordered) * 1000:.1f} ms "
        f"p99={p99 * 1000:.1f} ms max={ordered[-1] * 1000:.1f} ms"
    )


async def test_health_and_usage_answer_through_large_messages_and_audits() -> None:
    async with kvservice_serve(
        f"--num-blocks={NUM_BLOCKS}", f"--max-model-len={MAX_MODEL_LEN}", "--audit-interval=0"
    ) as (process, serving):
        target = f"127.0.0.1:{serving['port']}"
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        async with (
            grpc.aio.insecure_channel(target, options=options) as big_channel,
            grpc.aio.insecure_channel(target) as audit_channel,
            grpc.aio.insecure_channel(target) as probe_channel,
        ):
            big = pb_grpc.KVCacheServiceStub(big_channel)
            auditor = pb_grpc.KVCacheServiceStub(audit_channel)
            prober = pb_grpc.KVCacheServiceStub(probe_channel)
            health = health_pb2_grpc.HealthStub(probe_channel)
            for n in range(NUM_HELD):  # 100,000 blocks held through the audits
                held = pb.AddRequestRequest(
                    request_id=f"held-{n}", packed_prompt_token_ids=prompt(n)
                )
                await big.AddRequest(held)
                await big.AllocateSlots(
                    pb.AllocateSlotsRequest(request_id=f"held-{n}", num_new_tokens=MAX_MODEL_LEN)
                )
            before = await prober.GetUsage(pb.GetUsageRequest())
            assert before.num_used_blocks == NUM_HELD * MAX_MODEL_LEN // 16

            loading = asyncio.Event()
            answers = {"add": 0, "step_ops": 0}

            async def send_largest() -> None:
                n = 0
                while not loading.is_set():
                    message = largest_add_request(n)
                    await big.AddRequest(message)
                    await big.FreeRequest(
                        pb.FreeRequestRequest(
                            request_id=message.request_id, mode=pb.FREE_MODE_FINISH
                        )
                    )
                    step, ids = largest_step(n)
                    results = (await big.Step(step)).results
                    assert all(r.WhichOneof("result") == "add_request" for r in results)
                    finish = pb.StepRequest(step_id=-n)
                    for request_id in ids:
                        finish.ops.add().free_request.CopyFrom(
                            pb.FreeRequestRequest(request_id=request_id, mode=pb.FREE_MODE_FINISH)
                        )
                    results = (await big.Step(finish)).results
                    assert all(r.WhichOneof("result") == "free_request" for r in results)
                    answers["add"] += 1
                    answers["step_ops"] += len(ids)
                    n += 1

            async def audit_concurrently() -> list[pb.AuditResponse]:
                reports: list[pb.AuditResponse] = []
                for _ in range(AUDIT_ROUNDS):
                    reports += await asyncio.gather(
                        *(auditor.Audit(pb.AuditRequest()) for _ in range(CONCURRENT_AUDITS))
                    )
                return reports

            health_ms: list[float] = []
            usage_ms: list[float] = []

            async def probe(latencies: list[float], call: Callable[[], Awaitable[Any]]) -> None:
                while not loading.is_set():
                    await timed(latencies, call)
                    await asyncio.sleep(0.01)

            check = health_pb2.HealthCheckRequest()
            tasks = [
                asyncio.create_task(send_largest()),
                asyncio.create_task(
                    probe(health_ms, lambda: health.Check(check, timeout=TIMEOUT_S))
                ),
                asyncio.create_task(probe(usage_ms, lambda: prober.GetUsage(pb.GetUsageRequest()))),
            ]
            try:
                reports = await audit_concurrently()
            finally:
                loading.set()
                await asyncio.gather(*tasks)

            assert len(reports) == CONCURRENT_AUDITS * AUDIT_ROUNDS
            assert all(report.ok for report in reports), [list(r.violations) for r in reports]
            assert answers["add"] >= 1 and health_ms and usage_ms
            after = await prober.GetUsage(pb.GetUsageRequest())
            assert (after.num_requests, after.num_used_blocks) == (NUM_HELD, before.num_used_blocks)
            final = await auditor.Audit(pb.AuditRequest())
            assert final.ok and final.num_requests == NUM_HELD
            print()
            print(
                f"during {len(reports)} audits ({CONCURRENT_AUDITS} at a time) of "
                f"{NUM_BLOCKS} blocks, {answers['add']} largest AddRequests and "
                f"{answers['step_ops']} AddRequests in largest Steps:"
            )
            print(summary("health check", health_ms))
            print(summary("GetUsage", usage_ms))
        process.terminate()
        _, stderr = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    assert process.returncode == 0, stderr.decode()


# -- a large Step pauses for health checks, and stays isolated -------------------------


async def wait_for_turn_taken(server: ThreadedServer) -> None:
    """Until the server's Step holds the table's turn (read across threads: a bool)."""
    for _ in range(int(TIMEOUT_S / 0.001)):
        if server.server.turn.taken:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the step never took the table's turn")


async def test_a_large_step_pauses_for_health_checks_and_stays_isolated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a Step of the most operations runs (paused between slices, holding the
    table's turn), a health check is answered before the Step is; a GetUsage sent
    meanwhile waits and sees the whole Step, never a part of it.

    The order is made, not waited for: the Step's first pause holds it (the loop runs
    on, the turn stays taken) until the server has the GetUsage waiting for the turn,
    and the GetUsage is sent only once the health check was answered. So the health
    check is answered while the Step provably runs, and the GetUsage provably arrives
    in the middle of the Step, with part of it done."""
    paused = threading.Event()  # the Step holds the turn, paused (set on the server's loop)
    usage_waits = asyncio.Event()  # a GetUsage waits for the turn (the server's loop only)
    pause = Slices.pause
    run = KVCacheServicer._run

    async def held_pause(slices: Slices) -> None:
        paused.set()
        await usage_waits.wait()
        await pause(slices)

    async def noting_run(
        service: KVCacheServicer, operation: Any, request: Any, out: Any, caller: Any
    ) -> Any:
        if isinstance(request, pb.GetUsageRequest) and service._turn.taken:
            usage_waits.set()  # _run then queues for the turn before the Step resumes
        return await run(service, operation, request, out, caller)

    monkeypatch.setattr(Slices, "pause", held_pause)
    monkeypatch.setattr(KVCacheServicer, "_run", noting_run)
    config = dataclasses.replace(SMALL_POOL, num_blocks=100_000, max_model_len=1024)
    step, ids = largest_step(0)
    with server_in_thread(config) as server:
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            running = asyncio.ensure_future(stub.Step(step))
            assert await asyncio.to_thread(paused.wait, TIMEOUT_S), "the Step never paused"
            await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            assert not running.done()  # held until the GetUsage below waits
            usage = await stub.GetUsage(pb.GetUsageRequest())
            assert usage.num_requests == len(ids)
            assert all(r.WhichOneof("result") == "add_request" for r in (await running).results)
        server.call(server.server.audit)


async def test_a_cancelled_large_step_runs_entirely() -> None:
    config = dataclasses.replace(SMALL_POOL, num_blocks=100_000, max_model_len=1024)
    step, ids = largest_step(0)
    with server_in_thread(config) as server:
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            stub = pb_grpc.KVCacheServiceStub(channel)
            running = stub.Step(step)
            await wait_for_turn_taken(server)
            running.cancel()
            usage = await stub.GetUsage(pb.GetUsageRequest())  # waits for the step's turn
            assert usage.num_requests == len(ids)
        server.call(server.server.audit)

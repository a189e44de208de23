"""Calls cancelled in flight leave the service consistent: every step ran entirely
or not at all, and the pool passes its audit."""

from __future__ import annotations

import asyncio

import grpc

from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.app import KVCacheServer
from tests.server.support import tokens

# Safety net only: the wait ends as soon as the server has seen every cancellation.
SETTLE_TIMEOUT_S = 60


def admit_step(request_id: str, num_tokens: int) -> pb.StepRequest:
    prompt = tokens(num_tokens, start=hash(request_id) % 1000)
    return pb.StepRequest(
        ops=[
            pb.StepOperation(
                add_request=pb.AddRequestRequest(request_id=request_id, prompt_token_ids=prompt)
            ),
            pb.StepOperation(
                allocate_slots=pb.AllocateSlotsRequest(
                    request_id=request_id, num_new_tokens=num_tokens
                )
            ),
        ]
    )


async def settled(server: KVCacheServer) -> None:
    """Wait until no KVCacheService call is in flight on the server."""
    registry = server.metrics.registry
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT_S
    while True:
        in_flight = sum(
            s.value
            for family in registry.collect()
            if family.name == "kvservice_rpc_in_flight"
            for s in family.samples
        )
        if in_flight == 0 or loop.time() > deadline:
            assert in_flight == 0
            return
        await asyncio.sleep(0.01)


async def assert_consistent(server: KVCacheServer, stub: pb_grpc.KVCacheServiceStub) -> None:
    """Each known request holds exactly the blocks its computed tokens need, the
    usage adds up, and the pool audit passes."""
    await settled(server)
    server.audit()
    held = 0
    for request_id in list(server.table._requests):  # test-only peek
        state = (await stub.GetRequest(pb.GetRequestRequest(request_id=request_id))).request
        table = await stub.GetBlockIds(pb.GetBlockIdsRequest(request_id=request_id))
        num_blocks = len(table.block_ids[0].block_ids)
        assert num_blocks == -(-state.num_computed_tokens // 16)
        held += num_blocks
    usage = await stub.GetUsage(pb.GetUsageRequest())
    assert usage.num_used_blocks == held
    assert usage.num_free_blocks + usage.num_used_blocks == usage.num_blocks - 1


async def test_cancelled_stream_mid_session(server: KVCacheServer) -> None:
    """A session cancelled with a step written but unanswered: that step was applied
    entirely or not at all, and the state is consistent."""
    async with grpc.aio.insecure_channel(server.handle.target) as channel:
        stub = pb_grpc.KVCacheServiceStub(channel)
        call = stub.StepStream()
        await call.write(pb.StepStreamRequest(step=admit_step("a", 40)))
        await call.read()
        await call.write(pb.StepStreamRequest(step=admit_step("b", 20)))
        call.cancel()
        await assert_consistent(server, stub)
        known = set(server.table._requests)
        assert known in ({"a"}, {"a", "b"})


async def test_cancelled_unary_calls(server: KVCacheServer) -> None:
    """Many Step calls, a part cancelled at varying points: whatever ran, ran whole."""
    async with grpc.aio.insecure_channel(server.handle.target) as channel:
        stub = pb_grpc.KVCacheServiceStub(channel)
        calls = [stub.Step(admit_step(f"r{i}", 16)) for i in range(12)]
        for i, call in enumerate(calls):
            if i % 2:
                for _ in range(i):
                    await asyncio.sleep(0)
                call.cancel()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert any(isinstance(o, pb.StepResponse) for o in outcomes)
        await assert_consistent(server, stub)

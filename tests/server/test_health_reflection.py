"""The standard services next to KVCacheService: health checking and reflection."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvservice.server.app import SERVICE_NAME
from tests.server.support import SMALL_POOL
from tests.servers import running_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Only a safety net: every wait below ends as soon as the event happens.
TIMEOUT_S = 60


async def test_health_reports_serving(channel: grpc.aio.Channel) -> None:
    """Both the whole server ("") and KVCacheService are SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == SERVING


async def test_health_turns_not_serving_on_shutdown() -> None:
    """stop() reports NOT_SERVING to watchers before the server goes away."""
    async with (
        running_server(SMALL_POOL) as server,
        grpc.aio.insecure_channel(server.handle.target) as channel,
    ):
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        )
        first = await asyncio.wait_for(watch.read(), TIMEOUT_S)
        assert first.status == SERVING
        stopping = asyncio.create_task(server.stop(grace=TIMEOUT_S))
        second = await asyncio.wait_for(watch.read(), TIMEOUT_S)
        assert second.status == NOT_SERVING
        # The open watch is an in-flight RPC; ending it lets stop() finish at once.
        watch.cancel()
        await asyncio.wait_for(stopping, TIMEOUT_S)
    # stop() is idempotent: running_server's own stop(grace=0) then does nothing.


async def test_reflection_lists_the_services(channel: grpc.aio.Channel) -> None:
    """Server reflection lists KVCacheService, health and reflection itself."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    reply = await asyncio.wait_for(call.read(), TIMEOUT_S)
    call.cancel()
    names = {s.name for s in reply.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert SERVICE_NAME == "kvservice.v1.KVCacheService"


async def test_reflection_describes_the_methods(channel: grpc.aio.Channel) -> None:
    """Reflection serves the proto file, so grpcurl-style clients see every RPC."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)
    call = stub.ServerReflectionInfo(iter([request]))
    reply = await asyncio.wait_for(call.read(), TIMEOUT_S)
    call.cancel()
    [raw] = reply.file_descriptor_response.file_descriptor_proto
    proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
    [service] = proto.service
    methods = {m.name for m in service.method}
    assert {"AddRequest", "AllocateSlots", "GetComputedBlocks", "FreeRequest"} <= methods

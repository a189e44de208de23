"""Fixtures: a real server on a free loopback port, a channel and a stub."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvservice.client import AsyncKVClient
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.app import KVCacheServer, ServerHandle, serve_in_background
from tests.server.support import SMALL_POOL, running_server


@pytest.fixture
async def server() -> AsyncIterator[ServerHandle]:
    async with serve_in_background(SMALL_POOL) as handle:
        yield handle


@pytest.fixture
async def channel(server: ServerHandle) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.target) as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.KVCacheServiceStub:
    return pb_grpc.KVCacheServiceStub(channel)


@pytest.fixture
async def kv_server() -> AsyncIterator[KVCacheServer]:
    """A started server object (for ``audit()`` and its metrics registry)."""
    async with running_server(SMALL_POOL) as server:
        yield server


@pytest.fixture
async def client(kv_server: KVCacheServer) -> AsyncIterator[AsyncKVClient]:
    async with AsyncKVClient(kv_server.handle.target, client_id="test-scheduler") as client:
        yield client

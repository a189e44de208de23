"""Fixtures: a real server on a free loopback port, a channel and a stub."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvservice.server import ServerHandle, serve_in_background
from kvservice.server.gen import kv_cache_service_pb2_grpc as pb_grpc
from tests.server.support import SMALL_POOL


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

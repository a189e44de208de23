"""Graceful shutdown in-process: once ``stop`` begins, new calls are refused UNAVAILABLE
having changed nothing, an open stream is served to its end, and ``stop`` returns as
soon as that stream closes, long before the grace period."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvservice.client import AsyncKVClient, KVServiceError, StepBuilder
from kvservice.server.app import KVCacheServer
from tests.server.fuzz_support import table_state
from tests.server.support import SMALL_POOL, tokens
from tests.servers import running_server

# Far longer than the test takes: stop() returning is the stream closing, not this.
GRACE_S = 120.0


async def draining(server: KVCacheServer) -> asyncio.Task[None]:
    """``server.stop`` running in a task, once it has begun refusing calls."""
    task = asyncio.ensure_future(server.stop(grace=GRACE_S))
    while not server._drain.draining:  # test-only peek: the first phase has begun
        await asyncio.sleep(0)
    return task


async def test_stop_refuses_new_calls_serves_open_streams_and_ends_when_they_do() -> None:
    async with (
        running_server(SMALL_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        session = client.session()
        step = StepBuilder()
        step.add_request("a", tokens(20))
        step.allocate_slots("a", 20)
        assert (await session.step(step)).ok

        stopping = await draining(server)
        before = table_state(server.table)
        with pytest.raises(KVServiceError) as refused:
            await client.add_request("b", tokens(20))
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in str(refused.value)
        assert table_state(server.table) == before

        # The stream opened before stop() is still served, then closes.
        step = StepBuilder()
        step.append_tokens("a", [7])
        decode = step.allocate_slots("a", 1)
        assert (await session.step(step))[decode] is not None
        assert not stopping.done()
        await session.close()
        await asyncio.wait_for(stopping, GRACE_S / 4)

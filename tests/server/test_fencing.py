"""Fencing on a real server: once a scheduler opens a session with a newer epoch, the
stale one is refused (FAILED_PRECONDITION naming both epochs), changes nothing, and its
requests are freed when its lease runs out."""

from __future__ import annotations

import grpc
import pytest

from kvservice.client import AsyncKVClient, FailedPreconditionError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from tests.server.support import expect_error, snapshot, tokens, usage
from tests.server.test_sessions import (
    LEASE_POOL,
    SHORT_TTL_S,
    add_and_admit,
    audit_ok,
    open_session,
    session_md,
    wait_until,
)
from tests.servers import Stub


@pytest.fixture
def server_config() -> ServerConfig:
    return LEASE_POOL


async def epoch_of(stub: Stub) -> int:
    config: pb.GetCacheConfigResponse = await stub.GetCacheConfig(pb.GetCacheConfigRequest())
    return config.scheduler_epoch


class TestFencing:
    async def test_a_stale_scheduler_is_refused_after_a_newer_one_opens(self, stub: Stub) -> None:
        assert await epoch_of(stub) == 0
        old = await open_session(stub, ttl_s=600, epoch=1, name="scheduler-old")
        await add_and_admit(stub, "old-req", 20, old.session_id)
        new = await open_session(stub, ttl_s=600, epoch=2, name="scheduler-new")
        assert new.current_epoch == 2
        assert await epoch_of(stub) == 2
        before = await snapshot(stub, ["old-req"])

        stale = session_md(old.session_id)
        append = pb.AppendTokensRequest(request_id="old-req", token_ids=[5])
        message = await expect_error(
            stub.AppendTokens(append, metadata=stale), grpc.StatusCode.FAILED_PRECONDITION
        )
        assert "epoch 1" in message and "current epoch 2" in message
        await expect_error(
            stub.KeepAlive(pb.KeepAliveRequest(session_id=old.session_id)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        add = pb.AddRequestRequest(request_id="sneaky", prompt_token_ids=tokens(4))
        await expect_error(
            stub.AddRequest(add, metadata=stale), grpc.StatusCode.FAILED_PRECONDITION
        )
        assert await snapshot(stub, ["old-req"]) == before
        # The newer scheduler carries on, on the same pool.
        await stub.AppendTokens(append, metadata=session_md(new.session_id))

    async def test_opening_with_an_older_epoch_is_refused(self, stub: Stub) -> None:
        await open_session(stub, ttl_s=600, epoch=5)
        message = await expect_error(
            stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600, epoch=4)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert "epoch 4" in message and "current epoch 5" in message
        # The same epoch is the same scheduler (another of its connections).
        same = await open_session(stub, ttl_s=600, epoch=5)
        assert same.current_epoch == 5
        assert (await audit_ok(stub)).num_sessions == 2
        message = await expect_error(
            stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600, epoch=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "epoch" in message and "-1" in message

    async def test_a_fenced_session_still_loses_its_requests_at_expiry(self, stub: Stub) -> None:
        """Refused renewals mean the stale lease runs out: no block is stranded."""
        old = await open_session(stub, ttl_s=SHORT_TTL_S, epoch=1)
        await add_and_admit(stub, "old-req", 30, old.session_id)
        await open_session(stub, ttl_s=600, epoch=2)

        async def freed() -> bool:
            return (await usage(stub)).num_requests == 0

        await wait_until(freed, "the stale session's lease to run out")
        assert (await usage(stub)).num_used_blocks == 0
        await audit_ok(stub)

    async def test_a_stream_of_the_stale_scheduler_ends(self, stub: Stub) -> None:
        old = await open_session(stub, ttl_s=600, epoch=1)
        call = stub.StepStream(metadata=session_md(old.session_id))
        await call.write(pb.StepStreamRequest(step=pb.StepRequest(step_id=1)))
        assert (await call.read()).step.step_id == 1
        await open_session(stub, ttl_s=600, epoch=2)
        await call.write(pb.StepStreamRequest(step=pb.StepRequest(step_id=2)))
        message = await expect_error(call.read(), grpc.StatusCode.FAILED_PRECONDITION)
        assert "epoch 1" in message and "current epoch 2" in message

    async def test_clients(self, server: KVCacheServer) -> None:
        target = server.handle.target
        async with AsyncKVClient(target) as old, AsyncKVClient(target) as new:
            await old.open_session(600, epoch=7)
            await old.add_request("mine", tokens(4))
            await new.open_session(600, epoch=8)
            with pytest.raises(FailedPreconditionError, match="current epoch 8"):
                await old.append_tokens("mine", [1])
            with pytest.raises(FailedPreconditionError, match="current epoch 8"):
                await old.open_session(600, epoch=7)
            assert (await new.audit()).current_epoch == 8

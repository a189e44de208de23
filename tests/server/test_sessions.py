"""Client sessions on a real server: leases own requests, and no block outlives its
owner's lease (expiry, a broken stream); renewal and closing; TTL bounds; the clients'
background renewal."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvservice.client import AsyncKVClient, FailedPreconditionError, KVClient
from kvservice.core.errors import InvalidArgumentError, RequestNotFoundError
from kvservice.protocol import SESSION_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import FreeMode, NewRequest
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.sessions import (
    SessionEndedError,
    SessionNotFoundError,
    SessionPolicy,
    SessionRegistry,
)
from tests.server.support import SMALL_POOL, admit, expect_error, tokens, usage
from tests.servers import Stub, raw_stub, running_server, server_in_thread

# Short leases allowed, so expiry tests take a fraction of a second; no self-check
# (the audit tests run their own).
LEASE_POOL = dataclasses.replace(
    SMALL_POOL, session_ttl_min_s=0.1, session_ttl_default_s=5.0, audit_interval_s=0
)
LABELS = {"model_name": "test-model", "engine": "0"}
# Safety net only: every wait ends as soon as its condition holds.
WAIT_TIMEOUT_S = 30.0
# Short enough that expiry tests end quickly, long enough that a stall of a loaded
# CI machine between two calls of a test's setup does not end the lease early.
SHORT_TTL_S = 1.5
# The client tests wait for six renewals (one every third of the TTL): two TTLs.
CLIENT_TTL_S = 1.2


async def wait_until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``condition`` until it holds (fails after ``WAIT_TIMEOUT_S``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_TIMEOUT_S
    while not await condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def session_md(session_id: str) -> tuple[tuple[str, str], ...]:
    return ((SESSION_KEY, session_id),)


async def open_session(
    stub: Stub, ttl_s: float = SHORT_TTL_S, epoch: int = 0, name: str = "test"
) -> pb.OpenSessionResponse:
    response: pb.OpenSessionResponse = await stub.OpenSession(
        pb.OpenSessionRequest(ttl_seconds=ttl_s, client_name=name, epoch=epoch)
    )
    return response


async def add_and_admit(stub: Stub, request_id: str, num_tokens: int, session_id: str) -> None:
    """Add a request under the session and allocate its prompt."""
    md = session_md(session_id) if session_id else ()
    await stub.AddRequest(
        pb.AddRequestRequest(request_id=request_id, prompt_token_ids=tokens(num_tokens)),
        metadata=md,
    )
    response = await stub.AllocateSlots(
        pb.AllocateSlotsRequest(request_id=request_id, num_new_tokens=num_tokens), metadata=md
    )
    assert response.outcome == pb.ALLOCATION_OUTCOME_OK


def metric(server: KVCacheServer, name: str, **labels: str) -> float:
    value = server.metrics.registry.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if value is None else value


def keep_alives(server: KVCacheServer) -> float:
    """KeepAlive calls the server has answered."""
    return metric(server, "kvservice_rpc_duration_seconds_count", method="KeepAlive")


async def audit_ok(stub: Stub) -> pb.AuditResponse:
    report: pb.AuditResponse = await stub.Audit(pb.AuditRequest())
    assert report.ok, list(report.violations)
    return report


@pytest.fixture
def server_config() -> ServerConfig:
    return LEASE_POOL


class TestExpiry:
    async def test_a_lease_that_is_not_renewed_frees_its_requests(
        self, server: KVCacheServer, stub: Stub
    ) -> None:
        """A session that stops renewing loses its requests once the lease runs out;
        an unowned request is untouched, and the pool is whole again after it."""
        session = await open_session(stub)
        await add_and_admit(stub, "owned-1", 20, session.session_id)
        await add_and_admit(stub, "owned-2", 40, session.session_id)
        await add_and_admit(stub, "unowned", 16, "")
        assert (await usage(stub)).num_used_blocks == 2 + 3 + 1

        async def only_unowned_left() -> bool:
            return (await usage(stub)).num_requests == 1

        await wait_until(only_unowned_left, "the lease to run out")
        pool = await usage(stub)
        assert pool.num_used_blocks == 1
        assert metric(server, "kvservice_session_expirations_total", reason="ttl") == 1
        assert metric(server, "kvservice_requests_reclaimed_total") == 2
        assert metric(server, "kvservice_sessions_active") == 0
        message = await expect_error(
            stub.GetUsage(pb.GetUsageRequest(), metadata=session_md(session.session_id)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert "lease ran out" in message and "open a new session" in message
        await stub.FreeRequest(
            pb.FreeRequestRequest(request_id="unowned", mode=pb.FREE_MODE_FINISH)
        )
        assert (await usage(stub)).num_used_blocks == 0
        assert (await audit_ok(stub)).num_sessions == 0

    async def test_a_finished_request_is_no_longer_owned(
        self, server: KVCacheServer, stub: Stub
    ) -> None:
        """A request the client finishes itself is not counted as reclaimed."""
        session = await open_session(stub)
        await add_and_admit(stub, "a", 16, session.session_id)
        await add_and_admit(stub, "b", 16, session.session_id)
        await stub.FreeRequest(
            pb.FreeRequestRequest(request_id="a", mode=pb.FREE_MODE_FINISH),
            metadata=session_md(session.session_id),
        )
        assert (await audit_ok(stub)).num_owned_requests == 1

        async def expired() -> bool:
            return metric(server, "kvservice_session_expirations_total", reason="ttl") == 1

        await wait_until(expired, "the lease to run out")
        assert metric(server, "kvservice_requests_reclaimed_total") == 1
        assert (await usage(stub)).num_requests == 0


class TestStreams:
    async def test_a_broken_stream_ends_the_lease_at_once(
        self, server: KVCacheServer, stub: Stub
    ) -> None:
        """A StepStream opened under a session that the client drops frees the
        session's requests without waiting for the (long) lease."""
        session = await open_session(stub, ttl_s=600)
        call = stub.StepStream(metadata=session_md(session.session_id))
        step = pb.StepRequest(
            ops=[
                pb.StepOperation(
                    add_request=pb.AddRequestRequest(request_id="s", prompt_token_ids=tokens(32))
                ),
                pb.StepOperation(
                    allocate_slots=pb.AllocateSlotsRequest(request_id="s", num_new_tokens=32)
                ),
            ]
        )
        await call.write(pb.StepStreamRequest(step=step))
        answer = await call.read()
        assert answer.step.results[1].allocate_slots.outcome == pb.ALLOCATION_OUTCOME_OK
        assert (await usage(stub)).num_used_blocks == 2
        call.cancel()

        async def freed() -> bool:
            return (await usage(stub)).num_requests == 0

        await wait_until(freed, "the broken stream to free the session's requests")
        assert metric(server, "kvservice_session_expirations_total", reason="stream_broken") == 1
        assert metric(server, "kvservice_requests_reclaimed_total") == 1
        assert (await usage(stub)).num_used_blocks == 0
        message = await expect_error(
            stub.KeepAlive(pb.KeepAliveRequest(session_id=session.session_id)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert "stream broke" in message
        await audit_ok(stub)

    async def test_a_stream_closed_cleanly_keeps_the_session(self, stub: Stub) -> None:
        """Half-closing the stream is not a crash: the session and its requests stay."""
        session = await open_session(stub, ttl_s=600)
        md = session_md(session.session_id)
        call = stub.StepStream(metadata=md)
        add = pb.AddRequestRequest(request_id="kept", prompt_token_ids=tokens(8))
        await call.write(
            pb.StepStreamRequest(step=pb.StepRequest(ops=[pb.StepOperation(add_request=add)]))
        )
        await call.read()
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        await stub.KeepAlive(pb.KeepAliveRequest(session_id=session.session_id))
        assert (await audit_ok(stub)).num_owned_requests == 1


class TestClose:
    async def test_close_with_free_requests(self, stub: Stub) -> None:
        session = await open_session(stub, ttl_s=600)
        await add_and_admit(stub, "a", 30, session.session_id)
        closed = await stub.CloseSession(
            pb.CloseSessionRequest(session_id=session.session_id, free_requests=True)
        )
        assert closed.num_requests_freed == 1
        assert (await usage(stub)).num_used_blocks == 0
        await expect_error(
            stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )

    async def test_close_without_freeing_leaves_the_requests_unowned(
        self, server: KVCacheServer, stub: Stub
    ) -> None:
        """The requests survive the close and are no session's to reclaim."""
        session = await open_session(stub, ttl_s=600)
        await add_and_admit(stub, "a", 30, session.session_id)
        closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id))
        assert closed.num_requests_freed == 0
        report = await audit_ok(stub)
        assert (report.num_requests, report.num_owned_requests, report.num_sessions) == (1, 0, 0)
        assert metric(server, "kvservice_requests_reclaimed_total") == 0


class TestRefusals:
    @pytest.mark.parametrize("ttl", [0.05, 7200.0, -1.0, math.nan, math.inf])
    async def test_ttl_out_of_bounds(self, stub: Stub, ttl: float) -> None:
        message = await expect_error(
            stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=ttl)),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "ttl_seconds" in message and "[0.1, 3600.0]" in message
        assert (await audit_ok(stub)).num_sessions == 0

    async def test_zero_ttl_takes_the_default(self, stub: Stub) -> None:
        session = await open_session(stub, ttl_s=0)
        assert session.ttl_seconds == LEASE_POOL.session_ttl_default_s

    async def test_unknown_session_is_not_found_and_changes_nothing(self, stub: Stub) -> None:
        add = pb.AddRequestRequest(request_id="x", prompt_token_ids=tokens(4))
        message = await expect_error(
            stub.AddRequest(add, metadata=session_md("no-such-session")),
            grpc.StatusCode.NOT_FOUND,
        )
        assert "'no-such-session'" in message and "OpenSession" in message
        assert (await usage(stub)).num_requests == 0
        await expect_error(
            stub.KeepAlive(pb.KeepAliveRequest(session_id="no-such-session")),
            grpc.StatusCode.NOT_FOUND,
        )

    async def test_require_sessions(self) -> None:
        """With require_sessions, mutating calls need a session; reads do not."""
        config = dataclasses.replace(LEASE_POOL, require_sessions=True)
        async with running_server(config) as server, raw_stub(server) as stub:
            add = pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(4))
            message = await expect_error(stub.AddRequest(add), grpc.StatusCode.FAILED_PRECONDITION)
            assert "require_sessions" in message and SESSION_KEY in message
            assert (await usage(stub)).num_requests == 0
            session = await open_session(stub, ttl_s=600)
            await stub.AddRequest(add, metadata=session_md(session.session_id))
            assert (await usage(stub)).num_requests == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TestRegistry:
    """The lease arithmetic on a real request table, with a clock the test moves."""

    def make(self) -> tuple[SessionRegistry, RequestTable, FakeClock]:
        clock = FakeClock()
        table = RequestTable(build_manager(SMALL_POOL))
        policy = SessionPolicy(ttl_min_s=1.0, ttl_default_s=10.0, ttl_max_s=100.0)
        return SessionRegistry(table, policy, clock=clock), table, clock

    def test_every_resolve_renews_the_lease(self) -> None:
        registry, table, clock = self.make()
        session = registry.open("", 10.0, "s", 0).session
        table.add_request(
            NewRequest("r", tokens(8)), session_id=session.session_id, tenant=DEFAULT_TENANT
        )
        for _ in range(5):
            clock.now += 9.0
            registry.resolve(session.session_id, "")
            assert registry.reap() == 0
        clock.now += 10.0
        assert registry.reap() == 1
        with pytest.raises(RequestNotFoundError):
            table.get_request("r", tenant=DEFAULT_TENANT)
        with pytest.raises(SessionEndedError, match="lease ran out"):
            registry.resolve(session.session_id, "")

    def test_an_open_stream_holds_the_lease(self) -> None:
        registry, _, clock = self.make()
        session = registry.open("", 10.0, "s", 0).session
        registry.stream_opened(session)
        clock.now += 1000.0
        assert registry.reap() == 0
        registry.stream_closed(session, broken=False)
        # A clean close restarts the lease from now.
        assert registry.reap() == 0
        clock.now += 10.0
        assert registry.reap() == 1

    def test_a_lapsed_lease_is_ended_by_the_call_that_finds_it(self) -> None:
        registry, _, clock = self.make()
        session = registry.open("", 10.0, "s", 0).session
        clock.now += 10.0
        with pytest.raises(SessionEndedError):
            registry.resolve(session.session_id, "")
        assert registry.num_sessions == 0

    def test_sessions_belong_to_their_tenant(self) -> None:
        registry, _, _ = self.make()
        session = registry.open("tenant-a", 10.0, "s", 0).session
        with pytest.raises(SessionNotFoundError):
            registry.resolve(session.session_id, "tenant-b")
        with pytest.raises(SessionNotFoundError):
            registry.close(session.session_id, "tenant-b", free_requests=True)
        assert registry.resolve(session.session_id, "tenant-a") is session

    def test_policy_bounds_are_checked(self) -> None:
        with pytest.raises(InvalidArgumentError, match="session_ttl_min"):
            SessionPolicy(ttl_min_s=5.0, ttl_default_s=1.0, ttl_max_s=10.0)
        with pytest.raises(InvalidArgumentError, match="session_ttl_min"):
            KVCacheServer(dataclasses.replace(SMALL_POOL, session_ttl_min_s=0.0))

    def test_freeing_under_a_session_releases_ownership(self) -> None:
        registry, table, _ = self.make()
        session = registry.open("", 10.0, "s", 0).session
        table.add_request(
            NewRequest("r", tokens(8)), session_id=session.session_id, tenant=DEFAULT_TENANT
        )
        assert registry.num_owned_requests == 1
        table.free("r", FreeMode.FINISH, tenant=DEFAULT_TENANT)
        assert registry.num_owned_requests == 0
        assert registry.violations() == []


class TestClients:
    async def test_async_client_keeps_its_lease_alive(self, server: KVCacheServer) -> None:
        """The client renews in the background past several TTLs; closing the lease
        frees what the session owns."""
        async with AsyncKVClient(server.handle.target) as client:
            lease = await client.open_session(CLIENT_TTL_S, client_name="aio")
            await client.add_request("r", tokens(20))
            assert await client.allocate_slots("r", 20) is not None

            async def renewed_many_times() -> bool:
                return keep_alives(server) >= 6  # two TTLs' worth of renewals

            await wait_until(renewed_many_times, "the background renewals")
            assert lease.lost is None
            assert (await client.get_request("r")).num_computed_tokens == 20
            assert await lease.close() == 1
            assert (await client.get_usage()).num_used_blocks == 0
            # Without the session, calls work as before (unowned requests).
            await client.add_request("after", tokens(4))
            assert (await client.audit()).num_owned_requests == 0

    async def test_a_lease_that_stops_renewing_is_lost(self, server: KVCacheServer) -> None:
        async with AsyncKVClient(server.handle.target) as client:
            lease = await client.open_session(SHORT_TTL_S)
            await client.add_request("r", tokens(4))
            await lease.stop_renewing()

            async def reclaimed() -> bool:
                return metric(server, "kvservice_requests_reclaimed_total") == 1

            await wait_until(reclaimed, "the lease to run out")
            with pytest.raises(FailedPreconditionError, match="open a new session"):
                await client.get_usage()

    def test_sync_client_keeps_its_lease_alive(self) -> None:
        with server_in_thread(LEASE_POOL) as threaded, KVClient(threaded.target) as client:
            lease = client.open_session(CLIENT_TTL_S, client_name="sync")
            client.add_request("r", tokens(20))
            assert client.allocate_slots("r", 20) is not None
            server = threaded.server
            deadline = time.monotonic() + WAIT_TIMEOUT_S
            while threaded.call(lambda: keep_alives(server)) < 6:
                assert time.monotonic() < deadline, "timed out waiting for the renewals"
                time.sleep(0.05)
            assert lease.lost is None
            assert client.get_request("r").num_tokens == 20
            assert lease.close() == 1
            assert client.get_usage().num_used_blocks == 0
            assert client.audit().ok


async def test_admit_helper_still_works_without_sessions(stub: Stub) -> None:
    """Calls without session metadata keep working: the request is simply unowned."""
    await stub.AddRequest(pb.AddRequestRequest(request_id="plain", prompt_token_ids=tokens(20)))
    assert (await admit(stub, "plain")).outcome == pb.ALLOCATION_OUTCOME_OK
    report = await audit_ok(stub)
    assert (report.num_requests, report.num_owned_requests) == (1, 0)


TENANT_TOKENS = {name: secrets.token_urlsafe(24) for name in ("alpha", "beta")}


class TestTenants:
    """With bearer tokens, sessions and epochs are each tenant's own."""

    def auth(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TENANT_TOKENS[tenant]}"),)

    async def test_sessions_and_epochs_are_per_tenant(self, tmp_path: Path) -> None:
        tokens_file = tmp_path / "tokens.toml"
        tokens_file.write_text(
            "".join(
                f'[tenants."{name}"]\ntokens = ["{token}"]\nadmin = true\n'
                for name, token in TENANT_TOKENS.items()
            )
        )
        config = dataclasses.replace(LEASE_POOL, auth_tokens_file=str(tokens_file))
        async with running_server(config) as server, raw_stub(server) as stub:
            alpha, beta = self.auth("alpha"), self.auth("beta")
            opened = await stub.OpenSession(
                pb.OpenSessionRequest(ttl_seconds=SHORT_TTL_S, epoch=3), metadata=alpha
            )
            alpha_md = (*alpha, *session_md(opened.session_id))
            for rid in ("a1", "a2"):
                add = pb.AddRequestRequest(request_id=rid, prompt_token_ids=tokens(20))
                await stub.AddRequest(add, metadata=alpha_md)
                await stub.AllocateSlots(
                    pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=20),
                    metadata=alpha_md,
                )
            # Another tenant can neither use nor see alpha's session...
            await expect_error(
                stub.GetUsage(
                    pb.GetUsageRequest(), metadata=(*beta, *session_md(opened.session_id))
                ),
                grpc.StatusCode.NOT_FOUND,
            )
            # ...nor fence alpha's scheduler with a higher epoch of its own.
            await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600, epoch=9), metadata=beta)
            await stub.KeepAlive(pb.KeepAliveRequest(session_id=opened.session_id), metadata=alpha)

            async def reclaimed() -> bool:
                return metric(server, "kvservice_requests_reclaimed_total") == 2

            # alpha's lease runs out: its requests are freed under alpha's name.
            await wait_until(reclaimed, "alpha's lease to run out")
            # Only its own tenant learns that the session ended.
            for who, code in (
                (alpha, grpc.StatusCode.FAILED_PRECONDITION),
                (beta, grpc.StatusCode.NOT_FOUND),
            ):
                await expect_error(
                    stub.KeepAlive(pb.KeepAliveRequest(session_id=opened.session_id), metadata=who),
                    code,
                )
            pool = await stub.GetUsage(pb.GetUsageRequest(), metadata=beta)
            assert (pool.num_requests, pool.num_used_blocks) == (0, 0)
            report = await stub.Audit(pb.AuditRequest(), metadata=alpha)
            assert report.ok, list(report.violations)
            assert report.current_epoch == 3

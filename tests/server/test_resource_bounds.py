"""Bounds on what a hostile client could otherwise grow without limit: the multimodal
items a tenant's requests keep (their number and their identifiers' bytes, over all
prompts), the sessions open and the StepStreams open at once (per tenant and in all).
Each is a setting with a flag, refused RESOURCE_EXHAUSTED with a message naming the
limit and its flag, counted in ``kvservice_refusals_total``, changes nothing, and is
given back when the request is freed, the session ends or the stream closes. And the
session reaper: its tick looks only at the leases that are due, never at every idle
session."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.invariants import InvariantViolationError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.limits import RequestLimits, mm_identifier_bytes
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import FreeMode, NewRequest
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.sessions import SessionPolicy, SessionRegistry
from kvservice.server.settings import load_settings
from tests.server.support import SMALL_POOL, tokens
from tests.server.test_limits import add_message, mm, refusals, refused
from tests.server.test_sessions import FakeClock, session_md
from tests.server.test_tenants import TOKENS, auth, write_tokens_file
from tests.servers import Stub, raw_stub, running_server

# Generous: only a safety net for a stream's end to reach the server.
WAIT_TIMEOUT_S = 10.0

MM_LIMITED = dataclasses.replace(
    SMALL_POOL,
    max_mm_identifier_length=8,
    max_mm_items_per_prompt=3,
    max_mm_items_per_tenant=5,
    max_mm_identifier_bytes_per_tenant=30,
)


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_TIMEOUT_S
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def items(*identifiers: str) -> list[pb.MultiModalFeature]:
    return [mm(identifier, offset) for offset, identifier in enumerate(identifiers)]


def free_message(rid: str) -> pb.FreeRequestRequest:
    return pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH)


# -- multimodal items per tenant ---------------------------------------------------------


async def test_mm_items_and_identifier_bytes_per_tenant() -> None:
    """Past either per-tenant multimodal limit AddRequest (alone or in a Step) is
    refused RESOURCE_EXHAUSTED naming the limit and its flag, counted, and nothing is
    added; finishing a request gives its items and bytes back."""
    async with running_server(MM_LIMITED) as server, raw_stub(server) as stub:
        ledger = server.table.requests_per_tenant
        await stub.AddRequest(add_message("r0", mm_features=items("a" * 8, "b" * 8, "c" * 8)))
        assert (ledger.mm_items(""), ledger.mm_identifier_bytes("")) == (3, 24)
        details = await refused(
            stub.AddRequest(add_message("r1", mm_features=items("d" * 8))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        assert "max_mm_identifier_bytes_per_tenant" in details
        assert "--max-mm-identifier-bytes-per-tenant" in details and "32" in details
        assert refusals(server, "max_mm_identifier_bytes_per_tenant") == 1
        assert (ledger.mm_items(""), ledger.mm_identifier_bytes("")) == (3, 24)
        await stub.AddRequest(add_message("r1", mm_features=items("dd", "ee")))  # 5 items, 28 B
        details = await refused(
            stub.AddRequest(add_message("r2", mm_features=items("f"))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        assert "max_mm_items_per_tenant" in details and "--max-mm-items-per-tenant" in details
        assert refusals(server, "max_mm_items_per_tenant") == 1
        # The same refusal for an operation of a Step; the others run.
        step = pb.StepRequest(step_id=1)
        step.ops.add().add_request.CopyFrom(add_message("r2", mm_features=items("f")))
        step.ops.add().get_usage.SetInParent()
        answer = await stub.Step(step)
        assert answer.results[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "max_mm_items_per_tenant" in answer.results[0].error.message
        assert answer.results[1].WhichOneof("result") == "get_usage"
        assert refusals(server, "max_mm_items_per_tenant") == 2
        assert server.table.num_requests == 2
        assert (ledger.mm_items(""), ledger.mm_identifier_bytes("")) == (5, 28)
        # A preemption keeps the items (the request keeps them); a finish frees them.
        await stub.FreeRequest(free_message("r0"))
        assert (ledger.mm_items(""), ledger.mm_identifier_bytes("")) == (2, 4)
        await stub.AddRequest(add_message("r2", mm_features=items("g" * 8, "h" * 8, "i" * 8)))
        assert (ledger.mm_items(""), ledger.mm_identifier_bytes("")) == (5, 28)
        for rid in ("r1", "r2"):
            await stub.FreeRequest(free_message(rid))
        assert (ledger.mm_items(""), ledger.mm_identifier_bytes("")) == (0, 0)
        server.audit()


async def test_mm_limits_are_per_tenant(tmp_path: Path) -> None:
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {name: {"tokens": [TOKENS[name]]} for name in ("alpha", "beta")},
    )
    config = dataclasses.replace(MM_LIMITED, auth_tokens_file=tokens_file)
    async with running_server(config) as server, raw_stub(server) as stub:
        full = add_message("r", mm_features=items("a", "b", "c"))
        more = add_message("s", mm_features=items("d", "e", "f"))
        await stub.AddRequest(full, metadata=auth("alpha"))
        details = await refused(
            stub.AddRequest(more, metadata=auth("alpha")), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert "tenant 'alpha'" in details
        # alpha at its limit does not hold beta back.
        await stub.AddRequest(full, metadata=auth("beta"))
        await stub.AddRequest(add_message("s", mm_features=items("d", "e")), metadata=auth("beta"))
        assert refusals(server, "max_mm_items_per_tenant", "alpha") == 1
        assert refusals(server, "max_mm_items_per_tenant", "beta") == 0
        server.audit()


def test_mm_ledger_is_audited_and_counts_utf8_bytes() -> None:
    assert mm_identifier_bytes([MultiModalFeature("éé", 0, 1), MultiModalFeature("ab", 1, 1)]) == 6
    limits = RequestLimits(max_mm_items_per_tenant=4, max_mm_identifier_bytes_per_tenant=100)
    table = RequestTable(build_manager(SMALL_POOL), limits=limits)
    feature = MultiModalFeature("ééé", 0, 1)
    table.add_request(NewRequest("a", tokens(8), mm_features=(feature,)), tenant="")
    assert table.requests_per_tenant.mm_identifier_bytes("") == 6
    table.audit()
    table.requests_per_tenant.added("", 0, 0, 1, 0)
    table.requests_per_tenant.finished("", 0)  # the request count back, one item left
    with pytest.raises(InvariantViolationError, match="multimodal items"):
        table.audit()
    table.requests_per_tenant.finished("", 0, 0, 1, 0)
    table.requests_per_tenant.added("", 0)
    table.audit()
    table.free("a", FreeMode.FINISH, tenant="")
    assert table.requests_per_tenant.mm_items("") == 0


# -- sessions ----------------------------------------------------------------------------


async def test_sessions_per_tenant_and_in_all(tmp_path: Path) -> None:
    """OpenSession past max_sessions_per_tenant or max_sessions is refused
    RESOURCE_EXHAUSTED naming the limit and its flag, counted, and changes nothing
    (not even the epoch); closing a session gives its place back."""
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {name: {"tokens": [TOKENS[name]]} for name in ("alpha", "beta")},
    )
    config = dataclasses.replace(
        SMALL_POOL, auth_tokens_file=tokens_file, max_sessions_per_tenant=2, max_sessions=3
    )
    async with running_server(config) as server, raw_stub(server) as stub:

        def open_as(tenant: str, epoch: int = 0) -> Any:
            return stub.OpenSession(
                pb.OpenSessionRequest(ttl_seconds=600, client_name="t", epoch=epoch),
                metadata=auth(tenant),
            )

        alpha = [await open_as("alpha") for _ in range(2)]
        details = await refused(open_as("alpha", epoch=5), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "max_sessions_per_tenant" in details and "--max-sessions-per-tenant" in details
        assert "tenant 'alpha'" in details and "2" in details
        assert server.sessions.current_epoch("alpha") == 0  # the refused epoch not taken
        assert server.sessions.num_sessions == 2
        assert refusals(server, "max_sessions_per_tenant", "alpha") == 1
        await open_as("beta")
        details = await refused(open_as("beta"), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "max_sessions" in details and "--max-sessions" in details and "3" in details
        assert "per_tenant" not in details
        assert refusals(server, "max_sessions", "beta") == 1
        await stub.CloseSession(
            pb.CloseSessionRequest(session_id=alpha[0].session_id, free_requests=True),
            metadata=auth("alpha"),
        )
        await open_as("beta")
        assert server.sessions.num_sessions_of("beta") == 2
        server.audit()


def test_an_expired_session_gives_its_place_back() -> None:
    clock = FakeClock()
    policy = SessionPolicy(ttl_min_s=1.0, ttl_default_s=10.0, max_sessions_per_tenant=1)
    registry = SessionRegistry(RequestTable(build_manager(SMALL_POOL)), policy, clock=clock)
    registry.open("", 10.0, "s", 0)
    with pytest.raises(Exception, match="max_sessions_per_tenant"):
        registry.open("", 10.0, "s", 0)
    clock.now += 10.0
    assert registry.reap() == 1
    registry.open("", 10.0, "s", 0)
    assert registry.num_sessions_of("") == 1


def test_the_reaper_looks_only_at_due_leases() -> None:
    """A tick inspects the heap entries that are due, not every session: idle leases
    cost nothing until they may have run out; a renewed one is looked at once per
    lease, not once per tick."""
    clock = FakeClock()
    policy = SessionPolicy(ttl_min_s=1.0, ttl_default_s=10.0, ttl_max_s=1000.0)
    registry = SessionRegistry(RequestTable(build_manager(SMALL_POOL)), policy, clock=clock)
    idle = [registry.open("", 100.0, "idle", 0).session for _ in range(1000)]
    registry.open("", 1.0, "short", 0)
    for _ in range(9):  # ticks with nothing due
        clock.now += 0.1
        assert registry.reap() == 0
    assert registry.num_inspected == 0
    clock.now += 0.2
    assert registry.reap() == 1
    assert registry.num_inspected == 1
    assert registry.next_expiry_in() == pytest.approx(100.0 - 1.1)
    clock.now += 60.0
    for session in idle[:500]:
        registry.resolve(session.session_id, "")  # renewed: the heap is not touched
    assert registry.num_queued == 1000
    clock.now += 39.0
    assert registry.reap() == 500  # the others were renewed
    assert registry.num_inspected == 1 + 1000
    assert registry.num_queued == 500
    clock.now += 62.0
    assert registry.reap() == 500
    assert registry.num_sessions == 0 and registry.num_queued == 0


def test_session_and_stream_limit_settings() -> None:
    """Each new limit is a setting with a flag and an environment variable and a
    positive default; a non-positive one fails startup."""
    assert SessionPolicy.of(ServerConfig()) == SessionPolicy()
    config = ServerConfig()
    assert config.request_limits == RequestLimits()
    settings = load_settings(
        {"max_sessions": 7, "max_mm_items_per_tenant": 8},
        {
            "KVSERVICE_MAX_STEP_STREAMS": "9",
            "KVSERVICE_MAX_STEP_STREAMS_PER_TENANT": "3",
            "KVSERVICE_MAX_SESSIONS_PER_TENANT": "2",
            "KVSERVICE_MAX_MM_IDENTIFIER_BYTES_PER_TENANT": "10",
        },
    ).server
    assert (
        settings.max_sessions,
        settings.max_sessions_per_tenant,
        settings.max_step_streams,
        settings.max_step_streams_per_tenant,
        settings.max_mm_items_per_tenant,
        settings.max_mm_identifier_bytes_per_tenant,
    ) == (7, 2, 9, 3, 8, 10)
    for name in ("max_sessions", "max_step_streams_per_tenant", "max_mm_items_per_tenant"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            overrides: dict[str, Any] = {name: 0}
            KVCacheServer(dataclasses.replace(SMALL_POOL, **overrides))


# -- StepStreams -------------------------------------------------------------------------


@pytest.fixture
async def stream_server(tmp_path: Path) -> AsyncIterator[KVCacheServer]:
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {name: {"tokens": [TOKENS[name]]} for name in ("alpha", "beta", "gamma")},
    )
    config = dataclasses.replace(
        SMALL_POOL,
        auth_tokens_file=tokens_file,
        max_step_streams_per_tenant=1,
        max_step_streams=2,
        session_ttl_min_s=0.1,
    )
    async with running_server(config) as server:
        yield server


async def open_stream(stub: Stub, metadata: tuple[tuple[str, str], ...]) -> Any:
    """A StepStream that answered one step (so it is open on the server)."""
    call = stub.StepStream(metadata=metadata)
    step = pb.StepRequest(step_id=1)
    step.ops.add().get_usage.SetInParent()
    await call.write(pb.StepStreamRequest(step=step))
    await call.read()
    return call


async def stream_refusal(stub: Stub, metadata: tuple[tuple[str, str], ...]) -> str:
    call = stub.StepStream(metadata=metadata)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        step = pb.StepRequest(step_id=1)
        step.ops.add().get_usage.SetInParent()
        await call.write(pb.StepStreamRequest(step=step))
        await call.read()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    return info.value.details() or ""


async def test_step_streams_per_tenant_and_in_all(stream_server: KVCacheServer) -> None:
    """A StepStream past max_step_streams_per_tenant or max_step_streams is refused
    RESOURCE_EXHAUSTED naming the limit and its flag, counted, renews no lease; a
    stream that ends gives its place back."""
    server, registry = stream_server, stream_server.sessions
    async with raw_stub(server) as stub:
        session = await stub.OpenSession(
            pb.OpenSessionRequest(ttl_seconds=600, client_name="t"), metadata=auth("alpha")
        )
        md = (*auth("alpha"), *session_md(session.session_id))
        first = await open_stream(stub, md)
        assert registry.num_streams("alpha") == 1
        expires = registry._sessions[session.session_id].expires_at
        details = await stream_refusal(stub, md)
        assert "max_step_streams_per_tenant" in details
        assert "--max-step-streams-per-tenant" in details and "tenant 'alpha'" in details
        assert registry._sessions[session.session_id].expires_at == expires  # not renewed
        assert refusals(server, "max_step_streams_per_tenant", "alpha") == 1
        second = await open_stream(stub, auth("beta"))
        assert registry.num_streams() == 2
        await first.done_writing()
        await wait_for(lambda: registry.num_streams("alpha") == 0, "alpha's stream to end")
        await open_stream(stub, auth("alpha"))
        # gamma holds no stream, but the server is full.
        details = await stream_refusal(stub, auth("gamma"))
        assert "max_step_streams" in details and "--max-step-streams" in details
        assert "per_tenant" not in details
        assert refusals(server, "max_step_streams", "gamma") == 1
        assert registry.num_streams() == 2
        second.cancel()
        await wait_for(lambda: registry.num_streams("beta") == 0, "beta's stream to end")
        await open_stream(stub, auth("gamma"))
        assert registry.num_streams() == 2
        server.audit()

"""What one caller may send and hold, over real gRPC: every string field of a new
request has a length limit, a prompt a number of multimodal items, and a tenant a
number of requests, of waiting tokens and of prompt-embedding bytes. Each is a
setting with a default, refused with a status naming it, counted, and leaves nothing
behind."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvservice.client import AsyncKVClient, ResourceExhaustedError, StepBuilder
from kvservice.core.invariants import InvariantViolationError
from kvservice.protocol import pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.limits import RequestLimits
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, FreeMode, NewRequest
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.metrics import MAX_TRACKED_CLIENTS, ClientTracker
from kvservice.server.settings import load_settings
from tests.server.support import SMALL_POOL, tokens
from tests.server.test_tenants import TOKENS, auth, write_tokens_file
from tests.servers import Stub, raw_stub, running_server

# Small limits, so each is reached in a few calls.
LIMITED = dataclasses.replace(
    SMALL_POOL,
    max_request_id_length=16,
    max_cache_salt_length=8,
    max_lora_name_length=8,
    max_lora_path_length=8,
    max_mm_identifier_length=8,
    max_mm_items_per_prompt=3,
    max_requests_per_tenant=3,
    max_waiting_tokens_per_tenant=100,
    max_prompt_embeds_bytes_per_tenant=96,
)


@pytest.fixture
def server_config() -> ServerConfig:
    return LIMITED


async def refused(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


def refusals(server: KVCacheServer, reason: str, tenant: str = "") -> float:
    value = server.metrics.registry.get_sample_value(
        "kvservice_refusals_total", {**server.metrics.labels, "tenant": tenant, "reason": reason}
    )
    return value or 0.0


def gauge(server: KVCacheServer, name: str, tenant: str = "") -> float | None:
    labels = {**server.metrics.labels, "tenant": tenant}
    return server.metrics.registry.get_sample_value(name, labels)


def add_message(
    rid: str = "r", prompt: list[int] | None = None, **fields: Any
) -> pb.AddRequestRequest:
    return pb.AddRequestRequest(request_id=rid, prompt_token_ids=prompt or tokens(8), **fields)


def mm(identifier: str, offset: int = 0) -> pb.MultiModalFeature:
    return pb.MultiModalFeature(identifier=identifier, offset=offset, length=1)


# One case per string field, and the multimodal item count: the longest value accepted,
# then one too many.
FIELD_CASES: dict[str, tuple[str, Callable[[int], pb.AddRequestRequest], int]] = {
    "request_id": (
        "max_request_id_length",
        lambda n: add_message(rid="x" * n),
        16,
    ),
    "cache_salt": ("max_cache_salt_length", lambda n: add_message(cache_salt="s" * n), 8),
    "lora_name": ("max_lora_name_length", lambda n: add_message(lora_name="l" * n), 8),
    "lora_path": (
        "max_lora_path_length",
        lambda n: add_message(lora_name="l", lora_path="p" * n),
        8,
    ),
    "mm_identifier": (
        "max_mm_identifier_length",
        lambda n: add_message(mm_features=[mm("i" * n)]),
        8,
    ),
    "mm_items": (
        "max_mm_items_per_prompt",
        lambda n: add_message(mm_features=[mm(f"i{k}", k) for k in range(n)]),
        3,
    ),
}


@pytest.mark.parametrize("case", FIELD_CASES)
async def test_each_field_has_a_limit(server: KVCacheServer, stub: Stub, case: str) -> None:
    """At the limit the request is accepted; one past it is refused INVALID_ARGUMENT
    naming the setting, counted under it, and nothing is added."""
    limit, message, size = FIELD_CASES[case]
    await stub.AddRequest(message(size))
    await stub.FreeRequest(
        pb.FreeRequestRequest(request_id=message(size).request_id, mode=pb.FREE_MODE_FINISH)
    )
    details = await refused(stub.AddRequest(message(size + 1)), grpc.StatusCode.INVALID_ARGUMENT)
    assert limit in details and str(size) in details
    assert refusals(server, limit) == 1
    assert server.table.num_requests == 0
    server.audit()


async def test_a_huge_request_id_is_refused_without_being_echoed(stub: Stub) -> None:
    """The issue's 3.9 MB id, under the message limit: refused, and the answer quotes
    only its start."""
    async with running_server(dataclasses.replace(SMALL_POOL)) as server:
        async with raw_stub(server) as default_stub:
            details = await refused(
                default_stub.AddRequest(add_message(rid="x" * 3_900_000)),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        assert "max_request_id_length" in details and "3900000 characters" in details
        assert len(details) < 300
        assert server.table.num_requests == 0


async def test_too_many_multimodal_items_are_refused_before_they_are_read() -> None:
    """The issue's 180,000-item prompt (2.7 MB), under the message limit: refused by
    the default limit, the items never turned into Python values."""
    async with running_server(dataclasses.replace(SMALL_POOL, max_model_len=128)) as server:
        message = pb.AddRequestRequest(
            request_id="mm", packed_prompt_token_ids=pack_token_ids(tokens(128))
        )
        message.mm_features.extend(mm(f"{k:08x}", k % 128) for k in range(180_000))
        assert message.ByteSize() < ServerConfig().max_message_bytes
        async with raw_stub(server) as stub:
            details = await refused(stub.AddRequest(message), grpc.StatusCode.INVALID_ARGUMENT)
        assert "180000 multimodal items" in details and "max_mm_items_per_prompt" in details
        assert server.table.num_requests == 0


async def test_requests_per_tenant(server: KVCacheServer, stub: Stub) -> None:
    """A caller holding max_requests_per_tenant requests is refused RESOURCE_EXHAUSTED
    naming the limit until it finishes one; the count is exported."""
    for n in range(3):
        await stub.AddRequest(add_message(rid=f"r{n}"))
    assert gauge(server, "kvservice_tenant_requests") == 3
    details = await refused(
        stub.AddRequest(add_message(rid="r3")), grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert "max_requests_per_tenant" in details and "3" in details
    assert refusals(server, "max_requests_per_tenant") == 1
    assert server.table.num_requests == 3
    await stub.FreeRequest(pb.FreeRequestRequest(request_id="r0", mode=pb.FREE_MODE_FINISH))
    await stub.AddRequest(add_message(rid="r3"))
    server.audit()


async def test_waiting_tokens_per_tenant(server: KVCacheServer, stub: Stub) -> None:
    """Tokens of requests that are not running count against the limit: admitting one
    makes room, preempting it takes the room back (never refused), appending to a
    waiting request counts too."""
    await stub.AddRequest(add_message(rid="a", prompt=tokens(60)))
    await stub.AddRequest(add_message(rid="b", prompt=tokens(40, start=100)))
    assert gauge(server, "kvservice_tenant_waiting_tokens") == 100
    details = await refused(
        stub.AddRequest(add_message(rid="c", prompt=tokens(1, start=200))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert "max_waiting_tokens_per_tenant" in details and "100" in details
    await refused(
        stub.AppendTokens(pb.AppendTokensRequest(request_id="b", token_ids=[7])),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    await stub.AllocateSlots(pb.AllocateSlotsRequest(request_id="a", num_new_tokens=60))
    assert gauge(server, "kvservice_tenant_waiting_tokens") == 40
    await stub.AppendTokens(pb.AppendTokensRequest(request_id="a", token_ids=[7]))  # running
    await stub.AddRequest(add_message(rid="c", prompt=tokens(60, start=200)))
    assert gauge(server, "kvservice_tenant_waiting_tokens") == 100
    await stub.FreeRequest(pb.FreeRequestRequest(request_id="a", mode=pb.FREE_MODE_PREEMPT))
    assert gauge(server, "kvservice_tenant_waiting_tokens") == 161  # past it: a preemption
    await stub.FreeRequest(pb.FreeRequestRequest(request_id="c", mode=pb.FREE_MODE_FINISH))
    details = await refused(
        stub.AddRequest(add_message(rid="d", prompt=tokens(1))), grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert "max_waiting_tokens_per_tenant" in details
    assert refusals(server, "max_waiting_tokens_per_tenant") == 3
    server.audit()


async def test_prompt_embeds_bytes_per_tenant(server: KVCacheServer, stub: Stub) -> None:
    """Prompt embeddings stay with their request until it finishes, running or not:
    a tenant's total is bounded, refused RESOURCE_EXHAUSTED naming the limit, and
    finishing a request gives its bytes back."""

    def embedded(rid: str, num_tokens: int, row_bytes: int = 8) -> pb.AddRequestRequest:
        return add_message(
            rid,
            tokens(num_tokens),
            prompt_embeds=bytes(num_tokens * row_bytes),
            prompt_embeds_row_bytes=row_bytes,
        )

    await stub.AddRequest(embedded("a", 8))  # 64 bytes
    await stub.AllocateSlots(pb.AllocateSlotsRequest(request_id="a", num_new_tokens=8))
    details = await refused(stub.AddRequest(embedded("b", 8)), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "max_prompt_embeds_bytes_per_tenant" in details and "128" in details
    assert refusals(server, "max_prompt_embeds_bytes_per_tenant") == 1
    await stub.AddRequest(embedded("b", 4))  # 96: at the limit
    assert server.table.requests_per_tenant.prompt_embeds_bytes("") == 96
    await stub.FreeRequest(pb.FreeRequestRequest(request_id="a", mode=pb.FREE_MODE_FINISH))
    await stub.AddRequest(embedded("c", 8))
    assert server.table.requests_per_tenant.prompt_embeds_bytes("") == 96
    server.audit()


# Malformed LoRA and prompt-embedding fields: each refused INVALID_ARGUMENT with a
# message naming the field, nothing added.
MALFORMED: dict[str, tuple[dict[str, Any], str]] = {
    "lora_path without name": ({"lora_path": "/a"}, "lora_path is set without lora_name"),
    "lora_int_id without name": ({"lora_int_id": 3}, "lora_int_id is set without lora_name"),
    "negative lora_int_id": (
        {"lora_name": "a", "lora_int_id": -1},
        "lora_int_id = -1; vLLM's LoRA ids are >= 1",
    ),
    "embeds without width": (
        {"prompt_embeds": bytes(32)},
        "prompt_embeds (32 bytes) needs prompt_embeds_row_bytes > 0",
    ),
    "width without embeds": (
        {"prompt_embeds_row_bytes": 4},
        "prompt_embeds_row_bytes = 4 but prompt_embeds is empty",
    ),
    "embeds of another length": (
        {"prompt_embeds": bytes(36), "prompt_embeds_row_bytes": 4},
        "prompt_embeds holds 36 bytes; 8 prompt tokens of 4 bytes each are 32",
    ),
    "negative width": (
        {"prompt_embeds": bytes(32), "prompt_embeds_row_bytes": -4},
        "needs prompt_embeds_row_bytes > 0",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
async def test_malformed_lora_and_prompt_embeds_are_refused(
    server: KVCacheServer, stub: Stub, case: str
) -> None:
    fields, message = MALFORMED[case]
    details = await refused(
        stub.AddRequest(add_message(**fields)), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert message in details
    assert server.table.num_requests == 0
    assert server.table.requests_per_tenant.prompt_embeds_bytes("") == 0
    server.audit()


async def test_the_limits_are_per_tenant(tmp_path: Path) -> None:
    """One tenant at its limit does not hold back another; a refused operation of a
    Step answers its own status and the others run."""
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {name: {"tokens": [TOKENS[name]]} for name in ("alpha", "beta")},
    )
    config = dataclasses.replace(LIMITED, auth_tokens_file=tokens_file)
    async with running_server(config) as server, raw_stub(server) as stub:
        for n in range(3):
            await stub.AddRequest(add_message(rid=f"r{n}"), metadata=auth("alpha"))
        step = pb.StepRequest(step_id=1)
        step.ops.add().add_request.CopyFrom(add_message(rid="late"))
        step.ops.add().get_usage.SetInParent()
        answer = await stub.Step(step, metadata=auth("alpha"))
        assert answer.results[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "tenant 'alpha'" in answer.results[0].error.message
        assert answer.results[1].WhichOneof("result") == "get_usage"
        for n in range(3):
            await stub.AddRequest(add_message(rid=f"r{n}"), metadata=auth("beta"))
        assert refusals(server, "max_requests_per_tenant", "alpha") == 1
        assert gauge(server, "kvservice_tenant_requests", "beta") == 3
        server.audit()


async def test_the_client_raises_a_typed_error(server: KVCacheServer) -> None:
    async with AsyncKVClient(server.handle.target) as client:
        for n in range(3):
            await client.add_request(f"r{n}", tokens(4))
        with pytest.raises(ResourceExhaustedError, match="max_requests_per_tenant"):
            await client.add_request("r3", tokens(4))
        step = StepBuilder()
        handle = step.add_request("r3", tokens(4))
        results = await client.step(step)
        assert isinstance(results.error(handle), ResourceExhaustedError)


def test_the_ledger_is_audited() -> None:
    table = RequestTable(build_manager(SMALL_POOL), limits=RequestLimits())
    table.add_request(NewRequest("a", tokens(20)), tenant=DEFAULT_TENANT)
    table.allocate_slots("a", AllocateArgs(20), tenant=DEFAULT_TENANT)
    table.add_request(NewRequest("b", tokens(5)), tenant=DEFAULT_TENANT)
    table.free("a", FreeMode.PREEMPT, tenant=DEFAULT_TENANT)
    table.audit()
    assert table.requests_per_tenant.per_tenant() == {"": (2, 25)}
    table.requests_per_tenant.waiting_changed("", 1)
    with pytest.raises(InvariantViolationError, match="request ledger"):
        table.audit()
    table.requests_per_tenant.waiting_changed("", -1)
    table.add_request(
        NewRequest("c", tokens(4), prompt_embeds=bytes(8), prompt_embeds_row_bytes=2),
        tenant=DEFAULT_TENANT,
    )
    table.audit()
    table.requests_per_tenant.added("", 0, 1)
    table.requests_per_tenant.finished("", 0)  # the count back, one byte left over
    with pytest.raises(InvariantViolationError, match="prompt embeddings bytes"):
        table.audit()


def test_defaults_and_settings() -> None:
    """Every limit is a setting with a flag, an environment variable and a positive
    default; a non-positive one fails startup."""
    config = ServerConfig()
    assert config.request_limits == RequestLimits()
    assert all(getattr(RequestLimits(), f.name) > 0 for f in dataclasses.fields(RequestLimits))
    settings = load_settings(
        {"max_requests_per_tenant": 7}, {"KVSERVICE_MAX_MM_ITEMS_PER_PROMPT": "9"}
    ).server
    assert (settings.max_requests_per_tenant, settings.max_mm_items_per_prompt) == (7, 9)
    with pytest.raises(ValueError, match="max_lora_name_length must be a positive int"):
        KVCacheServer(dataclasses.replace(SMALL_POOL, max_lora_name_length=0))


def test_the_client_ids_remembered_are_bounded() -> None:
    """A caller sending a new x-client-id with every call, and nobody scraping: the
    tracker keeps at most its cap."""
    tracker = ClientTracker(clock=lambda: 0.0)
    for n in range(3 * MAX_TRACKED_CLIENTS):
        tracker.seen(f"client-{n}")
    assert tracker.count() <= MAX_TRACKED_CLIENTS

"""Retention through the server (README, Retention): pins and eviction priorities over
real gRPC, their flags, metrics and validation, and the client's values for them.

The pool is the small one (10 usable blocks of 16 tokens), so a few requests churn it.
Time is the server's monotonic clock: tests with a TTL or a duration poll the server's
state until it changes (never a fixed sleep that could flake).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.client import (
    AsyncKVClient,
    FailedPreconditionError,
    FreeMode,
    InvalidArgumentError,
    PermissionDeniedError,
    RequestNotFoundError,
    ResourceExhaustedError,
    Retention,
    StepBuilder,
    TokenRangeRetention,
    _wire,
)
from kvservice.client.types import MultiModalFeature, Pin, PinList
from kvservice.core.kv_cache_block import DEFAULT_PRIORITY
from kvservice.core.retention_policy import RetentionConfig, parse_duration
from kvservice.core.retention_policy import TokenRangeRetention as CoreTokenRange
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server import converters
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.settings import load_settings
from tests.server.support import SMALL_POOL, tokens
from tests.server.test_tenants import write_tokens_file
from tests.servers import raw_stub, running_server

BLOCK = SMALL_POOL.block_size
# Pins may reserve 5 of the 10 usable blocks.
PINNING = dataclasses.replace(SMALL_POOL, max_pinned_fraction=0.5)
PRIORITY = dataclasses.replace(SMALL_POOL, eviction_policy="priority")
RETAINED = dataclasses.replace(PINNING, eviction_policy="priority")
PREFIX = tokens(3 * BLOCK, start=500)
# Polls of server state that must change within this (the TTLs are under a second).
WAIT_S = 10.0


async def admit(client: AsyncKVClient, rid: str) -> int:
    """Look the request's prefix up and allocate the rest; the hit tokens."""
    hit = await client.get_computed_blocks(rid)
    state = await client.get_request(rid)
    allocation = await client.allocate_slots(rid, state.num_tokens - hit.num_computed_tokens, hit)
    assert allocation is not None, rid
    return hit.num_computed_tokens


async def run_once(client: AsyncKVClient, rid: str, prompt: list[int], **fields: Any) -> int:
    """Add, admit and finish a request; the hit tokens it got."""
    await client.add_request(rid, prompt, **fields)
    hit = await admit(client, rid)
    await client.free(rid, FreeMode.FINISH)
    return hit


async def hit_of(client: AsyncKVClient, rid: str, prompt: list[int]) -> int:
    """The prefix hit a new request of ``prompt`` gets now (the request is left waiting)."""
    await client.add_request(rid, prompt)
    return (await client.get_computed_blocks(rid)).num_computed_tokens


async def churn(client: AsyncKVClient, rounds: int = 2) -> None:
    """Requests of 6 blocks each, run and finished: on a pool of 10 blocks, two rounds
    evict every cached block nothing holds."""
    for i in range(rounds):
        await run_once(client, f"churn-{i}", tokens(6 * BLOCK, start=10_000 * (i + 1)))


async def poll(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait for ``check()`` (a call to the server each time) to hold."""
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


# -- pins ----------------------------------------------------------------------------


@pytest.mark.parametrize("server_config", [PINNING, SMALL_POOL], ids=["pinned", "unpinned"])
async def test_a_pinned_prefix_survives_churn_that_evicts_an_unpinned_one(
    client: AsyncKVClient, server_config: ServerConfig
) -> None:
    pinned = server_config.max_pinned_fraction > 0
    if pinned:
        pin = await client.pin_prefix(PREFIX)
        assert (pin.num_reserved_blocks, pin.num_held_blocks) == (3, 0)
    # The prefix is cached by a request, then churned through AllocateSlots/FreeRequest.
    assert await run_once(client, "first", PREFIX) == 0
    if pinned:
        (listed,) = (await client.list_pins()).pins
        assert listed.pin_id == pin.pin_id and listed.num_held_blocks == 3
        usage = await client.get_usage()
        # Pinned blocks count as used: only 7 of the 10 are free.
        assert (usage.num_free_blocks, usage.num_used_blocks) == (7, 3)
    await churn(client)
    hit = await hit_of(client, "again", [*PREFIX, *tokens(BLOCK, start=7000)])
    assert hit == (3 * BLOCK if pinned else 0)
    if pinned:
        # A hit counts once attached (the lookup takes no reference): one per block.
        await client.allocate_slots("again", BLOCK, await client.get_computed_blocks("again"))
        (listed,) = (await client.list_pins()).pins
        assert listed.num_hits == 3
        await client.free("again", FreeMode.FINISH)
        await client.unpin_prefix(pin.pin_id)
        assert (await client.list_pins()).pins == ()
        assert (await client.get_usage()).num_free_blocks == 10
    assert (await client.audit()).ok


@pytest.mark.parametrize("server_config", [PINNING])
async def test_a_pin_lets_go_when_its_ttl_runs_out(client: AsyncKVClient) -> None:
    # Long enough for the checks before it runs out, on a loaded machine too.
    pin = await client.pin_prefix(PREFIX, ttl_s=0.5)
    assert pin.ttl_s == 0.5
    assert pin.expires_in_s == pytest.approx(0.5, abs=0.01)
    await run_once(client, "first", PREFIX)
    assert (await client.get_usage()).num_free_blocks == 7

    async def expired() -> bool:
        return (await client.list_pins()).pins == ()

    await poll(expired, "the pin's TTL")
    usage = await client.get_usage()
    assert (usage.num_free_blocks, usage.num_used_blocks) == (10, 0)
    # The blocks are cached free blocks again: churn evicts them as vLLM would.
    await churn(client)
    assert await hit_of(client, "again", [*PREFIX, 1]) == 0
    assert (await client.audit()).ok


@pytest.mark.parametrize("server_config", [PINNING])
async def test_pinning_the_same_prefix_again_refreshes_the_pin(client: AsyncKVClient) -> None:
    first = await client.pin_prefix(PREFIX, ttl_s=0.2)
    again = await client.pin_prefix(PREFIX, ttl_s=3600.0, refresh_on_hit=True)
    assert again.pin_id == first.pin_id
    (listed,) = (await client.list_pins()).pins
    assert listed.ttl_s == 3600.0 and listed.refresh_on_hit
    assert (await client.list_pins()).num_reserved_blocks == 3


@pytest.mark.parametrize("server_config", [PINNING])
async def test_pins_past_the_budget_are_refused(client: AsyncKVClient) -> None:
    pins = await client.list_pins()
    assert (pins.max_pinned_blocks, pins.num_reserved_blocks) == (5, 0)
    await client.pin_prefix(PREFIX)
    with pytest.raises(ResourceExhaustedError, match="pinned budget of 5 blocks"):
        await client.pin_prefix(tokens(3 * BLOCK, start=900))
    pins = await client.list_pins()
    assert (len(pins.pins), pins.num_reserved_blocks, pins.num_pinned_blocks) == (1, 3, 0)
    # A cache_control_ttl pin past the budget refuses the AddRequest whole.
    with pytest.raises(ResourceExhaustedError, match="pinned budget"):
        await client.add_request("ttl", tokens(3 * BLOCK, start=900), cache_control_ttl="5m")
    with pytest.raises(RequestNotFoundError):
        await client.get_request("ttl")
    assert len((await client.list_pins()).pins) == 1


async def test_pinning_is_off_by_default(client: AsyncKVClient) -> None:
    with pytest.raises(ResourceExhaustedError, match="--max-pinned-fraction"):
        await client.pin_prefix(PREFIX)
    assert await client.list_pins() == PinList((), 0, 0, 0)
    with pytest.raises(ResourceExhaustedError, match="pinning is off"):
        await client.add_request("ttl", PREFIX, cache_control_ttl="5m")
    with pytest.raises(RequestNotFoundError):
        await client.get_request("ttl")


@pytest.mark.parametrize("server_config", [PINNING])
async def test_cache_control_ttl_pins_the_prompt(client: AsyncKVClient) -> None:
    await client.add_request("ttl", [*PREFIX, 1, 2], cache_control_ttl="5m")
    (pin,) = (await client.list_pins()).pins
    assert (pin.ttl_s, pin.num_tokens, pin.num_reserved_blocks) == (300.0, 3 * BLOCK, 3)
    assert pin.num_held_blocks == 0  # joins as the request caches its blocks
    await admit(client, "ttl")
    await client.free("ttl", FreeMode.FINISH)
    (pin,) = (await client.list_pins()).pins
    assert pin.num_held_blocks == 3
    await churn(client)
    assert await hit_of(client, "again", [*PREFIX, 9]) == 3 * BLOCK
    # The same prefix pinned again (seconds as a number) refreshes the same pin.
    await client.add_request("ttl-2", PREFIX, cache_control_ttl=60)
    (again,) = (await client.list_pins()).pins
    assert again.pin_id == pin.pin_id and again.ttl_s == 60.0


@pytest.mark.parametrize("server_config", [PINNING])
async def test_cache_control_ttl_pins_a_multimodal_prompt_by_its_own_hashes(
    client: AsyncKVClient,
) -> None:
    """The pin names the request's blocks by the request's hashes, image included: the
    same prompt with the same image hits after the churn."""
    image = [MultiModalFeature("image-1", 4, 8)]
    prompt = [*PREFIX, 1]
    await client.add_request("mm", prompt, mm_features=image, cache_control_ttl="5m")
    await admit(client, "mm")
    await client.free("mm", FreeMode.FINISH)
    (pin,) = (await client.list_pins()).pins
    assert pin.num_held_blocks == 3
    await churn(client)
    await client.add_request("mm-again", prompt, mm_features=image)
    assert (await client.get_computed_blocks("mm-again")).num_computed_tokens == 3 * BLOCK


@pytest.mark.parametrize("server_config", [PINNING])
async def test_a_refused_add_request_creates_no_pin(client: AsyncKVClient) -> None:
    await client.add_request("dup", tokens(BLOCK))
    with pytest.raises(Exception, match="already exists"):
        await client.add_request("dup", PREFIX, cache_control_ttl="5m")
    with pytest.raises(InvalidArgumentError, match="do not fill one block"):
        await client.add_request("short", tokens(BLOCK - 1), cache_control_ttl="5m")
    with pytest.raises(RequestNotFoundError):
        await client.get_request("short")
    assert (await client.list_pins()).pins == ()


@pytest.mark.parametrize("server_config", [PINNING])
async def test_pins_in_a_step(client: AsyncKVClient) -> None:
    step = StepBuilder()
    pinned = step.pin_prefix(PREFIX, ttl_s=60.0)
    listed = step.list_pins()
    refused = step.unpin_prefix("no-such-pin")
    results = await client.step(step)
    pin = results[pinned]
    assert isinstance(pin, Pin) and pin.num_reserved_blocks == 3
    assert [p.pin_id for p in results[listed].pins] == [pin.pin_id]
    with pytest.raises(RequestNotFoundError, match="no-such-pin"):
        results[refused]
    unpin = StepBuilder()
    unpin.unpin_prefix(pin.pin_id)
    await client.step(unpin)
    assert (await client.list_pins()).pins == ()


# -- priorities --------------------------------------------------------------------------


HIGH = Retention(token_ranges=(TokenRangeRetention(0, None, priority=90),))


@pytest.mark.parametrize("server_config", [PRIORITY, SMALL_POOL], ids=["priority", "lru"])
async def test_a_high_priority_prefix_outlives_lru_order(
    client: AsyncKVClient, server_config: ServerConfig
) -> None:
    """Two cached prefixes of 2 blocks, the high-priority one freed first (LRU would
    evict it first); an allocation that must evict 2 cached blocks evicts the
    default-priority ones instead."""
    priority = server_config.eviction_policy == "priority"
    first, second = tokens(2 * BLOCK + 1, start=100), tokens(2 * BLOCK + 1, start=300)
    await run_once(client, "high", first, retention=HIGH if priority else None)
    await run_once(client, "default", second)
    # 8 blocks: the 6 never cached, then 2 cached ones.
    await run_once(client, "big", tokens(8 * BLOCK, start=5000))
    assert await hit_of(client, "high-again", first) == (2 * BLOCK if priority else 0)
    assert await hit_of(client, "default-again", second) == (0 if priority else 2 * BLOCK)


@pytest.mark.parametrize("server_config", [PRIORITY])
async def test_a_priority_reverts_when_its_duration_runs_out(
    client: AsyncKVClient, server: KVCacheServer
) -> None:
    retention = server.table.manager.retention_policy
    assert retention is not None
    short = Retention(token_ranges=(TokenRangeRetention(0, None, 90, duration_s=0.2),))
    first, second = tokens(2 * BLOCK + 1, start=100), tokens(2 * BLOCK + 1, start=300)
    await run_once(client, "short", first, retention=short)
    await run_once(client, "default", second)

    async def reverted() -> bool:
        await client.new_step_starts()  # lets the server's time pass
        return retention.stats.priorities_expired == 2

    await poll(reverted, "the priority's duration")
    # Back at the default priority, at the front of its level: evicted first.
    await run_once(client, "big", tokens(8 * BLOCK, start=5000))
    assert await hit_of(client, "short-again", first) == 0
    assert await hit_of(client, "default-again", second) == 2 * BLOCK


async def test_retention_on_an_lru_pool_is_refused(stub: Any) -> None:
    message = pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(20))
    message.retention.token_ranges.add(start=0, priority=80)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.AddRequest(message)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--eviction-policy priority" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.GetRequest(pb.GetRequestRequest(request_id="r"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


# -- validation ------------------------------------------------------------------------


def _retention(**fields: Any) -> pb.AddRequestRequest:
    message = pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(40))
    message.retention.token_ranges.add(**fields)
    return message


def _with_ttl(ttl: str) -> pb.AddRequestRequest:
    return pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(40), cache_control_ttl=ttl)


INVALID_CALLS: list[tuple[str, str, Any, str]] = [
    ("AddRequest", "priority", _retention(start=0, priority=101), "priority must be in"),
    ("AddRequest", "range", _retention(start=10, end=5, priority=50), "start < end"),
    (
        "AddRequest",
        "duration",
        _retention(start=0, priority=50, duration_seconds=-1),
        "duration_seconds must be positive",
    ),
    ("AddRequest", "ttl unit", _with_ttl("5x"), "not a positive duration"),
    ("AddRequest", "ttl zero", _with_ttl("0s"), "not a positive duration"),
    ("PinPrefix", "short", pb.PinPrefixRequest(token_ids=tokens(BLOCK - 1)), "one block"),
    ("PinPrefix", "empty", pb.PinPrefixRequest(), "at least one block"),
    ("PinPrefix", "negative id", pb.PinPrefixRequest(token_ids=[-1] * BLOCK), "must be >= 0"),
    (
        "PinPrefix",
        "ttl",
        pb.PinPrefixRequest(token_ids=tokens(BLOCK), ttl_seconds=-1),
        "ttl_seconds must be positive",
    ),
    (
        "PinPrefix",
        "both forms",
        pb.PinPrefixRequest(token_ids=tokens(BLOCK), packed_token_ids=b"\0" * 64),
        "both token_ids",
    ),
    ("PinPrefix", "lora path", pb.PinPrefixRequest(token_ids=tokens(BLOCK), lora_path="/x"), ""),
    ("UnpinPrefix", "empty id", pb.UnpinPrefixRequest(), "must not be empty"),
]


@pytest.mark.parametrize("server_config", [RETAINED])
@pytest.mark.parametrize(
    ("rpc", "message", "words"),
    [(rpc, message, words) for rpc, _, message, words in INVALID_CALLS],
    ids=[f"{rpc}-{name}" for rpc, name, _, _ in INVALID_CALLS],
)
async def test_invalid_arguments_are_refused_and_change_nothing(
    stub: Any, server: KVCacheServer, rpc: str, message: Any, words: str
) -> None:
    before = (server.table.num_requests, server.table.pinned_budget())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(stub, rpc)(message)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert words in (info.value.details() or "")
    assert (server.table.num_requests, server.table.pinned_budget()) == before


@pytest.mark.parametrize("server_config", [RETAINED])
async def test_other_refusals(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id="abc"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.PinPrefix(pb.PinPrefixRequest(token_ids=tokens(SMALL_POOL.max_model_len + 1)))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE


# -- tenants ---------------------------------------------------------------------------

TOKENS = {name: secrets.token_urlsafe(24) for name in ("alpha", "beta", "root")}


def auth(tenant: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


async def test_pins_belong_to_their_tenant(tmp_path: Path) -> None:
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {
            "alpha": {"tokens": [TOKENS["alpha"]], "max_blocks": 8},
            "beta": {"tokens": [TOKENS["beta"]]},
            "root": {"tokens": [TOKENS["root"]], "admin": True},
        },
    )
    config = dataclasses.replace(PINNING, auth_tokens_file=tokens_file)
    async with running_server(config) as server, raw_stub(server) as stub:
        pinned = await stub.PinPrefix(
            pb.PinPrefixRequest(token_ids=PREFIX, ttl_seconds=1.0), metadata=auth("alpha")
        )
        pin_id = pinned.pin.pin_id
        assert pinned.pin.tenant == "alpha"
        # alpha caches the prefix: its blocks are alpha's, held by alpha's pin.
        md = auth("alpha")
        await stub.AddRequest(
            pb.AddRequestRequest(request_id="a", prompt_token_ids=PREFIX), metadata=md
        )
        await stub.AllocateSlots(
            pb.AllocateSlotsRequest(request_id="a", num_new_tokens=len(PREFIX)), metadata=md
        )
        await stub.FreeRequest(
            pb.FreeRequestRequest(request_id="a", mode=pb.FREE_MODE_FINISH), metadata=md
        )
        assert server.table.tenant_blocks() == {"alpha": 3}
        assert (await stub.Audit(pb.AuditRequest(), metadata=auth("root"))).ok
        # beta can neither see nor drop it, nor hit alpha's prefix.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id=pin_id), metadata=auth("beta"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        beta = await stub.ListPins(pb.ListPinsRequest(), metadata=auth("beta"))
        assert list(beta.pins) == [] and beta.num_pinned_blocks == 3
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListPins(pb.ListPinsRequest(all_tenants=True), metadata=auth("beta"))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        every = await stub.ListPins(pb.ListPinsRequest(all_tenants=True), metadata=auth("root"))
        assert [(p.tenant, p.pin_id) for p in every.pins] == [("alpha", pin_id)]
        # The TTL runs out: alpha's ledger lets go of the blocks.
        deadline = time.monotonic() + WAIT_S
        while (await stub.ListPins(pb.ListPinsRequest(), metadata=auth("alpha"))).pins:
            assert time.monotonic() < deadline, "the pin did not expire"
            await asyncio.sleep(0.02)
        assert not any(server.table.tenant_blocks().values())
        assert (await stub.Audit(pb.AuditRequest(), metadata=auth("root"))).ok


async def test_a_non_admin_cannot_list_every_pin_through_the_client(tmp_path: Path) -> None:
    tokens_file = write_tokens_file(tmp_path / "t.toml", {"beta": {"tokens": [TOKENS["beta"]]}})
    config = dataclasses.replace(PINNING, auth_tokens_file=tokens_file)
    async with (
        running_server(config) as server,
        AsyncKVClient(
            server.handle.target, token=TOKENS["beta"], allow_insecure_token=True
        ) as client,
    ):
        with pytest.raises(PermissionDeniedError):
            await client.list_pins(all_tenants=True)
        pin = await client.pin_prefix(PREFIX)
        assert pin.tenant == "beta"
        await client.unpin_prefix(pin.pin_id)


# -- config, settings, metrics -----------------------------------------------------------


@pytest.mark.parametrize("server_config", [RETAINED])
async def test_cache_config_reports_the_policy_and_budget(client: AsyncKVClient) -> None:
    config = await client.get_cache_config()
    assert (config.eviction_policy, config.max_pinned_blocks) == ("priority", 5)
    assert config.has_retention


async def test_a_default_pool_reports_lru_and_no_budget(client: AsyncKVClient) -> None:
    config = await client.get_cache_config()
    assert (config.eviction_policy, config.max_pinned_blocks) == ("lru", 0)
    assert not config.has_retention


def test_the_settings_take_flags_and_environment() -> None:
    assert load_settings({}, {}).server.eviction_policy == "lru"
    assert load_settings({}, {}).server.max_pinned_fraction == 0.0
    flags = load_settings({"eviction_policy": "priority", "max_pinned_fraction": 0.25}, {})
    assert (flags.server.eviction_policy, flags.server.max_pinned_fraction) == ("priority", 0.25)
    env = load_settings(
        {}, {"KVSERVICE_EVICTION_POLICY": "priority", "KVSERVICE_MAX_PINNED_FRACTION": "0.1"}
    )
    assert (env.server.eviction_policy, env.server.max_pinned_fraction) == ("priority", 0.1)
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, priority"):
        load_settings({"eviction_policy": "fifo"}, {})


def test_a_pinned_fraction_outside_the_unit_interval_fails_startup() -> None:
    with pytest.raises(ValueError, match="max_pinned_fraction must be in"):
        KVCacheServer(dataclasses.replace(SMALL_POOL, max_pinned_fraction=1.5))


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of the server's /metrics, by name and labels (less the server's own
    model_name and engine)."""
    with urllib.request.urlopen(url, timeout=60) as response:
        text = response.read().decode()
    ours = ("model_name", "engine")
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ours)): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("server_config", [dataclasses.replace(RETAINED, metrics_port=0)])
async def test_retention_metrics(client: AsyncKVClient, server: KVCacheServer) -> None:
    url = server.handle.metrics_url
    assert url is not None
    start = await asyncio.to_thread(_scrape, url)
    assert start[("kvservice_pinned_budget_blocks", frozenset())] == 5
    assert start[("kvservice_pins_created_total", frozenset())] == 0
    pin = await client.pin_prefix(PREFIX)
    await run_once(client, "first", PREFIX)
    # One more full block (cached at the default priority) and a partial one.
    await run_once(client, "again", [*PREFIX, *tokens(BLOCK + 1, start=700)])
    await client.pin_prefix(tokens(BLOCK, start=900), ttl_s=0.2)

    async def expired() -> bool:
        return len((await client.list_pins()).pins) == 1

    await poll(expired, "the second pin's TTL")
    await client.unpin_prefix(pin.pin_id)
    await client.pin_prefix(PREFIX)
    # The 7 free blocks: 5 never used, "again"'s partial block, its cached one.
    await run_once(client, "big", tokens(7 * BLOCK, start=5000))
    end = await asyncio.to_thread(_scrape, url)
    expected = {
        "kvservice_pins_created_total": 3,
        "kvservice_pins_expired_total": 1,
        "kvservice_pins_removed_total": 1,
        "kvservice_pinned_block_hits_total": 3,
        "kvservice_pinned_blocks": 3,
        "kvservice_pinned_reserved_blocks": 3,
        "kvservice_priority_expirations_total": 0,
    }
    for name, value in expected.items():
        assert end[(name, frozenset())] == value, name
    assert end[("kvservice_tenant_pins", frozenset({("tenant", "")}))] == 1
    # "big" evicted the one cached block not pinned ("again"'s, at the default
    # priority).
    evicted = end[("kvservice_evictions_by_priority_total", frozenset({("priority", "35")}))]
    assert evicted == 1


# -- the client's values -------------------------------------------------------------


def test_client_retention_round_trips_to_the_cores() -> None:
    retention = Retention(
        token_ranges=(
            TokenRangeRetention(0, 64, priority=80, duration_s=30.0),
            TokenRangeRetention(64, None, priority=10),
        ),
        decode_priority=5,
        decode_duration_s=2.5,
    )
    message = pb.AddRequestRequest(request_id="r")
    _wire.retention_to_pb(retention, message.retention)
    assert converters.retention_from_pb(message) == RetentionConfig(
        token_ranges=(CoreTokenRange(0, 64, 80, 30.0), CoreTokenRange(64, None, 10, None)),
        decode_priority=5,
        decode_duration_s=2.5,
    )
    default = pb.AddRequestRequest(request_id="r")
    _wire.retention_to_pb(Retention(), default.retention)
    assert default.HasField("retention")
    assert converters.retention_from_pb(default) == RetentionConfig()
    assert Retention().decode_priority == DEFAULT_PRIORITY


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5m", 300.0), ("300s", 300.0), ("1h", 3600.0), ("250ms", 0.25), ("2", 2.0), (" 1.5h", 5400)],
)
def test_cache_control_ttls_in_dynamos_form(text: str, seconds: float) -> None:
    assert parse_duration(text, "ttl") == seconds
    assert parse_duration(_wire.ttl_text(seconds), "ttl") == seconds


def test_pins_round_trip_from_the_wire() -> None:
    message = pb.PinPrefixResponse()
    message.pin.pin_id, message.pin.tenant, message.pin.num_tokens = "ab", "t", 40
    message.pin.num_reserved_blocks, message.pin.num_held_blocks = 2, 1
    message.pin.refresh_on_hit, message.pin.num_hits = True, 4
    assert _wire._pinned(message) == Pin("ab", "t", 40, 2, 1, None, True, None, 4)
    message.pin.ttl_seconds, message.pin.expires_in_seconds = 60.0, 12.5
    assert _wire._pinned(message).ttl_s == 60.0
    assert _wire._pinned(message).expires_in_s == 12.5


async def test_the_clients_refuse_in_their_own_words(client: AsyncKVClient) -> None:
    """Errors arrive typed: retention on an LRU pool is a FailedPreconditionError."""
    with pytest.raises(FailedPreconditionError, match="--eviction-policy priority"):
        await client.add_request("r", tokens(20), retention=HIGH)


# -- a replica session: retention changes wait for its step boundaries --------------------


async def _step(session: Any) -> Any:
    """One Step message of the replica session (a step boundary and nothing else)."""
    step = StepBuilder()
    step.new_step_starts()
    return await session.step(step)


@pytest.mark.parametrize("server_config", [PINNING])
async def test_a_replica_session_gets_pins_after_its_next_message(
    server: KVCacheServer, client: AsyncKVClient
) -> None:
    await client.open_session(replica=True)
    session = client.session()
    async with AsyncKVClient(server.handle.target) as admin:
        pin = await admin.pin_prefix(PREFIX, ttl_s=60.0)
        assert pin.num_held_blocks == 0
        assert (await admin.list_pins()).pins == ()  # answered, not placed yet
        first = await _step(session)  # answer 1 ships it (after the clock)
        changes = first.retention_changes
        assert [type(c).__name__ for c in changes] == ["RetentionTick", "RetentionPin"]
        assert changes[1].pin_id == pin.pin_id and len(changes[1].keys) == 3
        assert (await admin.list_pins()).pins == ()
        await _step(session)  # placed after message 2's operations
        (placed,) = (await admin.list_pins()).pins
        assert placed.pin_id == pin.pin_id
        await admin.unpin_prefix(pin.pin_id)
        assert len((await admin.list_pins()).pins) == 1  # waits too
        with pytest.raises(RequestNotFoundError, match="is not known"):
            await admin.unpin_prefix("no-such-pin")
        with pytest.raises(FailedPreconditionError, match="another replica session"):
            await admin.open_session(replica=True)


@pytest.mark.parametrize("server_config", [PINNING])
async def test_what_waited_takes_effect_when_the_replica_session_ends(
    server: KVCacheServer, client: AsyncKVClient
) -> None:
    lease = await client.open_session(replica=True)
    async with AsyncKVClient(server.handle.target) as admin:
        await admin.pin_prefix(PREFIX)
        assert (await admin.list_pins()).pins == ()
        await lease.close()
        (placed,) = (await admin.list_pins()).pins
        assert placed.num_reserved_blocks == 3

"""Tenants on one pool, over real gRPC: each sees only its own requests, its prefixes
never serve another tenant, and its block quota holds.

Every server here runs with a tokens file; tenants are told apart only by the bearer
token each call carries.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvservice.client import AsyncKVClient, FreeMode, StepBuilder
from kvservice.client.errors import KVServiceError
from kvservice.core.errors import QuotaExceededError
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import (
    DEFAULT_TENANT,
    check_tenant_name,
    core_request_id,
    tenant_cache_salt,
)
from kvservice.request_table.types import AllocateArgs, NewRequest
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig, build_manager
from tests.server.support import SMALL_POOL, snapshot, tokens
from tests.servers import raw_stub, running_server

BLOCK = SMALL_POOL.block_size
TOKENS = {name: secrets.token_urlsafe(24) for name in ("alpha", "beta", "gamma")}
# gamma may hold 3 blocks at once; the others are unbounded.
GAMMA_QUOTA = 3


def write_tokens_file(path: Path, tenants: dict[str, dict[str, Any]]) -> str:
    """A tokens file of ``tenants`` (name -> keys of its [tenants.NAME] table)."""
    lines: list[str] = []
    for name, keys in tenants.items():
        lines.append(f'[tenants."{name}"]')
        for key, value in keys.items():
            if isinstance(value, list):
                lines.append(f"{key} = [{', '.join(repr(v) for v in value)}]")
            elif isinstance(value, bool):
                lines.append(f"{key} = {str(value).lower()}")
            else:
                lines.append(f"{key} = {value!r}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def auth(tenant: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


@pytest.fixture
def server_config(tmp_path: Path) -> ServerConfig:
    """The ``server`` (and ``stub``) of this module: three tenants, gamma with a quota."""
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {
            "alpha": {"tokens": [TOKENS["alpha"]]},
            "beta": {"tokens": [TOKENS["beta"]]},
            "gamma": {"tokens": [TOKENS["gamma"]], "max_blocks": GAMMA_QUOTA},
        },
    )
    return dataclasses.replace(SMALL_POOL, auth_tokens_file=tokens_file)


async def refused(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


async def add(stub: Any, tenant: str, rid: str, prompt: list[int], **fields: Any) -> Any:
    message = pb.AddRequestRequest(request_id=rid, prompt_token_ids=prompt, **fields)
    return (await stub.AddRequest(message, metadata=auth(tenant))).request


async def admit(stub: Any, tenant: str, rid: str) -> tuple[int, pb.AllocateSlotsResponse]:
    """Look the prefix up and allocate the rest; (hit tokens, the allocation)."""
    md = auth(tenant)
    hit = await stub.GetComputedBlocks(pb.GetComputedBlocksRequest(request_id=rid), metadata=md)
    state = (await stub.GetRequest(pb.GetRequestRequest(request_id=rid), metadata=md)).request
    allocation = await stub.AllocateSlots(
        pb.AllocateSlotsRequest(
            request_id=rid,
            num_new_tokens=state.num_tokens - hit.num_computed_tokens,
            num_new_computed_tokens=hit.num_computed_tokens,
            new_computed_block_ids=hit.block_ids,
        ),
        metadata=md,
    )
    return hit.num_computed_tokens, allocation


async def finish(stub: Any, tenant: str, rid: str) -> None:
    await stub.FreeRequest(
        pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH), metadata=auth(tenant)
    )


# -- requests are per tenant ------------------------------------------------------------


async def test_another_tenants_request_answers_exactly_as_an_unknown_id(
    server: KVCacheServer, stub: Any
) -> None:
    await add(stub, "alpha", "secret-req", tokens(20))
    await admit(stub, "alpha", "secret-req")
    before = await snapshot_as(stub, "alpha", ["secret-req"])
    calls: dict[str, Callable[[str], Any]] = {
        "GetRequest": lambda rid: stub.GetRequest(
            pb.GetRequestRequest(request_id=rid), metadata=auth("beta")
        ),
        "FreeRequest": lambda rid: stub.FreeRequest(
            pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH), metadata=auth("beta")
        ),
        "AllocateSlots": lambda rid: stub.AllocateSlots(
            pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=1), metadata=auth("beta")
        ),
        "AppendTokens": lambda rid: stub.AppendTokens(
            pb.AppendTokensRequest(request_id=rid, token_ids=[1]), metadata=auth("beta")
        ),
        "GetBlockIds": lambda rid: stub.GetBlockIds(
            pb.GetBlockIdsRequest(request_id=rid), metadata=auth("beta")
        ),
        "Probe": lambda rid: stub.Probe(pb.ProbeRequest(request_id=rid), metadata=auth("beta")),
    }
    for name, call in calls.items():
        theirs = await refused(call("secret-req"), grpc.StatusCode.NOT_FOUND)
        unknown = await refused(call("never-added"), grpc.StatusCode.NOT_FOUND)
        # Same words, only the id differs: nothing tells beta the id is taken.
        assert theirs.replace("secret-req", "X") == unknown.replace("never-added", "X"), name
    assert await snapshot_as(stub, "alpha", ["secret-req"]) == before
    server.audit()


async def snapshot_as(stub: Any, tenant: str, rids: list[str]) -> list[Any]:
    """``support.snapshot`` through ``tenant``'s token."""

    class AsTenant:
        def __getattr__(self, name: str) -> Any:
            method = getattr(stub, name)
            return lambda message: method(message, metadata=auth(tenant))

    return await snapshot(AsTenant(), rids)  # type: ignore[arg-type]


async def test_two_tenants_may_use_the_same_request_id(server: KVCacheServer, stub: Any) -> None:
    a = await add(stub, "alpha", "req-0", tokens(20))
    b = await add(stub, "beta", "req-0", tokens(40, start=1000))
    assert (a.request_id, a.num_tokens) == ("req-0", 20)
    assert (b.request_id, b.num_tokens) == ("req-0", 40)
    _, alpha_alloc = await admit(stub, "alpha", "req-0")
    _, beta_alloc = await admit(stub, "beta", "req-0")
    assert alpha_alloc.request.request_id == beta_alloc.request.request_id == "req-0"
    alpha_blocks = set(alpha_alloc.new_block_ids[0].block_ids)
    beta_blocks = set(beta_alloc.new_block_ids[0].block_ids)
    assert len(alpha_blocks) == 2 and len(beta_blocks) == 3 and not alpha_blocks & beta_blocks
    await finish(stub, "alpha", "req-0")
    # beta's request is untouched by alpha finishing its own "req-0".
    md = auth("beta")
    left = await stub.GetBlockIds(pb.GetBlockIdsRequest(request_id="req-0"), metadata=md)
    assert set(left.block_ids[0].block_ids) == beta_blocks
    await refused(
        stub.GetRequest(pb.GetRequestRequest(request_id="req-0"), metadata=auth("alpha")),
        grpc.StatusCode.NOT_FOUND,
    )
    server.audit()


# -- prefix caching is per tenant -------------------------------------------------------


async def test_a_tenants_prompt_never_hits_another_tenants_cached_blocks(
    server: KVCacheServer, stub: Any
) -> None:
    prompt = tokens(3 * BLOCK + 5)
    await add(stub, "alpha", "first", prompt, cache_salt="shared-salt")
    assert (await admit(stub, "alpha", "first"))[0] == 0
    await finish(stub, "alpha", "first")  # its 3 full blocks stay cached
    # Same prompt, same client salt, another tenant: a miss.
    await add(stub, "beta", "copy", prompt, cache_salt="shared-salt")
    beta_hit, _ = await admit(stub, "beta", "copy")
    assert beta_hit == 0
    # Same tenant: the hit is there (3 full blocks).
    await add(stub, "alpha", "again", prompt, cache_salt="shared-salt")
    alpha_hit, _ = await admit(stub, "alpha", "again")
    assert alpha_hit == 3 * BLOCK
    server.audit()


async def test_a_live_tenants_blocks_are_never_shared_with_another(
    server: KVCacheServer, stub: Any
) -> None:
    prompt = tokens(2 * BLOCK + 1)
    await add(stub, "alpha", "a", prompt)
    _, alpha = await admit(stub, "alpha", "a")
    await add(stub, "beta", "b", prompt)
    hit, beta = await admit(stub, "beta", "b")
    assert hit == 0
    assert not set(alpha.new_block_ids[0].block_ids) & set(beta.new_block_ids[0].block_ids)
    server.audit()


def test_the_default_tenant_hashes_exactly_as_before() -> None:
    """Without tokens nothing changes: same core key, same salt, same block hashes as
    the core alone computes; a named tenant's chain differs from the first block on."""
    manager = build_manager(SMALL_POOL)
    table = RequestTable(manager)
    prompt = tokens(3 * BLOCK)
    for salt in (None, "client-salt"):
        reference = Request("r", prompt, manager.block_hasher, cache_salt=salt)
        plain = table.add_request(
            NewRequest(f"plain-{salt}", prompt, cache_salt=salt), tenant=DEFAULT_TENANT
        )
        named = table.add_request(
            NewRequest(f"named-{salt}", prompt, cache_salt=salt), tenant="alpha"
        )
        assert plain.request_id == f"plain-{salt}"
        assert plain.block_hashes == reference.block_hashes
        assert all(n != r for n, r in zip(named.block_hashes, reference.block_hashes, strict=True))
    assert tenant_cache_salt("", "s") == "s" and tenant_cache_salt("", None) is None


def test_tenant_salts_and_keys_are_unambiguous() -> None:
    """No (tenant, salt) or (tenant, request id) pair spells another's, even when a
    name or a salt holds the separators."""
    pairs = [("a", "b:c"), ("a:b", "c"), ("a", None), ("a", ""), ("ab", None), ("a:1:b", "")]
    salts = [tenant_cache_salt(t, s) for t, s in pairs]
    # ("a", None) and ("a", "") are the same salt on purpose: vLLM treats "" as none.
    assert len(set(salts)) == len(salts) - 1
    # Tenant names never hold the separator (the tokens file refuses one that does), so
    # the first separator after the leading one ends the name.
    keys = [
        core_request_id(t, r) for t, r in [("a", "b\x00c"), ("ab", "c"), ("a", "bc"), ("", "a")]
    ]
    assert len(set(keys)) == len(keys)
    with pytest.raises(ValueError, match="NUL"):
        check_tenant_name("a\x00b")


# -- quotas -----------------------------------------------------------------------------


def held(server: KVCacheServer, tenant: str) -> float | None:
    return server.metrics.registry.get_sample_value(
        "kvservice_tenant_blocks", {**server.metrics.labels, "tenant": tenant}
    )


def refusals(server: KVCacheServer, tenant: str, reason: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "kvservice_refusals_total", {**server.metrics.labels, "tenant": tenant, "reason": reason}
    )
    return value or 0.0


async def test_an_allocation_past_the_quota_is_refused_and_changes_nothing(
    server: KVCacheServer, stub: Any
) -> None:
    await add(stub, "gamma", "two-blocks", tokens(2 * BLOCK))
    await admit(stub, "gamma", "two-blocks")
    assert held(server, "gamma") == 2
    await add(stub, "gamma", "also-two", tokens(2 * BLOCK, start=500))
    md = auth("gamma")
    await stub.GetComputedBlocks(pb.GetComputedBlocksRequest(request_id="also-two"), metadata=md)
    # Probe tells in advance: the pool has room, the quota has not.
    probe = await stub.Probe(pb.ProbeRequest(request_id="also-two"), metadata=md)
    assert probe.num_blocks_to_allocate == 2 and probe.num_free_blocks >= 2
    assert not probe.would_fit
    before = await snapshot_as(stub, "gamma", ["two-blocks", "also-two"])
    allocate = pb.AllocateSlotsRequest(request_id="also-two", num_new_tokens=2 * BLOCK)
    message = await refused(
        stub.AllocateSlots(allocate, metadata=md), grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert "quota of 3" in message and "'gamma'" in message and "'also-two'" in message
    assert await snapshot_as(stub, "gamma", ["two-blocks", "also-two"]) == before
    assert held(server, "gamma") == 2
    assert refusals(server, "gamma", "quota") == 1
    # Other tenants are not bound by gamma's quota.
    await add(stub, "alpha", "big", tokens(5 * BLOCK))
    await admit(stub, "alpha", "big")
    assert held(server, "alpha") == 5
    # Freeing makes room within the quota again.
    await finish(stub, "gamma", "two-blocks")
    assert held(server, "gamma") == 0
    assert (await stub.Probe(pb.ProbeRequest(request_id="also-two"), metadata=md)).would_fit
    await admit(stub, "gamma", "also-two")
    assert held(server, "gamma") == 2
    server.audit()


async def test_a_decode_step_past_the_quota_is_refused_in_a_step(
    server: KVCacheServer,
) -> None:
    target = server.handle.target
    async with AsyncKVClient(target, token=TOKENS["gamma"], allow_insecure_token=True) as client:
        await client.add_request("r", tokens(3 * BLOCK))
        hit = await client.get_computed_blocks("r")
        assert await client.allocate_slots("r", 3 * BLOCK, hit) is not None
        step = StepBuilder()
        step.append_tokens("r", [7])
        decode = step.allocate_slots("r", 1)  # a 4th block: past the quota
        results = await client.step(step)
        error = results.error(decode)
        assert error is not None and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The append ran; the refused allocation took nothing.
        assert (await client.get_request("r")).num_tokens == 3 * BLOCK + 1
        assert len((await client.get_block_ids("r"))[0]) == 3
        with pytest.raises(KVServiceError) as info:
            await client.allocate_slots("r", 1)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        await client.free("r", FreeMode.FINISH)
    assert held(server, "gamma") == 0
    server.audit()


async def test_blocks_shared_within_a_tenant_count_once(server: KVCacheServer, stub: Any) -> None:
    """The quota counts the distinct blocks a tenant holds: a prefix hit on one of its
    own live blocks costs nothing more."""
    prompt = tokens(2 * BLOCK)
    await add(stub, "gamma", "first", prompt)
    await admit(stub, "gamma", "first")
    assert held(server, "gamma") == 2
    await add(stub, "gamma", "second", prompt)
    hit, allocation = await admit(stub, "gamma", "second")
    # One shared block (the hit stops a token short of the end) plus one new block:
    # 3 distinct blocks, within the quota; counted per request it would be 4.
    assert hit == BLOCK
    assert allocation.outcome == pb.ALLOCATION_OUTCOME_OK
    assert held(server, "gamma") == 3
    await add(stub, "gamma", "third", tokens(1, start=900))
    await refused(admit(stub, "gamma", "third"), grpc.StatusCode.RESOURCE_EXHAUSTED)
    server.audit()


def test_quota_counts_with_the_cores_predictor() -> None:
    """At the request table: a quota refusal answers before the core allocates, and the
    ledger matches the pool after each change."""
    manager: KVCacheManager = build_manager(SMALL_POOL)
    table = RequestTable(manager, quotas={"t": 4})
    table.add_request(NewRequest("a", tokens(3 * BLOCK)), tenant="t")
    table.allocate_slots("a", AllocateArgs(num_new_tokens=3 * BLOCK), tenant="t")
    assert table.tenant_blocks() == {"t": 3}
    table.add_request(NewRequest("b", tokens(2 * BLOCK, start=99)), tenant="t")
    free_before = manager.block_pool.get_num_free_blocks()
    with pytest.raises(QuotaExceededError, match="quota of 4") as info:
        table.allocate_slots("b", AllocateArgs(num_new_tokens=2 * BLOCK), tenant="t")
    assert info.value.status == "RESOURCE_EXHAUSTED"
    assert manager.block_pool.get_num_free_blocks() == free_before
    assert table.get_request("b", tenant="t").num_computed_tokens == 0
    table.allocate_slots("b", AllocateArgs(num_new_tokens=BLOCK), tenant="t")
    assert table.tenant_blocks() == {"t": 4}
    table.audit()


async def test_a_sessions_requests_are_freed_for_their_own_tenant(
    server: KVCacheServer,
) -> None:
    """Ending a session frees what it owns under its own tenant: the quota ledger
    gives the blocks back, and another tenant's same request id is untouched."""
    target = server.handle.target
    async with (
        AsyncKVClient(target, token=TOKENS["gamma"], allow_insecure_token=True) as gamma,
        AsyncKVClient(target, token=TOKENS["beta"], allow_insecure_token=True) as beta,
    ):
        await beta.add_request("shared-id", tokens(BLOCK))
        assert await beta.allocate_slots("shared-id", BLOCK) is not None
        lease = await gamma.open_session(ttl_s=60)
        await gamma.add_request("shared-id", tokens(2 * BLOCK, start=300))
        assert await gamma.allocate_slots("shared-id", 2 * BLOCK) is not None
        assert held(server, "gamma") == 2
        assert await lease.close(free_requests=True) == 1
        assert held(server, "gamma") == 0
        assert held(server, "beta") == 1
        assert (await beta.get_request("shared-id")).num_tokens == BLOCK
        with pytest.raises(KVServiceError) as info:
            await gamma.get_request("shared-id")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
    server.audit()


# -- usage is per tenant ----------------------------------------------------------------


async def usage_as(stub: Any, tenant: str, pool_wide: bool = False) -> pb.GetUsageResponse:
    answer: pb.GetUsageResponse = await stub.GetUsage(
        pb.GetUsageRequest(pool_wide=pool_wide), metadata=auth(tenant)
    )
    return answer


async def test_a_tenant_sees_its_own_counters_and_an_admin_the_pools(tmp_path: Path) -> None:
    """GetUsage answers a tenant its own requests, blocks and prefix cache counters
    (the pool's free space, shared by all, stays the pool's); pool_wide is for admin
    tenants and answers the pool's totals."""
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml",
        {
            "alpha": {"tokens": [TOKENS["alpha"]]},
            "beta": {"tokens": [TOKENS["beta"]], "admin": True},
        },
    )
    config = dataclasses.replace(SMALL_POOL, auth_tokens_file=tokens_file)
    async with running_server(config) as server, raw_stub(server) as stub:
        await add(stub, "alpha", "a1", tokens(2 * BLOCK))
        await add(stub, "alpha", "a2", tokens(2 * BLOCK))
        await admit(stub, "alpha", "a1")
        await admit(stub, "alpha", "a2")  # a 2-block prefix hit of alpha's own
        await add(stub, "beta", "b1", tokens(BLOCK, start=500))
        await admit(stub, "beta", "b1")
        alpha, beta = await usage_as(stub, "alpha"), await usage_as(stub, "beta")
        assert (alpha.num_requests, alpha.num_used_blocks) == (2, 3)
        assert (alpha.prefix_cache_queries, alpha.prefix_cache_hits) == (4 * BLOCK, BLOCK)
        assert (beta.num_requests, beta.num_used_blocks) == (1, 1)
        assert (beta.prefix_cache_queries, beta.prefix_cache_hits) == (BLOCK, 0)
        assert not alpha.pool_wide and not beta.pool_wide
        # The free space is the pool's: every tenant allocates from it.
        assert alpha.num_free_blocks == beta.num_free_blocks == SMALL_POOL.num_blocks - 1 - 4
        details = await refused(
            stub.GetUsage(pb.GetUsageRequest(pool_wide=True), metadata=auth("alpha")),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        assert "pool_wide" in details and "admin" in details
        pool = await usage_as(stub, "beta", pool_wide=True)
        assert pool.pool_wide
        assert (pool.num_requests, pool.num_used_blocks) == (3, 4)
        assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (5 * BLOCK, BLOCK)
        # The same in a Step, operation by operation.
        step = pb.StepRequest(step_id=1)
        step.ops.add().get_usage.pool_wide = True
        step.ops.add().get_usage.SetInParent()
        results = (await stub.Step(step, metadata=auth("alpha"))).results
        assert results[0].error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert results[1].get_usage.num_requests == 2


async def test_without_tenants_every_caller_sees_the_pool() -> None:
    """A server without a tokens file has one tenant: its counters are the pool's."""
    async with running_server(SMALL_POOL) as server, raw_stub(server) as stub:
        await stub.AddRequest(pb.AddRequestRequest(request_id="r", prompt_token_ids=tokens(9)))
        own = await stub.GetUsage(pb.GetUsageRequest())
        pool = await stub.GetUsage(pb.GetUsageRequest(pool_wide=True))
        assert own == pool and own.pool_wide and own.num_requests == 1


async def test_the_client_asks_for_either(tmp_path: Path) -> None:
    tokens_file = write_tokens_file(
        tmp_path / "tokens.toml", {"beta": {"tokens": [TOKENS["beta"]], "admin": True}}
    )
    config = dataclasses.replace(SMALL_POOL, auth_tokens_file=tokens_file)
    async with (
        running_server(config) as server,
        AsyncKVClient(
            server.handle.target, token=TOKENS["beta"], allow_insecure_token=True
        ) as client,
    ):
        await client.add_request("b", tokens(4))
        own, pool = await client.get_usage(), await client.get_usage(pool_wide=True)
        assert (own.num_requests, own.pool_wide) == (1, False)
        assert (pool.num_requests, pool.pool_wide) == (1, True)
        step = StepBuilder()
        handle = step.get_usage(pool_wide=True)
        assert (await client.step(step))[handle].pool_wide

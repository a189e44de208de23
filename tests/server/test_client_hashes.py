"""Block hashes a client sends (``client_hashed`` requests), over real gRPC: the
server takes them only from a caller it trusts, checks them before anything changes,
and never lets one tenant's claims reach another tenant's blocks.

The threat is a client that lies: it claims, for its own tokens, a hash that another
request's tokens have. These tests lie on purpose, with the exact hashes the victims'
blocks are cached under (known here from the server's own hasher, which is more than a
real attacker would know).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvservice.core.request import Request
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.tenancy import tenant_cache_salt
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.tls import SecurityConfigError
from tests.server.support import SMALL_POOL, expect_error, snapshot, tokens
from tests.server.test_tenants import write_tokens_file
from tests.servers import raw_stub, running_server

POOL = dataclasses.replace(SMALL_POOL, num_blocks=64, max_model_len=256)
BLOCK = POOL.block_size
TOKENS = {name: secrets.token_urlsafe(24) for name in ("alpha", "beta", "gamma")}
# A prompt of two full blocks and a partial one, and another of the same length.
PROMPT = tokens(2 * BLOCK + 8, start=100)
OTHER = tokens(2 * BLOCK + 8, start=5000)


def hashes_of(server: KVCacheServer, prompt: list[int], salt: str | None = None) -> list[bytes]:
    """The hashes the server's own hasher gives ``prompt`` (vLLM's, for this pool)."""
    hasher = server.table.manager.block_hasher
    return list(Request("probe", prompt, hasher, cache_salt=salt).block_hashes)


def metadata(tenant: str | None) -> Any:
    return None if tenant is None else (("authorization", f"Bearer {TOKENS[tenant]}"),)


async def add(
    stub: Any, rid: str, prompt: list[int], hashes: list[bytes] | None, tenant: str | None = None
) -> None:
    message = pb.AddRequestRequest(request_id=rid, prompt_token_ids=prompt)
    if hashes is not None:
        message.client_hashed = True
        message.block_hashes.extend(hashes)
    await stub.AddRequest(message, metadata=metadata(tenant))


async def admit(stub: Any, rid: str, tenant: str | None = None) -> tuple[int, list[int]]:
    """Look the prefix up and allocate the rest: (hit tokens, the hit's block ids)."""
    md = metadata(tenant)
    hit = await stub.GetComputedBlocks(pb.GetComputedBlocksRequest(request_id=rid), metadata=md)
    state = (await stub.GetRequest(pb.GetRequestRequest(request_id=rid), metadata=md)).request
    await stub.AllocateSlots(
        pb.AllocateSlotsRequest(
            request_id=rid,
            num_new_tokens=state.num_tokens - hit.num_computed_tokens,
            num_new_computed_tokens=hit.num_computed_tokens,
            new_computed_block_ids=hit.block_ids,
        ),
        metadata=md,
    )
    return hit.num_computed_tokens, list(hit.block_ids[0].block_ids)


async def finish(stub: Any, rid: str, tenant: str | None = None) -> None:
    await stub.FreeRequest(
        pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH), metadata=metadata(tenant)
    )


async def block_ids(stub: Any, rid: str, tenant: str | None = None) -> list[int]:
    answer = await stub.GetBlockIds(
        pb.GetBlockIdsRequest(request_id=rid), metadata=metadata(tenant)
    )
    return list(answer.block_ids[0].block_ids)


# -- the default tenant, trusted ----------------------------------------------------------


@pytest.fixture
def server_config() -> ServerConfig:
    return dataclasses.replace(POOL, trust_client_block_hashes=True)


async def test_the_config_says_the_caller_is_trusted(stub: Any) -> None:
    config = await stub.GetCacheConfig(pb.GetCacheConfigRequest())
    assert config.trusts_client_block_hashes


async def test_honest_hashes_cache_as_the_servers_own(server: KVCacheServer, stub: Any) -> None:
    """A client_hashed request's blocks, prompt and appended, are cached under the hashes
    it sent; for the default tenant they are vLLM's, so a request the server hashes
    itself hits them."""
    full = PROMPT + tokens(BLOCK - 8, start=900)  # the appends complete block 3
    expected = hashes_of(server, full)
    assert len(expected) == 3
    await add(stub, "sent", PROMPT, expected[:2])
    await admit(stub, "sent")
    owned = await block_ids(stub, "sent")
    await stub.AppendTokens(
        pb.AppendTokensRequest(
            request_id="sent", token_ids=full[len(PROMPT) :], block_hashes=[expected[2]]
        )
    )
    await stub.AllocateSlots(pb.AllocateSlotsRequest(request_id="sent", num_new_tokens=BLOCK - 8))
    await finish(stub, "sent")
    await add(stub, "hashed-here", [*full, 7], None)
    hit, hit_blocks = await admit(stub, "hashed-here")
    assert hit == 3 * BLOCK
    assert hit_blocks == owned[:3]
    assert (await stub.Audit(pb.AuditRequest())).ok


async def test_blocks_sent_without_a_hash_are_not_cached(server: KVCacheServer, stub: Any) -> None:
    await add(stub, "first-only", PROMPT, hashes_of(server, PROMPT)[:1])
    await admit(stub, "first-only")
    await finish(stub, "first-only")
    await add(stub, "again", PROMPT, None)
    assert (await admit(stub, "again"))[0] == BLOCK


Claim = Callable[[list[bytes]], list[bytes]]
REFUSED_ADDS: dict[str, tuple[Claim, bool, str]] = {
    "more hashes than full blocks": (lambda h: [*h, h[0]], True, "3 block hashes for 2 full"),
    "a hash of the wrong length": (lambda h: [h[0], h[1][:8]], True, "has 8 bytes"),
    "hashes without client_hashed": (lambda h: h, False, "not client_hashed"),
}


@pytest.mark.parametrize("case", list(REFUSED_ADDS))
async def test_a_bad_claim_is_refused_and_adds_nothing(
    server: KVCacheServer, stub: Any, case: str
) -> None:
    await add(stub, "bystander", OTHER, None)
    await admit(stub, "bystander")
    before = await snapshot(stub, ["bystander"])
    claim, client_hashed, words = REFUSED_ADDS[case]
    message = pb.AddRequestRequest(
        request_id="bad",
        prompt_token_ids=PROMPT,
        client_hashed=client_hashed,
        block_hashes=claim(hashes_of(server, PROMPT)),
    )
    detail = await expect_error(stub.AddRequest(message), grpc.StatusCode.INVALID_ARGUMENT)
    assert words in detail and "'bad'" in detail
    assert await snapshot(stub, ["bystander"]) == before
    await expect_error(
        stub.GetRequest(pb.GetRequestRequest(request_id="bad")), grpc.StatusCode.NOT_FOUND
    )


async def test_a_bad_append_is_refused_and_appends_nothing(
    server: KVCacheServer, stub: Any
) -> None:
    await add(stub, "client", PROMPT, hashes_of(server, PROMPT))
    await add(stub, "server", OTHER, None)
    before = await snapshot(stub, ["client", "server"])
    extra = hashes_of(server, PROMPT)[0]
    appends = {
        # 8 more tokens complete block 3, not 4.
        "client": ([1] * (BLOCK - 8), [extra, extra], "4 block hashes for 3 full"),
        "server": ([1] * (BLOCK - 8), [extra], "hashed by the server"),
    }
    for rid, (token_ids, hashes, words) in appends.items():
        message = pb.AppendTokensRequest(request_id=rid, token_ids=token_ids, block_hashes=hashes)
        detail = await expect_error(stub.AppendTokens(message), grpc.StatusCode.INVALID_ARGUMENT)
        assert words in detail
    assert await snapshot(stub, ["client", "server"]) == before


async def test_an_untrusted_caller_is_told_how_to_be_trusted() -> None:
    async with running_server(POOL) as server, raw_stub(server) as stub:
        config = await stub.GetCacheConfig(pb.GetCacheConfigRequest())
        assert not config.trusts_client_block_hashes
        message = pb.AddRequestRequest(
            request_id="r", prompt_token_ids=PROMPT, client_hashed=True, block_hashes=[]
        )
        detail = await expect_error(stub.AddRequest(message), grpc.StatusCode.FAILED_PRECONDITION)
        assert "--trust-client-block-hashes" in detail
        assert (await stub.GetUsage(pb.GetUsageRequest())).num_requests == 0


# -- named tenants: trust stays inside the tenant --------------------------------------------


def _tenants_config(tmp_path: Path) -> ServerConfig:
    """alpha and beta trusted, gamma hashed by the server (and an admin, to audit)."""
    path = write_tokens_file(
        tmp_path / "tokens.toml",
        {
            "alpha": {"tokens": [TOKENS["alpha"]], "trust_client_block_hashes": True},
            "beta": {"tokens": [TOKENS["beta"]], "trust_client_block_hashes": True},
            "gamma": {"tokens": [TOKENS["gamma"]], "admin": True},
        },
    )
    return dataclasses.replace(POOL, auth_tokens_file=path)


async def test_a_lying_tenant_reaches_no_other_tenants_blocks(tmp_path: Path) -> None:
    """beta (trusted) and gamma (hashed by the server) cache PROMPT. alpha claims, for
    other tokens, exactly the hashes their blocks are cached under: it gets no hit, and
    what it caches under those claims changes neither tenant's hits."""
    async with running_server(_tenants_config(tmp_path)) as server, raw_stub(server) as stub:
        honest = hashes_of(server, PROMPT)
        gamma_keys = hashes_of(server, PROMPT, tenant_cache_salt("gamma", None))
        await add(stub, "b1", PROMPT, honest, "beta")
        await admit(stub, "b1", "beta")
        beta_blocks = (await block_ids(stub, "b1", "beta"))[:2]
        await finish(stub, "b1", "beta")
        await add(stub, "g1", PROMPT, None, "gamma")
        await admit(stub, "g1", "gamma")
        gamma_blocks = (await block_ids(stub, "g1", "gamma"))[:2]
        await finish(stub, "g1", "gamma")

        for rid, claims in (("lie-beta", honest), ("lie-gamma", gamma_keys)):
            await add(stub, rid, OTHER, claims, "alpha")
            hit, _ = await admit(stub, rid, "alpha")
            assert hit == 0, f"{rid}: alpha's claim hit another tenant's blocks"
            await finish(stub, rid, "alpha")  # caches OTHER under the claims, for alpha

        await add(stub, "b2", PROMPT, honest, "beta")
        assert await admit(stub, "b2", "beta") == (2 * BLOCK, beta_blocks)
        await add(stub, "g2", PROMPT, None, "gamma")
        assert await admit(stub, "g2", "gamma") == (2 * BLOCK, gamma_blocks)
        assert (await stub.Audit(pb.AuditRequest(), metadata=metadata("gamma"))).ok


async def test_a_trusted_tenant_can_poison_only_its_own_cache(tmp_path: Path) -> None:
    """The boundary of the trust: alpha's lie reaches alpha's own later requests, whose
    claims it shares (what trusting a tenant's hashes means), and beta's identical
    claims reach nothing of alpha's."""
    async with running_server(_tenants_config(tmp_path)) as server, raw_stub(server) as stub:
        claims = hashes_of(server, PROMPT)
        await add(stub, "lie", OTHER, claims, "alpha")
        await admit(stub, "lie", "alpha")
        lied_blocks = (await block_ids(stub, "lie", "alpha"))[:2]
        await finish(stub, "lie", "alpha")
        await add(stub, "victim", PROMPT, claims, "alpha")
        assert await admit(stub, "victim", "alpha") == (2 * BLOCK, lied_blocks)
        await add(stub, "other-tenant", PROMPT, claims, "beta")
        assert (await admit(stub, "other-tenant", "beta"))[0] == 0


async def test_each_tenant_is_told_whether_it_is_trusted(tmp_path: Path) -> None:
    async with running_server(_tenants_config(tmp_path)) as server, raw_stub(server) as stub:
        for tenant, trusted in (("alpha", True), ("gamma", False)):
            config = await stub.GetCacheConfig(
                pb.GetCacheConfigRequest(), metadata=metadata(tenant)
            )
            assert config.trusts_client_block_hashes is trusted
        message = pb.AddRequestRequest(
            request_id="r", prompt_token_ids=PROMPT, client_hashed=True, block_hashes=[]
        )
        detail = await expect_error(
            stub.AddRequest(message, metadata=metadata("gamma")),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        assert "trust_client_block_hashes = true in [tenants.gamma]" in detail


# -- pins by the client's hashes --------------------------------------------------------


def _pinning(config: ServerConfig) -> ServerConfig:
    return dataclasses.replace(config, max_pinned_fraction=0.5)


async def pin(
    stub: Any, prompt: list[int], hashes: list[bytes] | None, tenant: str | None
) -> pb.Pin:
    message = pb.PinPrefixRequest(token_ids=prompt)
    if hashes is not None:
        message.block_hashes.extend(hashes)
    answer: pb.PinPrefixResponse = await stub.PinPrefix(message, metadata=metadata(tenant))
    return answer.pin


async def test_a_trusted_tenant_pins_its_client_hashed_blocks_by_their_hashes(
    tmp_path: Path,
) -> None:
    """alpha caches PROMPT under its own claims. A pin by tokens alone names the
    server's hashes of PROMPT in alpha's namespace, which key none of those blocks; a
    pin by the same claims holds both. beta pinning alpha's claims holds nothing of
    alpha's (its claims are keyed in its own namespace)."""
    config = _pinning(_tenants_config(tmp_path))
    async with running_server(config) as server, raw_stub(server) as stub:
        claims = hashes_of(server, PROMPT)[:2]
        await add(stub, "a1", PROMPT, claims, "alpha")
        await admit(stub, "a1", "alpha")
        await finish(stub, "a1", "alpha")
        assert (await pin(stub, PROMPT, None, "alpha")).num_held_blocks == 0
        pinned = await pin(stub, PROMPT, claims, "alpha")
        assert (pinned.num_tokens, pinned.num_held_blocks) == (2 * BLOCK, 2)
        assert (await pin(stub, PROMPT, claims, "beta")).num_held_blocks == 0
        # What alpha pinned is what its next client_hashed request hits.
        await add(stub, "a2", PROMPT, claims, "alpha")
        assert (await admit(stub, "a2", "alpha"))[0] == 2 * BLOCK
        assert (await stub.Audit(pb.AuditRequest(), metadata=metadata("gamma"))).ok


async def test_the_default_tenants_pin_by_hashes_is_its_pin_by_tokens() -> None:
    """For the default tenant the claims are vLLM's hashes, which the server computes
    too: both pins name the same blocks (one pin, refreshed)."""
    config = _pinning(dataclasses.replace(POOL, trust_client_block_hashes=True))
    async with running_server(config) as server, raw_stub(server) as stub:
        await add(stub, "r", PROMPT, hashes_of(server, PROMPT))
        await admit(stub, "r")
        await finish(stub, "r")
        by_tokens = await pin(stub, PROMPT, None, None)
        by_hashes = await pin(stub, PROMPT, hashes_of(server, PROMPT), None)
        assert by_hashes.pin_id == by_tokens.pin_id
        assert by_hashes.num_held_blocks == 2
        assert len((await stub.ListPins(pb.ListPinsRequest())).pins) == 1


REFUSED_PINS: dict[str, tuple[Claim, str | None, grpc.StatusCode, str]] = {
    "fewer hashes than whole blocks": (
        lambda h: h[:1],
        "alpha",
        grpc.StatusCode.INVALID_ARGUMENT,
        "1 block_hashes for the 2 whole blocks",
    ),
    "a hash of the wrong length": (
        lambda h: [h[0], h[1][:8]],
        "alpha",
        grpc.StatusCode.INVALID_ARGUMENT,
        "block_hashes[1] has 8 bytes",
    ),
    "a tenant not trusted": (
        lambda h: h,
        "gamma",
        grpc.StatusCode.FAILED_PRECONDITION,
        "trust_client_block_hashes = true in [tenants.gamma]",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_PINS))
async def test_a_bad_pin_claim_is_refused_and_pins_nothing(tmp_path: Path, case: str) -> None:
    claim, tenant, code, words = REFUSED_PINS[case]
    config = _pinning(_tenants_config(tmp_path))
    async with running_server(config) as server, raw_stub(server) as stub:
        await add(stub, "cached", PROMPT, hashes_of(server, PROMPT), "alpha")
        await admit(stub, "cached", "alpha")
        await finish(stub, "cached", "alpha")
        before = await stub.GetUsage(pb.GetUsageRequest(pool_wide=True), metadata=metadata("gamma"))
        detail = await expect_error(
            pin(stub, PROMPT, claim(hashes_of(server, PROMPT)[:2]), tenant), code
        )
        assert words in detail, detail
        listed = await stub.ListPins(
            pb.ListPinsRequest(all_tenants=True), metadata=metadata("gamma")
        )
        assert not listed.pins
        after = await stub.GetUsage(pb.GetUsageRequest(pool_wide=True), metadata=metadata("gamma"))
        assert after == before


def test_the_flag_with_a_tokens_file_is_refused_at_startup(tmp_path: Path) -> None:
    config = dataclasses.replace(_tenants_config(tmp_path), trust_client_block_hashes=True)
    with pytest.raises(SecurityConfigError, match="in the tables of the tenants"):
        KVCacheServer(config)


def test_a_trust_key_that_is_not_a_boolean_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[tenants.alpha]\ntokens = ["{TOKENS["alpha"]}"]\ntrust_client_block_hashes = "yes"\n'
    )
    config = dataclasses.replace(POOL, auth_tokens_file=str(path))
    with pytest.raises(SecurityConfigError, match="trust_client_block_hashes must be true or"):
        KVCacheServer(config)

"""Builders for the end-to-end tests: a small pool and the scheduler's moves as RPCs.
(The servers themselves: ``tests.servers`` and the fixtures of ``tests/conftest.py``.)"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from typing import Any

import grpc
import pytest

from kvservice.client import KVClient
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.config import ServerConfig
from tests.servers import Stub

# 10 usable blocks of 16 tokens (block 0 is the null block); one request of
# max_model_len tokens takes 8 of them.
SMALL_POOL = ServerConfig(
    port=0,
    metrics_port=None,
    num_blocks=11,
    block_size=16,
    max_model_len=128,
    num_layers=2,
    num_kv_heads=1,
    head_size=8,
    dtype="float32",
    model_name="test-model",
    shutdown_grace_s=0,
)

# Full attention and Mamba (two groups), 8-token blocks hashed every 4 tokens: partial
# prefix hits and their copy-on-write copies; fresh blocks are listed for zeroing.
HYBRID_POOL = ServerConfig(
    port=0,
    metrics_port=None,
    num_blocks=20,
    block_size=8,
    mamba_block_size=8,
    hash_block_size=4,
    max_model_len=64,
    num_layers=2,
    num_kv_heads=1,
    head_size=4,
    dtype="float32",
    shutdown_grace_s=0,
    needs_kv_cache_zeroing=True,
)


def wait_for_blocks_back(client: KVClient, safety_s: float = 60.0) -> None:
    """Wait until the pool holds no request and no block (a dead client's lease ran
    out), then check that the audit passes. ``safety_s`` is a safety net, not a
    timing: the leases the tests use end long before it."""
    deadline = time.monotonic() + safety_s
    while client.get_usage().num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    usage = client.get_usage()
    assert (usage.num_requests, usage.num_used_blocks) == (0, 0)
    assert client.audit().ok


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def ids(groups: Sequence[pb.BlockIds]) -> list[list[int]]:
    return [list(g.block_ids) for g in groups]


async def add(stub: Stub, request_id: str, prompt: list[int], **fields: Any) -> pb.RequestState:
    response: pb.AddRequestResponse = await stub.AddRequest(
        pb.AddRequestRequest(request_id=request_id, prompt_token_ids=prompt, **fields)
    )
    return response.request


async def lookup(stub: Stub, request_id: str) -> pb.GetComputedBlocksResponse:
    response: pb.GetComputedBlocksResponse = await stub.GetComputedBlocks(
        pb.GetComputedBlocksRequest(request_id=request_id)
    )
    return response


async def allocate(stub: Stub, request_id: str, num_new_tokens: int, **fields: Any) -> Any:
    response: pb.AllocateSlotsResponse = await stub.AllocateSlots(
        pb.AllocateSlotsRequest(request_id=request_id, num_new_tokens=num_new_tokens, **fields)
    )
    return response


async def admit(
    stub: Stub, request_id: str, hit: pb.GetComputedBlocksResponse | None = None
) -> pb.AllocateSlotsResponse:
    """What the scheduler does for a waiting request: look up its cached prefix
    (unless ``hit`` is that lookup), then allocate the rest of its tokens, attaching
    the hit."""
    hit = hit or await lookup(stub, request_id)
    current = await state(stub, request_id)
    response: pb.AllocateSlotsResponse = await allocate(
        stub,
        request_id,
        current.num_tokens - hit.num_computed_tokens,
        num_new_computed_tokens=hit.num_computed_tokens,
        new_computed_block_ids=hit.block_ids,
    )
    return response


async def append(stub: Stub, request_id: str, token_ids: list[int]) -> pb.RequestState:
    response: pb.AppendTokensResponse = await stub.AppendTokens(
        pb.AppendTokensRequest(request_id=request_id, token_ids=token_ids)
    )
    return response.request


async def free(stub: Stub, request_id: str, mode: pb.FreeMode.ValueType) -> pb.FreeRequestResponse:
    response: pb.FreeRequestResponse = await stub.FreeRequest(
        pb.FreeRequestRequest(request_id=request_id, mode=mode)
    )
    return response


async def usage(stub: Stub) -> pb.GetUsageResponse:
    response: pb.GetUsageResponse = await stub.GetUsage(pb.GetUsageRequest())
    return response


async def block_ids(stub: Stub, request_id: str) -> list[list[int]]:
    response: pb.GetBlockIdsResponse = await stub.GetBlockIds(
        pb.GetBlockIdsRequest(request_id=request_id)
    )
    return ids(response.block_ids)


async def state(stub: Stub, request_id: str) -> pb.RequestState:
    response: pb.GetRequestResponse = await stub.GetRequest(
        pb.GetRequestRequest(request_id=request_id)
    )
    return response.request


async def snapshot(stub: Stub, request_ids: Sequence[str]) -> list[Any]:
    """Everything a refused call must leave alone: the pool and each request's state
    and block table."""
    result: list[Any] = [await usage(stub)]
    for rid in request_ids:
        result += [await state(stub, rid), await block_ids(stub, rid)]
    return result


async def expect_error(call: Awaitable[Any], code: grpc.StatusCode) -> str:
    """Await a call that must fail with ``code``; returns the error message."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    details: str = info.value.details() or ""
    return details

"""Probe: what an allocation would need, answered without changing anything."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.app import KVCacheServer
from tests.core.helpers import free_queue_ids
from tests.server.support import add, admit, allocate, append, expect_error, free, tokens


async def probe(
    stub: pb_grpc.KVCacheServiceStub, request_id: str, **fields: Any
) -> pb.ProbeResponse:
    response: pb.ProbeResponse = await stub.Probe(pb.ProbeRequest(request_id=request_id, **fields))
    return response


async def test_admission_probe_leaves_lru_order_and_stats(
    server: KVCacheServer, stub: pb_grpc.KVCacheServiceStub
) -> None:
    """Probing a hit on free cached blocks answers the hit and the blocks needed, but
    the free queue order, the prefix cache counters and the pool are untouched."""
    await add(stub, "a", tokens(48))
    await admit(stub, "a")
    await free(stub, "a", pb.FREE_MODE_FINISH)
    await add(stub, "b", tokens(64))
    manager = server.table.manager
    order = free_queue_ids(manager)
    usage_before = await stub.GetUsage(pb.GetUsageRequest())

    answer = await probe(stub, "b")
    assert (answer.num_hit_tokens, answer.num_new_tokens) == (48, 16)
    assert (answer.num_blocks_to_allocate, answer.num_free_blocks, answer.would_fit) == (
        4,
        10,
        True,
    )
    assert free_queue_ids(manager) == order
    assert await stub.GetUsage(pb.GetUsageRequest()) == usage_before
    server.audit()


async def test_running_probe_and_fit(stub: pb_grpc.KVCacheServiceStub) -> None:
    """A running request is probed for its next tokens; would_fit turns false when
    the pool is short, exactly when AllocateSlots answers NO_SPACE."""
    await add(stub, "a", tokens(32))
    await admit(stub, "a")
    await append(stub, "a", [1])
    decode = await probe(stub, "a", num_new_tokens=1)
    assert (decode.num_hit_tokens, decode.num_blocks_to_allocate, decode.would_fit) == (0, 1, True)
    tight = await probe(stub, "a", num_new_tokens=1, reserved_blocks=8)
    assert not tight.would_fit
    big = await probe(stub, "a", num_new_tokens=1, num_lookahead_tokens=95)
    assert (big.num_blocks_to_allocate, big.would_fit) == (6, True)
    too_big = await probe(stub, "a", num_new_tokens=1, num_lookahead_tokens=95, reserved_blocks=5)
    assert not too_big.would_fit
    refused = await allocate(stub, "a", 1, num_lookahead_tokens=95, reserved_blocks=5)
    assert refused.outcome == pb.ALLOCATION_OUTCOME_NO_SPACE


@pytest.mark.parametrize(
    ("request_id", "fields", "code"),
    [
        ("ghost", {}, grpc.StatusCode.NOT_FOUND),
        ("w", {"num_new_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT),
        ("w", {"num_lookahead_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT),
        ("w", {"reserved_blocks": -1}, grpc.StatusCode.INVALID_ARGUMENT),
        ("w", {"num_new_tokens": 500}, grpc.StatusCode.OUT_OF_RANGE),
    ],
)
async def test_probe_errors(
    stub: pb_grpc.KVCacheServiceStub,
    request_id: str,
    fields: dict[str, int],
    code: grpc.StatusCode,
) -> None:
    """Probe refuses what AllocateSlots would refuse, with the same codes."""
    await add(stub, "w", tokens(10))
    await expect_error(probe(stub, request_id, **fields), code)

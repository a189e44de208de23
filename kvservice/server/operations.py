"""The per-request operations, once: protobuf request in, protobuf response
filled in place.

The unary RPCs and the operations of a ``Step`` call the same functions, which is what
makes a batched step answer exactly what the same calls made one by one would. None of
them awaits: each runs to completion on the loop that owns the allocator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvservice.server import converters
from kvservice.server.allocator import Allocator
from kvservice.server.caller import CURRENT_CALLER
from kvservice.server.gen import kv_cache_service_pb2 as pb

# (allocator, request message, response message to fill) -> None; protobuf messages
# are untyped at this level because the table below mixes every kind. Each operation
# writes its answer into the given message in place (a fresh response for a unary
# call, the StepResult's field for a step), so a step builds no message it then
# copies; it writes only once the allocator has answered, so a refusal leaves the
# message untouched.
Operation = Callable[[Allocator, Any, Any], None]


def _tenant() -> str:
    # The tenant the auth interceptor set for this call ("" without tokens); read per
    # operation, so a Step's operations act for the tenant of the call carrying them.
    return CURRENT_CALLER.get().tenant


def _fill_state(out: pb.RequestState, request: Any, request_id: str) -> None:
    converters.fill_request_state(out, request)
    # A named tenant's request is stored under a longer core key; answer with the id
    # the client knows it by.
    out.request_id = request_id


def add_request(
    allocator: Allocator, msg: pb.AddRequestRequest, out: pb.AddRequestResponse
) -> None:
    added = allocator.add_request(converters.new_request_from_pb(msg), _tenant())
    _fill_state(out.request, added, msg.request_id)


def append_tokens(
    allocator: Allocator, msg: pb.AppendTokensRequest, out: pb.AppendTokensResponse
) -> None:
    updated = allocator.append_tokens(msg.request_id, list(msg.token_ids), _tenant())
    _fill_state(out.request, updated, msg.request_id)


def get_computed_blocks(
    allocator: Allocator, msg: pb.GetComputedBlocksRequest, out: pb.GetComputedBlocksResponse
) -> None:
    converters.fill_computed_blocks(out, allocator.get_computed_blocks(msg.request_id, _tenant()))


def allocate_slots(
    allocator: Allocator, msg: pb.AllocateSlotsRequest, out: pb.AllocateSlotsResponse
) -> None:
    args = converters.allocate_args_from_pb(msg)
    converters.fill_allocation(out, allocator.allocate_slots(msg.request_id, args, _tenant()))
    out.request.request_id = msg.request_id


def free_request(
    allocator: Allocator, msg: pb.FreeRequestRequest, out: pb.FreeRequestResponse
) -> None:
    freed = allocator.free(msg.request_id, converters.free_mode_from_pb(msg.mode), _tenant())
    _fill_state(out.request, freed, msg.request_id)
    out.num_free_blocks = allocator.manager.block_pool.get_num_free_blocks()


def probe(allocator: Allocator, msg: pb.ProbeRequest, out: pb.ProbeResponse) -> None:
    args = converters.probe_args_from_pb(msg)
    out.CopyFrom(converters.probe_to_pb(allocator.probe(msg.request_id, args, _tenant())))


def get_request(
    allocator: Allocator, msg: pb.GetRequestRequest, out: pb.GetRequestResponse
) -> None:
    found = allocator.get_request(msg.request_id, _tenant())
    _fill_state(out.request, found, msg.request_id)


def get_block_ids(
    allocator: Allocator, msg: pb.GetBlockIdsRequest, out: pb.GetBlockIdsResponse
) -> None:
    converters.add_block_ids(out.block_ids, allocator.get_block_ids(msg.request_id, _tenant()))


def get_usage(allocator: Allocator, msg: pb.GetUsageRequest, out: pb.GetUsageResponse) -> None:
    out.CopyFrom(converters.usage_to_pb(allocator.usage()))


# The StepOperation oneof field name -> the operation. StepResult's oneof uses the same
# names, so a result is filed under the name of the operation that produced it.
STEP_OPERATIONS: dict[str, Operation] = {
    "add_request": add_request,
    "append_tokens": append_tokens,
    "get_computed_blocks": get_computed_blocks,
    "allocate_slots": allocate_slots,
    "free_request": free_request,
    "probe": probe,
    "get_request": get_request,
    "get_block_ids": get_block_ids,
    "get_usage": get_usage,
}

"""The per-request operations, once: protobuf request in, protobuf response
filled in place.

The unary RPCs and the operations of a ``Step`` call the same functions, which is what
makes a batched step answer exactly what the same calls made one by one would. None of
them awaits: each runs to completion on the loop that owns the allocator.
"""

from __future__ import annotations

from typing import Any, Protocol

import structlog

from kvservice.core.errors import InvalidArgumentError, KVCacheError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server import admission, converters
from kvservice.server.allocator import Allocator
from kvservice.server.caller import CURRENT_CALLER
from kvservice.server.errors import status_code_of, status_message_of

log = structlog.get_logger("kvservice.step")


class Operation(Protocol):
    """(allocator, request message, response message to fill, tenant) -> None.

    Protobuf messages are untyped at this level because the tables below mix every
    kind. Each operation writes its answer into the given message in place (a fresh
    response for a unary call, the StepResult's field for a step), so a step builds no
    message it then copies; it writes only once the allocator has answered, so a
    refusal leaves the message untouched. ``tenant`` None reads the current caller's;
    a Step resolves it once for all its operations.
    """

    def __call__(
        self, allocator: Allocator, msg: Any, out: Any, tenant: str | None = None, /
    ) -> None: ...


def _tenant(tenant: str | None) -> str:
    # The tenant the auth interceptor set for this call ("" without tokens).
    return CURRENT_CALLER.get().tenant if tenant is None else tenant


def current_tenant() -> str:
    """The tenant of the call running in this task, which a Step's operations act
    for: resolved once per Step rather than once per operation."""
    return CURRENT_CALLER.get().tenant


def _fill_state(out: pb.RequestState, request: Any, request_id: str) -> None:
    converters.fill_request_state(out, request)
    # A named tenant's request is stored under a longer core key; answer with the id
    # the client knows it by.
    out.request_id = request_id


def add_request(
    allocator: Allocator,
    msg: pb.AddRequestRequest,
    out: pb.AddRequestResponse,
    tenant: str | None = None,
    /,
) -> None:
    added = allocator.add_request(converters.new_request_from_pb(msg), _tenant(tenant))
    _fill_state(out.request, added, msg.request_id)


def append_tokens(
    allocator: Allocator,
    msg: pb.AppendTokensRequest,
    out: pb.AppendTokensResponse,
    tenant: str | None = None,
    /,
) -> None:
    updated = allocator.append_tokens(msg.request_id, list(msg.token_ids), _tenant(tenant))
    _fill_state(out.request, updated, msg.request_id)


def append_tokens_without_state(
    allocator: Allocator,
    msg: pb.AppendTokensRequest,
    out: pb.AppendTokensResponse,
    tenant: str | None = None,
    /,
) -> None:
    """``append_tokens`` answering no ``request`` (``StepRequest.omit_request_state``)."""
    allocator.append_tokens(msg.request_id, list(msg.token_ids), _tenant(tenant))


def get_computed_blocks(
    allocator: Allocator,
    msg: pb.GetComputedBlocksRequest,
    out: pb.GetComputedBlocksResponse,
    tenant: str | None = None,
    /,
) -> None:
    hit = allocator.get_computed_blocks(msg.request_id, _tenant(tenant))
    converters.fill_computed_blocks(out, hit)


def allocate_slots(
    allocator: Allocator,
    msg: pb.AllocateSlotsRequest,
    out: pb.AllocateSlotsResponse,
    tenant: str | None = None,
    /,
) -> None:
    args = converters.allocate_args_from_pb(msg)
    converters.fill_allocation(out, allocator.allocate_slots(msg.request_id, args, _tenant(tenant)))
    out.request.request_id = msg.request_id


def allocate_slots_without_state(
    allocator: Allocator,
    msg: pb.AllocateSlotsRequest,
    out: pb.AllocateSlotsResponse,
    tenant: str | None = None,
    /,
) -> None:
    """``allocate_slots`` answering no ``request`` (``StepRequest.omit_request_state``):
    for a scheduler that counts its requests' tokens itself."""
    args = converters.allocate_args_from_pb(msg)
    allocation = allocator.allocate_slots(msg.request_id, args, _tenant(tenant))
    converters.fill_allocation(out, allocation, with_request=False)


def free_request(
    allocator: Allocator,
    msg: pb.FreeRequestRequest,
    out: pb.FreeRequestResponse,
    tenant: str | None = None,
    /,
) -> None:
    mode = converters.free_mode_from_pb(msg.mode)
    freed = allocator.free(msg.request_id, mode, _tenant(tenant))
    _fill_state(out.request, freed, msg.request_id)
    out.num_free_blocks = allocator.manager.block_pool.get_num_free_blocks()


def probe(
    allocator: Allocator,
    msg: pb.ProbeRequest,
    out: pb.ProbeResponse,
    tenant: str | None = None,
    /,
) -> None:
    args = converters.probe_args_from_pb(msg)
    out.CopyFrom(converters.probe_to_pb(allocator.probe(msg.request_id, args, _tenant(tenant))))


def get_request(
    allocator: Allocator,
    msg: pb.GetRequestRequest,
    out: pb.GetRequestResponse,
    tenant: str | None = None,
    /,
) -> None:
    found = allocator.get_request(msg.request_id, _tenant(tenant))
    _fill_state(out.request, found, msg.request_id)


def get_block_ids(
    allocator: Allocator,
    msg: pb.GetBlockIdsRequest,
    out: pb.GetBlockIdsResponse,
    tenant: str | None = None,
    /,
) -> None:
    block_ids = allocator.get_block_ids(msg.request_id, _tenant(tenant))
    converters.add_block_ids(out.block_ids, block_ids)


def get_usage(
    allocator: Allocator,
    msg: pb.GetUsageRequest,
    out: pb.GetUsageResponse,
    tenant: str | None = None,
    /,
) -> None:
    out.CopyFrom(converters.usage_to_pb(allocator.usage()))


def admit(
    allocator: Allocator,
    msg: pb.AdmitRequest,
    out: pb.AdmitResponse,
    tenant: str | None = None,
    /,
) -> None:
    _fill_admission(out, admission.admit(allocator, _admit_args(msg), _tenant(tenant)), True)


def admit_without_state(
    allocator: Allocator,
    msg: pb.AdmitRequest,
    out: pb.AdmitResponse,
    tenant: str | None = None,
    /,
) -> None:
    """``admit`` whose allocations answer no ``request`` (``omit_request_state``)."""
    _fill_admission(out, admission.admit(allocator, _admit_args(msg), _tenant(tenant)), False)


def _admit_args(msg: pb.AdmitRequest) -> admission.AdmitArgs:
    return admission.AdmitArgs(
        request_ids=list(msg.request_ids),
        token_budget=msg.token_budget,
        enable_chunked_prefill=msg.enable_chunked_prefill,
        num_lookahead_tokens=msg.num_lookahead_tokens,
        full_sequence_must_fit=msg.full_sequence_must_fit,
    )


def _fill_admission(
    out: pb.AdmitResponse, result: admission.ServerAdmission, with_request: bool
) -> None:
    for one in result.admitted:
        admitted = out.admitted.add()
        converters.fill_computed_blocks(admitted.hit, one.hit)
        admitted.num_new_tokens = one.num_new_tokens
        converters.fill_allocation(admitted.allocation, one.allocation, with_request)
        if with_request:
            # The id the client knows, not a named tenant's longer core key.
            admitted.allocation.request.request_id = one.request_id
    out.stop_reason = converters.admit_stop_to_pb(result.stop)
    if result.stop_error is not None:
        out.stop_message = str(result.stop_error)


# -- columnar operations (AppendTokensBatch, AllocateSlotsBatch) ----------------------


class BatchOperation(Protocol):
    """(allocator, batch message, batch response to fill, tenant, stop_on_error,
    with_state) -> the status code number of the first refused entry, 0 when none.

    Each entry runs through the same allocator method as its single operation, in
    order, so it answers and changes exactly what that operation would. Raises
    ``InvalidArgumentError`` before anything runs for a batch malformed as a whole.
    """

    def __call__(
        self,
        allocator: Allocator,
        msg: Any,
        out: Any,
        tenant: str,
        stop_on_error: bool,
        with_state: bool,
        /,
    ) -> int: ...


def _check_columns(kind: str, num_ids: int, column: str, num_values: int) -> None:
    if not num_ids:
        raise InvalidArgumentError(f"{kind}: request_ids must hold at least one request")
    if num_values != num_ids:
        raise InvalidArgumentError(
            f"{kind}: {column} has {num_values} values for {num_ids} request_ids (one each)"
        )


def _entry_error(errors: Any, index: int, err: Exception) -> int:
    """Record a refused (or crashed) entry; its status code number."""
    if isinstance(err, KVCacheError):
        code: int = status_code_of(err).value[0]
        message = status_message_of(err)
    else:
        log.exception("batch entry crashed", index=index)
        code, message = _INTERNAL, "internal error; see the server log"
    errors.add(index=index, code=code, message=message)
    return code


_INTERNAL = 13  # grpc.StatusCode.INTERNAL


def append_tokens_batch(
    allocator: Allocator,
    msg: pb.AppendTokensBatch,
    out: pb.AppendTokensBatchResponse,
    tenant: str,
    stop_on_error: bool,
    with_state: bool,
    /,
) -> int:
    """One token appended per entry: ``append_tokens`` in a loop, with no message per
    entry (unless the request states are wanted)."""
    ids = list(msg.request_ids)
    tokens = list(msg.token_ids)
    _check_columns("append_tokens_batch", len(ids), "token_ids", len(tokens))
    out.num_requests = len(ids)
    append = allocator.append_token
    states = out.requests if with_state else None
    first_code = 0
    index = -1
    for index, (rid, token) in enumerate(zip(ids, tokens, strict=True)):
        try:
            request = append(rid, token, tenant)
        except Exception as err:
            code = _entry_error(out.errors, index, err)
            first_code = first_code or code
            if states is not None:
                states.add()
            if stop_on_error:
                break
            continue
        if states is not None:
            _fill_state(states.add(), request, rid)
    out.num_run = index + 1
    return first_code


def allocate_slots_batch(
    allocator: Allocator,
    msg: pb.AllocateSlotsBatch,
    out: pb.AllocateSlotsBatchResponse,
    tenant: str,
    stop_on_error: bool,
    with_state: bool,
    /,
) -> int:
    """A plain ``allocate_slots`` per entry, answered column by column (see
    ``converters.AllocationColumns``)."""
    ids = list(msg.request_ids)
    nums = list(msg.num_new_tokens)
    _check_columns("allocate_slots_batch", len(ids), "num_new_tokens", len(nums))
    out.num_requests = len(ids)
    columns = converters.AllocationColumns(allocator.manager.num_kv_cache_groups)
    allocate = allocator.allocate_new_tokens
    states = out.requests if with_state else None
    first_code = 0
    index = -1
    for index, (rid, num) in enumerate(zip(ids, nums, strict=True)):
        try:
            allocation = allocate(rid, num, tenant)
        except Exception as err:
            code = _entry_error(out.errors, index, err)
            first_code = first_code or code
            columns.add_nothing()
            if states is not None:
                states.add()
            if stop_on_error:
                break
            continue
        if allocation.new_block_ids is None:
            out.no_space.append(index)
            columns.add_nothing()
        else:
            columns.add(allocation)
        if states is not None:
            _fill_state(states.add(), allocation.request, rid)
    out.num_run = index + 1
    columns.fill(out)
    return first_code


# The StepOperation oneof field name of each columnar operation -> the operation.
BATCH_OPERATIONS: dict[str, BatchOperation] = {
    "append_tokens_batch": append_tokens_batch,
    "allocate_slots_batch": allocate_slots_batch,
}


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
    "admit": admit,
}
# The same, for a step that set ``omit_request_state``.
STEP_OPERATIONS_WITHOUT_STATE: dict[str, Operation] = {
    **STEP_OPERATIONS,
    "append_tokens": append_tokens_without_state,
    "allocate_slots": allocate_slots_without_state,
    "admit": admit_without_state,
}

"""The per-request operations, once: protobuf request in, protobuf response
filled in place.

The unary RPCs and the operations of a ``Step`` call the same functions, which is what
makes a batched step answer exactly what the same calls made one by one would. The
per-request ones do not await: each runs to completion on the loop that owns the
request table. The ones that may carry thousands of entries (``Admit``, the columnar
batches) pause between entries every ``turns.SLICE_S`` of work, with the table's turn
held by their caller (``SLICED_OPERATIONS``), as a Step pauses between operations, so
no single call holds up the loop (health checks) for longer than a slice.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol

import structlog

from kvservice.core.allocation_options import AllocationOptions
from kvservice.core.errors import InvalidArgumentError, KVCacheError
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table import admission
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, Allocation
from kvservice.server import converters
from kvservice.server.caller import Caller
from kvservice.server.errors import PermissionDeniedError, status_code_of, status_message_of
from kvservice.server.turns import Slices

log = structlog.get_logger("kvservice.step")


class Operation(Protocol):
    """(table, request message, response message to fill, caller, with_state) ->
    None.

    Protobuf messages are untyped at this level because the tables below mix every
    kind. Each operation writes its answer into the given message in place (a fresh
    response for a unary call, the StepResult's field for a step), so a step builds no
    message it then copies; it writes only once the table has answered, so a refusal
    leaves the message untouched. ``with_state`` False leaves the request state out of
    the answers of appends and allocations (``StepRequest.omit_request_state``).
    """

    def __call__(
        self, table: RequestTable, msg: Any, out: Any, caller: Caller, with_state: bool, /
    ) -> None: ...


def add_request(
    table: RequestTable,
    msg: pb.AddRequestRequest,
    out: pb.AddRequestResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    # Before the message's items are read into Python values: an oversized one costs
    # only its refusal.
    table.check_request_size(msg.request_id, len(msg.mm_features), caller.tenant)
    new = converters.new_request_from_pb(msg)
    added = table.add_request(new, caller.tenant, caller.session_id)
    converters.fill_request_state(out.request, added)


def append_tokens(
    table: RequestTable,
    msg: pb.AppendTokensRequest,
    out: pb.AppendTokensResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    updated = table.append_tokens(
        msg.request_id, list(msg.token_ids), caller.tenant, list(msg.block_hashes)
    )
    if with_state:
        converters.fill_request_state(out.request, updated)


def get_computed_blocks(
    table: RequestTable,
    msg: pb.GetComputedBlocksRequest,
    out: pb.GetComputedBlocksResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    cap = msg.max_cache_hit_length if msg.HasField("max_cache_hit_length") else None
    hit = table.get_computed_blocks(msg.request_id, caller.tenant, cap)
    converters.fill_computed_blocks(out, hit)


def allocate_slots(
    table: RequestTable,
    msg: pb.AllocateSlotsRequest,
    out: pb.AllocateSlotsResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    args = converters.allocate_args_from_pb(msg)
    allocation = table.allocate_slots(msg.request_id, args, caller.tenant)
    converters.fill_allocation(out, allocation, with_state)


def new_step_starts(
    table: RequestTable,
    msg: pb.NewStepStartsRequest,
    out: pb.NewStepStartsResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    table.new_step_starts()


def free_retained_blocks(
    table: RequestTable,
    msg: pb.FreeRetainedBlocksRequest,
    out: pb.FreeRetainedBlocksResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    out.num_free_blocks = table.free_retained_blocks(
        list(msg.block_ids), caller.tenant, caller.session_id
    )


def evict_blocks(
    table: RequestTable,
    msg: pb.EvictBlocksRequest,
    out: pb.EvictBlocksResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    table.evict_blocks(list(msg.block_ids), caller.tenant, caller.session_id)


def remove_skipped_blocks(
    table: RequestTable,
    msg: pb.RemoveSkippedBlocksRequest,
    out: pb.RemoveSkippedBlocksResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    out.num_free_blocks = table.remove_skipped_blocks(
        msg.request_id, msg.processed_computed_tokens, caller.tenant
    )


def cache_blocks(
    table: RequestTable,
    msg: pb.CacheBlocksRequest,
    out: pb.CacheBlocksResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    table.cache_blocks(msg.request_id, msg.num_computed_tokens, caller.tenant)


def free_request(
    table: RequestTable,
    msg: pb.FreeRequestRequest,
    out: pb.FreeRequestResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    mode = converters.free_mode_from_pb(msg.mode)
    freed = table.free(msg.request_id, mode, caller.tenant, msg.keep_blocks)
    converters.fill_request_state(out.request, freed)
    out.num_free_blocks = table.manager.block_pool.get_num_free_blocks()


def probe(
    table: RequestTable,
    msg: pb.ProbeRequest,
    out: pb.ProbeResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    num_new_tokens, options = converters.probe_args_from_pb(msg)
    answer = table.probe(msg.request_id, num_new_tokens, options, caller.tenant)
    out.CopyFrom(converters.probe_to_pb(answer))


def get_request(
    table: RequestTable,
    msg: pb.GetRequestRequest,
    out: pb.GetRequestResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    converters.fill_request_state(out.request, table.get_request(msg.request_id, caller.tenant))


def get_block_ids(
    table: RequestTable,
    msg: pb.GetBlockIdsRequest,
    out: pb.GetBlockIdsResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    converters.add_block_ids(out.block_ids, table.get_block_ids(msg.request_id, caller.tenant))


def get_usage(
    table: RequestTable,
    msg: pb.GetUsageRequest,
    out: pb.GetUsageResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    if msg.pool_wide and not caller.admin:
        raise PermissionDeniedError(
            f"tenant {caller.tenant!r} may not ask for pool_wide usage: it shows every "
            f"tenant's activity (set admin = true for the tenant in the tokens file)"
        )
    # The default tenant exists only on a server without tenants: its view is the pool.
    pool_wide = msg.pool_wide or caller.tenant == DEFAULT_TENANT
    usage = table.usage() if pool_wide else table.tenant_usage(caller.tenant)
    out.CopyFrom(converters.usage_to_pb(usage))
    out.pool_wide = pool_wide


def pin_prefix(
    table: RequestTable,
    msg: pb.PinPrefixRequest,
    out: pb.PinPrefixResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    # Every argument is read and checked before the table changes anything.
    args = converters.pin_args_from_pb(msg)
    converters.fill_pin(out.pin, table.pin_prefix(args, caller.tenant))


def unpin_prefix(
    table: RequestTable,
    msg: pb.UnpinPrefixRequest,
    out: pb.UnpinPrefixResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    table.unpin_prefix(msg.pin_id, caller.tenant)


def list_pins(
    table: RequestTable,
    msg: pb.ListPinsRequest,
    out: pb.ListPinsResponse,
    caller: Caller,
    with_state: bool,
    /,
) -> None:
    if msg.all_tenants and not caller.admin:
        raise PermissionDeniedError(
            f"tenant {caller.tenant!r} may not list every tenant's pins: they name other "
            f"tenants' prefixes (set admin = true for the tenant in the tokens file)"
        )
    pins = table.list_pins(None if msg.all_tenants else caller.tenant)
    converters.fill_pins(out, pins, table.pinned_budget())


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
    "new_step_starts": new_step_starts,
    "free_retained_blocks": free_retained_blocks,
    "cache_blocks": cache_blocks,
    "pin_prefix": pin_prefix,
    "unpin_prefix": unpin_prefix,
    "list_pins": list_pins,
    "evict_blocks": evict_blocks,
    "remove_skipped_blocks": remove_skipped_blocks,
}


# -- columnar operations (AppendTokensBatch, AllocateSlotsBatch, FreeBatch...) ---------


class BatchOperation(Protocol):
    """(table, batch message, batch response to fill, caller, stop_on_error,
    with_state, slices) -> the status code number of the first refused entry, 0 when
    none.

    Each entry runs through the same table method as its single operation, in order,
    so it answers and changes exactly what that operation would; between two entries
    the operation pauses whenever ``slices`` says a slice of work is done (its caller
    holds the table's turn, so nothing else touches the table meanwhile). Raises
    ``InvalidArgumentError`` before anything runs for a batch malformed as a whole.
    """

    def __call__(
        self,
        table: RequestTable,
        msg: Any,
        out: Any,
        caller: Caller,
        stop_on_error: bool,
        with_state: bool,
        slices: Slices,
        /,
    ) -> Coroutine[Any, Any, int]: ...


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


_INTERNAL: Final = 13  # grpc.StatusCode.INTERNAL


async def append_tokens_batch(
    table: RequestTable,
    msg: pb.AppendTokensBatch,
    out: pb.AppendTokensBatchResponse,
    caller: Caller,
    stop_on_error: bool,
    with_state: bool,
    slices: Slices,
    /,
) -> int:
    """One token appended per entry (with the hashes of the blocks it completes, for a
    client_hashed request): ``append_tokens`` in a loop, with no message per entry
    (unless the request states are wanted)."""
    ids = msg.request_ids[:]
    tokens = msg.token_ids[:]
    _check_columns("append_tokens_batch", len(ids), "token_ids", len(tokens))
    hashes = converters.appended_hashes(msg)
    out.num_requests = len(ids)
    tenant = caller.tenant
    states = out.requests if with_state else None
    clock = slices.clock
    first_code = 0
    index = -1
    for index in range(len(ids)):
        if clock.due():
            await slices.pause()
        rid = ids[index]
        try:
            if hashes is None:
                request = table.append_tokens(rid, [tokens[index]], tenant)
            else:
                request = table.append_tokens(rid, [tokens[index]], tenant, hashes[index])
        except Exception as err:
            code = _entry_error(out.errors, index, err)
            first_code = first_code or code
            if states is not None:
                states.add()
            if stop_on_error:
                break
            continue
        if states is not None:
            converters.fill_request_state(states.add(), request)
    out.num_run = index + 1
    return first_code


async def allocate_slots_batch(
    table: RequestTable,
    msg: pb.AllocateSlotsBatch,
    out: pb.AllocateSlotsBatchResponse,
    caller: Caller,
    stop_on_error: bool,
    with_state: bool,
    slices: Slices,
    /,
) -> int:
    """A plain ``allocate_slots`` per entry, answered column by column (see
    ``converters.AllocationColumns``)."""
    ids = msg.request_ids[:]
    nums = msg.num_new_tokens[:]
    _check_columns("allocate_slots_batch", len(ids), "num_new_tokens", len(nums))
    out.num_requests = len(ids)
    columns = converters.AllocationColumns(table.manager.num_kv_cache_groups)
    tenant = caller.tenant
    states = out.requests if with_state else None
    no_space = out.no_space
    clock = slices.clock
    first_code = 0
    index = -1
    for index in range(len(ids)):
        if clock.due():
            await slices.pause()
        rid = ids[index]
        try:
            allocation = table.allocate_slots(rid, AllocateArgs(nums[index]), tenant)
        except Exception as err:
            code = _refused(out.errors, index, err, columns, states)
            first_code = first_code or code
            if stop_on_error:
                break
            continue
        _allocated(no_space, index, allocation, columns, states)
    out.num_run = index + 1
    columns.fill(out)
    return first_code


def _refused(
    errors: Any,
    index: int,
    err: Exception,
    columns: converters.AllocationColumns,
    states: Any,
) -> int:
    """An allocation entry refused: its error, no blocks, an empty state (when the
    states are answered); its status code number."""
    code = _entry_error(errors, index, err)
    columns.add_nothing()
    if states is not None:
        states.add()
    return code


def _allocated(
    no_space: Any,
    index: int,
    allocation: Allocation,
    columns: converters.AllocationColumns,
    states: Any,
) -> None:
    """An allocation entry answered: its blocks, or NO_SPACE; its state when wanted."""
    if allocation.new_block_ids is None:
        no_space.append(index)
        columns.add_nothing()
    else:
        columns.add(allocation)
    if states is not None:
        converters.fill_request_state(states.add(), allocation.request)


async def free_batch(
    table: RequestTable,
    msg: pb.FreeBatch,
    out: pb.FreeBatchResponse,
    caller: Caller,
    stop_on_error: bool,
    with_state: bool,
    slices: Slices,
    /,
) -> int:
    """``free_request`` per entry, answering only the refused ones (a step's frees
    read nothing back)."""
    ids = msg.request_ids[:]
    modes = msg.modes[:]
    _check_columns("free_batch", len(ids), "modes", len(modes))
    keep = msg.keep_blocks[:]
    if keep:
        _check_columns("free_batch", len(ids), "keep_blocks", len(keep))
    else:
        keep = [False] * len(ids)
    tenant = caller.tenant

    def free(index: int) -> None:
        table.free(ids[index], converters.free_mode_from_pb(modes[index]), tenant, keep[index])

    out.num_requests = len(ids)
    out.num_run, first_code = await _each_entry(len(ids), free, out.errors, stop_on_error, slices)
    return first_code


async def add_request_batch(
    table: RequestTable,
    msg: pb.AddRequestBatch,
    out: pb.AddRequestBatchResponse,
    caller: Caller,
    stop_on_error: bool,
    with_state: bool,
    slices: Slices,
    /,
) -> int:
    """``add_request`` per entry (a plain request: a packed prompt and, client_hashed,
    its hashes), answering only the refused ones (the client sent the new state)."""
    num_ids = len(msg.request_ids)
    _check_columns("add_request_batch", num_ids, "num_prompt_tokens", len(msg.num_prompt_tokens))
    new = converters.new_requests_from_batch(msg)
    tenant, session_id = caller.tenant, caller.session_id

    def add(index: int) -> None:
        request = new[index]
        table.check_request_size(request.request_id, 0, tenant)
        table.add_request(request, tenant, session_id)

    out.num_requests = len(new)
    out.num_run, first_code = await _each_entry(len(new), add, out.errors, stop_on_error, slices)
    return first_code


async def _each_entry(
    count: int,
    run_entry: Callable[[int], object],
    errors: Any,
    stop_on_error: bool,
    slices: Slices,
) -> tuple[int, int]:
    """Run entries 0 to ``count - 1`` of a batch that answers only its refusals, in
    order, pausing when a slice is done; a refused entry is recorded in ``errors``,
    and under ``stop_on_error`` ends the batch. (Entries run, the status code number
    of the first refused one or 0.)"""
    clock = slices.clock
    first_code = 0
    index = -1
    for index in range(count):
        if clock.due():
            await slices.pause()
        try:
            run_entry(index)
        except Exception as err:
            code = _entry_error(errors, index, err)
            first_code = first_code or code
            if stop_on_error:
                break
    return index + 1, first_code


async def lookup_allocate_batch(
    table: RequestTable,
    msg: pb.LookupAllocateBatch,
    out: pb.LookupAllocateBatchResponse,
    caller: Caller,
    stop_on_error: bool,
    with_state: bool,
    slices: Slices,
    /,
) -> int:
    """``get_computed_blocks`` then ``allocate_slots`` attaching its hit, per entry
    (see the proto), answered column by column."""
    ids = msg.request_ids[:]
    nums = msg.num_new_tokens[:]
    _check_columns("lookup_allocate_batch", len(ids), "num_new_tokens", len(nums))
    out.num_requests = len(ids)
    allocations = out.allocations
    no_space = allocations.no_space
    num_groups = table.manager.num_kv_cache_groups
    hits = converters.HitColumns(num_groups)
    columns = converters.AllocationColumns(num_groups)
    options = converters.lookup_allocate_options(msg)
    tenant = caller.tenant
    states = allocations.requests if with_state else None
    clock = slices.clock
    first_code = 0
    index = -1
    for index in range(len(ids)):
        if clock.due():
            await slices.pause()
        rid = ids[index]
        try:
            allocation = _lookup_allocate(table, rid, nums[index], options, tenant, hits)
        except Exception as err:
            code = _refused(out.errors, index, err, columns, states)
            first_code = first_code or code
            if stop_on_error:
                break
            continue
        _allocated(no_space, index, allocation, columns, states)
    out.num_run = allocations.num_run = index + 1
    allocations.num_requests = len(ids)
    hits.fill(out)
    columns.fill(allocations)
    return first_code


def _lookup_allocate(
    table: RequestTable,
    request_id: str,
    num_new_tokens: int,
    options: AllocationOptions,
    tenant: str,
    hits: converters.HitColumns,
) -> Allocation:
    """A ``LookupAllocateBatch`` entry: the lookup (its answer added to ``hits``, an
    empty one when it is refused), then the allocation that attaches its hit."""
    try:
        hit = table.get_computed_blocks(request_id, tenant)
    except Exception:
        hits.add_nothing()
        raise
    hits.add(hit)
    # What a client's AllocateSlots attaching this hit sends: no blocks for a miss.
    block_ids = hit.block_ids if hit.num_computed_tokens else ()
    args = AllocateArgs(num_new_tokens, hit.num_computed_tokens, block_ids, options)
    return table.allocate_slots(request_id, args, tenant)


# -- Admit ---------------------------------------------------------------------------

# Admissions run between two looks at the clock (each a lookup, an allocation and its
# answer: tens of microseconds).
ADMIT_CHUNK: Final = 32


async def admit(
    table: RequestTable,
    msg: pb.AdmitRequest,
    out: pb.AdmitResponse,
    caller: Caller,
    stop_on_error: bool,
    with_state: bool,
    slices: Slices,
    /,
) -> int:
    """``Admit``, pausing between admissions (a unary Admit may name every request of
    its tenant: 16,384 at the default limit, half a second of work run whole).

    Still all or nothing: every argument and id is checked before anything runs, so a
    refused Admit changes nothing. The admissions then run in chunks of
    ``ADMIT_CHUNK``, each chunk ``admission.admit`` over its ids with the budget the
    chunks before it left: the same loop run in pieces, so it admits, and stops,
    exactly where one call over every id would (admission stops within a chunk, or
    before the next one once the budget is spent). Between chunks it pauses whenever a
    slice of work is done; the caller holds the table's turn throughout, so no other
    call touches the table between two chunks (a request checked above is still as it
    was when its chunk runs). Returns 0: a refusal is raised, not answered."""
    tenant = caller.tenant
    ids = list(msg.request_ids)
    whole = admission.AdmitArgs(
        request_ids=ids,
        token_budget=msg.token_budget,
        enable_chunked_prefill=msg.enable_chunked_prefill,
        num_lookahead_tokens=msg.num_lookahead_tokens,
        full_sequence_must_fit=msg.full_sequence_must_fit,
    )
    # Everything checked first (the chunks below check their own ids again: cheap).
    admission.check(table, whole, tenant)
    budget = whole.token_budget
    stop = None
    for start in range(0, len(ids), ADMIT_CHUNK):
        if start and slices.clock.due():
            await slices.pause()
        result = admission.admit(
            table,
            admission.AdmitArgs(
                request_ids=ids[start : start + ADMIT_CHUNK],
                token_budget=budget,
                enable_chunked_prefill=whole.enable_chunked_prefill,
                num_lookahead_tokens=whole.num_lookahead_tokens,
                full_sequence_must_fit=whole.full_sequence_must_fit,
            ),
            tenant,
        )
        for one in result.admitted:
            admitted = out.admitted.add()
            converters.fill_computed_blocks(admitted.hit, one.hit)
            admitted.num_new_tokens = one.num_new_tokens
            converters.fill_allocation(admitted.allocation, one.allocation, with_state)
            budget -= one.num_new_tokens
        stop = result
        if result.stop is not admission.AdmitStop.ALL_ADMITTED:
            break
    assert stop is not None  # ids is not empty: checked above
    out.stop_reason = converters.admit_stop_to_pb(stop.stop)
    if stop.stop_error is not None:
        out.stop_message = str(stop.stop_error)
    return 0


# The StepOperation oneof field name of each columnar operation -> the operation.
BATCH_OPERATIONS: dict[str, BatchOperation] = {
    "append_tokens_batch": append_tokens_batch,
    "allocate_slots_batch": allocate_slots_batch,
    "free_batch": free_batch,
    "lookup_allocate_batch": lookup_allocate_batch,
    "add_request_batch": add_request_batch,
}
# The operations a Step awaits, since they pause between their entries; the others
# (``STEP_OPERATIONS``) run whole.
SLICED_OPERATIONS: dict[str, BatchOperation] = {**BATCH_OPERATIONS, "admit": admit}

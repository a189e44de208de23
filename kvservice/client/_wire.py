"""Protobuf in and out for the client: each operation as an ``Op`` (the RPC to call,
its request message and how to read the answer), shared by the unary calls, the step
builder and both clients. The only client module that touches protobuf."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvservice.client.types import (
    OMITTED_REQUEST_STATE,
    AdmitOptions,
    AdmitResult,
    AdmitStopReason,
    Admitted,
    AllocateOptions,
    Allocation,
    BlockIds,
    CacheConfig,
    ComputedBlocks,
    FreeMode,
    FreeResult,
    KVCacheGroup,
    MultiModalFeature,
    Pin,
    PinList,
    ProbeOptions,
    ProbeResult,
    RequestState,
    RequestStatus,
    Retention,
    RetentionChange,
    RetentionPin,
    RetentionTick,
    RetentionUnpin,
    Usage,
)
from kvservice.protocol import pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb

T = TypeVar("T")

_STATUS = {
    pb.REQUEST_STATUS_WAITING: RequestStatus.WAITING,
    pb.REQUEST_STATUS_RUNNING: RequestStatus.RUNNING,
    pb.REQUEST_STATUS_PREEMPTED: RequestStatus.PREEMPTED,
    pb.REQUEST_STATUS_FINISHED: RequestStatus.FINISHED,
}
_FREE_MODE = {FreeMode.PREEMPT: pb.FREE_MODE_PREEMPT, FreeMode.FINISH: pb.FREE_MODE_FINISH}
_KIND_PREFIX = "KV_CACHE_SPEC_KIND_"


# A plain class: mypyc compiles this module, and cannot run a generic dataclass.
class Op(Generic[T]):
    """One operation: the unary RPC, the StepOperation/StepResult field, the request
    message and the reader of the response message."""

    __slots__ = ("field", "message", "parse", "rpc")

    def __init__(self, rpc: str, field: str, message: Any, parse: Callable[[Any], T]) -> None:
        self.rpc = rpc
        self.field = field
        self.message = message
        self.parse = parse


# -- readers --------------------------------------------------------------------------


def block_ids(groups: Iterable[pb.BlockIds]) -> BlockIds:
    return tuple([tuple(g.block_ids) for g in groups])


# The common answer, a decode allocation of a one-group pool that takes no block, is
# one shared (immutable) value instead of a fresh one per entry (bench_decode_layers
# client layer: 24% slower without, 3 runs, spread up to 13%).
_NO_BLOCKS: BlockIds = ((),)
_NO_BLOCKS_OMITTED = Allocation(_NO_BLOCKS, (), None)


def _new_block_ids(groups: Any) -> BlockIds:
    if len(groups) == 1 and not groups[0].block_ids:
        return _NO_BLOCKS
    return block_ids(groups)


def request_state(msg: pb.RequestState) -> RequestState:
    return RequestState(
        request_id=msg.request_id,
        status=_STATUS[msg.status],
        num_tokens=msg.num_tokens,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_computed_tokens=msg.num_computed_tokens,
        num_preemptions=msg.num_preemptions,
        num_block_hashes=msg.num_block_hashes,
    )


def _request_of(msg: Any) -> RequestState:
    return request_state(msg.request)


def _appended(msg: pb.AppendTokensResponse) -> RequestState:
    # A step sent with omit_request_state answers an append without the state.
    return request_state(msg.request) if msg.HasField("request") else OMITTED_REQUEST_STATE


def _computed_blocks(msg: pb.GetComputedBlocksResponse) -> ComputedBlocks:
    return ComputedBlocks(
        block_ids(msg.block_ids), msg.num_computed_tokens, msg.shared_prefix_boundary
    )


def _allocation(msg: pb.AllocateSlotsResponse) -> Allocation | None:
    if msg.outcome == pb.ALLOCATION_OUTCOME_NO_SPACE:
        return None
    # Absent when the step asked the server to omit it.
    request = request_state(msg.request) if msg.HasField("request") else None
    new_block_ids = _new_block_ids(msg.new_block_ids)
    zero, zeroed = msg.block_ids_to_zero, msg.block_ids_zeroed
    to_apply, applied = msg.block_copies_to_apply, msg.block_copies_applied
    if not (zero or zeroed or to_apply or applied):
        return Allocation(new_block_ids, (), request)
    return Allocation(
        new_block_ids,
        tuple(zero),
        request,
        tuple(zeroed),
        tuple((c.src_block_id, c.dst_block_id) for c in to_apply),
        tuple((c.src_block_id, c.dst_block_id) for c in applied),
    )


_DEFAULT_ADMIT = AdmitOptions()
_ADMIT_STOPS = {
    pb.ADMIT_STOP_REASON_ALL_ADMITTED: AdmitStopReason.ALL_ADMITTED,
    pb.ADMIT_STOP_REASON_BUDGET_SPENT: AdmitStopReason.BUDGET_SPENT,
    pb.ADMIT_STOP_REASON_NO_SPACE: AdmitStopReason.NO_SPACE,
    pb.ADMIT_STOP_REASON_NEEDS_CHUNKING: AdmitStopReason.NEEDS_CHUNKING,
    pb.ADMIT_STOP_REASON_QUOTA: AdmitStopReason.QUOTA,
}


def _admit_result(request_ids: Sequence[str]) -> Callable[[pb.AdmitResponse], AdmitResult]:
    def decode(msg: pb.AdmitResponse) -> AdmitResult:
        admitted = []
        for request_id, one in zip(request_ids, msg.admitted, strict=False):
            allocation = _allocation(one.allocation)
            assert allocation is not None  # an admitted request's allocation fitted
            admitted.append(
                Admitted(request_id, _computed_blocks(one.hit), one.num_new_tokens, allocation)
            )
        return AdmitResult(tuple(admitted), _ADMIT_STOPS[msg.stop_reason], msg.stop_message)

    return decode


def _free_result(msg: pb.FreeRequestResponse) -> FreeResult:
    return FreeResult(request_state(msg.request), msg.num_free_blocks)


def _probe_result(msg: pb.ProbeResponse) -> ProbeResult:
    return ProbeResult(
        msg.num_hit_tokens,
        msg.num_new_tokens,
        msg.num_blocks_to_allocate,
        msg.num_free_blocks,
        msg.would_fit,
    )


def _block_table(msg: pb.GetBlockIdsResponse) -> BlockIds:
    return block_ids(msg.block_ids)


def _usage(msg: pb.GetUsageResponse) -> Usage:
    return Usage(
        msg.usage,
        msg.num_free_blocks,
        msg.num_used_blocks,
        msg.num_blocks,
        msg.num_requests,
        msg.prefix_cache_queries,
        msg.prefix_cache_hits,
        msg.pool_wide,
    )


def _group(msg: pb.KVCacheGroup) -> KVCacheGroup:
    return KVCacheGroup(
        kind=pb.KVCacheSpecKind.Name(msg.kind).removeprefix(_KIND_PREFIX).lower(),
        block_size=msg.block_size,
        layer_names=tuple(msg.layer_names),
        num_kv_heads=msg.num_kv_heads,
        head_size=msg.head_size,
        dtype=msg.dtype,
        page_size_bytes=msg.page_size_bytes,
        sliding_window=msg.sliding_window if msg.HasField("sliding_window") else None,
        attention_chunk_size=(
            msg.attention_chunk_size if msg.HasField("attention_chunk_size") else None
        ),
        max_num_encoder_input_tokens=(
            msg.max_num_encoder_input_tokens
            if msg.HasField("max_num_encoder_input_tokens")
            else None
        ),
        max_admission_blocks_per_request=(
            msg.max_admission_blocks_per_request
            if msg.HasField("max_admission_blocks_per_request")
            else None
        ),
    )


def cache_config(msg: pb.GetCacheConfigResponse) -> CacheConfig:
    return CacheConfig(
        num_blocks=msg.num_blocks,
        max_model_len=msg.max_model_len,
        scheduler_block_size=msg.scheduler_block_size,
        hash_block_size=msg.hash_block_size,
        hash_algo=msg.hash_algo,
        none_hash_seed_fingerprint=msg.none_hash_seed_fingerprint,
        enable_caching=msg.enable_caching,
        needs_kv_cache_zeroing=msg.needs_kv_cache_zeroing,
        model_name=msg.model_name,
        groups=tuple(_group(g) for g in msg.groups),
        blocks_zeroed_by_server=msg.blocks_zeroed_by_server,
        runtime_device=msg.runtime_device,
        vocab_size=msg.vocab_size,
        watermark_blocks=msg.watermark_blocks,
        max_in_flight_tokens=msg.max_in_flight_tokens,
        prefix_cache_retention_interval=(
            msg.prefix_cache_retention_interval
            if msg.HasField("prefix_cache_retention_interval")
            else None
        ),
        none_hash_seed=msg.none_hash_seed,
        none_hash_seed_source=_SEED_SOURCES.get(msg.none_hash_seed_source, ""),
        # An older server does not say: it evicts by LRU and pins nothing.
        eviction_policy=msg.eviction_policy or "lru",
        max_pinned_blocks=msg.max_pinned_blocks,
        use_eagle=msg.use_eagle,
        eagle_group_ids=tuple(msg.eagle_group_ids),
        num_hash_lookahead_tokens=msg.num_hash_lookahead_tokens,
        trusts_client_block_hashes=msg.trusts_client_block_hashes,
    )


_SEED_SOURCES = {
    pb.HASH_SEED_SOURCE_EXPLICIT: "explicit",
    pb.HASH_SEED_SOURCE_PYTHONHASHSEED: "PYTHONHASHSEED",
    pb.HASH_SEED_SOURCE_DEFAULT: "default",
    pb.HASH_SEED_SOURCE_RANDOM: "random",
}


# -- operations -----------------------------------------------------------------------


def add_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_features: Sequence[MultiModalFeature] = (),
    skip_reading_prefix_cache: bool = False,
    lora_path: str | None = None,
    lora_int_id: int | None = None,
    prompt_embeds: bytes | bytearray | memoryview | None = None,
    prompt_embeds_row_bytes: int = 0,
    retention: Retention | None = None,
    cache_control_ttl: str | float | None = None,
    block_hashes: Sequence[bytes] | None = None,
) -> Op[RequestState]:
    message = pb.AddRequestRequest(
        request_id=request_id,
        cache_salt=cache_salt or "",
        lora_name=lora_name or "",
        mm_features=[
            pb.MultiModalFeature(identifier=f.identifier, offset=f.offset, length=f.length)
            for f in mm_features
        ],
        skip_reading_prefix_cache=skip_reading_prefix_cache,
    )
    # The rarer fields only when set: a decode-heavy client adds many plain requests.
    if lora_path:
        message.lora_path = lora_path
    if lora_int_id:
        message.lora_int_id = lora_int_id
    if prompt_embeds is not None:
        message.prompt_embeds = bytes(prompt_embeds)
    if prompt_embeds_row_bytes:
        message.prompt_embeds_row_bytes = prompt_embeds_row_bytes
    if retention is not None:
        retention_to_pb(retention, message.retention)
    if cache_control_ttl is not None:
        message.cache_control_ttl = ttl_text(cache_control_ttl)
    if block_hashes is not None:
        message.client_hashed = True
        message.block_hashes.extend(block_hashes)
    try:
        message.packed_prompt_token_ids = pack_token_ids(prompt_token_ids)
    except (OverflowError, TypeError):
        # An id the packing cannot hold: sent as given, for the server to name it.
        message.prompt_token_ids.extend(prompt_token_ids)
    return Op("AddRequest", "add_request", message, _request_of)


def append_tokens(
    request_id: str, token_ids: Sequence[int], block_hashes: Sequence[bytes] = ()
) -> Op[RequestState]:
    message = pb.AppendTokensRequest(
        request_id=request_id, token_ids=token_ids, block_hashes=block_hashes
    )
    return Op("AppendTokens", "append_tokens", message, _appended)


def get_computed_blocks(
    request_id: str, max_cache_hit_length: int | None = None
) -> Op[ComputedBlocks]:
    message = pb.GetComputedBlocksRequest(request_id=request_id)
    if max_cache_hit_length is not None:
        message.max_cache_hit_length = max_cache_hit_length
    return Op("GetComputedBlocks", "get_computed_blocks", message, _computed_blocks)


def allocate_slots(
    request_id: str,
    num_new_tokens: int,
    hit: ComputedBlocks | None = None,
    options: AllocateOptions | None = None,
) -> Op[Allocation | None]:
    message = pb.AllocateSlotsRequest(request_id=request_id, num_new_tokens=num_new_tokens)
    if hit is not None and hit.num_computed_tokens:
        message.num_new_computed_tokens = hit.num_computed_tokens
        for group in hit.block_ids:
            message.new_computed_block_ids.add().block_ids.extend(group)
    if options is not None:
        _set_allocate_options(message, options)
    return Op("AllocateSlots", "allocate_slots", message, _allocation)


def admit(
    request_ids: Sequence[str], token_budget: int, options: AdmitOptions | None = None
) -> Op[AdmitResult]:
    ids = list(request_ids)
    options = options or _DEFAULT_ADMIT
    message = pb.AdmitRequest(
        request_ids=ids,
        token_budget=token_budget,
        enable_chunked_prefill=options.enable_chunked_prefill,
        num_lookahead_tokens=options.num_lookahead_tokens,
        full_sequence_must_fit=options.full_sequence_must_fit,
    )
    return Op("Admit", "admit", message, _admit_result(ids))


def _set_allocate_options(message: pb.AllocateSlotsRequest, options: AllocateOptions) -> None:
    message.num_lookahead_tokens = options.num_lookahead_tokens
    message.num_external_computed_tokens = options.num_external_computed_tokens
    message.delay_cache_blocks = options.delay_cache_blocks
    message.num_encoder_tokens = options.num_encoder_tokens
    message.full_sequence_must_fit = options.full_sequence_must_fit
    message.reserved_blocks = options.reserved_blocks
    message.has_scheduled_reqs = options.has_scheduled_reqs
    if options.num_computed_tokens is not None:
        message.num_computed_tokens = options.num_computed_tokens
    message.num_in_flight_tokens = options.num_in_flight_tokens


def free(
    request_id: str, mode: FreeMode = FreeMode.FINISH, keep_blocks: bool = False
) -> Op[FreeResult]:
    message = pb.FreeRequestRequest(
        request_id=request_id, mode=_FREE_MODE[mode], keep_blocks=keep_blocks
    )
    return Op("FreeRequest", "free_request", message, _free_result)


def probe(
    request_id: str, num_new_tokens: int | None = None, options: ProbeOptions | None = None
) -> Op[ProbeResult]:
    message = pb.ProbeRequest(request_id=request_id)
    if num_new_tokens is not None:
        message.num_new_tokens = num_new_tokens
    if options is not None:
        message.num_lookahead_tokens = options.num_lookahead_tokens
        message.num_external_computed_tokens = options.num_external_computed_tokens
        message.num_encoder_tokens = options.num_encoder_tokens
        message.full_sequence_must_fit = options.full_sequence_must_fit
        message.reserved_blocks = options.reserved_blocks
        message.has_scheduled_reqs = options.has_scheduled_reqs
    return Op("Probe", "probe", message, _probe_result)


def get_request(request_id: str) -> Op[RequestState]:
    message = pb.GetRequestRequest(request_id=request_id)
    return Op("GetRequest", "get_request", message, _request_of)


def get_block_ids(request_id: str) -> Op[BlockIds]:
    message = pb.GetBlockIdsRequest(request_id=request_id)
    return Op("GetBlockIds", "get_block_ids", message, _block_table)


def get_usage(pool_wide: bool = False) -> Op[Usage]:
    return Op("GetUsage", "get_usage", pb.GetUsageRequest(pool_wide=pool_wide), _usage)


def reset_prefix_cache(fresh_pool: bool = False) -> Op[bool]:
    message = pb.ResetPrefixCacheRequest(fresh_pool=fresh_pool)
    return Op("ResetPrefixCache", "", message, _reset)


def _reset(msg: pb.ResetPrefixCacheResponse) -> bool:
    return msg.reset


def new_step_starts() -> Op[None]:
    return Op("NewStepStarts", "new_step_starts", pb.NewStepStartsRequest(), _nothing)


def _nothing(msg: Any) -> None:
    return None


def free_retained_blocks(block_ids: Sequence[int]) -> Op[int]:
    message = pb.FreeRetainedBlocksRequest(block_ids=block_ids)
    return Op("FreeRetainedBlocks", "free_retained_blocks", message, _num_free_blocks)


def _num_free_blocks(msg: pb.FreeRetainedBlocksResponse) -> int:
    return msg.num_free_blocks


def evict_blocks(block_ids: Sequence[int]) -> Op[None]:
    message = pb.EvictBlocksRequest(block_ids=block_ids)
    return Op("EvictBlocks", "evict_blocks", message, _nothing)


def remove_skipped_blocks(request_id: str, processed_computed_tokens: int) -> Op[int]:
    message = pb.RemoveSkippedBlocksRequest(
        request_id=request_id, processed_computed_tokens=processed_computed_tokens
    )
    return Op("RemoveSkippedBlocks", "remove_skipped_blocks", message, _skipped_free_blocks)


def _skipped_free_blocks(msg: pb.RemoveSkippedBlocksResponse) -> int:
    return msg.num_free_blocks


def cache_blocks(request_id: str, num_computed_tokens: int) -> Op[None]:
    message = pb.CacheBlocksRequest(request_id=request_id, num_computed_tokens=num_computed_tokens)
    return Op("CacheBlocks", "cache_blocks", message, _nothing)


def retention_to_pb(retention: Retention, out: pb.Retention) -> None:
    """The client's ``Retention`` on the wire (None end and durations: 0), the one
    place it is converted; the server checks the values."""
    for r in retention.token_ranges:
        out.token_ranges.add(
            start=r.start,
            end=r.end or 0,
            priority=r.priority,
            duration_seconds=r.duration_s or 0.0,
        )
    out.decode_priority = retention.decode_priority
    out.decode_duration_seconds = retention.decode_duration_s or 0.0
    out.SetInParent()


def ttl_text(ttl: str | float) -> str:
    """A cache_control TTL as the server reads it: text as given ("5m", "300s",
    "1h"), a number as seconds."""
    return ttl if isinstance(ttl, str) else f"{float(ttl)!r}s"


def _pin(msg: pb.Pin) -> Pin:
    return Pin(
        pin_id=msg.pin_id,
        tenant=msg.tenant,
        num_tokens=msg.num_tokens,
        num_reserved_blocks=msg.num_reserved_blocks,
        num_held_blocks=msg.num_held_blocks,
        ttl_s=msg.ttl_seconds if msg.HasField("ttl_seconds") else None,
        refresh_on_hit=msg.refresh_on_hit,
        expires_in_s=msg.expires_in_seconds if msg.HasField("expires_in_seconds") else None,
        num_hits=msg.num_hits,
    )


def _pinned(msg: pb.PinPrefixResponse) -> Pin:
    return _pin(msg.pin)


def _pin_list(msg: pb.ListPinsResponse) -> PinList:
    return PinList(
        pins=tuple(_pin(p) for p in msg.pins),
        num_pinned_blocks=msg.num_pinned_blocks,
        num_reserved_blocks=msg.num_reserved_blocks,
        max_pinned_blocks=msg.max_pinned_blocks,
    )


def pin_prefix(
    token_ids: Sequence[int],
    ttl_s: float | None = None,
    refresh_on_hit: bool = False,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    block_hashes: Sequence[bytes] = (),
) -> Op[Pin]:
    message = pb.PinPrefixRequest(
        ttl_seconds=ttl_s or 0.0,
        refresh_on_hit=refresh_on_hit,
        cache_salt=cache_salt or "",
        lora_name=lora_name or "",
        lora_path=lora_path or "",
        block_hashes=block_hashes,
    )
    try:
        message.packed_token_ids = pack_token_ids(token_ids)
    except (OverflowError, TypeError):
        # An id the packing cannot hold: sent as given, for the server to name it.
        message.token_ids.extend(token_ids)
    return Op("PinPrefix", "pin_prefix", message, _pinned)


def unpin_prefix(pin_id: str) -> Op[None]:
    return Op("UnpinPrefix", "unpin_prefix", pb.UnpinPrefixRequest(pin_id=pin_id), _nothing)


def list_pins(all_tenants: bool = False) -> Op[PinList]:
    message = pb.ListPinsRequest(all_tenants=all_tenants)
    return Op("ListPins", "list_pins", message, _pin_list)


def get_cache_config() -> Op[CacheConfig]:
    return Op("GetCacheConfig", "", pb.GetCacheConfigRequest(), cache_config)


# -- columnar operations ----------------------------------------------------------------
#
# A batch answers its entries column by column; each is decoded into what the single
# operation's handle reads (a value, or a ``RowError``), once per batch.

APPEND_TOKENS_BATCH = "append_tokens_batch"
ALLOCATE_SLOTS_BATCH = "allocate_slots_batch"
FREE_BATCH = "free_batch"
LOOKUP_ALLOCATE_BATCH = "lookup_allocate_batch"
ADD_REQUEST_BATCH = "add_request_batch"
# What a step answers for an operation skipped under stop_on_error (the server's words).
NOT_RUN_MESSAGE = "not run: an earlier operation failed (stop_on_error)"
_CANCELLED = 1  # grpc.StatusCode.CANCELLED


@dataclass(frozen=True, slots=True)
class RowError:
    """A batch entry's error: the status its single operation would have answered."""

    code: int
    message: str


def batch_errors(msg: Any) -> dict[int, RowError]:
    """Every failed entry of a batch response by its index in the batch: refused, or
    not run (stop_on_error stopped the batch, or an operation before it)."""
    errors = {e.index: RowError(e.code, e.message) for e in msg.errors}
    not_run = RowError(_CANCELLED, NOT_RUN_MESSAGE)
    for index in range(msg.num_run, msg.num_requests):
        errors[index] = not_run
    return errors


def _append_rows(msg: pb.AppendTokensBatchResponse) -> list[Any]:
    errors = batch_errors(msg)
    states = msg.requests
    rows: list[Any] = []
    for index in range(msg.num_requests):
        error = errors.get(index)
        if error is not None:
            rows.append(error)
        else:
            # A refused entry's state is an empty placeholder: never decoded.
            rows.append(request_state(states[index]) if states else OMITTED_REQUEST_STATE)
    return rows


def _allocation_rows(msg: pb.AllocateSlotsBatchResponse) -> list[Any]:
    rows: list[Any] = [None] * msg.num_requests
    for index, error in batch_errors(msg).items():
        rows[index] = error
    no_space = set(msg.no_space)
    extras = _ExtraColumns(msg)
    states = msg.requests
    for index, new_block_ids in enumerate(_entry_block_ids(msg)):
        if rows[index] is None and index not in no_space:
            # (A refused entry's state is an empty placeholder: never decoded.)
            request = request_state(states[index]) if states else None
            rows[index] = extras.allocation(index, new_block_ids, request)
    return rows


def _entry_block_ids(msg: pb.AllocateSlotsBatchResponse) -> list[BlockIds]:
    """Each entry's new block ids, per group, for the entries that ran (a refused or
    no-room entry's are empty)."""
    num_run, num_groups = msg.num_run, msg.num_groups
    ids = list(msg.new_block_ids)
    if num_groups == 1 and not ids:
        return [_NO_BLOCKS] * num_run  # a decode step that takes no block
    return _per_group(ids, list(msg.num_new_blocks), num_groups, num_run)


def _per_group(ids: list[int], counts: list[int], num_groups: int, num: int) -> list[BlockIds]:
    """The first ``num`` entries' block ids per group, cut from the concatenated
    ``ids`` by ``counts`` (``num_groups`` counts an entry, in order); an entry of one
    empty group is the shared ``_NO_BLOCKS``."""
    entries: list[BlockIds] = []
    pos = 0
    for index in range(num):
        groups = []
        for count in counts[index * num_groups : (index + 1) * num_groups]:
            groups.append(tuple(ids[pos : pos + count]))
            pos += count
        entries.append(_NO_BLOCKS if groups == [()] else tuple(groups))
    return entries


def allocation_run_matches(
    msg: pb.AllocateSlotsBatchResponse, first: int, answers: Sequence[BlockIds | None]
) -> bool:
    """Whether entries ``first`` on of an AllocateSlotsBatchResponse all ran, without
    copy-on-write copies, and got exactly ``answers`` (new block ids per group; None:
    no room), read from the columns without decoding an entry."""
    num_groups, last = msg.num_groups, first + len(answers)
    if (
        msg.num_run < last
        or any(first <= error.index < last for error in msg.errors)
        or msg.block_copies_to_apply
        or msg.block_copies_applied
    ):
        return False
    no_space = _unfilled_rows(msg.num_new_blocks, msg.new_block_ids, first, num_groups, answers)
    return no_space is not None and [row for row in msg.no_space if first <= row < last] == no_space


def _unfilled_rows(
    counts: Sequence[int],
    ids: Sequence[int],
    first: int,
    num_groups: int,
    rows: Sequence[BlockIds | None],
) -> list[int] | None:
    """Whether entries ``first`` on of a column of block ids per group (``counts``:
    ``num_groups`` an entry, cutting the concatenated ``ids``) hold exactly ``rows``, a
    None row holding no block: the indices of the None rows when they do, else None."""
    last = first + len(rows)
    if len(counts) < last * num_groups:
        return None
    empty = [0] * num_groups
    expected_counts: list[int] = []
    expected_ids: list[int] = []
    unfilled: list[int] = []
    for row, groups in enumerate(rows, first):
        if groups is None:
            unfilled.append(row)
            expected_counts.extend(empty)
        elif len(groups) != num_groups:
            return None
        else:
            for group in groups:
                expected_counts.append(len(group))
                expected_ids.extend(group)
    start = sum(counts[: first * num_groups]) if first else 0
    if (
        counts[first * num_groups : last * num_groups] == expected_counts
        and ids[start : start + len(expected_ids)] == expected_ids
    ):
        return unfilled
    return None


def batchable(options: AllocateOptions) -> bool:
    """Whether a ``LookupAllocateBatch`` can carry an allocation with ``options``
    (the connectors' and the computed-token count's travel in single operations)."""
    return not (
        options.num_external_computed_tokens
        or options.delay_cache_blocks
        or options.num_computed_tokens is not None
        or options.num_in_flight_tokens
    )


def set_lookup_allocate_options(message: pb.LookupAllocateBatch, options: AllocateOptions) -> None:
    message.num_lookahead_tokens = options.num_lookahead_tokens
    message.num_encoder_tokens = options.num_encoder_tokens
    message.full_sequence_must_fit = options.full_sequence_must_fit
    message.reserved_blocks = options.reserved_blocks
    message.has_scheduled_reqs = options.has_scheduled_reqs


def pack_prompts(prompts: Sequence[Sequence[int]]) -> bytes:
    """An AddRequestBatch's packed prompts column; ValueError naming the first prompt
    with an id that does not pack (which a single add_request sends unpacked, for the
    server to name)."""
    try:
        return b"".join([pack_token_ids(prompt) for prompt in prompts])
    except (OverflowError, TypeError):
        for index, prompt in enumerate(prompts):
            try:
                pack_token_ids(prompt)
            except (OverflowError, TypeError) as err:
                raise ValueError(
                    f"prompt {index} of the batch holds a token id outside [0, 2**32) or not "
                    f"an int ({err}): add that request singly"
                ) from None
        raise


def free_modes(modes: Sequence[FreeMode]) -> list[int]:
    """A FreeBatch's modes column."""
    return [_FREE_MODE[mode] for mode in modes]


def _refusal_rows(msg: pb.FreeBatchResponse | pb.AddRequestBatchResponse) -> list[Any]:
    # A freed or added entry answers nothing: None, or its error.
    rows: list[Any] = [None] * msg.num_requests
    for index, error in batch_errors(msg).items():
        rows[index] = error
    return rows


def _entry_hits(msg: pb.LookupAllocateBatchResponse) -> list[ComputedBlocks]:
    """Each run entry's lookup answer (an empty one for a refused lookup)."""
    tokens = msg.num_computed_tokens
    per_group = _per_group(
        list(msg.hit_block_ids), list(msg.num_hit_blocks), msg.allocations.num_groups, len(tokens)
    )
    return [
        ComputedBlocks(groups, num_tokens, boundary)
        for groups, num_tokens, boundary in zip(
            per_group, tokens, msg.shared_prefix_boundary, strict=True
        )
    ]


def _lookup_allocation_rows(msg: pb.LookupAllocateBatchResponse) -> list[Any]:
    """Each entry as (its lookup's answer, its allocation or None for no room), or its
    error."""
    rows: list[Any] = [None] * msg.num_requests
    for index, error in batch_errors(msg).items():
        rows[index] = error
    allocations = msg.allocations
    no_space = set(allocations.no_space)
    extras = _ExtraColumns(allocations)
    states = allocations.requests
    hits = _entry_hits(msg)
    for index, new_block_ids in enumerate(_entry_block_ids(allocations)):
        if rows[index] is not None:
            continue
        allocation = None
        if index not in no_space:
            request = request_state(states[index]) if states else None
            allocation = extras.allocation(index, new_block_ids, request)
        rows[index] = (hits[index], allocation)
    return rows


def lookup_allocation_run_matches(
    msg: pb.LookupAllocateBatchResponse,
    first: int,
    hits: Sequence[ComputedBlocks],
    answers: Sequence[BlockIds | None],
) -> bool:
    """Whether entries ``first`` on of a LookupAllocateBatchResponse all ran, without
    copy-on-write copies, their lookups answering ``hits`` and their allocations
    ``answers`` (as ``allocation_run_matches``)."""
    last = first + len(hits)
    if msg.num_run < last or any(first <= error.index < last for error in msg.errors):
        return False
    # On the columns, as the allocations: no ComputedBlocks built per entry.
    return (
        allocation_run_matches(msg.allocations, first, answers)
        and msg.num_computed_tokens[first:last] == [hit.num_computed_tokens for hit in hits]
        and msg.shared_prefix_boundary[first:last] == [hit.shared_prefix_boundary for hit in hits]
        and _unfilled_rows(
            msg.num_hit_blocks,
            msg.hit_block_ids,
            first,
            msg.allocations.num_groups,
            [hit.block_ids for hit in hits],
        )
        == []
    )


class _ExtraColumns:
    """The zeroing and copy columns of an AllocateSlotsBatchResponse, cut per entry
    (each column is empty when no entry has anything in it)."""

    def __init__(self, msg: pb.AllocateSlotsBatchResponse) -> None:
        self.any = bool(
            msg.block_ids_to_zero
            or msg.block_ids_zeroed
            or msg.block_copies_to_apply
            or msg.block_copies_applied
        )
        if not self.any:
            return
        self.zero = _cut(msg.num_block_ids_to_zero, msg.block_ids_to_zero, 1)
        self.zeroed = _cut(msg.num_block_ids_zeroed, msg.block_ids_zeroed, 1)
        self.to_apply = _cut(msg.num_block_copies_to_apply, msg.block_copies_to_apply, 2)
        self.applied = _cut(msg.num_block_copies_applied, msg.block_copies_applied, 2)

    def allocation(
        self, index: int, new_block_ids: BlockIds, request: RequestState | None
    ) -> Allocation:
        if not self.any:
            if new_block_ids is _NO_BLOCKS and request is None:
                return _NO_BLOCKS_OMITTED
            return Allocation(new_block_ids, (), request)
        zero, zeroed = self.zero.get(index, ()), self.zeroed.get(index, ())
        to_apply, applied = self.to_apply.get(index, ()), self.applied.get(index, ())
        if not (zero or zeroed or to_apply or applied):
            return Allocation(new_block_ids, (), request)
        return Allocation(new_block_ids, zero, request, zeroed, _pairs(to_apply), _pairs(applied))


def _cut(counts: Any, values: Any, width: int) -> dict[int, tuple[int, ...]]:
    """Entry index -> its values, for the entries that have any."""
    out: dict[int, tuple[int, ...]] = {}
    flat = list(values)
    pos = 0
    for index, count in enumerate(counts):
        if count:
            out[index] = tuple(flat[pos : pos + count * width])
            pos += count * width
    return out


def _pairs(flat: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(flat[::2], flat[1::2], strict=True))


# A columnar StepResult field -> the decoder of its entries.
BATCH_ROWS: dict[str, Callable[[Any], list[Any]]] = {
    APPEND_TOKENS_BATCH: _append_rows,
    ALLOCATE_SLOTS_BATCH: _allocation_rows,
    FREE_BATCH: _refusal_rows,
    LOOKUP_ALLOCATE_BATCH: _lookup_allocation_rows,
    ADD_REQUEST_BATCH: _refusal_rows,
}


def retention_changes(events: Iterable[pb.RetentionEvent]) -> tuple[RetentionChange, ...]:
    """A replica session's retention changes, from its Step answer."""
    changes: list[RetentionChange] = []
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "pin":
            pin = event.pin
            changes.append(
                RetentionPin(
                    event.now_seconds,
                    pin.owner,
                    pin.pin_id,
                    pin.num_tokens,
                    tuple(pin.keys),
                    pin.ttl_seconds or None,
                    pin.refresh_on_hit,
                )
            )
        elif kind == "unpin":
            changes.append(RetentionUnpin(event.now_seconds, event.unpin.owner, event.unpin.pin_id))
        else:
            changes.append(RetentionTick(event.now_seconds))
    return tuple(changes)

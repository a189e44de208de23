"""Protobuf messages to domain values and back; no validation beyond shape.

Proto3 scalars have no "absent" state, so empty strings mean "none" (cache salt,
LoRA name) and only the fields declared ``optional`` carry presence.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from kvservice.core.allocation_options import AllocationOptions, allocation_options
from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_block import DEFAULT_PRIORITY
from kvservice.core.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpecKind,
    SlidingWindowSpec,
)
from kvservice.core.kv_cache_manager import AllocationProbe, KVCacheManager
from kvservice.core.request import Request, RequestStatus
from kvservice.core.retention_policy import (
    PinPlaced,
    RetentionConfig,
    RetentionEvent,
    Tick,
    TokenRangeRetention,
    parse_duration,
)
from kvservice.protocol import PACKED_TOKEN_ID_SIZE, unpack_token_id_array
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.admission import AdmitStop
from kvservice.request_table.tenancy import client_request_id
from kvservice.request_table.types import (
    AllocateArgs,
    Allocation,
    ComputedBlocks,
    FreeMode,
    NewRequest,
    PinArgs,
    PinnedBudget,
    PinView,
    PoolUsage,
)
from kvservice.server.config import HashSeedSource

_STATUS_TO_PB = {
    RequestStatus.WAITING: pb.REQUEST_STATUS_WAITING,
    RequestStatus.RUNNING: pb.REQUEST_STATUS_RUNNING,
    RequestStatus.PREEMPTED: pb.REQUEST_STATUS_PREEMPTED,
    RequestStatus.FINISHED: pb.REQUEST_STATUS_FINISHED,
}
_KIND_TO_PB = {
    KVCacheSpecKind.FULL_ATTENTION: pb.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
    KVCacheSpecKind.SLIDING_WINDOW: pb.KV_CACHE_SPEC_KIND_SLIDING_WINDOW,
    KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: pb.KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION,
    KVCacheSpecKind.CROSS_ATTENTION: pb.KV_CACHE_SPEC_KIND_CROSS_ATTENTION,
    KVCacheSpecKind.MAMBA: pb.KV_CACHE_SPEC_KIND_MAMBA,
}
T = TypeVar("T")

_FREE_MODE_FROM_PB = {
    pb.FREE_MODE_PREEMPT: FreeMode.PREEMPT,
    pb.FREE_MODE_FINISH: FreeMode.FINISH,
}

# -- to domain ------------------------------------------------------------------------


def new_request_from_pb(msg: pb.AddRequestRequest) -> NewRequest:
    packed = bool(msg.packed_prompt_token_ids)
    return NewRequest(
        request_id=msg.request_id,
        prompt_token_ids=_prompt_token_ids(msg) if packed else msg.prompt_token_ids[:],
        cache_salt=msg.cache_salt or None,
        lora_name=msg.lora_name or None,
        mm_features=(
            tuple(MultiModalFeature(f.identifier, f.offset, f.length) for f in msg.mm_features)
            if msg.mm_features
            else ()
        ),
        skip_reading_prefix_cache=msg.skip_reading_prefix_cache,
        packed=packed,
        lora_path=msg.lora_path or None,
        # 0 is proto3's "unset"; a negative id is passed on for the table to refuse.
        lora_int_id=msg.lora_int_id or None,
        prompt_embeds=msg.prompt_embeds or None,
        prompt_embeds_row_bytes=msg.prompt_embeds_row_bytes,
        retention=retention_from_pb(msg) if msg.HasField("retention") else None,
        cache_control_ttl_s=(
            parse_duration(msg.cache_control_ttl, f"request {msg.request_id!r}: cache_control_ttl")
            if msg.cache_control_ttl
            else None
        ),
        block_hashes=tuple(msg.block_hashes) if msg.block_hashes else (),
        client_hashed=msg.client_hashed,
    )


def new_requests_from_batch(msg: pb.AddRequestBatch) -> list[NewRequest]:
    """An ``AddRequestBatch``'s requests, entry by entry (each what the
    ``AddRequestRequest`` of its id, packed prompt and hashes converts to);
    ``InvalidArgumentError`` for a batch whose counts do not cut its concatenated
    columns (the request ids' column is the caller's to check)."""
    num_ids = len(msg.request_ids)
    # Each prompt stays packed (an array cut from the batch's): the table keeps it so.
    prompts = cut_column(
        "add_request_batch",
        _unpacked(msg.packed_prompt_token_ids, "add_request_batch: packed_prompt_token_ids"),
        msg.num_prompt_tokens,
        num_ids,
        "num_prompt_tokens",
        "packed prompt ids",
    )
    hashed = msg.client_hashed
    if hashed:
        hashes = cut_column(
            "add_request_batch",
            msg.block_hashes[:],
            msg.num_block_hashes,
            num_ids,
            "num_block_hashes",
            "hashes",
        )
    elif msg.block_hashes or msg.num_block_hashes:
        raise InvalidArgumentError(
            "add_request_batch: block_hashes and num_block_hashes are for a client_hashed "
            "batch only"
        )
    return [
        NewRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            # An empty prompt is named as AddRequest names it (no packed bytes).
            packed=bool(prompt),
            block_hashes=tuple(hashes[index]) if hashed else (),
            client_hashed=hashed,
        )
        for index, (request_id, prompt) in enumerate(zip(msg.request_ids, prompts, strict=True))
    ]


def cut_column(
    kind: str, values: Sequence[T], counts: Sequence[int], num_ids: int, column: str, what: str
) -> list[Sequence[T]]:
    """A batch's concatenated ``values`` cut into one slice per entry, ``counts[i]``
    values for entry i; ``InvalidArgumentError`` naming ``kind``'s ``column`` unless
    there is a count per entry and they add up to the values."""
    if len(counts) != num_ids:
        raise InvalidArgumentError(
            f"{kind}: {column} has {len(counts)} values for {num_ids} request_ids (one each)"
        )
    if any(count < 0 for count in counts) or sum(counts) != len(values):
        raise InvalidArgumentError(
            f"{kind}: {column} must be counts >= 0 that add up to the {len(values)} {what} "
            f"sent, got {list(counts)}"
        )
    cut: list[Sequence[T]] = []
    pos = 0
    for count in counts:
        cut.append(values[pos : pos + count])
        pos += count
    return cut


def appended_hashes(msg: pb.AppendTokensBatch) -> list[Sequence[bytes]] | None:
    """An ``AppendTokensBatch``'s hashes per entry (none for the entries past its
    counts), or None when no entry carries any."""
    counts = msg.num_block_hashes[:]
    if not counts and not msg.block_hashes:
        return None
    num_ids = len(msg.request_ids)
    if len(counts) > num_ids:
        raise InvalidArgumentError(
            f"append_tokens_batch: num_block_hashes has {len(counts)} values for {num_ids} "
            f"request_ids (at most one each)"
        )
    column = "num_block_hashes"
    hashes = cut_column(
        "append_tokens_batch", msg.block_hashes[:], counts, len(counts), column, "hashes"
    )
    hashes.extend([] for _ in range(num_ids - len(counts)))
    return hashes


def retention_from_pb(msg: pb.AddRequestRequest) -> RetentionConfig:
    """The core's ``RetentionConfig`` of ``msg.retention`` (0 end: to the prompt's end;
    0 durations: none); ``InvalidArgumentError`` naming the request and the range for
    a priority outside 0-100, a negative duration or an empty range."""
    retention = msg.retention
    what = f"request {msg.request_id!r}: retention"
    ranges = []
    for index, r in enumerate(retention.token_ranges):
        _check_seconds(r.duration_seconds, f"{what}.token_ranges[{index}].duration_seconds")
        ranges.append(
            TokenRangeRetention(
                start=r.start,
                end=r.end or None,
                priority=r.priority,
                duration_s=r.duration_seconds or None,
            )
        )
    _check_seconds(retention.decode_duration_seconds, f"{what}.decode_duration_seconds")
    try:
        return RetentionConfig(
            token_ranges=tuple(ranges),
            decode_priority=(
                retention.decode_priority
                if retention.HasField("decode_priority")
                else DEFAULT_PRIORITY
            ),
            decode_duration_s=retention.decode_duration_seconds or None,
        )
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{what}: {err}") from None


def _check_seconds(value: float, what: str) -> None:
    """A duration field: 0 (none) or positive, finite seconds."""
    if value < 0 or not math.isfinite(value):
        raise InvalidArgumentError(f"{what} must be positive seconds (0: no expiry), got {value}")


def pin_args_from_pb(msg: pb.PinPrefixRequest) -> PinArgs:
    """``PinPrefix``'s arguments (token ids packed or not, not both)."""
    packed = bool(msg.packed_token_ids)
    if packed:
        if msg.token_ids:
            raise InvalidArgumentError(
                f"pin: both token_ids ({len(msg.token_ids)} ids) and packed_token_ids "
                f"({len(msg.packed_token_ids)} bytes) are set; send the prefix in one of them"
            )
        token_ids = _unpacked(msg.packed_token_ids, "pin: packed_token_ids").tolist()
    else:
        token_ids = msg.token_ids[:]
    _check_seconds(msg.ttl_seconds, "pin: ttl_seconds")
    return PinArgs(
        token_ids=token_ids,
        ttl_s=msg.ttl_seconds or None,
        refresh_on_hit=msg.refresh_on_hit,
        cache_salt=msg.cache_salt or None,
        lora_name=msg.lora_name or None,
        lora_path=msg.lora_path or None,
        packed=packed,
        block_hashes=tuple(msg.block_hashes),
    )


def _prompt_token_ids(msg: pb.AddRequestRequest) -> array[int]:
    """The ids of ``packed_prompt_token_ids``, left packed (unpacked in C, no Python int
    per id: a fraction of what reading the repeated field costs)."""
    packed = msg.packed_prompt_token_ids
    if msg.prompt_token_ids:
        raise InvalidArgumentError(
            f"request {msg.request_id!r}: both prompt_token_ids ({len(msg.prompt_token_ids)} "
            f"ids) and packed_prompt_token_ids ({len(packed)} bytes) are set; send the "
            f"prompt in one of them"
        )
    return _unpacked(packed, f"request {msg.request_id!r}: packed_prompt_token_ids")


def _unpacked(packed: bytes, what: str) -> array[int]:
    """The token ids ``packed`` holds; ``InvalidArgumentError`` naming the field
    (``what``) when its bytes are not a whole number of ids."""
    if len(packed) % PACKED_TOKEN_ID_SIZE:
        raise InvalidArgumentError(
            f"{what} holds {len(packed)} bytes, not a multiple of {PACKED_TOKEN_ID_SIZE} (one "
            f"unsigned little-endian {PACKED_TOKEN_ID_SIZE}-byte int per token id)"
        )
    return unpack_token_id_array(packed)


def allocate_args_from_pb(msg: pb.AllocateSlotsRequest) -> AllocateArgs:
    return AllocateArgs(
        num_new_tokens=msg.num_new_tokens,
        num_new_computed_tokens=msg.num_new_computed_tokens,
        new_computed_block_ids=tuple(tuple(g.block_ids) for g in msg.new_computed_block_ids),
        options=_allocation_options(msg, msg.delay_cache_blocks),
        num_computed_tokens=(
            msg.num_computed_tokens if msg.HasField("num_computed_tokens") else None
        ),
        num_in_flight_tokens=msg.num_in_flight_tokens,
    )


def probe_args_from_pb(msg: pb.ProbeRequest) -> tuple[int | None, AllocationOptions]:
    """``RequestTable.probe``'s ``num_new_tokens`` (None when absent) and options."""
    num_new_tokens = msg.num_new_tokens if msg.HasField("num_new_tokens") else None
    return num_new_tokens, _allocation_options(msg)


def _allocation_options(
    msg: pb.AllocateSlotsRequest | pb.ProbeRequest, delay_cache_blocks: bool = False
) -> AllocationOptions:
    """The fields both messages share (a probe caches nothing, so it has no
    ``delay_cache_blocks``)."""
    return allocation_options(
        num_lookahead_tokens=msg.num_lookahead_tokens,
        num_external_computed_tokens=msg.num_external_computed_tokens,
        delay_cache_blocks=delay_cache_blocks,
        num_encoder_tokens=msg.num_encoder_tokens,
        full_sequence_must_fit=msg.full_sequence_must_fit,
        reserved_blocks=msg.reserved_blocks,
        # Absent means vLLM's default (True); proto3's plain bool would mean False.
        has_scheduled_reqs=msg.has_scheduled_reqs if msg.HasField("has_scheduled_reqs") else True,
    )


def lookup_allocate_options(msg: pb.LookupAllocateBatch) -> AllocationOptions:
    """The options every entry of a ``LookupAllocateBatch`` allocates with."""
    return allocation_options(
        num_lookahead_tokens=msg.num_lookahead_tokens,
        num_encoder_tokens=msg.num_encoder_tokens,
        full_sequence_must_fit=msg.full_sequence_must_fit,
        reserved_blocks=msg.reserved_blocks,
        has_scheduled_reqs=msg.has_scheduled_reqs if msg.HasField("has_scheduled_reqs") else True,
    )


def free_mode_from_pb(mode: pb.FreeMode.ValueType) -> FreeMode:
    try:
        return _FREE_MODE_FROM_PB[mode]
    except KeyError:
        raise InvalidArgumentError(
            f"mode must be FREE_MODE_PREEMPT or FREE_MODE_FINISH, got "
            f"{pb.FreeMode.Name(mode) if mode in pb.FreeMode.values() else mode}"
        ) from None


# -- to protobuf ----------------------------------------------------------------------


def add_block_ids(field: Any, groups: Iterable[Sequence[int]]) -> None:
    """Append ``groups`` to a repeated ``BlockIds`` field in place (no message built
    to be copied)."""
    for ids in groups:
        # Most decode allocations hand out no block; an empty group skips the copy.
        if ids:
            field.add(block_ids=ids)
        else:
            field.add()


def request_state_to_pb(request: Request) -> pb.RequestState:
    out = pb.RequestState()
    fill_request_state(out, request)
    return out


def fill_request_state(out: pb.RequestState, request: Request) -> None:
    """Write ``request`` into a fresh ``out`` field by field (on the Step path this
    costs half of building a message and copying it in), under the id the client
    knows it by."""
    out.request_id = client_request_id(request.request_id)
    out.status = _STATUS_TO_PB[request.status]
    out.num_tokens = request.num_tokens
    out.num_prompt_tokens = request.num_prompt_tokens
    out.num_computed_tokens = request.num_computed_tokens
    out.num_preemptions = request.num_preemptions
    out.num_block_hashes = len(request.block_hashes)


def fill_computed_blocks(out: pb.GetComputedBlocksResponse, hit: ComputedBlocks) -> None:
    add_block_ids(out.block_ids, hit.block_ids)
    out.num_computed_tokens = hit.num_computed_tokens
    out.shared_prefix_boundary = hit.shared_prefix_boundary


def fill_allocation(
    out: pb.AllocateSlotsResponse, allocation: Allocation, with_request: bool = True
) -> None:
    """Write ``allocation`` into ``out``; ``with_request`` False leaves ``request``
    unset (``StepRequest.omit_request_state``)."""
    if allocation.new_block_ids is None:
        out.outcome = pb.ALLOCATION_OUTCOME_NO_SPACE
    else:
        out.outcome = pb.ALLOCATION_OUTCOME_OK
        add_block_ids(out.new_block_ids, allocation.new_block_ids)
        # Speed: most allocations (decodes) have none of these, and reaching a repeated
        # field costs even when nothing is added to it;
        # `python -m benchmarks.bench_decode_layers --requests 512 --steps 60 --layers step-single`:
        # step-single layer +7.6% us/request without (9.07 -> 9.76, medians of 5; 2026-12-03).
        if allocation.block_ids_to_zero:
            out.block_ids_to_zero.extend(allocation.block_ids_to_zero)
        if allocation.block_ids_zeroed:
            out.block_ids_zeroed.extend(allocation.block_ids_zeroed)
        if allocation.block_copies_to_apply:
            _add_copies(out.block_copies_to_apply, allocation.block_copies_to_apply)
        if allocation.block_copies_applied:
            _add_copies(out.block_copies_applied, allocation.block_copies_applied)
    if with_request:
        fill_request_state(out.request, allocation.request)


class AllocationColumns:
    """The answers of an ``AllocateSlotsBatch`` gathered into plain lists, one entry at
    a time, and written into its response once (``fill``): a few ``extend`` calls per
    batch instead of messages per allocation. The layout is the proto's."""

    __slots__ = ("_empty", "_extras", "_num_entries", "_num_groups", "block_ids", "counts")

    def __init__(self, num_groups: int) -> None:
        self._num_groups = num_groups
        self._empty = [0] * num_groups
        self._num_entries = 0
        self.counts: list[int] = []
        self.block_ids: list[int] = []
        # (entry index, allocation) of the rare entries that zero or copy blocks: the
        # per-entry columns are built from them once, at ``fill``.
        self._extras: list[tuple[int, Allocation]] = []

    def add_nothing(self) -> None:
        """An entry without blocks: refused, or without room."""
        self.counts.extend(self._empty)
        self._num_entries += 1

    def add(self, allocation: Allocation) -> None:
        """An entry that allocated (``new_block_ids`` set)."""
        groups = allocation.new_block_ids
        assert groups is not None
        if self._num_groups == 1:
            # The common pool; a decode allocation usually takes no block at all.
            ids = groups[0]
            self.counts.append(len(ids))
            if ids:
                self.block_ids.extend(ids)
        else:
            for ids in groups:
                self.counts.append(len(ids))
                self.block_ids.extend(ids)
        if (
            allocation.block_ids_to_zero
            or allocation.block_ids_zeroed
            or allocation.block_copies_to_apply
            or allocation.block_copies_applied
        ):
            self._extras.append((self._num_entries, allocation))
        self._num_entries += 1

    def fill(self, out: pb.AllocateSlotsBatchResponse) -> None:
        out.num_groups = self._num_groups
        out.num_new_blocks.extend(self.counts)
        if self.block_ids:
            out.new_block_ids.extend(self.block_ids)
        if not self._extras:
            return
        extras = self._extras
        self._fill_column(
            out.num_block_ids_to_zero,
            out.block_ids_to_zero,
            [(i, a.block_ids_to_zero) for i, a in extras],
        )
        self._fill_column(
            out.num_block_ids_zeroed,
            out.block_ids_zeroed,
            [(i, a.block_ids_zeroed) for i, a in extras],
        )
        self._fill_column(
            out.num_block_copies_to_apply,
            out.block_copies_to_apply,
            [(i, _flat_pairs(a.block_copies_to_apply)) for i, a in extras],
            width=2,
        )
        self._fill_column(
            out.num_block_copies_applied,
            out.block_copies_applied,
            [(i, _flat_pairs(a.block_copies_applied)) for i, a in extras],
            width=2,
        )

    def _fill_column(
        self, counts: Any, values: Any, entries: list[tuple[int, Sequence[int]]], width: int = 1
    ) -> None:
        """One count per entry plus the concatenated values (``width`` values per
        counted item: 2 for a copy); nothing at all, counts included, when no entry
        has a value."""
        if not any(vals for _, vals in entries):
            return
        per_entry = [0] * self._num_entries
        for index, vals in entries:
            per_entry[index] = len(vals) // width
            values.extend(vals)
        counts.extend(per_entry)


class HitColumns:
    """The lookups of a ``LookupAllocateBatch`` gathered into plain lists, one entry
    at a time, and written into its response once (``fill``), as
    ``AllocationColumns`` gathers its allocations. The layout is the proto's."""

    __slots__ = ("_empty", "_num_groups", "block_ids", "boundaries", "counts", "tokens")

    def __init__(self, num_groups: int) -> None:
        self._num_groups = num_groups
        self._empty = [0] * num_groups
        self.tokens: list[int] = []
        self.boundaries: list[int] = []
        self.counts: list[int] = []
        self.block_ids: list[int] = []

    def add_nothing(self) -> None:
        """An entry whose lookup was refused."""
        self.tokens.append(0)
        self.boundaries.append(0)
        self.counts.extend(self._empty)

    def add(self, hit: ComputedBlocks) -> None:
        self.tokens.append(hit.num_computed_tokens)
        self.boundaries.append(hit.shared_prefix_boundary)
        for ids in hit.block_ids:
            self.counts.append(len(ids))
            if ids:
                self.block_ids.extend(ids)

    def fill(self, out: pb.LookupAllocateBatchResponse) -> None:
        out.num_computed_tokens.extend(self.tokens)
        out.shared_prefix_boundary.extend(self.boundaries)
        out.num_hit_blocks.extend(self.counts)
        if self.block_ids:
            out.hit_block_ids.extend(self.block_ids)


def _flat_pairs(pairs: Sequence[tuple[int, int]]) -> list[int]:
    return [value for pair in pairs for value in pair]


def _add_copies(field: Any, copies: Sequence[tuple[int, int]]) -> None:
    for src, dst in copies:
        field.add(src_block_id=src, dst_block_id=dst)


def fill_pin(out: pb.Pin, pin: PinView) -> None:
    out.pin_id = pin.pin_id
    out.tenant = pin.tenant
    out.num_tokens = pin.num_tokens
    out.num_reserved_blocks = pin.num_reserved_blocks
    out.num_held_blocks = pin.num_held_blocks
    if pin.ttl_s is not None:
        out.ttl_seconds = pin.ttl_s
    out.refresh_on_hit = pin.refresh_on_hit
    if pin.expires_in_s is not None:
        out.expires_in_seconds = pin.expires_in_s
    out.num_hits = pin.num_hits


def fill_pins(out: pb.ListPinsResponse, pins: Sequence[PinView], budget: PinnedBudget) -> None:
    for pin in pins:
        fill_pin(out.pins.add(), pin)
    out.num_pinned_blocks = budget.num_pinned_blocks
    out.num_reserved_blocks = budget.num_reserved_blocks
    out.max_pinned_blocks = budget.max_pinned_blocks


def probe_to_pb(probe: AllocationProbe) -> pb.ProbeResponse:
    return pb.ProbeResponse(
        num_hit_tokens=probe.num_hit_tokens,
        num_new_tokens=probe.num_new_tokens,
        num_blocks_to_allocate=probe.num_blocks_to_allocate,
        num_free_blocks=probe.num_free_blocks,
        would_fit=probe.would_fit,
    )


def usage_to_pb(usage: PoolUsage) -> pb.GetUsageResponse:
    return pb.GetUsageResponse(
        usage=usage.usage,
        num_free_blocks=usage.num_free_blocks,
        num_used_blocks=usage.num_used_blocks,
        num_blocks=usage.num_blocks,
        num_requests=usage.num_requests,
        prefix_cache_queries=usage.prefix_cache_queries,
        prefix_cache_hits=usage.prefix_cache_hits,
    )


def group_to_pb(group: KVCacheGroupSpec) -> pb.KVCacheGroup:
    spec = group.kv_cache_spec
    msg = pb.KVCacheGroup(
        kind=_KIND_TO_PB[spec.kind],
        block_size=spec.block_size,
        layer_names=group.layer_names,
        page_size_bytes=spec.page_size_bytes,
    )
    if isinstance(spec, AttentionSpec):
        msg.num_kv_heads = spec.num_kv_heads
        msg.head_size = spec.head_size
        msg.dtype = spec.dtype
    if isinstance(spec, SlidingWindowSpec):
        msg.sliding_window = spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        msg.attention_chunk_size = spec.attention_chunk_size
    if isinstance(spec, CrossAttentionSpec):
        msg.max_num_encoder_input_tokens = spec.max_num_encoder_input_tokens
    return msg


_SEED_SOURCES = {
    HashSeedSource.EXPLICIT: pb.HASH_SEED_SOURCE_EXPLICIT,
    HashSeedSource.PYTHONHASHSEED: pb.HASH_SEED_SOURCE_PYTHONHASHSEED,
    HashSeedSource.DEFAULT: pb.HASH_SEED_SOURCE_DEFAULT,
    HashSeedSource.RANDOM: pb.HASH_SEED_SOURCE_RANDOM,
}


def cache_config_to_pb(
    manager: KVCacheManager,
    model_name: str,
    runtime_device: str = "",
    vocab_size: int = 0,
    seed_source: HashSeedSource = HashSeedSource.RANDOM,
    trusts_client_block_hashes: bool = False,
) -> pb.GetCacheConfigResponse:
    """The pool as clients see it; ``runtime_device`` is where the co-located
    runtime's KV tensors live, empty without a runtime; ``vocab_size`` bounds the
    token ids the server accepts (0: no bound); ``seed_source`` where the hash chain's
    seed came from (the seed itself is reported unless it is a random one);
    ``trusts_client_block_hashes``: whether the caller may send client_hashed requests."""
    config = manager.kv_cache_config
    hasher = manager.block_hasher
    retention = manager.retention_policy
    groups = [group_to_pb(g) for g in config.kv_cache_groups]
    for msg, single in zip(groups, manager.coordinator.single_type_managers, strict=True):
        cap = single.max_admission_blocks_per_request
        if cap is not None:
            msg.max_admission_blocks_per_request = cap
    return pb.GetCacheConfigResponse(
        none_hash_seed="" if seed_source.secret else hasher.none_hash_seed,
        none_hash_seed_source=_SEED_SOURCES[seed_source],
        groups=groups,
        num_blocks=config.num_blocks,
        max_model_len=manager.max_model_len,
        scheduler_block_size=manager.scheduler_block_size,
        hash_block_size=manager.hash_block_size,
        hash_algo=hasher.hash_algo,
        none_hash_seed_fingerprint=hasher.none_hash_seed_fingerprint,
        enable_caching=manager.enable_caching,
        needs_kv_cache_zeroing=config.needs_kv_cache_zeroing,
        model_name=model_name,
        blocks_zeroed_by_server=bool(runtime_device),
        runtime_device=runtime_device,
        vocab_size=vocab_size,
        watermark_blocks=manager.watermark_blocks,
        max_in_flight_tokens=manager.max_in_flight_tokens,
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        eviction_policy=retention.policy if retention is not None else "lru",
        max_pinned_blocks=retention.max_pinned_blocks if retention is not None else 0,
        use_eagle=bool(manager.coordinator.eagle_group_ids),
        eagle_group_ids=sorted(manager.coordinator.eagle_group_ids),
        num_hash_lookahead_tokens=manager.num_hash_lookahead_tokens,
        trusts_client_block_hashes=trusts_client_block_hashes,
    )


_ADMIT_STOPS = {
    AdmitStop.ALL_ADMITTED: pb.ADMIT_STOP_REASON_ALL_ADMITTED,
    AdmitStop.BUDGET_SPENT: pb.ADMIT_STOP_REASON_BUDGET_SPENT,
    AdmitStop.NO_SPACE: pb.ADMIT_STOP_REASON_NO_SPACE,
    AdmitStop.NEEDS_CHUNKING: pb.ADMIT_STOP_REASON_NEEDS_CHUNKING,
    AdmitStop.QUOTA: pb.ADMIT_STOP_REASON_QUOTA,
}


def admit_stop_to_pb(stop: AdmitStop) -> pb.AdmitStopReason.ValueType:
    return _ADMIT_STOPS[stop]


def retention_events_to_pb(events: Sequence[RetentionEvent], out: Any) -> None:
    """A replica session's retention changes into its Step answer."""
    for event in events:
        message = out.add(now_seconds=event.now)
        if isinstance(event, Tick):
            message.tick = True
        elif isinstance(event, PinPlaced):
            pin = message.pin
            pin.owner, pin.pin_id, pin.num_tokens = event.owner, event.pin_id, event.num_tokens
            pin.keys.extend(event.keys)
            pin.ttl_seconds = event.ttl_s or 0.0
            pin.refresh_on_hit = event.refresh_on_hit
        else:
            message.unpin.owner, message.unpin.pin_id = event.owner, event.pin_id

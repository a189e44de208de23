"""Shared by the fuzz, load and fault tests: which status each RPC may answer, a
fingerprint of the request table's whole state (to prove a refused call changed nothing),
hypothesis strategies for well-formed and malformed messages, and cleanup that proves
no block was lost.

Everything here talks to a real server over loopback; the fingerprint and the audit
run on the server's own loop (``ThreadedServer.call``), never from another thread.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvservice.protocol import pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.request_table.table import RequestTable
from tests.servers import ThreadedServer

Code = grpc.StatusCode
SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"]
# A safety net only: every call answers in milliseconds unless the server is stuck.
CALL_TIMEOUT_S = 30.0


def fuzz_settings(default_examples: int) -> settings:
    """Small example counts by default (the suite runs on 2 cores);
    ``KVSERVICE_FUZZ_EXAMPLES`` scales every fuzz test up for a manual run."""
    examples = int(os.environ.get("KVSERVICE_FUZZ_EXAMPLES", default_examples))
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


# -- the statuses each RPC documents (proto/kvservice/v1/kv_cache_service.proto) -------

_PER_REQUEST = frozenset({Code.OK, Code.NOT_FOUND})
_ALLOCATION = _PER_REQUEST | {
    Code.INVALID_ARGUMENT,
    Code.OUT_OF_RANGE,
    Code.FAILED_PRECONDITION,
    Code.ABORTED,
}
ALLOWED_CODES: dict[str, frozenset[grpc.StatusCode]] = {
    # FAILED_PRECONDITION: retention on an LRU pool; RESOURCE_EXHAUSTED: a
    # cache_control_ttl pin the pool refuses (pinning off, or past its budget).
    "AddRequest": frozenset(
        {
            Code.OK,
            Code.ALREADY_EXISTS,
            Code.INVALID_ARGUMENT,
            Code.OUT_OF_RANGE,
            Code.FAILED_PRECONDITION,
            Code.RESOURCE_EXHAUSTED,
        }
    ),
    "AppendTokens": _PER_REQUEST | {Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE},
    "GetComputedBlocks": _PER_REQUEST | {Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT},
    "AllocateSlots": _ALLOCATION,
    "FreeRequest": _PER_REQUEST | {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION},
    "GetRequest": _PER_REQUEST,
    "GetBlockIds": _PER_REQUEST,
    "ResetPrefixCache": frozenset({Code.OK}),
    "GetUsage": frozenset({Code.OK}),
    "GetCacheConfig": frozenset({Code.OK}),
    "Probe": _ALLOCATION - {Code.ABORTED},
    # Every id is checked before anything runs; no room or a quota is a stop reason.
    "Admit": _PER_REQUEST | {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION},
    # Over the operations-per-step limit, or keep_copy_holds without a session;
    # per-operation refusals are results.
    "Step": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    "StepStream": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    # Step boundaries and copy holds (a hold the caller's session does not have).
    "NewStepStarts": frozenset({Code.OK}),
    "FreeRetainedBlocks": frozenset({Code.OK, Code.FAILED_PRECONDITION}),
    # vLLM's cache_blocks: past the request's tokens or slots is OUT_OF_RANGE.
    "CacheBlocks": _PER_REQUEST | {Code.OUT_OF_RANGE},
    "SubscribeEvents": frozenset({Code.FAILED_PRECONDITION}),
    # Sessions and the audit.
    "OpenSession": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    "KeepAlive": frozenset({Code.OK, Code.NOT_FOUND, Code.FAILED_PRECONDITION}),
    "CloseSession": frozenset({Code.OK, Code.NOT_FOUND, Code.FAILED_PRECONDITION}),
    "Audit": frozenset({Code.OK}),
    # Pins: refused past the pinned budget (or with pinning off, the default).
    "PinPrefix": frozenset(
        {Code.OK, Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.RESOURCE_EXHAUSTED}
    ),
    "UnpinPrefix": frozenset({Code.OK, Code.NOT_FOUND, Code.INVALID_ARGUMENT}),
    "ListPins": frozenset({Code.OK}),
    # A CPU offload tier's step: a session needed, a config fixed per session, an
    # operation the index refuses or answers otherwise stops the index.
    "OffloadStep": frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    # Step-only columnar operations: refused whole only when malformed (no entry,
    # uneven columns); each entry's refusal is in the batch's answer.
    "AppendTokensBatch": frozenset({Code.OK, Code.INVALID_ARGUMENT}),
    "AllocateSlotsBatch": frozenset({Code.OK, Code.INVALID_ARGUMENT}),
    "FreeBatch": frozenset({Code.OK, Code.INVALID_ARGUMENT}),
    "LookupAllocateBatch": frozenset({Code.OK, Code.INVALID_ARGUMENT}),
    "AddRequestBatch": frozenset({Code.OK, Code.INVALID_ARGUMENT}),
    # Step-only, for KV connectors: a block the caller holds no request of, a request
    # past its computed tokens.
    "EvictBlocks": frozenset({Code.OK, Code.FAILED_PRECONDITION}),
    "RemoveSkippedBlocks": _PER_REQUEST | {Code.OUT_OF_RANGE},
}
# A StepOperation's field -> the unary RPC whose statuses its result may carry (for a
# columnar operation, its message's name: there is no such RPC).
STEP_OP_RPC = {
    op.name: op.message_type.name.removesuffix("Request")
    for op in pb.StepOperation.DESCRIPTOR.fields
    if op.message_type is not None
}
# A columnar operation -> the statuses each of its entries may answer (its single
# operation's; a LookupAllocateBatch entry is a lookup, then an allocation).
BATCH_ENTRY_CODES = {
    "AppendTokensBatch": ALLOWED_CODES["AppendTokens"],
    "AllocateSlotsBatch": ALLOWED_CODES["AllocateSlots"],
    "FreeBatch": ALLOWED_CODES["FreeRequest"],
    "LookupAllocateBatch": ALLOWED_CODES["GetComputedBlocks"] | ALLOWED_CODES["AllocateSlots"],
    "AddRequestBatch": ALLOWED_CODES["AddRequest"],
}
# The step operations with a unary twin, and the step-only ones.
UNARY_STEP_OPS = sorted(k for k, rpc in STEP_OP_RPC.items() if rpc in SERVICE.methods_by_name)
BATCH_STEP_OPS = sorted(k for k, rpc in STEP_OP_RPC.items() if rpc not in SERVICE.methods_by_name)
# RPCs that never change state, whatever they answer.
READ_ONLY = frozenset(
    {"GetRequest", "GetBlockIds", "GetUsage", "GetCacheConfig", "Probe", "Audit", "ListPins"}
)


# Every unary RPC is fuzzed with raw bytes; one added without its statuses in
# ALLOWED_CODES fails the fuzz tests (a KeyError) rather than going unfuzzed.
UNARY_METHODS = sorted(
    m.name for m in SERVICE.methods if not m.client_streaming and not m.server_streaming
)


def method_path(name: str) -> str:
    return f"/{SERVICE.full_name}/{name}"


def request_type(name: str) -> Any:
    return getattr(pb, SERVICE.methods_by_name[name].input_type.name)


def response_type(name: str) -> Any:
    return getattr(pb, SERVICE.methods_by_name[name].output_type.name)


def code_of_number(number: int) -> grpc.StatusCode:
    code: grpc.StatusCode = next(c for c in Code if c.value[0] == number)
    return code


@dataclass
class Tally:
    """How many inputs a test sent and how the server answered them, for the report."""

    codes: Counter[str] = field(default_factory=Counter)

    def add(self, code: grpc.StatusCode) -> None:
        self.codes[code.name] += 1

    def line(self, what: str) -> str:
        total = sum(self.codes.values())
        return f"{what}: {total} calls, answers {dict(self.codes.most_common())}"


# -- state -----------------------------------------------------------------------------


def table_state(table: RequestTable) -> tuple[Any, ...]:
    """Everything a call could change: each request, each remembered prefix hit, every
    block's reference count and hash, the free queue's order, the hash map, the block
    tables and the allocation checker's history. Run it on the server's loop."""
    manager = table.manager
    pool = manager.block_pool
    requests = {
        rid: (
            r.status,
            tuple(r.all_token_ids),
            r.num_computed_tokens,
            r.num_preemptions,
            len(r.block_hashes),
        )
        for rid, r in table._requests.items()  # test-only peek
    }
    hits = {rid: hit.block_ids for rid, hit in table._hits.items()}
    blocks = tuple((b.ref_cnt, b.block_hash) for b in pool.blocks)
    free_queue = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    cached = tuple(
        (key, tuple(b.block_id for b in pool.cached_block_hash_to_block.blocks_of(key)))
        for key in pool.cached_block_hash_to_block
    )
    tables = tuple(
        (
            {rid: tuple(b.block_id for b in bs) for rid, bs in single.req_to_blocks.items()},
            dict(single.num_cached_block),
        )
        for single in manager.coordinator.single_type_managers
    )
    checker = dict(manager.checker.num_computed_at_last_allocation)
    counters = (table._prefix_cache_queries, table._prefix_cache_hits)
    return (requests, hits, blocks, free_queue, cached, tables, checker, counters)


def finish_everything(server: ThreadedServer, stub: pb_grpc.KVCacheServiceStub) -> None:
    """FINISH every request the server knows, over RPC, then prove the pool is whole:
    no request left, no block held, every usable block free, the audit passing."""
    known = server.call(lambda: sorted(server.server.table._requests))
    for rid in known:
        stub.FreeRequest(
            pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH),
            timeout=CALL_TIMEOUT_S,
        )
    usage: pb.GetUsageResponse = stub.GetUsage(pb.GetUsageRequest(), timeout=CALL_TIMEOUT_S)
    assert usage.num_requests == 0, usage
    assert usage.num_used_blocks == 0, usage
    assert usage.num_free_blocks == usage.num_blocks - 1, usage
    server.call(server.server.audit)


# -- strategies ------------------------------------------------------------------------

# A few ids most operations name, so sequences reach every state of a request; plus
# the empty id and arbitrary (unicode, long) ones nobody added.
ID_POOL = ("a", "b", "c")
request_ids = st.one_of(
    st.sampled_from(ID_POOL),
    st.sampled_from(ID_POOL),
    st.just(""),
    st.text(max_size=12),
    st.text(min_size=300, max_size=2000),
)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EDGE_INTS = (
    -1,
    INT64_MIN,
    INT64_MIN + 1,
    -(2**31),
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**62,
    INT64_MAX - 1,
    INT64_MAX,
)
# Counts: mostly plausible, sometimes negative, huge or at the int64 edges.
counts = st.one_of(
    st.integers(0, 40),
    st.integers(0, 200),
    st.integers(-5, -1),
    st.sampled_from(EDGE_INTS),
    st.integers(INT64_MIN, INT64_MAX),
)
small_counts = st.one_of(st.just(0), st.just(0), counts)
# Prompts share leading blocks (so lookups hit) and sometimes carry bad token ids or
# run past max_model_len.
_SHARED_PREFIXES: tuple[list[int], ...] = (
    [],
    list(range(16)),
    list(range(32)),
    list(range(1000, 1048)),
)
token_ids = st.one_of(
    st.builds(
        lambda prefix, tail: prefix + tail,
        st.sampled_from(_SHARED_PREFIXES),
        st.lists(st.integers(0, 50_000), max_size=40),
    ),
    st.lists(st.one_of(st.integers(0, 100), st.sampled_from(EDGE_INTS)), max_size=20),
    st.lists(st.integers(0, 10), min_size=100, max_size=200),
)
enum_values = st.one_of(st.integers(0, 3), st.integers(-3, 100), st.sampled_from((2**31 - 1,)))
block_id_lists = st.lists(
    st.builds(
        lambda ids: pb.BlockIds(block_ids=ids),
        st.lists(st.one_of(st.integers(0, 12), st.sampled_from(EDGE_INTS)), max_size=4),
    ),
    max_size=2,
)


M = TypeVar("M")


def _with_optional(message: M, **optional: Any) -> M:
    """Set the proto3 ``optional`` fields whose drawn value is not None."""
    for name, value in optional.items():
        if value is not None:
            setattr(message, name, value)
    return message


def _allocate(**fields: Any) -> pb.AllocateSlotsRequest:
    has_scheduled, computed = fields.pop("has_scheduled_reqs"), fields.pop("num_computed_tokens")
    message = pb.AllocateSlotsRequest(**fields)
    return _with_optional(message, has_scheduled_reqs=has_scheduled, num_computed_tokens=computed)


def _probe(**fields: Any) -> pb.ProbeRequest:
    has_scheduled, new = fields.pop("has_scheduled_reqs"), fields.pop("num_new_tokens")
    message = pb.ProbeRequest(**fields)
    return _with_optional(message, has_scheduled_reqs=has_scheduled, num_new_tokens=new)


def _computed_blocks_request(**fields: Any) -> pb.GetComputedBlocksRequest:
    cap = fields.pop("max_cache_hit_length")
    message = pb.GetComputedBlocksRequest(**fields)
    return _with_optional(message, max_cache_hit_length=cap)


MESSAGES: dict[str, st.SearchStrategy[Any]] = {
    "AddRequest": st.builds(
        pb.AddRequestRequest,
        request_id=request_ids,
        prompt_token_ids=token_ids,
        cache_salt=st.one_of(st.just(""), st.text(max_size=8)),
        lora_name=st.one_of(st.just(""), st.text(max_size=8)),
        mm_features=st.lists(
            st.builds(
                pb.MultiModalFeature,
                identifier=st.one_of(st.just(""), st.text(min_size=1, max_size=8)),
                offset=small_counts,
                length=small_counts,
            ),
            max_size=2,
        ),
        skip_reading_prefix_cache=st.booleans(),
        lora_path=st.one_of(st.just(""), st.text(max_size=8)),
        lora_int_id=st.one_of(st.just(0), st.integers(1, 5), st.sampled_from(EDGE_INTS)),
        prompt_embeds=st.one_of(st.just(b""), st.binary(max_size=64)),
        prompt_embeds_row_bytes=st.one_of(
            st.just(0), st.integers(1, 8), st.sampled_from(EDGE_INTS)
        ),
    ),
    "AppendTokens": st.builds(pb.AppendTokensRequest, request_id=request_ids, token_ids=token_ids),
    "GetComputedBlocks": st.builds(
        _computed_blocks_request, request_id=request_ids, max_cache_hit_length=st.none() | counts
    ),
    "AllocateSlots": st.builds(
        _allocate,
        request_id=request_ids,
        num_new_tokens=counts,
        num_new_computed_tokens=small_counts,
        new_computed_block_ids=block_id_lists,
        num_lookahead_tokens=small_counts,
        num_external_computed_tokens=small_counts,
        delay_cache_blocks=st.booleans(),
        num_encoder_tokens=small_counts,
        full_sequence_must_fit=st.booleans(),
        reserved_blocks=small_counts,
        has_scheduled_reqs=st.none() | st.booleans(),
        num_computed_tokens=st.none() | counts,
        num_in_flight_tokens=small_counts,
    ),
    "FreeRequest": st.builds(
        pb.FreeRequestRequest, request_id=request_ids, mode=enum_values, keep_blocks=st.booleans()
    ),
    "GetRequest": st.builds(pb.GetRequestRequest, request_id=request_ids),
    "GetBlockIds": st.builds(pb.GetBlockIdsRequest, request_id=request_ids),
    "ResetPrefixCache": st.just(pb.ResetPrefixCacheRequest()),
    "NewStepStarts": st.just(pb.NewStepStartsRequest()),
    "FreeRetainedBlocks": st.builds(
        pb.FreeRetainedBlocksRequest,
        block_ids=st.lists(st.one_of(st.integers(0, 12), st.sampled_from(EDGE_INTS)), max_size=4),
    ),
    "CacheBlocks": st.builds(
        pb.CacheBlocksRequest, request_id=request_ids, num_computed_tokens=counts
    ),
    "GetUsage": st.just(pb.GetUsageRequest()),
    "GetCacheConfig": st.just(pb.GetCacheConfigRequest()),
    "Probe": st.builds(
        _probe,
        request_id=request_ids,
        num_new_tokens=st.none() | counts,
        num_lookahead_tokens=small_counts,
        num_external_computed_tokens=small_counts,
        num_encoder_tokens=small_counts,
        full_sequence_must_fit=st.booleans(),
        reserved_blocks=small_counts,
        has_scheduled_reqs=st.none() | st.booleans(),
    ),
    "Admit": st.builds(
        pb.AdmitRequest,
        request_ids=st.lists(request_ids, max_size=4),
        token_budget=counts,
        enable_chunked_prefill=st.booleans(),
        num_lookahead_tokens=small_counts,
        full_sequence_must_fit=st.booleans(),
    ),
}


# Leases of every kind: NaN, infinities, negative, zero (the default), in and out
# of the server's bounds; epochs up to the int64 edges; over-long names.
ttls = st.one_of(
    st.sampled_from((0.0, 1.0, 60.0, 3600.0, 3600.5, 0.5, -1.0)),
    st.floats(allow_nan=True, allow_infinity=True),
)
MESSAGES["OpenSession"] = st.builds(
    pb.OpenSessionRequest,
    ttl_seconds=ttls,
    client_name=st.one_of(st.text(max_size=10), st.text(min_size=250, max_size=300)),
    epoch=st.one_of(st.just(0), st.integers(0, 3), counts),
)
MESSAGES["KeepAlive"] = st.builds(pb.KeepAliveRequest, session_id=request_ids)
MESSAGES["CloseSession"] = st.builds(
    pb.CloseSessionRequest, session_id=request_ids, free_requests=st.booleans()
)
MESSAGES["Audit"] = st.just(pb.AuditRequest())
MESSAGES["PinPrefix"] = st.builds(
    pb.PinPrefixRequest,
    token_ids=token_ids,
    ttl_seconds=ttls,
    refresh_on_hit=st.booleans(),
    cache_salt=st.one_of(st.just(""), st.text(max_size=8)),
)
MESSAGES["UnpinPrefix"] = st.builds(pb.UnpinPrefixRequest, pin_id=request_ids)
MESSAGES["ListPins"] = st.builds(pb.ListPinsRequest, all_tenants=st.booleans())

# Offload keys: a few well-formed ones (32-byte hash, group 0 or 1), and bad lengths.
offload_keys = st.one_of(
    st.sampled_from(
        [bytes([i]) * 32 + group.to_bytes(4, "big") for i in range(3) for group in (0, 1)]
    ),
    st.binary(max_size=80),
)
offload_key_lists = st.lists(offload_keys, max_size=4)
offload_positions = st.lists(st.sampled_from((-2, -1, 0, 16, 32)), max_size=4)
offload_ids = st.lists(st.sampled_from((-1, 0, 1, 2, 7)), max_size=4)
offload_times = st.sampled_from((0.0, 1.0, 100.0, -1.0, float("nan"), float("inf")))
OFFLOAD_OPS = {
    "new_request": st.builds(
        pb.OffloadNewRequest,
        request_id=request_ids,
        priority=st.sampled_from((-1, 0, 35, 100, 101)),
    ),
    "prepare_load": st.builds(
        pb.OffloadPrepareLoad,
        request_id=request_ids,
        keys=offload_key_lists,
        positions=offload_positions,
        chunk_ids=offload_ids,
    ),
    "prepare_store": st.builds(
        pb.OffloadPrepareStore,
        request_id=request_ids,
        keys=offload_key_lists,
        positions=offload_positions,
        no_room=st.booleans(),
        keys_to_store=offload_key_lists,
        chunk_ids=offload_ids,
        evicted_keys=offload_key_lists,
    ),
    "touch": st.builds(pb.OffloadKeys, keys=offload_key_lists),
    "complete_load": st.builds(pb.OffloadKeys, keys=offload_key_lists),
    "complete_store": st.builds(
        pb.OffloadCompleteStore, keys=offload_key_lists, success=st.booleans()
    ),
    "request_finished": st.builds(
        pb.OffloadRequestFinished, request_id=request_ids, keys=offload_key_lists
    ),
    "pin": st.builds(
        pb.OffloadPin,
        pin_id=request_ids,
        keys=offload_key_lists,
        ttl_seconds=offload_times,
        now_seconds=offload_times,
        refused=st.booleans(),
    ),
    "unpin": st.builds(pb.OffloadUnpin, pin_id=request_ids, removed=st.booleans()),
    "expire_pins": st.builds(
        pb.OffloadExpirePins, now_seconds=offload_times, num_expired=st.integers(-1, 2)
    ),
    "reset": st.just(pb.OffloadReset()),
}


def _offload_op(kind: str, body: Any) -> pb.OffloadOperation:
    return pb.OffloadOperation(**{kind: body})


offload_ops = st.one_of(
    st.just(pb.OffloadOperation()),
    *(st.builds(_offload_op, st.just(kind), body) for kind, body in OFFLOAD_OPS.items()),
)
MESSAGES["OffloadStep"] = st.builds(
    pb.OffloadStepRequest,
    config=st.builds(
        pb.OffloadTierConfig,
        num_chunks=st.sampled_from((0, 1, 8, -1, INT64_MAX)),
        eviction_policy=st.sampled_from(("lru", "arc", "priority", "", "fifo")),
        store_threshold=st.sampled_from((0, 2, -1)),
        max_tracker_size=st.sampled_from((0, 1, 64, INT64_MAX)),
        enable_events=st.booleans(),
        max_pinned_chunks=st.sampled_from((0, 4, -1, 9)),
        bytes_per_chunk=st.sampled_from((0, 4096, -1)),
    ),
    ops=st.lists(offload_ops, max_size=6),
)


def _step_op(kind: str | None, message: Any) -> pb.StepOperation:
    op = pb.StepOperation()
    if kind is not None:
        getattr(op, kind).CopyFrom(message)
    return op


@st.composite
def _batch(draw: st.DrawFn, message: Any, column: str, values: st.SearchStrategy[int]) -> Any:
    """A columnar message: usually even columns of up to 6 entries (ids repeat), at
    times empty or uneven (refused whole)."""
    ids = draw(st.lists(request_ids, max_size=6))
    shape = draw(st.sampled_from(("even", "even", "even", "uneven")))
    size = len(ids) if shape == "even" else draw(st.integers(0, 7).filter(lambda n: n != len(ids)))
    return message(
        request_ids=ids, **{column: draw(st.lists(values, min_size=size, max_size=size))}
    )


@st.composite
def _new_requests(draw: st.DrawFn) -> pb.AddRequestBatch:
    """An AddRequestBatch: prompt counts that usually cut its packed ids (at times
    not, or a stray byte), hashed or not, with hash counts that add up or not."""
    ids = draw(st.lists(request_ids, max_size=6))
    prompts = draw(
        st.lists(
            st.lists(st.one_of(st.integers(0, 50_000), st.just(2**32 - 1)), max_size=40),
            min_size=len(ids),
            max_size=len(ids),
        )
    )
    counts = [len(prompt) for prompt in prompts]
    packed = b"".join(pack_token_ids(prompt) for prompt in prompts)
    shape = draw(st.sampled_from(("even", "even", "even", "counts", "stray")))
    if shape == "counts":
        counts = draw(st.lists(st.integers(-2, 50), max_size=7))
    elif shape == "stray":
        packed += b"\x01"
    batch = pb.AddRequestBatch(
        request_ids=ids, packed_prompt_token_ids=packed, num_prompt_tokens=counts
    )
    if draw(st.booleans()):
        batch.client_hashed = draw(st.booleans())
        num_hashes = draw(st.lists(st.integers(0, 3), max_size=7))
        batch.num_block_hashes.extend(num_hashes)
        total = sum(num_hashes)
        hashes = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40))
        batch.block_hashes.extend(
            draw(st.lists(hashes, min_size=max(0, total - 1), max_size=total + 1))
        )
    return batch


def _with_column(message: Any, column: str, values: list[Any]) -> Any:
    getattr(message, column).extend(values)
    return message


# Step-only messages (the columnar operations and the KV connectors' evict and skip):
# not in MESSAGES, whose keys are RPCs.
STEP_ONLY_MESSAGES: dict[str, st.SearchStrategy[Any]] = {
    "AppendTokensBatch": _batch(
        pb.AppendTokensBatch,
        "token_ids",
        st.one_of(st.integers(0, 50_000), st.sampled_from(EDGE_INTS)),
    ),
    "AllocateSlotsBatch": _batch(pb.AllocateSlotsBatch, "num_new_tokens", counts),
    # Modes past the enum's values; keep_blocks empty, one per entry, or uneven.
    "FreeBatch": st.builds(
        _with_column,
        _batch(pb.FreeBatch, "modes", st.sampled_from((0, 1, 2, 2, 7))),
        st.just("keep_blocks"),
        st.one_of(st.just([]), st.lists(st.booleans(), max_size=7)),
    ),
    "LookupAllocateBatch": _batch(pb.LookupAllocateBatch, "num_new_tokens", counts),
    "AddRequestBatch": _new_requests(),
    "EvictBlocks": st.builds(
        pb.EvictBlocksRequest,
        block_ids=st.lists(st.one_of(st.integers(0, 12), st.sampled_from(EDGE_INTS)), max_size=4),
    ),
    "RemoveSkippedBlocks": st.builds(
        pb.RemoveSkippedBlocksRequest, request_id=request_ids, processed_computed_tokens=counts
    ),
}
# Every StepOperation kind is fuzzed: one without a message strategy or its statuses
# fails here, at import, rather than going unfuzzed.
_MISSING = [
    kind
    for kind, rpc in STEP_OP_RPC.items()
    if rpc not in ALLOWED_CODES or (rpc not in MESSAGES and rpc not in STEP_ONLY_MESSAGES)
]
assert not _MISSING, f"step operations missing from the fuzz tables: {_MISSING}"


def _ops_of(kinds: list[str]) -> st.SearchStrategy[pb.StepOperation]:
    strategies = {**MESSAGES, **STEP_ONLY_MESSAGES}
    return st.one_of(
        *(st.builds(_step_op, st.just(kind), strategies[STEP_OP_RPC[kind]]) for kind in kinds),
        st.builds(_step_op, st.none(), st.none()),
    )


# One StepOperation of any kind with a unary twin (what a Step is compared against),
# or an empty one (no field of the oneof set).
step_ops = _ops_of(UNARY_STEP_OPS)
# Any StepOperation, the columnar ones included.
all_step_ops = _ops_of(UNARY_STEP_OPS + BATCH_STEP_OPS)
MESSAGES["Step"] = st.one_of(
    st.builds(
        pb.StepRequest,
        step_id=counts,
        ops=st.lists(step_ops, max_size=8),
        stop_on_error=st.booleans(),
        omit_request_state=st.booleans(),
    ),
    st.builds(
        pb.StepRequest,
        step_id=counts,
        ops=st.lists(all_step_ops, max_size=8),
        stop_on_error=st.booleans(),
        omit_request_state=st.booleans(),
    ),
)


@st.composite
def wire_bytes(draw: st.DrawFn, name: str) -> bytes:
    """Bytes for ``name``'s request: random garbage, or a valid message truncated,
    with bytes flipped, or with another message's bytes appended."""
    if name == "StepStream":
        strategy: st.SearchStrategy[Any] = st.builds(pb.StepStreamRequest, step=MESSAGES["Step"])
    else:
        strategy = MESSAGES.get(name, st.just(request_type(name)()))
    valid: bytes = draw(strategy).SerializeToString()
    how = draw(st.sampled_from(("garbage", "truncated", "flipped", "spliced", "valid")))
    if how == "garbage":
        return draw(st.binary(max_size=300))
    if how == "truncated":
        return valid[: draw(st.integers(0, max(len(valid) - 1, 0)))]
    if how == "flipped" and valid:
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "spliced":
        return valid + draw(st.binary(min_size=1, max_size=40))
    return valid

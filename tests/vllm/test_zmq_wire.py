"""The wire structs, the config keys and the endpoint grammar against vLLM 0.33.0's own:
the same bytes for the same values, the same keys and defaults, the same bind rule."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import msgspec
import pytest
from vllm.config.kv_events import KVEventsConfig as VllmKVEventsConfig
from vllm.distributed import kv_events as vllm_events
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvservice.core import kv_events as core
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.offload_tiers import OffloadTier, StepTally
from kvservice.server.zmq_events import wire
from kvservice.server.zmq_events.config import (
    KVEventsConfig,
    endpoint_is_bound,
    parse_kv_events_config,
)

PAIRS = [
    (wire.EventBatch, vllm_events.EventBatch),
    (wire.KVCacheEvent, vllm_events.KVCacheEvent),
    (wire.BlockStored, vllm_events.BlockStored),
    (wire.BlockRemoved, vllm_events.BlockRemoved),
    (wire.AllBlocksCleared, vllm_events.AllBlocksCleared),
    (wire.KVEventBatch, vllm_events.KVEventBatch),
]
HASH = bytes(range(32))

# Every field set, and each left at its default, with each kind of extra key vLLM
# publishes (LoRA name, (mm identifier, offset), cache salt).
STORED_FIELDS: dict[str, Any] = {
    "block_hashes": [HASH, 7],
    "parent_block_hash": 2**64 - 1,
    "token_ids": [0, 1, 127, 128, 65_535, 2**31 - 1],
    "block_size": 16,
    "lora_id": 3,
    "medium": "GPU",
    "lora_name": "adapter",
    "extra_keys": [("adapter", ("img-0", 4), "salt"), None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 4096,
    "locality": "LOCAL",
    "ownership": "tier-1",
    "session_id": "s",
    "lookahead_token_ids": [[1, 2], [3, 4]],
}
REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


def batches() -> list[tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]]:
    """(batch fields, [(event class name, fields)]) covering every field."""
    minimal = {k: STORED_FIELDS[k] for k in REQUIRED} | {"medium": None, "lora_name": None}
    removed = {"block_hashes": [HASH], "medium": "GPU", "group_idx": 0}
    return [
        ({"ts": 1.5, "data_parallel_rank": 0}, [("BlockStored", STORED_FIELDS)]),
        ({"ts": 2.0}, [("BlockStored", minimal), ("AllBlocksCleared", {})]),
        (
            {"ts": 1e9 + 0.25, "data_parallel_rank": 3},
            [("BlockRemoved", removed), ("BlockRemoved", removed | {"locality": "REMOTE"})],
        ),
        ({"ts": 0.0, "data_parallel_rank": 0}, []),
    ]


@pytest.mark.parametrize("case", range(len(batches())))
def test_same_bytes_as_vllms_encoder(case: int) -> None:
    """Our structs and vLLM's, holding the same values, encode to the same bytes, and
    vLLM's decoder reads ours back to equal values."""
    batch_fields, event_specs = batches()[case]
    ours = wire.KVEventBatch(
        events=[getattr(wire, name)(**fields) for name, fields in event_specs], **batch_fields
    )
    theirs = vllm_events.KVEventBatch(
        events=[getattr(vllm_events, name)(**fields) for name, fields in event_specs],
        **batch_fields,
    )
    payload = msgspec.msgpack.encode(ours)
    assert payload == msgspec.msgpack.encode(theirs)
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(payload)
    # Every value read back (a nested extra key returns as a list: msgpack has no
    # tuples), so it encodes to the same bytes again.
    assert isinstance(decoded, vllm_events.KVEventBatch)
    assert msgspec.msgpack.encode(decoded) == payload


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=lambda c: c.__name__)
def test_struct_definitions_match(ours: Any, theirs: Any) -> None:
    """Names, field order, defaults and msgspec options (tag, array_like,
    omit_defaults) are vLLM's, so a struct vLLM adds a field to fails here."""
    assert ours.__name__ == theirs.__name__
    assert ours.__struct_fields__ == theirs.__struct_fields__
    assert ours.__struct_defaults__ == theirs.__struct_defaults__
    for option in (
        "tag",
        "tag_field",
        "array_like",
        "omit_defaults",
        "gc",
        "forbid_unknown_fields",
    ):
        assert getattr(ours.__struct_config__, option) == getattr(
            theirs.__struct_config__, option
        ), option


def test_int_hashes_are_vllms_default_conversion() -> None:
    """vLLM publishes ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; so do we."""
    assert os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "1"
    for block_hash in (HASH, bytes(32), b"\xff" * 32, b"\x01\x02\x03", bytes(range(8))):
        assert wire.int_block_hash(block_hash) == maybe_convert_block_hash(block_hash)


def test_core_events_convert_field_for_field() -> None:
    """Each core event becomes the wire event of the same name and values (hashes in
    the chosen form); a field the core lacks is left at vLLM's default."""
    stored = core.BlockStored(
        block_hashes=[HASH],
        parent_block_hash=HASH[::-1],
        token_ids=[5, 6],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[("adapter",)],
        group_idx=1,
        kv_cache_spec_kind="mamba",
        kv_cache_spec_sliding_window=None,
    )
    removed = core.BlockRemoved(block_hashes=[HASH], medium="GPU", group_idx=1)
    events: list[core.KVCacheEvent] = [stored, removed, core.AllBlocksCleared()]
    for int_hashes in (True, False):
        convert = wire.int_block_hash if int_hashes else bytes
        payload = wire.WireEncoder(int_hashes).encode(events, 5.0)
        decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(payload)
        assert decoded == vllm_events.KVEventBatch(
            ts=5.0,
            data_parallel_rank=0,
            events=[
                vllm_events.BlockStored(
                    block_hashes=[convert(HASH)],
                    parent_block_hash=convert(HASH[::-1]),
                    token_ids=[5, 6],
                    block_size=2,
                    lora_id=None,
                    medium="GPU",
                    lora_name="adapter",
                    extra_keys=[("adapter",)],
                    group_idx=1,
                    kv_cache_spec_kind="mamba",
                ),
                vllm_events.BlockRemoved(block_hashes=[convert(HASH)], medium="GPU", group_idx=1),
                vllm_events.AllBlocksCleared(),
            ],
        )


def test_config_keys_and_defaults_are_vllms() -> None:
    """Our KVEventsConfig has vLLM's fields with vLLM's defaults, and resolves the
    publisher as vLLM's __post_init__ does."""
    theirs = {
        f.name: getattr(VllmKVEventsConfig(), f.name)
        for f in dataclasses.fields(VllmKVEventsConfig)
    }
    assert dataclasses.asdict(KVEventsConfig()) == theirs
    for raw in ({"enable_kv_cache_events": True}, {}, {"publisher": "zmq"}):
        theirs = dataclasses.asdict(VllmKVEventsConfig(**raw))
        assert dataclasses.asdict(parse_kv_events_config(json.dumps(raw))) == theirs
        assert dataclasses.asdict(KVEventsConfig(**raw)) == theirs


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5557",
        "tcp://*:0",
        "tcp://[::]:5557",
        "tcp://[::1]:5557",
        "tcp://127.0.0.1:5557",
        "tcp://indexer.llm-d.svc:5557",
        "tcp://0.0.0.0:5557",
        "ipc:///tmp/kv-events",
        "inproc://kv-events",
    ],
)
def test_bind_or_connect_as_vllm(endpoint: str) -> None:
    """vLLM binds wildcard, ipc and inproc endpoints and connects to the others."""
    assert endpoint_is_bound(endpoint) == vllm_events.ZmqEventPublisher._is_bind_endpoint(endpoint)


def test_the_offload_tiers_events_decode_as_vllms() -> None:
    """A CPU offload tier's chunks served by kvservice (``OffloadStep``) go out as
    vLLM's BlockStored and BlockRemoved with medium "CPU", one event per KV cache
    group, the hashes without their group suffix, as vLLM's decoder reads them."""
    tier = OffloadTier(
        pb.OffloadTierConfig(
            num_chunks=2, eviction_policy="lru", max_tracker_size=64, enable_events=True
        )
    )
    keys = [HASH + (0).to_bytes(4, "big"), HASH[::-1] + (1).to_bytes(4, "big")]
    tally = StepTally()
    for op in (
        pb.OffloadOperation(new_request=pb.OffloadNewRequest(request_id="r", priority=35)),
        pb.OffloadOperation(
            prepare_store=pb.OffloadPrepareStore(
                request_id="r", keys=keys, keys_to_store=keys, chunk_ids=[0, 1]
            )
        ),
        pb.OffloadOperation(complete_store=pb.OffloadCompleteStore(keys=keys, success=True)),
        pb.OffloadOperation(reset=pb.OffloadReset()),
    ):
        tier.run(op, tally)
    payload = wire.WireEncoder(False).encode(tier.take_events(), 1.0)
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(payload)
    assert decoded.events == [
        vllm_events.BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=group,
        )
        for group, block_hash in enumerate((HASH, HASH[::-1]))
    ]

"""The CPU offload tiers' indexes kvservice serves: one per engine session, driven by
``OffloadStep``.

vLLM's offloading connector asks its ``OffloadingManager`` (kvservice's offloading
spec) where chunks are many times a step and acts on each answer at once, so the
engine keeps a replica of its index that answers at once, and sends what it ran once
per step, each operation with its answer: this module runs the same operations on the
server's index, in order, and checks every answer. The server's index is then the one
the tier's KV events (medium "CPU") and metrics come from, and a replica that went
its own way (another writer, a bug) is caught at its first different answer.

A malformed message (a bad config, key, position, TTL or id) is refused before
anything runs. An operation the index refuses, or answers otherwise, stops the index:
the operations before it ran, so the two no longer agree, and every later step of
the session is refused until the session ends (which drops its index).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvservice.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    QuotaExceededError,
)
from kvservice.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvservice.core.offload_index import OFFLOAD_EVICTION_POLICIES, OffloadIndex, RequestAccess
from kvservice.core.retention_policy import check_priority
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.errors import OffloadTierStoppedError

MEDIUM_CPU = "CPU"
# An OffloadKey: a block hash (vLLM's: 32 bytes of sha256, or 8 of xxhash) and 4
# bytes of KV cache group.
GROUP_BYTES = 4
MAX_KEY_BYTES = 64 + GROUP_BYTES
MAX_ID_CHARS = 256
# Far past any host buffer (2^32 chunks of one 16-token block each, at 2 KiB a block,
# is 8 TiB), and small enough that every count stays exact.
MAX_CHUNKS = 2**32
_UNKNOWN_POSITION = -1


class OffloadCounters(Protocol):
    """Where the tiers count what they do (``KVCacheMetrics``)."""

    def record_offload_step(
        self, stored: int, failed: int, loaded: int, evicted: int, chunk_bytes: int
    ) -> None: ...

    def record_offload_usage(self, chunks_used: int, chunks: int, tiers: int) -> None: ...


def build_index(config: pb.OffloadTierConfig) -> OffloadIndex:
    """The index ``config`` describes; InvalidArgumentError names a bad field."""
    if not 1 <= config.num_chunks <= MAX_CHUNKS:
        raise InvalidArgumentError(
            f"config.num_chunks must be in [1, {MAX_CHUNKS}], got {config.num_chunks}"
        )
    if config.eviction_policy not in OFFLOAD_EVICTION_POLICIES:
        raise InvalidArgumentError(
            f"config.eviction_policy {config.eviction_policy!r} is not one the offload "
            f"index has; choose one of {list(OFFLOAD_EVICTION_POLICIES)}"
        )
    if config.store_threshold < 0 or config.max_tracker_size < 1:
        raise InvalidArgumentError(
            "config.store_threshold must be >= 0 and config.max_tracker_size >= 1, got "
            f"{config.store_threshold} and {config.max_tracker_size}"
        )
    if config.bytes_per_chunk < 0:
        raise InvalidArgumentError(
            f"config.bytes_per_chunk must be >= 0, got {config.bytes_per_chunk}"
        )
    priority = config.eviction_policy == "priority"
    if config.max_pinned_chunks and not priority:
        raise InvalidArgumentError(
            "config.max_pinned_chunks is for the 'priority' policy only; this tier runs "
            f"{config.eviction_policy!r}"
        )
    return OffloadIndex(
        config.num_chunks,
        config.eviction_policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
        enable_events=config.enable_events,
        max_pinned_chunks=config.max_pinned_chunks if priority else None,
    )


# -- checking a message before anything runs ------------------------------------------


def _check_keys(where: str, keys: Sequence[bytes]) -> None:
    for key in keys:
        if not GROUP_BYTES < len(key) <= MAX_KEY_BYTES:
            raise InvalidArgumentError(
                f"{where}: an offload key is a block hash and 4 bytes of KV cache group "
                f"({GROUP_BYTES + 1}-{MAX_KEY_BYTES} bytes), got {len(key)} bytes"
            )


def _check_id(where: str, name: str, value: str) -> None:
    if not value or len(value) > MAX_ID_CHARS:
        raise InvalidArgumentError(
            f"{where}: {name} must be 1-{MAX_ID_CHARS} characters, got {len(value)}"
        )


def _check_positions(where: str, keys: Sequence[bytes], positions: Sequence[int]) -> None:
    if positions and len(positions) != len(keys):
        raise InvalidArgumentError(
            f"{where}: {len(positions)} positions for {len(keys)} keys (one each, or none)"
        )
    if any(position < _UNKNOWN_POSITION for position in positions):
        raise InvalidArgumentError(f"{where}: a position is >= 0, or -1 for unknown")


def _check_ids(where: str, ids: Sequence[int]) -> None:
    if any(chunk_id < 0 for chunk_id in ids):
        raise InvalidArgumentError(f"{where}: chunk ids are >= 0")


def _check_time(where: str, name: str, seconds: float) -> None:
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"{where}: {name} must be finite and >= 0, got {seconds}")


# The operations that name chunks by their keys (``keys``).
_KEYED = frozenset(
    {
        "prepare_load",
        "prepare_store",
        "complete_load",
        "complete_store",
        "touch",
        "pin",
        "request_finished",
    }
)


def check_operation(index: int, op: pb.OffloadOperation) -> None:
    """INVALID_ARGUMENT for a malformed operation, naming it by its place."""
    kind = op.WhichOneof("op")
    where = f"ops[{index}] ({kind})"
    if kind is None:
        raise InvalidArgumentError(f"ops[{index}] sets no operation")
    body = getattr(op, kind)
    if kind in ("new_request", "prepare_load", "prepare_store", "request_finished"):
        _check_id(where, "request_id", body.request_id)
    if kind in ("pin", "unpin"):
        _check_id(where, "pin_id", body.pin_id)
    if kind in _KEYED:
        _check_keys(where, body.keys)
    if kind in ("prepare_load", "prepare_store"):
        _check_positions(where, body.keys, body.positions)
        _check_ids(where, body.chunk_ids)
    if kind == "prepare_store":
        _check_keys(where, body.keys_to_store)
        _check_keys(where, body.evicted_keys)
    if kind == "new_request":
        check_priority(body.priority, where)
    if kind == "pin":
        _check_time(where, "ttl_seconds", body.ttl_seconds)
        _check_time(where, "now_seconds", body.now_seconds)
    if kind == "expire_pins":
        _check_time(where, "now_seconds", body.now_seconds)


# -- one engine's tier ----------------------------------------------------------------


class DivergedError(Exception):
    """An operation the server's index refused or answered otherwise than the replica."""


@dataclass
class _Request:
    access: RequestAccess
    positions: dict[bytes, int] = field(default_factory=dict)


@dataclass
class StepTally:
    """What one step did to a tier, for the metrics."""

    stored: int = 0
    failed: int = 0
    loaded: int = 0
    evicted: int = 0


class OffloadTier:
    """One engine's index and the requests its replica announced."""

    def __init__(self, config: pb.OffloadTierConfig) -> None:
        # A copy: the request that carried it belongs to gRPC.
        self.config = pb.OffloadTierConfig()
        self.config.CopyFrom(config)
        self.index = build_index(config)
        self.requests: dict[str, _Request] = {}
        # Why the index stopped (an operation diverged); None while it runs.
        self.stopped: str | None = None

    @property
    def num_chunks_used(self) -> int:
        return self.index.num_chunks - self.index.num_free_chunks

    def run(self, op: pb.OffloadOperation, tally: StepTally) -> None:
        """Run ``op``; ``DivergedError`` if the index refuses it or answers otherwise."""
        kind = op.WhichOneof("op")
        assert kind is not None
        _RUNNERS[kind](self, getattr(op, kind), tally)

    def _request(self, request_id: str) -> _Request:
        request = self.requests.get(request_id)
        if request is None or not self.index.is_current(request.access):
            raise DivergedError(
                f"request {request_id!r} was not announced (new_request) since the "
                "tier's last reset"
            )
        return request

    def _with_positions(self, body: Any) -> _Request:
        request = self._request(body.request_id)
        if body.positions:
            for key, position in zip(body.keys, body.positions, strict=True):
                if position != _UNKNOWN_POSITION:
                    request.positions[key] = position
        return request

    def _new_request(self, body: pb.OffloadNewRequest, tally: StepTally) -> None:
        old = self.requests.get(body.request_id)
        if old is not None and self.index.is_current(old.access):
            raise DivergedError(f"request {body.request_id!r} was announced already")
        positions: dict[bytes, int] = {}
        access = self.index.request_access(positions.get, body.priority)
        self.requests[body.request_id] = _Request(access, positions)

    def _prepare_load(self, body: pb.OffloadPrepareLoad, tally: StepTally) -> None:
        request = self._with_positions(body)
        chunk_ids = _refusal_diverges(
            lambda: self.index.prepare_load(list(body.keys), request.access)
        )
        _same("chunk ids", chunk_ids, list(body.chunk_ids))
        tally.loaded += len(chunk_ids)

    def _prepare_store(self, body: pb.OffloadPrepareStore, tally: StepTally) -> None:
        request = self._with_positions(body)
        plan = self.index.prepare_store(list(body.keys), request.access)
        if plan is None or body.no_room:
            _same("no room", plan is None, body.no_room)
            return
        _same("keys to store", plan.keys_to_store, list(body.keys_to_store))
        _same("chunk ids", plan.chunk_ids, list(body.chunk_ids))
        _same("evicted keys", plan.evicted_keys, list(body.evicted_keys))
        tally.evicted += len(plan.evicted_keys)

    def _touch(self, body: pb.OffloadKeys, tally: StepTally) -> None:
        self.index.touch(list(body.keys))

    def _complete_load(self, body: pb.OffloadKeys, tally: StepTally) -> None:
        _refusal_diverges(lambda: self.index.complete_load(list(body.keys)))

    def _complete_store(self, body: pb.OffloadCompleteStore, tally: StepTally) -> None:
        done = self.index.complete_store(list(body.keys), body.success)
        if body.success:
            tally.stored += len(done)
        else:
            tally.failed += len(done)

    def _request_finished(self, body: pb.OffloadRequestFinished, tally: StepTally) -> None:
        request = self.requests.pop(body.request_id, None)
        keys = [] if request is None else self.index.request_finished(request.access)
        _same("keys", keys, list(body.keys))

    def _pin(self, body: pb.OffloadPin, tally: StepTally) -> None:
        ttl_s = body.ttl_seconds or None
        try:
            self.index.pin(body.pin_id, list(body.keys), ttl_s, body.now_seconds)
            refused = False
        except QuotaExceededError:
            refused = True
        except KVCacheError as error:
            raise DivergedError(str(error)) from None
        _same("refused", refused, body.refused)

    def _unpin(self, body: pb.OffloadUnpin, tally: StepTally) -> None:
        removed = _refusal_diverges(lambda: self.index.unpin(body.pin_id))
        _same("removed", removed, body.removed)

    def _expire_pins(self, body: pb.OffloadExpirePins, tally: StepTally) -> None:
        _same("expired pins", self.index.expire_pins(body.now_seconds), body.num_expired)

    def _reset(self, body: pb.OffloadReset, tally: StepTally) -> None:
        # Requests go stale with the reset (the index's generation): new_request again.
        self.index.reset()

    def take_events(self) -> list[KVCacheEvent]:
        """The index's stored and removed chunks as KV events, medium "CPU", one per
        KV cache group of each (a failed store's keys only if no retry stored them)."""
        events: list[KVCacheEvent] = []
        for event in self.index.take_events():
            keys = event.keys
            if event.metadata_only:
                keys = [key for key in keys if not self.index.is_stored(key)]
            for group, hashes in _by_group(keys).items():
                if event.removed:
                    events.append(BlockRemoved(hashes, MEDIUM_CPU, group_idx=group))
                else:
                    events.append(
                        BlockStored(hashes, None, [], 0, None, MEDIUM_CPU, group_idx=group)
                    )
        return events


def _by_group(keys: Sequence[bytes]) -> dict[int, list[bytes]]:
    groups: dict[int, list[bytes]] = {}
    for key in keys:
        group = int.from_bytes(key[-GROUP_BYTES:], "big")
        groups.setdefault(group, []).append(key[:-GROUP_BYTES])
    return groups


def _refusal_diverges(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except KVCacheError as error:
        raise DivergedError(f"the index refused it: {error}") from None


def _same(what: str, server: Any, replica: Any) -> None:
    if server != replica:
        raise DivergedError(
            f"the server's index answered {what} {server!r}; the replica {replica!r}"
        )


_RUNNERS: dict[str, Callable[[OffloadTier, Any, StepTally], None]] = {
    "new_request": OffloadTier._new_request,
    "prepare_load": OffloadTier._prepare_load,
    "prepare_store": OffloadTier._prepare_store,
    "touch": OffloadTier._touch,
    "complete_load": OffloadTier._complete_load,
    "complete_store": OffloadTier._complete_store,
    "request_finished": OffloadTier._request_finished,
    "pin": OffloadTier._pin,
    "unpin": OffloadTier._unpin,
    "expire_pins": OffloadTier._expire_pins,
    "reset": OffloadTier._reset,
}


# -- every engine's -------------------------------------------------------------------


class OffloadTiers:
    """The tiers of every session; ``step`` serves ``OffloadStep``.

    ``max_ops``: operations one message may carry; ``publish``: where the tiers' KV
    events go (None: the server runs without --kv-events); ``counters``: the metrics.
    """

    def __init__(
        self,
        max_ops: int,
        publish: Callable[[Sequence[KVCacheEvent]], None] | None = None,
        counters: OffloadCounters | None = None,
    ) -> None:
        self._max_ops = max_ops
        self._publish = publish
        self._counters = counters
        self._tiers: dict[str, OffloadTier] = {}

    def __len__(self) -> int:
        return len(self._tiers)

    def session_ended(self, session_id: str) -> None:
        """Drop the session's tier, if it has one (``SessionRegistry``'s end hook)."""
        if self._tiers.pop(session_id, None) is not None:
            self._report_usage()

    def _report_usage(self) -> None:
        if self._counters is not None:
            tiers = self._tiers.values()
            self._counters.record_offload_usage(
                sum(tier.num_chunks_used for tier in tiers),
                sum(tier.index.num_chunks for tier in tiers),
                len(tiers),
            )

    def step(
        self, session_id: str | None, request: pb.OffloadStepRequest
    ) -> pb.OffloadStepResponse:
        """Run one message's operations on the caller's session's tier (see the module
        docstring)."""
        tier = self._tier(session_id, request)
        tally = StepTally()
        try:
            for index, op in enumerate(request.ops):
                try:
                    tier.run(op, tally)
                except DivergedError as error:
                    tier.stopped = f"ops[{index}] ({op.WhichOneof('op')}): {error}"
                    raise OffloadTierStoppedError(
                        f"the offload tier's index stopped at {tier.stopped}. The engine's "
                        "replica and the server no longer agree: stop the engine (is another "
                        "client using this session?)"
                    ) from None
        finally:
            self._report(tier, tally)
        return pb.OffloadStepResponse(
            num_ops=len(request.ops), num_chunks_used=tier.num_chunks_used
        )

    def _tier(self, session_id: str | None, request: pb.OffloadStepRequest) -> OffloadTier:
        if session_id is None:
            raise FailedPreconditionError(
                "OffloadStep needs a client session (OpenSession, then x-kvservice-session): "
                "the offload tier's index is the session's engine's"
            )
        if len(request.ops) > self._max_ops:
            raise InvalidArgumentError(
                f"OffloadStep carries {len(request.ops)} operations; the server takes at most "
                f"{self._max_ops} (--max-step-ops)"
            )
        for index, op in enumerate(request.ops):
            check_operation(index, op)
        tier = self._tiers.get(session_id)
        if tier is None:
            tier = OffloadTier(request.config)
            self._tiers[session_id] = tier
            return tier
        if tier.stopped is not None:
            raise FailedPreconditionError(
                f"this session's offload index stopped at {tier.stopped}; open a new session"
            )
        if request.config != tier.config:
            raise FailedPreconditionError(
                "OffloadStep's config differs from the one this session's offload index "
                "was built with; an index's config never changes (open a new session)"
            )
        return tier

    def _report(self, tier: OffloadTier, tally: StepTally) -> None:
        events = tier.take_events()
        if events and self._publish is not None:
            self._publish(events)
        if self._counters is not None:
            self._counters.record_offload_step(
                tally.stored, tally.failed, tally.loaded, tally.evicted, tier.config.bytes_per_chunk
            )
            self._report_usage()

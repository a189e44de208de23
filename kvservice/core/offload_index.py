"""The index of a CPU offload tier: which KV chunks the tier holds, in which slot of the
workers' host buffer, who is reading or writing them, and which to evict.

vLLM's offloading connector asks its ``OffloadingManager`` these questions from the
scheduler (kvservice's vLLM integration adapts this class to it). With
the ``lru`` and ``arc`` policies every answer is the one vLLM 0.33's
``CPUOffloadingManager`` gives: the same hits, the same evictions in the same order,
and the same chunk ids (fresh ids first, then the most recently freed), so the workers'
host buffer, which vLLM's CPU worker indexes by chunk id, stays valid. The ``priority``
policy is kvservice's: a chunk keeps the retention priority of the request that stored
or reused it, lower priorities are evicted first (LRU within a priority), and pins with
a TTL hold chunks from eviction altogether.

Keys are vLLM's ``OffloadKey`` bytes: ``block hash ‖ KV cache group (4 bytes, big
endian)``. Time never comes from a clock here: callers pass ``now``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvservice.core.errors import InvalidArgumentError, QuotaExceededError
from kvservice.core.kv_cache_block import DEFAULT_PRIORITY, get_group_id
from kvservice.core.retention_policy import check_duration, check_priority

OFFLOAD_EVICTION_POLICIES: Final = ("lru", "arc", "priority")

# ``OffloadIndex.lookup``'s answers.
LOOKUP_MISS: Final = 0
LOOKUP_HIT: Final = 1
LOOKUP_HIT_PENDING: Final = 2

# A request's token position of a key's end (None: unknown), as the scheduler records it.
PositionOf = Callable[[bytes], int | None]
# The recency policies' heap entry: (priority and rank packed in one int, key).
_Entry = tuple[int, bytes]
# A rank ``(rank, -position)`` packed in one int of the same order: ``BASE - position``
# in the low bits (a later position sorts first, a key without one, position 0, last),
# the priority above the rank. One int compares faster than a tuple, and the heap
# compares on every step.
_POSITION_BITS: Final = 48
_POSITION_BASE: Final = 1 << (_POSITION_BITS - 1)
_LEVEL_SHIFT: Final = 128


class Chunk:
    """One slot of the tier's host buffer: ``chunk_id`` indexes the workers' buffer;
    ``ref_cnt`` is -1 while the chunk's store is in flight, else the loads reading it."""

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class RequestAccess:
    """One request's dealings with the tier, kept between its calls (the adapter keeps
    it on vLLM's ``ReqContext``): the keys it saw, by KV cache group in first-seen
    order; which it stored and which it reused; its retention priority. A reset of the
    tier makes it stale (``OffloadIndex.is_current``)."""

    def __init__(
        self, owner: object, generation: int, position_of: PositionOf, priority: int
    ) -> None:
        self.owner = owner
        self.generation = generation
        self.position_of = position_of
        self.priority = priority
        self.key_groups: dict[int, list[bytes]] = {}
        self.seen_keys: set[bytes] = set()
        self.inserted_keys: set[bytes] = set()
        self.reused_keys: set[bytes] = set()
        self.store_miss_keys: set[bytes] = set()
        self.finished = False
        # The recency rank all of this request's keys share until it finishes (LRU).
        self.recency_rank: int | None = None

    def ordered_keys(self) -> list[bytes]:
        """Every key seen, head to tail: by position where every key has one, else
        group by group (each group by position where all of its keys have one)."""
        keys: list[bytes] = []
        positions: dict[bytes, int] = {}
        all_known = True
        for group in sorted(self.key_groups):
            group_keys = self.key_groups[group]
            known = True
            for key in group_keys:
                position = self.position_of(key)
                if position is None:
                    known = False
                else:
                    positions[key] = position
            keys.extend(sorted(group_keys, key=positions.__getitem__) if known else group_keys)
            all_known = all_known and known
        # A stable sort: keys of one position keep their groups' order.
        if all_known and len(self.key_groups) > 1:
            keys.sort(key=positions.__getitem__)
        return keys


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What ``prepare_store`` decided: the keys to write, into which chunks (in the same
    order), and the keys evicted to make room."""

    keys_to_store: list[bytes]
    chunk_ids: list[int]
    evicted_keys: list[bytes]


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """Keys stored (``removed`` False) or removed. ``metadata_only``: a failed store's
    keys, dropped before anyone could read them (not an eviction)."""

    keys: list[bytes]
    removed: bool
    metadata_only: bool = False


@dataclass(frozen=True, slots=True)
class IndexStats:
    """The tier's gauges now, and what happened since the last ``take_stats``:
    ``allocation_sizes`` one per ``prepare_store`` with keys to store (refused ones
    too, as vLLM counts them), ``stores_skipped`` the keys offered under the store
    threshold (None: no threshold)."""

    usage: float
    write_usage: float
    read_usage: float
    allocation_sizes: list[int]
    stores_skipped: int | None


@dataclass(slots=True)
class PinCounters:
    """Pins since start, for metrics."""

    created: int = 0
    expired: int = 0
    removed: int = 0
    refused: int = 0


# -- eviction policies -----------------------------------------------------------------


class _Policy:
    """Where the resident chunks live and which to evict; the index does the
    bookkeeping around it (ref counts, the chunk pool, events)."""

    def get(self, key: bytes) -> Chunk | None:
        raise NotImplementedError

    def resident(self) -> Iterator[tuple[bytes, Chunk]]:
        raise NotImplementedError

    def insert(self, key: bytes, chunk: Chunk, req: RequestAccess) -> None:
        raise NotImplementedError

    def remove(self, key: bytes) -> None:
        raise NotImplementedError

    def touch(self, keys: list[bytes]) -> None:
        raise NotImplementedError

    def on_store_miss(self, keys: list[bytes]) -> None:
        """Keys about to be stored that the tier does not hold (once per request)."""

    def on_request_access(self, keys: list[bytes], req: RequestAccess) -> None:
        """Keys a request sees for the first time (resident or not)."""

    def on_request_finished(
        self, keys: list[bytes], insertion_only: set[bytes], reused: set[bytes]
    ) -> None:
        raise NotImplementedError

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Chunk]] | None:
        """Exactly ``n`` idle chunks outside ``protected``, or None (nothing changed)."""
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def mark_evictable(self, key: bytes) -> None:
        """The chunk's ref count fell to 0."""

    def mark_non_evictable(self, key: bytes) -> None:
        """The chunk's ref count rose from 0."""


class _RecencyPolicy(_Policy):
    """vLLM's offload LRU: recency is a rank, independent of transfers in flight.

    A key's rank is ``(rank, -position)``: a request shares one rank across its steps,
    its later chunks before its earlier ones (so a prefix's tail goes first); a store
    without a position or a touch takes a fresh rank. Idle chunks sit in a min-heap of
    lazily invalidated entries: an entry is current while its key is idle and the entry
    matches the key's rank, so eviction takes the smallest ``(rank, key)``. Ranks are
    kept packed (``_pack``).
    """

    def __init__(self) -> None:
        self.chunks: dict[bytes, Chunk] = {}
        self.ranks: dict[bytes, int] = {}
        self.evictable: set[bytes] = set()
        self.heap: list[_Entry] = []
        self.next_rank = 0

    def _entry(self, key: bytes) -> _Entry:
        return (self.ranks[key], key)

    def _is_current(self, entry: _Entry) -> bool:
        key = entry[1]
        return key in self.evictable and entry[0] == self.ranks[key]

    def _pack(self, key: bytes, rank: int, position: int) -> int:
        """``(rank, -position)`` as one int of the same order (the priority policy adds
        its priority above)."""
        assert 0 <= position < _POSITION_BASE, f"position {position} out of range"
        return (rank << _POSITION_BITS) | (_POSITION_BASE - position)

    def _request_rank(self, req: RequestAccess) -> int:
        rank = req.recency_rank
        if rank is None:
            self.next_rank += 1
            rank = self.next_rank
            req.recency_rank = rank
        return rank

    def _push(self, keys: list[bytes]) -> None:
        if not keys:
            return
        # A long prefix re-ranked at once: one heapify beats k pushes.
        if len(keys) >= max(64, len(self.evictable) // 4):
            self._rebuild()
            return
        for key in keys:
            heapq.heappush(self.heap, self._entry(key))
        self._maybe_compact()

    def _rebuild(self) -> None:
        self.heap = [self._entry(key) for key in self.evictable]
        heapq.heapify(self.heap)

    def _maybe_compact(self) -> None:
        if len(self.heap) > 2 * len(self.evictable) + 64:
            self._rebuild()

    def _renew(self, keys: Iterable[bytes]) -> None:
        """A fresh rank for each resident key, in the order given (the last, newest)."""
        moved: list[bytes] = []
        for key in keys:
            if key in self.chunks:
                self.next_rank += 1
                self.ranks[key] = self._pack(key, self.next_rank, 0)
                if key in self.evictable:
                    moved.append(key)
        self._push(moved)

    def get(self, key: bytes) -> Chunk | None:
        return self.chunks.get(key)

    def resident(self) -> Iterator[tuple[bytes, Chunk]]:
        return iter(self.chunks.items())

    def insert(self, key: bytes, chunk: Chunk, req: RequestAccess) -> None:
        self.chunks[key] = chunk
        position = req.position_of(key)
        if position is None:
            self.next_rank += 1
            self.ranks[key] = self._pack(key, self.next_rank, 0)
        else:
            self.ranks[key] = self._pack(key, self._request_rank(req), position)

    def remove(self, key: bytes) -> None:
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: list[bytes]) -> None:
        self._renew(reversed(keys))

    def on_request_access(self, keys: list[bytes], req: RequestAccess) -> None:
        rank = self._request_rank(req)
        moved: list[bytes] = []
        for key in keys:
            position = req.position_of(key)
            if position is None or key not in self.chunks:
                continue
            # Only ever forward: a key seen again later in the request keeps its place.
            ranked = self._pack(key, rank, position)
            if self.ranks[key] >= ranked:
                continue
            self.ranks[key] = ranked
            if key in self.evictable:
                moved.append(key)
        self._push(moved)

    def on_request_finished(
        self, keys: list[bytes], insertion_only: set[bytes], reused: set[bytes]
    ) -> None:
        self._renew(reversed(keys))

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Chunk]] | None:
        if n == 0:
            return []
        chosen: list[_Entry] = []
        chosen_keys: set[bytes] = set()
        skipped: list[_Entry] = []
        while self.heap and len(chosen) < n:
            entry = heapq.heappop(self.heap)
            key = entry[1]
            # A key re-ranked to the same rank can have two equal entries: take it once.
            if not self._is_current(entry) or key in chosen_keys:
                continue
            if key in protected:
                skipped.append(entry)
                continue
            chosen.append(entry)
            chosen_keys.add(key)
        if len(chosen) < n:
            skipped.extend(chosen)
            chosen = []
        for entry in skipped:
            heapq.heappush(self.heap, entry)
        if not chosen:
            return None
        return [self._drop(entry[1]) for entry in chosen]

    def _drop(self, key: bytes) -> tuple[bytes, Chunk]:
        chunk = self.chunks.pop(key)
        assert chunk.ref_cnt == 0, f"evicting chunk {chunk.chunk_id}, which is in use"
        del self.ranks[key]
        self.evictable.remove(key)
        return key, chunk

    def clear(self) -> None:
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self.heap.clear()
        self.next_rank = 0

    def mark_evictable(self, key: bytes) -> None:
        self.evictable.add(key)
        heapq.heappush(self.heap, self._entry(key))
        self._maybe_compact()

    def mark_non_evictable(self, key: bytes) -> None:
        self.evictable.discard(key)


class _PriorityPolicy(_RecencyPolicy):
    """The recency policy with a priority before the rank: every idle chunk of a lower
    priority goes before any of a higher one, LRU within a priority. A chunk takes the
    priority of the request that stores it, raised by any request reusing it. Chunks a
    pin holds are never idle. With every chunk at one priority and no pins the order is
    exactly the LRU policy's."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: dict[bytes, int] = {}
        # Key -> how many pins hold it (resident or not: a chunk stored later is held).
        self.pin_counts: dict[bytes, int] = {}

    def _pack(self, key: bytes, rank: int, position: int) -> int:
        return (self.levels[key] << _LEVEL_SHIFT) | super()._pack(key, rank, position)

    def insert(self, key: bytes, chunk: Chunk, req: RequestAccess) -> None:
        self.levels[key] = req.priority
        super().insert(key, chunk, req)

    def remove(self, key: bytes) -> None:
        super().remove(key)
        del self.levels[key]

    def on_request_access(self, keys: list[bytes], req: RequestAccess) -> None:
        raised: list[bytes] = []
        for key in keys:
            level = self.levels.get(key)
            if level is not None and req.priority > level:
                self.levels[key] = req.priority
                rank = self.ranks[key] & ((1 << _LEVEL_SHIFT) - 1)
                self.ranks[key] = (req.priority << _LEVEL_SHIFT) | rank
                if key in self.evictable:
                    raised.append(key)
        self._push(raised)
        super().on_request_access(keys, req)

    def _drop(self, key: bytes) -> tuple[bytes, Chunk]:
        del self.levels[key]
        return super()._drop(key)

    def clear(self) -> None:
        # Pins outlive a reset: they name keys, which may be stored again.
        super().clear()
        self.levels.clear()

    def mark_evictable(self, key: bytes) -> None:
        if key not in self.pin_counts:
            super().mark_evictable(key)

    def hold(self, key: bytes) -> None:
        count = self.pin_counts.get(key, 0)
        self.pin_counts[key] = count + 1
        if count == 0:
            self.evictable.discard(key)

    def release(self, key: bytes) -> None:
        count = self.pin_counts[key] - 1
        if count:
            self.pin_counts[key] = count
            return
        del self.pin_counts[key]
        chunk = self.chunks.get(key)
        if chunk is not None and chunk.ref_cnt == 0:
            self.mark_evictable(key)


class _AdaptivePolicy(_Policy):
    """vLLM's offload ARC: T1 holds chunks used once, T2 chunks reused since; B1 and B2
    remember what each evicted. A store that B1 remembers grows T1's target size, one
    that B2 remembers shrinks it; eviction takes from T1 while it is at least its
    target, else from T2 (from the other when one has no idle chunk)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1_size = 0.0
        self.t1: OrderedDict[bytes, Chunk] = OrderedDict()
        self.t2: OrderedDict[bytes, Chunk] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> Chunk | None:
        chunk = self.t1.get(key)
        return chunk if chunk is not None else self.t2.get(key)

    def resident(self) -> Iterator[tuple[bytes, Chunk]]:
        yield from self.t1.items()
        yield from self.t2.items()

    def insert(self, key: bytes, chunk: Chunk, req: RequestAccess) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _learn_from_ghost(self, key: bytes) -> None:
        if key in self.b1:
            step = max(1.0, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + step, float(self.capacity))
            self.b1.move_to_end(key)
        elif key in self.b2:
            step = max(1.0, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - step, 0.0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            self._learn_from_ghost(key)

    def touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            chunk = self.t1.pop(key, None)
            if chunk is not None:
                # A chunk still being written was not used twice: it stays in T1.
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._learn_from_ghost(key)

    def on_request_finished(
        self, keys: list[bytes], insertion_only: set[bytes], reused: set[bytes]
    ) -> None:
        for key in reversed(keys):
            if key in insertion_only:
                # Storing is no reuse: recency only, T1 stays T1.
                self._refresh(key)
            elif key in reused:
                chunk = self.t1.pop(key, None)
                if chunk is not None:
                    self.t2[key] = chunk
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def _refresh(self, key: bytes) -> None:
        if key in self.t1:
            self.t1.move_to_end(key)
        elif key in self.t2:
            self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Chunk]] | None:
        if n == 0:
            return []
        # Both lists are scanned once, oldest first: choosing the n victims never
        # restarts a scan, and nothing changes until all n are found.
        t1_scan = iter(self.t1.items())
        t2_scan = iter(self.t2.items())
        target = int(self.target_t1_size)
        t1_size = len(self.t1)
        chosen: list[tuple[bytes, Chunk, bool]] = []
        for _ in range(n):
            victim = _next_idle(t1_scan, protected) if t1_size >= target else None
            from_t1 = victim is not None
            if victim is None:
                victim = _next_idle(t2_scan, protected)
            if victim is None:
                victim = _next_idle(t1_scan, protected)
                from_t1 = True
            if victim is None:
                return None
            if from_t1:
                t1_size -= 1
            chosen.append((victim[0], victim[1], from_t1))
        return self._apply_evictions(chosen)

    def _apply_evictions(
        self, chosen: list[tuple[bytes, Chunk, bool]]
    ) -> list[tuple[bytes, Chunk]]:
        for key, _, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return [(key, chunk) for key, chunk, _ in chosen]

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0


def _next_idle(
    scan: Iterator[tuple[bytes, Chunk]], protected: set[bytes]
) -> tuple[bytes, Chunk] | None:
    for key, chunk in scan:
        if chunk.ref_cnt == 0 and key not in protected:
            return key, chunk
    return None


def _make_policy(name: str, capacity: int) -> _Policy:
    if name == "lru":
        return _RecencyPolicy()
    if name == "arc":
        return _AdaptivePolicy(capacity)
    if name == "priority":
        return _PriorityPolicy()
    raise InvalidArgumentError(
        f"offload eviction policy {name!r} is unknown; choose one of "
        f"{list(OFFLOAD_EVICTION_POLICIES)}"
    )


# -- the store threshold ---------------------------------------------------------------


class _OfferTracker:
    """How often each key was offered for storing, for the newest ``max_size`` keys: a
    key is stored only once offered ``store_threshold`` times."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.counts: OrderedDict[bytes, int] = OrderedDict()

    def record(self, keys: list[bytes]) -> None:
        counts = self.counts
        offered_again: set[bytes] = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                offered_again.add(key)
        # A full tracker drops its oldest key for a new one, never a key of this offer.
        num_droppable = len(counts) - len(offered_again)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_size:
                if num_droppable == 0:
                    continue
                counts.popitem(last=False)
                num_droppable -= 1
            counts[key] = 1


# -- pins ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pin:
    pin_id: str
    keys: tuple[bytes, ...]
    expires_at: float | None
    serial: int


@dataclass(slots=True)
class _Pins:
    """The pins of a priority index and their deadlines (stale entries skipped)."""

    max_chunks: int
    by_id: dict[str, _Pin] = field(default_factory=dict)
    deadlines: list[tuple[float, int, str]] = field(default_factory=list)
    num_reserved: int = 0
    next_serial: int = 0
    counters: PinCounters = field(default_factory=PinCounters)


# -- the index -------------------------------------------------------------------------


class OffloadIndex:
    """A CPU offload tier's chunk pool, ref counts and eviction policy.

    ``num_chunks`` slots; ``policy`` one of ``OFFLOAD_EVICTION_POLICIES``;
    ``store_threshold`` >= 2: a key is stored only on its that-many-th offer, counted
    for the newest ``max_tracker_size`` keys; ``enable_events``: keep the stored and
    removed keys for ``take_events``; ``max_pinned_chunks`` (priority only, default
    ``num_chunks``): what pins may hold together.

    Every method taking a ``RequestAccess`` needs a current one (``request_access``,
    ``is_current``).
    """

    def __init__(
        self,
        num_chunks: int,
        policy: str = "lru",
        *,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        enable_events: bool = False,
        max_pinned_chunks: int | None = None,
    ) -> None:
        if num_chunks < 0:
            raise InvalidArgumentError(f"num_chunks must be >= 0, got {num_chunks}")
        self.num_chunks = num_chunks
        self.policy_name = policy
        self._policy = _make_policy(policy, num_chunks)
        self._num_allocated = 0
        self._free_list: list[int] = []
        self._num_evictable = 0
        self._num_write_pending = 0
        self._generation = 0
        self._events: list[IndexEvent] | None = [] if enable_events else None
        self.store_threshold = store_threshold
        self._tracker = _OfferTracker(max_tracker_size) if store_threshold >= 2 else None
        self._stores_skipped = 0
        self._allocation_sizes: list[int] = []
        self._pins = self._make_pins(max_pinned_chunks)

    def _make_pins(self, max_pinned_chunks: int | None) -> _Pins | None:
        if not isinstance(self._policy, _PriorityPolicy):
            return None
        limit = self.num_chunks if max_pinned_chunks is None else max_pinned_chunks
        if not 0 <= limit <= self.num_chunks:
            raise InvalidArgumentError(
                f"max_pinned_chunks must be in [0, {self.num_chunks}] (the tier's chunks), "
                f"got {limit}"
            )
        return _Pins(limit)

    # -- requests --

    def request_access(
        self, position_of: PositionOf, priority: int = DEFAULT_PRIORITY
    ) -> RequestAccess:
        """A new request's state (``priority``: its chunks' retention priority, read by
        the priority policy only)."""
        check_priority(priority, "offload request")
        return RequestAccess(self, self._generation, position_of, priority)

    def is_current(self, req: RequestAccess | None) -> bool:
        """Whether ``req`` belongs to this index since its last reset."""
        return req is not None and req.owner is self and req.generation == self._generation

    def _observe(self, keys: Iterable[bytes], req: RequestAccess, reused: Sequence[bytes]) -> None:
        new_keys: list[bytes] = []
        for key in keys:
            if key in req.seen_keys:
                continue
            assert not req.finished, "a finished request saw new keys"
            req.key_groups.setdefault(get_group_id(key), []).append(key)
            req.seen_keys.add(key)
            new_keys.append(key)
        if new_keys:
            self._policy.on_request_access(new_keys, req)
        # Reading back a chunk this request stored is a transfer, not a second access.
        for key in reused:
            if key not in req.inserted_keys:
                req.reused_keys.add(key)

    def request_finished(self, req: RequestAccess) -> list[bytes]:
        """The request is done: its accesses count (recency, ARC's reuse). Returns its
        keys head to tail; empty if it is stale or had finished."""
        if not self.is_current(req) or req.finished:
            return []
        req.finished = True
        keys = req.ordered_keys()
        self._policy.on_request_finished(keys, req.inserted_keys - req.reused_keys, req.reused_keys)
        return keys

    # -- lookups and loads --

    def lookup(self, key: bytes) -> int:
        chunk = self._policy.get(key)
        if chunk is None:
            return LOOKUP_MISS
        return LOOKUP_HIT if chunk.is_ready else LOOKUP_HIT_PENDING

    def prepare_load(self, keys: Sequence[bytes], req: RequestAccess) -> list[int]:
        """Hold ``keys`` (all stored) for reading until ``complete_load``; their chunk ids.
        InvalidArgumentError, nothing changed, if one is not readable."""
        chunks = [self._readable(key) for key in keys]
        for key, chunk in zip(keys, chunks, strict=True):
            if chunk.ref_cnt == 0:
                self._policy.mark_non_evictable(key)
                self._num_evictable -= 1
            chunk.ref_cnt += 1
        self._observe(keys, req, keys)
        return [chunk.chunk_id for chunk in chunks]

    def _readable(self, key: bytes) -> Chunk:
        chunk = self._policy.get(key)
        if chunk is None or not chunk.is_ready:
            state = "not stored" if chunk is None else "still being stored"
            raise InvalidArgumentError(f"cannot load offload key {key.hex()}: it is {state}")
        return chunk

    def touch(self, keys: Sequence[bytes]) -> None:
        self._policy.touch(list(keys))

    def complete_load(self, keys: Iterable[bytes]) -> None:
        """The loads of ``keys`` (one per listing) are done. InvalidArgumentError,
        nothing changed, for a key with fewer loads in flight than listed."""
        keys = list(keys)
        loads: dict[bytes, int] = {}
        for key in keys:
            loads[key] = loads.get(key, 0) + 1
        for key, count in loads.items():
            held = self._policy.get(key)
            if held is None or held.ref_cnt < count:
                raise InvalidArgumentError(
                    f"cannot complete {count} load(s) of offload key {key.hex()}: "
                    f"{0 if held is None else max(held.ref_cnt, 0)} in flight"
                )
        for key in keys:
            chunk = self._policy.get(key)
            assert chunk is not None
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable += 1
                self._policy.mark_evictable(key)

    # -- stores --

    def prepare_store(self, keys: Iterable[bytes], req: RequestAccess) -> StorePlan | None:
        """Chunks for the offered keys the tier lacks (those past the store threshold),
        evicting idle chunks for room; None when there is not enough room. Keys being
        stored stay unreadable until ``complete_store``."""
        offered = list(keys)
        if self._tracker is not None:
            self._tracker.record(offered)
        to_store, ready = self._partition(offered)
        self._note_store_misses(to_store, req)
        recorded = set(to_store)
        recorded.update(ready)
        self._observe([key for key in offered if key in recorded], req, ready)
        if not to_store:
            return StorePlan([], [], [])
        self._allocation_sizes.append(len(to_store))
        evicted = self._make_room(len(to_store), set(offered))
        if evicted is None:
            return None
        if evicted and self._events is not None:
            self._events.append(IndexEvent(evicted, removed=True))
        chunk_ids = self._allocate(len(to_store))
        for key, chunk_id in zip(to_store, chunk_ids, strict=True):
            self._policy.insert(key, Chunk(chunk_id), req)
        self._num_write_pending += len(to_store)
        req.inserted_keys.update(to_store)
        return StorePlan(to_store, chunk_ids, evicted)

    def _partition(self, offered: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """The keys to store (absent, and past the threshold) and the ready ones held."""
        to_store: list[bytes] = []
        ready: list[bytes] = []
        for key in offered:
            chunk = self._policy.get(key)
            if chunk is None:
                to_store.append(key)
            elif chunk.is_ready:
                ready.append(key)
        tracker = self._tracker
        if tracker is not None:
            wanted = [key for key in to_store if tracker.counts.get(key, 0) >= self.store_threshold]
            self._stores_skipped += len(to_store) - len(wanted)
            to_store = wanted
        return to_store, ready

    def _note_store_misses(self, to_store: list[bytes], req: RequestAccess) -> None:
        # Once per request and key: ARC learns from its ghost lists before the store
        # takes the key out of them.
        misses = [key for key in to_store if key not in req.store_miss_keys]
        if misses:
            self._policy.on_store_miss(misses)
            req.store_miss_keys.update(misses)

    def _make_room(self, n: int, protected: set[bytes]) -> list[bytes] | None:
        shortfall = n - self.num_free_chunks
        if shortfall <= 0:
            return []
        if shortfall > self._num_evictable:
            return None
        # The offer's own chunks stay: a key stored before must survive its re-offer.
        victims = self._policy.evict(shortfall, protected)
        if victims is None:
            return None
        self._num_evictable -= len(victims)
        self._free_list.extend(chunk.chunk_id for _, chunk in victims)
        return [key for key, _ in victims]

    def _allocate(self, n: int) -> list[int]:
        # Fresh ids first, then the most recently freed: vLLM's order, which its CPU
        # worker's buffer indexing relies on.
        num_fresh = min(n, self.num_chunks - self._num_allocated)
        chunk_ids = list(range(self._num_allocated, self._num_allocated + num_fresh))
        self._num_allocated += num_fresh
        for _ in range(n - num_fresh):
            chunk_ids.append(self._free_list.pop())
        return chunk_ids

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> list[bytes]:
        """Stores done: the keys become readable (``success``), or are dropped and their
        chunks freed. Keys not being stored are ignored; returns the others."""
        done: list[bytes] = []
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self._num_write_pending -= 1
            if success:
                chunk.ref_cnt = 0
                self._num_evictable += 1
                self._policy.mark_evictable(key)
            else:
                self._policy.remove(key)
                self._free_list.append(chunk.chunk_id)
            done.append(key)
        if done and self._events is not None:
            self._events.append(IndexEvent(done, removed=not success, metadata_only=not success))
        return done

    # -- the whole tier --

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_list) + self.num_chunks - self._num_allocated

    @property
    def num_allocated_chunks(self) -> int:
        """Chunk ids handed out so far (the free list holds those given back)."""
        return self._num_allocated

    def free_chunk_ids(self) -> list[int]:
        """The freed chunk ids, the next to be reused last."""
        return list(self._free_list)

    def chunk_table(self) -> dict[bytes, tuple[int, int]]:
        """Every resident key -> (chunk id, ref count)."""
        return {key: (chunk.chunk_id, chunk.ref_cnt) for key, chunk in self._policy.resident()}

    def is_stored(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` (being written or readable)."""
        return self._policy.get(key) is not None

    def reset(self) -> None:
        """Drop every chunk, whatever its state; requests' states go stale. Pins stay
        (they name keys)."""
        self._policy.clear()
        self._generation += 1
        self._num_evictable = 0
        self._num_write_pending = 0
        self._free_list.clear()
        self._num_allocated = 0

    def take_events(self) -> list[IndexEvent]:
        """The events since the last call (none unless ``enable_events``)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def take_stats(self) -> IndexStats:
        """Gauges now, and the counts since the last call."""
        num_used = self._num_allocated - len(self._free_list) - self._num_evictable
        usage = num_used / self.num_chunks if self.num_chunks > 0 else 0.0
        write_usage = self._num_write_pending / self.num_chunks if self.num_chunks > 0 else 0.0
        sizes, self._allocation_sizes = self._allocation_sizes, []
        skipped: int | None = None
        if self._tracker is not None:
            skipped, self._stores_skipped = self._stores_skipped, 0
        return IndexStats(usage, write_usage, max(usage - write_usage, 0.0), sizes, skipped)

    # -- pins (priority policy) --

    def _pinning(self) -> tuple[_PriorityPolicy, _Pins]:
        policy, pins = self._policy, self._pins
        if not isinstance(policy, _PriorityPolicy) or pins is None:
            raise InvalidArgumentError(
                f"pins need the 'priority' offload eviction policy; this tier runs "
                f"{self.policy_name!r}"
            )
        return policy, pins

    def pin(self, pin_id: str, keys: Sequence[bytes], ttl_s: float | None, now: float) -> None:
        """Hold ``keys`` from eviction until ``now + ttl_s`` (None: until ``unpin``),
        stored now or later. Pinning ``pin_id`` again replaces it. QuotaExceededError,
        nothing changed, past ``max_pinned_chunks`` (every pin counts all its keys)."""
        policy, pins = self._pinning()
        check_duration(ttl_s, f"pin {pin_id!r}")
        unique = tuple(dict.fromkeys(keys))
        old = pins.by_id.get(pin_id)
        reserved = pins.num_reserved - (len(old.keys) if old is not None else 0)
        if reserved + len(unique) > pins.max_chunks:
            pins.counters.refused += 1
            raise QuotaExceededError(
                f"pin {pin_id!r} needs {len(unique)} chunks, but pins already hold "
                f"{reserved} of the {pins.max_chunks} chunks the offload tier lets pins "
                "hold (max_pinned_chunks); unpin something or pin fewer chunks"
            )
        if old is not None:
            self._release(policy, pins, old)
        pins.next_serial += 1
        expires_at = None if ttl_s is None else now + ttl_s
        pin = _Pin(pin_id, unique, expires_at, pins.next_serial)
        for key in unique:
            policy.hold(key)
        pins.by_id[pin_id] = pin
        pins.num_reserved += len(unique)
        if expires_at is not None:
            heapq.heappush(pins.deadlines, (expires_at, pin.serial, pin_id))
        pins.counters.created += 1

    def unpin(self, pin_id: str) -> bool:
        """Let go of a pin; False if there is none of that id."""
        policy, pins = self._pinning()
        pin = pins.by_id.get(pin_id)
        if pin is None:
            return False
        self._release(policy, pins, pin)
        pins.counters.removed += 1
        return True

    def expire_pins(self, now: float) -> int:
        """Let go of the pins whose TTL ran out by ``now``; how many."""
        if self._pins is None:
            return 0
        policy, pins = self._pinning()
        expired = 0
        while pins.deadlines and pins.deadlines[0][0] <= now:
            _, serial, pin_id = heapq.heappop(pins.deadlines)
            pin = pins.by_id.get(pin_id)
            if pin is not None and pin.serial == serial:
                self._release(policy, pins, pin)
                expired += 1
        pins.counters.expired += expired
        return expired

    def _release(self, policy: _PriorityPolicy, pins: _Pins, pin: _Pin) -> None:
        del pins.by_id[pin.pin_id]
        pins.num_reserved -= len(pin.keys)
        for key in pin.keys:
            policy.release(key)

    def is_pinned(self, key: bytes) -> bool:
        policy = self._policy
        return isinstance(policy, _PriorityPolicy) and key in policy.pin_counts

    @property
    def pin_counters(self) -> PinCounters:
        return self._pinning()[1].counters

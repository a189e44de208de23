"""RetentionPolicy that vLLM's LRU lacks: eviction priorities and pinned prefixes.

Both are opt-in; a pool without them evicts exactly as vLLM 0.33.0 does.

- **Priorities** (TensorRT-LLM's ``KvCacheRetentionConfig`` shape): a request may give
  ranges of its prompt, and its decode blocks, a priority 0-100 (default 35) and a
  duration after which the priority reverts to the default. ``PriorityFreeQueue``
  evicts every free block of a lower priority before any of a higher one, LRU within a
  priority; blocks without a hash go first, as in vLLM.
- **Pins**: a tenant pins a token prefix, optionally for a TTL. A pin holds one
  reference on each cached block of the prefix (a block cached later joins the pin
  when it is cached), so a pinned block is never evicted and counts as used. The pool
  caps what pins may hold at a fraction of its blocks.
"""

from __future__ import annotations

import bisect
import heapq
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvservice.core.errors import InvalidArgumentError, QuotaExceededError
from kvservice.core.kv_cache_block import (
    DEFAULT_PRIORITY,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)

MIN_PRIORITY: Final = 0
MAX_PRIORITY: Final = 100
EVICTION_POLICIES = ("lru", "priority")


def check_priority(priority: int, what: str) -> None:
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidArgumentError(
            f"{what}: priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}"
        )


def check_duration(duration_s: float | None, what: str) -> None:
    if duration_s is not None and not duration_s > 0:
        raise InvalidArgumentError(
            f"{what}: duration must be positive seconds (or unset: no expiry), got {duration_s}"
        )


# Dynamo's cache_control TTL: a number and a unit (a bare number: seconds).
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float, what: str) -> float:
    """Seconds from a number or a string in Dynamo's ``cache_control`` form: ``"300"``,
    ``"300s"``, ``"5m"``, ``"1h"``, ``"250ms"``; InvalidArgumentError unless positive."""
    match = _DURATION.fullmatch(str(value).strip().lower())
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"] if match else 0.0
    if not 0 < seconds < float("inf"):
        raise InvalidArgumentError(
            f"{what}: {str(value)[:40]!r} is not a positive duration: write a number and a "
            f"unit, e.g. '300s', '5m' or '1h'"
        )
    return seconds


@dataclass(frozen=True)
class TokenRangeRetention:
    """Prompt tokens ``[start, end)`` (``end`` None: to the prompt's end) kept at
    ``priority`` for ``duration_s`` seconds after their blocks are cached (None: for as
    long as the blocks stay cached)."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def check(self) -> None:
        what = f"token range [{self.start}, {self.end})"
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise InvalidArgumentError(f"{what}: needs 0 <= start < end")
        check_priority(self.priority, what)
        check_duration(self.duration_s, what)


@dataclass(frozen=True)
class RetentionConfig:
    """A request's retention, as TensorRT-LLM's ``KvCacheRetentionConfig``: prompt
    ranges with a priority and duration, and one priority and duration for the blocks
    decoding fills. A block takes the highest priority of the ranges it overlaps."""

    token_ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        for token_range in self.token_ranges:
            token_range.check()
        check_priority(self.decode_priority, "decode")
        check_duration(self.decode_duration_s, "decode")

    def block_priority(
        self, start: int, end: int, num_prompt_tokens: int
    ) -> tuple[int, float | None]:
        """Priority and duration of the block of tokens ``[start, end)``."""
        if start >= num_prompt_tokens:
            return self.decode_priority, self.decode_duration_s
        best: tuple[int, float | None] = (DEFAULT_PRIORITY, None)
        found = False
        for r in self.token_ranges:
            r_end = num_prompt_tokens if r.end is None else r.end
            if r.start < end and start < r_end and (not found or r.priority > best[0]):
                best = (r.priority, r.duration_s)
                found = True
        return best


class PriorityFreeQueue(FreeKVCacheBlockQueue):
    """The free queue of the priority policy: one list, cut into levels by sentinels.

    ``head | unhashed blocks | S(p1) level p1 | S(p2) level p2 ... | tail`` with
    p1 < p2 < ...: popping from the front evicts every unhashed block, then every block
    of the lowest priority, LRU within a level. A level's sentinel appears the first
    time a block is queued at it and stays (at most 101), so a pop skips a bounded
    number of sentinels and every operation stays O(1) per block. With every hashed
    block at one priority the order is exactly the LRU queue's.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        super().__init__(blocks)
        self._levels: list[int] = []
        self._sentinels: dict[int, KVCacheBlock] = {}
        # Level -> the node its blocks are inserted before (the next level's sentinel).
        self._level_end: dict[int, KVCacheBlock] = {}

    def _end_of_level(self, priority: int) -> KVCacheBlock:
        end = self._level_end.get(priority)
        if end is None:
            end = self._add_level(priority)
        return end

    def _add_level(self, priority: int) -> KVCacheBlock:
        i = bisect.bisect_left(self._levels, priority)
        after = (
            self._sentinels[self._levels[i]] if i < len(self._levels) else self.fake_free_list_tail
        )
        sentinel = KVCacheBlock(block_id=-1)
        _link_before(after, sentinel)
        self._levels.insert(i, priority)
        self._sentinels[priority] = sentinel
        self._level_end[priority] = after
        if i > 0:
            self._level_end[self._levels[i - 1]] = sentinel
        return after

    def popleft(self) -> KVCacheBlock:
        if not self.num_free_blocks:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n, f"cannot pop {n} of {self.num_free_blocks} free blocks"
        ret: list[KVCacheBlock] = []
        curr = self.fake_free_list_head.next_free_block
        while len(ret) < n:
            assert curr is not None
            nxt = curr.next_free_block
            if curr.block_id >= 0:
                _unlink(curr)
                ret.append(curr)
            curr = nxt
        self.num_free_blocks -= n
        return ret

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put each block at the back of its priority's level (unhashed ones too: a
        block losing its hash keeps its place, as in the LRU queue)."""
        n = 0
        for block in blocks:
            _link_before(self._end_of_level(block.priority), block)
            n += 1
        self.num_free_blocks += n

    def requeue_at_front(self, block: KVCacheBlock) -> None:
        """Move a queued block to the front of its (new) priority's level: a block whose
        priority expired is the least recently used of the level it falls into."""
        _unlink(block)
        self._end_of_level(block.priority)  # make sure the level exists
        _link_after(self._sentinels[block.priority], block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            if curr.block_id >= 0:  # not a level's sentinel
                yield curr
            curr = curr.next_free_block


def _unlink(block: KVCacheBlock) -> None:
    prev, nxt = block.prev_free_block, block.next_free_block
    assert prev is not None and nxt is not None, f"block {block.block_id} is not queued"
    prev.next_free_block = nxt
    nxt.prev_free_block = prev
    block.prev_free_block = block.next_free_block = None


def _link_before(node: KVCacheBlock, block: KVCacheBlock) -> None:
    prev = node.prev_free_block
    assert prev is not None
    prev.next_free_block = block
    block.prev_free_block = prev
    block.next_free_block = node
    node.prev_free_block = block


def _link_after(node: KVCacheBlock, block: KVCacheBlock) -> None:
    nxt = node.next_free_block
    assert nxt is not None
    _link_before(nxt, block)


@dataclass
class Pin:
    """A tenant's pin of a token prefix: the cache keys of its blocks in every
    attention group, and the blocks it holds a reference on (those cached so far).
    ``pin_id`` names the prefix (its last block hash, in hex): one pin per tenant and
    prefix, so pinning it again refreshes the pin."""

    pin_id: str
    tenant: str
    num_tokens: int
    keys: tuple[BlockHashWithGroupId, ...]
    ttl_s: float | None
    refresh_on_hit: bool
    expires_at: float | None
    held: dict[BlockHashWithGroupId, KVCacheBlock] = field(default_factory=dict)
    num_hits: int = 0

    @property
    def owner_key(self) -> tuple[str, str]:
        return self.tenant, self.pin_id


@dataclass(frozen=True)
class Tick:
    """Time passes to ``now``: pins past their TTL let go, priorities revert."""

    now: float


@dataclass(frozen=True)
class PinPlaced:
    """A pin placed by its keys (what a server ships a replica: no hashing needed)."""

    now: float
    owner: str
    pin_id: str
    num_tokens: int
    keys: tuple[BlockHashWithGroupId, ...]
    ttl_s: float | None
    refresh_on_hit: bool


@dataclass(frozen=True)
class PinRemoved:
    now: float
    owner: str
    pin_id: str


# A retention change decided by the pool's owner (a server), applied in order by it
# and by every replica of the pool at the same step boundary.
RetentionEvent = Tick | PinPlaced | PinRemoved


@dataclass
class RetentionStats:
    """Counters since start, for metrics."""

    pins_created: int = 0
    pins_expired: int = 0
    pins_removed: int = 0
    # Pins refused for the pinned budget (or with pinning off).
    pins_refused: int = 0
    pinned_block_hits: int = 0
    priorities_expired: int = 0
    evictions_by_priority: dict[int, int] = field(default_factory=dict)


class RetentionPolicy:
    """The pool's pins and priority deadlines; the pool applies what this decides.

    Time comes from ``now`` arguments, never a clock read here: the caller decides when
    time passes (the server once per call, a replica at the server's step boundaries).
    """

    def __init__(self, policy: str, max_pinned_blocks: int) -> None:
        if policy not in EVICTION_POLICIES:
            raise InvalidArgumentError(
                f"eviction policy {policy!r} is unknown; choose one of {EVICTION_POLICIES}"
            )
        self.policy = policy
        self.max_pinned_blocks = max_pinned_blocks
        self.pins: dict[tuple[str, str], Pin] = {}
        # Key -> the pins that wait for it or hold a block under it.
        self.pins_by_key: dict[BlockHashWithGroupId, list[Pin]] = {}
        # Block id -> the pins holding it (one reference each).
        self.holders: dict[int, list[Pin]] = {}
        self._pin_deadlines: list[tuple[float, str, str]] = []
        self._priority_deadlines: list[tuple[float, int, int]] = []
        # Block id -> the deadline of its current priority (a stale heap entry differs).
        self.priority_deadline: dict[int, float] = {}
        self.stats = RetentionStats()

    @property
    def priorities_enabled(self) -> bool:
        return self.policy == "priority"

    @property
    def num_reserved_blocks(self) -> int:
        """What pins may hold: each pin counts every key of its prefix, cached or not."""
        return sum(len(pin.keys) for pin in self.pins.values())

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.holders)

    def check_budget(self, pin_id: str, num_keys: int, pending: int = 0) -> None:
        """Refuse (QuotaExceededError, counted) a new pin of ``num_keys`` keys past the
        pinned budget, beside what pins reserve and ``pending`` keys not placed yet."""
        if self.max_pinned_blocks == 0:
            self.stats.pins_refused += 1
            raise QuotaExceededError(
                "pinning is off in this pool: its pinned budget is 0 blocks "
                "(set a pinned fraction, e.g. --max-pinned-fraction 0.1)"
            )
        reserved = self.num_reserved_blocks + pending
        if reserved + num_keys > self.max_pinned_blocks:
            self.stats.pins_refused += 1
            raise QuotaExceededError(
                f"pin {pin_id!r} needs {num_keys} blocks, but pins already reserve "
                f"{reserved} of the pinned budget of {self.max_pinned_blocks} blocks "
                f"(--max-pinned-fraction); unpin something or pin a shorter prefix"
            )

    def next_deadline(self) -> float | None:
        deadlines = [h[0][0] for h in (self._pin_deadlines, self._priority_deadlines) if h]
        return min(deadlines) if deadlines else None

    def schedule_pin_expiry(self, pin: Pin) -> None:
        if pin.expires_at is not None:
            heapq.heappush(self._pin_deadlines, (pin.expires_at, pin.tenant, pin.pin_id))

    def expired_pins(self, now: float) -> list[Pin]:
        """Pins whose TTL ran out by ``now`` (a refreshed pin's old deadline is stale)."""
        expired: list[Pin] = []
        while self._pin_deadlines and self._pin_deadlines[0][0] <= now:
            deadline, tenant, pin_id = heapq.heappop(self._pin_deadlines)
            pin = self.pins.get((tenant, pin_id))
            if pin is not None and pin.expires_at == deadline:
                expired.append(pin)
        return expired

    def set_priority(
        self, block: KVCacheBlock, priority: int, duration_s: float | None, now: float
    ) -> None:
        block.priority = priority
        if duration_s is None or priority == DEFAULT_PRIORITY:
            self.priority_deadline.pop(block.block_id, None)
            return
        deadline = now + duration_s
        self.priority_deadline[block.block_id] = deadline
        heapq.heappush(self._priority_deadlines, (deadline, block.block_id, priority))

    def expired_priorities(self, now: float, blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        """Blocks whose priority's duration ran out by ``now``."""
        expired: list[KVCacheBlock] = []
        while self._priority_deadlines and self._priority_deadlines[0][0] <= now:
            deadline, block_id, _ = heapq.heappop(self._priority_deadlines)
            if self.priority_deadline.get(block_id) == deadline:
                del self.priority_deadline[block_id]
                expired.append(blocks[block_id])
        return expired

    def count_eviction(self, priority: int) -> None:
        by_priority = self.stats.evictions_by_priority
        by_priority[priority] = by_priority.get(priority, 0) + 1

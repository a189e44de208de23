"""What the request table tells the outside world: the pool and each allocation's
outcome to a metrics observer, and the manager's KV events to an event sink.

``Reporter`` reports each change right away or, inside a batch (``RequestTable.
batched()``: a ``Step`` of many operations), the pool and the outcomes once when the
batch ends. The observer sees the same totals either way: gauges end at the same
values and the prefix cache counters move by the sum of the batch's stats. KV events
are never held back: each change hands them on before the call returns, so none is
pending between two calls (what lets a snapshot taken then match the events published
so far). Without an observer nor a sink every method returns at once.

Like the table that drives it, it is not thread safe: it runs on the loop that owns
the table.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.kv_events import KVCacheEvent
from kvservice.core.stats import PrefixCacheStats
from kvservice.request_table.types import PoolUsage

# Receives the manager's KV events right after the change that caused them (the
# server's event log, ``kvservice.server.events.EventLog.publish``).
EventSink = Callable[[list[KVCacheEvent]], None]


class AllocationResult(enum.StrEnum):
    """How an AllocateSlots call ended (the ``result`` label of the metrics)."""

    OK = "ok"
    NO_SPACE = "no_space"
    INVALID = "invalid"


class TableObserver(Protocol):
    """Receives what the metrics need, on the loop that owns the table."""

    def record_allocation(self, result: AllocationResult, count: int = 1) -> None: ...

    def record_pool(self, usage: PoolUsage, stats: PrefixCacheStats | None) -> None: ...

    def record_preemption(self) -> None: ...


class Reporter:
    """The observer and event sink of one table, and what a batch holds back."""

    def __init__(
        self,
        manager: KVCacheManager,
        observer: TableObserver | None,
        events: EventSink | None,
        usage: Callable[[], PoolUsage],
    ) -> None:
        self._manager = manager
        self._observer = observer
        self._events = events
        # The pool as it is now (``RequestTable.usage``), read only when reporting.
        self._usage = usage
        # Inside a batch: pool observations are held back (the prefix cache stats
        # summed in ``_pending``) and reported once when the batch ends.
        self._batching = False
        self._pending: PrefixCacheStats | None = None
        self._pending_change = False
        # Allocation outcomes counted inside a batch, reported when it ends.
        self._pending_results: dict[AllocationResult, int] = {}

    def begin_batch(self) -> None:
        """Hold reports back until ``end_batch``. Not nested: the table calls it for
        its outermost batch only."""
        self._batching = True

    def end_batch(self) -> None:
        """Report what the batch held back: each outcome's count, then the pool once
        with the batch's prefix cache stats summed."""
        self._batching = False
        if self._pending_results:
            results, self._pending_results = self._pending_results, {}
            if self._observer is not None:
                for result, count in results.items():
                    self._observer.record_allocation(result, count)
        if self._pending_change:
            stats, self._pending, self._pending_change = self._pending, None, False
            if self._observer is not None:
                self._observer.record_pool(self._usage(), stats)

    def publish_events(self) -> None:
        """Hand the manager's pending KV events to the sink (none without one)."""
        if self._events is not None:
            events = self._manager.take_events()
            if events:
                self._events(events)

    def changed(self, stats: PrefixCacheStats | None = None) -> None:
        """Report a change of the pool: its KV events, then the pool with the prefix
        cache stats the change recorded. Only lookups and resets record any (and each
        takes its own right away), so other changes pass none rather than ask the core
        for an empty stats window."""
        if self._events is not None:
            self.publish_events()
        observer = self._observer
        if observer is None:
            return
        if not self._batching:
            observer.record_pool(self._usage(), stats)
            return
        self._pending_change = True
        if stats is not None:
            pending = self._pending
            if pending is None:
                self._pending = stats
            else:
                pending.reset |= stats.reset
                pending.requests += stats.requests
                pending.queries += stats.queries
                pending.hits += stats.hits
                pending.preempted_requests += stats.preempted_requests
                pending.preempted_queries += stats.preempted_queries
                pending.preempted_hits += stats.preempted_hits

    def allocated(self, result: AllocationResult) -> None:
        """Count one ``AllocateSlots`` outcome."""
        if self._observer is None:
            return
        if self._batching:
            # Counted once per batch: a Step's allocations add up to one inc per result.
            pending = self._pending_results
            pending[result] = pending.get(result, 0) + 1
        else:
            self._observer.record_allocation(result)

    def preempted(self) -> None:
        """Count one preemption, right away even inside a batch."""
        if self._observer is not None:
            self._observer.record_preemption()

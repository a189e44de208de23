"""Tells the metrics observer of the allocator's pool and allocation outcomes.

``PoolReporter`` reports each change of the pool and each ``AllocateSlots`` outcome to
an ``AllocatorObserver`` right away or, inside a batch (``Allocator.batched()``: a
``Step`` of many operations), once when the batch ends. The observer sees the same
totals either way: gauges end at the same values and the prefix cache counters move by
the sum of the batch's stats. Without an observer every method returns at once.

Like the allocator that drives it, it is not thread safe: it runs on the loop that owns
the allocator.
"""

from __future__ import annotations

from collections.abc import Callable

from kvservice.core.stats import PrefixCacheStats
from kvservice.server.allocation import AllocationResult, AllocatorObserver, PoolUsage


class PoolReporter:
    """The observer of one allocator and what a batch holds back from it."""

    def __init__(self, observer: AllocatorObserver | None, usage: Callable[[], PoolUsage]) -> None:
        # Read by the allocator too, which reports preemptions itself (never batched).
        self.observer = observer
        # The pool as it is now (``Allocator.usage``), read only when reporting.
        self._usage = usage
        # Inside a batch: pool observations are held back (the prefix cache stats
        # summed in ``_pending``) and reported once when the batch ends.
        self._batching = False
        self._pending: PrefixCacheStats | None = None
        self._pending_change = False
        # Allocation outcomes counted inside a batch, reported when it ends.
        self._pending_results: dict[AllocationResult, int] = {}

    def begin_batch(self) -> None:
        """Hold reports back until ``end_batch``. Not nested: the allocator calls it
        for its outermost batch only."""
        self._batching = True

    def end_batch(self) -> None:
        """Report what the batch held back: each outcome's count, then the pool once
        with the batch's prefix cache stats summed."""
        self._batching = False
        if self._pending_results:
            results, self._pending_results = self._pending_results, {}
            if self.observer is not None:
                for result, count in results.items():
                    self.observer.record_allocation(result, count)
        if self._pending_change:
            stats, self._pending, self._pending_change = self._pending, None, False
            if self.observer is not None:
                self.observer.record_pool(self._usage(), stats)

    def record(self, result: AllocationResult) -> None:
        """Count one ``AllocateSlots`` outcome."""
        if self.observer is None:
            return
        if self._batching:
            # Counted once per batch: a Step's allocations add up to one inc per result.
            pending = self._pending_results
            pending[result] = pending.get(result, 0) + 1
        else:
            self.observer.record_allocation(result)

    def pool_changed(self, stats: PrefixCacheStats | None = None) -> None:
        """Report the pool after a change, with the prefix cache stats the change
        recorded. Only lookups and resets record any (and each takes its own right
        away), so other changes pass none rather than ask the core for an empty stats
        window."""
        if self.observer is None:
            return
        if not self._batching:
            self.observer.record_pool(self._usage(), stats)
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

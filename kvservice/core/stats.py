"""Prefix cache statistics, in tokens, as vLLM's ``PrefixCacheStats`` and
``CachingMetrics`` count them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Lookups since the last ``make_prefix_cache_stats()``.

    Preempted requests are counted apart: they mostly re-hit their own blocks, and
    counting them in the headline numbers inflates the hit rate.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class CachingMetrics:
    """Hit rate over the most recent ``max_recent_requests`` requests (vLLM's log line)."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        # The newest entry stays even when it alone exceeds the window.
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def empty(self) -> bool:
        return self.aggregated_query_total == 0

    @property
    def hit_rate(self) -> float:
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total

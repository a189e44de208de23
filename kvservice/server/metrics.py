"""Prometheus metrics: vLLM's KV cache series (same names, so existing dashboards
work) plus the service's own pool and allocation series.

Each server gets its own ``CollectorRegistry``, so several can live in one process
(tests). Values are written on the event loop that owns the allocator and read by the
exposition thread; prometheus_client's values are individually locked, and the
allocator itself is never touched from that thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.stats import PrefixCacheStats
from kvservice.server.allocator import AllocationResult, PoolUsage

_LABELS = ("model_name", "engine")


class KVCacheMetrics:
    """The service's metrics in a registry of their own; an ``AllocatorObserver``."""

    def __init__(self, manager: KVCacheManager, model_name: str, engine: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": engine}
        reg = self.registry
        self._usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            _LABELS,
            registry=reg,
        ).labels(**labels)
        self._queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            _LABELS,
            registry=reg,
        ).labels(**labels)
        self._hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            _LABELS,
            registry=reg,
        ).labels(**labels)
        self._free = Gauge(
            "kvservice_free_blocks", "Free KV cache blocks.", _LABELS, registry=reg
        ).labels(**labels)
        self._used = Gauge(
            "kvservice_used_blocks", "KV cache blocks held by requests.", _LABELS, registry=reg
        ).labels(**labels)
        allocations = Counter(
            "kvservice_allocations",
            "AllocateSlots calls by outcome (invalid: refused with an error).",
            (*_LABELS, "result"),
            registry=reg,
        )
        # Every outcome is exported from the start, so rate() sees the first one.
        self._allocations = {
            r: allocations.labels(**labels, result=r.value) for r in AllocationResult
        }
        self._export_cache_config(manager, labels)

    def _export_cache_config(self, manager: KVCacheManager, labels: dict[str, str]) -> None:
        config = manager.kv_cache_config
        info = {
            **labels,
            "block_size": str(manager.scheduler_block_size),
            "num_gpu_blocks": str(config.num_blocks),
            "enable_prefix_caching": str(manager.enable_caching),
            "prefix_caching_hash_algo": manager.block_hasher.hash_algo,
        }
        # A gauge set to 1, as vLLM exports it (an Info would add a second suffix).
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            tuple(info),
            registry=self.registry,
        ).labels(**info).set(1)

    def record_allocation(self, result: AllocationResult) -> None:
        self._allocations[result].inc()

    def record_pool(self, usage: PoolUsage, stats: PrefixCacheStats | None) -> None:
        self._usage.set(usage.usage)
        self._free.set(usage.num_free_blocks)
        self._used.set(usage.num_used_blocks)
        if stats is not None:
            self._queries.inc(stats.queries)
            self._hits.inc(stats.hits)


@dataclass(slots=True)
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server (a daemon thread)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
        server, thread = start_http_server(port, addr=host, registry=registry)
        return cls(server, thread)

    async def stop(self) -> None:
        # shutdown() waits for the serve loop's next poll: keep it off the event loop.
        await asyncio.to_thread(self.server.shutdown)
        self.server.server_close()
        await asyncio.to_thread(self.thread.join, 5.0)

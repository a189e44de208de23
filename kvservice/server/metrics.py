"""Prometheus metrics: vLLM's KV cache series (same names, so existing dashboards
work) plus the service's own pool, allocation and RPC series. Every series carries the
``model_name`` and ``engine`` labels.

Each server gets its own ``CollectorRegistry``, so several can live in one process
(tests). Most values are written on the event loop that owns the request table and read by
the exposition thread (prometheus_client's values are individually locked). The few
that would cost something per call (cached blocks, evictions, active requests and
clients) are computed at scrape time by ``_ScrapeTimeCollector`` instead, in the
exposition thread: it only reads plain attributes of the pool, never mutates it, and a
scrape racing an allocation may see a count one step old, which a gauge tolerates.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.retention_policy import RetentionStats
from kvservice.core.stats import PrefixCacheStats
from kvservice.request_table.reporting import AllocationResult
from kvservice.request_table.types import PinnedBudget, PoolUsage
from kvservice.server.binding import BindError, address, socket_family
from kvservice.server.probes import LoopProbe, with_probes

_LABELS = ("model_name", "engine")
# RPCs take tens of microseconds (a lookup) to a good fraction of a second (a large
# Step); the default buckets start at 5 ms and would put every unary call in the first.
RPC_DURATION_BUCKETS = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
)
ACTIVE_CLIENT_WINDOW_S = 60.0
# Client ids remembered at most (each an x-client-id value seen in the window).
MAX_TRACKED_CLIENTS = 10_000


class ClientTracker:
    """The ``x-client-id`` values that are active: with a stream open now, or seen on a
    call that ended within the last ``window_s`` seconds. Calls without the header are
    not counted (there is nothing to tell those clients apart by).

    Written on the event loop, read by the exposition thread: a lock keeps the two
    dicts consistent (uncontended, it costs well under a microsecond per call).
    """

    def __init__(
        self,
        window_s: float = ACTIVE_CLIENT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_seen: dict[str, float] = {}
        self._open_streams: dict[str, int] = {}

    def seen(self, client_id: str | None) -> None:
        """A call from ``client_id`` just ended."""
        if client_id is None:
            return
        with self._lock:
            self._last_seen[client_id] = self._clock()
            if len(self._last_seen) > MAX_TRACKED_CLIENTS:
                # Without a scrape nothing else forgets, and a caller may send a new id
                # with every call. Down to half the cap, the oldest first even if still
                # in the window (the count then reads low): a pass per cap/2 calls.
                self._forget_stale()
                surplus = len(self._last_seen) - MAX_TRACKED_CLIENTS // 2
                if surplus > 0:
                    oldest = sorted(self._last_seen, key=self._last_seen.__getitem__)
                    for stale in oldest[:surplus]:
                        del self._last_seen[stale]

    def _forget_stale(self) -> None:
        """Forget the ids whose window has passed (under the lock)."""
        horizon = self._clock() - self._window_s
        for client_id in [c for c, t in self._last_seen.items() if t < horizon]:
            del self._last_seen[client_id]

    def open_stream(self, client_id: str | None) -> None:
        if client_id is None:
            return
        with self._lock:
            self._open_streams[client_id] = self._open_streams.get(client_id, 0) + 1

    def close_stream(self, client_id: str | None) -> None:
        if client_id is None:
            return
        with self._lock:
            left = self._open_streams.pop(client_id, 1) - 1
            if left:
                self._open_streams[client_id] = left
            self._last_seen[client_id] = self._clock()

    def count(self) -> int:
        """Active clients now; forgets the ones whose window has passed."""
        with self._lock:
            self._forget_stale()
            return len(self._last_seen.keys() | self._open_streams.keys())


@dataclass(frozen=True, slots=True)
class RpcInstruments:
    """The per-method children of the RPC metrics, resolved once per method."""

    duration: Histogram
    in_flight: Gauge


class KVCacheMetrics:
    """The service's metrics in a registry of their own; the request table's ``TableObserver``."""

    def __init__(self, manager: KVCacheManager, model_name: str, engine: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine}
        self._declare_vllm_series()
        self._declare_pool_series()
        self._declare_rpc_series()
        self._declare_lifecycle_series()
        self._declare_loop_series()
        self._declare_security_series()
        self._declare_offload_series()
        self._export_cache_config(manager)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, _LABELS, registry=self.registry).labels(**self.labels)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, _LABELS, registry=self.registry).labels(**self.labels)

    def _declare_vllm_series(self) -> None:
        self._usage = self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self._queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self._hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self._preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )

    def _declare_pool_series(self) -> None:
        self._free = self._gauge("kvservice_free_blocks", "Free KV cache blocks.")
        self._used = self._gauge("kvservice_used_blocks", "KV cache blocks held by requests.")
        allocations = Counter(
            "kvservice_allocations",
            "AllocateSlots calls by outcome (invalid: refused with an error).",
            (*_LABELS, "result"),
            registry=self.registry,
        )
        # Every outcome is exported from the start, so rate() sees the first one.
        self._allocations = {
            r: allocations.labels(**self.labels, result=r.value) for r in AllocationResult
        }
        # Declared whether or not the server runs with --kv-events, so dashboards and
        # alerts can be written against them.
        self.events_published = self._counter(
            "kvservice_events_published", "KV cache events published to subscribers."
        )
        self.events_dropped = self._counter(
            "kvservice_events_dropped", "KV cache events dropped (a subscriber too slow)."
        )
        # The ZMQ stream (``zmq_events``), counted from its publishing thread.
        self.zmq_batches_published = self._counter(
            "kvservice_kv_event_zmq_batches_published",
            "KV event batches sent on the ZMQ PUB socket (vLLM's wire format).",
        )
        self.zmq_batches_dropped = self._counter(
            "kvservice_kv_event_zmq_batches_dropped",
            "KV event batches no ZMQ subscriber got: max_queue_size batches were already "
            "waiting for the publishing thread.",
        )
        self.zmq_subscriber_overflows = self._counter(
            "kvservice_kv_event_zmq_subscriber_overflows",
            "Times a ZMQ subscriber fell hwm batches behind and began missing batches.",
        )

    def _declare_rpc_series(self) -> None:
        self._rpc_duration = Histogram(
            "kvservice_rpc_duration_seconds",
            "Time the server spent on a KVCacheService call (per message for StepStream).",
            (*_LABELS, "method"),
            buckets=RPC_DURATION_BUCKETS,
            registry=self.registry,
        )
        self._rpc_in_flight = Gauge(
            "kvservice_rpc_in_flight",
            "KVCacheService calls in progress (open streams for StepStream).",
            (*_LABELS, "method"),
            registry=self.registry,
        )
        self._rpc_instruments: dict[str, RpcInstruments] = {}
        self.step_socket_connections = self._counter(
            "kvservice_step_socket_connections",
            "Connections accepted on the step socket (--step-socket); each is one "
            "StepStream, counted in the RPC series as one over gRPC (method StepStream).",
        )

    def _declare_lifecycle_series(self) -> None:
        """Sessions, idempotent retries and the self-check (``sessions``,
        ``idempotency``, ``audit``); public, those modules write them."""
        self.sessions_active = self._gauge("kvservice_sessions_active", "Open client sessions.")
        self.sessions_opened = self._counter(
            "kvservice_sessions_opened", "Client sessions opened (OpenSession answered OK)."
        )
        closed = Counter(
            "kvservice_sessions_closed",
            "Client sessions ended, by why: client (CloseSession), ttl (the lease ran "
            "out), stream_broken (a StepStream opened under it broke). Counted once its "
            "requests are freed.",
            (*_LABELS, "reason"),
            registry=self.registry,
        )
        self.sessions_closed = {
            reason: closed.labels(**self.labels, reason=reason)
            for reason in ("client", "ttl", "stream_broken")
        }
        expirations = Counter(
            "kvservice_session_expirations",
            "Sessions ended by the server: ttl (the lease ran out), stream_broken (a "
            "StepStream opened under it broke).",
            (*_LABELS, "reason"),
            registry=self.registry,
        )
        self.session_expirations = {
            reason: expirations.labels(**self.labels, reason=reason)
            for reason in ("ttl", "stream_broken")
        }
        self.requests_reclaimed = self._counter(
            "kvservice_requests_reclaimed",
            "Requests freed because the session owning them expired or its stream broke.",
        )
        self.idempotent_replays = self._counter(
            "kvservice_idempotent_replays",
            "Retried calls answered from the operation-id cache, without running again.",
        )
        self.audit_runs = self._counter("kvservice_audit_runs", "Pool invariant audits run.")
        self.audit_failures = self._counter(
            "kvservice_audit_failures", "Pool invariant audits that found a violation."
        )
        self.audit_errors = self._counter(
            "kvservice_audit_errors",
            "Pool invariant audits that could not run (a forked child crashed or hung); "
            "nothing was checked.",
        )
        self.audit_last_success = self._gauge(
            "kvservice_audit_last_success_timestamp_seconds",
            "Unix time of the last audit that found the pool consistent.",
        )

    def _declare_loop_series(self) -> None:
        """How long the event loop is held up (``loop_watch``)."""
        self._loop_stall = Histogram(
            "kvservice_event_loop_stall_seconds",
            "How late a timer the server sets every --loop-stall-interval (10 ms unless "
            "set) runs: the time the event loop was held by something else (a call's work "
            "between two pauses, a garbage collection). Health checks wait this long.",
            _LABELS,
            buckets=RPC_DURATION_BUCKETS,
            registry=self.registry,
        ).labels(**self.labels)
        gc_pause = Histogram(
            "kvservice_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, by generation (2: a full "
            "collection); each stalls the event loop.",
            (*_LABELS, "generation"),
            buckets=RPC_DURATION_BUCKETS,
            registry=self.registry,
        )
        self._gc_pause = [gc_pause.labels(**self.labels, generation=str(g)) for g in range(3)]

    def record_loop_stall(self, seconds: float) -> None:
        self._loop_stall.observe(seconds)

    def record_gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pause[min(max(generation, 0), 2)].observe(seconds)

    def _declare_security_series(self) -> None:
        """Refused calls by tenant and reason (``auth``, quotas and limits in the
        request table); tenant names come from the tokens file and reasons are a fixed
        set, so the label set stays bounded."""
        self._refusals = Counter(
            "kvservice_refusals",
            "Calls refused by a security check or a limit: unauthenticated (no or wrong "
            "token; tenant empty), permission_denied (an admin-only call), rate_limited, "
            "quota (an allocation past the tenant's max_blocks), or the name of the "
            "request limit (max_requests_per_tenant, max_waiting_tokens_per_tenant, "
            "max_prompt_embeds_bytes_per_tenant, max_request_id_length, "
            "max_cache_salt_length, max_lora_name_length, max_lora_path_length, "
            "max_mm_identifier_length, max_mm_items_per_prompt, max_mm_items_per_tenant, "
            "max_mm_identifier_bytes_per_tenant), or of the session and stream limit "
            "(max_sessions_per_tenant, max_sessions, max_step_streams_per_tenant, "
            "max_step_streams).",
            (*_LABELS, "tenant", "reason"),
            registry=self.registry,
        )
        self._rate_delay = Counter(
            "kvservice_rate_limit_delay_seconds",
            "Seconds stream messages waited for their tenant's rate limit (a stream over "
            "it is slowed, not ended).",
            (*_LABELS, "tenant"),
            registry=self.registry,
        )

    def _declare_offload_series(self) -> None:
        """The CPU offload tiers kvservice indexes (``OffloadStep``), every engine's
        together; declared (at zero) on a server that serves none."""
        self._offload_stored = self._counter(
            "kvservice_offload_keys_stored",
            "Chunks the CPU offload tiers finished storing (vLLM's complete_store).",
        )
        self._offload_store_failures = self._counter(
            "kvservice_offload_store_failures",
            "Chunks whose store to a CPU offload tier failed (dropped, never readable).",
        )
        self._offload_loaded = self._counter(
            "kvservice_offload_keys_loaded",
            "Chunks loaded back from the CPU offload tiers (prefix hits in the tier).",
        )
        self._offload_evicted = self._counter(
            "kvservice_offload_keys_evicted",
            "Chunks the CPU offload tiers evicted to make room for stores.",
        )
        self._offload_bytes_stored = self._counter(
            "kvservice_offload_bytes_stored",
            "Bytes stored to the CPU offload tiers (chunks stored x the engine's chunk "
            "size; 0 when the engine does not give it).",
        )
        self._offload_bytes_loaded = self._counter(
            "kvservice_offload_bytes_loaded", "Bytes loaded back from the CPU offload tiers."
        )
        self._offload_chunks_used = self._gauge(
            "kvservice_offload_chunks_used",
            "Chunks of the CPU offload tiers in use (stored, being stored or read).",
        )
        self._offload_chunks = self._gauge(
            "kvservice_offload_chunks", "Chunks of the CPU offload tiers, in all."
        )
        self._offload_tiers = self._gauge(
            "kvservice_offload_tiers", "CPU offload tiers indexed (one per engine session)."
        )

    # -- OffloadCounters (``offload_tiers``) ------------------------------------------

    def record_offload_step(
        self, stored: int, failed: int, loaded: int, evicted: int, chunk_bytes: int
    ) -> None:
        self._offload_stored.inc(stored)
        self._offload_store_failures.inc(failed)
        self._offload_loaded.inc(loaded)
        self._offload_evicted.inc(evicted)
        self._offload_bytes_stored.inc(stored * chunk_bytes)
        self._offload_bytes_loaded.inc(loaded * chunk_bytes)

    def record_offload_usage(self, chunks_used: int, chunks: int, tiers: int) -> None:
        self._offload_chunks_used.set(chunks_used)
        self._offload_chunks.set(chunks)
        self._offload_tiers.set(tiers)

    def record_rate_delay(self, tenant: str, seconds: float) -> None:
        """A stream message of ``tenant`` was held back ``seconds`` to its rate."""
        self._rate_delay.labels(**self.labels, tenant=tenant).inc(seconds)

    def record_refusal(self, tenant: str, reason: str) -> None:
        """A call of ``tenant`` ("" when unauthenticated) was refused for ``reason``."""
        self._refusals.labels(**self.labels, tenant=tenant, reason=reason).inc()

    def watch_tenants(self, blocks: Callable[[], Mapping[str, int]]) -> None:
        """Export ``blocks()`` (tenant -> blocks held) at scrape time."""
        self.registry.register(_TenantCollector(blocks, self.labels))

    def watch_tenant_requests(self, counts: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        """Export ``counts()`` (tenant -> requests held, waiting tokens) at scrape time."""
        self.registry.register(_TenantPairCollector(_TENANT_REQUESTS, counts, self.labels))

    def watch_tenant_sessions(self, counts: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        """Export ``counts()`` (tenant -> open sessions, open StepStreams) at scrape
        time."""
        self.registry.register(_TenantPairCollector(_TENANT_SESSIONS, counts, self.labels))

    def watch_retention(self, retention: RetentionSource) -> None:
        """Export the pool's pins and priorities (``retention``) at scrape time; the
        families are declared (at zero) on a pool without them too."""
        self.registry.register(_RetentionCollector(retention, self.labels))

    def _export_cache_config(self, manager: KVCacheManager) -> None:
        config = manager.kv_cache_config
        info = {
            **self.labels,
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

    def watch(
        self, manager: KVCacheManager, num_requests: Callable[[], int], clients: ClientTracker
    ) -> None:
        """Register the values computed at scrape time."""
        self.registry.register(_ScrapeTimeCollector(manager, num_requests, clients, self.labels))

    def rpc(self, method: str) -> RpcInstruments:
        """The instruments of ``method`` (its short name, e.g. ``AllocateSlots``)."""
        found = self._rpc_instruments.get(method)
        if found is None:
            found = RpcInstruments(
                self._rpc_duration.labels(**self.labels, method=method),
                self._rpc_in_flight.labels(**self.labels, method=method),
            )
            self._rpc_instruments[method] = found
        return found

    # -- TableObserver ----------------------------------------------------------------

    def record_allocation(self, result: AllocationResult, count: int = 1) -> None:
        self._allocations[result].inc(count)

    def record_preemption(self) -> None:
        self._preemptions.inc()

    def record_pool(self, usage: PoolUsage, stats: PrefixCacheStats | None) -> None:
        self._usage.set(usage.usage)
        self._free.set(usage.num_free_blocks)
        self._used.set(usage.num_used_blocks)
        if stats is not None:
            self._queries.inc(stats.queries)
            self._hits.inc(stats.hits)


class _TenantCollector:
    """``kvservice_tenant_blocks``: blocks held per tenant, read at scrape time (the
    request table hands a copy, so the exposition thread never iterates a live dict)."""

    def __init__(self, blocks: Callable[[], Mapping[str, int]], labels: dict[str, str]) -> None:
        self._blocks = blocks
        self._label_values = [labels[name] for name in _LABELS]

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for tenant, num_blocks in sorted(self._blocks().items()):
            family.add_metric([*self._label_values, tenant], num_blocks)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "kvservice_tenant_blocks",
            "KV cache blocks held by each tenant's requests (the default tenant: empty).",
            labels=(*_LABELS, "tenant"),
        )


# (name, help) of the two per-tenant gauges one collector reports.
_TenantGauges = tuple[tuple[str, str], tuple[str, str]]
_TENANT_REQUESTS: _TenantGauges = (
    (
        "kvservice_tenant_requests",
        "Requests each tenant holds, waiting, running or preempted (limit: "
        "max_requests_per_tenant; the default tenant: empty).",
    ),
    (
        "kvservice_tenant_waiting_tokens",
        "Tokens of each tenant's requests that are not running (limit: "
        "max_waiting_tokens_per_tenant).",
    ),
)
_TENANT_SESSIONS: _TenantGauges = (
    (
        "kvservice_tenant_sessions",
        "Sessions each tenant has open (limit: max_sessions_per_tenant; the default "
        "tenant: empty).",
    ),
    (
        "kvservice_tenant_step_streams",
        "StepStreams each tenant has open (limit: max_step_streams_per_tenant).",
    ),
)


class _TenantPairCollector:
    """Two gauges per tenant, what a pair of per-tenant limits counts (requests and
    waiting tokens, or sessions and streams), read at scrape time (from a copy)."""

    def __init__(
        self,
        gauges: _TenantGauges,
        counts: Callable[[], Mapping[str, tuple[int, int]]],
        labels: dict[str, str],
    ) -> None:
        self._gauges = gauges
        self._counts = counts
        self._label_values = [labels[name] for name in _LABELS]

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        first, second = self._families()
        for tenant, (one, other) in sorted(self._counts().items()):
            first.add_metric([*self._label_values, tenant], one)
            second.add_metric([*self._label_values, tenant], other)
        yield from (first, second)

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        labels = (*_LABELS, "tenant")
        first, second = (
            GaugeMetricFamily(name, help_text, labels=labels) for name, help_text in self._gauges
        )
        return first, second


@dataclass(frozen=True, slots=True)
class RetentionSource:
    """Where the retention metrics are read from at scrape time (copies, safe to read
    from the exposition thread): the pinned budget, pins per tenant, the core's
    counters (None: no retention in this pool)."""

    budget: Callable[[], PinnedBudget]
    pins_per_tenant: Callable[[], Mapping[str, int]]
    stats: Callable[[], RetentionStats | None]


class _RetentionCollector:
    """Pins and eviction priorities (README, Retention), read when Prometheus
    scrapes: plain counts of the pool's retention policy and a copy of its pins'
    owners."""

    def __init__(self, source: RetentionSource, labels: dict[str, str]) -> None:
        self._source = source
        self._label_values = [labels[name] for name in _LABELS]

    def describe(self) -> Iterator[Metric]:
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        values = self._label_values
        pinned = GaugeMetricFamily(
            "kvservice_pinned_blocks",
            "Blocks pins hold now (cached, never evicted, counted as used).",
            labels=_LABELS,
        )
        reserved = GaugeMetricFamily(
            "kvservice_pinned_reserved_blocks",
            "Blocks pins reserve against the pinned budget: every block key of every "
            "pin, in every attention group, cached or not (overlapping pins count twice).",
            labels=_LABELS,
        )
        budget = GaugeMetricFamily(
            "kvservice_pinned_budget_blocks",
            "The most blocks pins may reserve (--max-pinned-fraction of the pool; 0: "
            "pinning is off).",
            labels=_LABELS,
        )
        tenant_pins = GaugeMetricFamily(
            "kvservice_tenant_pins",
            "Pins each tenant has (the default tenant: empty).",
            labels=(*_LABELS, "tenant"),
        )
        counters = [
            (
                "kvservice_pins_created",
                "Pins created (PinPrefix, AddRequest's cache_control_ttl); a refresh of "
                "an existing pin is not counted.",
                "pins_created",
            ),
            ("kvservice_pins_expired", "Pins whose TTL ran out.", "pins_expired"),
            ("kvservice_pins_removed", "Pins dropped by UnpinPrefix.", "pins_removed"),
            (
                "kvservice_pins_refused",
                "Pins refused for the pinned budget or with pinning off (a replica "
                "session's request is added without its cache_control pin).",
                "pins_refused",
            ),
            (
                "kvservice_pinned_block_hits",
                "Prefix hits on blocks a pin holds (one per block and pin).",
                "pinned_block_hits",
            ),
            (
                "kvservice_priority_expirations",
                "Cached blocks whose retention priority's duration ran out (back to the "
                "default priority, 35).",
                "priorities_expired",
            ),
        ]
        families = [
            CounterMetricFamily(name, help_text, labels=_LABELS) for name, help_text, _ in counters
        ]
        by_priority = CounterMetricFamily(
            "kvservice_evictions_by_priority",
            "Cached blocks evicted for reuse, by the retention priority they had (35: the "
            "default; every eviction of a pool with retention on).",
            labels=(*_LABELS, "priority"),
        )
        if with_samples:
            source = self._source
            now = source.budget()
            pinned.add_metric(values, now.num_pinned_blocks)
            reserved.add_metric(values, now.num_reserved_blocks)
            budget.add_metric(values, now.max_pinned_blocks)
            for tenant, count in sorted(source.pins_per_tenant().items()):
                tenant_pins.add_metric([*values, tenant], count)
            stats = source.stats()
            for family, (_, _, attribute) in zip(families, counters, strict=True):
                family.add_metric(values, getattr(stats, attribute) if stats is not None else 0)
            evictions = dict(stats.evictions_by_priority) if stats is not None else {}
            for priority, count in sorted(evictions.items()):
                by_priority.add_metric([*values, str(priority)], count)
        yield from (pinned, reserved, budget, tenant_pins, *families, by_priority)


class _ScrapeTimeCollector:
    """Values read from the pool and the trackers when Prometheus scrapes."""

    def __init__(
        self,
        manager: KVCacheManager,
        num_requests: Callable[[], int],
        clients: ClientTracker,
        labels: dict[str, str],
    ) -> None:
        self._pool = manager.block_pool
        self._num_requests = num_requests
        self._clients = clients
        self._label_values = [labels[name] for name in _LABELS]

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so the registry knows (and guards) the names."""
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        values = self._label_values
        cached = GaugeMetricFamily(
            "kvservice_cached_blocks",
            "Free blocks that still hold a prefix cache entry (reusable on a hit).",
            labels=_LABELS,
        )
        evictions = CounterMetricFamily(
            "kvservice_evictions",
            "Prefix cache entries evicted: reuse (the block was allocated again), "
            "invalidated (dropped on request, e.g. KV that failed to load).",
            labels=(*_LABELS, "reason"),
        )
        requests = GaugeMetricFamily(
            "kvservice_active_requests",
            "Requests the server knows (waiting, running and preempted).",
            labels=_LABELS,
        )
        clients = GaugeMetricFamily(
            "kvservice_active_clients",
            "Distinct x-client-id values with an open stream or a call in the last minute.",
            labels=_LABELS,
        )
        if with_samples:
            pool = self._pool
            cached.add_metric(values, self._num_cached_free_blocks())
            evictions.add_metric([*values, "reuse"], pool.num_evicted_on_reuse)
            evictions.add_metric([*values, "invalidated"], pool.num_evicted_on_request)
            requests.add_metric(values, self._num_requests())
            clients.add_metric(values, self._clients.count())
        yield from (cached, evictions, requests, clients)

    def _num_cached_free_blocks(self) -> int:
        # O(pool size), once per scrape rather than per call: the core keeps no counter
        # of hashed free blocks. ``blocks`` is never resized, so the walk is safe from
        # this thread.
        return sum(1 for b in self._pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)


@dataclass(slots=True)
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server (a daemon thread)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @classmethod
    def start(
        cls, registry: CollectorRegistry, host: str, port: int, probe: LoopProbe | None = None
    ) -> MetricsEndpoint:
        """Serve ``/metrics`` (and with ``probe``, ``/health`` and ``/ready``) on
        ``host:port`` (an IPv6 address too); ``BindError`` when it cannot listen."""
        app = _classic_text_only(make_wsgi_app(registry))
        if probe is not None:
            app = with_probes(app, probe)
        bare = host.strip("[]")
        try:
            server_class: type[WSGIServer] = type(
                "_Server", (ThreadingWSGIServer,), {"address_family": socket_family(bare, port)}
            )
            server: WSGIServer = make_server(
                bare, port, app, server_class, handler_class=_QuietHandler
            )
        except OSError as err:
            raise BindError(
                f"cannot serve metrics on {address(host, port)}: {err.strerror or err}; check "
                f"--metrics-host/--metrics-port (or --no-metrics)"
            ) from None
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return cls(server, thread)

    async def stop(self) -> None:
        # shutdown() waits for the serve loop's next poll: keep it off the event loop.
        await asyncio.to_thread(self.server.shutdown)
        self.server.server_close()
        await asyncio.to_thread(self.thread.join, 5.0)


class _QuietHandler(WSGIRequestHandler):
    """No access line on stderr per scrape."""

    def log_message(self, format: str, *args: Any) -> None:  # stdlib name
        pass


def _classic_text_only(app: Any) -> Any:
    """Always answer the classic text format. prometheus_client 0.26 escapes the colon
    of ``vllm:`` sample names in its OpenMetrics output, which Prometheus negotiates
    by default, so every vLLM dashboard would find nothing (client_python#1177)."""

    def classic(environ: dict[str, Any], start_response: Any) -> Any:
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    return classic

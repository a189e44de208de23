"""kvservice's offload index as the scheduler side of vLLM 0.33's CPU offload tier.

vLLM's native KV offloading (the ``OffloadingConnector``) copies KV blocks to host
memory in chunks, and its scheduler asks an ``OffloadingManager`` which chunks the
tier holds, where, and which to evict. ``KVServiceOffloadingSpec`` is vLLM's
``CPUOffloadingSpec`` (the same chunk sizing, the same CPU worker and host buffer) with
``KVServiceOffloadingManager`` as that manager, over ``kvservice.core.offload_index``.
With ``eviction_policy`` ``lru`` (the default) or ``arc`` it decides exactly as vLLM's
``CPUOffloadingManager`` (hits, evictions, chunk ids, events, stats); ``priority`` adds
what vLLM lacks: a request's ``kv_transfer_params`` may give its chunks a retention
priority (``"kvservice_priority": 0-100``, default 35; lower priorities are evicted
first, LRU within one) and pin them for a TTL (``"cache_control": {"ttl": "5m"}``, or
just ``"5m"``): a pinned chunk is never evicted until its pin expires. Pins may hold
``max_pinned_fraction`` of the tier (default 0.5); a pin past it is dropped and logged,
never fails the request.

Turn it on with vLLM's offloading connector and these ``kv_connector_extra_config``
keys (``cpu_bytes_to_use``, ``store_threshold`` and ``max_tracker_size`` mean what
they mean for vLLM's own spec)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "KVServiceOffloadingSpec",
        "spec_module_path": "kvservice.integrations.vllm.offloading",
        "cpu_bytes_to_use": 8000000000, "eviction_policy": "priority"}}'

With ``"kvservice_target": "HOST:PORT"`` (or ``unix:PATH``) in the same
``kv_connector_extra_config`` the index is served by that kvservice server, in a
session of its own: this index is then the engine's replica, and every call it
answers goes to the server once a step (``OffloadStep``, at ``on_schedule_end``),
which checks each answer and publishes the tier's events and metrics
(``kvservice.client.offload_link``).

Importing this module imports vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import (
    CPULoadStoreSpec,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvservice.client.offload_link import UNKNOWN_POSITION, OffloadLink, OffloadTierConfig
from kvservice.core.errors import KVCacheError, QuotaExceededError
from kvservice.core.kv_cache_block import DEFAULT_PRIORITY
from kvservice.core.offload_index import (
    LOOKUP_HIT,
    LOOKUP_HIT_PENDING,
    LOOKUP_MISS,
    OFFLOAD_EVICTION_POLICIES,
    OffloadIndex,
    RequestAccess,
)
from kvservice.integrations.vllm.retention import request_retention
from kvservice.integrations.vllm.settings import ConnectionSettings

logger = logging.getLogger(__name__)

_LOOKUP_RESULTS = {
    LOOKUP_MISS: LookupResult.MISS,
    LOOKUP_HIT: LookupResult.HIT,
    LOOKUP_HIT_PENDING: LookupResult.HIT_PENDING,
}
DEFAULT_MAX_PINNED_FRACTION = 0.5
# The kv_transfer_params keys the priority policy reads (retention.py parses them).
_RETENTION_KEYS = ("kvservice_priority", "cache_control")


def check_eviction_policy(name: str) -> str:
    """``name`` if the offload index has that policy, else a ValueError naming them."""
    if name not in OFFLOAD_EVICTION_POLICIES:
        raise ValueError(
            f"eviction_policy {name!r} is not one KVServiceOffloadingSpec knows; choose "
            f"one of {list(OFFLOAD_EVICTION_POLICIES)}"
        )
    return name


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadRetention:
    """What a request's ``kv_transfer_params`` ask of the priority policy."""

    priority: int = DEFAULT_PRIORITY
    pin_ttl_s: float | None = None


_NO_RETENTION = OffloadRetention()


def offload_retention(params: Mapping[str, Any] | None) -> OffloadRetention:
    """The priority and pin TTL ``params`` ask for; InvalidArgumentError names a bad
    value."""
    wanted = {key: params[key] for key in _RETENTION_KEYS if params and key in params}
    if not wanted:
        return _NO_RETENTION
    retention = request_retention(wanted)
    priority = DEFAULT_PRIORITY
    if retention.config is not None and retention.config.token_ranges:
        priority = retention.config.token_ranges[0].priority
    return OffloadRetention(priority, retention.pin_ttl_s)


class KVServiceOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """vLLM's ``OffloadingManager`` over kvservice's ``OffloadIndex``: the answers of
    vLLM's ``CPUOffloadingManager`` (``lru``, ``arc``), or the priority policy with pins.
    ``clock`` gives the seconds pins expire by (the index reads no clock)."""

    def __init__(
        self,
        num_chunks: int,
        eviction_policy: str = "lru",
        *,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
        max_pinned_fraction: float = DEFAULT_MAX_PINNED_FRACTION,
        clock: Callable[[], float] = time.monotonic,
        link: OffloadLink | None = None,
    ) -> None:
        check_eviction_policy(eviction_policy)
        if not 0 <= max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        self.medium = Medium.CPU
        self.priorities = eviction_policy == "priority"
        # The index's settings, as a server serving it builds its own (``open_link``).
        self.tier = OffloadTierConfig(
            num_chunks=num_chunks,
            eviction_policy=eviction_policy,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
            max_pinned_chunks=int(num_chunks * max_pinned_fraction) if self.priorities else 0,
        )
        self.index = OffloadIndex(
            num_chunks,
            eviction_policy,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
            max_pinned_chunks=self.tier.max_pinned_chunks if self.priorities else None,
        )
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._clock = clock
        # With a kvservice server serving the index: every call is also recorded there
        # (this index is then the engine's replica of the server's).
        self.link = link

    # -- per request --

    def _access(self, req_context: ReqContext) -> RequestAccess:
        """The request's current state in the index, made anew after a reset."""
        state: RequestAccess | None = req_context.get_state(RequestAccess)
        if state is not None and self.index.is_current(state):
            return state
        priority = self._retention(req_context).priority
        state = self.index.request_access(req_context.get_offload_key_position, priority)
        if self.link is not None:
            self.link.new_request(req_context.req_id, priority)
        req_context.set_state(state)
        return state

    def _retention(self, req_context: ReqContext) -> OffloadRetention:
        if not self.priorities:
            return _NO_RETENTION
        retention: OffloadRetention | None = req_context.get_state(OffloadRetention)
        if retention is None:
            try:
                retention = offload_retention(req_context.kv_transfer_params)
            except KVCacheError as error:
                # One malformed request never stops the engine: it runs without.
                logger.warning(
                    "request %s: offload retention ignored: %s", req_context.req_id, error
                )
                retention = _NO_RETENTION
            req_context.set_state(retention)
        return retention

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._access(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        state: RequestAccess | None = req_context.get_state(RequestAccess)
        if state is None:
            return
        keys = self.index.request_finished(state)
        if self.link is not None:
            self.link.request_finished(req_context.req_id, keys)
        ttl_s = self._retention(req_context).pin_ttl_s
        if keys and ttl_s is not None:
            self._pin_request(req_context, keys, ttl_s)

    def _pin_request(self, req_context: ReqContext, keys: list[bytes], ttl_s: float) -> None:
        # The pin is named by the prefix's last key: pinning the same prefix again
        # refreshes it rather than stacking a second pin.
        try:
            self._pin(keys[-1].hex(), keys, ttl_s)
        except KVCacheError as error:
            logger.warning("request %s: offload pin dropped: %s", req_context.req_id, error)

    # -- lookups and loads --

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP_RESULTS[self.index.lookup(key)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        keys = list(keys)
        access = self._access(req_context)
        chunk_ids = self.index.prepare_load(keys, access)
        if self.link is not None:
            self.link.prepare_load(req_context.req_id, keys, _positions(keys, access), chunk_ids)
        return CPULoadStoreSpec(chunk_ids)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self.index.touch(keys)
        if self.link is not None:
            self.link.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self.index.complete_load(keys)
        if self.link is not None:
            self.link.complete_load(keys)

    # -- stores --

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._expire_pins()
        keys = list(keys)
        access = self._access(req_context)
        plan = self.index.prepare_store(keys, access)
        if self.link is not None:
            self.link.prepare_store(
                req_context.req_id,
                keys,
                _positions(keys, access),
                None if plan is None else (plan.keys_to_store, plan.chunk_ids, plan.evicted_keys),
            )
        if plan is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=plan.keys_to_store,
            store_spec=CPULoadStoreSpec(plan.chunk_ids),
            evicted_keys=plan.evicted_keys,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        keys = list(keys)
        self.index.complete_store(keys, success)
        if self.link is not None:
            self.link.complete_store(keys, success)

    # -- pins (priority policy) --

    def pin(
        self, keys: Sequence[OffloadKey], ttl_s: float | None, pin_id: str | None = None
    ) -> str:
        """Hold ``keys`` from eviction for ``ttl_s`` seconds (None: until ``unpin``);
        the pin's id (default: the last key, in hex). QuotaExceededError past
        ``max_pinned_fraction``; InvalidArgumentError unless the policy is priority."""
        pin_id = pin_id if pin_id is not None else keys[-1].hex()
        self._pin(pin_id, keys, ttl_s)
        return pin_id

    def _pin(self, pin_id: str, keys: Sequence[OffloadKey], ttl_s: float | None) -> None:
        now = self._clock()
        try:
            self.index.pin(pin_id, keys, ttl_s, now)
        except QuotaExceededError:
            # Refused, and counted: the server's index must count it too.
            if self.link is not None:
                self.link.pin(pin_id, keys, ttl_s, now, refused=True)
            raise
        if self.link is not None:
            self.link.pin(pin_id, keys, ttl_s, now, refused=False)

    def unpin(self, pin_id: str) -> bool:
        removed = self.index.unpin(pin_id)
        if self.link is not None:
            self.link.unpin(pin_id, removed)
        return removed

    def _expire_pins(self) -> None:
        if not self.priorities:
            return
        now = self._clock()
        expired = self.index.expire_pins(now)
        if self.link is not None:
            self.link.expire_pins(now, expired)

    # -- the whole tier --

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._expire_pins()
        if self.link is not None:
            # The step's calls go to the server now; checked at the next step's end.
            self.link.flush()

    def reset_cache(self) -> None:
        self.index.reset()
        if self.link is not None:
            self.link.reset()

    def shutdown(self) -> None:
        """vLLM's scheduler shutting down: send what is left to the server serving the
        index, and end its session (the server drops the index)."""
        if self.link is not None:
            self.link.close()

    def take_events(self) -> Iterator[OffloadingEvent]:
        # A generator, as vLLM's: the batch is taken at the first next(), and a failed
        # store's keys are announced only if no retry has stored them again by then.
        for event in self.index.take_events():
            keys: Iterable[bytes] = event.keys
            if event.metadata_only:
                keys = [key for key in event.keys if not self.index.is_stored(key)]
                if not keys:
                    continue
            yield OffloadingEvent(
                keys=list(keys),
                medium=self.medium,
                removed=event.removed,
                metadata_only=event.metadata_only,
            )

    def get_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        now = self.index.take_stats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, now.usage)
        for size in now.allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, now.write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, now.read_usage)
        if now.stores_skipped is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, now.stores_skipped)
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]


class KVServiceOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``CPUOffloadingSpec`` (chunk sizing, worker, metrics) whose scheduler side
    is ``KVServiceOffloadingManager``. Reads ``eviction_policy`` (``lru``, ``arc``,
    ``priority``), ``store_threshold``, ``max_tracker_size``, ``max_pinned_fraction``
    and ``kvservice_target`` (a server to serve the index) from
    ``kv_connector_extra_config``."""

    _manager: OffloadingManager | None

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        check_eviction_policy(self.eviction_policy)
        if self.cache_policy_module_path is not None:
            raise ValueError(
                "cache_policy_module_path names an out-of-tree vLLM cache policy, which "
                "runs on vLLM's CPUOffloadingSpec only; drop it or use spec_name "
                "CPUOffloadingSpec"
            )
        self.max_pinned_fraction = float(
            self.extra_config.get("max_pinned_fraction", DEFAULT_MAX_PINNED_FRACTION)
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            manager = KVServiceOffloadingManager(
                num_chunks=self.num_chunks,
                eviction_policy=self.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=self.cpu_info,
                max_pinned_fraction=self.max_pinned_fraction,
            )
            target = self.extra_config.get("kvservice_target")
            if target:
                manager.link = open_link(manager, str(target), self.kv_bytes_per_chunk)
            self._manager = manager
        return self._manager


def _positions(keys: Sequence[bytes], access: RequestAccess) -> list[int]:
    """Each key's token position in the request, as the server's index asks for them."""
    position_of = access.position_of
    return [UNKNOWN_POSITION if (p := position_of(key)) is None else p for key in keys]


def open_link(
    manager: KVServiceOffloadingManager,
    target: str,
    bytes_per_chunk: int = 0,
    env: Mapping[str, str] | None = None,
) -> OffloadLink:
    """A session on the kvservice server at ``target`` serving ``manager``'s index;
    the other connection settings (token, TLS, lease, timeout) are the scheduler's
    ``KVSERVICE_*`` variables."""
    settings = ConnectionSettings.from_env(
        {**(os.environ if env is None else env), "KVSERVICE_TARGET": target}
    )
    client = settings.connect()
    try:
        return OffloadLink.open(
            client,
            dataclasses.replace(manager.tier, bytes_per_chunk=bytes_per_chunk),
            settings.session_ttl_s,
            "vllm offload tier",
        )
    except BaseException:
        client.close()
        raise

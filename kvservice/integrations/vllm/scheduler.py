"""``KVServiceScheduler``: vLLM's own scheduler (0.32 or 0.33) with kvservice's manager.

For ``vllm serve --scheduler-cls kvservice.integrations.vllm.KVServiceScheduler``.
Every scheduling decision is vLLM's code; only the ``KVCacheManager`` it builds is
kvservice's (``KVServiceKVCacheManager``, configured from ``KVSERVICE_*`` variables).
KV connectors (``--kv-transfer-config``, ``--kv-offloading-size``) work as with vLLM's
manager, except those that reach into vLLM's own block pool, refused by name at start
(``connectors``).

vLLM takes a named scheduler class as it is, whatever ``async_scheduling`` says, and a
subclass of its synchronous ``Scheduler`` adds no output placeholders: a running
request would get no new tokens while its previous step is in flight. So the class
the README names builds the matching variant itself, as vLLM's own
``get_scheduler_cls`` would pick: ``KVServiceAsyncScheduler`` (vLLM's
``AsyncScheduler``) when async scheduling is on, vLLM's default on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import vllm.v1.core.sched.scheduler as vllm_scheduler
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvservice.integrations.vllm.connectors import check_connector, check_connector_classes
from kvservice.integrations.vllm.manager import KVServiceKVCacheManager

_construction = threading.Lock()


@contextmanager
def _kv_cache_manager_class(cls: type) -> Iterator[None]:
    # vLLM's Scheduler.__init__ builds its manager from this module global and offers no
    # other seam; rebinding it for the length of one construction keeps every line of
    # vLLM's __init__ as it is, and builds no throwaway pool of vLLM's.
    with _construction:
        original = vllm_scheduler.KVCacheManager
        vllm_scheduler.KVCacheManager = cls
        try:
            yield
        finally:
            vllm_scheduler.KVCacheManager = original


def _vllm_config(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs.get("vllm_config", args[0] if args else None)


class KVServiceScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's v1 ``Scheduler``, unchanged, allocating through kvservice; constructed
    with async scheduling on, a ``KVServiceAsyncScheduler``."""

    kv_cache_manager: KVServiceKVCacheManager

    def __new__(cls, *args: Any, **kwargs: Any) -> KVServiceScheduler:
        vllm_config = _vllm_config(args, kwargs)
        variant = cls
        if (
            cls is KVServiceScheduler
            and vllm_config is not None
            and vllm_config.scheduler_config.async_scheduling
        ):
            variant = KVServiceAsyncScheduler
        instance: KVServiceScheduler = super().__new__(variant)
        return instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = _vllm_config(args, kwargs)
        if vllm_config is not None:
            check_connector_classes(vllm_config)
        with _kv_cache_manager_class(KVServiceKVCacheManager):
            super().__init__(*args, **kwargs)
        if self.connector is not None:
            check_connector(self.connector, self.kv_cache_config)
        if self.cache_config.enable_prefix_caching:
            # The engine seeded vLLM's hash chain (init_none_hash) before building us.
            self.kv_cache_manager.check_hashing(
                self.cache_config.prefix_caching_hash_algo, kv_cache_utils._NONE_HASH_SEED
            )

    def shutdown(self) -> None:
        super().shutdown()
        self.kv_cache_manager.close()


class KVServiceAsyncScheduler(KVServiceScheduler, AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler``, unchanged, allocating through kvservice: output
    placeholders let a request's next step be planned while its last one runs."""

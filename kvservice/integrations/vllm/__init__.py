"""vLLM 0.33's scheduler on kvservice.

``KVServiceKVCacheManager`` is vLLM's ``KVCacheManager`` interface over kvservice (the
core in-process, or a server named by ``KVSERVICE_TARGET``), and ``KVServiceScheduler``
is vLLM's own ``Scheduler`` using it::

    vllm serve MODEL --scheduler-cls kvservice.integrations.vllm.KVServiceScheduler

Importing this package imports vLLM.
"""

from kvservice.integrations.vllm.manager import KVServiceKVCacheManager
from kvservice.integrations.vllm.scheduler import KVServiceAsyncScheduler, KVServiceScheduler

__all__ = ["KVServiceAsyncScheduler", "KVServiceKVCacheManager", "KVServiceScheduler"]

"""The pure four-layer KV cache manager (no I/O, no gRPC, no torch).

Layer 1 ``KVCacheManager`` (kv_cache_manager.py) -> layer 2 ``KVCacheCoordinator``
(kv_cache_coordinator.py) -> layer 3 ``SingleTypeKVCacheManager`` per attention type
(single_type_kv_cache_manager.py) -> layer 4 ``BlockPool`` (block_pool.py).

The modules are imported compiled by mypyc unless ``KVSERVICE_PURE_PYTHON=1``; a build
that does not match these sources (or the request table's, compiled with them) is
refused, never used (see ``compiled.py``).
"""

from kvservice.core.compiled import activate

COMPILED: bool = activate("core", __path__)
"""Whether this process runs the mypyc-compiled core (False: the sources)."""

"""The pure four-layer KV cache manager (no I/O, no gRPC, no torch).

Layer 1 ``KVCacheManager`` (kv_cache_manager.py) -> layer 2 ``KVCacheCoordinator``
(kv_cache_coordinator.py) -> layer 3 ``SingleTypeKVCacheManager`` per attention type
(single_type_kv_cache_manager.py) -> layer 4 ``BlockPool`` (block_pool.py).
"""

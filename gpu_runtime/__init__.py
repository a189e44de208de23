"""The co-located GPU runtime: owns the KV tensors, zeroes new blocks, applies
copy-on-write copies and runs paged attention.

Depends on ``kvservice.core`` (block ids, KV cache config), never the reverse: the
core stays free of torch. Modules, one job each:

* ``kv_cache``: the KV tensors and their layout (``PagedKVCache``).
* ``ops``: slot writes (vLLM's ``reshape_and_cache``), block zeroing and block copies.
* ``attention``: the metadata of one step and the paged-attention backends.
* ``runtime``: ``KVCacheRuntime``, what a server calls once per scheduler step.
* ``model``: a tiny transformer with fixed random weights for end-to-end checks.
"""

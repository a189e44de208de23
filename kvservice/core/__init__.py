"""The pure four-layer KV cache manager (no I/O, no gRPC, no torch).

Layer 1 ``KVCacheManager`` (kv_cache_manager.py) -> layer 2 ``KVCacheCoordinator``
(kv_cache_coordinator.py) -> layer 3 ``SingleTypeKVCacheManager`` per attention type
(single_type_kv_cache_manager.py) -> layer 4 ``BlockPool`` (block_pool.py).

The modules are imported compiled by mypyc unless ``KVSERVICE_PURE_PYTHON=1``; a build
that does not match these sources (or those of any package compiled with them) is
refused, never used (see ``compiled.py``).
"""

from kvservice.core.compiled import activate

# The modules mypyc leaves as sources (``compiled.py`` reads this line; this file always
# stays one). compiled.py runs before the build is on the path. errors.py: mypyc cannot
# make its exception classes native (nothing to gain), and drops their class attributes
# unless declared ClassVar (which the server's per-instance ``status`` rules out).
# invariants.py subclasses AssertionError, which mypyc refuses; it runs once per audit,
# not per block.
NOT_COMPILED = ("compiled.py", "errors.py", "invariants.py")

COMPILED: bool = activate("core", __path__)
"""Whether this process runs the mypyc-compiled core (False: the sources)."""

"""The request table: what vLLM's scheduler keeps around its ``KVCacheManager`` (the
requests by tenant and id, their computed tokens and status, the prefix hit carried
from lookup to allocation), with every argument checked before anything changes. No
I/O: the gRPC server and the scheduler's in-process backend both run on it.

``table`` (``RequestTable``, the requests and the calls on them), ``types`` (what it
takes and answers), ``admission`` (``Admit``: a step's admissions over the table),
``tenancy`` (tenants' keys, salts and block quotas), ``runtime_sync`` (the co-located
KV tensors kept in step with the block table), ``reporting`` (metrics and KV events),
``errors``.

Compiled by mypyc with the core, as one build (``kvservice.core.compiled``): imported
compiled unless ``KVSERVICE_PURE_PYTHON=1``, and refused when it does not match the
sources.
"""

from kvservice.core.compiled import activate

# The modules mypyc leaves as sources (``kvservice.core.compiled`` reads this line; this
# file always stays one). errors.py, for the core's errors.py's reason (its ``status``
# class attributes); tenant_keys.py, whose ``TenantRequestId`` subclasses ``str``, which
# mypyc refuses for a native class ("Inheriting from most builtin types is
# unimplemented"; its ``native_class=False`` escape needs mypy_extensions at run time).
NOT_COMPILED = ("errors.py", "tenant_keys.py")

COMPILED: bool = activate("request_table", __path__)
"""Whether this process runs the compiled request table (False: the sources)."""

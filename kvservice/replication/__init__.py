"""Where the client's vocabulary meets the core's, for the replicas of a server's pool
that schedulers keep (the reference scheduler's replicated backends, vLLM's remote
link) and for in-process runs: ``retention`` translates retention both ways;
``server_requests`` tracks what a server has of each request of a replica.

``server_requests`` runs once per request of a remote step, so it is compiled by mypyc
with the core, the client and the server, as one build (``kvservice.core.compiled``):
imported compiled unless ``KVSERVICE_PURE_PYTHON=1``, and refused when the build does
not match the sources.
"""

# The build module only (standard library; importing it activates the core's build,
# loading none of the core's modules).
from kvservice.core.compiled import activate

# The modules mypyc leaves as sources (``kvservice.core.compiled`` reads this line; this
# file always stays one): ``retention``, which runs once per retention change or
# request with retention, not once per operation.
NOT_COMPILED = ("retention.py",)

COMPILED: bool = activate("replication", __path__)
"""Whether this process runs the compiled request tracking (False: the sources)."""

from kvservice.replication.retention import (
    client_retention,
    core_retention,
    core_retention_event,
)
from kvservice.replication.server_requests import ServerRequests

__all__ = ["ServerRequests", "client_retention", "core_retention", "core_retention_event"]

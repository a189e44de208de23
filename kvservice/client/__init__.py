"""Python clients for kvservice: no protobuf in sight.

``AsyncKVClient`` (grpc.aio) and ``KVClient`` (blocking) have the same typed methods
(``add_request``, ``get_computed_blocks``, ``allocate_slots``, ``free``, ``probe``,
``step``...), return the dataclasses of ``types``, answer ``None`` for "no room" as
vLLM does, and raise the typed errors of ``errors``. ``StepBuilder`` batches one
scheduling step; ``client.session()`` runs steps over one long-lived stream;
``subscribe_events`` follows the KV events (``events``; ``CachedBlocksView`` folds
them).

What runs once per request of a remote step is compiled by mypyc with the core, as one
build (``kvservice.core.compiled``): ``step_log`` (recording a scheduler's calls with
its replica's answers), ``step_link`` (checking the server's answers against them) and
``_wire`` (the protobuf conversions, with the columnar checks). Imported compiled unless
``KVSERVICE_PURE_PYTHON=1``, and refused when the build does not match the sources.
"""

# The build module only (standard library; importing it activates the core's build,
# loading none of the core's modules): the client's layering allows only ``protocol``.
from kvservice.core.compiled import activate

# The modules mypyc leaves as sources (``kvservice.core.compiled`` reads this line; this
# file always stays one): the transports, sessions and events (per call or stream, not
# per request: nothing measured to gain), the typed errors (mypyc cannot make exception
# classes native, see the core's), the public dataclasses (``types``, not measured), and
# ``step``, whose generic NamedTuple handles and abstract sessions the transports
# build on (mypyc's native classes would refuse their interpreted subclasses).
NOT_COMPILED = (
    "aio.py",
    "errors.py",
    "events.py",
    "offload_link.py",
    "step.py",
    "step_socket.py",
    "sync.py",
    "types.py",
)

COMPILED: bool = activate("client", __path__)
"""Whether this process runs the compiled step recording and checking (False: the
sources)."""

from kvservice.client.aio import AsyncKVClient, AsyncLease, AsyncPendingStep, AsyncSession
from kvservice.client.errors import (
    FailedPreconditionError,
    InsecureTokenError,
    InvalidArgumentError,
    KVServiceError,
    NotRunError,
    OutOfRangeError,
    PermissionDeniedError,
    RequestExistsError,
    RequestNotFoundError,
    ResourceExhaustedError,
    ServiceUnavailableError,
    StaleHitError,
    SubscriberDroppedError,
    UnauthenticatedError,
)
from kvservice.client.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlockHash,
    CachedBlocksView,
    CacheSnapshot,
    EventStreamItem,
    KVEvent,
)
from kvservice.client.step import (
    OpHandle,
    PendingStep,
    RunHandle,
    StepBuilder,
    StepResults,
    StepSession,
)
from kvservice.client.step_socket import SocketSession
from kvservice.client.sync import KVClient, Lease, Session
from kvservice.client.types import (
    AdmitOptions,
    AdmitResult,
    AdmitStopReason,
    Admitted,
    AllocateOptions,
    Allocation,
    AuditReport,
    BlockIds,
    CacheConfig,
    ComputedBlocks,
    FreeMode,
    FreeResult,
    KVCacheGroup,
    MultiModalFeature,
    Pin,
    PinList,
    ProbeOptions,
    ProbeResult,
    RequestState,
    RequestStateOmittedError,
    RequestStatus,
    Retention,
    TokenRangeRetention,
    Usage,
)

__all__ = [
    "AdmitOptions",
    "AdmitResult",
    "AdmitStopReason",
    "Admitted",
    "AllBlocksCleared",
    "AllocateOptions",
    "Allocation",
    "AsyncKVClient",
    "AsyncLease",
    "AsyncPendingStep",
    "AsyncSession",
    "AuditReport",
    "BlockIds",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheSnapshot",
    "CachedBlockHash",
    "CachedBlocksView",
    "ComputedBlocks",
    "EventStreamItem",
    "FailedPreconditionError",
    "FreeMode",
    "FreeResult",
    "InsecureTokenError",
    "InvalidArgumentError",
    "KVCacheGroup",
    "KVClient",
    "KVEvent",
    "KVServiceError",
    "Lease",
    "MultiModalFeature",
    "NotRunError",
    "OpHandle",
    "OutOfRangeError",
    "PendingStep",
    "PermissionDeniedError",
    "Pin",
    "PinList",
    "ProbeOptions",
    "ProbeResult",
    "RequestExistsError",
    "RequestNotFoundError",
    "RequestState",
    "RequestStateOmittedError",
    "RequestStatus",
    "ResourceExhaustedError",
    "Retention",
    "RunHandle",
    "ServiceUnavailableError",
    "Session",
    "SocketSession",
    "StaleHitError",
    "StepBuilder",
    "StepResults",
    "StepSession",
    "SubscriberDroppedError",
    "TokenRangeRetention",
    "UnauthenticatedError",
    "Usage",
]

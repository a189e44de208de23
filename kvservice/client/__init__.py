"""Python clients for kvservice: no protobuf in sight.

``AsyncKVClient`` (grpc.aio) and ``KVClient`` (blocking) have the same typed methods
(``add_request``, ``get_computed_blocks``, ``allocate_slots``, ``free``, ``probe``,
``step``...), return the dataclasses of ``types``, answer ``None`` for "no room" as
vLLM does, and raise the typed errors of ``errors``. ``StepBuilder`` batches one
scheduling step; ``client.session()`` runs steps over one long-lived stream;
``subscribe_events`` follows the KV events (``events``; ``CachedBlocksView`` folds
them).
"""

from kvservice.client.aio import AsyncKVClient, AsyncLease, AsyncPendingStep, AsyncSession
from kvservice.client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVServiceError,
    NotRunError,
    OutOfRangeError,
    RequestExistsError,
    RequestNotFoundError,
    ServiceUnavailableError,
    StaleHitError,
    SubscriberDroppedError,
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
from kvservice.client.step import OpHandle, StepBuilder, StepResults
from kvservice.client.sync import KVClient, Lease, PendingStep, Session
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
    ProbeOptions,
    ProbeResult,
    RequestState,
    RequestStateOmittedError,
    RequestStatus,
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
    "ProbeOptions",
    "ProbeResult",
    "RequestExistsError",
    "RequestNotFoundError",
    "RequestState",
    "RequestStateOmittedError",
    "RequestStatus",
    "ServiceUnavailableError",
    "Session",
    "StaleHitError",
    "StepBuilder",
    "StepResults",
    "SubscriberDroppedError",
    "Usage",
]

"""The reference scheduler: vLLM's scheduling loop over a ``Backend`` (in-process,
remote unary, remote batched ``Step`` or ``StepStream``), and run traces that replay
its allocator calls."""

from kvservice.scheduler.backend import (
    AdmittedIds,
    AllocatedIds,
    Backend,
    BlockIds,
    InProcessBackend,
    PendingBlockIds,
    PrefixHit,
    RemoteBackend,
    resolve_ids,
)
from kvservice.scheduler.batched import (
    BatchingBackend,
    PredictionError,
    StepBackend,
    StreamBackend,
)
from kvservice.scheduler.loop import (
    Policy,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    StepRecord,
)
from kvservice.scheduler.trace import (
    Trace,
    TraceEntry,
    TraceMismatchError,
    TracingBackend,
    check_replay,
    read_trace,
    replay,
    write_trace,
)

__all__ = [
    "AdmittedIds",
    "AllocatedIds",
    "Backend",
    "BatchingBackend",
    "BlockIds",
    "InProcessBackend",
    "PendingBlockIds",
    "Policy",
    "PredictionError",
    "PrefixHit",
    "RemoteBackend",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "StepBackend",
    "StepRecord",
    "StreamBackend",
    "Trace",
    "TraceEntry",
    "TraceMismatchError",
    "TracingBackend",
    "check_replay",
    "read_trace",
    "replay",
    "resolve_ids",
    "write_trace",
]

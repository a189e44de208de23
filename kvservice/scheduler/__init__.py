"""The reference scheduler: vLLM's scheduling loop over a ``Backend`` (in-process or
remote), and run traces that replay its allocator calls."""

from kvservice.scheduler.backend import (
    Backend,
    BlockIds,
    InProcessBackend,
    PrefixHit,
    RemoteBackend,
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
    "Backend",
    "BlockIds",
    "InProcessBackend",
    "Policy",
    "PrefixHit",
    "RemoteBackend",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "StepRecord",
    "Trace",
    "TraceEntry",
    "TraceMismatchError",
    "TracingBackend",
    "check_replay",
    "read_trace",
    "replay",
    "write_trace",
]

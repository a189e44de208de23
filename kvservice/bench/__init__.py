"""``kvservice bench`` and ``kvservice demo``: the reference scheduler in-process and
over gRPC (unary, batched ``Step``, ``StepStream``), measured side by side, and a
short guided run against a server with the co-located runtime."""

from kvservice.bench.runner import (
    IN_PROCESS,
    MODES,
    WORKLOAD_KINDS,
    BenchConfig,
    ModeResult,
    PoolResult,
    build_workload,
    run_bench,
)

__all__ = [
    "IN_PROCESS",
    "MODES",
    "WORKLOAD_KINDS",
    "BenchConfig",
    "ModeResult",
    "PoolResult",
    "build_workload",
    "run_bench",
]

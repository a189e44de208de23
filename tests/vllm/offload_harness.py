"""vLLM 0.33's ``OffloadingConnector`` without a GPU: the scheduler side as the engine
builds it, and a fake worker that finishes its transfers on seeded schedules.

The connector's worker (``CPUOffloadingWorker``) copies between GPU and host memory and
needs CUDA; its scheduler side runs anywhere. ``FakeOffloadWorker`` plays the worker:
it reads each step's ``OffloadingConnectorMetadata`` and reports jobs done in later
steps' ``KVConnectorOutput`` as the real worker does (``completed_jobs`` for every job,
``finished_recving`` for asynchronous loads), with seeded delays, flushes done at once,
and seeded load failures reported as ``invalid_block_ids`` (by request,
``failed_recving``, with several KV cache groups). Its schedule depends only on
job ids and the step, so twin schedulers that decide alike see the same worker.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from tests.vllm.async_harness import EngineOrderWorkload
from tests.vllm.scheduler_harness import Workload, model_runner_output


@dataclass
class _Job:
    due_step: int
    load_req_id: str | None  # an asynchronous load's request; None for the rest
    failed_blocks: tuple[int, ...]


@dataclass
class FakeOffloadWorker:
    """The connector's worker side, as the scheduler sees it (see the module docstring).
    ``max_delay``: a job finishes 0 to ``max_delay`` steps after it is handed out;
    ``load_failure_rate``: the share of asynchronous loads whose blocks fail."""

    seed: int
    max_delay: int = 3
    load_failure_rate: float = 0.0
    # vLLM takes block-level failures only with one KV cache group; with more, a
    # failed load is reported by request (failed_recving).
    by_request: bool = False
    step: int = 0
    _jobs: dict[int, _Job] = field(default_factory=dict)

    def _rng(self, job_id: int) -> random.Random:
        return random.Random(f"{self.seed}:{job_id}")

    def run(self, meta: Any) -> KVConnectorOutput:
        """Take this step's jobs and report those done by its end."""
        self.step += 1
        if isinstance(meta, OffloadingConnectorMetadata):
            self._submit(meta)
        done = sorted(job_id for job_id, job in self._jobs.items() if job.due_step <= self.step)
        finished_recving: set[str] = set()
        failed_recving: set[str] = set()
        invalid: set[int] = set()
        for job_id in done:
            job = self._jobs.pop(job_id)
            if job.load_req_id is not None:
                finished_recving.add(job.load_req_id)
                if job.failed_blocks and self.by_request:
                    failed_recving.add(job.load_req_id)
            if not self.by_request:
                invalid.update(job.failed_blocks)
        worker_meta = (
            OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(done, 1)) if done else None
        )
        return KVConnectorOutput(
            finished_recving=finished_recving or None,
            invalid_block_ids=invalid,
            failed_recving=failed_recving,
            kv_connector_worker_meta=worker_meta,
        )

    def _submit(self, meta: OffloadingConnectorMetadata) -> None:
        for job_id in sorted(meta.store_jobs):
            self._jobs[job_id] = _Job(self._due(job_id), None, ())
        for job_id, job in sorted(meta.load_jobs.items()):
            failed = self._rng(job_id).random() < self.load_failure_rate
            blocks = tuple(int(b) for b in job.dst_spec.block_ids) if failed else ()
            if job.sync:
                # Completed before this step's forward pass; a failure is reported by
                # block (vLLM then evicts the blocks, hashed at allocation).
                self._jobs[job_id] = _Job(self.step, None, () if self.by_request else blocks)
                continue
            self._jobs[job_id] = _Job(self._due(job_id), job.req_id, blocks)
        for job_id in meta.jobs_to_flush or ():
            # The worker waits for a flushed job before the step runs.
            if job_id in self._jobs:
                self._jobs[job_id].due_step = self.step

    def _due(self, job_id: int) -> int:
        return self.step + self._rng(job_id).randrange(self.max_delay + 1)


def _spec(spec: Any) -> tuple[Any, ...]:
    return (type(spec).__name__, tuple(int(b) for b in spec.block_ids))


def connector_snapshot(meta: Any) -> Any:
    """A step's transfers: every load and store with its GPU blocks and CPU chunks."""
    if not isinstance(meta, OffloadingConnectorMetadata):
        return None

    def jobs(table: dict[int, Any]) -> list[Any]:
        return [
            (job_id, job.req_id, _spec(job.src_spec), _spec(job.dst_spec), job.sync)
            for job_id, job in sorted(table.items())
        ]

    return {
        "loads": jobs(meta.load_jobs),
        "stores": jobs(meta.store_jobs),
        "flush": sorted(meta.jobs_to_flush or ()),
    }


@dataclass
class OffloadWorkload(Workload):
    """``Workload`` on a scheduler with the offloading connector: each step's model
    output carries the fake worker's report (fixed when the step is planned, as the
    worker runs the step's transfers with it), and each snapshot the step's transfers,
    the requests waiting for a load and every KV event published (the GPU pool's and
    the offload tier's)."""

    max_delay: int = 3
    load_failure_rate: float = 0.0
    _worker: FakeOffloadWorker | None = None
    _recorder: EventRecorder | None = None

    def begin(self, scheduler: Any) -> None:
        self._worker = FakeOffloadWorker(
            self.seed,
            self.max_delay,
            self.load_failure_rate,
            by_request=len(scheduler.kv_cache_config.kv_cache_groups) > 1,
        )
        self._recorder = scheduler.kv_event_publisher = EventRecorder()

    def runner_output(self, scheduler: Any, output: Any, step: dict[str, Any]) -> Any:
        assert self._worker is not None
        step["transfers"] = connector_snapshot(output.kv_connector_metadata)
        step["waiting_for_kv"] = sorted(
            r.request_id
            # vLLM keeps the requests holding KV blocks apart from the plain waiting ones.
            for r in (*scheduler.waiting, *scheduler.kv_holding_waiting)
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )
        runner_output = model_runner_output(scheduler, output)
        runner_output.kv_connector_output = self._worker.run(output.kv_connector_metadata)
        return runner_output

    def finish_step(self, scheduler: Any, step: dict[str, Any], engine_outputs: Any) -> None:
        assert self._recorder is not None
        step["stats"] = _offload_stats(engine_outputs)
        step["events"] = self._recorder.take()


class EngineOrderOffloadWorkload(OffloadWorkload, EngineOrderWorkload):
    """``OffloadWorkload`` in the engine's batch-queue order (async scheduling)."""


def _offload_stats(engine_outputs: Any) -> Any:
    for outputs in engine_outputs.values():
        stats = outputs.scheduler_stats
        if stats is not None:
            p = stats.prefix_cache_stats
            c = stats.connector_prefix_cache_stats
            return (
                stats.kv_cache_usage,
                (p.requests, p.queries, p.hits, p.preempted_requests),
                None if c is None else (c.requests, c.queries, c.hits),
            )
    return None


class EventRecorder:
    """Stands in for the scheduler's KV event publisher: keeps what each step
    publishes, the GPU pool's events and the offload tier's (``medium="CPU"``)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def take(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def shutdown(self) -> None:
        pass

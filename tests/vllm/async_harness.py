"""vLLM's scheduler driven as its engine drives it with async scheduling.

``EngineCore.step_with_batch_queue`` keeps two steps in flight: it plans step N+1
before it hands step N's model output to ``update_from_output``, so a running request
is scheduled on output placeholders, its outputs may arrive after it was preempted or
aborted (stale), and the manager is asked for blocks for tokens not yet computed.
``BatchQueueWorkload`` replays that order on the seeded traffic of ``Workload``.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from vllm.v1.outputs import ModelRunnerOutput

from tests.vllm.scheduler_harness import Workload, _stats, sampled_token, snapshot

BATCH_QUEUE_SIZE = 2


def model_runner_output(scheduler: Any, output: Any) -> Any:
    """The fake model's output for ``output``, fixed when the step is planned (as the
    real model's inputs are): one token at the request's next position for each request
    whose step is not a partial prefill chunk."""
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = not request.is_prefill_chunk
        sampled.append([sampled_token(req_id, request.num_computed_tokens)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


class BatchQueueWorkload(Workload):
    """``Workload``'s traffic in the engine's batch-queue order (two steps in flight)."""

    def run(self, scheduler: Any, max_steps: int = 4000, stop_early: bool = False) -> list[Any]:
        rng = random.Random(self.seed + 1)
        pending = list(self._specs)
        in_flight: deque[tuple[Any, Any, dict[str, Any]]] = deque()
        trace: list[Any] = []
        for _ in range(max_steps):
            for _ in range(rng.randrange(*self.arrivals_per_step)):
                if pending:
                    scheduler.add_request(pending.pop(0).build(self.hash_block_size))
            self._maybe_abort(scheduler, rng)
            if not pending and not scheduler.has_requests() and not in_flight:
                return trace
            if scheduler.has_requests():
                output = scheduler.schedule()
                step = snapshot(scheduler, output)
                trace.append(step)
                in_flight.appendleft((output, model_runner_output(scheduler, output), step))
                executed = output.total_num_scheduled_tokens > 0
                if len(in_flight) < BATCH_QUEUE_SIZE and (executed or scheduler.has_requests()):
                    continue
            elif not in_flight:
                continue
            output, runner_output, step = in_flight.pop()
            self._maybe_abort(scheduler, rng)
            step["stats"] = _stats(scheduler.update_from_output(output, runner_output))
        if stop_early:
            return trace
        raise AssertionError(f"workload {self.seed} did not finish in {max_steps} iterations")

"""vLLM's scheduler driven in its engine's order, with async scheduling and with
speculative decoding.

``EngineCore.step_with_batch_queue`` keeps two steps in flight: it plans step N+1
before it hands step N's model output to ``update_from_output``, so a running request
is scheduled on output placeholders, its outputs may arrive after it was preempted or
aborted (stale), and the manager is asked for blocks for tokens not yet computed.
With draft tokens, each step verifies the drafts scheduled for it: a seeded share of
them is accepted, the rest rolls back (``num_computed_tokens`` goes back), and the
synchronous engine hands the next drafts over after the step
(``update_draft_token_ids``); the asynchronous one schedules on draft placeholders.
``EngineOrderWorkload`` replays that on the seeded traffic of ``Workload``.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from vllm.v1.outputs import DraftTokenIds

from tests.vllm.scheduler_harness import Workload, sampled_token, snapshot


def draft_token_ids(scheduler: Any, output: Any, num_drafts: int) -> Any:
    """The drafter's proposals after a synchronous step, for each request it ran (vLLM
    drops them for finished requests and prefill chunks)."""
    req_ids = [req_id for req_id in output.num_scheduled_tokens if req_id in scheduler.requests]
    return DraftTokenIds(
        req_ids,
        [[sampled_token(req_id, -1 - i) for i in range(num_drafts)] for req_id in req_ids],
    )


class EngineOrderWorkload(Workload):
    """``Workload``'s traffic in the engine's order: ``batch_queue_size`` steps in
    flight (2: async scheduling), ``num_drafts`` draft tokens a step (0: none)."""

    batch_queue_size: int = 2
    num_drafts: int = 0

    def configure(self, batch_queue_size: int, num_drafts: int) -> EngineOrderWorkload:
        self.batch_queue_size = batch_queue_size
        self.num_drafts = num_drafts
        return self

    def run(self, scheduler: Any, max_steps: int = 4000, stop_early: bool = False) -> list[Any]:
        self.begin(scheduler)
        rng = random.Random(self.seed + 1)
        pending = list(self._specs)
        in_flight: deque[tuple[Any, Any, dict[str, Any]]] = deque()
        trace: list[Any] = []
        for _ in range(max_steps):
            for _ in range(rng.randrange(*self.arrivals_per_step)):
                if pending:
                    scheduler.add_request(
                        pending.pop(0).build(self.hash_block_size, self.hash_lookahead)
                    )
            self._maybe_abort(scheduler, rng)
            if not pending and not scheduler.has_requests() and not in_flight:
                return trace
            if scheduler.has_requests():
                output = scheduler.schedule()
                step = snapshot(scheduler, output)
                step["drafts"] = dict(output.scheduled_spec_decode_tokens)
                trace.append(step)
                in_flight.appendleft((output, self.runner_output(scheduler, output, step), step))
                executed = output.total_num_scheduled_tokens > 0
                if len(in_flight) < self.batch_queue_size and (
                    executed or scheduler.has_requests()
                ):
                    continue
            elif not in_flight:
                continue
            output, runner_output, step = in_flight.pop()
            self._maybe_abort(scheduler, rng)
            self.finish_step(scheduler, step, scheduler.update_from_output(output, runner_output))
            if self.num_drafts and self.batch_queue_size == 1:
                scheduler.update_draft_token_ids(
                    draft_token_ids(scheduler, output, self.num_drafts)
                )
        if stop_early:
            return trace
        raise AssertionError(f"workload {self.seed} did not finish in {max_steps} iterations")

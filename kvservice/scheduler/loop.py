"""vLLM's scheduling loop (``Scheduler.schedule`` + ``update_from_output``) in our own
code, over any ``Backend``.

One step: requests that have arrived join the waiting queue; running requests are
scheduled first, each for its remaining tokens within the step's token budget,
preempting the lowest-priority running request while ``allocate_slots`` has no room;
if nothing was preempted, waiting requests are admitted in queue order (prefix lookup,
then ``allocate_slots`` with ``full_sequence_must_fit``) until one does not fit, all in
one ``Backend.admit`` call (a remote backend runs them next to the pool). Then
each request whose prompt is fully computed samples one token from a seeded RNG and
finishes at its ``max_output_tokens``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvservice.client import BlockIds
from kvservice.client.types import AdmitOptions, Retention, TokenRangeRetention
from kvservice.scheduler.backend import Backend
from kvservice.workloads.specs import RequestSpec


class Policy(enum.Enum):
    """Which running request is preempted first, and which waiting one admitted first."""

    FCFS = "fcfs"  # preempt the last admitted; admit in arrival order
    PRIORITY = "priority"  # preempt the highest priority value, latest arrival


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's knobs, named after vLLM's ``SchedulerConfig`` where they match."""

    max_model_len: int
    max_num_batched_tokens: int = 512
    max_num_running_reqs: int = 64
    enable_chunked_prefill: bool = True
    full_sequence_must_fit: bool = True
    num_lookahead_tokens: int = 0
    policy: Policy = Policy.FCFS
    vocab_size: int = 32_000
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    num_new_tokens: int  # tokens computed this step (the prefix hit excluded)
    num_hit_tokens: int  # tokens the prefix cache supplied (admissions only)
    new_block_ids: BlockIds


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step decided, as plain data comparable across backends."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]


# Compared by identity: the queues find requests by ``is`` (comparing specs field by
# field made queue scans quadratic in the prompt lengths).
@dataclass(slots=True, eq=False)
class _Tracked:
    """The scheduler's own state of one request (vLLM's scheduler-side ``Request``)."""

    spec: RequestSpec
    order: int  # arrival order, the tie breaker after arrival_step
    num_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def preemption_key(self) -> tuple[int, int, int]:
        # The priority policy evicts the largest key: least important, latest arrival.
        return (self.spec.priority, self.spec.arrival_step, self.order)


@dataclass(slots=True)
class _StepPlan:
    """The scheduled part of a step being built; dicts keep scheduling order."""

    token_budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    """vLLM's scheduling loop over a ``Backend``; ``step`` runs one iteration.

    The same code drives the in-process and the remote backend, so two runs of one
    workload, config and seed make the same decisions on either.
    """

    def __init__(
        self, backend: Backend, config: SchedulerConfig, specs: Iterable[RequestSpec]
    ) -> None:
        self.backend = backend
        self.config = config
        self._rng = random.Random(config.seed)
        self._pending = sorted(specs, key=lambda s: s.arrival_step)
        self._num_arrived = 0
        self.waiting: list[_Tracked] = []
        self.running: list[_Tracked] = []
        self.step_index = 0
        self.finished_order: list[str] = []
        self._admit_options = AdmitOptions(
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=config.num_lookahead_tokens,
            full_sequence_must_fit=config.full_sequence_must_fit,
        )

    @property
    def done(self) -> bool:
        """Whether every request has arrived and finished."""
        return self._num_arrived == len(self._pending) and not self.waiting and not self.running

    def run(self, max_steps: int = 100_000) -> list[StepRecord]:
        """Step until every request has finished; raises if ``max_steps`` is not enough."""
        records: list[StepRecord] = []
        while not self.done:
            if len(records) >= max_steps:
                raise RuntimeError(f"the workload did not finish in {max_steps} steps")
            records.append(self.step())
        self.backend.flush()  # the last step's frees
        return records

    def step(self) -> StepRecord:
        """One scheduling iteration: arrivals, schedule, sample, finish (the clock
        first jumps to the next arrival when nothing is waiting or running)."""
        self._skip_idle_steps()
        self._admit_arrivals()
        # At the top of vLLM's schedule(): before the running requests' allocations.
        self.backend.new_step_starts()
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # As vLLM: a step that had to preempt admits nobody (the memory is contended).
        if not plan.preempted:
            self._schedule_waiting(plan)
        # The step's decisions are made (a replicated backend sends them here); the
        # forward pass's appends and frees belong to the next step's message.
        self.backend.end_step()
        finished = self._update_from_output(plan)
        scheduled = tuple(plan.scheduled.values())
        record = StepRecord(self.step_index, scheduled, tuple(plan.preempted), finished)
        self.step_index += 1
        return record

    def abort_all(self) -> None:
        """Free every request the backend knows (running, preempted or waiting), for a
        run cut short; the pool ends as it would after the workload finished."""
        for request in [*self.running, *self.waiting]:
            self.backend.free(request.request_id)
        self.running.clear()
        self.waiting.clear()
        self.backend.flush()

    # -- arrivals ---------------------------------------------------------------------

    def _skip_idle_steps(self) -> None:
        # Nothing to do until the next arrival: jump the clock rather than step empty.
        if not self.waiting and not self.running and self._num_arrived < len(self._pending):
            next_arrival = self._pending[self._num_arrived].arrival_step
            self.step_index = max(self.step_index, next_arrival)

    def _admit_arrivals(self) -> None:
        while (
            self._num_arrived < len(self._pending)
            and self._pending[self._num_arrived].arrival_step <= self.step_index
        ):
            spec = self._pending[self._num_arrived]
            self.backend.add_request(spec.request_id, spec.prompt_token_ids, _retention(spec))
            self.waiting.append(_Tracked(spec, self._num_arrived, len(spec.prompt_token_ids)))
            self._num_arrived += 1

    # -- running requests ---------------------------------------------------------------

    def _num_new_tokens(self, request: _Tracked, token_budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        # The last position of the context window never needs computing: no token follows.
        room = self.config.max_model_len - 1 - request.num_computed_tokens
        return max(min(remaining, token_budget, room), 0)

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            num_preempted = len(plan.preempted)
            num_new_tokens = self._num_new_tokens(request, plan.token_budget)
            if num_new_tokens == 0:
                index += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new_tokens, plan)
            if new_block_ids is None:
                break  # the request preempted itself: nothing more fits this step
            plan.scheduled[request.request_id] = ScheduledRequest(
                request.request_id, num_new_tokens, 0, new_block_ids
            )
            plan.token_budget -= num_new_tokens
            if len(plan.preempted) == num_preempted:
                index += 1
            else:
                # A preempted, already scheduled request shifted the list left.
                index = self.running.index(request) + 1

    def _allocate_or_preempt(
        self, request: _Tracked, num_new_tokens: int, plan: _StepPlan
    ) -> BlockIds | None:
        """Allocate for a running request, preempting others until it fits; None when
        it had to preempt itself."""
        while True:
            new_block_ids = self.backend.allocate_slots(
                request.request_id,
                num_new_tokens,
                num_lookahead_tokens=self.config.num_lookahead_tokens,
            )
            if new_block_ids is not None:
                return new_block_ids
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _pick_victim(self) -> _Tracked:
        if self.config.policy is Policy.PRIORITY:
            return max(self.running, key=lambda r: r.preemption_key)
        return self.running[-1]  # FCFS: the last admitted

    def _preempt(self, victim: _Tracked, plan: _StepPlan) -> None:
        self.running.remove(victim)
        scheduled = plan.scheduled.pop(victim.request_id, None)
        if scheduled is not None:
            # Its blocks are gone, so its share of this step is given back.
            plan.token_budget += scheduled.num_new_tokens
        self.backend.free(victim.request_id, preempt=True)
        # Re-prefill from token 0, usually hitting its own freed, still-cached blocks.
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        plan.preempted.append(victim.request_id)
        if self.config.policy is Policy.FCFS:
            self.waiting.insert(0, victim)  # first in line again
        else:
            self.waiting.append(victim)  # the priority order places it

    # -- waiting requests ---------------------------------------------------------------

    def _admission_order(self, limit: int) -> list[_Tracked]:
        """The first ``limit`` waiting requests in the order admission tries them."""
        if self.config.policy is Policy.PRIORITY:
            # Unique keys: the order repeatedly taking the smallest key would give.
            return sorted(self.waiting, key=lambda r: r.preemption_key)[:limit]
        return self.waiting[:limit]

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        num_slots = self.config.max_num_running_reqs - len(self.running)
        if not self.waiting or plan.token_budget <= 0 or num_slots <= 0:
            return
        candidates = self._admission_order(num_slots)
        admitted = self.backend.admit(
            [request.request_id for request in candidates],
            plan.token_budget,
            self._admit_options,
        )
        if [item.request_id for item in admitted] != [
            request.request_id for request in candidates[: len(admitted)]
        ]:
            raise RuntimeError("admit answered requests other than a prefix of those asked")
        for request, item in zip(candidates, admitted, strict=False):
            self.running.append(request)
            request.num_computed_tokens = item.num_hit_tokens
            plan.scheduled[request.request_id] = ScheduledRequest(
                request.request_id, item.num_new_tokens, item.num_hit_tokens, item.new_block_ids
            )
            plan.token_budget -= item.num_new_tokens
        if admitted:
            taken = {request.request_id for request in candidates[: len(admitted)]}
            self.waiting = [r for r in self.waiting if r.request_id not in taken]

    # -- after the forward pass ---------------------------------------------------------

    def _update_from_output(self, plan: _StepPlan) -> tuple[str, ...]:
        finished: list[str] = []
        by_id = {r.request_id: r for r in self.running}
        for scheduled in plan.scheduled.values():
            request = by_id[scheduled.request_id]
            request.num_computed_tokens += scheduled.num_new_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a partial prefill chunk samples nothing
            if self._sample(request):
                finished.append(request.request_id)
        self.finished_order.extend(finished)
        return tuple(finished)

    def _sample(self, request: _Tracked) -> bool:
        """Sample one token; True when that finished the request (freed, dropped)."""
        token = self._rng.randrange(self.config.vocab_size)
        request.num_output_tokens += 1
        request.num_tokens += 1
        if (
            request.num_output_tokens >= request.spec.max_output_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            # The last token is never computed, so the backend need not hear of it.
            self.running.remove(request)
            self.backend.free(request.request_id)
            return True
        self.backend.append_tokens(request.request_id, [token])
        return False


def _retention(spec: RequestSpec) -> Retention | None:
    """The eviction priority ``spec`` asks for its shared prefix (None: none)."""
    if spec.prefix_priority is None or spec.prefix_len <= 0:
        return None
    return Retention((TokenRangeRetention(0, spec.prefix_len, spec.prefix_priority),))

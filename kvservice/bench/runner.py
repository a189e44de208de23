"""The benchmark's measurements: one workload through the reference scheduler in every
mode (in-process, remote unary, remote batched ``Step``, remote ``StepStream``), in
rounds that alternate the modes so that machine noise hits all of them alike.

An untimed in-process reference run comes first: it counts the request-table operations
per step and records the prefix hit rate, preemptions and usage over time (the
decisions, hence these, are the same in every mode; each timed run is checked
against it). Timed runs measure only ``Scheduler.step`` calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from kvservice.bench.measure import process_cpu_seconds, rotated
from kvservice.bench.progress import Progress
from kvservice.bench.server import ChildServer
from kvservice.client import AdmitOptions, BlockIds, ComputedBlocks, KVClient
from kvservice.client.types import Retention
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.scheduler.backend import (
    AdmittedIds,
    Backend,
    ForwardingBackend,
    InProcessBackend,
    RemoteBackend,
)
from kvservice.scheduler.loop import Scheduler, SchedulerConfig, StepRecord
from kvservice.scheduler.replicated import StepBackend, StreamBackend
from kvservice.server.config import ServerConfig, build_manager
from kvservice.workloads import (
    FewShotConfig,
    LongDocumentQAConfig,
    MultiTurnChatConfig,
    NoSharingConfig,
    RequestSpec,
    SharedSystemPromptConfig,
    WorkloadConfig,
    generate,
)

P = ParamSpec("P")
R = TypeVar("R")

IN_PROCESS = "in-process"
MODES = (IN_PROCESS, "unary", "step", "stream")
WORKLOAD_KINDS = (
    "shared_system_prompt",
    "multi_turn_chat",
    "few_shot",
    "long_document_qa",
    "no_sharing",
)
_GROUP_SIZE = 4  # turns per conversation, questions per document


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What one ``kvservice bench`` run measures."""

    workload: str = "shared_system_prompt"
    num_requests: int = 4096
    num_blocks: tuple[int, ...] = (10_000,)
    seed: int = 0
    modes: tuple[str, ...] = MODES
    max_steps: int = 200
    rounds: int = 3
    max_running: int = 256
    max_batched_tokens: int = 8192
    arrival_rate: float = 16.0
    block_size: int = 16
    max_model_len: int = 8192
    # The pool's eviction policy, and the priority the shared_system_prompt workload
    # keeps its system prompts at (README, Retention).
    eviction_policy: str = "lru"
    system_prompt_priority: int | None = None

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_batched_tokens,
            max_num_running_reqs=self.max_running,
            seed=self.seed,
        )

    def pool(self, num_blocks: int) -> ServerConfig:
        """The pool of the in-process manager (and of the server the bench starts)."""
        return ServerConfig(
            port=0,
            metrics_port=None,
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            eviction_policy=self.eviction_policy,
        )


def build_workload(config: BenchConfig) -> list[RequestSpec]:
    """The requests of ``config.workload``, about ``num_requests`` of them."""
    n = config.num_requests
    groups = max(math.ceil(n / _GROUP_SIZE), 1)
    rate = config.arrival_rate
    workload: WorkloadConfig
    match config.workload:
        case "shared_system_prompt":
            workload = SharedSystemPromptConfig(
                num_requests=n, system_prompt_priority=config.system_prompt_priority
            )
        case "multi_turn_chat":
            workload = MultiTurnChatConfig(
                num_conversations=groups, turns_per_conversation=_GROUP_SIZE
            )
            rate /= _GROUP_SIZE  # arrivals count conversations, not turns
        case "few_shot":
            workload = FewShotConfig(num_requests=n)
        case "long_document_qa":
            workload = LongDocumentQAConfig(
                num_documents=groups, questions_per_document=_GROUP_SIZE
            )
            rate /= _GROUP_SIZE  # a document's questions arrive together
        case "no_sharing":
            workload = NoSharingConfig(num_requests=n)
        case other:
            raise ValueError(f"workload: unknown kind {other!r}; one of {WORKLOAD_KINDS}")
    workload = dataclasses.replace(
        workload, requests_per_step=rate, max_model_len=config.max_model_len
    )
    return generate(workload, config.seed)


# -- the reference run ------------------------------------------------------------------


class CountingBackend(ForwardingBackend):
    """A ``Backend`` that forwards every call and counts the request-table operations.

    ``admit`` counts as the operations it stands for, so that ops/s still counts
    request-table work, not calls: a lookup and an allocation per admitted request, and
    for the request it stopped at (when the budget was not spent) a lookup, plus the
    allocation that answered no room when chunked prefill lets every request reach
    it (without chunked prefill a too-long request stops before allocating, and the
    answer does not say which it was: its lookup alone is counted).
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.num_ops = 0

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        retention: Retention | None = None,
    ) -> None:
        self.num_ops += 1
        super().add_request(request_id, prompt_token_ids, retention)

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        self.num_ops += 1
        return super().get_computed_blocks(request_id)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        self.num_ops += 1
        return super().allocate_slots(
            request_id, num_new_tokens, hit, num_lookahead_tokens, full_sequence_must_fit
        )

    def admit(
        self, request_ids: Sequence[str], token_budget: int, options: AdmitOptions
    ) -> list[AdmittedIds]:
        admitted = super().admit(request_ids, token_budget, options)
        self.num_ops += admit_ops(
            len(request_ids),
            admitted,
            token_budget,
            enable_chunked_prefill=options.enable_chunked_prefill,
        )
        return admitted

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.num_ops += 1
        super().append_tokens(request_id, token_ids)

    def free(self, request_id: str, preempt: bool = False) -> None:
        self.num_ops += 1
        super().free(request_id, preempt)


def admit_ops(
    num_candidates: int,
    admitted: Sequence[AdmittedIds],
    token_budget: int,
    *,
    enable_chunked_prefill: bool,
) -> int:
    """The request-table operations one ``admit`` stands for (see ``CountingBackend``)."""
    num_ops = 2 * len(admitted)
    budget_left = token_budget - sum(item.num_new_tokens for item in admitted)
    if len(admitted) < num_candidates and budget_left > 0:
        num_ops += 2 if enable_chunked_prefill else 1
    return num_ops


class TimedBackend(ForwardingBackend):
    """A ``Backend`` that forwards every call and adds up the time spent inside them
    (the KV service's part of a step, RPCs included; the rest is the scheduler's own
    Python). Every mode runs behind it, so its own small cost is in all of them."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.elapsed_ns = 0

    def take_elapsed_ns(self) -> int:
        """The time inside the backend since the last call."""
        elapsed, self.elapsed_ns = self.elapsed_ns, 0
        return elapsed

    def _forward(self, call: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            self.elapsed_ns += time.perf_counter_ns() - start


@dataclass(slots=True)
class Reference:
    """The untimed in-process run: decisions and what they did to the pool, per step."""

    decisions: list[tuple[object, ...]] = field(default_factory=list)
    num_ops: list[int] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    hit_rate: list[float] = field(default_factory=list)  # cumulative, first lookups only
    num_preemptions: int = 0

    @property
    def total_ops(self) -> int:
        return sum(self.num_ops)


def decision(record: StepRecord) -> tuple[object, ...]:
    """A step's decisions without block ids (they depend on the free queue's history,
    which differs between a fresh pool and one reused after a prefix cache reset)."""
    scheduled = tuple((s.request_id, s.num_new_tokens, s.num_hit_tokens) for s in record.scheduled)
    return (record.step, scheduled, record.preempted, record.finished)


def reference_run(
    manager: KVCacheManager, specs: Sequence[RequestSpec], config: BenchConfig
) -> Reference:
    in_process = InProcessBackend(manager)
    backend = CountingBackend(in_process)
    scheduler = Scheduler(backend, config.scheduler_config(), specs)
    reference = Reference()
    while not scheduler.done and len(reference.decisions) < config.max_steps:
        before = backend.num_ops
        record = scheduler.step()
        # The table's prefix cache totals: first lookups only, as vLLM counts them.
        usage = in_process.table.usage()
        queries, hits = usage.prefix_cache_queries, usage.prefix_cache_hits
        reference.decisions.append(decision(record))
        reference.num_ops.append(backend.num_ops - before)
        reference.num_scheduled.append(len(record.scheduled))
        reference.usage.append(manager.usage)
        reference.hit_rate.append(hits / queries if queries else 0.0)
        reference.num_preemptions += len(record.preempted)
    scheduler.abort_all()
    _reset(manager.reset_prefix_cache())
    return reference


def _reset(done: bool) -> None:
    if not done:
        raise RuntimeError("the prefix cache reset was refused: a run left blocks in use")


# -- timed runs -------------------------------------------------------------------------


@dataclass(slots=True)
class ModeResult:
    """One mode on one pool, over every round."""

    num_blocks: int
    mode: str
    latencies_ns: list[int] = field(default_factory=list)
    full_latencies_ns: list[int] = field(default_factory=list)  # steps at max_running
    # Per step: the time inside the backend (the KV service, RPCs included), and the
    # rest of the step (the scheduler's own Python).
    backend_latencies_ns: list[int] = field(default_factory=list)
    scheduler_latencies_ns: list[int] = field(default_factory=list)
    last_round_ms: list[float] = field(default_factory=list)
    num_steps: int = 0
    num_ops: int = 0
    num_sends: int | None = None
    decisions_match: bool = True
    # CPU seconds of this process and of the server (when its pid is known): on a
    # loaded machine a steadier measure of the work than the wall clock.
    client_cpu_seconds: float = 0.0
    server_cpu_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.latencies_ns) / 1e9

    @property
    def round_seconds(self) -> list[float]:
        """Each round's timed steps, in seconds (every round runs the same steps)."""
        per_round = len(self.last_round_ms)
        if not per_round:
            return []
        latencies = self.latencies_ns
        return [
            sum(latencies[start : start + per_round]) / 1e9
            for start in range(0, len(latencies), per_round)
        ]


@dataclass(slots=True)
class PoolResult:
    """Every mode on one pool size, and the pool's reference run."""

    num_blocks: int
    reference: Reference
    modes: dict[str, ModeResult]


@dataclass(slots=True)
class _Pool:
    """What the modes of one pool size run against."""

    num_blocks: int
    manager: KVCacheManager
    client: KVClient | None
    server_pid: int | None
    reference: Reference

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time so far of this process and of the server (0 when unknown)."""
        server = None if self.server_pid is None else process_cpu_seconds(self.server_pid)
        return time.process_time(), server or 0.0


def _timed(
    backend: Backend,
    specs: Sequence[RequestSpec],
    config: BenchConfig,
    reference: Reference,
    result: ModeResult,
    progress: Progress,
) -> None:
    timed = TimedBackend(backend)
    scheduler = Scheduler(timed, config.scheduler_config(), specs)
    round_ms: list[float] = []
    label = f"{result.mode} ({result.num_blocks} blocks)"
    timed.take_elapsed_ns()  # the scheduler's construction is not a step
    for index, expected in enumerate(reference.decisions):
        start = time.perf_counter_ns()
        record = scheduler.step()
        elapsed = time.perf_counter_ns() - start
        in_backend = timed.take_elapsed_ns()
        result.latencies_ns.append(elapsed)
        result.backend_latencies_ns.append(in_backend)
        result.scheduler_latencies_ns.append(elapsed - in_backend)
        round_ms.append(elapsed / 1e6)
        if reference.num_scheduled[index] >= config.max_running:
            result.full_latencies_ns.append(elapsed)
        if decision(record) != expected:
            result.decisions_match = False
        progress.advance(label)
    scheduler.abort_all()
    result.last_round_ms = round_ms
    result.num_steps += len(reference.decisions)
    result.num_ops += reference.total_ops


def _run_mode(
    pool: _Pool,
    mode: str,
    specs: Sequence[RequestSpec],
    config: BenchConfig,
    result: ModeResult,
    progress: Progress,
) -> None:
    def timed(backend: Backend) -> None:
        client_start, server_start = pool.cpu_seconds()
        _timed(backend, specs, config, pool.reference, result, progress)
        client_end, server_end = pool.cpu_seconds()
        result.client_cpu_seconds += client_end - client_start
        result.server_cpu_seconds += server_end - server_start

    if mode == IN_PROCESS:
        timed(InProcessBackend(pool.manager))
        _reset(pool.manager.reset_prefix_cache())
        return
    client = pool.client
    if client is None:
        raise ValueError(f"mode {mode!r} needs a server")
    if mode == "unary":
        timed(RemoteBackend(client))
    elif mode == "step":
        # Each step checked before the next is sent, while the next is planned.
        with StepBackend(client, overlap=True) as step_backend:
            timed(step_backend)
            result.num_sends = (result.num_sends or 0) + step_backend.round_trips
    else:
        # Each step checked while the next is planned: the server's work overlaps the
        # scheduler's.
        with StreamBackend(client, overlap=True) as stream_backend:
            timed(stream_backend)
            result.num_sends = (result.num_sends or 0) + stream_backend.round_trips
    _reset(client.reset_prefix_cache())


ServerFactory = Callable[[ServerConfig], contextlib.AbstractContextManager[ChildServer]]
# The client of a server's address.
Connect = Callable[[str], KVClient]


@contextlib.contextmanager
def _pools(
    config: BenchConfig,
    server_for: ServerFactory | None,
    specs: Sequence[RequestSpec],
    connect: Connect,
) -> Iterator[list[_Pool]]:
    with contextlib.ExitStack() as stack:
        pools: list[_Pool] = []
        for num_blocks in config.num_blocks:
            pool_config = config.pool(num_blocks)
            client = None
            server_pid = None
            if server_for is not None:
                server = stack.enter_context(server_for(pool_config))
                client = stack.enter_context(connect(server.target))
                server_pid = server.pid
            manager = build_manager(pool_config)
            reference = reference_run(manager, specs, config)
            pools.append(_Pool(num_blocks, manager, client, server_pid, reference))
        # As the server does at startup: keep the pools' block objects (a million for a
        # large pool) out of the collector's scans, so both sides pay the same.
        gc.collect()
        gc.freeze()
        try:
            yield pools
        finally:
            gc.unfreeze()


def run_bench(
    config: BenchConfig,
    server_for: ServerFactory | None,
    *,
    progress_enabled: bool = True,
    connect: Connect = KVClient,
) -> list[PoolResult]:
    """Measure every mode on every pool, alternating the modes' order each round.

    ``server_for`` runs a server for a pool and yields where it is; None runs the
    in-process mode alone. ``connect`` makes the client of a server's address (with
    the token and TLS a server of the user's needs).
    """
    specs = build_workload(config)
    with _pools(config, server_for, specs, connect) as pools:
        results = {
            (p.num_blocks, m): ModeResult(p.num_blocks, m) for p in pools for m in config.modes
        }
        total = config.rounds * sum(len(p.reference.decisions) for p in pools) * len(config.modes)
        progress = Progress(total, enabled=progress_enabled)
        try:
            for round_index in range(config.rounds):
                for pool in pools:
                    for mode in rotated(config.modes, round_index):
                        result = results[(pool.num_blocks, mode)]
                        _run_mode(pool, mode, specs, config, result, progress)
        finally:
            progress.close()
        return [
            PoolResult(
                p.num_blocks, p.reference, {m: results[(p.num_blocks, m)] for m in config.modes}
            )
            for p in pools
        ]

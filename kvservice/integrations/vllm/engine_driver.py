"""A real vLLM engine (``LLMEngine``, in this process) driven step by step on seeded
traffic, for the end-to-end tests and ``benchmarks/bench_vllm_engine.py``.

``EngineWorkload`` is the traffic: prompts that share system prefixes, arrivals spread
over steps, and aborts at given steps. ``run_engine`` runs it on one engine, stock or
with ``--scheduler-cls``, and returns what the KV cache manager decides through: every
request's generated tokens, ``num_cached_tokens`` and finish reason, the preemptions
and vLLM's own prefix-cache counters (read from the engine's stat loggers, as vLLM's
``/metrics`` reads them), and the time of each ``step()``.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import TokensPrompt
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.loggers import StatLoggerBase

from kvservice.integrations.vllm.tiny_model import SPECIAL_TOKENS, VOCAB_SIZE

SCHEDULER_CLS = "kvservice.integrations.vllm.KVServiceScheduler"


@dataclass(frozen=True)
class EngineSetup:
    """The engine's settings (vLLM's ``EngineArgs`` names) besides the model."""

    num_blocks: int = 24
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32
    max_model_len: int = 512
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    # vLLM's ``KVEventsConfig`` (``--kv-events-config``): its own ZMQ event publisher.
    kv_events_config: Any = None

    def engine_args(self, model: Path, scheduler_cls: str | None) -> EngineArgs:
        extra = {} if scheduler_cls is None else {"scheduler_cls": scheduler_cls}
        return EngineArgs(
            model=str(model),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            block_size=self.block_size,
            num_gpu_blocks_override=self.num_blocks,
            kv_cache_memory_bytes=16 << 20,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            disable_log_stats=False,
            kv_events_config=self.kv_events_config,
            **extra,
        )


@dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    step: int


@dataclass
class EngineWorkload:
    """Seeded traffic: ``num_requests`` prompts, most of them starting with one of
    ``shared_prefixes`` system prompts, arriving over the first steps; ``aborts`` maps
    a step to the requests aborted before it."""

    seed: int = 0
    num_requests: int = 14
    shared_prefixes: int = 2
    prompt_len: tuple[int, int] = (10, 120)
    max_tokens: tuple[int, int] = (16, 64)
    arrival_steps: int = 24
    aborts: dict[int, tuple[str, ...]] = field(default_factory=dict)
    arrivals: list[Arrival] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        first = len(SPECIAL_TOKENS)
        prefixes = [
            tuple(rng.randrange(first, VOCAB_SIZE) for _ in range(rng.randrange(40, 100)))
            for _ in range(self.shared_prefixes)
        ]
        for i in range(self.num_requests):
            prefix = rng.choice(prefixes) if prefixes and rng.random() < 0.7 else ()
            body = tuple(
                rng.randrange(first, VOCAB_SIZE) for _ in range(rng.randrange(*self.prompt_len))
            )
            self.arrivals.append(
                Arrival(
                    f"req-{i}",
                    prefix + body,
                    rng.randrange(*self.max_tokens),
                    0 if i < 3 else rng.randrange(self.arrival_steps),
                )
            )


@dataclass(frozen=True)
class RequestResult:
    token_ids: tuple[int, ...]
    num_cached_tokens: int | None
    finish_reason: str | None


@dataclass
class EngineRun:
    """What one engine produced for a workload."""

    requests: dict[str, RequestResult] = field(default_factory=dict)
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    step_seconds: list[float] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(len(result.token_ids) for result in self.requests.values())

    def outcome(self) -> dict[str, Any]:
        """Everything a KV cache manager decides through (no timings)."""
        return {
            "requests": dict(sorted(self.requests.items())),
            "preemptions": self.preemptions,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
        }


class _StatsRecorder(StatLoggerBase):  # type: ignore[misc]
    """Sums what vLLM's Prometheus logger counts: preemptions and prefix-cache queries
    and hits (``vllm:num_preemptions``, ``vllm:prefix_cache_queries``, ``..._hits``)."""

    def __init__(self, run: EngineRun) -> None:
        self.run = run

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self.run.preemptions += iteration_stats.num_preempted_reqs
        if scheduler_stats is not None and scheduler_stats.prefix_cache_stats is not None:
            self.run.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
            self.run.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits

    def log_engine_initialized(self) -> None:
        pass


def build_engine(model: Path, setup: EngineSetup, scheduler_cls: str | None, run: EngineRun) -> Any:
    """An ``LLMEngine`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) whose
    stats go to ``run``."""
    return LLMEngine.from_engine_args(
        setup.engine_args(model, scheduler_cls),
        stat_loggers=[lambda config, index: _StatsRecorder(run)],
    )


def run_engine(
    model: Path,
    workload: EngineWorkload,
    setup: EngineSetup = EngineSetup(),
    scheduler_cls: str | None = None,
    max_steps: int = 5000,
) -> EngineRun:
    """Run ``workload`` to the end on a fresh engine, then shut the engine down."""
    run = EngineRun()
    engine = build_engine(model, setup, scheduler_cls, run)
    try:
        drive(engine, workload, run, max_steps)
    finally:
        shutdown(engine)
    return run


def drive(
    engine: Any,
    workload: EngineWorkload,
    run: EngineRun,
    max_steps: int = 5000,
    stop_early: bool = False,
) -> None:
    """Feed ``workload`` to ``engine`` step by step until every request has ended (or
    for ``max_steps`` when ``stop_early``)."""
    pending = sorted(workload.arrivals, key=lambda arrival: arrival.step)
    for step in range(max_steps):
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            engine.add_request(
                arrival.request_id,
                TokensPrompt(prompt_token_ids=list(arrival.prompt)),
                SamplingParams(temperature=0.0, max_tokens=arrival.max_tokens),
            )
        aborted = workload.aborts.get(step, ())
        if aborted:
            engine.abort_request(list(aborted))
            for request_id in aborted:
                result = run.requests.get(request_id)
                if result is not None and result.finish_reason is None:
                    run.requests[request_id] = RequestResult(
                        result.token_ids, result.num_cached_tokens, "abort"
                    )
        if not pending and not engine.has_unfinished_requests():
            return
        started = time.perf_counter()
        outputs = engine.step()
        run.step_seconds.append(time.perf_counter() - started)
        for output in outputs:
            completion = output.outputs[0]
            run.requests[output.request_id] = RequestResult(
                tuple(completion.token_ids), output.num_cached_tokens, completion.finish_reason
            )
    if stop_early:
        return
    raise AssertionError(f"the workload did not finish in {max_steps} steps")


def shutdown(engine: Any) -> None:
    """End the engine core (and so the scheduler: a remote manager ends its session)."""
    engine.engine_core.shutdown()
    del engine
    gc.collect()

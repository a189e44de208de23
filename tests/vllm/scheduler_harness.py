"""Differential runs of vLLM 0.33's real ``Scheduler``: seeded traffic and what of
each step must match between two KV cache managers.

``Workload`` drives one scheduler step by step with seeded arrivals, stops (vLLM's own
checks: a stop token, ``max_tokens``) and aborts before a step and between
``schedule`` and ``update_from_output``; the fake model samples a token that depends
only on the request and the position, so twin schedulers sample alike. ``snapshot``
reduces a step to what depends on the manager.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvservice.integrations.vllm.testing import (
    VOCAB_SIZE,
    SchedulerSetup,
    block_hasher,
    build_scheduler,
)

STOP_TOKEN = 7


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    arrival_time: float = 0.0
    stop_token_ids: tuple[int, ...] = (STOP_TOKEN,)

    def build(self, hash_block_size: int, hash_lookahead: int = 0) -> Request:
        return Request(
            self.request_id,
            list(self.prompt),
            SamplingParams(max_tokens=self.max_tokens, stop_token_ids=list(self.stop_token_ids)),
            None,
            arrival_time=self.arrival_time,
            cache_salt=self.cache_salt,
            block_hasher=block_hasher(hash_block_size, hash_lookahead),
        )


def sampled_token(request_id: str, position: int) -> int:
    """The fake model's token at ``position``: a function of the request and position
    only, so twin schedulers sample alike whatever their steps."""
    return random.Random(f"{request_id}:{position}").randrange(VOCAB_SIZE)


def model_runner_output(scheduler: Any, output: Any) -> Any:
    """The fake model's output for ``output``, fixed when the step is planned (as the
    real model's inputs are, also with steps in flight). A request whose step is not a
    partial prefill chunk samples at its next position: with draft tokens scheduled, a
    seeded number of them is accepted and one more token is sampled after them."""
    req_ids = list(output.num_scheduled_tokens)
    drafts = output.scheduled_spec_decode_tokens
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.is_prefill_chunk:
            sampled.append([])
            continue
        num_drafts = len(drafts.get(req_id, ()))
        position = request.num_computed_tokens - num_drafts
        accepted = random.Random(f"{req_id}:{position}:accepted").randrange(num_drafts + 1)
        sampled.append([sampled_token(req_id, position + i) for i in range(accepted + 1)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _block_ids(ids: Any) -> Any:
    return None if ids is None else tuple(tuple(group) for group in ids)


def snapshot(scheduler: Any, output: Any) -> dict[str, Any]:
    """Everything of one step that depends on the KV cache manager."""
    cached = output.scheduled_cached_reqs
    return {
        "new": [
            (r.req_id, _block_ids(r.block_ids), r.num_computed_tokens)
            for r in output.scheduled_new_reqs
        ],
        "cached": list(
            zip(
                cached.req_ids,
                [_block_ids(ids) for ids in cached.new_block_ids],
                cached.num_computed_tokens,
                cached.num_output_tokens,
                strict=True,
            )
        ),
        "resumed": sorted(cached.resumed_req_ids),
        "num_scheduled_tokens": dict(output.num_scheduled_tokens),
        "preempted": sorted(output.preempted_req_ids),
        "finished": sorted(output.finished_req_ids),
        "block_ids_to_zero": output.new_block_ids_to_zero,
        "copies": output.kv_cache_block_copies,
        "running": len(scheduler.running),
        "usage": scheduler.kv_cache_manager.usage,
        "free": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
    }


def _stats(engine_outputs: Any) -> Any:
    for outputs in engine_outputs.values():
        stats = outputs.scheduler_stats
        if stats is not None:
            p = stats.prefix_cache_stats
            return (
                stats.kv_cache_usage,
                (
                    p.reset,
                    p.requests,
                    p.queries,
                    p.hits,
                    p.preempted_requests,
                    p.preempted_queries,
                    p.preempted_hits,
                ),
            )
    return None


@dataclass
class Workload:
    """Seeded traffic: shared prefixes, arrivals over steps, aborts before a step and
    between ``schedule`` and ``update_from_output``. With ``repeat_rate``, that share of
    the requests repeats an earlier request's prompt whole (a full prefix hit); at 0 (the
    default) the traffic is drawn exactly as without the option."""

    seed: int
    num_requests: int = 60
    prompt_len: tuple[int, int] = (8, 300)
    max_tokens: tuple[int, int] = (1, 60)
    arrivals_per_step: tuple[int, int] = (0, 6)
    abort_rate: float = 0.02
    salts: tuple[str | None, ...] = (None,)
    shared_prefixes: int = 4
    # Stop tokens end about one answer in 64 tokens early; off, answers run to max_tokens.
    stop_tokens: bool = True
    hash_block_size: int = 16
    # Tokens after each block its hash covers (vLLM 0.33's EAGLE default: 1).
    hash_lookahead: int = 0
    repeat_rate: float = 0.0
    _specs: list[RequestSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        prefixes = [
            tuple(rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(16, 160)))
            for _ in range(self.shared_prefixes)
        ]
        for i in range(self.num_requests):
            if self.repeat_rate and self._specs and rng.random() < self.repeat_rate:
                prompt = rng.choice(self._specs).prompt
            else:
                length = rng.randrange(*self.prompt_len)
                prefix = rng.choice(prefixes) if prefixes and rng.random() < 0.6 else ()
                body = tuple(rng.randrange(VOCAB_SIZE) for _ in range(max(length - len(prefix), 1)))
                prompt = prefix + body
            self._specs.append(
                RequestSpec(
                    f"req-{i}",
                    prompt,
                    rng.randrange(*self.max_tokens),
                    cache_salt=rng.choice(self.salts),
                    arrival_time=float(i),
                    stop_token_ids=(STOP_TOKEN,) if self.stop_tokens else (),
                )
            )

    def run(self, scheduler: Any, max_steps: int = 2000, stop_early: bool = False) -> list[Any]:
        """Drive ``scheduler`` to completion (or for ``max_steps`` when ``stop_early``);
        the per-step snapshots."""
        self.begin(scheduler)
        rng = random.Random(self.seed + 1)
        pending = list(self._specs)
        trace: list[Any] = []
        for _ in range(max_steps):
            for _ in range(rng.randrange(*self.arrivals_per_step)):
                if pending:
                    scheduler.add_request(
                        pending.pop(0).build(self.hash_block_size, self.hash_lookahead)
                    )
            self._maybe_abort(scheduler, rng)
            if not pending and not scheduler.has_requests():
                return trace
            output = scheduler.schedule()
            step = snapshot(scheduler, output)
            runner_output = self.runner_output(scheduler, output, step)
            self._maybe_abort(scheduler, rng)
            self.finish_step(scheduler, step, scheduler.update_from_output(output, runner_output))
            trace.append(step)
        if stop_early:
            return trace
        raise AssertionError(f"workload {self.seed} did not finish in {max_steps} steps")

    # Hooks for a workload with more in each step (a KV connector's worker).

    def begin(self, scheduler: Any) -> None:
        """Before the first step."""

    def runner_output(self, scheduler: Any, output: Any, step: dict[str, Any]) -> Any:
        """The model's output for ``output``, fixed when the step is planned."""
        return model_runner_output(scheduler, output)

    def finish_step(self, scheduler: Any, step: dict[str, Any], engine_outputs: Any) -> None:
        """Record what ``update_from_output`` answered for ``step``."""
        step["stats"] = _stats(engine_outputs)

    def _maybe_abort(self, scheduler: Any, rng: random.Random) -> None:
        live = sorted(scheduler.requests)
        victims = [req_id for req_id in live if rng.random() < self.abort_rate]
        if victims:
            scheduler.finish_requests(victims, RequestStatus.FINISHED_ABORTED)


def first_difference(a: list[Any], b: list[Any]) -> str | None:
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            keys = [k for k in x if x[k] != y.get(k)]
            return f"step {step}: " + "; ".join(f"{k}: {x[k]!r} != {y.get(k)!r}" for k in keys)
    if len(a) != len(b):
        return f"lengths differ: {len(a)} != {len(b)}"
    return None


__all__ = ["SchedulerSetup", "Workload", "build_scheduler", "first_difference"]

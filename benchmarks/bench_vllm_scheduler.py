"""vLLM 0.33's own scheduler on three KV cache managers, side by side in one run.

The scheduler is vLLM's ``Scheduler`` in every column; only its manager changes:
vLLM's built-in ``KVCacheManager``, kvservice's core in-process, and kvservice over a
server on loopback (a child process). Each round runs every mode once, in turn, on the
same seeded workload, and times ``schedule()`` plus ``update_from_output()`` (the fake
model's output is built outside the timer):

- ``decode``: 256 running requests, each step one token per request.
- ``churn``: short answers and steady arrivals, so most steps admit and finish requests
  (prefix lookups, hashing, frees) while about 256 run.

It prints steps/s per mode (median over rounds), each kvservice mode's ratio to the
built-in manager measured within every round (median and spread), and the round trips
per step of the remote mode.

    python -m benchmarks.bench_vllm_scheduler [--rounds 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(_key, _value)

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvservice.bench.server import child_server  # noqa: E402
from kvservice.integrations.vllm import KVServiceScheduler  # noqa: E402
from kvservice.integrations.vllm.testing import (  # noqa: E402
    SchedulerSetup,
    block_hasher,
    build_scheduler,
)

VOCAB = 32000
NUM_RUNNING = 256
SETUP = SchedulerSetup(
    num_blocks=40_000,
    max_num_batched_tokens=8192,
    max_num_seqs=NUM_RUNNING,
    max_model_len=4096,
)


@dataclass(frozen=True)
class Mode:
    name: str
    scheduler_cls: type
    target: str | None


def _token(request_id: str, position: int) -> int:
    return (hash(request_id) + position * 7919) % VOCAB


def _requests(seed: int, count: int, max_tokens: tuple[int, int], first: int) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(512)]
    hasher = block_hasher(SETUP.block_size)
    made = []
    for i in range(first, first + count):
        shared = system[: rng.choice((0, 256, 512))]
        body = [rng.randrange(VOCAB) for _ in range(rng.randrange(64, 512))]
        params = SamplingParams(max_tokens=rng.randrange(*max_tokens), ignore_eos=True)
        made.append(
            Request(
                f"r{i}", shared + body, params, None, arrival_time=float(i), block_hasher=hasher
            )
        )
    return made


def _output(scheduler: Any, scheduled: Any) -> Any:
    req_ids = list(scheduled.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([_token(req_id, request.num_tokens)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _step(scheduler: Any) -> float:
    """One scheduler step; the seconds spent in the scheduler (and its manager)."""
    start = time.perf_counter()
    scheduled = scheduler.schedule()
    elapsed = time.perf_counter() - start
    output = _output(scheduler, scheduled)
    start = time.perf_counter()
    scheduler.update_from_output(scheduled, output)
    return elapsed + time.perf_counter() - start


@dataclass
class Timing:
    """Seconds in the scheduler over the timed steps, and round trips meanwhile."""

    seconds: float = 0.0
    round_trips: int = 0


def _timed(scheduler: Any, timing: Timing) -> None:
    manager = scheduler.kv_cache_manager
    before = getattr(manager, "round_trips", 0)
    timing.seconds += _step(scheduler)
    timing.round_trips += getattr(manager, "round_trips", 0) - before


def decode(scheduler: Any, steps: int, seed: int) -> Timing:
    for request in _requests(seed, NUM_RUNNING, (100_000, 100_001), 0):
        scheduler.add_request(request)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        _step(scheduler)
    timing = Timing()
    for _ in range(steps):
        _timed(scheduler, timing)
    return timing


def churn(scheduler: Any, steps: int, seed: int) -> Timing:
    arrivals = iter(_requests(seed, NUM_RUNNING * 40, (8, 64), 0))
    timing = Timing()
    for _ in range(steps):
        while len(scheduler.requests) < NUM_RUNNING + 32:
            scheduler.add_request(next(arrivals))
        _timed(scheduler, timing)
    return timing


WORKLOADS: dict[str, Callable[[Any, int, int], Timing]] = {"decode": decode, "churn": churn}


def _run(mode: Mode, workload: str, steps: int, seed: int) -> tuple[float, float]:
    """Steps/s of one run, and its round trips per step."""
    if mode.target is None:
        os.environ.pop("KVSERVICE_TARGET", None)
    else:
        os.environ["KVSERVICE_TARGET"] = mode.target
    scheduler = build_scheduler(SETUP, mode.scheduler_cls)
    timing = WORKLOADS[workload](scheduler, steps, seed)
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    scheduler.shutdown()
    return steps / timing.seconds, timing.round_trips / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args(argv)
    server_args = [
        f"--num-blocks={SETUP.num_blocks}",
        f"--block-size={SETUP.block_size}",
        f"--max-model-len={SETUP.max_model_len}",
        "--max-step-ops=16384",
        "--session-ttl-min=1",
    ]
    with child_server(server_args) as server:
        modes = [
            Mode("vllm built-in", Scheduler, None),
            Mode("kvservice in-process", KVServiceScheduler, None),
            Mode("kvservice remote", KVServiceScheduler, server.target),
        ]
        for workload in args.workloads:
            rates: dict[str, list[float]] = {m.name: [] for m in modes}
            trips: list[float] = []
            for round_ in range(args.rounds):
                for mode in modes:
                    rate, per_step = _run(mode, workload, args.steps, seed=round_)
                    rates[mode.name].append(rate)
                    if mode.target is not None:
                        trips.append(per_step)
            _report(workload, modes, rates, trips, args)


def _report(
    workload: str,
    modes: list[Mode],
    rates: dict[str, list[float]],
    trips: list[float],
    args: argparse.Namespace,
) -> None:
    base = rates[modes[0].name]
    print(f"\n{workload}: {NUM_RUNNING} requests, {args.steps} steps x {args.rounds} rounds")
    print(f"{'manager':<24}{'steps/s':>10}{'ratio':>9}{'spread':>16}")
    for mode in modes:
        ratios = [rate / b for rate, b in zip(rates[mode.name], base, strict=True)]
        print(
            f"{mode.name:<24}{statistics.median(rates[mode.name]):>10.1f}"
            f"{statistics.median(ratios):>8.2f}x"
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}x':>16}"
        )
    if trips:
        print(f"remote round trips per step: {statistics.median(trips):.2f} (max {max(trips):.2f})")


if __name__ == "__main__":
    main()

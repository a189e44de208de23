"""vLLM 0.33's own scheduler on three KV cache managers, side by side in one run.

The scheduler is vLLM's ``Scheduler`` in every column; only its manager changes:
vLLM's built-in ``KVCacheManager``, kvservice's core in-process, and kvservice over a
server on loopback (a child process), confirming each step before its output or, with
``overlap``, before the next step. Each round runs every mode once, in turn, on the
same seeded workload, and times ``schedule()`` plus ``update_from_output()`` (the fake
model's output is built outside the timer):

- ``decode``: 256 running requests, each step one token per request.
- ``churn``: short answers and steady arrivals, so most steps admit and finish requests
  (prefix lookups, hashing, frees) while about 256 run.

It prints steps/s per mode (median over rounds), each kvservice mode's ratio to the
built-in manager measured within every round (median and spread), and the round trips
per step of the remote modes. ``KVSERVICE_CONFIRM=overlap`` waits for the server's
answer before the next step instead of before the output: its round trip hides behind
the forward pass, which ``--forward-ms`` simulates (a sleep outside the timer).

    python -m benchmarks.bench_vllm_scheduler [--rounds 5] [--steps 200] [--forward-ms 0]
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

from kvservice.bench.measure import process_cpu_seconds  # noqa: E402
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
    confirm: str = "sync"
    server_pid: int | None = None


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


@dataclass
class Timing:
    """The timed steps: wall seconds in the scheduler, this thread's CPU seconds there
    (what other processes on a shared machine disturb least), round trips."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    server_cpu_seconds: float = 0.0
    round_trips: int = 0
    steps: int = 0


def _step(
    scheduler: Any, timing: Timing, forward_s: float = 0.0, server_pid: int | None = None
) -> None:
    """One scheduler step, timed outside the fake model's output; with ``server_pid``,
    the server process's CPU time over the step too."""
    server_cpu = process_cpu_seconds(server_pid) if server_pid else None
    server = getattr(scheduler.kv_cache_manager, "server", None)

    def round_trips() -> int:
        return 0 if server is None else server.round_trips

    trips = round_trips()
    wall, cpu = time.perf_counter(), time.thread_time()
    scheduled = scheduler.schedule()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    output = _output(scheduler, scheduled)
    if forward_s:
        time.sleep(forward_s)  # the model's forward pass, in no mode's time
    start, start_cpu = time.perf_counter(), time.thread_time()
    scheduler.update_from_output(scheduled, output)
    timing.seconds += wall + time.perf_counter() - start
    timing.cpu_seconds += cpu + time.thread_time() - start_cpu
    timing.round_trips += round_trips() - trips
    timing.steps += 1
    if server_pid and server_cpu is not None:
        timing.server_cpu_seconds += (process_cpu_seconds(server_pid) or 0.0) - server_cpu


def decode(
    scheduler: Any, steps: int, seed: int, forward_s: float, server_pid: int | None
) -> Timing:
    for request in _requests(seed, NUM_RUNNING, (100_000, 100_001), 0):
        scheduler.add_request(request)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        _step(scheduler, Timing())
    timing = Timing()
    for _ in range(steps):
        _step(scheduler, timing, forward_s, server_pid)
    return timing


def churn(
    scheduler: Any, steps: int, seed: int, forward_s: float, server_pid: int | None
) -> Timing:
    arrivals = iter(_requests(seed, NUM_RUNNING * 40, (8, 64), 0))
    timing = Timing()
    for _ in range(steps):
        while len(scheduler.requests) < NUM_RUNNING + 32:
            scheduler.add_request(next(arrivals))
        _step(scheduler, timing, forward_s, server_pid)
    return timing


WORKLOADS: dict[str, Callable[[Any, int, int, float, int | None], Timing]] = {
    "decode": decode,
    "churn": churn,
}


def _run(mode: Mode, workload: str, steps: int, seed: int, forward_s: float) -> Timing:
    if mode.target is None:
        os.environ.pop("KVSERVICE_TARGET", None)
    else:
        os.environ["KVSERVICE_TARGET"] = mode.target
    os.environ["KVSERVICE_CONFIRM"] = mode.confirm
    scheduler = build_scheduler(SETUP, mode.scheduler_cls)
    timing = WORKLOADS[workload](scheduler, steps, seed, forward_s, mode.server_pid)
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    scheduler.shutdown()
    return timing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="sleep this long between schedule() and update_from_output(), as a model's "
        "forward pass would take (untimed; what KVSERVICE_CONFIRM=overlap hides its "
        "round trip behind)",
    )
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
            Mode("kvservice remote", KVServiceScheduler, server.target, "sync", server.pid),
            Mode(
                "kvservice remote overlap", KVServiceScheduler, server.target, "overlap", server.pid
            ),
        ]
        for workload in args.workloads:
            runs: dict[str, list[Timing]] = {m.name: [] for m in modes}
            for round_ in range(args.rounds):
                for mode in modes:
                    timing = _run(mode, workload, args.steps, round_, args.forward_ms / 1000)
                    runs[mode.name].append(timing)
            _report(workload, modes, runs, args)


def _report(
    workload: str, modes: list[Mode], runs: dict[str, list[Timing]], args: argparse.Namespace
) -> None:
    base = runs[modes[0].name]
    print(f"\n{workload}: {NUM_RUNNING} requests, {args.steps} steps x {args.rounds} rounds")
    print(
        f"{'manager':<22}{'steps/s':>9}{'ratio':>8}{'spread':>13}"
        f"{'CPU ms/step':>13}{'CPU ratio':>11}{'trips/step':>12}{'server CPU ms/step':>20}"
    )
    for mode in modes:
        timings = runs[mode.name]
        ratios = [b.seconds / t.seconds for t, b in zip(timings, base, strict=True)]
        cpu_ratios = [b.cpu_seconds / t.cpu_seconds for t, b in zip(timings, base, strict=True)]
        print(
            f"{mode.name:<22}{statistics.median(t.steps / t.seconds for t in timings):>9.1f}"
            f"{statistics.median(ratios):>7.2f}x"
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}x':>13}"
            f"{statistics.median(1000 * t.cpu_seconds / t.steps for t in timings):>13.2f}"
            f"{statistics.median(cpu_ratios):>10.2f}x"
            f"{statistics.median(t.round_trips / t.steps for t in timings):>12.2f}"
            f"{statistics.median(1000 * t.server_cpu_seconds / t.steps for t in timings):>20.2f}"
        )
    print(
        "ratio: the built-in manager's time over this mode's, within each round (median, "
        "lowest-highest); CPU: the scheduler thread's own CPU time (the remote server's "
        "is not in it)"
    )


if __name__ == "__main__":
    main()

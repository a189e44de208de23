"""What the remote link adds to each call vLLM's scheduler makes on its KV cache
manager, without vLLM's scheduler around it.

``bench_vllm_scheduler`` times whole scheduler steps, where the link's per-call cost
(a few microseconds of a 3-5 ms step) drowns in the machine's noise. Here the same
manager vLLM's scheduler calls (``KVServiceKVCacheManager``) is driven directly with
vLLM's own ``Request`` objects: ``--requests`` running requests are admitted
(untimed), then each step the oldest ``--churn`` of them finish and are freed, every
other one appends a token (untimed) and allocates its slot, as many waiting requests
are admitted (a lookup, and the allocation that attaches its hit: every prompt
shares its first blocks), and the step is flushed (``take_kv_cache_block_copies``)
as vLLM's scheduler closes it. Each kind of call is timed as the scheduler thread's
CPU time (``time.thread_time``: issue 26's row; the server's CPU is not in it), in
rounds that rotate the modes' order; the flush too (remote: the step built, sent on
the step socket, its answer read and checked; waiting for the server costs no CPU).

Modes: ``in-process``; ``remote`` (a kvservice server in a child process, the
engine's step socket, vLLM's hashes sent): each allocation that attaches no hit
recorded from the replica's request, compiled (``ServerRequests.record_allocation``);
``remote, Python recording``: the same, those allocations recorded by the link in
Python from vLLM's request (``ServerLink.allocated``, the path an allocation
attaching a hit takes).

The server goes on working briefly after it answers a step (its event loop, the
step's bookkeeping), while the next step's calls run; ``--settle-ms`` sleeps before
each step, in every mode, so that they run on a quiet machine.

Run: ``python -m benchmarks.bench_vllm_link [--requests 256] [--churn 8] [--steps 40]
[--rounds 5] [--settle-ms 0]``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(_key, _value)

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from benchmarks.bench_vllm_scheduler import (  # noqa: E402
    SETUP,
    Mode,
    connection_env,
    server_args,
    step_socket_path,
)
from kvservice.bench.measure import machine_load, rotated  # noqa: E402
from kvservice.bench.server import child_server  # noqa: E402
from kvservice.integrations.vllm import KVServiceScheduler  # noqa: E402
from kvservice.integrations.vllm.testing import block_hasher, build_scheduler  # noqa: E402

# Every prompt starts with the same 4 blocks (as a system prompt), and ends with its own.
SHARED_PREFIX_LEN = 64
UNIQUE_LEN = 36
PROMPT_LEN = SHARED_PREFIX_LEN + UNIQUE_LEN
IN_PROCESS = "in-process"
REMOTE = "remote"
PYTHON_RECORDING = "remote, Python recording"
MODES = (IN_PROCESS, REMOTE, PYTHON_RECORDING)


@dataclass
class Times:
    """One mode's rounds: microseconds per call of each kind, milliseconds per flush."""

    decode_us: list[float] = field(default_factory=list)
    admit_us: list[float] = field(default_factory=list)
    free_us: list[float] = field(default_factory=list)
    flush_ms: list[float] = field(default_factory=list)


def _requests(count: int) -> list[Request]:
    """Prompts that share their first blocks (a system prompt), as admissions hit."""
    hasher = block_hasher(SETUP.block_size)
    return [
        Request(
            f"r{i}",
            [*range(SHARED_PREFIX_LEN), *((i * 7919 + t) % 32000 for t in range(UNIQUE_LEN))],
            SamplingParams(max_tokens=1_000, ignore_eos=True),
            None,
            arrival_time=float(i),
            block_hasher=hasher,
        )
        for i in range(count)
    ]


def _admit(manager: Any, request: Request) -> None:
    """The request's prompt, as vLLM's scheduler admits a waiting request."""
    blocks, num_hit_tokens, _ = manager.get_computed_blocks(request)
    manager.allocate_slots(
        request, PROMPT_LEN - num_hit_tokens, num_hit_tokens, blocks if num_hit_tokens else None
    )
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = PROMPT_LEN


def _steps(manager: Any, requests: list[Request], args: argparse.Namespace, times: Times) -> None:
    """``args.steps`` steps: the oldest ``args.churn`` running requests finish (freed,
    as vLLM's scheduler frees them after the step's output), every other one decodes
    a token, and as many waiting requests are admitted."""
    running = collections.deque(requests[: args.requests])
    waiting = iter(requests[args.requests :])
    clock = [0.0, 0.0, 0.0, 0.0]  # decode, admit, free, flush (seconds)
    for token in range(args.steps):
        time.sleep(args.settle_ms / 1000)
        finished = [running.popleft() for _ in range(args.churn)]
        for request in running:
            request.append_output_token_ids(token)
        admitted = [next(waiting) for _ in range(args.churn)]
        marks = [time.thread_time()]
        for request in finished:
            request.status = RequestStatus.FINISHED_STOPPED
            manager.free(request)
        marks.append(time.thread_time())
        for request in running:
            manager.allocate_slots(request, 1)
        marks.append(time.thread_time())
        for request in admitted:
            _admit(manager, request)
        marks.append(time.thread_time())
        manager.take_kv_cache_block_copies()
        marks.append(time.thread_time())
        for request in running:
            request.num_computed_tokens += 1
        running.extend(admitted)
        for part, (start, end) in zip((2, 0, 1, 3), itertools.pairwise(marks), strict=True):
            clock[part] += end - start
    decodes, churned = args.steps * (args.requests - args.churn), args.steps * args.churn
    times.decode_us.append(clock[0] / decodes * 1e6)
    if churned:
        times.admit_us.append(clock[1] / churned * 1e6)
        times.free_us.append(clock[2] / churned * 1e6)
    times.flush_ms.append(clock[3] / args.steps * 1e3)


def _run(mode: str, target: str, step_socket: str, args: argparse.Namespace, times: Times) -> None:
    connection = (
        Mode(mode, KVServiceScheduler, None)
        if mode == IN_PROCESS
        else Mode(mode, KVServiceScheduler, target, client_hashes=True, step_socket=step_socket)
    )
    with connection_env(connection):
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
    manager = scheduler.kv_cache_manager
    if mode == PYTHON_RECORDING:
        manager.server.record_allocation = lambda *_: False
    requests = _requests(args.requests + args.steps * args.churn)
    for request in requests[: args.requests]:
        _admit(manager, request)
    manager.take_kv_cache_block_copies()
    _steps(manager, requests, args, times)
    for request in requests:
        if request.status == RequestStatus.RUNNING:
            request.status = RequestStatus.FINISHED_ABORTED
            manager.free(request)
    scheduler.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--churn",
        type=int,
        default=8,
        help="requests finished and admitted each step (bench_vllm_scheduler's churn "
        "finishes about 8 of 256 a step); 0: decode steps only",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=0.0,
        help="sleep this long (untimed) before each step's allocations, in every mode: "
        "the server's work after its answer is then over while they run",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.churn < args.requests:
        parser.error(f"--churn must lie in [0, --requests): {args.churn}")
    print(f"machine: {machine_load()} at start")
    directory = tempfile.mkdtemp(prefix="kvservice-")
    socket_path = os.path.join(directory, "kvservice.sock")
    samples = {mode: Times() for mode in MODES}
    try:
        with child_server(server_args(socket_path)) as server:
            for round_index in range(args.rounds):
                for mode in rotated(MODES, round_index):
                    _run(mode, server.target, step_socket_path(socket_path), args, samples[mode])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    _report(samples, args)
    print(f"machine: {machine_load()} at end")


def _report(samples: dict[str, Times], args: argparse.Namespace) -> None:
    print(
        f"steps of {args.requests} running vLLM requests, {args.churn} of them finished "
        f"and {args.churn} admitted a step, {args.steps} steps, {args.rounds} rounds, "
        f"{args.settle_ms:g} ms settling before each step; the scheduler thread's CPU, "
        "median over rounds"
    )
    columns = ("decode us/call", "admission us/call", "free us/call", "flush ms/step")
    print(f"{'mode':26s}" + "".join(f"{column:>24s}" for column in columns))
    base = samples[IN_PROCESS]
    for mode, times in samples.items():
        cells = [
            _spread(times.decode_us, ".2f", base.decode_us),
            _spread(times.admit_us, ".1f", base.admit_us),
            _spread(times.free_us, ".2f", base.free_us),
            _spread(times.flush_ms, ".3f", base.flush_ms),
        ]
        print(f"{mode:26s}" + "".join(f"{cell:>24s}" for cell in cells))
    print(
        "us/call: vLLM's scheduler's calls, a decode step's allocate_slots, an "
        "admission's get_computed_blocks and allocate_slots, a finished request's free; "
        "+: over in-process, within each round (median)"
    )


def _spread(values: list[float], spec: str, base: list[float]) -> str:
    """The median, and its median excess over ``base`` round by round ("-": no call)."""
    if not values:
        return "-"
    extra = statistics.median(value - b for value, b in zip(values, base, strict=True))
    return f"{statistics.median(values):{spec}} (+{extra:{spec}})"


if __name__ == "__main__":
    main()

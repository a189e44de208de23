"""What the remote link adds to each ``allocate_slots`` of vLLM's decode step, without
vLLM's scheduler around it.

``bench_vllm_scheduler`` times whole scheduler steps, where the link's per-call cost
(a few microseconds of a 3-5 ms step) drowns in the machine's noise. Here the same
manager vLLM's scheduler calls (``KVServiceKVCacheManager``) is driven directly with
vLLM's own ``Request`` objects: ``--requests`` running requests are admitted
(untimed), then each decode step appends one token to each (untimed) and allocates
its slot, and the step is flushed (``take_kv_cache_block_copies``) as vLLM's
scheduler closes it. Timed as the scheduler thread's CPU time (``time.thread_time``,
what issue 26's row
compares; the server's CPU is not in it), in rounds that rotate the modes' order:

* the allocations, per call: what vLLM's scheduler waits for, in-process and remote;
* the flush, per step (remote: the step built, sent on the step socket, its answer
  read and checked; waiting for the server costs no CPU here).

Modes: ``in-process``; ``remote`` (a kvservice server in a child process, the
engine's step socket, vLLM's hashes sent): each allocation recorded from the
replica's request, compiled (``ServerRequests.record_allocation``); ``remote, Python
recording``: the same, each allocation recorded by the link in Python from vLLM's
request (``ServerLink.allocated``, the path an allocation attaching a hit takes).

Run: ``python -m benchmarks.bench_vllm_link [--requests 256] [--steps 40] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
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

PROMPT_LEN = 100
IN_PROCESS = "in-process"
REMOTE = "remote"
PYTHON_RECORDING = "remote, Python recording"
MODES = (IN_PROCESS, REMOTE, PYTHON_RECORDING)


@dataclass
class Times:
    """One mode's rounds: microseconds per allocation, milliseconds per flush."""

    allocate_us: list[float] = field(default_factory=list)
    flush_ms: list[float] = field(default_factory=list)


def _requests(count: int) -> list[Request]:
    hasher = block_hasher(SETUP.block_size)
    return [
        Request(
            f"r{i}",
            [(i * 7919 + t) % 32000 for t in range(PROMPT_LEN)],
            SamplingParams(max_tokens=1_000, ignore_eos=True),
            None,
            arrival_time=float(i),
            block_hasher=hasher,
        )
        for i in range(count)
    ]


def _admit(manager: Any, requests: list[Request]) -> None:
    """Each request's prompt, as vLLM's scheduler admits a waiting request."""
    for request in requests:
        blocks, num_hit_tokens, _ = manager.get_computed_blocks(request)
        manager.allocate_slots(
            request, PROMPT_LEN - num_hit_tokens, num_hit_tokens, blocks if num_hit_tokens else None
        )
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = PROMPT_LEN
    manager.take_kv_cache_block_copies()


def _decode(manager: Any, requests: list[Request], steps: int, times: Times) -> None:
    allocate_s = flush_s = 0.0
    for token in range(steps):
        for request in requests:
            request.append_output_token_ids(token)
        start = time.thread_time()
        for request in requests:
            manager.allocate_slots(request, 1)
        middle = time.thread_time()
        manager.take_kv_cache_block_copies()
        flush_s += time.thread_time() - middle
        allocate_s += middle - start
        for request in requests:
            request.num_computed_tokens += 1
    times.allocate_us.append(allocate_s / (steps * len(requests)) * 1e6)
    times.flush_ms.append(flush_s / steps * 1e3)


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
    requests = _requests(args.requests)
    _admit(manager, requests)
    _decode(manager, requests, args.steps, times)
    for request in requests:
        request.status = RequestStatus.FINISHED_ABORTED
        manager.free(request)
    scheduler.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
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
        f"decode steps of {args.requests} vLLM requests (one allocate_slots each), "
        f"{args.steps} steps, {args.rounds} rounds; median (lowest-highest round)"
    )
    base = samples[IN_PROCESS].allocate_us
    print(f"{'mode':26s} {'us/allocation':>22s} {'link us/allocation':>20s} {'flush ms/step':>20s}")
    for mode, times in samples.items():
        extra = [us - in_process for us, in_process in zip(times.allocate_us, base, strict=True)]
        print(
            f"{mode:26s} {_spread(times.allocate_us, '.2f'):>22s} "
            f"{statistics.median(extra):>20.2f} {_spread(times.flush_ms, '.3f'):>20s}"
        )
    print(
        "link us/allocation: this mode's allocation over the in-process one's, within "
        "each round (median)"
    )


def _spread(values: list[float], spec: str) -> str:
    return f"{statistics.median(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"


if __name__ == "__main__":
    main()

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

Prompts (``--shared-len``, ``--unique-len``) are by default as long as
``bench_vllm_scheduler``'s churn prompts on average.

With ``--in-scheduler``, the calls are timed inside vLLM's own scheduler instead:
``bench_vllm_scheduler``'s churn workload, ``--steps`` steps a round, each of the
manager's methods that vLLM's scheduler calls timed per call (the scheduler thread's
CPU), and the whole step, in four modes: in-process, remote (as above), in-process
with a minimal link (``_MinimalLink``: the prompt, tokens and hashes a server's pool
needs, sent each step to a stand-in process that spends the remote server's CPU a
step, nothing recorded or checked beyond that), and in-process with pass-through
hooks (a Python function in front of each method a link records, calling through).
It prints what each of the last three adds to each method and to the step, and how
much of the step's extra falls outside the manager's methods, in vLLM's code around
them (after a wait for another process, the scheduler's own code runs on caches
that process has used).

Run: ``python -m benchmarks.bench_vllm_link [--requests 256] [--churn 8] [--steps 40]
[--rounds 5] [--settle-ms 0] [--shared-len 256] [--unique-len 288]
[--in-scheduler]``.
"""

from __future__ import annotations

import argparse
import array
import collections
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from benchmarks.bench_vllm_scheduler import (
    SETUP,
    Mode,
    churn,
    connection_env,
    server_args,
    step_socket_path,
)
from kvservice.bench.measure import machine_load, rotated
from kvservice.bench.server import child_server
from kvservice.bench.stand_in import StandIn
from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.testing import block_hasher, build_scheduler
from kvservice.protocol import pack_token_ids

IN_PROCESS = "in-process"
REMOTE = "remote"
PYTHON_RECORDING = "remote, Python recording"
MODES = (IN_PROCESS, REMOTE, PYTHON_RECORDING)
MINIMAL_LINK = "in-process, minimal link"
PASS_THROUGH = "in-process, pass-through"
# The link's methods: those vLLM's scheduler calls that a remote link records.
LINKED_METHODS = ("get_computed_blocks", "allocate_slots", "free", "take_kv_cache_block_copies")


@dataclass
class Times:
    """One mode's rounds: microseconds per call of each kind, milliseconds per flush."""

    decode_us: list[float] = field(default_factory=list)
    admit_us: list[float] = field(default_factory=list)
    free_us: list[float] = field(default_factory=list)
    flush_ms: list[float] = field(default_factory=list)


def _requests(count: int, args: argparse.Namespace) -> list[Request]:
    """Prompts that share their first tokens (a system prompt), as admissions hit."""
    hasher = block_hasher(SETUP.block_size)
    return [
        Request(
            f"r{i}",
            [*range(args.shared_len), *((i * 7919 + t) % 32000 for t in range(args.unique_len))],
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
        request,
        request.num_prompt_tokens - num_hit_tokens,
        num_hit_tokens,
        blocks if num_hit_tokens else None,
    )
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_prompt_tokens


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
    requests = _requests(args.requests + args.steps * args.churn, args)
    for request in requests[: args.requests]:
        _admit(manager, request)
    manager.take_kv_cache_block_copies()
    _steps(manager, requests, args, times)
    for request in requests:
        if request.status == RequestStatus.RUNNING:
            request.status = RequestStatus.FINISHED_ABORTED
            manager.free(request)
    scheduler.shutdown()


class _MethodClock:
    """The scheduler thread's CPU seconds and calls of each of a manager's methods that
    vLLM's scheduler calls, timed on the manager instance until ``stop``; a method
    called from inside another timed one counts in its caller's time only."""

    def __init__(self, manager: Any) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self._depth = 0
        self._stopped = False
        for name in dir(type(manager)):
            if not name.startswith("_") and callable(getattr(type(manager), name)):
                setattr(manager, name, self._timed(name, getattr(manager, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth or self._stopped:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - start
                self.calls[name] += 1
                self._depth -= 1

        return timed

    def stop(self) -> None:
        """Time no call after this (the scheduler's shutdown is no step's)."""
        self._stopped = True


class _MinimalLink:
    """A remote link reduced to what a server's copy of the pool needs, in Python
    around the in-process manager: each new request's prompt tokens (packed at its
    lookup) and vLLM's hashes of its blocks, each allocation's request and size with
    the tokens and hashes the server lacks (an allocation only notes its request; the
    step reads them all in one loop), each free; sent once a step to a stand-in server
    process (``kvservice.bench.stand_in``) that spends the real server's CPU a step
    and answers 4 bytes an operation. It builds no message, keeps no replica of the
    server's answers and checks none: its cost over in-process is the part of the
    remote link's that any link keeping a server's pool in step would pay (the
    transport, the waiting, the tokens read and sent), as far as Python code makes
    it."""

    def __init__(self, manager: Any, stand_in: StandIn, server_seconds: float) -> None:
        self._stand_in = stand_in
        self._server_seconds = server_seconds
        self._tokens_sent: dict[str, int] = {}
        self._hashes_sent: dict[str, int] = {}
        self._data: list[bytes] = []
        self._request_ids: list[str] = []
        self._columns = array.array("I")
        # Each allocation's request and size, sent with the step (the tokens the
        # server lacks read then, in one loop, not in each call).
        self._allocations: list[tuple[Request, int]] = []
        lookup, allocate = manager.get_computed_blocks, manager.allocate_slots
        free, flush = manager.free, manager.take_kv_cache_block_copies

        def get_computed_blocks(request: Request, *args: Any) -> Any:
            self._send_tokens(request)
            return lookup(request, *args)

        def allocate_slots(request: Request, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
            self._allocations.append((request, num_new_tokens))
            return allocate(request, num_new_tokens, *args, **kw)

        def free_request(request: Request) -> None:
            self._request_ids.append(request.request_id)
            if request.is_finished():
                self._tokens_sent.pop(request.request_id, None)
                self._hashes_sent.pop(request.request_id, None)
            free(request)

        def take_kv_cache_block_copies() -> Any:
            self._send()
            return flush()

        manager.get_computed_blocks, manager.allocate_slots = get_computed_blocks, allocate_slots
        manager.free, manager.take_kv_cache_block_copies = free_request, take_kv_cache_block_copies

    def _send_tokens(self, request: Request) -> None:
        request_id = request.request_id
        tokens, hashes = request._all_token_ids, request.block_hashes
        sent = self._tokens_sent.get(request_id)
        if sent is None:
            self._hashes_sent[request_id] = 0
            self._request_ids.append(request_id)
            self._data.append(pack_token_ids(tokens[: request.num_prompt_tokens]))
            self._tokens_sent[request_id] = request.num_prompt_tokens
        elif len(tokens) > sent:
            self._columns.extend(tokens[sent:])
            self._tokens_sent[request_id] = len(tokens)
        if len(hashes) > self._hashes_sent[request_id]:
            self._data.extend(hashes[self._hashes_sent[request_id] :])
            self._hashes_sent[request_id] = len(hashes)

    def _send(self) -> None:
        for request, num_new_tokens in self._allocations:
            self._send_tokens(request)
            self._request_ids.append(request.request_id)
            self._columns.append(num_new_tokens)
        self._allocations.clear()
        ids = "\n".join(self._request_ids).encode()
        self._data += [ids, self._columns.tobytes()]
        self._stand_in.run(self._server_seconds, b"".join(self._data), 4 * len(self._request_ids))
        self._data, self._request_ids, self._columns = [], [], array.array("I")


def _pass_through(manager: Any) -> None:
    """Put a Python function that only calls through in front of each of the
    manager's ``LINKED_METHODS``, as any link written in Python hooks them."""
    for name in LINKED_METHODS:
        method = getattr(manager, name)

        def call_through(*args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
            return _method(*args, **kwargs)

        setattr(manager, name, call_through)


@dataclass
class StepTimes:
    """One mode's rounds inside vLLM's scheduler: its methods' clocks, the step's whole
    CPU (``schedule()`` plus ``update_from_output()``) and the server's, per step."""

    clocks: list[_MethodClock] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    server_seconds: list[float] = field(default_factory=list)
    steps: int = 0


def _run_in_scheduler(
    mode: str, server: Any, step_socket: str, steps: int, runs: dict[str, StepTimes]
) -> None:
    """``bench_vllm_scheduler``'s churn workload through vLLM's own scheduler, each of the
    manager's methods timed; the minimal link's stand-in spends the remote mode's
    server CPU a step so far."""
    remote = mode == REMOTE
    connection = (
        Mode(mode, KVServiceScheduler, server.target, client_hashes=True, step_socket=step_socket)
        if remote
        else Mode(mode, KVServiceScheduler, None)
    )
    with connection_env(connection):
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
    with ExitStack() as stack:
        if mode == PASS_THROUGH:
            _pass_through(scheduler.kv_cache_manager)
        elif mode == MINIMAL_LINK:
            # Only this mode has a stand-in process: an idle one would still share the CPUs.
            stand_in = stack.enter_context(closing(StandIn()))
            server_seconds = statistics.median(runs[REMOTE].server_seconds)
            _MinimalLink(scheduler.kv_cache_manager, stand_in, server_seconds)
        clock = _MethodClock(scheduler.kv_cache_manager)
        timing = churn(scheduler, steps, 0, 0.0, server.pid if remote else None)
        clock.stop()
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    scheduler.shutdown()
    into = runs[mode]
    into.clocks.append(clock)
    into.step_seconds.append(timing.cpu_seconds / timing.steps)
    into.server_seconds.append(timing.server_cpu_seconds / timing.steps)
    into.steps = timing.steps


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
    # bench_vllm_scheduler's churn prompts: a shared prefix of 0, 256 or 512 tokens and
    # 64-511 of their own, about 256 + 288 on average.
    parser.add_argument(
        "--shared-len", type=int, default=256, help="prompt tokens every request shares"
    )
    parser.add_argument(
        "--unique-len", type=int, default=288, help="prompt tokens of each request's own"
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=0.0,
        help="sleep this long (untimed) before each step's allocations, in every mode: "
        "the server's work after its answer is then over while they run",
    )
    parser.add_argument(
        "--in-scheduler",
        action="store_true",
        help="instead, run bench_vllm_scheduler's churn workload through vLLM's own "
        "scheduler (--steps steps a round) and time each of the manager's methods there",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.churn < args.requests:
        parser.error(f"--churn must lie in [0, --requests): {args.churn}")
    print(f"machine: {machine_load()} at start")
    directory = tempfile.mkdtemp(prefix="kvservice-")
    socket_path = os.path.join(directory, "kvservice.sock")
    samples = {mode: Times() for mode in MODES}
    # The minimal link's stand-in spends the remote mode's server CPU measured in the
    # rounds so far: the first round runs the remote mode before it.
    in_scheduler = {mode: StepTimes() for mode in (IN_PROCESS, REMOTE, MINIMAL_LINK, PASS_THROUGH)}
    try:
        with child_server(server_args(socket_path)) as server:
            for round_index in range(args.rounds):
                step_socket = step_socket_path(socket_path)
                if args.in_scheduler:
                    for mode in rotated(list(in_scheduler), round_index):
                        _run_in_scheduler(mode, server, step_socket, args.steps, in_scheduler)
                    continue
                for mode in rotated(MODES, round_index):
                    _run(mode, server.target, step_socket, args, samples[mode])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.in_scheduler:
        _report_in_scheduler(in_scheduler)
    else:
        _report(samples, args)
    print(f"machine: {machine_load()} at end")


def _report(samples: dict[str, Times], args: argparse.Namespace) -> None:
    print(
        f"steps of {args.requests} running vLLM requests, {args.churn} of them finished "
        f"and {args.churn} admitted a step (prompts of {args.shared_len} shared + "
        f"{args.unique_len} own tokens), {args.steps} steps, {args.rounds} rounds, "
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


def _report_in_scheduler(runs: dict[str, StepTimes]) -> None:
    base, remote = runs[IN_PROCESS], runs[REMOTE]
    print(
        f"bench_vllm_scheduler's churn workload through vLLM's scheduler, {base.steps} "
        f"steps, {len(base.clocks)} rounds; the scheduler thread's CPU in each manager "
        "method vLLM's scheduler calls (median over rounds), and what the remote mode, "
        "the minimal link and pass-through hooks add to it a step (+: over in-process "
        "within each round)"
    )
    columns = (
        "calls/step",
        "in-process us",
        "remote us",
        *(f"{label} +ms" for label in ("remote", "minimal", "through")),
    )
    print(f"{'method':30s}" + "".join(f"{column:>15s}" for column in columns))
    names = sorted(
        {name for clock in remote.clocks for name in clock.calls},
        key=lambda name: -sum(clock.seconds[name] for clock in remote.clocks),
    )
    for name in names:
        calls = statistics.median(c.calls[name] / remote.steps for c in remote.clocks)
        cells = (
            f"{calls:.1f}",
            _per_call(base, name),
            _per_call(remote, name),
            *(
                f"{statistics.median(_extra(base, runs[mode], name)):+.3f}"
                for mode in (REMOTE, MINIMAL_LINK, PASS_THROUGH)
            ),
        )
        print(f"{name:30s}" + "".join(f"{cell:>15s}" for cell in cells))
    print(
        f"a step: in-process {statistics.median(base.step_seconds) * 1e3:.2f} ms; "
        f"the server's CPU {statistics.median(remote.server_seconds) * 1e3:.2f} ms "
        "(spent by the minimal link's stand-in too)"
    )
    for name in (REMOTE, MINIMAL_LINK, PASS_THROUGH):
        times = runs[name]
        step = statistics.median(_extra(base, times))
        methods = statistics.median(_extra(base, times, *names))
        print(
            f"  {name}: {step:+.3f} ms a step, of which the manager's methods "
            f"{methods:+.3f} ms and vLLM's scheduler around them {step - methods:+.3f} ms"
        )


def _extra(base: StepTimes, times: StepTimes, *names: str) -> list[float]:
    """Per round, milliseconds a step ``times`` spends over ``base`` in the methods
    ``names`` (none named: in the whole step)."""
    if not names:
        pairs = zip(base.step_seconds, times.step_seconds, strict=True)
        return [(seconds - base_seconds) * 1e3 for base_seconds, seconds in pairs]
    return [
        sum(c.seconds[name] / times.steps - b.seconds[name] / base.steps for name in names) * 1e3
        for b, c in zip(base.clocks, times.clocks, strict=True)
    ]


def _per_call(times: StepTimes, name: str) -> str:
    """``name``'s median microseconds a call ("-": never called)."""
    values = [c.seconds[name] / c.calls[name] * 1e6 for c in times.clocks if c.calls[name]]
    return f"{statistics.median(values):.2f}" if values else "-"


def _spread(values: list[float], spec: str, base: list[float]) -> str:
    """The median, and its median excess over ``base`` round by round ("-": no call)."""
    if not values:
        return "-"
    extra = statistics.median(value - b for value, b in zip(values, base, strict=True))
    return f"{statistics.median(values):{spec}} (+{extra:{spec}})"


if __name__ == "__main__":
    main()

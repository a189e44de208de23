"""vLLM 0.33's own scheduler on three KV cache managers, side by side in one run.

The scheduler is vLLM's ``Scheduler`` in every column; only its manager changes:
vLLM's built-in ``KVCacheManager``, kvservice's core in-process, and kvservice over a
server on loopback (a child process), confirming each step before its output or, with
``overlap``, before the next step. Each round runs every mode once, in turn, on the
same seeded workload, and times ``schedule()`` plus ``update_from_output()`` (the fake
model's output is built outside the timer):

The remote modes run over loopback TCP, over the server's Unix domain socket (gRPC,
``unix``), and over its step socket (``--step-socket``: the steps framed without gRPC,
everything else over TCP; the ``socket`` rows).

- ``decode``: 256 running requests, each step one token per request.
- ``churn``: short answers and steady arrivals, so most steps admit and finish requests
  (prefix lookups, hashing, frees) while about 256 run.

It prints steps/s per mode (median over rounds), each kvservice mode's ratio to the
built-in manager measured within every round (median and spread), and the round trips
per step of the remote modes. ``KVSERVICE_CONFIRM=overlap`` waits for the server's
answer before the next step instead of before the output: its round trip hides behind
the forward pass, which ``--forward-ms`` simulates (a sleep outside the timer).

With ``--async-scheduling`` every mode runs as vLLM runs with async scheduling on (its
default on a GPU): vLLM's ``AsyncScheduler`` against ``KVServiceAsyncScheduler``
in-process and remote, driven in the order of ``EngineCore.step_with_batch_queue``
with a batch queue of 2 (step N+1 is planned before step N's output is applied). The
forward pass is then a fake GPU: a step dispatched at ``schedule()`` runs for
``--forward-ms`` once the previous step's forward is done, and its output is applied
once that forward has ended, so the scheduler's work for step N+1 (and the update of
step N) overlaps step N+1's forward as in the engine. What is timed is the whole loop,
steps/s, each step taking about max(forward, scheduler work); the fake model's output,
the arrivals and the decision check are left out of the clock. Every kvservice mode's
scheduler outputs, sampled tokens and stats must equal the ``AsyncScheduler``'s.

With ``--profile`` it instead samples (pyinstrument) the churn workload's steps on
the built-in manager, in-process and remote (over gRPC and over the step socket, both
on vLLM's hashes), and prints where each step goes: the
manager's share of ``schedule()`` plus ``update_from_output()`` (the manager's own
methods, everything they call included, and for the remote mode the wait for the
server), its methods, the remote link's parts (recording, building, sending,
waiting, checking), and the ratio an in-process manager that cost nothing would
reach (the floor vLLM's own scheduler code sets). It then runs each remote mode again,
unprofiled, with py-spy sampling the server, and prints the server's CPU a step by
where it went: the transport (gRPC, asyncio, threads: no kvservice frame), the Step
runner (compiled, so sampled as its caller's line), and kvservice's Python around it.
Last, unsampled, the scheduler thread's CPU a churn step: in-process, in-process with
a wait after each ``schedule()`` as long as the server's CPU (a sleep, then a stand-in
process busy that long: ``kvservice.bench.stand_in``), and remote, so that what
waiting on another process costs the thread is told apart from the link's own work;
then the same runs by phase, timed: ``schedule()`` without the manager's flush, the
flush (``take_kv_cache_block_copies``: the remote step built, sent, waited for and
checked) and ``update_from_output()``.
With ``perf`` installed, the step socket's server is sampled natively too (its C and
compiled frames, ``kvservice.bench.native_sampler``): its CPU by Step operation, and
the share of it that ran Python called from the compiled runner. And the scheduler's
own step, in-process and over the step socket, is sampled natively by py-spy (the
compiled link's parts, which the profiler above cannot see: recording, building the
Step, sending it, waiting, checking the answers), as shares of its samples.

    python -m benchmarks.bench_vllm_scheduler [--rounds 5] [--steps 200] [--forward-ms 0]
        [--async-scheduling] [--profile]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvservice.bench.measure import (
    machine_load,
    process_cpu_seconds,
    ratio_columns,
)
from kvservice.bench.native_sampler import (
    Stack,
    compiled_name,
    interpreted_under,
    native_sampled,
)
from kvservice.bench.process_sampler import (
    SamplerUnavailableError,
    natively_sampled,
    sampled,
)
from kvservice.bench.server import child_server
from kvservice.bench.stand_in import StandIn
from kvservice.client import COMPILED as CLIENT_COMPILED
from kvservice.core import COMPILED as CORE_COMPILED  # one build with the server's
from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.testing import (
    SchedulerSetup,
    block_hasher,
    build_scheduler,
)

VOCAB = 32000
NUM_RUNNING = 256
# The mode every remote mode's scheduler-thread CPU is set against (issue 26's row).
IN_PROCESS = "kvservice in-process"
SETUP = SchedulerSetup(
    num_blocks=40_000,
    max_num_batched_tokens=8192,
    max_num_seqs=NUM_RUNNING,
    max_model_len=4096,
)
# vLLM's engine with async scheduling keeps two steps in flight (its batch queue).
ASYNC_SETUP = replace(SETUP, async_scheduling=True)
BATCH_QUEUE_SIZE = 2


@dataclass(frozen=True)
class Mode:
    name: str
    scheduler_cls: type
    target: str | None
    confirm: str = "sync"
    server_pid: int | None = None
    # Send vLLM's block hashes (the server trusts them and hashes nothing).
    client_hashes: bool = False
    # The server's step socket (KVSERVICE_STEP_SOCKET): steps framed, without gRPC.
    step_socket: str = ""


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


@dataclass
class Timing:
    """The timed steps: wall seconds in the scheduler, this thread's CPU seconds there
    (what other processes on a shared machine disturb least), round trips."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    server_cpu_seconds: float = 0.0
    # Sync scheduling only: this thread's CPU seconds in the manager's flush (inside
    # schedule()) and in update_from_output().
    flush_cpu_seconds: float = 0.0
    update_cpu_seconds: float = 0.0
    round_trips: int = 0
    steps: int = 0
    # Async scheduling only: wall seconds inside schedule() and update_from_output(),
    # the fake GPU's forward seconds, and a digest of every decision and output.
    scheduler_seconds: float = 0.0
    gpu_seconds: float = 0.0
    decisions: str = ""


class _TimedFlush:
    """A manager's ``take_kv_cache_block_copies``, the last call of ``schedule()``: the
    remote manager's flush (the step built, sent, waited for and its answers checked),
    with this thread's CPU seconds in it."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call = call
        self.cpu_seconds = 0.0

    def __call__(self) -> Any:
        start = time.thread_time()
        try:
            return self._call()
        finally:
            self.cpu_seconds += time.thread_time() - start


def _step(
    scheduler: Any, timing: Timing, forward_s: float = 0.0, server_pid: int | None = None
) -> None:
    """One scheduler step, timed outside the fake model's output; with ``server_pid``,
    the server process's CPU time over the step too."""
    server_cpu = process_cpu_seconds(server_pid) if server_pid else None
    server = getattr(scheduler.kv_cache_manager, "server", None)
    flush = scheduler.kv_cache_manager.take_kv_cache_block_copies
    flushed = flush.cpu_seconds if isinstance(flush, _TimedFlush) else 0.0

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
    update_cpu = time.thread_time() - start_cpu
    timing.seconds += wall + time.perf_counter() - start
    timing.cpu_seconds += cpu + update_cpu
    timing.update_cpu_seconds += update_cpu
    if isinstance(flush, _TimedFlush):
        timing.flush_cpu_seconds += flush.cpu_seconds - flushed
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


def _output(scheduler: Any, scheduled: Any) -> Any:
    """The fake model's output for a step, fixed when the step is planned (as the real
    model's inputs are, also with a step in flight): ``schedule()`` has already counted
    the step's tokens as computed, so a request whose step is not a partial prefill
    chunk samples at position ``num_computed_tokens``."""
    req_ids = list(scheduled.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append(
            [] if request.is_prefill_chunk else [_token(req_id, request.num_computed_tokens)]
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _scheduled_decisions(scheduled: Any) -> tuple[Any, ...]:
    """Everything of a ``SchedulerOutput`` that the KV cache manager decides."""
    cached = scheduled.scheduled_cached_reqs
    return (
        [(r.req_id, r.block_ids, r.num_computed_tokens) for r in scheduled.scheduled_new_reqs],
        cached.req_ids,
        cached.new_block_ids,
        cached.num_computed_tokens,
        sorted(cached.resumed_req_ids),
        list(scheduled.num_scheduled_tokens.items()),
        sorted(scheduled.preempted_req_ids or ()),
        sorted(scheduled.finished_req_ids),
        scheduled.new_block_ids_to_zero,
        scheduled.kv_cache_block_copies,
    )


def _update_decisions(outputs: Any) -> list[Any]:
    """What ``update_from_output`` handed back: tokens, finishes, usage, prefix hits."""
    seen: list[Any] = []
    for client, engine_outputs in sorted(outputs.items()):
        stats = engine_outputs.scheduler_stats
        prefix = None if stats is None else stats.prefix_cache_stats
        seen.append(
            (
                client,
                [(o.request_id, o.new_token_ids, o.finish_reason) for o in engine_outputs.outputs],
                None if stats is None else stats.kv_cache_usage,
                None if prefix is None else (prefix.requests, prefix.queries, prefix.hits),
            )
        )
    return seen


class EngineLoop:
    """vLLM's ``EngineCore.step_with_batch_queue`` with a batch queue of 2 over a fake,
    serial GPU. A step is dispatched when ``schedule()`` returns; its forward starts
    then or when the previous step's forward ends, whichever is later, and lasts
    ``forward_s`` (none for a step that scheduled no tokens); ``update_from_output`` of a
    step first sleeps until its forward has ended. Steady state: plan step N+1 (its
    forward queued behind step N's), wait for step N's forward, apply its output; the
    loop's step time is max(forward, scheduler work).

    The clock leaves out what the real engine does not do on the scheduler's thread or
    does the same for every manager: building the fake model's output, the decision
    digest, and the arrivals (``before`` of ``timed``)."""

    def __init__(self, scheduler: Any, forward_s: float) -> None:
        self.scheduler = scheduler
        self.forward_s = forward_s
        # (scheduled, model output, when its forward ends, whether it ran), newest left.
        self.in_flight: deque[tuple[Any, Any, float, bool]] = deque()
        self.gpu_free_at = 0.0
        self.excluded = 0.0
        self.digest = hashlib.blake2b(digest_size=16)
        self.timing = Timing()

    def now(self) -> float:
        """Wall time, less the time spent outside the engine's own work."""
        return time.perf_counter() - self.excluded

    def _untimed(self, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = work()
        self.excluded += time.perf_counter() - start
        return result

    def _in_scheduler(self, work: Callable[[], Any]) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        result = work()
        self.timing.scheduler_seconds += time.perf_counter() - wall
        self.timing.cpu_seconds += time.thread_time() - cpu
        return result

    def _plan(self, scheduled: Any) -> Any:
        self.digest.update(repr(_scheduled_decisions(scheduled)).encode())
        return _output(self.scheduler, scheduled)

    def iteration(self) -> bool:
        """One call of ``step_with_batch_queue``; True when it applied a step's output."""
        scheduler = self.scheduler
        if scheduler.has_requests():
            scheduled = self._in_scheduler(scheduler.schedule)
            executed = scheduled.total_num_scheduled_tokens > 0
            dispatched = self.now()
            output = self._untimed(lambda: self._plan(scheduled))
            ready = dispatched
            if executed:
                ready = self.gpu_free_at = max(dispatched, self.gpu_free_at) + self.forward_s
            self.in_flight.appendleft((scheduled, output, ready, executed))
            if len(self.in_flight) < BATCH_QUEUE_SIZE and (executed or scheduler.has_requests()):
                return False
        elif not self.in_flight:
            return False
        scheduled, output, ready, executed = self.in_flight.pop()
        wait = ready - self.now()
        if wait > 0:
            time.sleep(wait)  # the GPU still runs this step's forward
        outputs = self._in_scheduler(lambda: scheduler.update_from_output(scheduled, output))
        self._untimed(lambda: self.digest.update(repr(_update_decisions(outputs)).encode()))
        if executed:
            self.timing.gpu_seconds += self.forward_s
        return True

    def timed(
        self, steps: int, server_pid: int | None, before: Callable[[], None] | None = None
    ) -> Timing:
        """Loop until ``steps`` steps' outputs are applied, timing the whole loop."""
        self.timing = timing = Timing()
        server = getattr(self.scheduler.kv_cache_manager, "server", None)
        trips = 0 if server is None else server.round_trips
        server_cpu = process_cpu_seconds(server_pid) if server_pid else None
        start = self.now()
        while timing.steps < steps:
            if before is not None:
                self._untimed(before)
            if self.iteration():
                timing.steps += 1
        timing.seconds = self.now() - start
        if server is not None:
            timing.round_trips = server.round_trips - trips
        if server_pid and server_cpu is not None:
            timing.server_cpu_seconds = (process_cpu_seconds(server_pid) or 0.0) - server_cpu
        return timing


def decode_async(
    scheduler: Any, steps: int, seed: int, forward_s: float, server_pid: int | None
) -> EngineLoop:
    """``decode`` in the engine's batch-queue order: the prefills untimed, then
    ``steps`` decode steps."""
    for request in _requests(seed, NUM_RUNNING, (100_000, 100_001), 0):
        scheduler.add_request(request)
    loop = EngineLoop(scheduler, forward_s)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        loop.iteration()
    loop.timed(steps, server_pid)
    return loop


def churn_async(
    scheduler: Any, steps: int, seed: int, forward_s: float, server_pid: int | None
) -> EngineLoop:
    """``churn`` in the engine's batch-queue order (arrivals before each iteration)."""
    arrivals = iter(_requests(seed, NUM_RUNNING * 40, (8, 64), 0))

    def arrive() -> None:
        while len(scheduler.requests) < NUM_RUNNING + 32:
            scheduler.add_request(next(arrivals))

    loop = EngineLoop(scheduler, forward_s)
    loop.timed(steps, server_pid, arrive)
    return loop


ASYNC_WORKLOADS: dict[str, Callable[[Any, int, int, float, int | None], EngineLoop]] = {
    "decode": decode_async,
    "churn": churn_async,
}


def _run(
    mode: Mode,
    workload: str,
    steps: int,
    seed: int,
    forward_s: float,
    async_scheduling: bool = False,
    wait: Callable[[], object] | None = None,
) -> Timing:
    """One run of ``workload`` on ``mode``; ``wait`` (sync scheduling only) runs at the
    end of every ``schedule()`` (inside its time), where a remote manager waits for the
    server."""
    with connection_env(mode):
        return _run_mode(mode, workload, steps, seed, forward_s, async_scheduling, wait)


@contextmanager
def connection_env(mode: Mode) -> Iterator[None]:
    """``mode``'s KVSERVICE_* connection variables for the run, the caller's after it
    (a test process runs more than this benchmark)."""
    names = (
        "KVSERVICE_TARGET",
        "KVSERVICE_CONFIRM",
        "KVSERVICE_CLIENT_BLOCK_HASHES",
        "KVSERVICE_STEP_SOCKET",
    )
    saved = {name: os.environ.get(name) for name in names}
    if mode.target is None:
        os.environ.pop("KVSERVICE_TARGET", None)
    else:
        os.environ["KVSERVICE_TARGET"] = mode.target
    os.environ["KVSERVICE_CONFIRM"] = mode.confirm
    os.environ["KVSERVICE_CLIENT_BLOCK_HASHES"] = "auto" if mode.client_hashes else "off"
    os.environ["KVSERVICE_STEP_SOCKET"] = mode.step_socket
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_mode(
    mode: Mode,
    workload: str,
    steps: int,
    seed: int,
    forward_s: float,
    async_scheduling: bool,
    wait: Callable[[], object] | None = None,
) -> Timing:
    if async_scheduling:
        scheduler = build_scheduler(ASYNC_SETUP, mode.scheduler_cls)
        # KVServiceScheduler builds KVServiceAsyncScheduler from the config, as vLLM
        # picks AsyncScheduler: every mode must run vLLM's async variant.
        assert isinstance(scheduler, AsyncScheduler), type(scheduler)
        loop = ASYNC_WORKLOADS[workload](scheduler, steps, seed, forward_s, mode.server_pid)
        timing = loop.timing
        timing.decisions = loop.digest.hexdigest()
    else:
        scheduler = build_scheduler(SETUP, mode.scheduler_cls)
        manager = scheduler.kv_cache_manager
        manager.take_kv_cache_block_copies = _TimedFlush(manager.take_kv_cache_block_copies)
        if wait is not None:
            scheduler.schedule = _then(scheduler.schedule, wait)
        timing = WORKLOADS[workload](scheduler, steps, seed, forward_s, mode.server_pid)
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    scheduler.shutdown()
    return timing


def _then(call: Callable[[], Any], after: Callable[[], object]) -> Callable[[], Any]:
    def both() -> Any:
        result = call()
        after()
        return result

    return both


def main(argv: list[str] | None = None) -> int:
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
        "round trip behind); with --async-scheduling, each step's forward on a fake GPU "
        "that the scheduler's work overlaps (timed: the loop's steps/s)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="run every mode as vLLM does with async scheduling on: AsyncScheduler vs "
        "KVServiceAsyncScheduler, in the engine's batch-queue order (2 steps in flight)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample the churn steps of the built-in manager, in-process and remote, "
        "and print the manager's share of each step instead of timing",
    )
    args = parser.parse_args(argv)
    socket_dir = tempfile.mkdtemp(prefix="kvservice-")
    socket_path = os.path.join(socket_dir, "kvservice.sock")
    print(f"machine: {machine_load()} at start")
    try:
        return _compare(args, server_args(socket_path), socket_path)
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
        print(f"machine: {machine_load()} at end")


def server_args(socket_path: str) -> list[str]:
    """The benchmark's server: ``SETUP``'s pool, on TCP and also on a Unix domain socket
    (gRPC, ``socket_path``) and a step socket (framed): the co-located engine's
    transports."""
    return [
        f"--unix-socket={socket_path}",
        f"--step-socket={step_socket_path(socket_path)}",
        f"--num-blocks={SETUP.num_blocks}",
        f"--block-size={SETUP.block_size}",
        f"--max-model-len={SETUP.max_model_len}",
        "--max-step-ops=16384",
        "--session-ttl-min=1",
        # Whether a mode sends vLLM's hashes is the client's choice (Mode.client_hashes).
        "--trust-client-block-hashes",
    ]


def step_socket_path(socket_path: str) -> str:
    return socket_path.removesuffix(".sock") + "-steps.sock"


def _compare(args: argparse.Namespace, server_args: list[str], socket_path: str) -> int:
    if args.profile:
        with child_server(server_args) as server:
            _profile(server.target, server.pid, args.steps, step_socket_path(socket_path))
        return 0
    with child_server(server_args) as server:
        modes = [
            Mode("vllm built-in", Scheduler, None),
            Mode(IN_PROCESS, KVServiceScheduler, None),
            Mode("kvservice remote", KVServiceScheduler, server.target, "sync", server.pid),
            Mode(
                "remote, vLLM hashes",
                KVServiceScheduler,
                server.target,
                "sync",
                server.pid,
                client_hashes=True,
            ),
            Mode(
                "kvservice remote overlap", KVServiceScheduler, server.target, "overlap", server.pid
            ),
            Mode(
                "overlap, vLLM hashes",
                KVServiceScheduler,
                server.target,
                "overlap",
                server.pid,
                client_hashes=True,
            ),
            Mode(
                "kvservice remote unix",
                KVServiceScheduler,
                f"unix:{socket_path}",
                "sync",
                server.pid,
            ),
        ]
        step_socket = step_socket_path(socket_path)
        modes += [
            Mode(
                "step socket",
                KVServiceScheduler,
                server.target,
                "sync",
                server.pid,
                step_socket=step_socket,
            ),
            Mode(
                "socket, vLLM hashes",
                KVServiceScheduler,
                server.target,
                "sync",
                server.pid,
                client_hashes=True,
                step_socket=step_socket,
            ),
            Mode(
                "socket overlap, hashes",
                KVServiceScheduler,
                server.target,
                "overlap",
                server.pid,
                client_hashes=True,
                step_socket=step_socket,
            ),
        ]
        if args.async_scheduling:
            modes[0] = Mode("vllm built-in", AsyncScheduler, None)
        same = True
        for workload in args.workloads:
            runs: dict[str, list[Timing]] = {m.name: [] for m in modes}
            for round_ in range(args.rounds):
                for mode in modes:
                    timing = _run(
                        mode,
                        workload,
                        args.steps,
                        round_,
                        args.forward_ms / 1000,
                        args.async_scheduling,
                    )
                    runs[mode.name].append(timing)
            if args.async_scheduling:
                same = _report_async(workload, modes, runs, args) and same
            else:
                _report(workload, modes, runs, args)
    return 0 if same else 1


def _report(
    workload: str, modes: list[Mode], runs: dict[str, list[Timing]], args: argparse.Namespace
) -> None:
    base = runs[modes[0].name]
    print(f"\n{workload}: {NUM_RUNNING} requests, {args.steps} steps x {args.rounds} rounds")
    forward_s = args.forward_ms / 1000
    print(
        f"{'manager':<22}{'steps/s':>9}{'ratio':>8}{'spread':>13}"
        f"{'CPU ms/step':>13}{'CPU ratio':>11}{'trips/step':>12}{'server CPU ms/step':>20}"
        f"{'CPU vs in-process':>19}" + (f"{'with forward':>14}" if forward_s else "")
    )
    in_process = runs.get(IN_PROCESS)
    for mode in modes:
        timings = runs[mode.name]
        ratios = [b.seconds / t.seconds for t, b in zip(timings, base, strict=True)]
        cpu_ratios = [b.cpu_seconds / t.cpu_seconds for t, b in zip(timings, base, strict=True)]
        line = (
            f"{mode.name:<22}{statistics.median(t.steps / t.seconds for t in timings):>9.1f}"
            f"{ratio_columns(ratios)}"
            f"{statistics.median(1000 * t.cpu_seconds / t.steps for t in timings):>13.2f}"
            f"{statistics.median(cpu_ratios):>10.2f}x"
            f"{statistics.median(t.round_trips / t.steps for t in timings):>12.2f}"
            f"{statistics.median(1000 * t.server_cpu_seconds / t.steps for t in timings):>20.2f}"
        )
        if in_process is None:
            line += f"{'-':>19}"
        else:
            cpu_vs = [
                t.cpu_seconds / i.cpu_seconds for t, i in zip(timings, in_process, strict=True)
            ]
            line += f"{statistics.median(cpu_vs):>18.2f}x"
        if forward_s:
            # The engine's step is the forward pass and then the scheduler's work.
            engine = [
                (b.seconds + b.steps * forward_s) / (t.seconds + t.steps * forward_s)
                for t, b in zip(timings, base, strict=True)
            ]
            line += f"{statistics.median(engine):>13.2f}x"
        print(line)
    print(
        "ratio: the built-in manager's time over this mode's, within each round (median, "
        "lowest-highest); CPU: the scheduler thread's own CPU time (the remote server's "
        f"is not in it); CPU vs in-process: this mode's over {IN_PROCESS}'s, within each "
        "round (median)"
        + (
            "; with forward: the same ratio for the engine's whole step, the forward pass "
            "plus the scheduler's work (median)"
            if forward_s
            else ""
        )
    )


def _report_async(
    workload: str, modes: list[Mode], runs: dict[str, list[Timing]], args: argparse.Namespace
) -> bool:
    """The async table; False when a kvservice mode decided otherwise than vLLM's."""
    base = runs[modes[0].name]
    forward = f"{args.forward_ms:g} ms forward on a fake GPU" if args.forward_ms else "no forward"
    print(
        f"\n{workload}, async scheduling (AsyncScheduler, batch queue {BATCH_QUEUE_SIZE}, "
        f"{forward}): {NUM_RUNNING} requests, {args.steps} steps x {args.rounds} rounds"
    )
    print(
        f"{'manager':<26}{'steps/s':>9}{'ratio':>8}{'spread':>13}{'sched ms/step':>15}"
        f"{'CPU ms/step':>13}{'CPU ratio':>11}{'trips/step':>12}{'server CPU ms/step':>20}"
        f"{'GPU busy':>10}"
    )
    differ = []
    for mode in modes:
        timings = runs[mode.name]
        ratios = [b.seconds / t.seconds for t, b in zip(timings, base, strict=True)]
        cpu_ratios = [b.cpu_seconds / t.cpu_seconds for t, b in zip(timings, base, strict=True)]
        busy = statistics.median(t.gpu_seconds / t.seconds for t in timings)
        differ += [
            f"{mode.name} (round {round_})"
            for round_, (t, b) in enumerate(zip(timings, base, strict=True))
            if t.decisions != b.decisions
        ]
        print(
            f"{mode.name:<26}{statistics.median(t.steps / t.seconds for t in timings):>9.1f}"
            f"{ratio_columns(ratios)}"
            f"{statistics.median(1000 * t.scheduler_seconds / t.steps for t in timings):>15.2f}"
            f"{statistics.median(1000 * t.cpu_seconds / t.steps for t in timings):>13.2f}"
            f"{statistics.median(cpu_ratios):>10.2f}x"
            f"{statistics.median(t.round_trips / t.steps for t in timings):>12.2f}"
            f"{statistics.median(1000 * t.server_cpu_seconds / t.steps for t in timings):>20.2f}"
            f"{f'{100 * busy:.0f}%' if args.forward_ms else '-':>10}"
        )
    print(
        "steps/s: the whole engine loop (scheduler work overlapping the fake forward); "
        "ratio: the AsyncScheduler's loop time over this mode's, within each round "
        "(median, lowest-highest); sched ms: wall time in schedule() and "
        "update_from_output(); CPU: the scheduler thread's; GPU busy: forward time over "
        "loop time"
    )
    if differ:
        print(f"DECISIONS DIFFER from vLLM's AsyncScheduler: {', '.join(differ)}")
    else:
        print(
            "decisions: every mode's scheduler outputs, tokens and stats equal the "
            "AsyncScheduler's, in every round"
        )
    return not differ


# Where a sampled step's time is the KV cache manager's: vLLM's manager and what it
# calls, or kvservice's adapter, link, client and core.
_MANAGER_PATHS = (
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/core/block_pool.py",
    "/kvservice/",
)
_STEP_FUNCTIONS = frozenset({"schedule", "update_from_output"})


def _profile(target: str, server_pid: int | None, steps: int, step_socket: str) -> None:
    from pyinstrument import Profiler  # noqa: PLC0415 (a dev tool: only this option needs it)

    modes = [
        Mode("vllm built-in", Scheduler, None),
        Mode(IN_PROCESS, KVServiceScheduler, None),
        Mode("remote, vLLM hashes", KVServiceScheduler, target, "sync", server_pid, True),
        Mode(
            "socket, vLLM hashes",
            KVServiceScheduler,
            target,
            "sync",
            server_pid,
            True,
            step_socket=step_socket,
        ),
    ]
    shares = {}
    for mode in modes:
        profiler = Profiler(interval=0.0002)
        with profiler:
            _run(mode, "churn", steps, 0, 0.0)
        session = profiler.last_session
        assert session is not None
        step_s, methods = _manager_time(session.root_frame())
        manager_s = sum(methods.values())
        shares[mode.name] = manager_s / step_s
        print(
            f"\n{mode.name}: {1000 * step_s / steps:.2f} ms a step sampled, the manager "
            f"{100 * manager_s / step_s:.0f}% of it"
        )
        for method, seconds in sorted(methods.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {100 * seconds / step_s:5.1f}%  {method}")
        if mode.target is not None:
            print("  of which the link to the server:")
            for part, seconds in _link_time(session.root_frame()).items():
                if part in _COMPILED_LINK_PARTS and CLIENT_COMPILED:
                    print(f"      -   {part}: compiled, unseen (in its caller's share)")
                else:
                    print(f"  {100 * seconds / step_s:5.1f}%  {part}")
    # Again without the client's profiler, which would stretch the server's idle time.
    for remote in modes[2:]:
        with _server_sampled(remote, steps):
            _run(remote, "churn", steps, 0, 0.0)
    _server_natively(modes[-1], steps)
    _client_natively([modes[1], modes[-1]], steps)
    _waiting_cost(modes[1], modes[2:], steps)
    floor = 1 / (1 - shares["vllm built-in"])
    print(
        f"\nan in-process manager costing nothing would make the step {floor:.2f}x the "
        "built-in manager's (vLLM's own scheduler code is the rest); sampled with the "
        "profiler on, so shares, not speeds"
    )


def _waiting_cost(in_process: Mode, remotes: list[Mode], steps: int, rounds: int = 3) -> None:
    """The scheduler thread's CPU a churn step, unsampled: in-process; in-process with
    a wait after each ``schedule()`` as long as the last remote mode's server CPU a
    step, sleeping, then while a stand-in process spends that CPU (as the server does
    while the remote scheduler waits); and each remote mode. The differences tell what
    waiting on another process costs the waiting thread, apart from the link's own
    work."""
    remote_runs = {
        remote.name: [_run(remote, "churn", steps, round_, 0.0) for round_ in range(rounds)]
        for remote in remotes
    }
    server_s = statistics.median(
        t.server_cpu_seconds / t.steps for t in remote_runs[remotes[-1].name]
    )
    runs: dict[str, list[Timing]] = {}
    with closing(StandIn()) as stand_in:
        waits: dict[str, Callable[[], object] | None] = {
            "in-process": None,
            "in-process, sleeping as long": lambda: time.sleep(server_s),
            "in-process, a stand-in busy as long": lambda: stand_in.run(server_s),
        }
        for round_ in range(rounds):
            for name, wait in waits.items():
                runs.setdefault(name, []).append(
                    _run(in_process, "churn", steps, round_, 0.0, wait=wait)
                )
    runs.update(remote_runs)
    cpu_ms = {
        name: statistics.median(1000 * t.cpu_seconds / t.steps for t in timings)
        for name, timings in runs.items()
    }
    print(
        f"\nthe scheduler thread's CPU a churn step, unsampled (median of {rounds} runs); "
        f"the waits after each schedule() last the server's {1000 * server_s:.2f} ms CPU "
        f"a step ({remotes[-1].name}):"
    )
    for name, ms in cpu_ms.items():
        print(f"  {ms:5.2f} ms  {ms - cpu_ms['in-process']:+5.2f}  {name}")
    _phases(runs)


def _phases(runs: dict[str, list[Timing]]) -> None:
    """The same runs' thread CPU by phase: where a remote step's extra CPU is spent,
    timed (the sampled shares above are not speeds, and the native ones of the compiled
    link's parts came out larger than timed calls of those parts)."""
    print(
        "\nthe same, by phase (ms a step, median): schedule() without the flush; the "
        "flush (take_kv_cache_block_copies: the remote step built, sent, waited for and "
        "checked); update_from_output():"
    )
    for name, timings in runs.items():
        flush = statistics.median(1000 * t.flush_cpu_seconds / t.steps for t in timings)
        update = statistics.median(1000 * t.update_cpu_seconds / t.steps for t in timings)
        schedule = statistics.median(
            1000 * (t.cpu_seconds - t.update_cpu_seconds - t.flush_cpu_seconds) / t.steps
            for t in timings
        )
        print(f"  {schedule:5.2f}  {flush:5.2f}  {update:5.2f}  {name}")


@contextmanager
def _server_sampled(mode: Mode, steps: int) -> Iterator[None]:
    """Sample ``mode``'s server (py-spy) while the block runs and print where the
    server's CPU went, by the frame each sample was taken in."""
    assert mode.server_pid is not None
    cpu_before = process_cpu_seconds(mode.server_pid)
    ran = False
    try:
        with sampled(mode.server_pid) as samples:
            ran = True
            yield
    except SamplerUnavailableError as error:
        print(f"\nthe server was not sampled: {error}")
        if not ran:
            yield  # py-spy could not attach: the block runs unsampled
        return
    cpu_ms = _ms_a_step_since(cpu_before, mode.server_pid, steps)
    parts: Counter[str] = Counter()
    for leaf, count in samples.leaves.items():
        parts[_server_part(leaf)] += count
    print(
        f"\n{mode.name}, its server: {cpu_ms:.2f} ms CPU a step while sampled "
        f"({samples.total} samples), by the frame sampled:"
    )
    for part, count in parts.most_common(8):
        share = count / max(1, samples.total)
        print(f"  {100 * share:5.1f}%  {share * cpu_ms:5.2f} ms  {part}")


def _ms_a_step_since(cpu_before: float | None, pid: int, steps: int) -> float:
    """Process ``pid``'s CPU milliseconds a step since it read ``cpu_before`` seconds
    (0 where its CPU time cannot be read)."""
    cpu_after = process_cpu_seconds(pid)
    if cpu_before is None or cpu_after is None:
        return 0.0
    return 1000 * (cpu_after - cpu_before) / steps


def _server_natively(mode: Mode, steps: int) -> None:
    """Sample ``mode``'s server with ``perf`` (native frames: the compiled Step
    runner's own functions) while it runs churn steps, and print its CPU by the Step
    operation each sample was in, then the share spent in Python code that the
    compiled runner called (interpreted: what compiling more would take), by the
    compiled function that called it."""
    assert mode.server_pid is not None
    cpu_before = process_cpu_seconds(mode.server_pid)
    try:
        with native_sampled(mode.server_pid) as samples:
            _run(mode, "churn", steps, 0, 0.0)
    except SamplerUnavailableError as error:
        print(f"\nthe server was not sampled natively: {error}")
        return
    cpu_ms = _ms_a_step_since(cpu_before, mode.server_pid, steps)
    parts: Counter[str] = Counter()
    interpreted: Counter[str] = Counter()
    for stack, count in samples.stacks.items():
        part, runner = _native_part(stack)
        parts[part] += count
        caller = None if runner is None else interpreted_under(stack, runner)
        if caller is not None:
            interpreted[caller] += count
    total = max(1, samples.total)
    print(
        f"\n{mode.name}, its server: {cpu_ms:.2f} ms CPU a step while sampled by perf "
        f"({samples.total} samples), by the Step operation sampled:"
    )
    for part, count in parts.most_common():
        print(f"  {100 * count / total:5.1f}%  {cpu_ms * count / total:5.2f} ms  {part}")
    share = sum(interpreted.values()) / total
    print(
        f"  of the server's CPU, {100 * share:.1f}% ({cpu_ms * share:.2f} ms a step) ran "
        "Python that the compiled runner called, by the compiled caller:"
    )
    for caller, count in interpreted.most_common(6):
        print(f"  {100 * count / total:5.1f}%  {caller}")


def _client_natively(modes: list[Mode], steps: int) -> None:
    """Sample this process natively (py-spy: Python frames with the C and compiled
    ones under them) while each of ``modes`` runs churn steps, and print where the
    scheduler's step went: vLLM's own code, the replica's core, the vLLM adapter and
    each part of the remote link, compiled parts included (the profile above cannot
    see those)."""
    for mode in modes:
        try:
            with natively_sampled(os.getpid()) as samples:
                _run(mode, "churn", steps, 0, 0.0)
        except SamplerUnavailableError as error:
            print(f"\n{mode.name}: this process was not sampled natively: {error}")
            return
        parts: Counter[str] = Counter()
        for stack, count in samples.stacks.items():
            if any(frame.startswith(_STEP_FRAMES) for frame in stack):
                parts[_client_part(stack)] += count
        total = sum(parts.values())
        print(
            f"\n{mode.name}, the scheduler's step sampled natively ({total} samples; "
            "py-spy stops the process to sample it, so shares, not speeds):"
        )
        for part, count in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {100 * count / max(1, total):5.1f}%  {part}")


# The scheduler's step, as py-spy names its frames.
_STEP_FRAMES = tuple(f"Scheduler.{function} (" for function in _STEP_FUNCTIONS)
# The parts of the remote link, by a frame each runs under (compiled functions by
# mypyc's C name, Python ones by py-spy's), in the order a stack is searched.
_CLIENT_LINK_PARTS = (
    ("StepLog___build", "the link: building the Step (StepLog.build, StepBuilder)"),
    ("Session.send (", "the link: serializing and sending it (the socket's send included)"),
    ("_read_through (", "the link: waiting for the answer and parsing it"),
    ("StepLink____compare", "the link: checking every answer (StepLink._compare)"),
    ("StepLink___", "the link: the rest of sending and confirming (StepLink)"),
    ("server_link.py", "the link: recording (ServerLink, StepLog)"),
)
_LINK_MODULES = ("step_log", "step_link", "_wire")


def _client_part(stack: tuple[str, ...]) -> str:
    """What a native sample of the scheduler's step stands for: a part of the remote
    link it runs under, else the innermost kvservice code it is in, else vLLM's."""
    for marker, part in _CLIENT_LINK_PARTS:
        if any(marker in frame for frame in stack):
            return part
    for frame in reversed(stack):
        name = compiled_name(frame.split(" (", 1)[0])
        if name is not None:
            if name.split(".", 1)[0] in _LINK_MODULES:
                return "the link: other compiled code (step_log, step_link, _wire)"
            return "kvservice's core (compiled; the replica when remote)"
        if "kvservice/integrations/vllm/" in frame:
            return "the vLLM adapter (kvservice/integrations/vllm)"
        if "kvservice/" in frame:
            return "kvservice, other"
    return "vLLM's scheduler code (no kvservice frame under it)"


_RUNNER = "StepRunner"
_OPERATION_MODULE = "operations."


def _native_part(stack: Stack) -> tuple[str, int | None]:
    """What a native sample stands for (its outermost public Step operation, the
    runner between operations, or what runs outside the runner) and the index of the
    runner's outermost frame in ``stack`` (None outside it)."""
    names = [compiled_name(function) or "" for function in stack]
    runner = next((i for i in reversed(range(len(names))) if _RUNNER in names[i]), None)
    if runner is None:
        return "outside the Step runner: transport, asyncio, StallWatch", None
    for name in reversed(names[:runner]):
        operation = name.removeprefix(_OPERATION_MODULE)
        if operation != name and not operation.startswith("_"):
            return operation.split("_gen.", 1)[0], runner
    return "the Step runner between operations (decoding, answers)", runner


# The servicer's line that calls the Step runner: with the compiled build (the server
# imports the same build as this process), no Python frame is under it (mypyc's
# functions are not sampled), so its samples are the runner's.
_STEP_CALL = "KVCacheServicer.StepStream ("


def _server_part(leaf: str) -> str:
    """What a server sample's innermost frame stands for."""
    if "kvservice/" not in leaf:
        return "gRPC, asyncio and threads (no kvservice frame): the transport"
    if leaf.startswith(_STEP_CALL) and CORE_COMPILED:
        return "the Step runner (decoding, request table, core; compiled: under StepStream)"
    function, _, where = leaf.partition(" (")
    return f"{function} ({where.rsplit(':', 1)[0]})"


# The remote link's parts, by the method that does each (kvservice/client and the
# vLLM integration's server link), in the order a step runs them.
_LINK_PARTS = {
    ("ServerLink", "_send_tokens"): "recording new requests and tokens (ServerLink._send_tokens)",
    ("StepLog", "allocate"): "recording plain allocations (StepLog.allocate)",
    ("StepLog", "record"): "recording other operations (StepLog.record)",
    ("StepLog", "build"): "building the Step message (StepLog.build)",
    ("Session", "send"): "serializing and handing it to gRPC (Session.send)",
    ("Session", "_read_through"): "waiting for the answer and parsing it (Session._read_through)",
    ("SocketSession", "send"): "serializing and writing it (SocketSession.send)",
    ("SocketSession", "_read_through"): (
        "waiting for the answer and parsing it (SocketSession._read_through)"
    ),
    ("StepLink", "_compare"): "checking every answer (StepLink._compare)",
}

# The parts the client's compiled build runs: no Python frame for the profiler to see.
_COMPILED_LINK_PARTS = {
    part for (cls, _), part in _LINK_PARTS.items() if cls in ("StepLog", "StepLink")
}


def _link_time(root: Any) -> dict[str, float]:
    """Seconds in each of ``_LINK_PARTS`` (the outermost call of each, everything it
    calls included)."""
    seconds = dict.fromkeys(_LINK_PARTS.values(), 0.0)

    def walk(frame: Any) -> None:
        part = _LINK_PARTS.get((frame.class_name, frame.function))
        if part is not None and "/kvservice/" in (frame.file_path or ""):
            seconds[part] += frame.time
            return
        for child in frame.children:
            walk(child)

    walk(root)
    return seconds


def _manager_time(root: Any) -> tuple[float, dict[str, float]]:
    """Seconds in the scheduler's step functions, and the manager's share of them by
    the manager's outermost method (everything it calls included)."""
    methods: dict[str, float] = {}
    step_s = 0.0

    def manager_frames(frame: Any) -> None:
        if any(part in (frame.file_path or "") for part in _MANAGER_PATHS):
            methods[frame.function] = methods.get(frame.function, 0.0) + frame.time
            return
        for child in frame.children:
            manager_frames(child)

    def walk(frame: Any) -> None:
        nonlocal step_s
        if frame.function in _STEP_FUNCTIONS and "sched/" in (frame.file_path or ""):
            step_s += frame.time
            for child in frame.children:
                manager_frames(child)
            return
        for child in frame.children:
            walk(child)

    walk(root)
    return step_s, methods


if __name__ == "__main__":
    raise SystemExit(main())

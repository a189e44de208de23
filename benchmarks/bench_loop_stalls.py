"""How long one hostile call holds the server's event loop: the longest stall while it
runs, and the longest garbage-collector pause.

The server runs in this process, on its loop, with a stall watch ticking every
millisecond and every collection timed (``kvservice.server.loop_watch``); each
scenario's client runs in a child process (this file with ``--client``), so the
server's loop shares its GIL with nobody. The client sets the scenario up, then the
measured call runs alone while the watches record:

  admit        a unary Admit of 16,384 waiting requests (64-token prompts)
  batch        a Step of one 4,096-entry AllocateSlotsBatch (16 blocks per entry)
  session_end  CloseSession of a session owning 16,384 admitted requests
  step         a Step adding 4,096 requests of 256 tokens next to 12,288 others

``--slices off`` runs the same code with pauses never due (the time slice set to
infinity): the figure of a call run whole, as before item 3 of issue 27. ``--gc``
chooses the collector's setup: ``python`` (Python's defaults throughout), ``frozen``
(collect and freeze once the pool is built, as ``kvservice serve`` does, with Python's
full collections: the setup before issue 27), ``tuned`` (frozen, and the server's
default ``--gc-full-collection-interval``: full collections only every 60 s, in the
table's turn, none during the measured call).

``--idle-cost`` instead measures what the server's own stall watch costs: idle
``kvservice serve`` processes, one per ``--loop-stall-interval`` (the default 0.01 s,
0.001 s, and 0: the watch off), each process's CPU over the same seconds, in turns,
printed as CPU milliseconds a second (median over rounds).

Run: ``python -m benchmarks.bench_loop_stalls [--slices on|off] [--gc python|frozen|tuned]
[--scenario NAME ...] [--rounds N] [--idle-cost]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.bench.measure import process_cpu_seconds
from kvservice.bench.server import child_server
from kvservice.protocol import SESSION_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server import turns
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.log import configure_logging
from kvservice.server.loop_watch import GcWatch, StallWatch

SCENARIOS = ("admit", "batch", "session_end", "step")
MANY = 16_384
BATCH = 4096
PROMPT = 64
LONG_PROMPT = 256
TICK_S = 0.001
Metadata = tuple[tuple[str, str], ...]
THRESHOLDS: list[int] = []
MESSAGE_BYTES = 64 * 1024 * 1024

CONFIG = ServerConfig(
    port=0,
    metrics_port=None,
    num_blocks=MANY * PROMPT // 16 + 4096,
    max_message_bytes=MESSAGE_BYTES,
    audit_interval_s=0,
    shutdown_grace_s=0,
)


@dataclass(frozen=True, slots=True)
class Figures:
    call_s: float
    longest_health_s: float
    longest_stall_s: float
    longest_stall_cpu_s: float
    longest_gc_s: float
    num_gc: int
    total_gc_s: float


# -- the client (a child process) ---------------------------------------------------------


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 131 + t) % 50_000 for t in range(n)]


def _add_steps(
    stub: pb_grpc.KVCacheServiceStub, prefix: str, count: int, n: int, md: Metadata
) -> None:
    for start in range(0, count, BATCH):
        ops = [
            pb.StepOperation(
                add_request=pb.AddRequestRequest(
                    request_id=f"{prefix}{i}", prompt_token_ids=_prompt(i, n)
                )
            )
            for i in range(start, min(count, start + BATCH))
        ]
        stub.Step(pb.StepRequest(ops=ops, omit_request_state=True), metadata=md)


def _admit(stub: pb_grpc.KVCacheServiceStub, ids: list[str], md: Metadata = ()) -> pb.AdmitResponse:
    response: pb.AdmitResponse = stub.Admit(
        pb.AdmitRequest(
            request_ids=ids, token_budget=len(ids) * LONG_PROMPT, enable_chunked_prefill=True
        ),
        metadata=md,
    )
    return response


def client(target: str, scenario: str) -> None:
    options = [
        ("grpc.max_receive_message_length", MESSAGE_BYTES),
        ("grpc.max_send_message_length", MESSAGE_BYTES),
    ]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.KVCacheServiceStub(channel)
        measured = _setup(stub, scenario)
        print("ready", flush=True)
        sys.stdin.readline()
        with HealthPoller(target) as health:
            start = time.perf_counter()
            measured()
            elapsed = time.perf_counter() - start
        print(f"done {elapsed:.6f} {health.longest_s:.6f}", flush=True)


class HealthPoller:
    """A thread that asks grpc.health.v1 over and over on a channel of its own while
    the measured call runs: the latency a probe sees (its longest)."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.latencies: list[float] = []

    @property
    def longest_s(self) -> float:
        return max(self.latencies, default=0.0)

    def __enter__(self) -> HealthPoller:
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with grpc.insecure_channel(self._target) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            check(health_pb2.HealthCheckRequest())  # connected before the call starts
            self._ready.set()
            while not self._stop.is_set():
                start = time.perf_counter()
                check(health_pb2.HealthCheckRequest())
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.001)


def _setup(stub: pb_grpc.KVCacheServiceStub, scenario: str) -> Callable[[], object]:
    """Set ``scenario`` up; the measured call."""
    if scenario == "admit":
        _add_steps(stub, "a", MANY, PROMPT, ())
        ids = [f"a{i}" for i in range(MANY)]
        return lambda: _check_admitted(_admit(stub, ids), MANY)
    if scenario == "batch":
        _add_steps(stub, "b", BATCH, LONG_PROMPT, ())
        batch = pb.AllocateSlotsBatch(
            request_ids=[f"b{i}" for i in range(BATCH)], num_new_tokens=[LONG_PROMPT] * BATCH
        )
        step = pb.StepRequest(ops=[pb.StepOperation(allocate_slots_batch=batch)])
        return lambda: stub.Step(step)
    if scenario == "session_end":
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=600)).session_id
        md = ((SESSION_KEY, session),)
        _add_steps(stub, "s", MANY, PROMPT, md)
        _check_admitted(_admit(stub, [f"s{i}" for i in range(MANY)], md), MANY)
        close = pb.CloseSessionRequest(session_id=session, free_requests=True)
        return lambda: _check_freed(stub.CloseSession(close), MANY)
    if scenario == "step":
        _add_steps(stub, "o", MANY - BATCH, PROMPT, ())
        ops = [
            pb.StepOperation(
                add_request=pb.AddRequestRequest(
                    request_id=f"n{i}", prompt_token_ids=_prompt(i, LONG_PROMPT)
                )
            )
            for i in range(BATCH)
        ]
        step = pb.StepRequest(ops=ops)
        return lambda: stub.Step(step)
    raise SystemExit(f"unknown scenario {scenario!r}")


def _check_admitted(response: pb.AdmitResponse, expected: int) -> None:
    if len(response.admitted) != expected:
        raise SystemExit(f"admitted {len(response.admitted)} of {expected}: {response.stop_reason}")


def _check_freed(response: pb.CloseSessionResponse, expected: int) -> None:
    if response.num_requests_freed != expected:
        raise SystemExit(f"freed {response.num_requests_freed} of {expected}")


# -- the server (this process) ------------------------------------------------------------


async def run_scenario(scenario: str, gc_mode: str) -> Figures:
    # "tuned": the server's default, its own full collections (``FullCollections``).
    config = CONFIG
    if gc_mode != "tuned" and hasattr(config, "gc_full_collection_interval_s"):
        config = replace(config, gc_full_collection_interval_s=0.0)  # Python's collections
    server = KVCacheServer(config)
    gc.unfreeze()
    gc.collect()
    gc.set_threshold(*(THRESHOLDS or (700, 10, 10)))
    if gc_mode != "python":
        # What ``kvservice serve`` does once the pool is built.
        gc.collect()
        gc.freeze()
    await server.start()
    stalls = StallWatch(TICK_S)
    collections = GcWatch()
    stalls.start()
    collections.start()
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.bench_loop_stalls",
            "--client",
            server.handle.target,
            "--scenario",
            scenario,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        line = await child.stdout.readline()
        if line.strip() != b"ready":
            raise SystemExit(f"{scenario}: the client said {line!r}; see its stderr")
        await asyncio.sleep(0.05)  # the ticker is running before the call
        stalls.reset()
        collections.reset()
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        line = await child.stdout.readline()
        if not line.startswith(b"done"):
            raise SystemExit(f"{scenario}: the client said {line!r}")
        _, call_s, health_s = line.split()
        figures = Figures(
            float(call_s),
            float(health_s),
            stalls.longest_s,
            stalls.longest_cpu_s,
            collections.longest_s,
            collections.num_collections,
            collections.total_s,
        )
        if await child.wait():
            raise SystemExit(f"{scenario}: the client failed")
        return figures
    finally:
        collections.stop()
        await stalls.stop()
        await server.stop(grace=0)


async def main_async(args: argparse.Namespace) -> None:
    if args.gc_thresholds:
        THRESHOLDS.extend(int(x) for x in args.gc_thresholds.split(","))
    if args.slices == "off":
        turns.SLICE_S = float("inf")
    print(
        f"slices {args.slices} (SLICE_S {turns.SLICE_S * 1000:g} ms), gc {args.gc}, "
        f"{args.rounds} round(s); medians"
    )
    header = ("call ms", "health ms", "stall ms", "stall cpu ms", "gc max ms", "gcs", "gc ms")
    print(f"{'scenario':<12}" + "".join(f"{name:>13}" for name in header))
    for scenario in args.scenario or SCENARIOS:
        rounds = [await run_scenario(scenario, args.gc) for _ in range(args.rounds)]
        median = Figures(
            *(statistics.median(getattr(f, name) for f in rounds) for name in Figures.__slots__)
        )
        median = replace(median, num_gc=int(median.num_gc))
        columns = (
            f"{median.call_s * 1000:.1f}",
            f"{median.longest_health_s * 1000:.1f}",
            f"{median.longest_stall_s * 1000:.1f}",
            f"{median.longest_stall_cpu_s * 1000:.1f}",
            f"{median.longest_gc_s * 1000:.1f}",
            f"{median.num_gc}",
            f"{median.total_gc_s * 1000:.1f}",
        )
        print(f"{scenario:<12}" + "".join(f"{c:>13}" for c in columns), flush=True)


IDLE_INTERVALS_S = (0.01, 0.001, 0.0)
IDLE_SECONDS = 2.0


def idle_cost(rounds: int) -> None:
    """Idle servers' CPU a second, one server per stall-watch interval, measured over
    the same windows in turns."""
    with contextlib.ExitStack() as stack:
        pids = {}
        for interval in IDLE_INTERVALS_S:
            server = stack.enter_context(child_server([f"--loop-stall-interval={interval}"]))
            assert server.pid is not None  # started here
            pids[interval] = server.pid
        time.sleep(IDLE_SECONDS)  # past start-up's own work
        per_second: dict[float, list[float]] = {interval: [] for interval in pids}
        for _ in range(rounds):
            before = {interval: process_cpu_seconds(pid) for interval, pid in pids.items()}
            time.sleep(IDLE_SECONDS)
            for interval, pid in pids.items():
                start, end = before[interval], process_cpu_seconds(pid)
                if start is not None and end is not None:
                    per_second[interval].append(1000 * (end - start) / IDLE_SECONDS)
    print(f"idle servers, {rounds} windows of {IDLE_SECONDS:g} s (median, lowest-highest):")
    for interval, figures in per_second.items():
        if not figures:
            print(f"  --loop-stall-interval={interval:g}: CPU not readable here")
            continue
        print(
            f"  --loop-stall-interval={interval:g}: {statistics.median(figures):.1f} ms CPU "
            f"a second ({min(figures):.1f}-{max(figures):.1f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", choices=("on", "off"), default="on")
    parser.add_argument("--gc", choices=("python", "frozen", "tuned"), default="tuned")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--gc-thresholds", help="experiments: gc.set_threshold(g0,g1,g2)")
    parser.add_argument("--idle-cost", action="store_true", help="the stall watch's CPU")
    parser.add_argument("--client", metavar="TARGET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client, args.scenario[0])
        return
    if args.idle_cost:
        idle_cost(max(args.rounds, 5))
        return
    configure_logging("warning")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()

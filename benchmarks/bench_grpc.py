"""The gRPC service on loopback: unary latency, and ops/s unary vs batched vs stream,
against the same workload run in-process, side by side in one run.

Run: ``python -m benchmarks.bench_grpc`` (``make bench-grpc``). The server runs as a
subprocess (``kvservice serve`` on a free port), so client and server have a core each
on a 2-core machine. ``--profile`` instead profiles, in-process, the server's side of
a Step (decode, run the operations, encode) with cProfile.

The floor: a raw grpc.aio echo server (one generic unary method that returns its
request bytes; no protobuf, no interceptor, no allocator) runs as a second subprocess
on the same event loop, and its latency is measured in the same rounds as the
service's, so the service's own overhead reads as the difference.

The workload is a seeded scheduler-like sequence, built once as protobuf operations:
waves of requests are added, looked up, admitted, decoded for a few steps (append one
token, allocate one slot) and finished. Every way of sending it runs the identical
operation sequence on a fresh set of request ids.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import grpc

from kvservice.server import converters
from kvservice.server.allocator import Allocator
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.gen import kv_cache_service_pb2 as pb
from kvservice.server.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.server.loop import EVENT_LOOPS, default_event_loop, loop_factory
from kvservice.server.metrics import KVCacheMetrics
from kvservice.server.step import StepRunner

NUM_BLOCKS = 8192
MAX_MODEL_LEN = 4096
PROMPT_LEN = 64
DECODE_STEPS = 4
WAVE = 32


@dataclass(frozen=True, slots=True)
class Workload:
    ops: list[pb.StepOperation]

    def chunks(self, size: int) -> list[pb.StepRequest]:
        return [
            pb.StepRequest(step_id=i, ops=self.ops[start : start + size])
            for i, start in enumerate(range(0, len(self.ops), size))
        ]


def build_workload(num_requests: int, tag: str) -> Workload:
    """Waves of WAVE requests: add, lookup, admit, DECODE_STEPS decodes, finish."""
    ops: list[pb.StepOperation] = []
    for wave_start in range(0, num_requests, WAVE):
        ids = [f"{tag}-{i}" for i in range(wave_start, min(wave_start + WAVE, num_requests))]
        for n, rid in enumerate(ids):
            prompt = [(wave_start + n) * 7 + t for t in range(PROMPT_LEN)]
            ops.append(
                pb.StepOperation(
                    add_request=pb.AddRequestRequest(request_id=rid, prompt_token_ids=prompt)
                )
            )
        for rid in ids:
            ops.append(
                pb.StepOperation(get_computed_blocks=pb.GetComputedBlocksRequest(request_id=rid))
            )
        for rid in ids:
            ops.append(
                pb.StepOperation(
                    allocate_slots=pb.AllocateSlotsRequest(
                        request_id=rid, num_new_tokens=PROMPT_LEN
                    )
                )
            )
        for step in range(DECODE_STEPS):
            for rid in ids:
                ops.append(
                    pb.StepOperation(
                        append_tokens=pb.AppendTokensRequest(request_id=rid, token_ids=[step])
                    )
                )
                ops.append(
                    pb.StepOperation(
                        allocate_slots=pb.AllocateSlotsRequest(request_id=rid, num_new_tokens=1)
                    )
                )
        for rid in ids:
            ops.append(
                pb.StepOperation(
                    free_request=pb.FreeRequestRequest(request_id=rid, mode=pb.FREE_MODE_FINISH)
                )
            )
    return Workload(ops)


RPC_OF = {
    "add_request": "AddRequest",
    "append_tokens": "AppendTokens",
    "get_computed_blocks": "GetComputedBlocks",
    "allocate_slots": "AllocateSlots",
    "free_request": "FreeRequest",
}


def config() -> ServerConfig:
    return ServerConfig(
        port=0, metrics_port=None, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN
    )


# -- in-process ---------------------------------------------------------------------


def run_in_process(workload: Workload) -> float:
    """ops/s of the workload on an Allocator in this process (no protobuf, no RPC)."""
    allocator = Allocator(build_manager(config()))
    calls = _domain_calls(allocator, workload)
    start = time.perf_counter()
    for call in calls:
        call()
    return len(calls) / (time.perf_counter() - start)


def run_step_in_process(workload: Workload, size: int) -> float:
    """ops/s of the server's side of ``Step`` in this process, metrics included:
    parse each request, run it, serialize the answer (no transport)."""
    manager = build_manager(config())
    runner = StepRunner(Allocator(manager, KVCacheMetrics(manager, "bench", "0")), 4096)
    steps = [s.SerializeToString() for s in workload.chunks(size)]
    start = time.perf_counter()
    for raw in steps:
        response = pb.StepResponse()
        runner.run(pb.StepRequest.FromString(raw), response)
        response.SerializeToString()
    return len(workload.ops) / (time.perf_counter() - start)


def _domain_calls(allocator: Allocator, workload: Workload) -> list[Callable[[], object]]:
    """The workload as the allocator calls an in-process scheduler would make."""
    calls: list[Callable[[], object]] = []
    for op in workload.ops:
        kind = op.WhichOneof("op")
        if kind == "add_request":
            new = converters.new_request_from_pb(op.add_request)
            calls.append(partial(allocator.add_request, new))
        elif kind == "get_computed_blocks":
            calls.append(partial(allocator.get_computed_blocks, op.get_computed_blocks.request_id))
        elif kind == "allocate_slots":
            args = converters.allocate_args_from_pb(op.allocate_slots)
            calls.append(partial(allocator.allocate_slots, op.allocate_slots.request_id, args))
        elif kind == "append_tokens":
            msg = op.append_tokens
            calls.append(partial(allocator.append_tokens, msg.request_id, list(msg.token_ids)))
        else:
            mode = converters.free_mode_from_pb(op.free_request.mode)
            calls.append(partial(allocator.free, op.free_request.request_id, mode))
    return calls


# -- the server -----------------------------------------------------------------------


@contextmanager
def server_process(event_loop: str) -> Iterator[str]:
    """``kvservice serve`` on a free port; yields its target."""
    cfg = config()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvservice.cli",
            "serve",
            "--port=0",
            "--metrics-port=0",
            f"--num-blocks={cfg.num_blocks}",
            f"--max-model-len={cfg.max_model_len}",
            "--log-level=info",
            "--shutdown-grace=0",
            f"--event-loop={event_loop}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        for line in process.stdout:
            record = json.loads(line)
            if record.get("event") == "serving":
                yield f"127.0.0.1:{record['port']}"
                break
        else:
            raise RuntimeError("the server exited before serving")
    finally:
        process.terminate()
        process.wait(30)


ECHO_METHOD = "/bench.Echo/Echo"


def echo_server(event_loop: str) -> None:
    """The floor: a grpc.aio server whose one method returns the request's bytes.
    Prints its port, then serves until terminated."""

    async def echo(request: bytes, context: object) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        runner.run(main())


@contextmanager
def echo_process(event_loop: str) -> Iterator[str]:
    """``echo_server`` in a subprocess; yields its target."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_grpc", f"--echo-server={event_loop}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        yield f"127.0.0.1:{int(process.stdout.readline())}"
    finally:
        process.terminate()
        process.wait(30)


# -- remote measurements --------------------------------------------------------------


@dataclass(slots=True)
class Latencies:
    """Blocking ping-pong samples, in seconds, per kind of call."""

    echo: list[float]
    allocate: list[float]
    usage: list[float]


def unary_latency(
    stub: pb_grpc.KVCacheServiceStub, echo: Callable[[bytes], bytes], n: int
) -> Latencies:
    """Blocking ping-pong in alternating rounds, so the floor and the service see the
    same machine: the echo of an AllocateSlots request's bytes; AllocateSlots
    (decode: append untimed, allocate timed); GetUsage (the service with almost no
    allocator work)."""
    stub.AddRequest(pb.AddRequestRequest(request_id="lat", prompt_token_ids=list(range(16))))
    stub.AllocateSlots(pb.AllocateSlotsRequest(request_id="lat", num_new_tokens=16))
    alloc = pb.AllocateSlotsRequest(request_id="lat", num_new_tokens=1)
    append = pb.AppendTokensRequest(request_id="lat", token_ids=[1])
    usage = pb.GetUsageRequest()
    payload = alloc.SerializeToString()
    out = Latencies([], [], [])
    round_size = 100
    for _ in range(0, n, round_size):
        for _ in range(round_size):
            start = time.perf_counter()
            echo(payload)
            out.echo.append(time.perf_counter() - start)
        for _ in range(round_size):
            stub.AppendTokens(append)
            start = time.perf_counter()
            stub.AllocateSlots(alloc)
            out.allocate.append(time.perf_counter() - start)
        for _ in range(round_size):
            start = time.perf_counter()
            stub.GetUsage(usage)
            out.usage.append(time.perf_counter() - start)
    stub.FreeRequest(pb.FreeRequestRequest(request_id="lat", mode=pb.FREE_MODE_FINISH))
    return out


def unary_ops(stub: pb_grpc.KVCacheServiceStub, workload: Workload) -> float:
    calls = [
        (getattr(stub, RPC_OF[k]), getattr(o, k)) for o in workload.ops if (k := o.WhichOneof("op"))
    ]
    start = time.perf_counter()
    for method, message in calls:
        method(message)
    return len(calls) / (time.perf_counter() - start)


def step_ops(stub: pb_grpc.KVCacheServiceStub, workload: Workload, size: int) -> float:
    steps = workload.chunks(size)
    start = time.perf_counter()
    for step in steps:
        response = stub.Step(step)
        assert not any(r.WhichOneof("result") == "error" for r in response.results)
    return len(workload.ops) / (time.perf_counter() - start)


async def stream_ops(target: str, workload: Workload, size: int) -> float:
    """Ping-pong over one StepStream (grpc.aio), ``size`` operations per message."""
    messages = [pb.StepStreamRequest(step=s) for s in workload.chunks(size)]
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.KVCacheServiceStub(channel).StepStream()
        start = time.perf_counter()
        for message in messages:
            await call.write(message)
            await call.read()
        elapsed = time.perf_counter() - start
        await call.done_writing()
    return len(workload.ops) / elapsed


# -- reporting ------------------------------------------------------------------------


def pct(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(num_requests: int, latency_samples: int, event_loop: str) -> None:
    tags = iter(f"w{i}" for i in range(100))
    in_process = run_in_process(build_workload(num_requests, next(tags)))
    num_ops = len(build_workload(num_requests, "x").ops)
    print(
        f"workload: {num_requests} requests, {num_ops} operations "
        f"(prompt {PROMPT_LEN}, {DECODE_STEPS} decode steps, waves of {WAVE}); "
        f"pool {NUM_BLOCKS} blocks; server event loop {event_loop}"
    )
    with (
        server_process(event_loop) as target,
        grpc.insecure_channel(target) as channel,
        echo_process(event_loop) as echo_target,
        grpc.insecure_channel(echo_target) as echo_channel,
    ):
        stub = pb_grpc.KVCacheServiceStub(channel)
        stub.GetUsage(pb.GetUsageRequest(), wait_for_ready=True)
        echo = echo_channel.unary_unary(ECHO_METHOD)
        echo(b"", wait_for_ready=True)
        unary_latency(stub, echo, 200)  # warm-up
        lat = unary_latency(stub, echo, latency_samples)
        rows = [("in-process (Allocator calls)", in_process)]
        rows.append(
            (
                "in-process Step path, 256 ops",
                run_step_in_process(build_workload(num_requests, next(tags)), 256),
            )
        )
        rows.append(
            ("unary, 1 op per call", unary_ops(stub, build_workload(num_requests, next(tags))))
        )
        for size in (64, 256):
            rows.append(
                (
                    f"Step, {size} ops per call",
                    step_ops(stub, build_workload(num_requests, next(tags)), size),
                )
            )
        for size in (1, 64, 256):
            ops_s = asyncio.run(stream_ops(target, build_workload(num_requests, next(tags)), size))
            rows.append((f"StepStream, {size} ops per message", ops_s))
        in_process = (in_process + run_in_process(build_workload(num_requests, next(tags)))) / 2
        rows[0] = (rows[0][0], in_process)
    floor = pct(lat.echo, 0.5)
    print(f"\nunary latency (blocking stub, {len(lat.allocate)} calls each, interleaved):")
    for name, samples in (
        ("raw grpc echo (floor)", lat.echo),
        ("AllocateSlots", lat.allocate),
        ("GetUsage", lat.usage),
    ):
        over = (
            ""
            if samples is lat.echo
            else f", p50 over the floor {(pct(samples, 0.5) - floor) * 1e6:+.0f} us"
        )
        print(
            f"  {name:<22} p50 {pct(samples, 0.5) * 1e6:.0f} us, "
            f"p99 {pct(samples, 0.99) * 1e6:.0f} us, "
            f"mean {statistics.fmean(samples) * 1e6:.0f} us{over}"
        )
    print(f"\n{'way':<34}{'ops/s':>12}{'vs in-process':>16}")
    for name, ops_s in rows:
        print(f"{name:<34}{ops_s:>12,.0f}{ops_s / in_process:>15.2f}x")


def profile(num_requests: int) -> None:
    """cProfile of the server's side of Step: parse, run the operations, serialize."""
    steps = [s.SerializeToString() for s in build_workload(num_requests, "p").chunks(256)]
    manager = build_manager(config())
    runner = StepRunner(Allocator(manager, KVCacheMetrics(manager, "bench", "0")), max_ops=4096)
    profiler = cProfile.Profile()
    profiler.enable()
    for raw in steps:
        response = pb.StepResponse()
        runner.run(pb.StepRequest.FromString(raw), response)
        response.SerializeToString()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=640, help="requests per workload")
    parser.add_argument("--latency-samples", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="profile Step in-process")
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=default_event_loop(),
        help="the servers' event loop (default: uvloop when installed)",
    )
    parser.add_argument("--echo-server", choices=EVENT_LOOPS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        echo_server(args.echo_server)
    elif args.profile:
        profile(args.requests)
    else:
        run(args.requests, args.latency_samples, args.event_loop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

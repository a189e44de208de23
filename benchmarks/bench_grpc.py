"""The gRPC service on loopback: unary latency, and ops/s unary vs batched vs stream,
against the same workload run in-process, measured side by side in one run.

Run: ``python -m benchmarks.bench_grpc`` (``make bench-grpc``). The server runs as a
subprocess (``kvservice serve`` on a free port, started by ``kvservice.bench.server``
as ``kvservice bench`` starts it), so client and server have a core each on a 2-core
machine; CPU times and ratios come from ``kvservice.bench.measure``. ``--profile``
instead profiles, in-process, the server's side of a Step (decode, run the
operations, encode) with cProfile.

The floors: a raw grpc.aio echo server (one generic unary method that returns its
request bytes; no protobuf, no interceptor, no request table) runs as a second subprocess
on the same event loop, called with the blocking client (what the latency rows use) and
with the grpc.aio client; the same subprocess echoes bytes on a plain TCP socket, which
is what Python and the loopback cost without gRPC. All are measured in the same rounds
as the service's calls, so the service's own overhead reads as the difference. The
server also serves its step socket (``--step-socket``: StepStream framed on a Unix
socket, through the same interceptors, sessions and metrics, without gRPC):
"StepStream 256 StepBuilder+omit, step socket" sends the 1-in-flight way's steps
there, so what gRPC costs a step reads as the difference between the two.

The workload is a seeded scheduler-like sequence, built once as protobuf operations:
waves of requests are added, looked up, admitted, decoded for a few steps and
finished. A decode step is what a scheduler sends: the sampled token of every running
request (append one token), then every request's allocation (one slot). The
"columnar" ways send the same operations with each run of one-token appends and of
plain allocations as one AppendTokensBatch / AllocateSlotsBatch (what ``StepBuilder``
does by itself; "no coalescing" ways turn that off), so the per-operation message
encoding is the only difference. The "StepStream 256 StepBuilder+omit" ways build
each step with ``StepBuilder`` and send it on the blocking ``Session``: with one in
flight they wait for each answer (ping-pong); with two, each step goes as soon as it is
built and the oldest answer is read once two are out, so the client's building and
decoding overlap the server's work (a stream runs steps in order, so later steps may
depend on earlier ones). Every way of sending it runs the identical
operation sequence on a fresh set of request ids, and the ways run interleaved, round
after round (each round starting at another way); each ratio is the median over rounds
of (way / in-process in that round). Beside ops/s, each way reports the CPU time per
operation of this process and the server together, read from the OS: other processes on
a shared machine stretch the wall time but hardly the CPU time, so "CPU vs Table" is the
steadier estimate of the ratio on an idle machine with a core per process.

The in-process baseline is the same operations on the server's ``RequestTable`` in
this process (the core ``KVCacheManager`` behind the request table and its argument
checks): the work the server does per operation minus protobuf, transport and metrics
(arguments decoded before timing, answers kept as the Python objects it returns). The
scheduler's ``InProcessBackend`` (the same table behind the scheduler's ``Backend``
protocol) is printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc

from kvservice.bench.measure import Meter, Sample, median_ratio, rotated
from kvservice.bench.server import child_server
from kvservice.client import KVClient, PendingStep
from kvservice.client.step import OpHandle, StepBuilder
from kvservice.client.types import FreeMode
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.scheduler.backend import InProcessBackend
from kvservice.server import converters
from kvservice.server.caller import ANONYMOUS
from kvservice.server.config import ServerConfig, build_manager
from kvservice.server.event_loop import EVENT_LOOPS, default_event_loop, loop_factory
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

    def chunks(self, size: int, columnar: bool = False, omit: bool = False) -> list[pb.StepRequest]:
        """Steps of ``size`` operations; ``columnar``: each step's runs of one-token
        appends and plain allocations as columnar operations; ``omit``: with
        omit_request_state, as the scheduler's batching backends send them."""
        encode = columnar_ops if columnar else list
        return [
            pb.StepRequest(
                step_id=i, ops=encode(self.ops[start : start + size]), omit_request_state=omit
            )
            for i, start in enumerate(range(0, len(self.ops), size))
        ]


def columnar_ops(ops: Sequence[pb.StepOperation]) -> list[pb.StepOperation]:
    """``ops`` with every run of one-token appends (of plain allocations) as one
    AppendTokensBatch (AllocateSlotsBatch), built by hand on the raw messages."""
    out: list[pb.StepOperation] = []
    open_kind: str | None = None
    for op in ops:
        kind = op.WhichOneof("op")
        if kind == "append_tokens" and len(op.append_tokens.token_ids) == 1:
            if open_kind != kind:
                out.append(pb.StepOperation())
            appends = out[-1].append_tokens_batch
            appends.request_ids.append(op.append_tokens.request_id)
            appends.token_ids.append(op.append_tokens.token_ids[0])
        elif kind == "allocate_slots" and _is_plain(op.allocate_slots):
            if open_kind != kind:
                out.append(pb.StepOperation())
            allocations = out[-1].allocate_slots_batch
            allocations.request_ids.append(op.allocate_slots.request_id)
            allocations.num_new_tokens.append(op.allocate_slots.num_new_tokens)
        else:
            out.append(op)
            kind = None
        open_kind = kind
    return out


def _is_plain(msg: pb.AllocateSlotsRequest) -> bool:
    """Only request_id and num_new_tokens set: what AllocateSlotsBatch carries."""
    return {f.name for f, _ in msg.ListFields()} <= {"request_id", "num_new_tokens"}


def build_workload(num_requests: int, tag: str, decode_steps: int = DECODE_STEPS) -> Workload:
    """Waves of WAVE requests: add, lookup, admit, ``decode_steps`` decodes, finish."""
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
        for step in range(decode_steps):
            # As a scheduler sends a step: the tokens sampled last step, then this
            # step's allocations.
            for rid in ids:
                ops.append(
                    pb.StepOperation(
                        append_tokens=pb.AppendTokensRequest(request_id=rid, token_ids=[step])
                    )
                )
            for rid in ids:
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


def run_in_process(meter: Meter, workload: Workload) -> Sample:
    """The workload on a RequestTable in this process (no protobuf, no RPC)."""
    table = RequestTable(build_manager(config()))
    calls = _domain_calls(table, workload)
    meter.start()
    for call in calls:
        call()
    return meter.stop(len(calls))


def run_backend(meter: Meter, workload: Workload) -> Sample:
    """The workload on the scheduler's ``InProcessBackend``."""
    backend = InProcessBackend(build_manager(config()))
    calls = _backend_calls(backend, workload)
    meter.start()
    for call in calls:
        call()
    return meter.stop(len(calls))


def run_step_in_process(
    meter: Meter, workload: Workload, size: int, columnar: bool = False, omit: bool = False
) -> Sample:
    """The server's side of ``Step`` in this process, metrics included: parse each
    request, run it, serialize the answer (no transport)."""
    manager = build_manager(config())
    runner = StepRunner(RequestTable(manager, KVCacheMetrics(manager, "bench", "0")), 4096)
    steps = [s.SerializeToString() for s in workload.chunks(size, columnar, omit)]
    meter.start()
    for raw in steps:
        response = pb.StepResponse()
        runner.run_whole(pb.StepRequest.FromString(raw), response, ANONYMOUS)
        response.SerializeToString()
    return meter.stop(len(workload.ops))


def _domain_calls(table: RequestTable, workload: Workload) -> list[Callable[[], object]]:
    """The workload as the table calls an in-process scheduler would make."""
    calls: list[Callable[[], object]] = []
    for op in workload.ops:
        kind = op.WhichOneof("op")
        if kind == "add_request":
            new = converters.new_request_from_pb(op.add_request)
            calls.append(partial(table.add_request, new, DEFAULT_TENANT))
        elif kind == "get_computed_blocks":
            calls.append(
                partial(
                    table.get_computed_blocks, op.get_computed_blocks.request_id, DEFAULT_TENANT
                )
            )
        elif kind == "allocate_slots":
            args = converters.allocate_args_from_pb(op.allocate_slots)
            calls.append(
                partial(table.allocate_slots, op.allocate_slots.request_id, args, DEFAULT_TENANT)
            )
        elif kind == "append_tokens":
            msg = op.append_tokens
            calls.append(
                partial(table.append_tokens, msg.request_id, list(msg.token_ids), DEFAULT_TENANT)
            )
        else:
            mode = converters.free_mode_from_pb(op.free_request.mode)
            calls.append(partial(table.free, op.free_request.request_id, mode, DEFAULT_TENANT))
    return calls


def _backend_calls(backend: InProcessBackend, workload: Workload) -> list[Callable[[], object]]:
    calls: list[Callable[[], object]] = []
    for op in workload.ops:
        kind = op.WhichOneof("op")
        if kind == "add_request":
            msg = op.add_request
            calls.append(partial(backend.add_request, msg.request_id, list(msg.prompt_token_ids)))
        elif kind == "get_computed_blocks":
            calls.append(partial(backend.get_computed_blocks, op.get_computed_blocks.request_id))
        elif kind == "allocate_slots":
            alloc = op.allocate_slots
            calls.append(partial(backend.allocate_slots, alloc.request_id, alloc.num_new_tokens))
        elif kind == "append_tokens":
            append = op.append_tokens
            calls.append(partial(backend.append_tokens, append.request_id, list(append.token_ids)))
        else:
            calls.append(partial(backend.free, op.free_request.request_id))
    return calls


# -- the server -----------------------------------------------------------------------


ECHO_METHOD = "/bench.Echo/Echo"


def echo_server(event_loop: str) -> None:
    """The floors: a grpc.aio server whose one method returns the request's bytes and
    a TCP server that writes back what it reads, on one loop. Prints the two ports,
    then serves until terminated."""

    async def echo(request: bytes, context: object) -> bytes:
        return request

    async def echo_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tcp = await asyncio.start_server(echo_tcp, "127.0.0.1", 0)
        print(port, tcp.sockets[0].getsockname()[1], flush=True)
        await server.wait_for_termination()

    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        runner.run(main())


@dataclass(frozen=True, slots=True)
class EchoProcess:
    """The ``echo_server`` subprocess: its gRPC target and its TCP echo port."""

    target: str
    tcp_port: int


@contextmanager
def echo_process(event_loop: str) -> Iterator[EchoProcess]:
    """``echo_server`` in a subprocess."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_grpc", f"--echo-server={event_loop}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        grpc_port, tcp_port = process.stdout.readline().split()
        yield EchoProcess(f"127.0.0.1:{grpc_port}", int(tcp_port))
    finally:
        process.terminate()
        process.wait(30)


# -- remote measurements --------------------------------------------------------------

LATENCY_ROWS = (
    "plain TCP echo (floor)",
    "grpc echo, aio client",
    "grpc echo (floor)",
    "AllocateSlots",
    "GetUsage",
)


@dataclass(slots=True)
class Floors:
    """The echo servers: the blocking gRPC echo call, a timer of ``n`` aio echo calls,
    and a connected TCP socket."""

    grpc_echo: Callable[[bytes], bytes]
    aio_echo: Callable[[bytes, int], list[float]]
    tcp: socket.socket


def _time_tcp(sock: socket.socket, payload: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        sock.sendall(payload)
        received = 0
        while received < len(payload):
            received += len(sock.recv(65536))
        out.append(time.perf_counter() - start)
    return out


def _time_calls(call: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def unary_latency(
    stub: pb_grpc.KVCacheServiceStub, floors: Floors, n: int
) -> dict[str, list[float]]:
    """Blocking ping-pong in alternating rounds of 100, so the floors and the service
    see the same machine: the echoes of an AllocateSlots request's bytes; AllocateSlots
    (decode: append untimed, allocate timed); GetUsage (almost no request table work)."""
    stub.AddRequest(pb.AddRequestRequest(request_id="lat", prompt_token_ids=list(range(16))))
    stub.AllocateSlots(pb.AllocateSlotsRequest(request_id="lat", num_new_tokens=16))
    alloc = pb.AllocateSlotsRequest(request_id="lat", num_new_tokens=1)
    append = pb.AppendTokensRequest(request_id="lat", token_ids=[1])
    usage = pb.GetUsageRequest()
    payload = alloc.SerializeToString()
    out: dict[str, list[float]] = {name: [] for name in LATENCY_ROWS}
    round_size = 100
    for _ in range(0, n, round_size):
        out["plain TCP echo (floor)"] += _time_tcp(floors.tcp, payload, round_size)
        out["grpc echo, aio client"] += floors.aio_echo(payload, round_size)
        out["grpc echo (floor)"] += _time_calls(partial(floors.grpc_echo, payload), round_size)
        for _ in range(round_size):
            stub.AppendTokens(append)
            start = time.perf_counter()
            stub.AllocateSlots(alloc)
            out["AllocateSlots"].append(time.perf_counter() - start)
        out["GetUsage"] += _time_calls(partial(stub.GetUsage, usage), round_size)
    stub.FreeRequest(pb.FreeRequestRequest(request_id="lat", mode=pb.FREE_MODE_FINISH))
    return out


def unary_ops(meter: Meter, stub: pb_grpc.KVCacheServiceStub, workload: Workload) -> Sample:
    calls = [
        (getattr(stub, RPC_OF[k]), getattr(o, k)) for o in workload.ops if (k := o.WhichOneof("op"))
    ]
    meter.start()
    for method, message in calls:
        method(message)
    return meter.stop(len(calls))


def step_ops(
    meter: Meter,
    stub: pb_grpc.KVCacheServiceStub,
    workload: Workload,
    size: int,
    columnar: bool = False,
) -> Sample:
    """Prebuilt ``StepRequest`` messages on the raw stub: the transport and the
    server, no client-side encoding or decoding."""
    steps = workload.chunks(size, columnar)
    meter.start()
    for step in steps:
        response = stub.Step(step)
        assert not any(_failed(r) for r in response.results)
    return meter.stop(len(workload.ops))


def _failed(result: pb.StepResult) -> bool:
    kind = result.WhichOneof("result")
    if kind == "error":
        return True
    return kind in ("append_tokens_batch", "allocate_slots_batch") and bool(
        getattr(result, kind).errors
    )


def _builder_adders(workload: Workload) -> list[Callable[[StepBuilder], OpHandle[Any]]]:
    """The workload as ``StepBuilder`` calls (plain Python values, no protobuf)."""
    adders: list[Callable[[StepBuilder], OpHandle[Any]]] = []
    for op in workload.ops:
        kind = op.WhichOneof("op")
        if kind == "add_request":
            msg = op.add_request
            rid, prompt = msg.request_id, list(msg.prompt_token_ids)
            adders.append(partial(StepBuilder.add_request, request_id=rid, prompt_token_ids=prompt))
        elif kind == "get_computed_blocks":
            rid = op.get_computed_blocks.request_id
            adders.append(partial(StepBuilder.get_computed_blocks, request_id=rid))
        elif kind == "allocate_slots":
            alloc = op.allocate_slots
            adders.append(
                partial(
                    StepBuilder.allocate_slots,
                    request_id=alloc.request_id,
                    num_new_tokens=alloc.num_new_tokens,
                )
            )
        elif kind == "append_tokens":
            append = op.append_tokens
            tokens = list(append.token_ids)
            adders.append(
                partial(StepBuilder.append_tokens, request_id=append.request_id, token_ids=tokens)
            )
        else:
            rid = op.free_request.request_id
            adders.append(partial(StepBuilder.free, request_id=rid, mode=FreeMode.FINISH))
    return adders


def client_step_ops(
    meter: Meter,
    client: KVClient,
    workload: Workload,
    size: int,
    omit_state: bool = False,
    coalesce: bool = True,
) -> Sample:
    """What a scheduler pays: build each step with ``StepBuilder``, send it with
    ``KVClient.step``, and read every operation's result back as Python values
    (``omit_state``: without the request states, as ``StepBackend``; ``coalesce``
    off: one message operation per operation, as before columnar operations)."""
    adders = _builder_adders(workload)
    meter.start()
    for first in range(0, len(adders), size):
        builder = StepBuilder(omit_request_state=omit_state, coalesce=coalesce)
        handles = [add(builder) for add in adders[first : first + size]]
        results = client.step(builder)
        for handle in handles:
            results[handle]
    return meter.stop(len(adders))


def client_stream_ops(
    meter: Meter,
    client: KVClient,
    workload: Workload,
    size: int,
    in_flight: int,
    step_socket: str = "",
) -> Sample:
    """``client_step_ops`` (coalescing, omit_state) over one blocking ``Session``
    with up to ``in_flight`` steps sent and unread: ``Session.send`` each step as soon
    as it is built, and read the oldest once that many are out, so the client builds
    and decodes while the server runs earlier steps (1: ping-pong). Steps depend on
    earlier ones (add, then allocate); the stream runs them in order. ``step_socket``:
    the stream goes on the server's step socket at that path instead of gRPC."""
    adders = _builder_adders(workload)
    opened = client.socket_session(step_socket) if step_socket else client.session()
    with opened as session:
        meter.start()
        out: collections.deque[tuple[PendingStep, list[OpHandle[Any]]]] = collections.deque()
        for first in range(0, len(adders), size):
            builder = StepBuilder(omit_request_state=True)
            handles = [add(builder) for add in adders[first : first + size]]
            out.append((session.send(builder), handles))
            if len(out) >= in_flight:
                _read_all(*out.popleft())
        while out:
            _read_all(*out.popleft())
        sample = meter.stop(len(adders))
    return sample


def _read_all(pending: PendingStep, handles: list[OpHandle[Any]]) -> None:
    results = pending.result()
    for handle in handles:
        results[handle]


def _run_stream(
    meter: Meter, runner: asyncio.Runner, target: str, workload: Workload, size: int
) -> Sample:
    return runner.run(stream_ops(meter, target, workload, size))


async def stream_ops(meter: Meter, target: str, workload: Workload, size: int) -> Sample:
    """Ping-pong over one StepStream (grpc.aio), ``size`` operations per message."""
    messages = [pb.StepStreamRequest(step=s) for s in workload.chunks(size)]
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.KVCacheServiceStub(channel).StepStream()
        meter.start()
        for message in messages:
            await call.write(message)
            await call.read()
        sample = meter.stop(len(workload.ops))
        await call.done_writing()
    return sample


# -- reporting ------------------------------------------------------------------------


def pct(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True, slots=True)
class Way:
    """One way of running the workload: a name, the requests it runs per round (the
    slow ways run a smaller workload of the same shape) and the measurement."""

    name: str
    num_requests: int
    measure: Callable[[Workload], Sample]


@dataclass(slots=True)
class Throughputs:
    """The samples of every way, per round."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def add(self, name: str, sample: Sample) -> None:
        self.samples.setdefault(name, []).append(sample)

    def ops_s(self, name: str) -> float:
        return statistics.median(s.ops_s for s in self.samples[name])

    def cpu_us_per_op(self, name: str) -> float:
        return statistics.median(s.cpu_us_per_op for s in self.samples[name])

    def ratio(self, name: str, baseline: str) -> float:
        """Median over rounds of (ops/s of the way / of the baseline in that round)."""
        return median_ratio(
            [s.ops_s for s in self.samples[name]], [s.ops_s for s in self.samples[baseline]]
        )

    def cpu_ratio(self, name: str, baseline: str) -> float | None:
        """Median over rounds of (the baseline's CPU per op / the way's, client and
        server together): the throughput ratio on an otherwise idle machine with one
        core per process. None when no round measured CPU on both sides: the kernel
        updates a running thread's CPU time at ticks and switches, so a tiny run (the
        smoke size) can read none."""
        pairs = zip(self.samples[name], self.samples[baseline], strict=True)
        ratios = [
            b.cpu_us_per_op / a.cpu_us_per_op
            for a, b in pairs
            if a.cpu_us_per_op > 0 and b.cpu_us_per_op > 0
        ]
        return statistics.median(ratios) if ratios else None


IN_PROCESS = "in-process: RequestTable calls"


def _ratio_cell(ratio: float | None) -> str:
    return f"{'-':>14}" if ratio is None else f"{ratio:>13.2f}x"


BACKEND = "in-process: InProcessBackend"
STEP_SOCKET = "StepStream 256 StepBuilder+omit, step socket"


def _ways(
    meter: Meter,
    num_requests: int,
    stub: pb_grpc.KVCacheServiceStub,
    client: KVClient,
    target: str,
    runner: asyncio.Runner,
    step_socket: str,
) -> list[Way]:
    few = max(WAVE, num_requests // 8)
    ways = [
        Way(IN_PROCESS, num_requests, partial(run_in_process, meter)),
        Way(BACKEND, num_requests, partial(run_backend, meter)),
        Way(
            "in-process Step path, 256 ops",
            num_requests,
            partial(run_step_in_process, meter, size=256),
        ),
        Way(
            "in-process Step path, 256, columnar",
            num_requests,
            partial(run_step_in_process, meter, size=256, columnar=True),
        ),
        Way(
            "in-process Step path, columnar+omit",
            num_requests,
            partial(run_step_in_process, meter, size=256, columnar=True, omit=True),
        ),
        Way("unary, 1 op per call", few, partial(unary_ops, meter, stub)),
    ]
    for size in (64, 256):
        for columnar in (False, True):
            ways.append(
                Way(
                    f"Step, {size} ops per call{', columnar' if columnar else ''}",
                    num_requests,
                    partial(step_ops, meter, stub, size=size, columnar=columnar),
                )
            )
    for coalesce in (False, True):
        how = "coalescing" if coalesce else "no coalescing"
        ways.append(
            Way(
                f"Step 256 StepBuilder, {how}",
                num_requests,
                partial(client_step_ops, meter, client, size=256, coalesce=coalesce),
            )
        )
        ways.append(
            Way(
                f"Step 256 StepBuilder+omit, {how}",
                num_requests,
                partial(
                    client_step_ops, meter, client, size=256, omit_state=True, coalesce=coalesce
                ),
            )
        )
    for size in (1, 64, 256):
        n = few if size == 1 else num_requests
        ways.append(
            Way(
                f"StepStream, {size} ops per message",
                n,
                partial(_run_stream, meter, runner, target, size=size),
            )
        )
    for in_flight in (1, 2):
        ways.append(
            Way(
                f"StepStream 256 StepBuilder+omit, {in_flight} in flight",
                num_requests,
                partial(client_stream_ops, meter, client, size=256, in_flight=in_flight),
            )
        )
    ways.append(
        Way(
            STEP_SOCKET,
            num_requests,
            partial(
                client_stream_ops, meter, client, size=256, in_flight=1, step_socket=step_socket
            ),
        )
    )
    return ways


async def _open_aio_channel(target: str) -> grpc.aio.Channel:
    # Opened on the runner's loop, which every later call on it runs on.
    return grpc.aio.insecure_channel(target)


def _aio_echo(
    runner: asyncio.Runner, channel: grpc.aio.Channel
) -> Callable[[bytes, int], list[float]]:
    call = channel.unary_unary(ECHO_METHOD)

    async def timed(payload: bytes, n: int) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            await call(payload)
            out.append(time.perf_counter() - start)
        return out

    return lambda payload, n: runner.run(timed(payload, n))


def run(
    num_requests: int, latency_samples: int, rounds: int, event_loop: str, decode_steps: int
) -> None:
    workload = partial(build_workload, decode_steps=decode_steps)
    num_ops = len(workload(num_requests, "x").ops)
    print(
        f"workload: {num_requests} requests, {num_ops} operations "
        f"(prompt {PROMPT_LEN}, {decode_steps} decode steps, waves of {WAVE}); "
        f"pool {NUM_BLOCKS} blocks; server event loop {event_loop}; {rounds} rounds"
    )
    tags = (f"w{i}" for i in range(1_000_000))
    with ExitStack() as stack:
        cfg = config()
        step_socket = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "s.sock")
        server = stack.enter_context(
            child_server(
                [
                    f"--num-blocks={cfg.num_blocks}",
                    f"--max-model-len={cfg.max_model_len}",
                    "--shutdown-grace=0",
                    f"--event-loop={event_loop}",
                    f"--step-socket={step_socket}",
                ]
            )
        )
        target, server_pid = server.target, server.pid
        echoes = stack.enter_context(echo_process(event_loop))
        channel = stack.enter_context(grpc.insecure_channel(target))
        echo_channel = stack.enter_context(grpc.insecure_channel(echoes.target))
        runner = stack.enter_context(asyncio.Runner(loop_factory=loop_factory(event_loop)))
        aio_channel = runner.run(_open_aio_channel(echoes.target))
        stack.callback(lambda: runner.run(aio_channel.close()))
        client = stack.enter_context(KVClient(target))
        tcp = stack.enter_context(socket.create_connection(("127.0.0.1", echoes.tcp_port)))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stub = pb_grpc.KVCacheServiceStub(channel)
        stub.GetUsage(pb.GetUsageRequest(), wait_for_ready=True)
        echo = echo_channel.unary_unary(ECHO_METHOD)
        echo(b"", wait_for_ready=True)
        floors = Floors(echo, _aio_echo(runner, aio_channel), tcp)
        unary_latency(stub, floors, 200)  # warm-up
        ways = _ways(Meter(server_pid), num_requests, stub, client, target, runner, step_socket)
        for way in ways:  # warm-up (connections, caches), not reported
            way.measure(workload(WAVE, next(tags)))
        latencies: dict[str, list[float]] = {name: [] for name in LATENCY_ROWS}
        throughputs = Throughputs()
        for r in range(rounds):
            for name, samples in unary_latency(stub, floors, latency_samples // rounds).items():
                latencies[name] += samples
            # None always runs first (right after the latency rounds) or last.
            for way in rotated(ways, r):
                throughputs.add(way.name, way.measure(workload(way.num_requests, next(tags))))
    _report(latencies, throughputs)


def _report(latencies: dict[str, list[float]], throughputs: Throughputs) -> None:
    floor = pct(latencies["grpc echo (floor)"], 0.5)
    num = len(latencies["AllocateSlots"])
    print(f"\nunary latency ({num} calls each, interleaved in rounds of 100; blocking stub):")
    for name, samples in latencies.items():
        over = (
            ""
            if "echo" in name
            else f", p50 over the grpc floor {(pct(samples, 0.5) - floor) * 1e6:+.0f} us"
        )
        print(
            f"  {name:<24} p50 {pct(samples, 0.5) * 1e6:6.0f} us, "
            f"p99 {pct(samples, 0.99) * 1e6:6.0f} us, "
            f"mean {statistics.fmean(samples) * 1e6:6.0f} us{over}"
        )
    print(
        f"\n{'way':<46}{'ops/s':>9}{'vs Table':>10}{'vs Backend':>12}"
        f"{'CPU us/op':>11}{'CPU vs Table':>14}"
    )
    for name in throughputs.samples:
        print(
            f"{name:<46}{throughputs.ops_s(name):>9,.0f}"
            f"{throughputs.ratio(name, IN_PROCESS):>9.2f}x"
            f"{throughputs.ratio(name, BACKEND):>11.2f}x"
            f"{throughputs.cpu_us_per_op(name):>11.1f}"
            f"{_ratio_cell(throughputs.cpu_ratio(name, IN_PROCESS))}"
        )
    print(
        "ops/s and CPU: medians over rounds; ratios: medians over rounds of the ratio in "
        "each round.\nCPU us/op: this process's CPU plus the server's, per operation; "
        "'CPU vs Table' = in-process CPU per op / the way's."
    )


def profile(num_requests: int) -> None:
    """cProfile of the server's side of Step: parse, run the operations, serialize."""
    steps = [s.SerializeToString() for s in build_workload(num_requests, "p").chunks(256)]
    manager = build_manager(config())
    runner = StepRunner(RequestTable(manager, KVCacheMetrics(manager, "bench", "0")), max_ops=4096)
    profiler = cProfile.Profile()
    profiler.enable()
    for raw in steps:
        response = pb.StepResponse()
        runner.run_whole(pb.StepRequest.FromString(raw), response, ANONYMOUS)
        response.SerializeToString()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=320, help="requests per workload")
    parser.add_argument("--latency-samples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=DECODE_STEPS,
        help="decode steps per request (more: a decode-dominated workload)",
    )
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
        run(args.requests, args.latency_samples, args.rounds, args.event_loop, args.decode_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

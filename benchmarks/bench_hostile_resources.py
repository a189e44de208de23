"""What a hostile client can make a ``kvservice serve`` process hold, and log, before
the server's limits refuse it (issue 27's hostile shapes, against today's limits).

Each shape runs against a fresh ``kvservice serve`` child process on a free loopback
port (``kvservice.bench.server.child_server``), at the server's default limits unless
a flag below sets one, with ``--log-level info`` (the default of ``kvservice serve``).
A client drives the shape until the first RESOURCE_EXHAUSTED, then sends
``--refusals`` more calls that are refused the same way, holds everything it got while
the server idles for ``--settle`` seconds (by default just over the log budget's
interval, so the "similar lines suppressed" summaries are written and counted), and
reports:

* accepted: what the server took before the first RESOURCE_EXHAUSTED, and which limit
  refused it (the limit the refusal's message names);
* RSS: the child's VmRSS (``/proc/<pid>/status``) before the shape; its growth when
  the first refusal came (what the accepted items hold, and per item), and after the
  calls refused past the limit and the settle (what refused calls leave behind: a
  refused call's garbage waits for the server's next full collection,
  ``--gc-full-collection-interval``, 60 s by default);
* idle CPU: the child's CPU time (user + system) during the settle, in % of one core,
  with everything still held (the reaper's cost with every session open);
* log: the lines and bytes the child wrote during the shape (its stdout, the log
  file ``child_server`` keeps, read through ``/proc/<pid>/fd/1``), settle included.

Shapes:

  mm_ids     AddRequest of 1-token prompts, each with ``max_mm_items_per_prompt``
             overlapping items (offset 0, length 1: the only place an item fits in a
             1-token prompt) with ``max_mm_identifier_length``-character identifiers,
             distinct within a prompt: the most identifier bytes a request may carry.
  mm_items   the same with 1-character identifiers: the most items per byte.
  sessions   OpenSession (the longest lease, so none runs out) as one tenant until
             refused, then as further tenants (a tokens file of enough tenants) until
             the server-wide limit refuses one: two rows, one tenant and all of them.
             (``child_server``'s readiness check sends no token, so a server with a
             tokens file is started here, the same way, ready once it answers
             UNAUTHENTICATED.)
  streams    StepStreams, each confirmed open by one empty step answered, kept open;
             one tenant, then enough tenants for the server-wide limit, as sessions.
  churn      ``--churn`` sessions opened and closed (at most ``--concurrency`` open at
             once, and within ``max_sessions_per_tenant``): the log lines session
             churn writes.

Run: ``python -m benchmarks.bench_hostile_resources [--quick] [--shapes mm_ids,...]
[--churn N] [--refusals N] [--mm-refusals N] [--settle S] [--max-sessions N ...]
[--server-arg=--FLAG=VALUE ...]``. ``--quick`` is the
smoke size (small server limits, no settle), for the tests; its figures say nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvservice.bench.server import (
    ChildServer,
    child_server,
)
from kvservice.protocol import AUTHORIZATION_KEY, SESSION_KEY, pack_token_ids
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server.config import ServerConfig
from kvservice.server.log import LINE_INTERVAL_S, SUPPRESSED_EVENT

SHAPES = ("mm_ids", "mm_items", "sessions", "streams", "churn")
# The server limits a flag may set (default: the server's own default).
LIMITS = (
    "max_mm_items_per_prompt",
    "max_mm_identifier_length",
    "max_mm_items_per_tenant",
    "max_mm_identifier_bytes_per_tenant",
    "max_sessions_per_tenant",
    "max_sessions",
    "max_step_streams_per_tenant",
    "max_step_streams",
)
# ``--quick``: limits small enough for a smoke run of a few seconds.
QUICK_LIMITS = {
    "max_mm_items_per_prompt": 64,
    "max_mm_identifier_length": 64,
    "max_mm_items_per_tenant": 1024,
    "max_mm_identifier_bytes_per_tenant": 16 * 1024,
    "max_sessions_per_tenant": 16,
    "max_sessions": 40,
    "max_step_streams_per_tenant": 4,
    "max_step_streams": 10,
}
QUICK_CHURN = 50
QUICK_REFUSALS = 20
DEFAULT_CHURN = 20_000
DEFAULT_REFUSALS = 500
# Each is a message of about 1 MB, whose garbage the server keeps until its next full
# collection (``--gc-full-collection-interval``): fewer.
DEFAULT_MM_REFUSALS = 100
DEFAULT_CONCURRENCY = 32
# Just past the log budget's interval, so the suppressed lines' summaries are written.
DEFAULT_SETTLE_S = LINE_INTERVAL_S + 0.5
SERVICE = "/kvservice.v1.KVCacheService/"
TENANT_TOKEN = "hostile-token-{:04d}-0123456789"  # at least 16 characters
LIMIT_NAME = re.compile(r"\b(max_[a-z_]+)\b")
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A stream refused whose status was lost (``_lost_status``) is opened again, this many
# times at most.
MAX_UNNAMED_REFUSALS = 20
Metadata = tuple[tuple[str, str], ...]


# -- the child process, seen from outside ---------------------------------------------


class ChildProcess:
    """RSS, CPU time and log output of the server's process (``/proc``)."""

    def __init__(self, server: ChildServer) -> None:
        assert server.pid is not None
        self.pid = server.pid
        # The log file child_server writes the child's stdout to (any later open
        # of /proc/<pid>/fd/1 is of that file, a new file position).
        self.log_path = os.readlink(f"/proc/{self.pid}/fd/1")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS in /proc/{self.pid}/status")

    def cpu_s(self) -> float:
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        # Fields 14 and 15 of stat(5) (utime, stime), counted from the state (field 3).
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def log_size(self) -> int:
        return os.stat(self.log_path).st_size

    def log_since(self, offset: int) -> bytes:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read()


# -- figures --------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    shape: str
    unit: str  # what "accepted" counts
    limits: str  # the limits in play, as set
    accepted: int = 0
    refused_by: str = "-"  # the limit the first refusal named
    refusals: int = 0  # calls refused, the first included
    wall_s: float = 0.0
    rss_before: int = 0
    rss_at_limit: int = 0  # when the first refusal came (churn: when the churn ended)
    rss_after: int = 0  # after the calls refused past the limit and the settle
    idle_cpu: float | None = None  # fraction of one core during the settle
    log_lines: int = 0
    log_bytes: int = 0
    # Summary lines' counts by the event they summarize: [lines suppressed, summaries].
    suppressed: dict[str, list[int]] = field(default_factory=dict)


class Measure:
    """One row's figures around a block of client work: RSS and log offset before,
    RSS at the limit (``at_limit``), then the settle (idle CPU), RSS and log after."""

    def __init__(self, child: ChildProcess, row: Row, settle_s: float) -> None:
        self.child, self.row, self.settle_s = child, row, settle_s
        self._start = 0.0
        self._log_offset = 0

    def begin(self) -> None:
        self.row.rss_before = self.child.rss_bytes()
        self._log_offset = self.child.log_size()
        self._start = time.perf_counter()

    def at_limit(self) -> None:
        self.row.rss_at_limit = self.child.rss_bytes()

    async def end(self, idle: bool = True) -> None:
        self.row.wall_s = time.perf_counter() - self._start
        if self.settle_s > 0:
            cpu = self.child.cpu_s()
            start = time.perf_counter()
            await asyncio.sleep(self.settle_s)
            if idle:
                self.row.idle_cpu = (self.child.cpu_s() - cpu) / (time.perf_counter() - start)
        self.row.rss_after = self.child.rss_bytes()
        written = self.child.log_since(self._log_offset)
        self.row.log_bytes = len(written)
        self.row.log_lines = written.count(b"\n")
        for line in written.splitlines():
            if SUPPRESSED_EVENT.encode() not in line:
                continue
            with contextlib.suppress(ValueError):
                summary = json.loads(line)
                counts = self.row.suppressed.setdefault(str(summary["of"]), [0, 0])
                counts[0] += int(summary["num_suppressed"])
                counts[1] += 1


# -- client plumbing ------------------------------------------------------------------


def _refusal(err: grpc.aio.AioRpcError) -> str:
    """The limit a RESOURCE_EXHAUSTED names; re-raise anything else."""
    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise err
    found = LIMIT_NAME.search(err.details() or "")
    return found[1] if found else "?"


def _lost_status(err: grpc.aio.AioRpcError) -> bool:
    """Whether a stream's write failed because the server had ended the stream (here:
    refused it) while the write was on its way: grpc.aio then reports a local INTERNAL
    error instead of the server's status, which is lost."""
    return err.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (
        err.debug_error_string() or ""
    )


@contextlib.asynccontextmanager
async def _channel(target: str) -> AsyncIterator[grpc.aio.Channel]:
    options = [
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        # A connection of its own per channel (a tenant each, as separate clients).
        ("grpc.use_local_subchannel_pool", 1),
    ]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        await channel.channel_ready()
        yield channel


def _metadata(tenant: int | None) -> Metadata:
    if tenant is None:
        return ()
    return ((AUTHORIZATION_KEY, f"Bearer {TENANT_TOKEN.format(tenant)}"),)


def _tokens_file(directory: str, num_tenants: int) -> str:
    path = Path(directory) / "tenants.toml"
    path.write_text(
        "".join(
            f'[tenants.t{i:04d}]\ntokens = ["{TENANT_TOKEN.format(i)}"]\n\n'
            for i in range(num_tenants)
        )
    )
    return str(path)


async def _until_refused(
    call: Callable[[int], Awaitable[None]], concurrency: int
) -> tuple[int, str]:
    """Run ``call(i)`` for i = 0, 1, ... on ``concurrency`` workers until one is
    refused RESOURCE_EXHAUSTED; returns how many succeeded and the limit named. The
    shapes hold what they get, so nothing succeeds once a count limit refused."""
    counter = iter(range(1 << 62))
    accepted = 0
    refused_by: str | None = None

    async def worker() -> None:
        nonlocal accepted, refused_by
        while refused_by is None:
            try:
                await call(next(counter))
            except grpc.aio.AioRpcError as err:
                refused_by = refused_by or _refusal(err)
                return
            accepted += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    assert refused_by is not None
    return accepted, refused_by


async def _refused(call: Callable[[int], Awaitable[None]], num: int, concurrency: int) -> int:
    """Send ``num`` calls expected to be refused RESOURCE_EXHAUSTED; how many were."""
    refused = 0
    queue = iter(range(num))

    async def worker() -> None:
        nonlocal refused
        for i in queue:
            try:
                await call(i)
            except grpc.aio.AioRpcError as err:
                _refusal(err)
                refused += 1

    await asyncio.gather(*(worker() for _ in range(min(concurrency, max(num, 1)))))
    return refused


# -- shapes ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    limits: dict[str, int]
    refusals: int
    mm_refusals: int
    settle_s: float
    churn: int
    concurrency: int
    server_args: tuple[str, ...] = ()


def _server_args(set_limits: dict[str, int], extra: Sequence[str]) -> list[str]:
    return [
        "--log-level=info",
        "--shutdown-grace=0",
        *(f"--{name.replace('_', '-')}={value}" for name, value in set_limits.items()),
        *extra,
    ]


def _limits_label(options: Options, names: Sequence[str], set_limits: dict[str, int]) -> str:
    return ", ".join(
        f"{name}={options.limits[name]:,}{'' if name in set_limits else ' (default)'}"
        for name in names
    )


async def mm_shape(
    child: ChildProcess, target: str, options: Options, set_limits: dict[str, int], long: bool
) -> Row:
    """AddRequests of 1-token prompts with the most multimodal items a prompt may
    carry, until a per-tenant limit refuses one."""
    limits = options.limits
    items = limits["max_mm_items_per_prompt"]
    id_length = limits["max_mm_identifier_length"] if long else 1
    names = ["max_mm_items_per_prompt", "max_mm_identifier_length"]
    names.append("max_mm_identifier_bytes_per_tenant" if long else "max_mm_items_per_tenant")
    row = Row(
        "mm_ids" if long else "mm_items",
        f"requests ({items:,} items x {id_length} B)",
        _limits_label(options, names, set_limits),
    )
    # One message of the items (distinct identifiers within it) serialized once; each
    # request appends its id (protobuf merges concatenated messages).
    features = [
        pb.MultiModalFeature(
            identifier=(f"{i:x}-".ljust(id_length, "x") if long else "x")[:id_length],
            offset=0,
            length=1,
        )
        for i in range(items)
    ]
    template = pb.AddRequestRequest(
        packed_prompt_token_ids=pack_token_ids([1]), mm_features=features
    ).SerializeToString()
    measure = Measure(child, row, options.settle_s)
    async with _channel(target) as channel:
        add = channel.unary_unary(
            SERVICE + "AddRequest",
            request_serializer=None,
            response_deserializer=pb.AddRequestResponse.FromString,
        )

        async def call(i: int) -> None:
            await add(template + pb.AddRequestRequest(request_id=f"mm-{i}").SerializeToString())

        async def refused(i: int) -> None:
            await add(template + pb.AddRequestRequest(request_id=f"no-{i}").SerializeToString())

        measure.begin()
        row.accepted, row.refused_by = await _until_refused(call, 2)
        measure.at_limit()
        row.refusals = 1 + await _refused(refused, options.mm_refusals, 2)
        await measure.end()
    return row


async def sessions_shape(
    child: ChildProcess,
    target: str,
    options: Options,
    set_limits: dict[str, int],
    num_tenants: int,
) -> list[Row]:
    """OpenSession as tenant 0 until refused, then as the others until the server-wide
    limit refuses one."""
    one = Row(
        "sessions, 1 tenant",
        "sessions",
        _limits_label(options, ["max_sessions_per_tenant"], set_limits),
    )
    every = Row(
        f"sessions, {num_tenants} tenants",
        "sessions",
        _limits_label(options, ["max_sessions_per_tenant", "max_sessions"], set_limits),
    )
    ttl = ServerConfig().session_ttl_max_s  # no lease runs out meanwhile
    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(_channel(target)) for _ in range(num_tenants)]

        def opener(tenant: int) -> Callable[[int], Awaitable[None]]:
            stub = channels[tenant].unary_unary(
                SERVICE + "OpenSession",
                request_serializer=pb.OpenSessionRequest.SerializeToString,
                response_deserializer=pb.OpenSessionResponse.FromString,
            )
            metadata = _metadata(tenant)

            async def call(i: int) -> None:
                del i
                await stub(pb.OpenSessionRequest(ttl_seconds=ttl), metadata=metadata)

            return call

        measure = Measure(child, every, options.settle_s)
        measure.begin()
        measure_one = Measure(child, one, 0.0)
        measure_one.begin()
        one.accepted, one.refused_by = await _until_refused(opener(0), options.concurrency)
        one.refusals = 1
        measure_one.at_limit()
        await measure_one.end(idle=False)
        every.accepted, every.refusals = one.accepted, 1
        for tenant in range(1, num_tenants):
            accepted, refused_by = await _until_refused(opener(tenant), options.concurrency)
            every.accepted += accepted
            every.refusals += 1
            if refused_by != "max_sessions_per_tenant":
                every.refused_by = refused_by
                break
        else:
            every.refused_by = "none: too few tenants"
        measure.at_limit()
        # Refused past the limits: half per tenant (tenant 0), half server-wide.
        half = options.refusals // 2
        every.refusals += await _refused(opener(0), half, options.concurrency)
        every.refusals += await _refused(
            opener(num_tenants - 1), options.refusals - half, options.concurrency
        )
        await measure.end()
    return [one, every]


async def streams_shape(
    child: ChildProcess,
    target: str,
    options: Options,
    set_limits: dict[str, int],
    num_tenants: int,
) -> list[Row]:
    """StepStreams as tenant 0 until refused, then as the others until the server-wide
    limit refuses one; each confirmed by one empty step answered, all kept open."""
    one = Row(
        "streams, 1 tenant",
        "StepStreams",
        _limits_label(options, ["max_step_streams_per_tenant"], set_limits),
    )
    every = Row(
        f"streams, {num_tenants} tenants",
        "StepStreams",
        _limits_label(options, ["max_step_streams_per_tenant", "max_step_streams"], set_limits),
    )
    open_calls: list[grpc.aio.StreamStreamCall] = []
    # Streams refused whose status the client lost (``_lost_status``).
    unnamed = [0]
    empty_step = pb.StepStreamRequest(step=pb.StepRequest(step_id=1))
    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(_channel(target)) for _ in range(num_tenants)]

        def opener(tenant: int, keep: bool) -> Callable[[int], Awaitable[None]]:
            stream = channels[tenant].stream_stream(
                SERVICE + "StepStream",
                request_serializer=pb.StepStreamRequest.SerializeToString,
                response_deserializer=pb.StepStreamResponse.FromString,
            )
            metadata = _metadata(tenant)

            async def call(i: int) -> None:
                del i
                for _ in range(MAX_UNNAMED_REFUSALS):
                    stream_call = stream(metadata=metadata)
                    try:
                        await stream_call.write(empty_step)
                        answer = await stream_call.read()
                    except asyncio.InvalidStateError:
                        answer = grpc.aio.EOF  # ended (refused) before the write
                    except grpc.aio.AioRpcError as err:
                        if not _lost_status(err):
                            raise
                        unnamed[0] += 1
                        continue  # refused; its status was lost: open another
                    if answer is grpc.aio.EOF:
                        raise grpc.aio.AioRpcError(
                            await stream_call.code(),
                            grpc.aio.Metadata(),
                            await stream_call.trailing_metadata(),
                            await stream_call.details(),
                        )
                    if keep:
                        open_calls.append(stream_call)
                    else:
                        stream_call.cancel()
                    return
                raise RuntimeError(f"{MAX_UNNAMED_REFUSALS} streams ended with no status")

            return call

        try:
            measure = Measure(child, every, options.settle_s)
            measure.begin()
            measure_one = Measure(child, one, 0.0)
            measure_one.begin()
            one.accepted, one.refused_by = await _until_refused(
                opener(0, True), options.concurrency
            )
            one.refusals = 1
            measure_one.at_limit()
            await measure_one.end(idle=False)
            every.accepted, every.refusals = one.accepted, 1
            for tenant in range(1, num_tenants):
                accepted, refused_by = await _until_refused(
                    opener(tenant, True), options.concurrency
                )
                every.accepted += accepted
                every.refusals += 1
                if refused_by != "max_step_streams_per_tenant":
                    every.refused_by = refused_by
                    break
            else:
                every.refused_by = "none: too few tenants"
            measure.at_limit()
            # Refused past the limits: half per tenant (tenant 0), half server-wide.
            half = options.refusals // 2
            every.refusals += await _refused(opener(0, False), half, options.concurrency)
            every.refusals += await _refused(
                opener(num_tenants - 1, False), options.refusals - half, options.concurrency
            )
            every.refusals += unnamed[0]
            await measure.end()
        finally:
            for stream_call in open_calls:
                stream_call.cancel()
    return [one, every]


async def churn_shape(
    child: ChildProcess, target: str, options: Options, set_limits: dict[str, int]
) -> Row:
    """``options.churn`` sessions opened and closed, ``options.concurrency`` at once
    (at most ``max_sessions_per_tenant``)."""
    row = Row("session churn", "sessions opened+closed", "-")
    del set_limits
    measure = Measure(child, row, options.settle_s)
    async with _channel(target) as channel:
        open_session = channel.unary_unary(
            SERVICE + "OpenSession",
            request_serializer=pb.OpenSessionRequest.SerializeToString,
            response_deserializer=pb.OpenSessionResponse.FromString,
        )
        close_session = channel.unary_unary(
            SERVICE + "CloseSession",
            request_serializer=pb.CloseSessionRequest.SerializeToString,
            response_deserializer=pb.CloseSessionResponse.FromString,
        )
        queue = iter(range(options.churn))

        async def worker() -> None:
            for _ in queue:
                opened = await open_session(pb.OpenSessionRequest())
                await close_session(
                    pb.CloseSessionRequest(session_id=opened.session_id, free_requests=True),
                    metadata=((SESSION_KEY, opened.session_id),),
                )
                row.accepted += 1

        # No more open at once than one tenant may have.
        workers = min(options.concurrency, options.limits["max_sessions_per_tenant"])
        measure.begin()
        await asyncio.gather(*(worker() for _ in range(workers)))
        measure.at_limit()
        await measure.end()
    return row


# -- the run --------------------------------------------------------------------------


@contextlib.contextmanager
def _server(
    options: Options, set_limits: dict[str, int], tokens_file: str | None = None
) -> Iterator[tuple[ChildProcess, str]]:
    args = _server_args(set_limits, options.server_args)
    if tokens_file is not None:
        args.append(f"--auth-tokens-file={tokens_file}")
    with child_server(args) as server:
        yield ChildProcess(server), server.target


def _tenants_needed(limits: dict[str, int], kind: str) -> int:
    """Tenants enough to reach the server-wide limit of ``kind`` (sessions or
    step_streams) through the per-tenant one, and one more to be refused by it."""
    return math.ceil(limits[f"max_{kind}"] / limits[f"max_{kind}_per_tenant"]) + 1


async def _shape(
    shape: str, child: ChildProcess, target: str, options: Options, set_limits: dict[str, int]
) -> list[Row]:
    if shape in ("mm_ids", "mm_items"):
        return [await mm_shape(child, target, options, set_limits, shape == "mm_ids")]
    if shape == "sessions":
        tenants = _tenants_needed(options.limits, "sessions")
        return await sessions_shape(child, target, options, set_limits, tenants)
    if shape == "streams":
        tenants = _tenants_needed(options.limits, "step_streams")
        return await streams_shape(child, target, options, set_limits, tenants)
    return [await churn_shape(child, target, options, set_limits)]


def run(shapes: Sequence[str], options: Options, set_limits: dict[str, int]) -> list[Row]:
    """Each shape against a fresh server; with a tokens file for the shapes that need
    many tenants."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvservice-hostile-") as directory:
        for shape in shapes:
            kind = {"sessions": "sessions", "streams": "step_streams"}.get(shape)
            tokens = (
                None
                if kind is None
                else _tokens_file(directory, _tenants_needed(options.limits, kind))
            )
            with _server(options, set_limits, tokens) as (child, target):
                rows += asyncio.run(_shape(shape, child, target, options, set_limits))
            print(f"  {shape}: done", flush=True)
    return rows


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:+,.1f}"


def report(rows: Sequence[Row], options: Options) -> None:
    print(
        f"\n{'shape':<20}{'accepted':>9}  {'refused by':<35}{'refused':>8}{'time s':>7}"
        f"{'RSS MB':>7}{'at limit':>10}{'per item':>13}{'after':>9}{'idle CPU':>9}"
        f"{'log lines':>10}{'log KB':>8}"
    )
    for row in rows:
        held = row.rss_at_limit - row.rss_before
        per_item = f"{held / row.accepted:,.0f} B" if row.accepted else "-"
        after = _mb(row.rss_after - row.rss_before) if row.rss_after else "-"
        idle = f"{row.idle_cpu * 100:.1f}%" if row.idle_cpu is not None else "-"
        print(
            f"{row.shape:<20}{row.accepted:>9,}  {row.refused_by:<35}{row.refusals:>8,}"
            f"{row.wall_s:>7.1f}{row.rss_before / 1e6:>7.0f}{_mb(held):>10}{per_item:>13}"
            f"{after:>9}{idle:>9}{row.log_lines:>10,}{row.log_bytes / 1e3:>8.1f}"
        )
    print("\nper row: what 'accepted' counts; the limits in play; the log's summary lines")
    for row in rows:
        suppressed = (
            "; ".join(
                f"{of}: {num:,} suppressed in {lines} summaries"
                for of, (num, lines) in row.suppressed.items()
            )
            or "none"
        )
        print(f"  {row.shape}: {row.unit}; {row.limits}; {suppressed}")
    print(
        f"""
accepted: before the first RESOURCE_EXHAUSTED (churn: sessions opened and closed);
refused by: the limit that refusal named. refused: calls refused RESOURCE_EXHAUSTED,
the first included, then --refusals more past each limit (--mm-refusals for the
multimodal shapes). RSS MB: the server's VmRSS before the row; at limit: its growth
when the first refusal came (churn: when the churn ended), and per accepted item;
after: the growth after the calls refused past the limit and the settle. idle CPU:
the server's during the settle (of one core), everything still held. log: what the
server wrote during the row at --log-level info, settle included. A row of all
tenants is the whole shape, its one-tenant row included; its calls refused past the
limits are split between the per-tenant and the server-wide limit.
Here: --refusals {options.refusals}, --mm-refusals {options.mm_refusals}, --settle \
{options.settle_s:g}, --concurrency {options.concurrency}."""
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smoke sizes (seconds)")
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma separated, of {', '.join(SHAPES)}"
    )
    parser.add_argument("--churn", type=int, help=f"sessions of churn (default {DEFAULT_CHURN})")
    parser.add_argument(
        "--refusals", type=int, help=f"calls sent past each limit (default {DEFAULT_REFUSALS})"
    )
    parser.add_argument(
        "--mm-refusals",
        type=int,
        help=f"AddRequests sent past the multimodal limits (default {DEFAULT_MM_REFUSALS})",
    )
    parser.add_argument(
        "--settle", type=float, help=f"idle seconds after each row (default {DEFAULT_SETTLE_S})"
    )
    parser.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="calls in flight"
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag of kvservice serve (repeatable), e.g. "
        "--server-arg=--gc-full-collection-interval=0",
    )
    for name in LIMITS:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, help="the server's limit (default: its own)"
        )
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes: {', '.join(sorted(unknown))}")
    set_limits = dict(QUICK_LIMITS) if args.quick else {}
    for name in LIMITS:
        if getattr(args, name) is not None:
            set_limits[name] = getattr(args, name)
    defaults = ServerConfig()
    limits = {name: set_limits.get(name, getattr(defaults, name)) for name in LIMITS}

    def pick(value: float | None, quick: float, default: float) -> float:
        return value if value is not None else quick if args.quick else default

    options = Options(
        limits=limits,
        refusals=int(pick(args.refusals, QUICK_REFUSALS, DEFAULT_REFUSALS)),
        mm_refusals=int(pick(args.mm_refusals, QUICK_REFUSALS, DEFAULT_MM_REFUSALS)),
        settle_s=pick(args.settle, 0.0, DEFAULT_SETTLE_S),
        churn=int(pick(args.churn, QUICK_CHURN, DEFAULT_CHURN)),
        concurrency=args.concurrency,
        server_args=tuple(args.server_arg),
    )
    print(
        f"hostile shapes against kvservice serve (a fresh child server each); shapes "
        f"{', '.join(shapes)}; limits set: "
        f"{', '.join(f'{k}={v:,}' for k, v in set_limits.items()) or 'none (defaults)'}"
        f"{'; server flags: ' + ' '.join(options.server_args) if options.server_args else ''}",
        flush=True,
    )
    rows = run(shapes, options, set_limits)
    report(rows, options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

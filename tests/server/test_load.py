"""Load: 16 concurrent schedulers against one server, tens of thousands of operations.

Each client runs vLLM's loop over its own requests (admit with the prefix hit, decode
one token per step, preempt what no longer fits, finish), on one of three transports:
unary calls, ``Step`` batches or one ``StepStream`` session. Prompts share system
prompts across clients, so prefix hits, evictions and stale hits happen under
contention. NO_SPACE is an answer and a stale hit (ABORTED) is the documented race
between a lookup and its allocation; anything else is an unexpected error and fails
the test. Each client checks the server's block table against what it was told, the
pool is audited while the load runs, and once every request is finished the pool
must be whole.

``KVSERVICE_LOAD_OPS`` (default 20,000) sets the total operations; the measured
ops/s are printed (``pytest -s``), never asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvservice.client import (
    Allocation,
    AsyncKVClient,
    AsyncSession,
    ComputedBlocks,
    FreeMode,
    KVServiceError,
    StaleHitError,
    StepBuilder,
    StepResults,
)
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.protocol.gen import kv_cache_service_pb2_grpc as pb_grpc
from tests.server.support import SMALL_POOL
from tests.servers import ThreadedServer, server_in_thread

NUM_CLIENTS = 16
TOTAL_OPS = int(os.environ.get("KVSERVICE_LOAD_OPS", "20000"))
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
# 96 usable blocks for 16 clients of up to 2 requests of up to 8 blocks: full enough
# that admissions answer NO_SPACE and decodes force preemptions.
LOAD_POOL = dataclasses.replace(SMALL_POOL, num_blocks=97, max_model_len=MAX_MODEL_LEN)
LIVE_PER_CLIENT = 2
MAX_DECODE = 24
SYSTEM_PROMPTS = [list(range(base, base + 32)) for base in (0, 1000, 2000, 3000)]
AUDIT_EVERY_STEPS = 25

# One operation's outcome: its value, or the typed error it was refused with.
Outcome = Any


class UnaryBatch:
    """Runs each queued operation as its own RPC when flushed."""

    def __init__(self, client: AsyncKVClient) -> None:
        self._client = client
        self._ops: list[tuple[str, tuple[Any, ...]]] = []

    def add(self, method: str, *args: Any) -> int:
        self._ops.append((method, args))
        return len(self._ops) - 1

    def __len__(self) -> int:
        return len(self._ops)

    async def flush(self) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for method, args in self._ops:
            try:
                outcomes.append(await getattr(self._client, method)(*args))
            except KVServiceError as err:
                outcomes.append(err)
        return outcomes


class StepBatch:
    """Queues operations in a ``StepBuilder``; flushing sends them as one step."""

    def __init__(self, submit: Callable[[StepBuilder], Awaitable[StepResults]]) -> None:
        self._submit = submit
        self._builder = StepBuilder()
        self._handles: list[Any] = []

    def add(self, method: str, *args: Any) -> int:
        self._handles.append(getattr(self._builder, method)(*args))
        return len(self._handles) - 1

    def __len__(self) -> int:
        return len(self._handles)

    async def flush(self) -> list[Outcome]:
        if not self._handles:
            return []
        results = await self._submit(self._builder)
        return [results.error(h) or results[h] for h in self._handles]


@dataclass
class Req:
    """A request as its scheduler tracks it."""

    request_id: str
    num_tokens: int
    running: bool = False
    decoded: int = 0
    # The block table the server's answers add up to.
    table: list[int] = field(default_factory=list)


@dataclass
class Stats:
    ops: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)


class Scheduler:
    """One client's scheduling loop over its own requests."""

    def __init__(
        self, name: str, new_batch: Callable[[], UnaryBatch | StepBatch], seed: int
    ) -> None:
        self.name = name
        self._new_batch = new_batch
        self._rng = random.Random(seed)
        self._requests: dict[str, Req] = {}
        self._next_id = 0
        self.stats = Stats()

    async def _run(self, batch: UnaryBatch | StepBatch) -> list[Outcome]:
        self.stats.ops += len(batch)
        return await batch.flush()

    def _unexpected(self, what: str, outcome: Outcome) -> None:
        self.stats.unexpected.append(f"{self.name}: {what}: {outcome!r}")

    def _new_prompt(self) -> list[int]:
        tail = [self._rng.randrange(10_000, 50_000) for _ in range(self._rng.randrange(1, 64))]
        return self._rng.choice(SYSTEM_PROMPTS) + tail

    async def step(self) -> None:
        """One scheduling step: admit new and waiting requests (lookup), decode the
        running ones; then allocate the admissions, preempt and finish."""
        batch = self._new_batch()
        lookups: dict[int, Req] = {}
        decodes: dict[int, Req] = {}
        while len(self._requests) < LIVE_PER_CLIENT:
            prompt = self._new_prompt()
            req = Req(f"{self.name}-{self._next_id}", len(prompt))
            self._next_id += 1
            self._requests[req.request_id] = req
            # Looked up in the same batch, below: operations run in order.
            batch.add("add_request", req.request_id, prompt)
        for req in self._requests.values():
            if req.running:
                batch.add("append_tokens", req.request_id, [self._rng.randrange(50_000)])
                decodes[batch.add("allocate_slots", req.request_id, 1)] = req
            else:
                lookups[batch.add("get_computed_blocks", req.request_id)] = req
        if self._rng.random() < 0.1:
            batch.add("get_usage")
        outcomes = await self._run(batch)
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, KVServiceError):
                self._unexpected(f"op {index} of a step", outcome)
        for index, req in decodes.items():
            self._decoded(req, outcomes[index])
        await self._admit_and_free({req.request_id: outcomes[i] for i, req in lookups.items()})

    def _decoded(self, req: Req, outcome: Outcome) -> None:
        req.num_tokens += 1
        if outcome is None:
            self.stats.outcomes["decode_no_space"] += 1
            req.running = False  # preempted below, recomputed later
            req.decoded = -1
            return
        if isinstance(outcome, Allocation):
            req.table += outcome.new_block_ids[0]
            req.decoded += 1

    async def _admit_and_free(self, hits: dict[str, Outcome]) -> None:
        batch = self._new_batch()
        admits: dict[int, tuple[Req, ComputedBlocks]] = {}
        freed: dict[int, str] = {}
        for rid, hit in hits.items():
            if isinstance(hit, ComputedBlocks):
                req = self._requests[rid]
                index = batch.add(
                    "allocate_slots", rid, req.num_tokens - hit.num_computed_tokens, hit
                )
                admits[index] = (req, hit)
        for req in list(self._requests.values()):
            if req.decoded < 0:
                freed[batch.add("free", req.request_id, FreeMode.PREEMPT)] = "preempted"
                req.decoded, req.table = 0, []
            elif req.decoded >= MAX_DECODE or req.num_tokens >= MAX_MODEL_LEN - 1:
                freed[batch.add("free", req.request_id, FreeMode.FINISH)] = "finished"
                del self._requests[req.request_id]
        outcomes = await self._run(batch)
        for index, (req, hit) in admits.items():
            self._admitted(req, hit, outcomes[index])
        for index, what in freed.items():
            if isinstance(outcomes[index], KVServiceError):
                self._unexpected(what, outcomes[index])
            self.stats.outcomes[what] += 1

    def _admitted(self, req: Req, hit: ComputedBlocks, outcome: Outcome) -> None:
        if outcome is None:
            self.stats.outcomes["admit_no_space"] += 1
        elif isinstance(outcome, StaleHitError):
            self.stats.outcomes["stale_hit"] += 1
        elif isinstance(outcome, Allocation):
            req.running = True
            req.table = list(hit.block_ids[0]) + list(outcome.new_block_ids[0])
            self.stats.outcomes["admitted"] += 1
            self.stats.outcomes["hit_tokens"] += hit.num_computed_tokens
        else:
            self._unexpected(f"admit {req.request_id}", outcome)

    async def check_tables(self) -> None:
        """The server's block table of every running request is what its answers
        added up to."""
        batch = self._new_batch()
        checks = {
            batch.add("get_block_ids", r.request_id): r
            for r in self._requests.values()
            if r.running
        }
        outcomes = await self._run(batch)
        for index, req in checks.items():
            got = outcomes[index]
            if isinstance(got, KVServiceError) or list(got[0]) != req.table:
                self._unexpected(f"block table of {req.request_id} (told {req.table})", got)

    async def drain(self) -> None:
        """FINISH everything still held."""
        batch = self._new_batch()
        for rid in self._requests:
            batch.add("free", rid, FreeMode.FINISH)
        for outcome in await self._run(batch):
            if isinstance(outcome, KVServiceError):
                self._unexpected("drain", outcome)
        self._requests.clear()


def batch_factory(
    client: AsyncKVClient, transport: str, session: AsyncSession | None
) -> Callable[[], UnaryBatch | StepBatch]:
    if session is not None:
        return lambda: StepBatch(session.step)
    if transport == "step":
        return lambda: StepBatch(client.step)
    return lambda: UnaryBatch(client)


async def run_client(
    index: int, server: ThreadedServer, ops_target: int, audits: list[int]
) -> Stats:
    """One scheduler on its own channel, on the transport its index picks."""
    async with AsyncKVClient(server.target, client_id=f"load-{index}") as client:
        transport = ("unary", "step", "stream")[index % 3]
        session = client.session() if transport == "stream" else None
        scheduler = Scheduler(
            f"c{index}-{transport}", batch_factory(client, transport, session), seed=index
        )
        steps = 0
        while scheduler.stats.ops < ops_target:
            await scheduler.step()
            steps += 1
            if steps % AUDIT_EVERY_STEPS == 0:
                await scheduler.check_tables()
                if index == 0:
                    # On the server's loop, between two RPCs: a consistent snapshot.
                    await asyncio.to_thread(server.call, server.server.audit)
                    audits.append(steps)
        await scheduler.drain()
        if session is not None:
            await session.close()
        return scheduler.stats


@pytest.fixture
def load_server() -> Iterator[ThreadedServer]:
    with server_in_thread(LOAD_POOL) as server:
        yield server


async def test_sixteen_clients_under_load(load_server: ThreadedServer) -> None:
    """16 concurrent schedulers, TOTAL_OPS operations: no unexpected error, the pool
    audited during the run, and whole again once every request is finished."""
    audits: list[int] = []
    start = time.perf_counter()
    all_stats = await asyncio.gather(
        *(run_client(i, load_server, TOTAL_OPS // NUM_CLIENTS, audits) for i in range(NUM_CLIENTS))
    )
    elapsed = time.perf_counter() - start
    ops = sum(s.ops for s in all_stats)
    outcomes = sum((s.outcomes for s in all_stats), Counter[str]())
    unexpected = [u for s in all_stats for u in s.unexpected]
    print(
        f"\nload: {NUM_CLIENTS} clients, {ops} operations in {elapsed:.1f} s = "
        f"{ops / elapsed:,.0f} ops/s; {dict(sorted(outcomes.items()))}; "
        f"{len(audits)} audits during the run; unexpected errors: {len(unexpected)}"
    )
    assert not unexpected, unexpected[:10]
    assert ops >= TOTAL_OPS
    # The load did what it is for: admissions, prefix hits and preemptions happened.
    assert outcomes["admitted"] and outcomes["hit_tokens"] and outcomes["preempted"]
    assert audits
    usage = load_server.call(load_server.server.table.usage)
    assert (usage.num_requests, usage.num_used_blocks) == (0, 0), usage
    assert usage.num_free_blocks == usage.num_blocks - 1
    load_server.call(load_server.server.audit)
    async with grpc.aio.insecure_channel(load_server.target) as channel:
        report = await pb_grpc.KVCacheServiceStub(channel).Audit(pb.AuditRequest())
    assert report.ok and not report.violations, report
    assert (report.num_requests, report.num_held_blocks) == (0, 0), report

"""Offload index throughput, side by side in one process: vLLM 0.33.0's
``CPUOffloadingManager`` and kvservice's ``KVServiceOffloadingManager`` (its core
compiled by mypyc unless ``KVSERVICE_PURE_PYTHON=1``), each with the ``lru`` and ``arc``
policies, on CPU tiers of 10^5 and 10^6 chunks.

The workload is what the offloading connector's scheduler asks of the tier for each
request: ``on_new_request``; ``lookup`` of its chunks in order until the first miss;
``touch`` of the prefix the GPU prefix cache already holds; ``prepare_load`` of the rest
of the hit; ``prepare_store`` of its new chunks, 16 a call; ``on_request_finished``;
loads and stores complete four requests later (transfers in flight). Requests are
seeded: half continue an earlier conversation (its chunks plus a new turn), half start
one on one of 256 shared system prompts. Both managers are first filled to capacity
(not timed), so the timed stores evict. Every manager call is one op.

Rounds: each round runs the next ``--requests`` requests of the same stream on every
engine, the engines' order rotating from round to round. ops/s is per CPU second of
this process (``time.process_time``), best round; the ratio is taken within each
round (median, lowest-highest). The engines must decide alike: a digest of every
answer (hits, chunk ids, evictions, refusals) is compared per round, and a difference
is printed as DECISIONS DIFFER.

With ``--served`` a third engine runs kvservice's manager with its index served by a
kvservice server (a child process on loopback, ``kvservice_target``): the manager
above is then the engine's replica, every call is recorded and sent once per
``--requests-per-step`` requests (one ``OffloadStep``, checked at the next), and the
server runs and checks each one. Its ops/s are the engine's process CPU as for the
others; the server's CPU per op is printed apart.

Run: ``python -m benchmarks.bench_offload_index`` (``--chunks 100000,1000000``,
``--rounds 5``, ``--served``; vLLM must be installed, as for the differential tests).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvservice.bench.measure import machine_load, process_cpu_seconds, ratio_columns, rotated
from kvservice.bench.server import child_server

ENGINES = ("vLLM", "kvservice")
SERVED = "kvservice served"
POLICIES = ("lru", "arc")
TOKENS_PER_CHUNK = 16
STORE_BATCH = 16
# A transfer completes this many requests after it was prepared.
COMPLETION_DELAY = 4
NUM_SYSTEM_PROMPTS = 256


def load_engines() -> dict[str, Any]:
    """The two managers' classes and vLLM's request context (imports vLLM)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: PLC0415
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: PLC0415

    from kvservice.integrations.vllm.offloading import (  # noqa: PLC0415
        KVServiceOffloadingManager,
        open_link,
    )

    return {
        "vLLM": CPUOffloadingManager,
        "kvservice": KVServiceOffloadingManager,
        "open_link": open_link,
        "ReqContext": ReqContext,
        "HIT": LookupResult.HIT,
    }


# -- the request stream ----------------------------------------------------------------


@dataclass(frozen=True)
class RequestPlan:
    """One request: its chunks' keys in prompt order, and how many of them the GPU
    prefix cache holds (touched in the tier, never loaded)."""

    req_id: str
    keys: list[bytes]
    gpu_hit: int


class RequestStream:
    """Seeded requests (see the module docstring); keys are 8-byte counters of group 0."""

    def __init__(self, seed: int, max_chunks_per_request: int = 512) -> None:
        self.rng = random.Random(seed)
        self.next_key = 0
        self.num_requests = 0
        self.max_chunks = max_chunks_per_request
        self.systems = [self._fresh(self.rng.randint(8, 48)) for _ in range(NUM_SYSTEM_PROMPTS)]
        self.conversations: list[tuple[list[bytes], int]] = []

    def _fresh(self, n: int) -> list[bytes]:
        start = self.next_key
        self.next_key += n
        return [(start + i).to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]

    def next(self) -> RequestPlan:
        rng = self.rng
        self.num_requests += 1
        if self.conversations and rng.random() < 0.5:
            # A recent conversation's next turn: its chunks, then new ones.
            i = len(self.conversations) - 1 - min(int(rng.expovariate(1 / 200)), 10_000)
            keys, system_len = self.conversations[max(i, 0)]
            if len(keys) > self.max_chunks:
                keys = keys[:system_len]
        else:
            keys = rng.choice(self.systems)
            system_len = len(keys)
        keys = keys + self._fresh(rng.randint(4, 48))
        self.conversations.append((keys, system_len))
        del self.conversations[:-20_000]
        gpu_hit = system_len if rng.random() < 0.5 else 0
        return RequestPlan(f"r{self.num_requests}", keys, gpu_hit)


# -- one engine ------------------------------------------------------------------------


@dataclass
class Digest:
    """What an engine answered over a segment: equal between engines that decide alike."""

    requests: int = 0
    lookups: int = 0
    hits: int = 0
    touches: int = 0
    loads: int = 0
    stores: int = 0
    stored: int = 0
    evicted: int = 0
    refused: int = 0
    completions: int = 0
    chunk_id_sum: int = 0

    @property
    def ops(self) -> int:
        """Manager calls: per request a new-request and a finished call, and the rest."""
        calls = self.lookups + self.touches + self.loads + self.stores + self.completions
        return 2 * self.requests + calls

    def decisions(self) -> tuple[int, ...]:
        return (
            self.lookups,
            self.hits,
            self.loads,
            self.stored,
            self.evicted,
            self.refused,
            self.chunk_id_sum,
        )


@dataclass
class Engine:
    """One manager and the transfers it has in flight."""

    name: str
    manager: Any
    hit: Any
    new_context: Callable[[str], Any]
    # Served: one scheduler step (on_schedule_end, which sends the step) this many
    # requests; 0: never (an index in the process).
    requests_per_step: int = 0
    in_flight: list[tuple[int, bool, list[bytes], Any]] = field(default_factory=list)
    num_served: int = 0
    ops_per_s: list[float] = field(default_factory=list)
    digest: Digest = field(default_factory=Digest)

    def context(self, plan: RequestPlan) -> Any:
        """The request's context with its keys' positions, as the scheduler sets them."""
        ctx = self.new_context(plan.req_id)
        for i, key in enumerate(plan.keys):
            ctx.set_offload_key_position(key, (i + 1) * TOKENS_PER_CHUNK)
        return ctx

    def fill(self, keys: list[bytes]) -> None:
        """Store ``keys`` (untimed), so that later stores evict."""
        for start in range(0, len(keys), 1024):
            ctx = self.new_context(f"fill{start}")
            batch = keys[start : start + 1024]
            output = self.manager.prepare_store(batch, ctx)
            self.manager.complete_store(output.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
            self._step_end(always=True)

    def _step_end(self, always: bool = False) -> None:
        if self.requests_per_step and (always or self.num_served % self.requests_per_step == 0):
            self.manager.on_schedule_end(None)

    def run(self, plans: Sequence[RequestPlan]) -> Digest:
        """Serve ``plans`` (their contexts made first, untimed); what was answered."""
        contexts = [self.context(plan) for plan in plans]
        self.digest = Digest()
        gc.collect()
        start = time.process_time()
        for plan, ctx in zip(plans, contexts, strict=True):
            self._serve(plan, ctx)
        self._step_end(always=True)
        if self.requests_per_step:
            self.manager.link.confirm()  # the last step's answer, inside the clock
        seconds = time.process_time() - start
        self.ops_per_s.append(self.digest.ops / max(seconds, 1e-9))
        return self.digest

    def _serve(self, plan: RequestPlan, ctx: Any) -> None:
        manager, keys, digest = self.manager, plan.keys, self.digest
        manager.on_new_request(ctx)
        num_hit = 0
        for key in keys:
            digest.lookups += 1
            if manager.lookup(key, ctx) != self.hit:
                break
            num_hit += 1
        digest.hits += num_hit
        gpu_hit = min(plan.gpu_hit, num_hit)
        if gpu_hit:
            manager.touch(keys[:gpu_hit], ctx)
            digest.touches += 1
        if num_hit > gpu_hit:
            spec = manager.prepare_load(keys[gpu_hit:num_hit], ctx)
            digest.loads += 1
            digest.chunk_id_sum += int(spec.block_ids.sum())
            self.in_flight.append((self.num_served, False, keys[gpu_hit:num_hit], ctx))
        self._store(keys[num_hit:], ctx)
        manager.on_request_finished(ctx)
        digest.requests += 1
        self.num_served += 1
        self._complete(self.num_served - COMPLETION_DELAY)
        self._step_end()

    def _store(self, keys: list[bytes], ctx: Any) -> None:
        digest = self.digest
        for start in range(0, len(keys), STORE_BATCH):
            output = self.manager.prepare_store(keys[start : start + STORE_BATCH], ctx)
            digest.stores += 1
            if output is None:
                digest.refused += 1
                return
            digest.stored += len(output.keys_to_store)
            digest.evicted += len(output.evicted_keys)
            digest.chunk_id_sum += int(output.store_spec.block_ids.sum())
            if output.keys_to_store:
                self.in_flight.append((self.num_served, True, output.keys_to_store, ctx))

    def _complete(self, served_by: int) -> None:
        done = 0
        for served, is_store, keys, ctx in self.in_flight:
            if served > served_by:
                break
            if is_store:
                self.manager.complete_store(keys, ctx)
            else:
                self.manager.complete_load(keys, ctx)
            done += 1
        self.digest.completions += done
        del self.in_flight[:done]


# -- the run ---------------------------------------------------------------------------


@dataclass
class Row:
    """One (policy, tier size): each engine's ops/s per round, and the op mix."""

    policy: str
    num_chunks: int
    ops_per_s: dict[str, list[float]]
    mix: Digest
    same: bool
    # Served: the server's CPU microseconds per op, per round.
    server_us_per_op: list[float] = field(default_factory=list)


def _engines(classes: dict[str, Any], policy: str, num_chunks: int, served: Any) -> list[Engine]:
    engines = [
        Engine(name, classes[name](num_chunks, policy), classes["HIT"], classes["ReqContext"])
        for name in ENGINES
    ]
    if served is not None:
        manager = classes["kvservice"](num_chunks, policy)
        manager.link = classes["open_link"](manager, served.target)
        engines.append(
            Engine(SERVED, manager, classes["HIT"], classes["ReqContext"], served.requests_per_step)
        )
    return engines


@dataclass(frozen=True)
class Served:
    """The server a served engine's index lives on."""

    target: str
    pid: int
    requests_per_step: int


def measure(
    classes: dict[str, Any],
    policy: str,
    num_chunks: int,
    args: argparse.Namespace,
    served: Served | None = None,
) -> Row:
    engines = _engines(classes, policy, num_chunks, served)
    # Keys of their own (a 0xff first byte): none of the stream's.
    fill_keys = [b"\xff" + i.to_bytes(7, "big") + b"\0\0\0\0" for i in range(num_chunks)]
    for engine in engines:
        engine.fill(fill_keys)
    del fill_keys
    stream = RequestStream(args.seed)
    same = True
    mix = Digest()
    server_us: list[float] = []
    for r in range(args.rounds):
        plans = [stream.next() for _ in range(args.requests)]
        digests = {}
        for engine in rotated(engines, r):
            server_cpu = (
                process_cpu_seconds(served.pid) if engine.name == SERVED and served else None
            )
            digests[engine.name] = engine.run(plans)
            if served is not None and server_cpu is not None:
                used = (process_cpu_seconds(served.pid) or 0.0) - server_cpu
                server_us.append(1e6 * used / max(digests[engine.name].ops, 1))
        same &= len({d.decisions() for d in digests.values()}) == 1
        mix = digests["vLLM"]
    for engine in engines:
        if engine.name == SERVED:
            engine.manager.shutdown()  # ends the session: the server drops the index
    return Row(policy, num_chunks, {e.name: e.ops_per_s for e in engines}, mix, same, server_us)


def print_row(row: Row) -> None:
    vllm, ours = row.ops_per_s["vLLM"], row.ops_per_s["kvservice"]
    ratios = [o / v for o, v in zip(ours, vllm, strict=True)]
    line = (
        f"{row.policy:<7}{row.num_chunks:>10,}{max(vllm):>13,.0f}{max(ours):>16,.0f}"
        f"{ratio_columns(ratios)}"
    )
    served = row.ops_per_s.get(SERVED)
    if served is not None:
        served_ratios = [o / v for o, v in zip(served, vllm, strict=True)]
        line += (
            f"{max(served):>15,.0f}{ratio_columns(served_ratios)}"
            f"{statistics.median(row.server_us_per_op):>13.2f}"
        )
    print(line)
    if not row.same:
        print("  !! DECISIONS DIFFER between the engines")


def print_mix(row: Row, num_requests: int) -> None:
    mix = row.mix
    print(
        f"  op mix of the last round ({row.policy}, {row.num_chunks:,} chunks): "
        f"{mix.ops:,} ops for {num_requests} requests: {mix.lookups:,} lookups "
        f"({mix.hits:,} hits), {mix.touches:,} touches, {mix.loads:,} loads, "
        f"{mix.stores:,} stores ({mix.stored:,} chunks stored, {mix.evicted:,} evicted, "
        f"{mix.refused} refused), {mix.completions:,} completions"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--chunks", default="100000,1000000", help="tier sizes in chunks, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each engine's best")
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--served",
        action="store_true",
        help="also kvservice's index served by a kvservice server (a child process)",
    )
    parser.add_argument("--requests-per-step", type=int, default=16)
    args = parser.parse_args(argv)
    if not args.served:
        return _main(args, None)
    with child_server(["--max-step-ops=65536", "--session-ttl-min=1"]) as server:
        assert server.pid is not None
        return _main(args, Served(server.target, server.pid, args.requests_per_step))


def _main(args: argparse.Namespace, served: Served | None) -> int:
    classes = load_engines()
    from kvservice.core import COMPILED  # noqa: PLC0415

    print(
        f"bench_offload_index: vLLM CPUOffloadingManager vs kvservice "
        f"({'compiled' if COMPILED else 'pure Python'}), one process; {args.requests} "
        f"requests per round, {args.rounds} rounds, engines in turn (order rotating), "
        f"seed {args.seed}; ops/s: manager calls per CPU second, best round; ratio "
        "kvservice/vLLM per round: median, lowest-highest"
    )
    print(f"machine: {machine_load()} at start")
    header = (
        f"{'policy':<7}{'chunks':>10}{'vLLM ops/s':>13}{'kvservice ops/s':>16}"
        f"{'ratio':>8}{'spread':>13}"
    )
    if served is not None:
        print(
            f"served: the index on a kvservice server at {served.target}, one OffloadStep "
            f"per {served.requests_per_step} requests; server CPU us/op apart"
        )
        header += f"{'served ops/s':>15}{'ratio':>8}{'spread':>13}{'server us/op':>13}"
    print(header)
    rows = []
    for num_chunks in (int(n) for n in args.chunks.split(",")):
        for policy in args.policies.split(","):
            row = measure(classes, policy, num_chunks, args, served)
            print_row(row)
            rows.append(row)
    for row in rows:
        print_mix(row, args.requests)
    print(f"machine: {machine_load()} at end")
    return 0 if all(row.same for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

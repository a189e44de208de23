"""What publishing KV events costs the request table, side by side in one run.

The same seeded scheduler-like workload (shared system prompts, prefix hits, decode,
finished requests freed, evictions once the pool is full) runs against a started
``KVCacheServer``'s request table on the server's own loop, one loop turn per step (so the
ZMQ publisher cuts one batch per step, as the server does per RPC), in three modes:

* ``off``: no KV events recorded;
* ``grpc-log``: events recorded and numbered in the event log behind SubscribeEvents
  (``--kv-events``), no subscriber;
* ``zmq``: the event log plus the ZMQ publisher (``--kv-events-config``, PUB and replay
  on loopback), with a subscriber in another process decoding every batch with
  msgspec as a router does.

Rounds interleave the modes, each round starting with the next one, after the same
untimed warm-up in every mode. Prints the request table's operations per second (each
add, lookup, allocate, append and free is one) and the server process's CPU time per
operation (its loop and the ZMQ threads: the steadier figure on a shared machine),
each with its ratio to ``off`` within the round (above 1: faster), and the KV events
per second the mode published; for ``zmq`` also how many the subscriber decoded.
Medians over rounds.

Run: ``python -m benchmarks.bench_kv_events [--steps 400] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import random
import statistics
import time
from multiprocessing.connection import Connection

import msgspec
import zmq

from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, FreeMode, NewRequest
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.zmq_events.config import KVEventsConfig
from kvservice.server.zmq_events.wire import KVEventBatch

BLOCK_SIZE = 16
PREFIX_TOKENS = 256
ONE = AllocateArgs(num_new_tokens=1)
MODES = ("off", "grpc-log", "zmq")
ZMQ = KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0")


def config(mode: str, num_blocks: int) -> ServerConfig:
    base = ServerConfig(
        port=0,
        metrics_port=None,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        audit_interval_s=0,
    )
    if mode == "grpc-log":
        return dataclasses.replace(base, kv_events=True)
    if mode == "zmq":
        return dataclasses.replace(base, kv_events_config=ZMQ)
    return base


@dataclasses.dataclass
class Sample:
    """One mode's timed run: wall and CPU seconds of the server's process (its loop
    and the ZMQ threads; the subscriber runs elsewhere)."""

    ops: int
    events: int
    wall_s: float
    cpu_s: float
    delivered: str = ""


@dataclasses.dataclass
class Workload:
    """Admit ``admits`` requests a step (a shared prefix and a unique tail), decode
    every running one, free those that reached their length; the ones still running
    are freed after the clock stops."""

    seed: int
    admits: int
    steps: int

    def run(self, server: KVCacheServer) -> Sample:
        """The timed steps; one loop turn after each."""
        return asyncio.get_event_loop().run_until_complete(self._run(server))

    async def _run(self, server: KVCacheServer) -> Sample:
        table = server.table
        rng = random.Random(self.seed)
        prefixes = [[rng.randrange(50_000) for _ in range(PREFIX_TOKENS)] for _ in range(8)]
        remaining: dict[str, int] = {}
        ops = 0
        next_id = 0
        event_log = server.events
        events_before = event_log.last_sequence if event_log is not None else 0
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(self.steps):
            for _ in range(self.admits):
                rid = f"{self.seed}-{next_id}"
                next_id += 1
                tail = [rng.randrange(50_000) for _ in range(rng.randrange(32, 256))]
                prompt = rng.choice(prefixes) + tail
                table.add_request(NewRequest(rid, prompt), tenant=DEFAULT_TENANT)
                hit = table.get_computed_blocks(rid, tenant=DEFAULT_TENANT)
                args = AllocateArgs(
                    num_new_tokens=len(prompt) - hit.num_computed_tokens,
                    num_new_computed_tokens=hit.num_computed_tokens,
                    new_computed_block_ids=hit.block_ids,
                )
                ops += 3
                if table.allocate_slots(rid, args, tenant=DEFAULT_TENANT).new_block_ids is None:
                    table.free(rid, FreeMode.FINISH, tenant=DEFAULT_TENANT)
                    ops += 1
                    continue
                remaining[rid] = rng.randrange(16, 128)
            for rid in list(remaining):
                table.append_tokens(rid, [rng.randrange(50_000)], tenant=DEFAULT_TENANT)
                ops += 2
                remaining[rid] -= 1
                fits = (
                    table.allocate_slots(rid, ONE, tenant=DEFAULT_TENANT).new_block_ids is not None
                )
                if not remaining[rid] or not fits:
                    table.free(rid, FreeMode.FINISH, tenant=DEFAULT_TENANT)
                    del remaining[rid]
                    ops += 1
            await asyncio.sleep(0)  # the loop turn that ends the step's batch
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
        events = (event_log.last_sequence if event_log is not None else 0) - events_before
        for rid in remaining:
            table.free(rid, FreeMode.FINISH, tenant=DEFAULT_TENANT)
        await asyncio.sleep(0)
        return Sample(ops, events, wall_s, cpu_s)


def subscribe(endpoint: str, conn: Connection) -> None:
    """A router's subscriber in its own process: decodes every batch. Says "joined" at
    its first batch; counts the events of the batches after ``("from", n)``; answers
    ``("until", n)`` with (events, batches) once it has batch n; stops at None."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    base = until = None
    events = batches = 0
    last = -1
    while True:
        if conn.poll():
            command = conn.recv()
            if command is None:
                break
            if command[0] == "from":
                base = command[1]
                conn.send("counting")
            else:
                until = command[1]
        if sub.poll(20):
            _, sequence, payload = sub.recv_multipart()
            num_events = len(decoder.decode(payload).events)
            if last < 0:
                conn.send("joined")
            last = int.from_bytes(sequence, "big")
            if base is not None and last > base:
                events += num_events
                batches += 1
        if until is not None and last >= until:
            conn.send((events, batches))
            until = None
    context.destroy(linger=0)


def measure(mode: str, workload: Workload, num_blocks: int) -> Sample:
    """One mode on a fresh server (and, for zmq, a fresh subscriber process)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    server = KVCacheServer(config(mode, num_blocks))
    loop.run_until_complete(server.start())
    publisher = server.kv_event_publisher
    child = conn = None
    try:
        # The same untimed warm-up in every mode: the pool and the interpreter's caches
        # start each timed run alike.
        warm_up = dataclasses.replace(workload, seed=-1 - workload.seed, steps=workload.steps // 4)
        warm_up.run(server)
        if publisher is not None:
            spawn = multiprocessing.get_context("spawn")
            conn, theirs = spawn.Pipe()
            child = spawn.Process(target=subscribe, args=(publisher.endpoint, theirs))
            child.start()
            _join(server, conn)
            conn.send(("from", publisher.last_sequence))
            assert conn.recv() == "counting"
        sample = workload.run(server)
        if publisher is not None and conn is not None:
            conn.send(("until", publisher.last_sequence))
            received, batches = conn.recv()
            sample.delivered = f"decoded {received} of {sample.events} events, {batches} batches"
            conn.send(None)
        return sample
    finally:
        loop.run_until_complete(server.stop(grace=0))
        if child is not None:
            child.join(10)
        loop.close()


def _join(server: KVCacheServer, conn: Connection) -> None:
    """Publish one small batch at a time until the subscriber has one (its SUB socket
    joins asynchronously), so the timed run reaches it whole."""
    loop = asyncio.get_event_loop()
    table = server.table
    for i in range(10_000):
        rid = f"warm{i}"
        table.add_request(NewRequest(rid, [i % 50_000] * BLOCK_SIZE), tenant=DEFAULT_TENANT)
        table.allocate_slots(rid, AllocateArgs(num_new_tokens=BLOCK_SIZE), tenant=DEFAULT_TENANT)
        table.free(rid, FreeMode.FINISH, tenant=DEFAULT_TENANT)
        loop.run_until_complete(asyncio.sleep(0.005))
        if conn.poll():
            assert conn.recv() == "joined"
            return
    raise RuntimeError("the subscriber never received a batch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--admits", type=int, default=4, help="new requests per step")
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    samples: dict[str, list[Sample]] = {mode: [] for mode in MODES}
    wall_ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu_ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        workload = Workload(seed=round_, admits=args.admits, steps=args.steps)
        # Each round starts with another mode, so none always runs first.
        order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
        measured = {mode: measure(mode, workload, args.num_blocks) for mode in order}
        off = measured["off"]
        for mode, sample in measured.items():
            samples[mode].append(sample)
            wall_ratios[mode].append(off.wall_s / sample.wall_s)
            cpu_ratios[mode].append(off.cpu_s / sample.cpu_s)
    print(
        f"request table with KV events: {args.steps} steps of {args.admits} admissions plus "
        f"decodes, {args.num_blocks} blocks, {args.rounds} rounds (medians; ratios to off "
        f"within each round)"
    )
    print(
        f"{'mode':>9} {'ops/s':>9} {'vs off':>7} {'cpu us/op':>10} {'vs off':>7} "
        f"{'events/s':>9}  zmq subscriber (last round)"
    )
    for mode in MODES:
        runs = samples[mode]
        ops_per_s = statistics.median(s.ops / s.wall_s for s in runs)
        cpu_us = statistics.median(s.cpu_s / s.ops * 1e6 for s in runs)
        events_per_s = statistics.median(s.events / s.wall_s for s in runs)
        print(
            f"{mode:>9} {ops_per_s:>9.0f} {statistics.median(wall_ratios[mode]):>6.2f}x "
            f"{cpu_us:>10.2f} {statistics.median(cpu_ratios[mode]):>6.2f}x "
            f"{events_per_s:>9.0f}  {runs[-1].delivered}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

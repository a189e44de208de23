"""A kvservice server's ZMQ KV event stream is the one stock vLLM publishes.

KV-aware routers (llm-d's indexer, Dynamo's router) rebuild each engine's prefix cache
from vLLM's ZMQ stream; a vLLM whose blocks a kvservice server allocates
(``KVServiceScheduler`` with ``KVSERVICE_TARGET``) points them at the server's stream
(``kvservice serve --kv-events-config``) instead. That only works if the server
publishes what vLLM would have. So the same seeded generation runs twice on vLLM
0.32.0's ``LLMEngine`` (the tiny model, greedy, shared prefixes, a pool small enough to
evict): once stock, with vLLM's own ZMQ publisher, and once on a ``kvservice serve``
child process with the same pool, publishing on ZMQ. A router's subscriber reads each
stream with vLLM's ``msgspec.msgpack.Decoder(KVEventBatch)``, and the two event
sequences, flattened, must be equal struct for struct, but for the ``AllBlocksCleared``
the server publishes first, when the engine's session resets its pool.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm import envs as vllm_envs
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core import kv_cache_utils

from kvservice.bench.server import child_server, free_port
from kvservice.client import KVClient
from kvservice.integrations.vllm.engine_driver import (
    SCHEDULER_CLS,
    EngineRun,
    EngineSetup,
    EngineWorkload,
    build_engine,
    drive,
    shutdown,
)

SETUP = EngineSetup()
# One request aborted mid-generation, another in its prefill (as test_generation's).
WORKLOAD = EngineWorkload(0, aborts={10: ("req-0",), 1: ("req-2",)})
TOPIC = "kv-events"
# A stream quiet this long after its engine finished has sent everything; the replay
# socket then confirms it (see ``StreamReader.drain``).
IDLE_S = 0.5
# Safety nets only: nothing waits this long when the streams work.
DRAIN_TIMEOUT_S = 30.0
REPLAY_TIMEOUT_MS = 5_000
END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)


class StreamReader:
    """A KV-aware router's subscriber: the SUB socket, decoded with vLLM's own
    ``KVEventBatch`` decoder, and the replay socket (vLLM's protocol) for batches the
    SUB socket missed. The engine runs in this thread, so nothing reads while it runs:
    ZMQ's I/O thread queues the batches, without a high-water mark so none is dropped.
    A SUB socket's subscription reaches the publisher some time after it binds (ZMQ's
    slow joiner), so the first batches can miss it: the replay socket fills any gap."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, replay_endpoint: str) -> None:
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.replay = context.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.RCVHWM, 0)
        self.replay.connect(replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.batches: list[KVEventBatch] = []
        self.replays = 0

    @property
    def events(self) -> list[Any]:
        """Every event, in the publisher's order: a router applies them so."""
        return [event for batch in self.batches for event in batch.events]

    def drain(self) -> None:
        """Read the SUB socket until it stays quiet for ``IDLE_S``, then ask the
        publisher's replay buffer for anything after the last batch read: the stream
        is drained when that answer is empty. (Counting on the publisher's buffer, not
        on time: a batch still in flight after the quiet spell is found either way.)"""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            while self.sub.poll(int(IDLE_S * 1000)):
                assert time.monotonic() < deadline, "the stream never went quiet"
                topic, sequence, payload = self.sub.recv_multipart()
                self._take(topic, sequence, payload)
            if not self._replay_from(len(self.batches)):
                return
            assert time.monotonic() < deadline, "the replay buffer kept growing"

    def _take(self, topic: bytes, sequence: bytes, payload: bytes) -> None:
        assert topic == TOPIC.encode()
        seq = int.from_bytes(sequence, "big")
        if seq > len(self.batches):  # missed some: the replay socket has them
            self._replay_from(len(self.batches))
        if seq == len(self.batches):
            batch = self.decoder.decode(payload)
            assert batch.data_parallel_rank == 0
            self.batches.append(batch)

    def _replay_from(self, start: int) -> int:
        """vLLM's replay: ask with the start sequence, read up to the end marker; the
        number of batches it answered."""
        self.replays += 1
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        answered = 0
        while True:
            assert self.replay.poll(REPLAY_TIMEOUT_MS), "no answer from the replay socket"
            empty, topic, sequence, payload = self.replay.recv_multipart()
            assert empty == b""
            if sequence == END_SEQUENCE:
                return answered
            answered += 1
            seq = int.from_bytes(sequence, "big")
            assert seq <= len(self.batches), f"batch {len(self.batches)} left the buffer"
            self._take(topic, sequence, payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


@contextmanager
def reading(endpoint: str, replay_endpoint: str) -> Iterator[StreamReader]:
    context: zmq.Context[Any] = zmq.Context()
    reader = StreamReader(context, endpoint, replay_endpoint)
    try:
        yield reader
    finally:
        reader.close()
        context.destroy(linger=0)


def events_config(endpoint: str, replay_endpoint: str) -> dict[str, Any]:
    """vLLM's ``--kv-events-config`` keys, the same for both publishers."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": TOPIC,
    }


def generate(
    model: Path, setup: EngineSetup, scheduler_cls: str | None, reader: StreamReader
) -> EngineRun:
    """``run_engine``, with the stream drained before the engine shuts down: vLLM's
    publisher closes its sockets with linger 0 at shutdown, dropping what is unsent,
    and its replay socket goes with them."""
    run = EngineRun()
    engine = build_engine(model, setup, scheduler_cls, run)
    try:
        drive(engine, WORKLOAD, run)
        reader.drain()
    finally:
        shutdown(engine)
    return run


def server_args(endpoint: str, replay_endpoint: str) -> list[str]:
    """vLLM's pool and vLLM's hash form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, an
    int by default, else the hash's bytes) on a server that publishes on ZMQ."""
    int_hashes = vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    return [
        f"--block-size={SETUP.block_size}",
        f"--num-blocks={SETUP.num_blocks}",
        f"--max-model-len={SETUP.max_model_len}",
        f"--kv-events-config={json.dumps(events_config(endpoint, replay_endpoint))}",
        "--kv-events-int-block-hashes" if int_hashes else "--no-kv-events-int-block-hashes",
    ]


def test_the_servers_stream_is_stock_vllms(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ``BlockStored`` and ``BlockRemoved`` the server publishes is, in order,
    the one stock vLLM publishes for the same generation: whole structs compared, so
    block hashes (and their form), parent hash, token ids, block size, LoRA, medium,
    extra keys, group index and cache-spec kind all agree. The batches may be cut
    differently, so the flattened sequences are compared.

    One event more on the server's stream, first: ``AllBlocksCleared``. The engine's
    scheduler resets the server's pool when its session opens (``ServerLink.start``:
    ``ResetPrefixCache(fresh_pool=True)``, so the pool starts as vLLM's new one does),
    and a reset publishes it, as vLLM's own ``BlockPool.reset_prefix_cache`` does even
    on an empty cache. Stock vLLM starts on a new pool and resets nothing. The event is
    what a router needs: the server's stream outlives an engine, so it is how the
    router drops what an earlier engine left cached.

    vLLM 0.32 hashes with sha256 and, without PYTHONHASHSEED, its fixed seed; the
    server does the same (the child inherits this environment), the scheduler refuses
    a server that hashes otherwise at startup, and the seed is checked here too.
    vLLM's endpoints are ipc sockets (a bound ``tcp://*:PORT`` would listen on every
    interface); the server's are on free loopback ports.
    """
    stock_config = events_config(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    stock_setup = EngineSetup(kv_events_config=KVEventsConfig(**stock_config))
    with reading(stock_config["endpoint"], stock_config["replay_endpoint"]) as reader:
        stock = generate(tiny_model, stock_setup, None, reader)
        stock_events = reader.events
        stock_batches = len(reader.batches)

    pub, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    bound = [address.replace("127.0.0.1", "*") for address in (pub, replay)]
    with child_server(server_args(*bound)) as server, reading(pub, replay) as reader:
        monkeypatch.setenv("KVSERVICE_TARGET", server.target)
        remote = generate(tiny_model, SETUP, SCHEDULER_CLS, reader)
        reader.drain()  # and what the session's end published, if anything
        served_events = reader.events
        with KVClient(server.target) as client:
            server_seed = client.get_cache_config().none_hash_seed

    assert remote.outcome() == stock.outcome()  # the same scheduling, so the same events
    assert server_seed == kv_cache_utils.get_none_hash_seed()
    stored = [e for e in stock_events if isinstance(e, BlockStored)]
    removed = [e for e in stock_events if isinstance(e, BlockRemoved)]
    assert stored and removed, "the workload should store and evict blocks"
    assert len(stored) + len(removed) == len(stock_events)  # no AllBlocksCleared
    form = int if vllm_envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else bytes
    assert all(isinstance(h, form) for e in stock_events for h in e.block_hashes)
    assert stock_batches > 1
    assert served_events[:1] == [AllBlocksCleared()]
    assert served_events[1:] == stock_events

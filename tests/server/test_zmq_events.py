"""The ZMQ KV event stream's settings, bind safety and sockets, without vLLM (the
wire format against vLLM's own classes is tests/vllm/)."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvservice.client import AsyncKVClient, BlockStored, CacheSnapshot
from kvservice.core import kv_events as core_events
from kvservice.core.errors import InvalidArgumentError
from kvservice.server.app import KVCacheServer
from kvservice.server.settings import SettingsError, load_settings
from kvservice.server.tls import SecurityConfigError
from kvservice.server.zmq_events import wire
from kvservice.server.zmq_events.config import KVEventsConfig, parse_kv_events_config
from tests.server.support import SMALL_POOL, tokens
from tests.servers import THREAD_TIMEOUT_S, running_server

ON = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'


def pool(text: str = ON, **fields: Any) -> KVCacheServer:
    config = dataclasses.replace(SMALL_POOL, kv_events_config=parse_kv_events_config(text))
    return KVCacheServer(dataclasses.replace(config, **fields))


def test_every_settings_form(tmp_path: Path) -> None:
    """--kv-events-config (vLLM's JSON) from a flag, KVSERVICE_KV_EVENTS_CONFIG or the
    TOML key; the bind host and the hash form beside it. Off by default."""
    default = load_settings({}, {}).server
    assert default.kv_events_config == KVEventsConfig() and not default.records_kv_events
    assert (default.kv_events_bind_host, default.kv_events_int_block_hashes) == ("127.0.0.1", True)
    text = json.dumps({"enable_kv_cache_events": True, "hwm": 7, "topic": "kv"})
    config_file = tmp_path / "kvservice.toml"
    config_file.write_text(
        f"kv_events_config = '{text}'\n"
        'kv_events_bind_host = "0.0.0.0"\n'
        "kv_events_int_block_hashes = false\n"
    )
    env = {
        "KVSERVICE_KV_EVENTS_CONFIG": text,
        "KVSERVICE_KV_EVENTS_BIND_HOST": "0.0.0.0",
        "KVSERVICE_KV_EVENTS_INT_BLOCK_HASHES": "0",
    }
    flags = {
        "kv_events_config": text,
        "kv_events_bind_host": "0.0.0.0",
        "kv_events_int_block_hashes": False,
    }
    for server in (
        load_settings(flags, {}).server,
        load_settings({}, env).server,
        load_settings({}, {}, config_file).server,
    ):
        assert server.kv_events_config == KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", hwm=7, topic="kv"
        )
        assert server.records_kv_events and server.kv_events_config.publishes
        assert server.kv_events_bind_host == "0.0.0.0"
        assert server.kv_events_int_block_hashes is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"endpoints": "tcp://*:1"}', r"unknown keys \['endpoints'\]"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events: expected bool"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"hwm": 0}', "hwm must be at least 1"),
        ('{"buffer_steps": true}', "buffer_steps: expected int"),
        ('{"max_queue_size": 0}', "max_queue_size must be at least 1"),
        ('{"replay_endpoint": 5558}', "replay_endpoint: expected str"),
        ('{"endpoint": "udp://*:1"}', "must start with tcp://, ipc://, inproc://"),
        ('{"endpoint": "tcp://*"}', "tcp://HOST:PORT"),
        ('{"replay_endpoint": "tcp://*:99999"}', "tcp://HOST:PORT"),
    ],
)
def test_a_bad_config_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=f"kv_events_config: .*{message}"):
        load_settings({"kv_events_config": text}, {})


def test_what_each_config_turns_on() -> None:
    """Enabled with the null publisher: events recorded (SubscribeEvents), no ZMQ, as
    vLLM collects without publishing. zmq without enable: nothing, as vLLM."""
    recorded = pool('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert recorded.events is not None and recorded.kv_event_publisher is None
    assert recorded.table.manager.block_pool.enable_kv_cache_events
    off = pool('{"publisher": "zmq"}')
    assert off.events is None and off.kv_event_publisher is None
    both = pool(ON, kv_events=True)
    assert both.events is not None and both.kv_event_publisher is not None


@pytest.mark.parametrize(
    "fields",
    [
        {"endpoint": "tcp://*:5557"},  # with kv_events_bind_host 0.0.0.0 below
        {"endpoint": "tcp://[::]:5557"},
        {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://10.1.2.3:5558"},
    ],
    ids=str,
)
def test_binding_off_loopback_needs_consent(fields: dict[str, str]) -> None:
    """The stream has no TLS and no authentication and carries every tenant's hashes
    and token ids: a bind off loopback fails startup unless --allow-insecure-bind."""
    text = json.dumps({"enable_kv_cache_events": True, **fields})
    with pytest.raises(SecurityConfigError, match="allow-insecure-bind") as info:
        pool(text, kv_events_bind_host="0.0.0.0")
    assert "every tenant" in str(info.value)
    pool(text, kv_events_bind_host="0.0.0.0", allow_insecure_bind=True)


def test_loopback_binds_and_connects_need_nothing() -> None:
    """Loopback binds (the default bind host, ::1) and connections to a router, which
    the operator named, are allowed."""
    for fields in (
        {"endpoint": "tcp://*:5557"},
        {"endpoint": "tcp://[::1]:5557"},
        {"endpoint": "tcp://indexer.example:5557"},
    ):
        publisher = pool(json.dumps({"enable_kv_cache_events": True, **fields}))
        assert publisher.kv_event_publisher is not None


async def test_a_taken_port_fails_startup_by_name() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    server = pool(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}))
    with pytest.raises(InvalidArgumentError, match=f"cannot bind .*127.0.0.1:{port}"):
        await server.start()
    await server.stop(grace=0)
    taken.close()


async def test_ipc_endpoint_and_the_grpc_stream_side_by_side(tmp_path: Path) -> None:
    """An ipc:// endpoint is bound (a Unix socket: its file's permissions guard it);
    the same events also reach SubscribeEvents, from the one event log."""
    path = tmp_path / "kv-events.sock"
    config = dataclasses.replace(
        SMALL_POOL,
        kv_events_config=KVEventsConfig(True, "zmq", f"ipc://{path}"),
    )
    context = zmq.asyncio.Context()
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        assert server.kv_event_publisher is not None
        assert server.kv_event_publisher.endpoint == f"ipc://{path}" and path.exists()
        sub = context.socket(zmq.SUB)
        sub.connect(f"ipc://{path}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        items = client.subscribe_events()
        assert isinstance(await anext(items), CacheSnapshot)
        decoder = msgspec.msgpack.Decoder(wire.KVEventBatch)
        # The SUB socket may join after the first batches: send until one arrives.
        for i in range(1_000):
            await client.add_request(f"r{i}", tokens(16, start=100 * i))
            assert await client.allocate_slots(f"r{i}", 16)
            if await sub.poll(10):
                break
        _, sequence, payload = await sub.recv_multipart()
        (event,) = decoder.decode(payload).events
        assert isinstance(event, wire.BlockStored)
        # The gRPC stream's event of the same batch: the same block.
        for _ in range(int.from_bytes(sequence, "big") + 1):
            item = await anext(items)
        assert isinstance(item, BlockStored)
        assert int.from_bytes(item.block_hashes[0][-8:], "big") == event.block_hashes[0]
        await items.aclose()
        sub.close(linger=0)
    context.destroy(linger=0)


# A distinct value for every field the core's events have (block hashes in bytes).
SAMPLES: dict[str, Any] = {
    "block_hashes": [bytes(range(32)), bytes(range(1, 33))],
    "parent_block_hash": bytes(range(2, 34)),
    "token_ids": [1, 2, 3],
    "block_size": 3,
    "lora_id": 9,
    "medium": "GPU",
    "lora_name": "adapter",
    "extra_keys": [("adapter", "salt"), None],
    "group_idx": 2,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,
    "lookahead_token_ids": [[4], [5]],
}


@pytest.mark.parametrize("core_type", [core_events.BlockStored, core_events.BlockRemoved])
def test_every_field_the_core_fills_reaches_the_wire(core_type: type[Any]) -> None:
    """A field the core's events gain under vLLM's name must be carried: this fails
    until ``WireEncoder.event`` (and SAMPLES) name it."""
    names = [f.name for f in dataclasses.fields(core_type)]
    unknown = [n for n in names if n not in SAMPLES]
    assert not unknown, f"{core_type.__name__} gained {unknown}: carry them in WireEncoder"
    event = core_type(**{n: SAMPLES[n] for n in names})
    for int_hashes in (True, False):
        convert = wire.int_block_hash if int_hashes else bytes
        converted = wire.WireEncoder(int_hashes).event(event)
        assert type(converted).__name__ == core_type.__name__
        for name in names:
            expected = SAMPLES[name]
            if name == "block_hashes":
                expected = [convert(h) for h in expected]
            elif name == "parent_block_hash":
                expected = convert(expected)
            assert getattr(converted, name) == expected, name


async def test_stop_sends_the_last_batch_and_ends_the_thread() -> None:
    """The batch of the calls just before shutdown goes out, and the publishing thread
    is gone once stop returns."""
    context = zmq.asyncio.Context()
    server = pool(ON)
    await server.start()
    assert server.kv_event_publisher is not None
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(server.kv_event_publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    async with AsyncKVClient(server.handle.target) as client:
        # The SUB socket joins asynchronously: send until a batch arrives.
        for i in range(1_000):
            await client.add_request(f"r{i}", tokens(16, start=100 * i))
            assert await client.allocate_slots(f"r{i}", 16)
            if await sub.poll(10):
                break
        await client.add_request("last", tokens(32, start=99_999))
        assert await client.allocate_slots("last", 32)
    await server.stop(grace=0)
    assert not [t for t in threading.enumerate() if t.name == "kv-events-zmq"]
    decoder = msgspec.msgpack.Decoder(wire.KVEventBatch)
    while True:  # the batches before it, then the last one
        assert await sub.poll(THREAD_TIMEOUT_S * 1000), "the last batch never came"
        events = decoder.decode((await sub.recv_multipart())[2]).events
        stored = [e for e in events if isinstance(e, wire.BlockStored)]
        if stored and stored[-1].token_ids == tokens(32, start=99_999):
            break
    sub.close(linger=0)
    context.destroy(linger=0)

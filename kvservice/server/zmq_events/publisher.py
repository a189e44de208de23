"""vLLM's ZMQ KV event stream, fed by the server's event log.

What a subscriber sees is what vLLM 0.33.0's ``ZmqEventPublisher`` sends: on the PUB
endpoint, multipart messages ``(topic, sequence, payload)`` (the sequence an 8-byte
big-endian count of batches from 0, the payload one msgpack ``KVEventBatch``); on the
replay endpoint (a ROUTER), a request ``(b"", start)`` answered with
``(b"", topic, sequence, payload)`` for every buffered batch from ``start`` on, then
the end marker ``(b"", b"", -1 as 8 signed bytes, b"")``.

Two halves:

* On the event loop (``collect``, ``_flush``): the event log hands every run of events
  it numbers to ``collect``, in the log's order. The first event after a flush
  schedules the next flush with ``call_soon``, so a batch holds the events of one turn
  of the loop. No RPC awaits while it changes the pool, so one RPC's events (a whole
  Step) are never split; RPCs served in the same turn share a batch. The flush numbers
  and encodes the batch and hands it to the thread without waiting: when
  ``max_queue_size`` batches already wait, it is dropped (counted; subscribers see the
  gap in the sequence numbers).
* On the publishing thread (``_Sender``): it sends each batch on the PUB socket, keeps
  the last ``buffer_steps`` for replay and answers replay requests. ZMQ queues up to
  ``hwm`` batches per subscriber and drops the rest for that subscriber alone, as
  vLLM's does; the socket is an XPUB that refuses to drop (``XPUB_NODROP``) so that
  the first batch a subscriber would lose is noticed, counted and then sent lossily:
  every time a subscriber falls ``hwm`` batches behind is counted once.

Memory is bounded whatever the subscribers do: ``max_queue_size`` batches waiting for
the thread, ``buffer_steps`` kept for replay, ``hwm`` per subscriber (plus the
kernel's socket buffers) and ``2 * (buffer_steps + 1)`` per replay requester.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import structlog
import zmq

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_events import KVCacheEvent
from kvservice.server.tls import ALLOW_INSECURE_BIND_FLAG, SecurityConfigError, is_loopback
from kvservice.server.zmq_events.config import (
    Endpoint,
    KVEventsConfig,
    endpoint_is_bound,
    resolve,
)
from kvservice.server.zmq_events.wire import WireEncoder

log = structlog.get_logger("kvservice.server.zmq_events")

END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
_INBOX = "inproc://kv-events-inbox"
# Shutdown: how long the loop waits to hand the thread its stop, and how long ZMQ keeps
# trying to deliver what is still queued for subscribers.
_STOP_TIMEOUT_MS = 2_000
_LINGER_MS = 1_000


class Counter(Protocol):
    """A Prometheus counter child (thread safe)."""

    def inc(self, amount: float = 1) -> None: ...


class ZmqEventCounters(Protocol):
    """Where the publisher counts (``KVCacheMetrics``)."""

    @property
    def zmq_batches_published(self) -> Counter: ...

    @property
    def zmq_batches_dropped(self) -> Counter: ...

    @property
    def zmq_subscriber_overflows(self) -> Counter: ...


class ZmqEventPublisher:
    """Publishes the event log's events as vLLM does (see the module docstring).

    Built with the server (endpoints and the bind check: a bad config fails startup
    before anything binds); ``start`` on the loop binds and starts the thread,
    ``collect`` is the event log's listener, ``stop`` sends what is left and closes.
    ``endpoint`` and ``replay_endpoint`` are where it listens once started (a port 0
    resolved).
    """

    def __init__(
        self,
        config: KVEventsConfig,
        counters: ZmqEventCounters,
        *,
        bind_host: str = "127.0.0.1",
        allow_insecure_bind: bool = False,
        int_block_hashes: bool = True,
    ) -> None:
        self.config = config
        self._pub_endpoint = resolve(config.endpoint, endpoint_is_bound(config.endpoint), bind_host)
        self._replay = (
            resolve(config.replay_endpoint, True, bind_host)
            if config.replay_endpoint is not None
            else None
        )
        for endpoint in (self._pub_endpoint, self._replay):
            if endpoint is not None:
                _check_bind(endpoint, allow_insecure_bind)
        self._counters = counters
        self._encoder = WireEncoder(int_block_hashes)
        self._pending: list[KVCacheEvent] = []
        self._next_sequence = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._inbox: zmq.Socket[bytes] | None = None
        self._sender: _Sender | None = None
        self.endpoint = self._pub_endpoint.address
        self.replay_endpoint = self._replay.address if self._replay is not None else None

    @property
    def pending_events(self) -> int:
        """Events collected in this loop turn, not yet in a batch."""
        return len(self._pending)

    @property
    def last_sequence(self) -> int:
        """The sequence number of the last batch handed on (-1 before the first)."""
        return self._next_sequence - 1

    def start(self) -> None:
        """Bind (or connect) the sockets and start the thread; on the server's loop."""
        self._loop = asyncio.get_running_loop()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sender = _Sender(context, self.config, self._pub_endpoint, self._replay, self._counters)
        except BaseException:
            context.destroy(linger=0)
            raise
        inbox = context.socket(zmq.PUSH)
        # The hand-off pipe holds the sum of both ends' marks (the thread's end is 1).
        inbox.setsockopt(zmq.SNDHWM, self.config.max_queue_size)
        inbox.setsockopt(zmq.SNDTIMEO, _STOP_TIMEOUT_MS)
        inbox.connect(_INBOX)
        self._context, self._inbox, self._sender = context, inbox, sender
        self.endpoint = sender.endpoint
        self.replay_endpoint = sender.replay_endpoint
        sender.start()
        log.info(
            "publishing KV events on ZMQ",
            endpoint=self.endpoint,
            mode="bind" if self._pub_endpoint.bind else "connect",
            replay_endpoint=self.replay_endpoint,
            topic=self.config.topic,
        )

    def collect(self, events: Sequence[KVCacheEvent]) -> None:
        """Take the log's newly numbered events (on the loop; never waits)."""
        if self._inbox is None or not events:
            return
        if not self._pending:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._pending.extend(events)

    def _flush(self) -> None:
        """Cut, number, encode and hand on the batch of this loop turn."""
        events, self._pending = self._pending, []
        if self._inbox is None or not events:
            return
        payload = self._encoder.encode(events, time.time())
        sequence = self._next_sequence
        self._next_sequence += 1
        try:
            self._inbox.send_multipart((sequence.to_bytes(8, "big"), payload), zmq.DONTWAIT)
        except zmq.Again:
            self._counters.zmq_batches_dropped.inc()

    async def stop(self) -> None:
        """Hand on the last batch, let the thread send everything queued (ZMQ keeps
        trying for a second after), then close. Idempotent."""
        inbox, sender, context = self._inbox, self._sender, self._context
        if inbox is None or sender is None or context is None:
            return
        self._flush()
        self._inbox = self._sender = self._context = None
        try:
            inbox.send(b"")  # the stop, behind every batch already handed on
        except zmq.Again:
            log.warning("the KV event thread did not take its stop; closing anyway")
        # Open until the thread is done: closing drops what it has not read yet.
        await asyncio.to_thread(sender.join, _STOP_TIMEOUT_MS / 1000)
        inbox.close(linger=0)
        # Ends a thread still running (its poll fails), then waits for the PUB socket's
        # linger.
        await asyncio.to_thread(context.term)


def _check_bind(endpoint: Endpoint, allow_insecure_bind: bool) -> None:
    """Refuse to bind the stream off loopback unless told to: it has no TLS and no
    authentication, and carries every tenant's block hashes and token ids."""
    host = endpoint.tcp_host
    if not endpoint.bind or host is None or is_loopback(host):
        return
    if not allow_insecure_bind:
        raise SecurityConfigError(
            f"refusing to bind the ZMQ KV event stream on non-loopback address "
            f"{endpoint.address!r}: it has no TLS and no authentication, and carries every "
            f"tenant's block hashes and token ids. Bind it on loopback (kv_events_bind_host "
            f"127.0.0.1), or pass {ALLOW_INSECURE_BIND_FLAG} (KVSERVICE_ALLOW_INSECURE_BIND=1) "
            f"to accept the risk, e.g. behind a NetworkPolicy that admits only the router"
        )
    log.warning(
        "insecure bind",
        endpoint=endpoint.address,
        detail="anyone who can reach this address reads every tenant's KV events",
    )


class _Sender(threading.Thread):
    """The publishing thread: owns the PUB, replay and inbox sockets once started."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        config: KVEventsConfig,
        pub_endpoint: Endpoint,
        replay_endpoint: Endpoint | None,
        counters: ZmqEventCounters,
    ) -> None:
        super().__init__(name="kv-events-zmq", daemon=True)
        self._counters = counters
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._inbox = context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 1)
        self._inbox.bind(_INBOX)
        self._pub = context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.RCVHWM, config.hwm)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.setsockopt(zmq.LINGER, _LINGER_MS)
        self.endpoint = _attach(self._pub, pub_endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            # vLLM's: room for a whole replay and its end marker.
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _attach(self._replay, replay_endpoint)

    def run(self) -> None:
        poller = zmq.Poller()
        for socket in (self._inbox, self._pub, self._replay):
            if socket is not None:
                poller.register(socket, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                # Batches first: a replay asked for after a batch was handed on has it.
                if self._inbox in ready and not self._forward():
                    return
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._pub in ready:
                    # Subscriptions: ZMQ filters by topic itself; nothing to do.
                    self._pub.recv_multipart()
        except Exception:
            log.exception("the KV event thread stopped")
        finally:
            for socket in (self._inbox, self._pub, self._replay):
                if socket is not None:
                    socket.close()

    def _forward(self) -> bool:
        """Publish the batches waiting in the inbox; False at the stop."""
        while True:
            try:
                frames = self._inbox.recv_multipart(zmq.DONTWAIT)
            except zmq.Again:
                return True
            if len(frames) != 2:
                return False
            sequence, payload = frames
            self._publish(sequence, payload)
            self._buffer.append((int.from_bytes(sequence, "big"), payload))

    def _publish(self, sequence: bytes, payload: bytes) -> None:
        frames = (self._topic, sequence, payload)
        try:
            self._pub.send_multipart(frames, zmq.DONTWAIT)
            self._counters.zmq_batches_published.inc()
            return
        except zmq.Again:
            pass
        # A subscriber is hwm batches behind: count it, then send as vLLM's PUB does,
        # dropping for that subscriber alone (it stays dropped until it catches up).
        self._counters.zmq_subscriber_overflows.inc()
        self._pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            self._pub.send_multipart(frames, zmq.DONTWAIT)
        finally:
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._counters.zmq_batches_published.inc()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a malformed replay request", frames=len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for sequence, payload in self._buffer:
            if sequence >= start:
                self._replay.send_multipart(
                    (client, b"", self._topic, sequence.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQUENCE, b""))


def _attach(socket: zmq.Socket[bytes], endpoint: Endpoint) -> str:
    """Bind or connect ``socket``; the address it is at (a port 0 resolved)."""
    if endpoint.address.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    if not endpoint.bind:
        socket.connect(endpoint.address)
        return endpoint.address
    try:
        socket.bind(endpoint.address)
    except zmq.ZMQError as err:
        socket.close(linger=0)
        raise InvalidArgumentError(
            f"cannot bind the ZMQ KV event endpoint {endpoint.address!r}: {err}"
        ) from None
    bound: str = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound

"""A StepStream on a server's step socket (``kvservice serve --step-socket PATH``),
without gRPC. For an engine on the server's node; everything but the steps (sessions,
config, pins) still goes over the client's gRPC channel.

The framing is ``kvservice.protocol.step_socket``'s. ``SocketSession`` has the
blocking ``Session``'s methods: the calling thread writes each step and reads each
answer itself (no HTTP/2), or, with ``write_thread``, hands each step to a writing
thread of the session's own. The asyncio client's ``AsyncSession`` runs on a
``SocketCall``, which stands for grpc.aio's stream call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc

from kvservice.client.errors import (
    KVServiceError,
    ServiceUnavailableError,
    error_for,
    error_for_number,
    status_code,
)
from kvservice.client.step import (
    Handoff,
    PendingStep,
    StepBuilder,
    StepResults,
    StepSession,
)
from kvservice.protocol import step_socket as wire
from kvservice.protocol.gen import kv_cache_service_pb2 as pb


def _hello(metadata: tuple[tuple[str, str], ...]) -> bytes:
    hello = pb.StepSocketHello(
        metadata=[pb.StepSocketMetadata(key=k, value=v) for k, v in metadata]
    )
    return wire.frame(wire.HELLO, hello.SerializeToString())


def _unreachable(path: str, err: OSError) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        grpc.StatusCode.UNAVAILABLE,
        f"cannot connect to the step socket {path}: {err.strerror} (is the server "
        "started with --step-socket at that path, as this user?)",
    )


class _Writer:
    """A thread that writes the frames handed to it (``put``), in order, with
    ``write``."""

    def __init__(self, write: Callable[[bytes], None], name: str) -> None:
        self._write = write
        self._frames: Handoff[bytes | None] = Handoff()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        self._frames.put(data)

    def stop(self) -> None:
        """Write what was put, then end the thread."""
        self._frames.put(None, wait=False)
        self._thread.join()

    def _run(self) -> None:
        while (data := self._frames.get()) is not None:
            self._write(data)


class SocketSession(StepSession):
    """One StepStream on a step socket; see ``Session`` (the same methods). The
    metadata (token, session, client id) travels in the connection's hello.

    Not thread safe: one thread drives a session. ``timeout``: seconds any one read or
    write may wait (None: no limit) before the step fails DEADLINE_EXCEEDED.

    ``write_thread``: the steps are written by a thread of the session's own, for a
    caller that goes on working while the server runs its step (the vLLM link's
    ``KVSERVICE_CONFIRM=overlap``): written by the caller, a step to a server that had
    idled through a forward pass held the caller in the write, and the row
    ``socket overlap, hashes`` of ``python -m benchmarks.bench_vllm_scheduler
    --forward-ms 10`` fell below gRPC's overlap (with the thread it is level or above).
    A caller that waits for the answer at once has nothing to overlap the write with.
    ``close`` or ``cancel`` ends the thread.
    """

    def __init__(
        self,
        path: str,
        metadata: tuple[tuple[str, str], ...],
        timeout: float | None = None,
        *,
        write_thread: bool = False,
    ) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as err:
            self._sock.close()
            raise _unreachable(path, err) from None
        self._reader = self._sock.makefile("rb")
        self._step_ids = itertools.count(1)
        # Steps sent whose answers are not read yet, oldest first (answers come in order).
        self._unread: collections.deque[PendingStep] = collections.deque()
        # Whether the stream is over (its status read, or the connection lost), and
        # with which error (None: it ended OK).
        self._finished = False
        self._error: KVServiceError | None = None
        self._write(_hello(metadata))
        self._writer = (
            _Writer(self._write, f"kvservice-step-socket-{path}") if write_thread else None
        )

    def send(self, builder: StepBuilder, *, stop_on_error: bool = False) -> PendingStep:
        """Send one step without waiting for its results; ``result()`` waits for them.
        Steps run in the order sent."""
        message = builder.to_stream_pb(next(self._step_ids), stop_on_error)
        pending = PendingStep(self._read_through)
        self._unread.append(pending)
        if not self._finished:
            self._send(wire.frame(wire.MESSAGE, message.SerializeToString()))
        return pending

    def close(self) -> None:
        """Read the answers of the steps sent and not yet read (into their
        ``PendingStep``), half-close, and wait for the server to end the stream;
        raises the stream's error if it ended with one."""
        try:
            if self._unread:
                self._read_through(self._unread[-1])
            if not self._finished:
                self._send(wire.frame(wire.END))
            while not self._finished:
                if self._read_answer() is not None:
                    self._finish(error_for(grpc.StatusCode.INTERNAL, "an answer after the end"))
            if self._error is not None:
                raise self._error
        finally:
            self._shut()

    def cancel(self) -> None:
        """Drop the stream at once: the server sees a client that vanished."""
        self._shut()

    def _read_through(self, pending: PendingStep) -> None:
        """Read answers, oldest first, until ``pending``'s."""
        while not pending.done():
            oldest = self._unread.popleft()
            answer = self._read_answer()
            if answer is not None:
                oldest.resolve(StepResults(answer.step))
            else:
                oldest.resolve_error(self._error or self._gone("the stream ended"))

    def _read_answer(self) -> pb.StepStreamResponse | None:
        """The next answer; None once the stream is over (``_error`` says how)."""
        if self._finished:
            return None
        try:
            header = self._reader.read(wire.HEADER.size)
            if len(header) < wire.HEADER.size:
                self._finish(self._gone("the server closed the connection"))
                return None
            length, kind = wire.HEADER.unpack(header)
            payload = self._reader.read(length)
        except TimeoutError:
            self._finish(self._late())
            return None
        except OSError as err:
            self._finish(self._gone(err.strerror or str(err)))
            return None
        if len(payload) < length:
            self._finish(self._gone("the server closed the connection mid-answer"))
        elif kind == wire.MESSAGE:
            # Declared: the compiled build type-checks this module without protobuf's
            # stubs (pip's build environment), where FromString answers Any.
            answer: pb.StepStreamResponse = pb.StepStreamResponse.FromString(payload)
            return answer
        elif kind == wire.STATUS:
            status = pb.StepSocketStatus.FromString(payload)
            self._finish(error_for_number(status.code, status.details) if status.code else None)
        else:
            self._finish(error_for(grpc.StatusCode.INTERNAL, f"unknown frame kind {kind}"))
        return None

    def _send(self, data: bytes) -> None:
        if self._writer is not None:
            self._writer.put(data)
        else:
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self._finished:
            return  # a write timed out (a frame may be cut short), or the stream ended
        try:
            self._sock.sendall(data)
        except TimeoutError:
            self._finish(self._late())
        except OSError:
            # The server ended the stream (its status frame says why) or went away:
            # the next read finds out which.
            pass

    def _finish(self, error: KVServiceError | None) -> None:
        if not self._finished:
            self._finished, self._error = True, error

    def _gone(self, why: str) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            grpc.StatusCode.UNAVAILABLE, f"the step socket {self.path} closed: {why}"
        )

    def _late(self) -> KVServiceError:
        return error_for(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no progress on the step socket {self.path} within the client's timeout",
        )

    def _shut(self) -> None:
        if self._writer is not None:
            # A write blocked on a server that stopped reading fails at once.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._writer.stop()
        self._reader.close()
        self._sock.close()


class SocketCall:
    """A StepStream on a step socket with the methods of grpc.aio's stream call that
    ``AsyncSession`` uses: ``write``, ``read`` (``grpc.aio.EOF`` once the stream
    ended), ``done_writing``, ``code``, ``details``, ``cancel``. Open one with
    ``connect``."""

    def __init__(self, path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.path = path
        self._reader = reader
        self._writer = writer
        # The stream's end, once read: its status, or UNAVAILABLE for a lost connection.
        self._code: grpc.StatusCode | None = None
        self._details = ""

    @classmethod
    async def connect(cls, path: str, metadata: tuple[tuple[str, str], ...]) -> SocketCall:
        """Connect to the step socket at ``path`` and say hello with ``metadata``."""
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError as err:
            raise _unreachable(path, err) from None
        call = cls(path, reader, writer)
        await call._send(_hello(metadata))
        return call

    async def write(self, message: pb.StepStreamRequest) -> None:
        await self._send(wire.frame(wire.MESSAGE, message.SerializeToString()))

    async def done_writing(self) -> None:
        await self._send(wire.frame(wire.END))

    async def read(self) -> Any:
        """The next answer, or ``grpc.aio.EOF`` once the stream ended."""
        while self._code is None:
            try:
                header = await self._reader.readexactly(wire.HEADER.size)
                length, kind = wire.HEADER.unpack(header)
                payload = await self._reader.readexactly(length)
            except (asyncio.IncompleteReadError, OSError):
                self._end(grpc.StatusCode.UNAVAILABLE, f"the step socket {self.path} closed")
                break
            if kind == wire.MESSAGE:
                return pb.StepStreamResponse.FromString(payload)
            if kind == wire.STATUS:
                status = pb.StepSocketStatus.FromString(payload)
                self._end(status_code(status.code), status.details)
            else:
                self._end(grpc.StatusCode.INTERNAL, f"unknown frame kind {kind}")
        return grpc.aio.EOF

    async def code(self) -> grpc.StatusCode:
        """The stream's status code, once it ended (reading the rest of the stream)."""
        while self._code is None and await self.read() is not grpc.aio.EOF:
            pass
        assert self._code is not None
        return self._code

    async def details(self) -> str:
        await self.code()
        return self._details

    def cancel(self) -> None:
        """Drop the connection: the server sees a client that vanished."""
        self._end(grpc.StatusCode.CANCELLED, "cancelled by the client")

    async def _send(self, data: bytes) -> None:
        # A write to a stream the server ended fails; its status is still to be read.
        with contextlib.suppress(ConnectionError):
            self._writer.write(data)
            await self._writer.drain()

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        if self._code is None:
            self._code, self._details = code, details
            self._writer.close()

"""The step socket: StepStream on a Unix domain socket, without gRPC.

An engine on the same node as the server (the deployment the design card draws) sends
a StepStream's messages as length-prefixed frames (``kvservice.protocol.step_socket``)
instead of HTTP/2: ``bench_grpc`` measures gRPC's layers at about 0.5 ms of CPU per
256-operation step, most of a remote step's transport cost.

Only the transport differs. Each connection is one StepStream call, run through the
very interceptors and handler the gRPC server runs it through: the hello's metadata is
the call's metadata, so authentication and the tenant's rate limit (``auth``), the
session's resolution, renewal and fencing (``SessionLayer``), the StepStream limits,
the drain, the RPC metrics and lines, and errors as statuses (``RpcLayer``) all apply
as they do over gRPC. What the transport must do itself, it does as gRPC does:

* A connection closed without an end frame is a client that vanished: the stream is
  cancelled, so a session it streamed under ends at once and its requests are freed.
  An end frame is a half-close: the stream ends cleanly and the session lives on.
* An abort (a refusal, UNAUTHENTICATED, UNAVAILABLE while draining) is a status frame,
  then the server closes the connection; so is a clean end (status OK).
* A frame over ``max_message_bytes`` (gRPC's message limit) ends the stream
  RESOURCE_EXHAUSTED; a frame of the wrong kind, or no hello within
  ``HELLO_TIMEOUT_S``, INVALID_ARGUMENT.

Access: the socket file is created with mode 0600, so only the server's own user can
connect; with a tokens file the hello must carry a valid bearer token too. The socket
has no TLS, and no client certificates: a server that requires them
(``tls_client_ca_file``) refuses to start with a step socket (``app``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from kvservice.core.errors import InvalidArgumentError, KVCacheError
from kvservice.protocol import step_socket as wire
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.server import binding
from kvservice.server.binding import BindError
from kvservice.server.log import LineBudget, clip

log = structlog.get_logger("kvservice.step_socket")

_SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name
STEP_STREAM_METHOD = f"/{_SERVICE}/StepStream"
# How long a connection may take to say hello before it is refused.
HELLO_TIMEOUT_S = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class _CallDetails:
    """What grpc.aio hands an interceptor (``grpc.HandlerCallDetails``)."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class _Aborted(grpc.aio.AbortError):  # type: ignore[misc]  # grpc is untyped
    """``context.abort`` on the step socket: an ``AbortError`` (the layers let it pass
    as they let gRPC's own pass) that carries the status for the status frame."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """The part of grpc.aio's servicer context the layers use."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], peer: str) -> None:
        self._metadata = metadata
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        raise _Aborted(code, details)


class FrameTooLargeError(KVCacheError):
    """A frame over the server's message limit (gRPC refuses such a message
    RESOURCE_EXHAUSTED too)."""

    status = "RESOURCE_EXHAUSTED"


class _Frames:
    """Reads frames off one connection."""

    def __init__(self, reader: asyncio.StreamReader, max_bytes: int) -> None:
        self._reader = reader
        self._max_bytes = max_bytes

    async def read(self) -> tuple[int, bytes] | None:
        """The next frame's (kind, payload); None where the connection closed."""
        try:
            length, kind = wire.HEADER.unpack(await self._reader.readexactly(wire.HEADER.size))
            if length > self._max_bytes:
                raise FrameTooLargeError(
                    f"step socket frame of {length} bytes, over the server's limit of "
                    f"{self._max_bytes} (max_message_bytes): send smaller steps"
                )
            return kind, await self._reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None


class _Requests:
    """The stream's inbound messages: a step per ``MESSAGE`` frame, the end at an
    ``END`` frame. A connection that closes first cancels the stream, as gRPC does
    when its client vanishes."""

    def __init__(self, frames: _Frames, deserialize: Callable[[bytes], Any]) -> None:
        self._frames = frames
        self._deserialize = deserialize

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        read = await self._frames.read()
        if read is None:
            # Raised out of the task's coroutine, it cancels the task, as gRPC cancels
            # the call of a client that vanished: every layer sees a cancellation.
            raise asyncio.CancelledError("the client closed the step socket mid-stream")
        kind, payload = read
        if kind == wire.MESSAGE:
            return self._deserialize(payload)
        if kind == wire.END:
            raise StopAsyncIteration
        raise InvalidArgumentError(
            f"step socket: a {_kind_name(kind)} frame where a step or the end was expected"
        )


class StepSocket:
    """Serves StepStream on a Unix domain socket (see the module docstring).

    ``interceptors`` and ``handler``: the gRPC server's interceptors and the
    servicer's StepStream handler, composed for every connection as grpc.aio composes
    them for every call. ``on_connect`` is told of every connection accepted."""

    def __init__(
        self,
        path: str,
        interceptors: Sequence[Any],
        handler: Any,
        max_message_bytes: int,
        on_connect: Callable[[], None] = lambda: None,
    ) -> None:
        self.path = path
        self._on_connect = on_connect
        self._interceptors = tuple(interceptors)
        self._handler = handler
        self._max_bytes = max_message_bytes
        self._server: asyncio.Server | None = None
        self._streams: set[asyncio.Task[None]] = set()
        self._lines = LineBudget()

    async def start(self) -> None:
        """Listen on ``path`` (mode 0600), replacing a socket file a previous server
        left; anything else there is a ``BindError``."""
        binding.remove_stale_socket(self.path, "--step-socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The mode is the file's from its creation on: no moment when others could
        # connect. (The umask is the process's; nothing else here creates files now.)
        umask = os.umask(0o177)
        try:
            sock.bind(self.path)
        except OSError as err:
            sock.close()
            raise BindError(f"--step-socket {self.path}: cannot listen: {err.strerror}") from None
        finally:
            os.umask(umask)
        self._server = await asyncio.start_unix_server(self._connected, sock=sock)

    async def stop(self) -> None:
        """Stop listening and cancel the streams still open (the server's drain has
        let them finish first), then remove the socket file."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._streams):
            task.cancel()
        if self._streams:
            await asyncio.wait(list(self._streams))
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of its own, tracked, so that stop can cancel what is left; its
        # cancellation (a vanished client, or stop) ends here.
        self._on_connect()
        task = asyncio.create_task(self._serve(reader, writer))
        self._streams.add(task)
        try:
            await asyncio.wait((task,))
        finally:
            self._streams.discard(task)
            writer.close()
        if not task.cancelled() and task.exception() is not None:
            log.error("step socket connection failed", exc_info=task.exception())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = _Frames(reader, self._max_bytes)
        peer = _peer(writer, self.path)
        try:
            metadata = await asyncio.wait_for(_hello(frames), HELLO_TIMEOUT_S)
        except TimeoutError:
            error: KVCacheError = InvalidArgumentError(
                f"step socket: no hello within {HELLO_TIMEOUT_S} s of connecting"
            )
            await self._refuse(writer, error, peer)
            return
        except KVCacheError as err:
            await self._refuse(writer, err, peer)
            return
        if metadata is None:
            return  # closed before its hello: nothing started
        handler = await self._compose(_CallDetails(STEP_STREAM_METHOD, metadata))
        requests = _Requests(frames, handler.request_deserializer)
        responses = handler.stream_stream(requests, _Context(metadata, peer))
        serialize = handler.response_serializer
        try:
            if inspect.isawaitable(responses):
                # A handler that only aborts (authentication's refusals) is a coroutine,
                # which grpc.aio accepts for a stream too.
                await responses
            else:
                async for response in responses:
                    writer.write(wire.frame(wire.MESSAGE, serialize(response)))
                    await writer.drain()
        except _Aborted as aborted:
            await _send_status(writer, aborted.code, aborted.details)
            return
        except ConnectionError:
            # The client went away while an answer was on its way: as cancelled.
            await responses.aclose()
            return
        await _send_status(writer, grpc.StatusCode.OK, "")

    async def _compose(self, details: _CallDetails) -> Any:
        """The handler the interceptors make of the servicer's for this call: each is
        awaited in this task, as grpc.aio awaits them (authentication sets the
        caller's tenant in the task's context)."""

        async def at(index: int, call: Any) -> Any:
            if index == len(self._interceptors):
                return self._handler
            continuation: Callable[[Any], Awaitable[Any]] = lambda c: at(index + 1, c)  # noqa: E731
            return await self._interceptors[index].intercept_service(continuation, call)

        return await at(0, details)

    async def _refuse(self, writer: asyncio.StreamWriter, error: KVCacheError, peer: str) -> None:
        """A connection refused before its stream started (no layer saw it)."""
        code = grpc.StatusCode[error.status]
        self._lines.info(
            log,
            "step socket refused",
            code.name,
            status=code.name,
            error=clip(str(error)),
            peer=clip(peer),
        )
        await _send_status(writer, code, str(error))


async def _hello(frames: _Frames) -> tuple[tuple[str, str], ...] | None:
    """The metadata of the connection's hello; None where it closed first."""
    read = await frames.read()
    if read is None:
        return None
    kind, payload = read
    if kind != wire.HELLO:
        raise InvalidArgumentError(
            f"step socket: a {_kind_name(kind)} frame where the hello was expected"
        )
    try:
        hello = pb.StepSocketHello.FromString(payload)
    except DecodeError as err:
        raise InvalidArgumentError(f"step socket: malformed hello: {err}") from None
    return tuple((entry.key, entry.value) for entry in hello.metadata)


async def _send_status(writer: asyncio.StreamWriter, code: grpc.StatusCode, details: str) -> None:
    status = pb.StepSocketStatus(code=code.value[0], details=details)
    with contextlib.suppress(ConnectionError):
        writer.write(wire.frame(wire.STATUS, status.SerializeToString()))
        await writer.drain()


def _kind_name(kind: int) -> str:
    return wire.KIND_NAMES.get(kind, f"kind {kind}")


def _peer(writer: asyncio.StreamWriter, path: str) -> str:
    """``unix:PATH`` and the connecting process (pid, uid) for the logs."""
    sock = writer.get_extra_info("socket")
    try:
        pid, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except (AttributeError, OSError):
        return f"unix:{path}"
    return f"unix:{path} pid={pid} uid={uid}"

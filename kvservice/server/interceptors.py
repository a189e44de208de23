"""The RPC boundary: logging, RPC metrics, client tracking, and errors as statuses.

Every KVCacheService call goes through here, so no servicer method needs its own
error handling: a ``KVCacheError`` (a caller mistake) becomes the status it names, and
any other exception is a bug, logged with its traceback and answered INTERNAL. Health
and reflection pass through untouched.

Each call binds, for every line it logs: ``method`` (the short RPC name, also the
metrics label), ``request_id`` (the KV request the message names, ``-`` for calls
that name none, such as Step), ``client_id`` (the ``x-client-id`` metadata, ``-`` when
absent) and ``call_id`` (the ``x-request-id`` metadata, else a generated one).

The lines a client's calls cause at info level (a refusal, a stream opened or closed)
go through a ``LineBudget``: a bounded number per kind and interval, then one line
saying how many more there were; the metrics count every call.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf.message import DecodeError

from kvservice.core.errors import InvalidArgumentError, KVCacheError
from kvservice.protocol import CALL_ID_KEY, CLIENT_ID_KEY
from kvservice.server.drain import SHUTTING_DOWN, Drain
from kvservice.server.errors import forget_frames, status_code_of, status_message_of
from kvservice.server.log import LineBudget, clip
from kvservice.server.metrics import ClientTracker, KVCacheMetrics, RpcInstruments

log = structlog.get_logger("kvservice.rpc")

UnaryBehavior = Callable[[Any, Any], Awaitable[Any]]
StreamBehavior = Callable[[Any, Any], AsyncIterator[Any]]


class BoundaryInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """The one grpc interceptor of a service: composes its layers (outermost first)
    around each method's handler once, then hands grpc the composed handler on every
    call without asking grpc to look the method up again. Other services (health,
    reflection) pass untouched.

    One interceptor, not one per layer: grpc.aio awaits every interceptor's
    ``intercept_service`` on every call, a cost paid per layer."""

    def __init__(self, service_name: str, layers: Sequence[Layer]) -> None:
        self._prefix = f"/{service_name}/"
        self._layers = tuple(reversed(layers))  # innermost first, as they wrap
        self._composed: dict[str, Any] = {}

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        path: str = handler_call_details.method
        composed = self._composed.get(path)
        if composed is not None:
            return composed
        handler = await continuation(handler_call_details)
        if handler is None or not path.startswith(self._prefix):
            return handler
        method = path.removeprefix(self._prefix)
        for layer in self._layers:
            handler = layer.wrap(handler, method)
        self._composed[path] = handler
        return handler


class Layer(Protocol):
    """One concern of the RPC boundary, as a handler wrapper built once per method."""

    def wrap(self, handler: Any, method: str) -> Any:
        """``handler`` with this layer around it (or unchanged where it does not apply)."""
        ...


class RpcLayer:
    """Logging, RPC metrics, client tracking, draining, and errors as statuses: the
    outermost layer, so it answers for the refusals of the layers inside it."""

    def __init__(
        self,
        metrics: KVCacheMetrics,
        clients: ClientTracker,
        drain: Drain,
    ) -> None:
        self._metrics = metrics
        self._clients = clients
        self._drain = drain
        # Refusals and stream churn are counted in the metrics (RPC duration and
        # in-flight series, ``kvservice_refusals_total``); their lines are kept to a
        # budget, so a client cannot make the server write a line per call.
        self._lines = LineBudget()

    def wrap(self, handler: Any, method: str) -> Any:
        instruments = self._metrics.rpc(method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_call(
                    handler.unary_unary,
                    method,
                    instruments,
                    self._clients,
                    self._drain,
                    _debug_enabled(),
                    self._lines,
                ),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _stream_call(
                    handler.stream_stream,
                    method,
                    instruments,
                    self._clients,
                    self._drain,
                    self._lines,
                ),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _refusing_malformed(handler.unary_stream),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


class MalformedMessage:
    """What a request's bytes became when they did not parse. grpc answers a
    deserializer's exception with UNKNOWN (INTERNAL on a stream), which blames the
    server; the wrappers below turn this into INVALID_ARGUMENT instead."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

    def refusal(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"malformed request message: {self.error}")


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as err:
            return MalformedMessage(str(err))

    return deserialize


def _refusing_malformed(behavior: StreamBehavior) -> StreamBehavior:
    """A server-streaming handler (SubscribeEvents, which answers its own errors)
    that ends INVALID_ARGUMENT for request bytes that did not parse."""

    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        if type(request) is MalformedMessage:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.refusal()))
        async for response in behavior(request, context):
            yield response

    return stream


def _identity(context: Any) -> tuple[str | None, str]:
    """(client id or None, call id) from the call's metadata."""
    client_id = call_id = None
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_KEY:
            client_id = clip(value)  # also what the client tracker keeps
        elif key == CALL_ID_KEY:
            call_id = value
    return client_id, call_id or uuid.uuid4().hex


def _fields(method: str, request_id: str, client_id: str | None, call_id: str) -> dict[str, str]:
    # Every value but the method name comes from the caller: cut.
    return {
        "method": method,
        "request_id": clip(request_id) if request_id else "-",
        "client_id": client_id or "-",
        "call_id": clip(call_id),
    }


def _bind(method: str, request_id: str, client_id: str | None, call_id: str) -> Any:
    fields = _fields(method, request_id, client_id, call_id)
    # Bound for whatever the handler logs; each RPC runs in a fresh context.
    structlog.contextvars.bind_contextvars(**fields)
    return log.bind(**fields)


def _debug_enabled() -> bool:
    """Whether the configured logger writes debug lines. Read once per method (when
    its handler is first wrapped): the level is set once, at startup."""
    is_enabled_for = getattr(log.bind(), "is_enabled_for", None)
    return True if is_enabled_for is None else bool(is_enabled_for(logging.DEBUG))


def _unary_call(
    behavior: UnaryBehavior,
    method: str,
    instruments: RpcInstruments,
    clients: ClientTracker,
    drain: Drain,
    log_ok: bool,
    lines: LineBudget,
) -> UnaryBehavior:
    # OK calls are the hot path: their one line is at debug, so info stays readable
    # under load, and below debug they bind no logger and format nothing; refusals and
    # failures log with the same fields. ``log_ok``: whether debug is enabled.
    observe = instruments.duration.observe
    in_flight = instruments.in_flight
    seen = clients.seen
    bind_contextvars = structlog.contextvars.bind_contextvars
    perf_counter = time.perf_counter

    # A closure, not a callable object: grpc.aio tells coroutine handlers apart with
    # inspect.iscoroutinefunction.
    async def call(request: Any, context: Any) -> Any:
        if drain.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        client_id, call_id = _identity(context)
        fields = _fields(method, getattr(request, "request_id", ""), client_id, call_id)
        # Bound for whatever the handler logs; each RPC runs in a fresh context.
        bind_contextvars(**fields)
        in_flight.inc()
        drain.enter()
        start = perf_counter()
        try:
            if type(request) is MalformedMessage:
                raise request.refusal()
            response = await behavior(request, context)
        except KVCacheError as err:
            code = status_code_of(err)
            lines.info(
                log,
                "rpc refused",
                code.name,
                **fields,
                status=code.name,
                error=clip(str(err)),
                ms=_ms(start),
            )
            forget_frames(err)
            # The abort's own traceback keeps this frame: not the refused message.
            request = None
            await context.abort(code, status_message_of(err))
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise  # an abort's status stands; a cancelled call has nobody to answer
        except Exception:
            log.exception("rpc failed", **fields, status="INTERNAL", ms=_ms(start))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")
        finally:
            observe(perf_counter() - start)
            in_flight.dec()
            drain.exit()
            seen(client_id)
        if log_ok:
            log.debug("rpc", **fields, status="OK", ms=_ms(start))
        return response

    return call


class _TimedRequests:
    """The request stream of a bidi call, remembering when the last message arrived,
    so each answer can be timed from its request."""

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = requests
        self.last_arrival = time.perf_counter()
        self.count = 0

    def __aiter__(self) -> _TimedRequests:
        return self

    async def __anext__(self) -> Any:
        message = await self._requests.__anext__()
        if type(message) is MalformedMessage:
            # Raised through the handler's loop: the stream ends INVALID_ARGUMENT.
            raise message.refusal()
        self.last_arrival = time.perf_counter()
        self.count += 1
        return message


def _stream_call(
    behavior: StreamBehavior,
    method: str,
    instruments: RpcInstruments,
    clients: ClientTracker,
    drain: Drain,
    lines: LineBudget,
) -> StreamBehavior:
    async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
        if drain.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        client_id, call_id = _identity(context)
        line = _bind(method, "", client_id, call_id)
        timed = _TimedRequests(requests)
        instruments.in_flight.inc()
        drain.enter()
        clients.open_stream(client_id)
        lines.info(line, "stream opened")
        status = "OK"
        try:
            async for response in behavior(timed, context):
                instruments.duration.observe(time.perf_counter() - timed.last_arrival)
                yield response
        except KVCacheError as err:
            code = status_code_of(err)
            status = code.name
            lines.info(line, "stream refused", status, status=status, error=clip(str(err)))
            forget_frames(err)
            await context.abort(code, status_message_of(err))
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except grpc.aio.AbortError:
            status = "ABORTED_BY_HANDLER"
            raise
        except Exception:
            status = "INTERNAL"
            line.exception("stream failed", status=status)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")
        finally:
            instruments.in_flight.dec()
            drain.exit()
            clients.close_stream(client_id)
            lines.info(line, "stream closed", status, status=status, num_messages=timed.count)

    return stream


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)

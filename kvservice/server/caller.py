"""Who is calling: the identity the RPC boundary established for the current call.

The interceptor layers fill it in, each call in its own context (grpc.aio runs every
call in its own task, so a context variable is per call for free): authentication
(``auth``) the ``tenant``, sessions (``sessions``) the ``session_id`` and ``epoch``.
The innermost layer, ``CallerLayer``, reads it once and hands it to the servicer as
an argument: below the interceptors the caller is a value passed along (servicer,
operations, request table), never ambient state. Without authentication every caller
is the default tenant ``""``, and without a session every request is unowned: the
server then behaves exactly as a single-tenant, sessionless one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc

from kvservice.request_table.tenancy import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated tenant and, when the client opened one, its session.
    ``admin``: whether it may see and act on the whole pool (any caller of a server
    without a tokens file, where there is one tenant; an admin tenant otherwise)."""

    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    epoch: int | None = None
    admin: bool = True


# Frozen, so one shared default is safe.
ANONYMOUS = Caller()
CURRENT_CALLER: ContextVar[Caller] = ContextVar("kvservice_caller", default=ANONYMOUS)


def current_caller() -> Caller:
    """The caller of the RPC running in this task (the default caller outside one)."""
    return CURRENT_CALLER.get()


class CallerLayer:
    """The innermost layer of the RPC boundary: calls the servicer's method with the
    call's ``Caller`` as its third argument (``KVCacheServicer`` methods take
    ``(request, context, caller)``)."""

    def wrap(self, handler: Any, method: str) -> Any:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        raise TypeError(f"{method}: a client-streaming RPC has no caller-passing handler")


def _unary(method: Any) -> Any:
    # A closure, not a callable object: grpc.aio tells coroutine handlers apart with
    # inspect.iscoroutinefunction.
    async def call(request: Any, context: Any) -> Any:
        return await method(request, context, CURRENT_CALLER.get())

    return call


def _streaming(method: Any) -> Any:
    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        async for response in method(request, context, CURRENT_CALLER.get()):
            yield response

    return stream

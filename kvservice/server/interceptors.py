"""The RPC boundary: one log line per call, and errors turned into gRPC statuses.

Every unary RPC goes through here, so no servicer method needs its own error
handling: a ``KVCacheError`` (a caller mistake) becomes the status it names, and any
other exception is a bug, logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

from kvservice.core.errors import KVCacheError
from kvservice.server.errors import status_code_of

log = structlog.get_logger("kvservice.rpc")

Behavior = Callable[[Any, Any], Awaitable[Any]]


class RpcInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Wraps each unary-unary handler; streams (reflection, health Watch) pass through."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            _wrap(handler.unary_unary, handler_call_details.method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _wrap(behavior: Behavior, method: str) -> Behavior:
    async def call(request: Any, context: Any) -> Any:
        request_id = getattr(request, "request_id", None)
        # Bound for whatever the handler logs; each RPC runs in a fresh context.
        structlog.contextvars.bind_contextvars(rpc=method, request_id=request_id)
        line = log.bind(rpc=method, request_id=request_id)
        start = time.perf_counter()
        try:
            response = await behavior(request, context)
        except KVCacheError as err:
            code = status_code_of(err)
            line.info("rpc refused", status=code.name, error=str(err), ms=_ms(start))
            await context.abort(code, str(err))
        except grpc.aio.AbortError:
            raise  # the handler aborted on purpose; its status stands
        except Exception:
            line.exception("rpc failed", status="INTERNAL", ms=_ms(start))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")
        # OK calls are the hot path: logged at debug so info stays readable under load.
        line.debug("rpc", status="OK", ms=_ms(start))
        return response

    return call


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)

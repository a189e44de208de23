"""Idempotent retries: a mutating call sent again with the same operation id is
answered from memory and changes nothing.

A client that did not hear back (a timeout, a dropped connection) cannot tell whether
its call took effect; sending it again must not allocate twice. Mutating calls may carry
``x-kvservice-operation-id`` metadata; ``IdempotencyLayer`` remembers, per caller
scope (tenant and session), each id's method, a digest of the request and the outcome:
the serialized response, or the refusal's status and message (a refused call retried is
refused the same way; it changed nothing the first time either). A retry with the same
id and the same request gets that outcome back without running; the same id with
another request or method is refused INVALID_ARGUMENT, naming the id.

The memory is one LRU of ``capacity`` outcomes (``idempotency_cache_size``) within
``MAX_CACHED_BYTES`` of answers: an id evicted from it runs again if retried, so a
client should retry within the time it takes the server to see that many other
operations. Unexpected failures (INTERNAL) are not remembered: they are bugs, not
answers. Calls run without awaiting (see ``servicer``), so no two calls with the same
id can interleave between the lookup and the record.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from kvservice.core.errors import InvalidArgumentError, KVCacheError
from kvservice.protocol import MUTATING_UNARY_METHODS, OPERATION_ID_KEY
from kvservice.server.caller import current_caller
from kvservice.server.metrics import KVCacheMetrics
from kvservice.server.sessions import metadata_value

MAX_OPERATION_ID_LENGTH = 128
# Remembered answers, in bytes, across all scopes.
MAX_CACHED_BYTES = 64 * 1024 * 1024

UnaryBehavior = Callable[[Any, Any], Awaitable[Any]]
# (tenant, session id or "", operation id)
ScopedId = tuple[str, str, str]


class ReplayedRefusalError(KVCacheError):
    """A remembered refusal, raised again for its retry with the same status."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one operation id answered: a response, or a refusal."""

    method: str
    digest: bytes
    response_type: type[Message] | None = None
    response: bytes = b""
    status: str = ""
    message: str = ""

    @property
    def size(self) -> int:
        """Bytes it holds, roughly (what the memory budget counts)."""
        return len(self.response) + len(self.message) + len(self.digest)

    def replay(self) -> Message:
        """The answer again: the same response, or the same refusal raised."""
        if self.response_type is None:
            raise ReplayedRefusalError(self.status, self.message)
        return self.response_type.FromString(self.response)


class OperationCache:
    """The last ``capacity`` outcomes, least recently used evicted first, within
    ``max_bytes`` of remembered answers (a Step's answer may be large)."""

    def __init__(self, capacity: int, max_bytes: int = MAX_CACHED_BYTES) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"idempotency_cache_size must be >= 1, got {capacity}")
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._bytes = 0
        self._outcomes: OrderedDict[ScopedId, Outcome] = OrderedDict()

    def __len__(self) -> int:
        return len(self._outcomes)

    def get(self, key: ScopedId) -> Outcome | None:
        outcome = self._outcomes.get(key)
        if outcome is not None:
            self._outcomes.move_to_end(key)
        return outcome

    def put(self, key: ScopedId, outcome: Outcome) -> None:
        replaced = self._outcomes.pop(key, None)
        if replaced is not None:
            self._bytes -= replaced.size
        self._outcomes[key] = outcome
        self._bytes += outcome.size
        # The newest outcome is kept even alone over the budget: its retry is the
        # likeliest.
        while len(self._outcomes) > 1 and (
            len(self._outcomes) > self._capacity or self._bytes > self._max_bytes
        ):
            _, evicted = self._outcomes.popitem(last=False)
            self._bytes -= evicted.size


def request_digest(request: Message) -> bytes:
    """A digest of the request's content (deterministic serialization, so equal
    messages digest equally however their maps were built)."""
    return hashlib.blake2b(request.SerializeToString(deterministic=True), digest_size=16).digest()


def check_operation_id(operation_id: str) -> None:
    if not operation_id or len(operation_id) > MAX_OPERATION_ID_LENGTH:
        raise InvalidArgumentError(
            f"{OPERATION_ID_KEY} must be 1 to {MAX_OPERATION_ID_LENGTH} characters, got "
            f"{len(operation_id)}: {operation_id[:MAX_OPERATION_ID_LENGTH]!r}"
        )


class IdempotencyLayer:
    """Answers retried mutating calls from the ``OperationCache``. Inside
    ``SessionLayer`` (ids are scoped by the session it resolves) and ``RpcLayer``
    (which turns the refusals raised here into statuses)."""

    def __init__(self, cache: OperationCache, metrics: KVCacheMetrics | None = None) -> None:
        self._cache = cache
        self._metrics = metrics

    def wrap(self, handler: Any, method: str) -> Any:
        if handler.unary_unary is None or method not in MUTATING_UNARY_METHODS:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        async def call(request: Any, context: Any) -> Any:
            operation_id = metadata_value(context, OPERATION_ID_KEY)
            if operation_id is None:
                return await behavior(request, context)
            check_operation_id(operation_id)
            caller = current_caller()
            key = (caller.tenant, caller.session_id or "", operation_id)
            digest = request_digest(request)
            found = self._cache.get(key)
            if found is not None:
                return self._replay(found, method, digest, operation_id)
            try:
                response = await behavior(request, context)
            except KVCacheError as err:
                self._cache.put(key, Outcome(method, digest, status=err.status, message=str(err)))
                raise
            self._cache.put(
                key, Outcome(method, digest, type(response), response.SerializeToString())
            )
            return response

        return call

    def _replay(self, found: Outcome, method: str, digest: bytes, operation_id: str) -> Message:
        if found.method != method or found.digest != digest:
            what = "request" if found.method == method else f"method ({found.method})"
            raise InvalidArgumentError(
                f"{OPERATION_ID_KEY} {operation_id!r} was already used for a different "
                f"{what}; a retry must resend the same call, a new call needs a new id"
            )
        if self._metrics is not None:
            self._metrics.idempotent_replays.inc()
        return found.replay()

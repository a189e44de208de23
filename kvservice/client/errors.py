"""Typed errors: one class per status the service uses, each carrying the status.

A unary call raises them; a step operation's error is one of them too (returned by
``StepResults.error`` or raised when the result is read).
"""

from __future__ import annotations

import grpc


class KVServiceError(Exception):
    """A call or operation the server refused (or a transport failure)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class RequestNotFoundError(KVServiceError):
    """NOT_FOUND: the request id is unknown (never added, or finished)."""


class RequestExistsError(KVServiceError):
    """ALREADY_EXISTS: ``add_request`` for an id the server knows."""


class InvalidArgumentError(KVServiceError):
    """INVALID_ARGUMENT: malformed whatever the state (negative counts, no tokens)."""


class OutOfRangeError(KVServiceError):
    """OUT_OF_RANGE: past ``max_model_len``."""


class FailedPreconditionError(KVServiceError):
    """FAILED_PRECONDITION: the request is in the wrong state for the call."""


class StaleHitError(KVServiceError):
    """ABORTED: the prefix hit was evicted since the lookup; look it up again."""


class NotRunError(KVServiceError):
    """CANCELLED: a step operation skipped under ``stop_on_error``, or a call the
    client cancelled."""


class ServiceUnavailableError(KVServiceError):
    """UNAVAILABLE: the server is unreachable or shutting down; retry with backoff."""


class ResourceExhaustedError(KVServiceError):
    """RESOURCE_EXHAUSTED: a limit of the server or of the caller's tenant is reached
    (requests held, waiting tokens, block quota, rate limit); the message names it.
    Nothing changed: finish or admit requests, or retry later."""


class SubscriberDroppedError(ResourceExhaustedError):
    """RESOURCE_EXHAUSTED on SubscribeEvents: the subscriber fell too far behind and
    was dropped; resubscribe from the last sequence received."""


class PermissionDeniedError(KVServiceError):
    """PERMISSION_DENIED: the caller's tenant may not make this call (an admin-only,
    pool-wide one)."""


class UnauthenticatedError(KVServiceError):
    """UNAUTHENTICATED: no bearer token, or one the server does not know."""


class InsecureTokenError(ValueError):
    """A client given a bearer token but no TLS, without ``allow_insecure_token``:
    the token would cross the network readable by anyone on the path."""


_BY_CODE: dict[grpc.StatusCode, type[KVServiceError]] = {
    grpc.StatusCode.NOT_FOUND: RequestNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: RequestExistsError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: StaleHitError,
    grpc.StatusCode.CANCELLED: NotRunError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}
_CODES_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_for(code: grpc.StatusCode, message: str) -> KVServiceError:
    """The typed error for ``code``."""
    return _BY_CODE.get(code, KVServiceError)(code, message)


def status_code(number: int) -> grpc.StatusCode:
    """The status code of a number (as a step result or a step socket status carries
    it); UNKNOWN for a number gRPC does not define."""
    return _CODES_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_for_number(number: int, message: str) -> KVServiceError:
    """The typed error for a status code number (as a step result carries it)."""
    return error_for(status_code(number), message)


# What gRPC says when client and server disagree about TLS, and what to do about it.
_TRANSPORT_HINTS = (
    (
        "Socket closed",
        "if the server serves TLS, so must the client: pass root_certificates=<the "
        "server's CA, PEM>, or tls=True for the system's roots",
    ),
    (
        "WRONG_VERSION_NUMBER",
        "the server does not seem to serve TLS: drop tls and root_certificates",
    ),
)


def error_from_rpc(err: grpc.RpcError, *, subscription: bool = False) -> KVServiceError:
    """The typed error for a failed call (sync or aio); on an event ``subscription``
    RESOURCE_EXHAUSTED means the subscriber was dropped. An UNAVAILABLE that looks
    like a TLS mismatch says how to fix it."""
    code, message = err.code(), err.details() or ""
    if subscription and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return SubscriberDroppedError(code, message)
    if code == grpc.StatusCode.UNAVAILABLE:
        hints = [hint for symptom, hint in _TRANSPORT_HINTS if symptom in message]
        if hints:
            message = f"{message} ({'; '.join(hints)})"
    return error_for(code, message)


class RemoteStepError(RuntimeError):
    """A remote step's link (``step_link.StepLink``) stopped: the server could not be
    reached, refused a step, or answered otherwise than the scheduler's replica. The
    two no longer agree, so the scheduler must stop. (Here, not in ``step_link``:
    mypyc compiles that module, and its classes could not be subclassed.)"""

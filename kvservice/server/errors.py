"""The one place where an error becomes a gRPC status, and the server's own startup
error.

Every caller mistake, from the core or the request table, is a ``KVCacheError`` that
names its status; this module maps the name to grpc's code.
"""

from __future__ import annotations

import traceback

import grpc

from kvservice.core.errors import KVCacheError


def status_code_of(error: KVCacheError) -> grpc.StatusCode:
    """The gRPC code named by ``error.status``; INTERNAL for a name gRPC lacks (a bug
    in the error class, not the caller's fault)."""
    code: grpc.StatusCode = grpc.StatusCode.__members__.get(error.status, grpc.StatusCode.INTERNAL)
    return code


# grpc sends a status message percent-encoded in a trailer, and clients refuse
# trailers over 8 KiB (answering RESOURCE_EXHAUSTED instead of the real status): a
# message echoing a huge field (a 2,000-character request id) is cut to this many
# characters, at most 12 bytes each once encoded.
MAX_STATUS_MESSAGE_CHARS = 512


def status_message_of(error: KVCacheError) -> str:
    """The error's message as a status (or step result) carries it: cut to
    ``MAX_STATUS_MESSAGE_CHARS``, saying how long it was."""
    message = str(error)
    if len(message) <= MAX_STATUS_MESSAGE_CHARS:
        return message
    suffix = f"... (cut from {len(message)} characters)"
    return message[: MAX_STATUS_MESSAGE_CHARS - len(suffix)] + suffix


def forget_frames(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and the errors it chains: a refusal is answered
    as a status, and a traceback would keep every frame it passed through alive, with
    their locals (the request, a megabyte of multimodal items), in a reference cycle
    that only a full collection frees (``benchmarks/bench_hostile_resources``: refused
    multimodal calls grew the server by megabytes each)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]


class PermissionDeniedError(KVCacheError):
    """A pool-wide request from a tenant that is not an admin."""

    status = "PERMISSION_DENIED"


class RuntimeUnavailableError(KVCacheError):
    """``--runtime torch`` cannot run here: PyTorch missing, the device absent, or too
    little memory for the KV tensors. Raised at startup only (``kvservice serve`` exits
    with code 2), never by an RPC."""

    status = "FAILED_PRECONDITION"


class OffloadTierStoppedError(KVCacheError):
    """An OffloadStep operation the server's offload index refused or answered otherwise
    than the engine's replica: the two no longer agree, and the index stops
    (``offload_tiers``)."""

    status = "FAILED_PRECONDITION"

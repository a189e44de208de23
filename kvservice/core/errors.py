"""The error types the core raises for caller mistakes.

Each class names the gRPC status the server maps it to (``status``), so the
mapping lives here once and the core still does not import grpc. "No room" is
not an error: ``allocate_slots`` answers ``None`` for it, as vLLM does.
"""


class KVCacheError(Exception):
    """Base class of every caller-facing error the core raises."""

    status = "INTERNAL"


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument is malformed whatever the state (negative count, zero tokens)."""

    status = "INVALID_ARGUMENT"


class OutOfRangeError(KVCacheError, ValueError):
    """A token count goes past a configured limit such as ``max_model_len``."""

    status = "OUT_OF_RANGE"


class RequestNotFoundError(KVCacheError, LookupError):
    """The request id is not known (never seen, or already finished)."""

    status = "NOT_FOUND"

    def __str__(self) -> str:
        # LookupError would quote the message like a dict key; keep it readable.
        return str(self.args[0]) if self.args else ""


class FailedPreconditionError(KVCacheError):
    """The call is well formed but the request is in the wrong state for it."""

    status = "FAILED_PRECONDITION"


class QuotaExceededError(KVCacheError):
    """A share of the pool set above the core (a tenant's block quota) is full;
    nothing changed. Admission stops on it as it does on no room."""

    status = "RESOURCE_EXHAUSTED"

"""The request table's own refusals, beside the core's (``kvservice.core.errors``):
each names the gRPC status the server answers it with, as the core's do."""

from __future__ import annotations

from kvservice.core.errors import KVCacheError


class AlreadyExistsError(KVCacheError):
    """AddRequest for a request id the tenant already uses."""

    status = "ALREADY_EXISTS"


class PinNotFoundError(KVCacheError, LookupError):
    """The caller's tenant has no pin of that id (another tenant's pins are never
    found)."""

    status = "NOT_FOUND"


class StaleHitError(KVCacheError):
    """A remembered prefix hit lost a block to eviction before it was attached."""

    status = "ABORTED"


class LimitExceededError(KVCacheError):
    """A tenant holds as many requests, or waiting tokens, as it may; nothing changed.
    ``limit`` names the setting."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit

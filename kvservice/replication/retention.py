"""Where the client's retention vocabulary (``client.types``) meets the core's
(``core.retention_policy``), once: the client loads nothing of the core. What a replica
of a server's pool needs, whichever scheduler keeps it (the reference scheduler's
replicated backends, vLLM's remote link): the server's retention changes as its Step
answers carry them to a replica session; and a request's retention both ways (a
scheduler speaking the client's types to an in-process core, vLLM's requests to a
server)."""

from __future__ import annotations

from kvservice.client.types import (
    Retention,
    RetentionChange,
    RetentionPin,
    RetentionTick,
    TokenRangeRetention,
)
from kvservice.core.retention_policy import (
    PinPlaced,
    PinRemoved,
    RetentionConfig,
    RetentionEvent,
    Tick,
)
from kvservice.core.retention_policy import TokenRangeRetention as CoreTokenRange


def core_retention_event(change: RetentionChange) -> RetentionEvent:
    """The core's event for a change the server shipped."""
    if isinstance(change, RetentionTick):
        return Tick(change.now_s)
    if isinstance(change, RetentionPin):
        return PinPlaced(
            change.now_s,
            change.owner,
            change.pin_id,
            change.num_tokens,
            change.keys,
            change.ttl_s,
            change.refresh_on_hit,
        )
    return PinRemoved(change.now_s, change.owner, change.pin_id)


def client_retention(config: RetentionConfig) -> Retention:
    """A request's retention in the client's terms."""
    return Retention(
        tuple(
            TokenRangeRetention(r.start, r.end, r.priority, r.duration_s)
            for r in config.token_ranges
        ),
        config.decode_priority,
        config.decode_duration_s,
    )


def core_retention(retention: Retention) -> RetentionConfig:
    """A request's retention in the core's terms (InvalidArgumentError if malformed)."""
    return RetentionConfig(
        tuple(
            CoreTokenRange(r.start, r.end, r.priority, r.duration_s) for r in retention.token_ranges
        ),
        retention.decode_priority,
        retention.decode_duration_s,
    )

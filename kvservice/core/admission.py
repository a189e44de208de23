"""Admitting waiting requests, as vLLM's scheduler does in ``Scheduler.schedule``.

For each waiting request in the order the scheduler tries them: look up its cached
prefix, give it the uncached tokens that fit in the step's token budget, and
``allocate_slots``; stop at the first request that does not fit, or when the budget
is spent (vLLM never admits past a request that did not fit).

The rule lives here, over three callables, so that every place that admits applies
it identically: the reference scheduler's in-process backend (over a
``KVCacheManager``) and the server's ``Admit`` operation (over its allocator), which
lets a remote scheduler admit a whole step in one message and still make the same
decisions as in-process.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvservice.core.errors import QuotaExceededError

Hit = TypeVar("Hit")
Allocated = TypeVar("Allocated")


class AdmitStop(enum.Enum):
    """Why admission stopped."""

    ALL_ADMITTED = "all_admitted"
    BUDGET_SPENT = "budget_spent"
    NO_SPACE = "no_space"  # allocate_slots answered None for the next request
    NEEDS_CHUNKING = "needs_chunking"  # chunked prefill off, prompt over the budget left
    QUOTA = "quota"  # the next request would take its tenant past its block quota


@dataclass(frozen=True, slots=True)
class Admission(Generic[Hit, Allocated]):
    """One admitted request: its hit, its share of the budget and its allocation."""

    request_id: str
    hit: Hit
    num_hit_tokens: int
    num_new_tokens: int
    allocation: Allocated


@dataclass(frozen=True, slots=True)
class AdmissionResult(Generic[Hit, Allocated]):
    admitted: list[Admission[Hit, Allocated]]
    stop: AdmitStop
    # For QUOTA: the refusal, as the allocation raised it.
    stop_error: QuotaExceededError | None = None


def admit_in_order(
    request_ids: Iterable[str],
    token_budget: int,
    enable_chunked_prefill: bool,
    *,
    num_tokens: Callable[[str], int],
    lookup: Callable[[str], tuple[Hit, int]],
    allocate: Callable[[str, Hit, int, int], Allocated | None],
) -> AdmissionResult[Hit, Allocated]:
    """Admit ``request_ids`` in order within ``token_budget``.

    ``num_tokens(id)``: the request's tokens (prompt plus outputs so far).
    ``lookup(id)``: its prefix hit and the tokens it covers (``get_computed_blocks``).
    ``allocate(id, hit, num_hit_tokens, num_new_tokens)``: ``allocate_slots`` with the
    hit attached; None for no room; raises ``QuotaExceededError`` for a tenant's
    quota.
    """
    admitted: list[Admission[Hit, Allocated]] = []
    for request_id in request_ids:
        if token_budget <= 0:
            return AdmissionResult(admitted, AdmitStop.BUDGET_SPENT)
        hit, num_hit_tokens = lookup(request_id)
        remaining = num_tokens(request_id) - num_hit_tokens
        if not enable_chunked_prefill and remaining > token_budget:
            return AdmissionResult(admitted, AdmitStop.NEEDS_CHUNKING)
        num_new_tokens = min(remaining, token_budget)
        try:
            allocation = allocate(request_id, hit, num_hit_tokens, num_new_tokens)
        except QuotaExceededError as err:
            return AdmissionResult(admitted, AdmitStop.QUOTA, err)
        if allocation is None:
            return AdmissionResult(admitted, AdmitStop.NO_SPACE)
        admitted.append(Admission(request_id, hit, num_hit_tokens, num_new_tokens, allocation))
        token_budget -= num_new_tokens
    return AdmissionResult(admitted, AdmitStop.ALL_ADMITTED)

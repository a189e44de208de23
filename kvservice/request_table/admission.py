"""``Admit``: a step's admissions over the request table, checked once.

Every argument and id is checked before anything runs, so a refused ``Admit`` changes
nothing. Then each waiting request, in the order given, gets what vLLM's scheduler
gives it in ``Scheduler.schedule``: the lookup of its cached prefix, the uncached
tokens that fit in the step's token budget, and ``allocate_slots`` with the hit
attached (the same ``get_computed_blocks`` + ``allocate_slots`` pair a scheduler would
send); admission stops at the first request that does not fit, or when the budget is
spent (vLLM never admits past a request that did not fit). The server's ``Admit`` and
the scheduler's in-process backend both run it, so a remote scheduler admits a whole
step in one message and still makes the same decisions as in-process.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvservice.core.allocation_options import AllocationOptions
from kvservice.core.errors import FailedPreconditionError, InvalidArgumentError, QuotaExceededError
from kvservice.core.request import Request, RequestStatus
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import AllocateArgs, Allocation, ComputedBlocks


class AdmitStop(enum.Enum):
    """Why admission stopped."""

    ALL_ADMITTED = "all_admitted"
    BUDGET_SPENT = "budget_spent"
    NO_SPACE = "no_space"  # allocate_slots answered None for the next request
    NEEDS_CHUNKING = "needs_chunking"  # chunked prefill off, prompt over the budget left
    QUOTA = "quota"  # the next request would take its tenant past its block quota


@dataclass(frozen=True, slots=True)
class Admission:
    """One admitted request: its hit, its share of the budget and its allocation."""

    request_id: str
    hit: ComputedBlocks
    num_hit_tokens: int
    num_new_tokens: int
    allocation: Allocation


@dataclass(frozen=True, slots=True)
class AdmissionResult:
    admitted: list[Admission]
    stop: AdmitStop
    # For QUOTA: the refusal, as the allocation raised it.
    stop_error: QuotaExceededError | None = None


@dataclass(frozen=True, slots=True)
class AdmitArgs:
    """The fields of an ``AdmitRequest``."""

    request_ids: Sequence[str]
    token_budget: int
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0
    full_sequence_must_fit: bool = False


def admit(table: RequestTable, args: AdmitArgs, tenant: str) -> AdmissionResult:
    """Admit ``args.request_ids`` of ``tenant`` in order, within ``args.token_budget``."""
    requests = check(table, args, tenant)
    options = AllocationOptions(
        num_lookahead_tokens=args.num_lookahead_tokens,
        full_sequence_must_fit=args.full_sequence_must_fit,
    )
    token_budget = args.token_budget
    admitted: list[Admission] = []
    for request_id in args.request_ids:
        if token_budget <= 0:
            return AdmissionResult(admitted, AdmitStop.BUDGET_SPENT)
        hit = table.get_computed_blocks(request_id, tenant)
        num_hit_tokens = hit.num_computed_tokens
        remaining = requests[request_id].num_tokens - num_hit_tokens
        if not args.enable_chunked_prefill and remaining > token_budget:
            return AdmissionResult(admitted, AdmitStop.NEEDS_CHUNKING)
        num_new_tokens = min(remaining, token_budget)
        try:
            allocation = table.allocate_slots(
                request_id,
                AllocateArgs(
                    num_new_tokens=num_new_tokens,
                    num_new_computed_tokens=num_hit_tokens,
                    new_computed_block_ids=hit.block_ids if num_hit_tokens else (),
                    options=options,
                ),
                tenant,
            )
        except QuotaExceededError as err:
            return AdmissionResult(admitted, AdmitStop.QUOTA, err)
        if allocation.new_block_ids is None:
            return AdmissionResult(admitted, AdmitStop.NO_SPACE)
        admitted.append(Admission(request_id, hit, num_hit_tokens, num_new_tokens, allocation))
        token_budget -= num_new_tokens
    return AdmissionResult(admitted, AdmitStop.ALL_ADMITTED)


def check(table: RequestTable, args: AdmitArgs, tenant: str) -> dict[str, Request]:
    """Every id's request, once each argument and id is known to be admissible."""
    if not args.request_ids:
        raise InvalidArgumentError("request_ids is empty; name at least one waiting request")
    if args.token_budget < 0:
        raise InvalidArgumentError(f"token_budget = {args.token_budget}; it must be >= 0")
    if args.num_lookahead_tokens < 0:
        raise InvalidArgumentError(
            f"num_lookahead_tokens = {args.num_lookahead_tokens}; it must be >= 0"
        )
    requests: dict[str, Request] = {}
    for index, request_id in enumerate(args.request_ids):
        if request_id in requests:
            raise InvalidArgumentError(
                f"request_ids[{index}] = {request_id!r} is named twice; a request is admitted once"
            )
        # NOT_FOUND for an unknown id (or another tenant's), as every call answers.
        request = requests[request_id] = table.get_request(request_id, tenant)
        if request.status == RequestStatus.RUNNING:
            raise FailedPreconditionError(
                f"request_ids[{index}] = {request_id!r} is running; admit waiting or "
                f"preempted requests (free it with PREEMPT to re-admit it)"
            )
    return requests

"""``Admit``: a step's admissions over the request table, checked once.

Every argument and id is checked before anything runs, so a refused ``Admit`` changes
nothing; after that each admission is the same ``get_computed_blocks`` +
``allocate_slots`` pair a scheduler would send, and stops exactly where vLLM's loop
would (``kvservice.core.admission.admit_in_order``). The server's ``Admit`` and the
scheduler's in-process backend both run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvservice.core.admission import AdmissionResult, admit_in_order
from kvservice.core.allocation_options import AllocationOptions
from kvservice.core.errors import FailedPreconditionError, InvalidArgumentError
from kvservice.core.request import Request, RequestStatus
from kvservice.request_table.table import RequestTable
from kvservice.request_table.types import AllocateArgs, Allocation, ComputedBlocks

TableAdmission = AdmissionResult[ComputedBlocks, Allocation]


@dataclass(frozen=True, slots=True)
class AdmitArgs:
    """The fields of an ``AdmitRequest``."""

    request_ids: Sequence[str]
    token_budget: int
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0
    full_sequence_must_fit: bool = False


def admit(table: RequestTable, args: AdmitArgs, tenant: str) -> TableAdmission:
    """Admit ``args.request_ids`` of ``tenant`` in order."""
    requests = _check(table, args, tenant)
    options = AllocationOptions(
        num_lookahead_tokens=args.num_lookahead_tokens,
        full_sequence_must_fit=args.full_sequence_must_fit,
    )

    def lookup(request_id: str) -> tuple[ComputedBlocks, int]:
        hit = table.get_computed_blocks(request_id, tenant)
        return hit, hit.num_computed_tokens

    def allocate(
        request_id: str, hit: ComputedBlocks, num_hit_tokens: int, num_new_tokens: int
    ) -> Allocation | None:
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
        return allocation if allocation.new_block_ids is not None else None

    return admit_in_order(
        args.request_ids,
        args.token_budget,
        args.enable_chunked_prefill,
        num_tokens=lambda request_id: requests[request_id].num_tokens,
        lookup=lookup,
        allocate=allocate,
    )


def _check(table: RequestTable, args: AdmitArgs, tenant: str) -> dict[str, Request]:
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

"""The caller-facing checks of ``allocate_slots`` and ``probe``, and the little
per-request state they need.

Every check runs before the manager changes anything, so a refused call leaves no
trace; messages name the request and the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvservice.core.allocation_options import AllocationOptions
from kvservice.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OutOfRangeError,
    RequestNotFoundError,
)
from kvservice.core.kv_cache_block import KVCacheBlock
from kvservice.core.request import Request, RequestStatus


class AllocationChecker:
    """Validates allocation arguments against the request's history.

    ``num_computed_at_last_allocation`` holds, for every request allocated for and not
    yet seen finish, its ``num_computed_tokens`` at the last allocation (0 after a
    preemption): it both detects counts running backwards and tells which requests
    are known.
    """

    def __init__(
        self,
        max_model_len: int,
        hit_block_sizes: Sequence[int | None],
        holds_blocks: Callable[[str], bool],
    ) -> None:
        self.max_model_len = max_model_len
        # Per group, the block size a prefix hit is counted in (None: never has hits).
        self._hit_block_sizes = list(hit_block_sizes)
        self._holds_blocks = holds_blocks
        self.num_computed_at_last_allocation: dict[str, int] = {}

    def record_allocation(self, request_id: str, num_computed_tokens: int) -> None:
        self.num_computed_at_last_allocation[request_id] = num_computed_tokens

    def record_free(self, request: Request) -> None:
        """A finished request is forgotten; a preempted one restarts from 0."""
        known = self.num_computed_at_last_allocation
        if request.is_finished:
            known.pop(request.request_id, None)
        elif request.request_id in known:
            known[request.request_id] = 0

    def check_known(self, request_id: str) -> None:
        if request_id not in self.num_computed_at_last_allocation:
            raise RequestNotFoundError(
                f"request {request_id!r} is not known to the KV cache manager (never "
                f"allocated, or already finished and freed)"
            )

    @staticmethod
    def check_not_finished(request: Request) -> None:
        if request.is_finished:
            raise FailedPreconditionError(f"request {request.request_id!r} is finished")

    def check_allocation(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hits: tuple[Sequence[KVCacheBlock], ...],
        options: AllocationOptions,
    ) -> None:
        """Refuse a malformed or out-of-order allocation before anything changes:
        negative counts, zero tokens, a finished request, ``num_computed_tokens`` below
        the last allocation's, past ``max_model_len``, hits that do not fit the call."""
        rid = request.request_id
        num_external_computed_tokens = options.num_external_computed_tokens
        if (
            num_new_tokens < 0
            or num_new_computed_tokens < 0
            or options.num_lookahead_tokens < 0
            or num_external_computed_tokens < 0
            or options.num_encoder_tokens < 0
            or options.reserved_blocks < 0
        ):
            counts = {
                "num_new_tokens": num_new_tokens,
                "num_new_computed_tokens": num_new_computed_tokens,
                "num_lookahead_tokens": options.num_lookahead_tokens,
                "num_external_computed_tokens": num_external_computed_tokens,
                "num_encoder_tokens": options.num_encoder_tokens,
                "reserved_blocks": options.reserved_blocks,
            }
            negative = {k: v for k, v in counts.items() if v < 0}
            raise InvalidArgumentError(f"request {rid!r}: counts must be >= 0, got {negative}")
        if num_new_tokens == 0 and num_external_computed_tokens + num_new_computed_tokens == 0:
            # As vLLM: a step may take no slots of its own while adopting computed tokens.
            raise InvalidArgumentError(
                f"request {rid!r}: num_new_tokens must be greater than 0 when there are no "
                f"computed tokens to adopt (external or prefix hits)"
            )
        if request.status is RequestStatus.FINISHED:
            self.check_not_finished(request)
        previous = self.num_computed_at_last_allocation.get(rid)
        if previous is not None and num_computed_tokens < previous:
            raise FailedPreconditionError(
                f"request {rid!r}: num_computed_tokens went backwards from {previous} to "
                f"{num_computed_tokens} without a preemption (free the request first)"
            )
        end = num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        if end + num_new_tokens > self.max_model_len:
            raise OutOfRangeError(
                f"request {rid!r}: {num_computed_tokens} computed + "
                f"{num_new_computed_tokens} cached + {num_external_computed_tokens} external + "
                f"{num_new_tokens} new tokens = {end + num_new_tokens} exceeds max_model_len "
                f"{self.max_model_len}"
            )
        if hits or num_new_computed_tokens:
            self._check_hits(request, num_new_computed_tokens, hits)

    def _check_hits(
        self,
        request: Request,
        num_new_computed_tokens: int,
        hits: tuple[Sequence[KVCacheBlock], ...],
    ) -> None:
        rid = request.request_id
        if not any(hits):
            if num_new_computed_tokens > 0:
                raise InvalidArgumentError(
                    f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} "
                    f"but no new_computed_blocks were given"
                )
            return
        if len(hits) != len(self._hit_block_sizes):
            raise InvalidArgumentError(
                f"request {rid!r}: new_computed_blocks has {len(hits)} groups, the KV cache "
                f"has {len(self._hit_block_sizes)}"
            )
        if self._holds_blocks(rid):
            raise FailedPreconditionError(
                f"request {rid!r} already holds blocks; prefix hits attach only at admission"
            )
        # By index and without min(default=): the lengths match (checked above), and a
        # keyword builtin is a generic call in the compiled core (the README's section).
        sized = [len(hits[i]) * bs for i, bs in enumerate(self._hit_block_sizes) if bs is not None]
        covered = min(sized) if sized else 0
        if num_new_computed_tokens > covered:
            raise InvalidArgumentError(
                f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} exceeds "
                f"the {covered} tokens the given new_computed_blocks cover"
            )

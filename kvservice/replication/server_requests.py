"""What a kvservice server holds of each request of a scheduler's replica, so that each
call of the scheduler records on the remote step only what the server lacks.

vLLM's remote link (``kvservice.integrations.vllm.server_link``) reads vLLM's request
and hands this the plain values: it runs for every request of every step, so it is
compiled. The link stays in the vLLM integration, which is not compiled: its modules
import vLLM and torch, which pip's build environment (mypy alone) does not hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvservice.client.step_link import StepLink
from kvservice.client.step_log import Copies
from kvservice.client.types import AllocateOptions, BlockIds, ComputedBlocks, FreeMode
from kvservice.core.allocation_options import PLAIN_ALLOCATION, AllocationOptions
from kvservice.core.request import Request, computed_after_allocation


class HeldRequest:
    """What the server has of one request: its tokens, its computed tokens as the
    server counts them, and how many of the engine's block hashes (when it takes
    them). One object for the three, so that a call looks its request up in one dict,
    not three."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.num_computed_tokens = 0
        self.num_hashes = 0


class ServerRequests:
    """Per request the server has: a ``HeldRequest``, and the hash blocks a
    ``cache_blocks`` covered. Each call records on ``link``'s log (``sends_hashes``:
    with the engine's block hashes).

    ``hash_block_size`` and ``num_hash_lookahead_tokens``: the server's hashing, which
    says which of the engine's hashes a request's tokens complete.
    """

    def __init__(
        self,
        link: StepLink,
        sends_hashes: bool,
        hash_block_size: int,
        num_hash_lookahead_tokens: int,
    ) -> None:
        self._link = link
        self.sends_hashes = sends_hashes
        # The pool has groups that release blocks below the processed tokens (windows,
        # chunked local attention, Mamba): an allocation then sends its in-flight
        # tokens, which async scheduling keeps (set by the link once it knows the pool).
        self.windowed = False
        self._hash_block_size = hash_block_size
        self._lookahead = num_hash_lookahead_tokens
        self._held: dict[str, HeldRequest] = {}
        self._cached: dict[str, int] = {}

    def __contains__(self, request_id: str) -> bool:
        """Whether the server has ``request_id`` (added, and not finished since)."""
        return request_id in self._held

    def add(
        self, request_id: str, num_prompt_tokens: int, block_hashes: Sequence[bytes]
    ) -> Sequence[bytes] | None:
        """``request_id`` goes to the server with its prompt (the caller records its
        ``add_request``): the block hashes to send with it, those its prompt completes,
        or None when the server hashes (``sends_hashes`` off)."""
        held = self._held[request_id] = HeldRequest(num_prompt_tokens)
        if not self.sends_hashes:
            return None
        return self._new_hashes(held, block_hashes, num_prompt_tokens)

    def send_tokens(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        block_hashes: Sequence[bytes],
    ) -> bool:
        """Record an append of the tokens of ``request_id``'s first ``num_tokens`` that
        the server lacks, with the hashes of the blocks they complete; False, recording
        nothing, when the server does not have the request (``add`` it first)."""
        held = self._held.get(request_id)
        if held is None:
            return False
        self._send_tokens(held, request_id, token_ids, num_tokens, block_hashes)
        return True

    def _send_tokens(
        self,
        held: HeldRequest,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        block_hashes: Sequence[bytes],
    ) -> None:
        known = held.num_tokens
        if num_tokens == known:
            return  # nothing new: most lookups, preempted requests coming back
        if num_tokens > known:
            hashes = self._new_hashes(held, block_hashes, num_tokens)
            log = self._link.log
            if num_tokens == known + 1 and not hashes:
                log.append_token(request_id, token_ids[known])
            else:
                log.append_tokens(request_id, token_ids[known:], hashes)
        held.num_tokens = num_tokens

    def _new_hashes(
        self, held: HeldRequest, block_hashes: Sequence[bytes], num_tokens: int
    ) -> Sequence[bytes]:
        """The engine's hashes of the blocks a request's first ``num_tokens`` tokens
        complete (lookahead tokens counted) that the server does not have."""
        if not self.sends_hashes:
            return []
        sent = held.num_hashes
        if len(block_hashes) == sent:
            return []  # most appends: no block completed
        num_full = max(0, num_tokens - self._lookahead) // self._hash_block_size
        hashes = block_hashes[sent:num_full]
        held.num_hashes = sent + len(hashes)
        return hashes

    # Speed: the replica's request read here, compiled, instead of vLLM's by the link in
    # Python (ServerLink.allocated and _send_tokens), for every allocation that attaches
    # no hit (a decode step's). `python -m benchmarks.bench_vllm_link --churn 0` (decode
    # steps only), four runs (2026-12-07): the link's cost 0.66-0.77 us an allocation,
    # against 1.20-1.33 recorded in Python. With one HeldRequest read per call instead
    # of three dicts, three runs alternated with the tree before it: 0.55-0.66 us,
    # against 0.67-0.80.
    def record_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        allocation_options: AllocationOptions,
        answer: BlockIds | None,
        copies: Copies,
    ) -> bool:
        """The replica's ``allocate_slots`` answered ``answer`` for ``request``, the
        replica's own (whose token and hash lists are the engine's), attaching no hit:
        record the tokens the server lacks and the allocation; False, recording
        nothing, when the server does not have the request (the caller adds it)."""
        request_id = request.request_id
        held = self._held.get(request_id)
        if held is None:
            return False
        tokens = request.all_token_ids
        self._send_tokens(held, request_id, tokens, len(tokens), request.block_hashes)
        self.allocated(
            request_id,
            num_new_tokens,
            request.num_computed_tokens,
            request.num_in_flight_tokens if self.windowed else 0,
            None,
            0,
            allocation_options,
            answer,
            copies,
        )
        return True

    def allocated(
        self,
        request_id: str,
        num_new_tokens: int,
        num_computed_tokens: int,
        num_in_flight_tokens: int,
        hit: ComputedBlocks | None,
        num_hit_tokens: int,
        allocation_options: AllocationOptions,
        answer: BlockIds | None,
        copies: Copies,
    ) -> None:
        """The replica's ``allocate_slots`` answered ``answer`` for ``request_id`` (its
        tokens sent), attaching ``hit`` (``num_hit_tokens`` of it) with
        ``allocation_options``: record it, with what the server needs beyond vLLM's
        defaults."""
        held = self._held[request_id]
        # vLLM's defaults (a decode step's plain call) are sent as no options at all;
        # allocation_options() gives them as PLAIN_ALLOCATION itself.
        options = (
            None
            if allocation_options is PLAIN_ALLOCATION
            else AllocateOptions(*allocation_options.as_tuple())
        )
        # The server counts computed tokens as the scheduler does; the count goes only
        # where the scheduler moved it otherwise (rejected draft tokens).
        if num_computed_tokens != held.num_computed_tokens:
            options = dataclasses.replace(
                options or AllocateOptions(), num_computed_tokens=num_computed_tokens
            )
        if num_in_flight_tokens:
            options = dataclasses.replace(
                options or AllocateOptions(), num_in_flight_tokens=num_in_flight_tokens
            )
        # A running request's plain allocation joins the step's column of them, a
        # waiting one's joins its lookup (StepLog.allocate).
        self._link.log.allocate(request_id, num_new_tokens, answer, copies, hit, options)
        if answer is not None:
            held.num_computed_tokens = computed_after_allocation(
                num_computed_tokens,
                num_hit_tokens,
                allocation_options.num_external_computed_tokens,
                num_new_tokens,
            )

    def covers_new_blocks(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether a ``cache_blocks(request_id, num_computed_tokens)`` covers a hash block
        the last one did not (one that does not caches nothing, on the replica as on
        the server); remembered when it does."""
        covered = num_computed_tokens // self._hash_block_size
        if covered <= self._cached.get(request_id, 0):
            return False
        self._cached[request_id] = covered
        return True

    def freed(self, request_id: str, finished: bool, keep_blocks: bool) -> bool:
        """Record the free of ``request_id`` (finished, else preempted), which keeps its
        blocks for a later release with ``keep_blocks``; False, recording nothing, when
        the server never had it."""
        held = self._held.get(request_id)
        if held is None:
            return False
        mode = FreeMode.FINISH if finished else FreeMode.PREEMPT
        self._link.log.free(request_id, mode, keep_blocks)
        self._cached.pop(request_id, None)
        if finished:
            del self._held[request_id]
        else:
            held.num_computed_tokens = 0
        return True

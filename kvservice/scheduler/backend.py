"""The scheduler's view of KV memory: a small ``Backend`` protocol with plain-data
answers, and its two implementations, in-process (the server's request table over a
``KVCacheManager`` in this process) and remote (the blocking ``KVClient``). The
scheduler cannot tell them apart.

A step's admissions are one ``admit`` call: every backend runs the table's
(``kvservice.request_table.admission``), in-process on its own table, remotely next
to the server's pool in one RPC."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar

from kvservice.client import KVClient
from kvservice.client.types import (
    AdmitOptions,
    AdmitResult,
    AllocateOptions,
    ComputedBlocks,
    FreeMode,
)
from kvservice.core.allocation_options import allocation_options
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.request_table import admission
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, NewRequest
from kvservice.request_table.types import FreeMode as TableFreeMode

P = ParamSpec("P")
R = TypeVar("R")

# Block ids per KV cache group, in block-table order (as the client's ``BlockIds``).
BlockIds = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A prefix lookup: the cached blocks and the tokens they hold. Passed back
    unchanged to ``allocate_slots`` to attach them."""

    block_ids: BlockIds
    num_computed_tokens: int
    shared_prefix_boundary: int = 0


def as_computed_blocks(hit: PrefixHit | None) -> ComputedBlocks | None:
    """The client's form of a lookup the scheduler kept (None: nothing to attach)."""
    if hit is None:
        return None
    return ComputedBlocks(hit.block_ids, hit.num_computed_tokens, hit.shared_prefix_boundary)


def as_prefix_hit(hit: ComputedBlocks) -> PrefixHit:
    """The scheduler's form of the client's lookup answer."""
    return PrefixHit(hit.block_ids, hit.num_computed_tokens, hit.shared_prefix_boundary)


def allocate_options(
    num_lookahead_tokens: int, full_sequence_must_fit: bool
) -> AllocateOptions | None:
    """The client's options for the scheduler's allocation arguments; None for the
    defaults (a plain decode allocation: nothing to encode)."""
    if not (num_lookahead_tokens or full_sequence_must_fit):
        return None
    return AllocateOptions(
        num_lookahead_tokens=num_lookahead_tokens, full_sequence_must_fit=full_sequence_must_fit
    )


class PendingBlockIds:
    """Block ids a batching backend will know once it sends the step (``flush``).

    A batching backend answers an allocation it can prove will fit with this
    placeholder instead of a round trip; the scheduler reads it after ``flush``.
    """

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value: BlockIds | None = None

    def set(self, value: BlockIds) -> None:
        self._value = value

    def get(self) -> BlockIds:
        if self._value is None:
            raise RuntimeError("block ids read before the step was flushed")
        return self._value


# An allocation's answer: the ids now, or once the step is flushed.
AllocatedIds = BlockIds | PendingBlockIds


def resolve_ids(ids: AllocatedIds) -> BlockIds:
    """The block ids of an answer, pending or not (pending ones after ``flush``)."""
    return ids.get() if isinstance(ids, PendingBlockIds) else ids


@dataclass(frozen=True, slots=True)
class AdmittedIds:
    """One request ``admit`` let in: the tokens its prefix hit covered, its share of
    the step's budget (the hit excluded) and the blocks it was given."""

    request_id: str
    num_hit_tokens: int
    num_new_tokens: int
    new_block_ids: AllocatedIds


def admitted_from_result(result: AdmitResult) -> list[AdmittedIds]:
    """The client's ``admit`` answer in the protocol's form.

    A tenant quota stop ends admission as no room does: the scheduler runs no
    tenants, and vLLM's scheduler never skips past a request that did not fit.
    """
    return [
        AdmittedIds(
            item.request_id,
            item.hit.num_computed_tokens,
            item.num_new_tokens,
            item.allocation.new_block_ids,
        )
        for item in result.admitted
    ]


class Backend(Protocol):
    """The allocator calls vLLM's scheduler makes, by request id.

    ``allocate_slots`` answers the new block ids (possibly pending until ``flush``),
    or None for no room (nothing changed); on success the backend advances the
    request's computed tokens by the hit plus ``num_new_tokens``, as vLLM's
    scheduler does right after scheduling. ``admit`` admits waiting requests in the
    order given (``admit_in_order``: lookup, then ``allocate_slots`` with the hit,
    until the budget is spent or one does not fit) and answers the admitted prefix of
    ``request_ids``. ``flush`` ends a scheduling step: a batching backend sends what
    it deferred; the others have nothing to do. ``new_step_starts`` begins one, as
    vLLM's scheduler tells its manager at the top of ``schedule()``: after the previous
    step's appends and frees, before the step's allocations and ``admit`` (a batching
    backend sends it in that order with the step's message).
    """

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None: ...

    def new_step_starts(self) -> None: ...

    def get_computed_blocks(self, request_id: str) -> PrefixHit: ...

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> AllocatedIds | None: ...

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions,
    ) -> list[AdmittedIds]: ...

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def free(self, request_id: str, preempt: bool = False) -> None: ...

    def num_free_blocks(self) -> int: ...

    def end_step(self) -> None:
        """The step's decisions are made: answer every pending block id. A batching
        backend sends only if something is still pending; the step's appends and
        frees, which nobody waits for, ride with the next step's message."""

    def flush(self) -> None:
        """Send everything deferred (the end of a run, before reading the server)."""


class ForwardingBackend:
    """A ``Backend`` that forwards every call to ``inner`` through one hook,
    ``_forward``: a wrapper (counting, timing, tracing) overrides the hook or the
    calls it watches and inherits the rest."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def _forward(self, call: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return call(*args, **kwargs)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self._forward(self.inner.add_request, request_id, prompt_token_ids)

    def new_step_starts(self) -> None:
        self._forward(self.inner.new_step_starts)

    def get_computed_blocks(self, request_id: str) -> PrefixHit:
        return self._forward(self.inner.get_computed_blocks, request_id)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> AllocatedIds | None:
        return self._forward(
            self.inner.allocate_slots,
            request_id,
            num_new_tokens,
            hit,
            num_lookahead_tokens,
            full_sequence_must_fit,
        )

    def admit(
        self, request_ids: Sequence[str], token_budget: int, options: AdmitOptions
    ) -> list[AdmittedIds]:
        return self._forward(self.inner.admit, request_ids, token_budget, options)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._forward(self.inner.append_tokens, request_id, token_ids)

    def free(self, request_id: str, preempt: bool = False) -> None:
        self._forward(self.inner.free, request_id, preempt)

    def num_free_blocks(self) -> int:
        return self._forward(self.inner.num_free_blocks)

    def end_step(self) -> None:
        self._forward(self.inner.end_step)

    def flush(self) -> None:
        self._forward(self.inner.flush)


def _ids(groups: Sequence[Sequence[int]]) -> BlockIds:
    return tuple(map(tuple, groups))


class InProcessBackend:
    """A ``Backend`` over a ``KVCacheManager`` in this process, through the request
    table the server runs on (``kvservice.request_table``): the same request state,
    the same checks and the same ``admit``, for the default tenant."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.table = RequestTable(manager)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.table.add_request(NewRequest(request_id, list(prompt_token_ids)), DEFAULT_TENANT)

    def new_step_starts(self) -> None:
        self.table.new_step_starts()

    def get_computed_blocks(self, request_id: str) -> PrefixHit:
        hit = self.table.get_computed_blocks(request_id, DEFAULT_TENANT)
        return PrefixHit(hit.block_ids, hit.num_computed_tokens, hit.shared_prefix_boundary)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        args = AllocateArgs(
            num_new_tokens,
            hit.num_computed_tokens if hit is not None else 0,
            hit.block_ids if hit is not None else (),
            allocation_options(
                num_lookahead_tokens=num_lookahead_tokens,
                full_sequence_must_fit=full_sequence_must_fit,
            ),
        )
        new_block_ids = self.table.allocate_slots(request_id, args, DEFAULT_TENANT).new_block_ids
        return None if new_block_ids is None else _ids(new_block_ids)

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions,
    ) -> list[AdmittedIds]:
        """The table's ``admit``, as the server runs it for an ``Admit``: every id
        checked before any is admitted, so a refused call changes nothing."""
        args = admission.AdmitArgs(
            request_ids,
            token_budget,
            options.enable_chunked_prefill,
            options.num_lookahead_tokens,
            options.full_sequence_must_fit,
        )
        result = admission.admit(self.table, args, DEFAULT_TENANT)
        return [
            AdmittedIds(
                a.request_id,
                a.num_hit_tokens,
                a.num_new_tokens,
                # An admitted request's allocation fitted: it has its ids.
                _ids(a.allocation.new_block_ids or ()),
            )
            for a in result.admitted
        ]

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.table.append_tokens(request_id, token_ids, DEFAULT_TENANT)

    def free(self, request_id: str, preempt: bool = False) -> None:
        self.table.free(
            request_id,
            TableFreeMode.PREEMPT if preempt else TableFreeMode.FINISH,
            DEFAULT_TENANT,
        )

    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def end_step(self) -> None:
        """Nothing is deferred in-process."""

    def flush(self) -> None:
        """Nothing is deferred in-process."""


class RemoteBackend:
    """A ``Backend`` over a kvservice server, one blocking RPC per call."""

    def __init__(self, client: KVClient) -> None:
        self.client = client

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.client.add_request(request_id, prompt_token_ids)

    def new_step_starts(self) -> None:
        self.client.new_step_starts()

    def get_computed_blocks(self, request_id: str) -> PrefixHit:
        return as_prefix_hit(self.client.get_computed_blocks(request_id))

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        computed = as_computed_blocks(hit)
        options = allocate_options(num_lookahead_tokens, full_sequence_must_fit)
        allocation = self.client.allocate_slots(request_id, num_new_tokens, computed, options)
        return None if allocation is None else allocation.new_block_ids

    def admit(
        self,
        request_ids: Sequence[str],
        token_budget: int,
        options: AdmitOptions,
    ) -> list[AdmittedIds]:
        """One ``Admit`` RPC: the server runs the admissions next to its pool."""
        result = self.client.admit(request_ids, token_budget, options)
        return admitted_from_result(result)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.client.append_tokens(request_id, token_ids)

    def free(self, request_id: str, preempt: bool = False) -> None:
        self.client.free(request_id, FreeMode.PREEMPT if preempt else FreeMode.FINISH)

    def num_free_blocks(self) -> int:
        return self.client.get_usage().num_free_blocks

    def end_step(self) -> None:
        """Every call was already sent."""

    def flush(self) -> None:
        """Every call was already sent."""

"""The scheduler's view of KV memory: a small ``Backend`` protocol with plain-data
answers, and its implementations, in-process (the server's request table over a
``KVCacheManager`` in this process) and remote one RPC per call (the blocking
``KVClient``); ``kvservice.scheduler.replicated`` has the remote ones that send a step
per message. The scheduler cannot tell them apart.

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
    BlockIds,
    ComputedBlocks,
    FreeMode,
    Retention,
)
from kvservice.core.allocation_options import allocation_options
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.replication import core_retention
from kvservice.request_table import admission
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import DEFAULT_TENANT
from kvservice.request_table.types import AllocateArgs, Allocation, NewRequest
from kvservice.request_table.types import FreeMode as TableFreeMode

P = ParamSpec("P")
R = TypeVar("R")


def client_options(
    num_lookahead_tokens: int, full_sequence_must_fit: bool
) -> AllocateOptions | None:
    """The client's options for the scheduler's allocation arguments; None for the
    defaults (a plain decode allocation: nothing to encode)."""
    if not (num_lookahead_tokens or full_sequence_must_fit):
        return None
    return AllocateOptions(
        num_lookahead_tokens=num_lookahead_tokens, full_sequence_must_fit=full_sequence_must_fit
    )


@dataclass(frozen=True, slots=True)
class AdmittedIds:
    """One request ``admit`` let in: the tokens its prefix hit covered, its share of
    the step's budget (the hit excluded) and the blocks it was given."""

    request_id: str
    num_hit_tokens: int
    num_new_tokens: int
    new_block_ids: BlockIds


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
    """The request-table calls vLLM's scheduler makes, by request id.

    ``allocate_slots`` answers the new block ids, or None for no room (nothing
    changed); on success the backend advances the request's computed tokens by the hit
    plus ``num_new_tokens``, as vLLM's scheduler does right after scheduling.
    ``admit`` admits waiting requests in the order given (lookup, then
    ``allocate_slots`` with the hit, until the budget is spent or one does not fit)
    and answers the admitted prefix of ``request_ids``. ``new_step_starts`` begins a
    step, as vLLM's scheduler tells its manager at the top of ``schedule()``: after the
    previous step's appends and frees, before the step's allocations and ``admit``;
    ``end_step`` closes its decisions
    (a replicated backend sends the step there); ``flush`` ends a run.
    """

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        retention: Retention | None = None,
    ) -> None: ...

    def new_step_starts(self) -> None: ...

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks: ...

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None: ...

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
        """The step's decisions are made, before the forward pass's appends and frees
        (which ride with the next step's message on a replicated backend)."""

    def flush(self) -> None:
        """Send and check everything recorded (the end of a run, before reading the
        server)."""


class ForwardingBackend:
    """A ``Backend`` that forwards every call to ``inner`` through one hook,
    ``_forward``: a wrapper (counting, timing, tracing) overrides the hook or the
    calls it watches and inherits the rest."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def _forward(self, call: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return call(*args, **kwargs)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        retention: Retention | None = None,
    ) -> None:
        self._forward(self.inner.add_request, request_id, prompt_token_ids, retention)

    def new_step_starts(self) -> None:
        self._forward(self.inner.new_step_starts)

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        return self._forward(self.inner.get_computed_blocks, request_id)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
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

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        retention: Retention | None = None,
    ) -> None:
        new = NewRequest(
            request_id,
            list(prompt_token_ids),
            retention=None if retention is None else core_retention(retention),
        )
        self.table.add_request(new, DEFAULT_TENANT)

    def new_step_starts(self) -> None:
        self.table.new_step_starts()

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        hit = self.table.get_computed_blocks(request_id, DEFAULT_TENANT)
        return ComputedBlocks(hit.block_ids, hit.num_computed_tokens, hit.shared_prefix_boundary)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        return self._new_ids(
            self._allocate(
                request_id, num_new_tokens, hit, num_lookahead_tokens, full_sequence_must_fit
            )
        )

    def _allocate(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None,
        num_lookahead_tokens: int,
        full_sequence_must_fit: bool,
    ) -> Allocation:
        """The table's whole answer (its copies too, which a replica records)."""
        args = AllocateArgs(
            num_new_tokens,
            hit.num_computed_tokens if hit is not None else 0,
            hit.block_ids if hit is not None else (),
            allocation_options(
                num_lookahead_tokens=num_lookahead_tokens,
                full_sequence_must_fit=full_sequence_must_fit,
            ),
        )
        return self.table.allocate_slots(request_id, args, DEFAULT_TENANT)

    @staticmethod
    def _new_ids(allocation: Allocation) -> BlockIds | None:
        new_block_ids = allocation.new_block_ids
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

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        retention: Retention | None = None,
    ) -> None:
        self.client.add_request(request_id, prompt_token_ids, retention=retention)

    def new_step_starts(self) -> None:
        self.client.new_step_starts()

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        return self.client.get_computed_blocks(request_id)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        options = client_options(num_lookahead_tokens, full_sequence_must_fit)
        allocation = self.client.allocate_slots(request_id, num_new_tokens, hit, options)
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

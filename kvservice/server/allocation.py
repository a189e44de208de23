"""What the allocator takes and answers, and the protocols of what it drives.

The argument and answer types of ``Allocator`` (``NewRequest``, ``AllocateArgs``,
``ProbeArgs``, ``ComputedBlocks``, ``Allocation``, ``PoolUsage``, ...) and the protocols
of what it is handed: the co-located KV tensors (``KVRuntime``), the owner of each
request (``RequestOwnership``) and the metrics (``AllocatorObserver``).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.request import Request
from kvservice.core.stats import PrefixCacheStats

BlockIdsPerGroup = tuple[list[int], ...]
# A prefix hit's block ids per group, as a lookup answers and an allocation names them.
HitBlockIds = tuple[tuple[int, ...], ...]


class FreeMode(enum.Enum):
    """What happens to a request once its blocks are released."""

    PREEMPT = enum.auto()
    FINISH = enum.auto()


class AllocationResult(enum.StrEnum):
    """How an AllocateSlots call ended (the ``result`` label of the metrics)."""

    OK = "ok"
    NO_SPACE = "no_space"
    INVALID = "invalid"


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request as a client describes it to AddRequest."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    mm_features: tuple[MultiModalFeature, ...] = ()
    skip_reading_prefix_cache: bool = False
    # The ids came as packed_prompt_token_ids: unsigned, so none can be negative, and
    # an error about one names that field.
    packed: bool = False

    @property
    def prompt_field(self) -> str:
        """The AddRequestRequest field the prompt came in."""
        return "packed_prompt_token_ids" if self.packed else "prompt_token_ids"


@dataclass(frozen=True, slots=True)
class AllocateArgs:
    """The arguments of ``allocate_slots``, with the hit named by its block ids (the
    blocks themselves stay on the server) and an optional ``num_computed_tokens`` to
    set first."""

    num_new_tokens: int
    num_new_computed_tokens: int = 0
    new_computed_block_ids: HitBlockIds = ()
    num_lookahead_tokens: int = 0
    num_external_computed_tokens: int = 0
    delay_cache_blocks: bool = False
    num_encoder_tokens: int = 0
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = True
    num_computed_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ProbeArgs:
    """The arguments of ``KVCacheManager.probe``; ``num_new_tokens=None`` probes every
    token not yet computed nor hit."""

    num_new_tokens: int | None = None
    num_lookahead_tokens: int = 0
    num_external_computed_tokens: int = 0
    num_encoder_tokens: int = 0
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = True


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix lookup: the hit's block ids per group and what vLLM reports with it."""

    block_ids: HitBlockIds
    num_computed_tokens: int
    shared_prefix_boundary: int


# Not frozen, and empty tuples rather than list factories: one is built per
# allocation on the hot path, and a frozen dataclass's __init__ (object.__setattr__
# per field) plus four fresh lists cost more than the rest of a decode allocation's
# bookkeeping. Nothing mutates one after it is built.
@dataclass(slots=True)
class Allocation:
    """An AllocateSlots answer; ``new_block_ids`` is None when there was no room.

    Fresh blocks of a pool that needs zeroing are in exactly one list:
    ``block_ids_to_zero`` for a remote worker to zero (no runtime), or
    ``block_ids_zeroed`` when the co-located runtime zeroes them before the answer is
    sent. Copy-on-write copies ``(src, dst)`` of a partial prefix hit likewise:
    ``block_copies_to_apply`` (the worker applies them after zeroing, before the
    model writes) or ``block_copies_applied`` (the runtime did, after zeroing).
    """

    request: Request
    new_block_ids: BlockIdsPerGroup | None
    block_ids_to_zero: Sequence[int] = ()
    block_ids_zeroed: Sequence[int] = ()
    block_copies_to_apply: Sequence[tuple[int, int]] = ()
    block_copies_applied: Sequence[tuple[int, int]] = ()


@functools.lru_cache(maxsize=1024)
def plain_allocate_args(num_new_tokens: int) -> AllocateArgs:
    """The arguments of an allocation with only ``num_new_tokens`` set (immutable, so
    shared: a scheduler sends the same few counts over and over)."""
    return AllocateArgs(num_new_tokens=num_new_tokens)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """The pool and the prefix cache totals at one moment."""

    usage: float
    num_free_blocks: int
    num_used_blocks: int
    num_blocks: int
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class KVRuntime(Protocol):
    """The KV tensors the server owns (``gpu_runtime.runtime.KVCacheRuntime``); a
    protocol so the allocator needs no torch."""

    def apply(
        self,
        new_block_ids_to_zero: Sequence[int] | None = None,
        copies: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Zero fresh blocks, then apply copy-on-write ``(src, dst)`` copies."""
        ...


class RequestOwnership(Protocol):
    """Learns which requests come and go (``sessions``: the caller's session owns
    what it adds); called right after the change, on the allocator's loop."""

    def adopt(self, request_id: str) -> None:
        """``request_id`` was just added."""
        ...

    def release(self, request_id: str) -> None:
        """``request_id`` was just finished (forgotten)."""
        ...


class AllocatorObserver(Protocol):
    """Receives what the metrics need, on the loop that owns the allocator."""

    def record_allocation(self, result: AllocationResult, count: int = 1) -> None: ...

    def record_pool(self, usage: PoolUsage, stats: PrefixCacheStats | None) -> None: ...

    def record_preemption(self) -> None: ...

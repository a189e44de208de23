"""What the request table takes and answers: plain values, no protobuf.

The table's own shapes (an allocation carries the live ``Request`` and list block
ids as the manager answers them; options are the core's ``AllocationOptions``); the
client's values for the same concepts are the wire's (``kvservice.client.types``
says why), converted from these by ``kvservice.server.converters`` for the wire and
by the reference scheduler's ``InProcessBackend`` for its in-process runs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvservice.core.allocation_options import PLAIN_ALLOCATION, AllocationOptions
from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.kv_cache_block import BlockIds
from kvservice.core.request import Request
from kvservice.core.retention_policy import RetentionConfig

BlockIdsPerGroup = tuple[list[int], ...]


class FreeMode(enum.Enum):
    """What happens to a request once its blocks are released."""

    PREEMPT = enum.auto()
    FINISH = enum.auto()


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
    # The LoRA adapter's path (hashed with its name, as vLLM 0.33 keys an adapter) and
    # int id (reported as lora_id in KV events); both need ``lora_name``.
    lora_path: str | None = None
    lora_int_id: int | None = None
    # Prompt embeddings: ``prompt_embeds_row_bytes`` bytes per prompt token, row-major
    # (vLLM hashes the raw bytes of each block's rows).
    prompt_embeds: bytes | None = None
    prompt_embeds_row_bytes: int = 0
    # Eviction priorities of its blocks (needs the priority eviction policy).
    retention: RetentionConfig | None = None
    # Pin the prompt's whole blocks for the tenant for this many seconds (Dynamo's
    # cache_control TTL), created with the request; None: no pin.
    cache_control_ttl_s: float | None = None
    # The client's hashes of the prompt's full blocks, taken instead of hashing the
    # prompt when ``client_hashed`` (a trusted tenant only: ``client_hashes``).
    block_hashes: tuple[bytes, ...] = ()
    client_hashed: bool = False

    @property
    def prompt_field(self) -> str:
        """The AddRequestRequest field the prompt came in."""
        return "packed_prompt_token_ids" if self.packed else "prompt_token_ids"


@dataclass(frozen=True, slots=True)
class PinArgs:
    """A prefix to pin, as a client describes it to PinPrefix: the tokens and the
    keys that enter its block hashes (as a request's would), the TTL (None: until
    unpinned) and whether a hit restarts it."""

    token_ids: list[int]
    ttl_s: float | None = None
    refresh_on_hit: bool = False
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    # The ids came packed (unsigned: none can be negative).
    packed: bool = False
    # The client's hashes of the prefix's whole blocks (a tenant trusted with client
    # block hashes: the pin then names its client_hashed requests' blocks); empty: the
    # server hashes the tokens.
    block_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class PinView:
    """One pin as the table reports it: under the tenant the client knows, with the
    time left rather than the server's clock reading."""

    pin_id: str
    tenant: str
    num_tokens: int
    num_reserved_blocks: int
    num_held_blocks: int
    ttl_s: float | None
    refresh_on_hit: bool
    expires_in_s: float | None
    num_hits: int


@dataclass(frozen=True, slots=True)
class PinnedBudget:
    """The pool's pins in blocks: held now, reserved (cached or not), and the most
    pins may reserve (0: pinning is off)."""

    num_pinned_blocks: int
    num_reserved_blocks: int
    max_pinned_blocks: int


class AllocateArgs(NamedTuple):
    """The arguments of ``allocate_slots``, with the hit named by its block ids (the
    blocks themselves stay in the table) and an optional ``num_computed_tokens`` to
    set first.

    A named tuple: immutable and hashable as a frozen dataclass is, and built in a
    sixth of the time, which every allocation pays (one per entry of a decode step;
    bench_decode_layers step layer: 21% faster than a frozen dataclass, 3 runs, spread
    under 3%).
    """

    num_new_tokens: int
    num_new_computed_tokens: int = 0
    new_computed_block_ids: BlockIds = ()
    options: AllocationOptions = PLAIN_ALLOCATION
    num_computed_tokens: int | None = None
    # Of the computed tokens, those whose step has not run (vLLM's async scheduling):
    # windows release blocks only below the rest. For this call only.
    num_in_flight_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix lookup: the hit's block ids per group and what vLLM reports with it."""

    block_ids: BlockIds
    num_computed_tokens: int
    shared_prefix_boundary: int


# Not frozen: one is built per allocation, and a frozen dataclass's __init__ (an
# object.__setattr__ per field) costs several times a plain one's. Nothing mutates
# one after it is built. (bench_decode_layers table layer: 40% slower frozen; 3 runs,
# spread under 6%.)
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

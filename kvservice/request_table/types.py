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


class NewRequest:
    """A request as a client describes it to AddRequest. Nothing changes one after it
    is built.

    A plain class, as ``AllocateArgs`` is and for the same reason: one is built per
    added request, and a frozen dataclass's ``__init__`` sets its fields through
    ``object.__setattr__``, interpreted under the compiled Step runner. Built as an
    AddRequestBatch entry is (``python -m timeit -s "from kvservice.request_table.types
    import NewRequest as N; p=[1]*16" "N('r', p, packed=True, block_hashes=(),
    client_hashed=True)"``, compiled): 2.6 us as a dataclass, 1.14 us now, most of it
    the keyword parsing a call from Python pays and the compiled runner does not.
    """

    __slots__ = (
        "block_hashes",
        "cache_control_ttl_s",
        "cache_salt",
        "client_hashed",
        "lora_int_id",
        "lora_name",
        "lora_path",
        "mm_features",
        "packed",
        "prompt_embeds",
        "prompt_embeds_row_bytes",
        "prompt_token_ids",
        "request_id",
        "retention",
        "skip_reading_prefix_cache",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: tuple[MultiModalFeature, ...] = (),
        skip_reading_prefix_cache: bool = False,
        packed: bool = False,
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        prompt_embeds: bytes | None = None,
        prompt_embeds_row_bytes: int = 0,
        retention: RetentionConfig | None = None,
        cache_control_ttl_s: float | None = None,
        block_hashes: tuple[bytes, ...] = (),
        client_hashed: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.mm_features = mm_features
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        # The ids came as packed_prompt_token_ids: unsigned, so none can be negative,
        # and an error about one names that field.
        self.packed = packed
        # The LoRA adapter's path (hashed with its name, as vLLM 0.33 keys an adapter)
        # and int id (reported as lora_id in KV events); both need ``lora_name``.
        self.lora_path = lora_path
        self.lora_int_id = lora_int_id
        # Prompt embeddings: ``prompt_embeds_row_bytes`` bytes per prompt token,
        # row-major (vLLM hashes the raw bytes of each block's rows).
        self.prompt_embeds = prompt_embeds
        self.prompt_embeds_row_bytes = prompt_embeds_row_bytes
        # Eviction priorities of its blocks (needs the priority eviction policy).
        self.retention = retention
        # Pin the prompt's whole blocks for the tenant for this many seconds (Dynamo's
        # cache_control TTL), created with the request; None: no pin.
        self.cache_control_ttl_s = cache_control_ttl_s
        # The client's hashes of the prompt's full blocks, taken instead of hashing the
        # prompt when ``client_hashed`` (a trusted tenant only: ``client_hashes``).
        self.block_hashes = block_hashes
        self.client_hashed = client_hashed

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


class AllocateArgs:
    """The arguments of ``allocate_slots``, with the hit named by its block ids (the
    blocks themselves stay in the table) and an optional ``num_computed_tokens`` to
    set first. Nothing changes one after it is built.

    A plain class, neither a named tuple nor a dataclass: one is built per allocation
    (every entry of a decode step), and compiled by mypyc a plain class's ``__init__``
    is native, while a named tuple's ``__new__`` and a dataclass's ``__init__`` are
    Python that the standard library generates at import, run interpreted on every
    call (``benchmarks/bench_vllm_scheduler --profile`` names such frames under the
    Step runner). With both classes plain, ``python -m benchmarks.bench_decode_layers
    --layers table,step --rounds 15``, against the core in the same rounds: table
    1.97-2.00x -> 1.58-1.61x, step 3.10-3.24x -> 2.41-2.42x (3 runs each, alternating).
    """

    __slots__ = (
        "new_computed_block_ids",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_new_computed_tokens",
        "num_new_tokens",
        "options",
    )

    def __init__(
        self,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_block_ids: BlockIds = (),
        options: AllocationOptions = PLAIN_ALLOCATION,
        num_computed_tokens: int | None = None,
        num_in_flight_tokens: int = 0,
    ) -> None:
        self.num_new_tokens = num_new_tokens
        self.num_new_computed_tokens = num_new_computed_tokens
        self.new_computed_block_ids = new_computed_block_ids
        self.options = options
        self.num_computed_tokens = num_computed_tokens
        # Of the computed tokens, those whose step has not run (vLLM's async
        # scheduling): windows release blocks only below the rest. For this call only.
        self.num_in_flight_tokens = num_in_flight_tokens

    # Compared and hashed by value, as the named tuple it replaces was.
    def _values(self) -> tuple[int, int, BlockIds, AllocationOptions, int | None, int]:
        return (
            self.num_new_tokens,
            self.num_new_computed_tokens,
            self.new_computed_block_ids,
            self.options,
            self.num_computed_tokens,
            self.num_in_flight_tokens,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AllocateArgs) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        named = zip(_ALLOCATE_ARGS_FIELDS, self._values(), strict=True)
        return "AllocateArgs(" + ", ".join(f"{name}={value!r}" for name, value in named) + ")"


_ALLOCATE_ARGS_FIELDS = (
    "num_new_tokens",
    "num_new_computed_tokens",
    "new_computed_block_ids",
    "options",
    "num_computed_tokens",
    "num_in_flight_tokens",
)


class ComputedBlocks:
    """A prefix lookup: the hit's block ids per group and what vLLM reports with it.

    A plain class compared by value, as ``AllocateArgs`` is and for the same reason: one
    is built per lookup (a frozen dataclass's ``__init__`` runs interpreted)."""

    __slots__ = ("block_ids", "num_computed_tokens", "shared_prefix_boundary")

    def __init__(
        self, block_ids: BlockIds, num_computed_tokens: int, shared_prefix_boundary: int
    ) -> None:
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.shared_prefix_boundary = shared_prefix_boundary

    def _values(self) -> tuple[BlockIds, int, int]:
        return (self.block_ids, self.num_computed_tokens, self.shared_prefix_boundary)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ComputedBlocks) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return (
            f"ComputedBlocks(block_ids={self.block_ids!r}, "
            f"num_computed_tokens={self.num_computed_tokens!r}, "
            f"shared_prefix_boundary={self.shared_prefix_boundary!r})"
        )


class Allocation:
    """An AllocateSlots answer; ``new_block_ids`` is None when there was no room.

    Fresh blocks of a pool that needs zeroing are in exactly one list:
    ``block_ids_to_zero`` for a remote worker to zero (no runtime), or
    ``block_ids_zeroed`` when the co-located runtime zeroes them before the answer is
    sent. Copy-on-write copies ``(src, dst)`` of a partial prefix hit likewise:
    ``block_copies_to_apply`` (the worker applies them after zeroing, before the
    model writes) or ``block_copies_applied`` (the runtime did, after zeroing).
    Nothing changes one after it is built.

    A plain class, as ``AllocateArgs`` is and for the same reason: one is built per
    allocation.
    """

    __slots__ = (
        "block_copies_applied",
        "block_copies_to_apply",
        "block_ids_to_zero",
        "block_ids_zeroed",
        "new_block_ids",
        "request",
    )

    def __init__(
        self,
        request: Request,
        new_block_ids: BlockIdsPerGroup | None,
        block_ids_to_zero: Sequence[int] = (),
        block_ids_zeroed: Sequence[int] = (),
        block_copies_to_apply: Sequence[tuple[int, int]] = (),
        block_copies_applied: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.request = request
        self.new_block_ids = new_block_ids
        self.block_ids_to_zero = block_ids_to_zero
        self.block_ids_zeroed = block_ids_zeroed
        self.block_copies_to_apply = block_copies_to_apply
        self.block_copies_applied = block_copies_applied


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

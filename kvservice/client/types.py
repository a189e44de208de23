"""The plain values the client takes and returns: frozen dataclasses, no protobuf.

The wire's vocabulary, owned by the client: a client loads nothing of the core or the
request table (``tests/test_layout.py``), which have their own values for the same
concepts in the shapes they compute with (``kvservice.request_table.types``, the
core's ``AllocationOptions``, ``RequestStatus``, ``MultiModalFeature`` and
``BlockIds``). The wire meets them in one place per side: ``kvservice.server.converters``
(the server's protobuf to and from the table's values) and ``_wire`` here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, cast

# Block ids per KV cache group, in block-table order: ``block_ids[group][i]``.
BlockIds = tuple[tuple[int, ...], ...]


class RequestStatus(enum.Enum):
    """Where a request is in its life, as vLLM's scheduler tracks it."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FreeMode(enum.Enum):
    """What ``free`` does with the request: keep it for re-prefill, or forget it."""

    PREEMPT = "preempt"
    FINISH = "finish"


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item: ``length`` placeholder tokens from ``offset``."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RequestState:
    """A request as the server sees it after a call."""

    request_id: str
    status: RequestStatus
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_preemptions: int
    num_block_hashes: int


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix lookup; pass it unchanged as ``hit`` to ``allocate_slots``."""

    block_ids: BlockIds
    num_computed_tokens: int
    shared_prefix_boundary: int


class RequestStateOmittedError(LookupError):
    """``Allocation.request`` read from a step sent with ``omit_request_state``: the
    server did not send it."""


_OMITTED = (
    "the server omitted this operation's request state: the step was sent with "
    "omit_request_state (read the request with get_request instead)"
)


@dataclass(frozen=True, slots=True)
class Allocation:
    """A successful ``allocate_slots`` (no room is ``None``, as in vLLM).

    When the pool needs zeroing, the fresh blocks are in ``block_ids_to_zero`` (the
    caller's worker must zero them before use) or, when the server's co-located runtime
    owns the KV tensors, in ``block_ids_zeroed`` (already zeroed when this arrived).

    A prefix hit ending inside a block gets a private copy of that block: the copies
    ``(src_block_id, dst_block_id)`` are in ``block_copies_to_apply`` (the worker
    copies after zeroing, before the model writes) or ``block_copies_applied`` (the
    server's runtime already did).

    ``new_block_ids`` lists, per group, every entry the allocation appended to the
    request's block table. For a Mamba "align" group that includes null ids (0)
    padding the table up to the new state block, as vLLM 0.33's ``allocate_slots``
    answers (e.g. ``(0, 0, 0, 0, 6)`` beside a full-attention group's five blocks):
    append them to the worker's block table as they are, so its entries stay aligned
    with the token positions; block 0 is never allocated, zeroed or copied.

    ``request`` is the request after the call; a step sent with
    ``omit_request_state`` has none (``request_state`` is None), and reading
    ``request`` then raises ``RequestStateOmittedError``.
    """

    new_block_ids: BlockIds
    block_ids_to_zero: tuple[int, ...]
    request_state: RequestState | None
    block_ids_zeroed: tuple[int, ...] = ()
    block_copies_to_apply: tuple[tuple[int, int], ...] = ()
    block_copies_applied: tuple[tuple[int, int], ...] = ()

    @property
    def request(self) -> RequestState:
        """The request after the call (``RequestStateOmittedError`` when omitted)."""
        if self.request_state is None:
            raise RequestStateOmittedError(_OMITTED)
        return self.request_state

    def __repr__(self) -> str:
        request = "<omitted>" if self.request_state is None else repr(self.request_state)
        return (
            f"Allocation(new_block_ids={self.new_block_ids!r}, "
            f"block_ids_to_zero={self.block_ids_to_zero!r}, request={request}, "
            f"block_ids_zeroed={self.block_ids_zeroed!r}, "
            f"block_copies_to_apply={self.block_copies_to_apply!r}, "
            f"block_copies_applied={self.block_copies_applied!r})"
        )


class _OmittedRequestState:
    """The answer of an ``append_tokens`` in a step sent with ``omit_request_state``:
    it stands for the request state the server did not send, and reading any of its
    fields raises ``RequestStateOmittedError``."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # Only the state's own fields: protocol lookups (copy's __deepcopy__...) must
        # keep answering "no such attribute".
        if name.startswith("__"):
            raise AttributeError(name)
        raise RequestStateOmittedError(_OMITTED)

    def __repr__(self) -> str:
        return "<omitted>"


OMITTED_REQUEST_STATE = cast(RequestState, _OmittedRequestState())


@dataclass(frozen=True, slots=True)
class AllocateOptions:
    """The rarer arguments of vLLM's ``allocate_slots``; the defaults are vLLM's.

    ``num_computed_tokens``, when set, replaces the server's count before allocating
    (rejected draft tokens); it is restored if the call is refused or has no room.
    ``num_in_flight_tokens``: of the computed tokens, those whose step has not run yet
    (vLLM's async scheduling); windows release blocks only below the rest.
    """

    num_lookahead_tokens: int = 0
    num_external_computed_tokens: int = 0
    delay_cache_blocks: bool = False
    num_encoder_tokens: int = 0
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = True
    num_computed_tokens: int | None = None
    num_in_flight_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """The arguments of ``probe`` besides the request and its new tokens."""

    num_lookahead_tokens: int = 0
    num_external_computed_tokens: int = 0
    num_encoder_tokens: int = 0
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = True


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What a lookup plus ``allocate_slots`` would do now (nothing was changed)."""

    num_hit_tokens: int
    num_new_tokens: int
    num_blocks_to_allocate: int
    num_free_blocks: int
    would_fit: bool


@dataclass(frozen=True, slots=True)
class AdmitOptions:
    """How ``admit`` sizes and allocates each admission; the defaults are vLLM's."""

    # Off: a request whose uncached tokens exceed the budget left stops admission
    # instead of getting a chunk.
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0  # passed to every allocate_slots
    full_sequence_must_fit: bool = False  # passed to every allocate_slots


class AdmitStopReason(enum.Enum):
    """Why an ``admit`` stopped."""

    ALL_ADMITTED = "all_admitted"
    BUDGET_SPENT = "budget_spent"  # no token budget left for the next request
    NO_SPACE = "no_space"  # the next request did not fit (vLLM's None)
    NEEDS_CHUNKING = "needs_chunking"  # chunked prefill off, prompt over the budget left
    QUOTA = "quota"  # the next request would pass its tenant's block quota


@dataclass(frozen=True, slots=True)
class Admitted:
    """One admitted request: the prefix hit it was admitted with, its share of the
    token budget (the hit excluded) and its allocation."""

    request_id: str
    hit: ComputedBlocks
    num_new_tokens: int
    allocation: Allocation


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """The requests ``admit`` admitted (the first ``len(admitted)`` of those it was
    given, in order) and why it stopped."""

    admitted: tuple[Admitted, ...]
    stop_reason: AdmitStopReason
    # For QUOTA: the refusal the allocation would have answered.
    stop_message: str = ""


@dataclass(frozen=True, slots=True)
class FreeResult:
    """The request after ``free`` and the pool's free blocks."""

    request: RequestState
    num_free_blocks: int


@dataclass(frozen=True, slots=True)
class Usage:
    """Pool usage and prefix cache totals. ``usage``, ``num_free_blocks`` and
    ``num_blocks`` are the pool's; the others the caller's tenant's, unless
    ``pool_wide`` (asked for by an admin tenant, or a server without tenants)."""

    usage: float
    num_free_blocks: int
    num_used_blocks: int
    num_blocks: int
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    pool_wide: bool = True


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV cache group: layers sharing a block table."""

    # full_attention, sliding_window, chunked_local_attention, cross_attention, mamba
    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: str
    page_size_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    # Window-bounded groups: the most blocks admission (full_sequence_must_fit) counts
    # for one request; None for the others.
    max_admission_blocks_per_request: int | None = None
    # Cross-attention groups: the encoder input tokens they are sized by.
    max_num_encoder_input_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The pool layout and hashing parameters of the server."""

    num_blocks: int
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    hash_algo: str
    none_hash_seed_fingerprint: str
    enable_caching: bool
    needs_kv_cache_zeroing: bool
    model_name: str
    groups: tuple[KVCacheGroup, ...] = field(default=())
    # The server's co-located runtime zeroes fresh blocks itself (and on which device).
    blocks_zeroed_by_server: bool = False
    runtime_device: str = ""
    # Token ids the server accepts are below this; 0: no upper bound.
    vocab_size: int = 0
    # Blocks kept free for admissions while others run (vLLM's watermark).
    watermark_blocks: int = 0
    # Tokens one engine step may schedule before it has run (vLLM's
    # max_in_flight_tokens); it bounds max_admission_blocks_per_request. 0: not reported.
    max_in_flight_tokens: int = 0
    # vLLM's prefix_cache_retention_interval: 0 keeps, of the window and Mamba groups'
    # blocks, only those a replay or a shared-prefix junction needs (vLLM's default);
    # None: every reusable block is cached (dense).
    prefix_cache_retention_interval: int | None = None
    # The hash chain's seed when it is not secret (SHA variants' fixed seed, an explicit
    # --none-hash-seed, PYTHONHASHSEED); "" for a random xxhash seed.
    none_hash_seed: str = ""
    # Where it came from: "explicit", "PYTHONHASHSEED", "default" or "random".
    none_hash_seed_source: str = ""
    # Which free cached blocks are evicted first: "lru" (vLLM's order) or "priority".
    eviction_policy: str = "lru"
    # The most blocks pins may reserve; 0: pinning is off.
    max_pinned_blocks: int = 0
    # The pool serves engines drafting with EAGLE: a prefix hit drops its last block.
    use_eagle: bool = False
    # The groups an EAGLE drafter's drop applies to (empty without one).
    eagle_group_ids: tuple[int, ...] = ()
    # Tokens after each block its hash also covers (vLLM 0.33's lookahead hashes).
    num_hash_lookahead_tokens: int = 0
    # The caller may send client_hashed requests (add_request's block_hashes).
    trusts_client_block_hashes: bool = False

    @property
    def has_retention(self) -> bool:
        """Whether the pool may evict otherwise than vLLM's LRU: priorities, or pins (a
        replica of the pool then opens a replica session to follow them)."""
        return self.eviction_policy != "lru" or self.max_pinned_blocks > 0


# The default retention priority (TensorRT-LLM's), as the server's.
DEFAULT_RETENTION_PRIORITY = 35


@dataclass(frozen=True, slots=True)
class TokenRangeRetention:
    """Prompt tokens ``[start, end)`` (``end`` None: to the prompt's end) kept at
    ``priority`` (0: evicted first, 100: last) for ``duration_s`` seconds after their
    blocks are cached (None: as long as they stay cached)."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None


@dataclass(frozen=True, slots=True)
class Retention:
    """A request's eviction priorities (TensorRT-LLM's ``KvCacheRetentionConfig``):
    prompt ranges, and one priority and duration for the blocks decoding fills. A block
    takes the highest priority of the ranges it overlaps. Needs a server started with
    ``--eviction-policy priority``; the server checks the values."""

    token_ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_RETENTION_PRIORITY
    decode_duration_s: float | None = None


@dataclass(frozen=True, slots=True)
class Pin:
    """One pinned prefix of a tenant (``PinPrefix``, ``ListPins``)."""

    # Names the prefix; ``unpin_prefix`` takes it.
    pin_id: str
    # "" for the default tenant of a server without tenants.
    tenant: str
    num_tokens: int
    # Block keys the pin reserves against the pinned budget (cached or not), and of
    # those the blocks cached and held now.
    num_reserved_blocks: int
    num_held_blocks: int
    ttl_s: float | None
    refresh_on_hit: bool
    # Seconds left when the server answered; None: no TTL.
    expires_in_s: float | None
    num_hits: int


@dataclass(frozen=True, slots=True)
class PinList:
    """``ListPins``: the pins and the pool's pinned budget in blocks (held now,
    reserved by the pins, the most they may reserve; 0: pinning is off)."""

    pins: tuple[Pin, ...]
    num_pinned_blocks: int
    num_reserved_blocks: int
    max_pinned_blocks: int


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What the server's audit of its pool found (``ok`` when nothing is broken)."""

    ok: bool
    violations: tuple[str, ...]
    num_free_blocks: int
    num_held_blocks: int
    num_cached_blocks: int
    num_requests: int
    num_sessions: int
    num_owned_requests: int
    current_epoch: int
    duration_s: float


# -- retention changes a server ships a replica session (StepResponse.retention_events) --


@dataclass(frozen=True, slots=True)
class RetentionTick:
    """Time passes to ``now_s`` (the server's clock)."""

    now_s: float


@dataclass(frozen=True, slots=True)
class RetentionPin:
    """A pin placed by its cache keys (block hash and group id, as the pool files them)."""

    now_s: float
    owner: str
    pin_id: str
    num_tokens: int
    keys: tuple[bytes, ...]
    ttl_s: float | None
    refresh_on_hit: bool


@dataclass(frozen=True, slots=True)
class RetentionUnpin:
    now_s: float
    owner: str
    pin_id: str


RetentionChange = RetentionTick | RetentionPin | RetentionUnpin

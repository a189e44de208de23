"""Layer 1: ``KVCacheManager``, the scheduler's whole interface to KV memory.

The policy lives here: admission (``full_sequence_must_fit``), the watermark kept free
for admissions, ``reserved_blocks``, and the ``None`` that means "no room". Every check
runs before anything is committed, so a refused call leaves no trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvservice.core.allocation_checks import AllocationChecker
from kvservice.core.allocation_options import (
    PLAIN_ALLOCATION,
    AllocationOptions,
    allocation_options,
)
from kvservice.core.block_hashing import BlockHasher, MultiModalFeature
from kvservice.core.block_pool import resolve_block_hashes
from kvservice.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    QuotaExceededError,
)
from kvservice.core.kv_cache_block import BlockHash, BlockHashWithGroupId, KVCacheBlock
from kvservice.core.kv_cache_coordinator import get_kv_cache_coordinator
from kvservice.core.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
    hash_block_size_of,
    scale_for_context_parallelism,
    scheduler_block_size_of,
)
from kvservice.core.kv_events import BlockStored, KVCacheEvent
from kvservice.core.request import Request, RequestStatus
from kvservice.core.retention_policy import (
    Pin,
    PinPlaced,
    RetentionConfig,
    RetentionEvent,
    RetentionPolicy,
    Tick,
    check_duration,
)
from kvservice.core.stats import PrefixCacheStats


@dataclass(slots=True, init=False)
class KVCacheBlocks:
    """Blocks per KV cache group (``blocks[group][i]``): what the scheduler sees."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    # Written out: the one dataclasses generates runs interpreted in the compiled
    # core, and every lookup and allocation that finds or takes blocks builds one.
    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(frozen=True, slots=True)
class KVCacheBlockCopy:
    """A copy-on-write copy for the runtime: block ``dst_block_id`` must receive the
    content of ``src_block_id`` after zeroing and before the model writes into it."""

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True, slots=True)
class KVCacheBlockCopies:
    """The answer of ``KVCacheManager.take_kv_cache_block_copies``: the copies, and the
    blocks held so that neither end of a copy is recycled before it is applied. Pass
    ``retained_blocks`` to ``free_retained_blocks`` once the copies are applied."""

    copies: list[KVCacheBlockCopy]
    retained_blocks: list[KVCacheBlock]


@dataclass(frozen=True, slots=True)
class AllocationProbe:
    """The answer of ``KVCacheManager.probe``."""

    num_hit_tokens: int  # tokens the prefix cache would supply (admissions only)
    num_new_tokens: int  # tokens the probed allocation would compute
    num_blocks_to_allocate: int  # blocks it would take from the free queue
    num_free_blocks: int  # free blocks once out-of-window blocks are released
    would_fit: bool  # whether allocate_slots would return blocks rather than None


class KVCacheManager:
    """vLLM 0.33's ``KVCacheManager``: prefix lookup, slot allocation and freeing.

    Args:
        kv_cache_config: the pool and its KV cache groups.
        max_model_len: the longest sequence, in tokens.
        scheduler_block_size: the boundary every group agrees on; defaults to the LCM
            of the groups' block sizes.
        hash_block_size: tokens per prefix-cache hash; defaults to the GCD of the
            groups' block sizes.
        enable_caching: prefix caching on or off.
        log_stats: keep ``PrefixCacheStats`` for ``make_prefix_cache_stats``.
        enable_kv_cache_events: collect events for ``take_events``.
        watermark: fraction of ``num_blocks`` kept free when admitting waiting or
            preempted requests while others are scheduled.
        max_in_flight_tokens: tokens one request can have in flight in a step (the
            window-bounded admission cap); defaults to ``max_model_len``. vLLM passes
            ``VllmConfig.max_in_flight_tokens``: ``max_num_batched_tokens`` times its
            concurrent batches.
        hash_algo / none_hash_seed: the block hash function and its chain seed.
        use_eagle: an EAGLE drafter reads the groups marked ``is_eagle_group`` (all
            groups if none is marked): their hits give back one block.
        num_hash_lookahead_tokens: vLLM 0.33's lookahead block hashes (an EAGLE
            drafter's default, 1): each hash also covers the tokens after its block, so
            a block is cached once they exist, and the KV events publish them.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        enable_caching: bool = True,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        watermark: float = 0.0,
        max_in_flight_tokens: int | None = None,
        hash_algo: str = "sha256",
        none_hash_seed: str | None = None,
        use_eagle: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        eviction_policy: str = "lru",
        max_pinned_fraction: float = 0.0,
        max_pinned_blocks: int | None = None,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        if max_model_len <= 0:
            raise InvalidArgumentError(f"max_model_len must be positive, got {max_model_len}")
        if not 0.0 <= watermark < 1.0:
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark}")
        if not 0.0 <= max_pinned_fraction < 1.0:
            raise InvalidArgumentError(
                f"max_pinned_fraction must be in [0, 1), got {max_pinned_fraction}"
            )
        if max_in_flight_tokens is not None and max_in_flight_tokens < 0:
            raise InvalidArgumentError(
                f"max_in_flight_tokens must be >= 0 (0 or None: max_model_len), got "
                f"{max_in_flight_tokens}"
            )
        self.kv_cache_config = kv_cache_config
        # Block sizes below are in the scheduler's tokens: DCP-scaled for full attention.
        scheduler_view = scale_for_context_parallelism(
            kv_cache_config, dcp_world_size, pcp_world_size
        )
        if pcp_world_size > 1 and len(scheduler_view.kv_cache_groups) > 1:
            raise InvalidArgumentError(
                f"pcp_world_size={pcp_world_size}: prefill context parallelism supports one "
                f"KV cache group, the config has {len(scheduler_view.kv_cache_groups)}"
            )
        groups = scheduler_view.kv_cache_groups
        self.max_model_len = max_model_len
        # vLLM's default: a request may have up to max_model_len tokens in flight.
        self.max_in_flight_tokens = max_in_flight_tokens or max_model_len
        self.scheduler_block_size = scheduler_block_size or scheduler_block_size_of(groups)
        self.hash_block_size = hash_block_size or hash_block_size_of(groups)
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        if num_hash_lookahead_tokens and any(
            isinstance(g.kv_cache_spec, MambaSpec) for g in groups
        ):
            raise InvalidArgumentError(
                "lookahead block hashes (num_hash_lookahead_tokens) with a Mamba group are "
                "not supported by kvservice's manager"
            )
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.block_hasher = BlockHasher(
            self.hash_block_size, hash_algo, none_hash_seed, num_hash_lookahead_tokens
        )
        # vLLM's LRU and nothing else unless a policy or a pinned budget is asked for.
        # A replica takes its server's budget in blocks (a fraction would round anew).
        if max_pinned_blocks is None:
            max_pinned_blocks = int(max_pinned_fraction * (kv_cache_config.num_blocks - 1))
        retention_policy = (
            RetentionPolicy(eviction_policy, max_pinned_blocks)
            if eviction_policy != "lru" or max_pinned_blocks > 0
            else None
        )
        self.coordinator = get_kv_cache_coordinator(
            scheduler_view,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            max_in_flight_tokens=self.max_in_flight_tokens,
            use_eagle=use_eagle,
            retention_policy=retention_policy,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
        self.num_kv_cache_groups = len(groups)
        # Layer 1 reads the free count directly for its capacity checks.
        self.block_pool = self.coordinator.block_pool
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in groups))
        self._group_event_metadata = [
            (
                g.kv_cache_spec.kind.value,
                g.kv_cache_spec.sliding_window
                if isinstance(g.kv_cache_spec, SlidingWindowSpec)
                else None,
            )
            for g in groups
        ]
        # Block id -> holds handed out by take_kv_cache_block_copies, not yet released.
        self._retained_holds: Counter[int] = Counter()
        # Whether the caller announces its scheduler steps (new_step_starts). Until it
        # first does, each allocate_slots is a step of its own: a caller unaware of
        # steps must not see Mamba hits refused for good.
        self._caller_steps = False
        self.checker = AllocationChecker(
            max_model_len,
            [
                None
                if isinstance(g.kv_cache_spec, CrossAttentionSpec)
                else g.kv_cache_spec.block_size
                for g in groups
            ],
            lambda request_id: any(self.coordinator.get_blocks(request_id)),
        )

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that requests hold (``vllm:kv_cache_usage_perc``)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call; starts a fresh window."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Iterable[MultiModalFeature] = (),
        skip_reading_prefix_cache: bool = False,
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        prompt_embeds: bytes | None = None,
        retention: RetentionConfig | None = None,
    ) -> Request:
        """A ``Request`` hashed with this manager's hash function and block size.
        ``retention`` needs the priority eviction policy (FailedPreconditionError)."""
        if retention is not None and not self.priorities_enabled:
            raise FailedPreconditionError(
                f"request {request_id!r} carries retention priorities, but this pool "
                f"evicts by LRU only; start it with the priority eviction policy "
                f"(--eviction-policy priority) to honour them"
            )
        return Request(
            request_id,
            prompt_token_ids,
            self.block_hasher,
            cache_salt=cache_salt,
            lora_name=lora_name,
            mm_features=mm_features,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            lora_path=lora_path,
            lora_int_id=lora_int_id,
            prompt_embeds=prompt_embeds,
            retention=retention,
        )

    def new_step_starts(self) -> None:
        """Tell the manager that the scheduler starts a new step, as vLLM's scheduler
        does at the top of each ``schedule()``. A Mamba state cached during a step is
        only written by that step's forward pass (or copy), so a prefix hit on it is
        refused (``allocate_slots`` answers None) until the next step starts.

        A manager never told of steps treats every ``allocate_slots`` call as a step of
        its own; the first call of this method hands the steps to the caller."""
        self._caller_steps = True
        self.coordinator.new_step_starts()

    # -- lookup -----------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The cached prefix of a waiting request: ``(blocks, num_new_computed_tokens,
        shared_prefix_boundary)``.

        The hit is capped at ``max_cache_hit_length``, by default ``num_tokens - 1``:
        the last token must be computed to produce logits, and with block-aligned hits a
        fully cached prompt recomputes its last block. Takes no references (two requests
        may see the same hit before either allocates). Side effects: records prefix
        cache stats when ``log_stats``, and notes the boundary on the request (0: none),
        so that sparse retention keeps the junction cached for the next request sharing
        the prefix.
        """
        self.checker.check_not_finished(request)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            request.shared_prefix_boundary = 0
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, num_hit_tokens, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_hit_tokens,
                preempted=request.num_preemptions > 0,
            )
        boundary = num_hit_tokens + num_uncached if num_uncached else 0
        request.shared_prefix_boundary = boundary  # as vLLM's scheduler records it
        return self.create_kv_cache_blocks(blocks), num_hit_tokens, boundary

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> KVCacheBlocks | None:
        """vLLM 0.33's ``allocate_slots``, argument for argument: see
        ``allocate_slots_with_options``, which takes the arguments after the hit as one
        ``AllocationOptions``."""
        options = allocation_options(
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        )
        return self.allocate_slots_with_options(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, options
        )

    def allocate_slots_with_options(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        options: AllocationOptions,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Allocate slots for ``num_new_tokens`` more tokens of ``request``.

        Token layout::

            | < comp > | < new_comp > | < ext_comp >  | < new >  | < lookahead > |
                                                      |   < to be computed >     |
                                     |            < to be allocated >           |

        comp = ``request.num_computed_tokens``; new_comp = local prefix hits not yet
        attached (``num_new_computed_tokens``, ``new_computed_blocks``); ext_comp =
        tokens a KV connector will load; new = tokens to compute; lookahead = speculative
        slots (allocated, never hashed). The external blocks of the groups in
        ``skip_zeroing_group_ids`` are not listed for zeroing (an asynchronous load
        writes them); nothing else depends on it, so it is not an allocation option.

        Returns the entries appended to each group's block table (never the hit blocks;
        a private copy of a hit block that the hit ends inside comes first; a Mamba
        "align" group lists its null padding too), or None when the pool cannot take
        the request now, or when its Mamba hit was cached earlier in this step (see
        ``new_step_starts``). None changes no block table nor reference, though blocks
        that slid out of view are released first, as in vLLM. Blocks that fill up are
        hashed into the prefix cache now, up to ``request.num_tokens`` (draft tokens
        that may be rejected are never cached), unless ``options.delay_cache_blocks``.

        Raises ``InvalidArgumentError`` for negative counts or zero tokens,
        ``OutOfRangeError`` past ``max_model_len`` and ``FailedPreconditionError`` for
        a finished request or ``num_computed_tokens`` going backwards.
        """
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        num_computed_tokens = request.num_computed_tokens
        self.checker.check_allocation(
            request, num_computed_tokens, num_new_tokens, num_new_computed_tokens, hits, options
        )
        request_id = request.request_id
        num_external_computed_tokens = options.num_external_computed_tokens
        num_encoder_tokens = options.num_encoder_tokens
        num_local_computed_tokens = num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = num_local_computed_tokens + num_external_computed_tokens
        coordinator = self.coordinator
        block_pool = self.block_pool

        watermark_blocks = self._watermark_blocks_for(request, options)
        if options.full_sequence_must_fit and not self._full_sequence_fits(
            request, hits, num_local_computed_tokens, options, watermark_blocks
        ):
            return None

        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(
            num_tokens_main_model + options.num_lookahead_tokens, self.max_model_len
        )

        # Free what has slid out of view before counting, so the request may cover its
        # need with memory it just released. Safe even if the request is refused below.
        # Only below the processed tokens: a step in flight still reads its window.
        coordinator.remove_skipped_blocks(
            request_id, max(0, total_computed_tokens - request.num_in_flight_tokens)
        )
        num_required = self._num_required(
            request_id, hits, num_local_computed_tokens, num_new_tokens, options
        )
        free_blocks = block_pool.get_num_free_blocks() - options.reserved_blocks
        if num_required + watermark_blocks > free_blocks:
            return None

        if num_external_computed_tokens > 0 or any(hits):
            coordinator.allocate_new_computed_blocks(
                request_id,
                hits,
                num_local_computed_tokens,
                num_external_computed_tokens,
                skip_zeroing_group_ids,
            )
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_encoder_tokens, num_tokens_main_model
        )
        self.checker.record_allocation(request_id, num_computed_tokens)

        if self.enable_caching and not options.delay_cache_blocks:
            coordinator.cache_blocks(request, min(num_tokens_main_model, request.num_tokens))
        if not self._caller_steps:
            coordinator.new_step_starts()
        return self.create_kv_cache_blocks(new_blocks)

    def take_kv_cache_block_copies(self) -> KVCacheBlockCopies:
        """The copy-on-write copies queued since the last call, for the runtime.

        Each copy's source and destination stay held (``retained_blocks``: source,
        destination, source, ... in copy order) until the caller passes them to
        ``free_retained_blocks``, once the copies are applied: as in vLLM 0.33, where
        the scheduler frees them after the copy's step. Holding the source keeps it from
        being reused (and zeroed) before the copy reads it.
        """
        copies = self.coordinator.take_pending_cow_copies()
        retained = [block for pair in copies for block in pair]
        self._retained_holds.update(b.block_id for b in retained)
        return KVCacheBlockCopies(
            [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in copies], retained
        )

    def free_retained_blocks(self, retained_blocks: Sequence[KVCacheBlock]) -> None:
        """Release the holds of ``take_kv_cache_block_copies``, in the order given, as
        vLLM's scheduler does (the order decides which blocks are evicted first)."""
        releasing = Counter(b.block_id for b in retained_blocks)
        for block_id, count in releasing.items():
            if self._retained_holds[block_id] < count:
                raise FailedPreconditionError(
                    f"block {block_id} is not held for a copy; retained blocks are released once"
                )
        self._retained_holds -= releasing  # also drops the counts reaching zero
        self.block_pool.free_blocks(retained_blocks)

    @property
    def retained_holds(self) -> Counter[int]:
        """Block id -> holds taken by ``take_kv_cache_block_copies`` not yet released."""
        return self._retained_holds

    def _watermark_blocks_for(self, request: Request, options: AllocationOptions) -> int:
        # The watermark only guards admissions, and only when something else runs.
        if options.has_scheduled_reqs and request.status in _WAITING_STATES:
            return self.watermark_blocks
        return 0

    def _full_sequence_fits(
        self,
        request: Request,
        hits: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        options: AllocationOptions,
        watermark_blocks: int,
    ) -> bool:
        """The admission gate: could the whole sequence be held now (window-bounded
        groups counted at their admission cap)?"""
        full_num_tokens = min(request.num_tokens, self.max_model_len)
        num_required = self.coordinator.get_num_blocks_to_allocate(
            request.request_id,
            full_num_tokens,
            hits,
            options.num_encoder_tokens,
            num_local_computed_tokens + options.num_external_computed_tokens,
            apply_admission_cap=True,
            num_local_computed_tokens=num_local_computed_tokens,
            num_tokens_main_model=full_num_tokens,
        )
        return num_required + watermark_blocks <= self.block_pool.get_num_free_blocks()

    def probe(
        self,
        request: Request,
        num_new_tokens: int | None = None,
        options: AllocationOptions = PLAIN_ALLOCATION,
    ) -> AllocationProbe:
        """What ``get_computed_blocks`` + ``allocate_slots`` would do now, without doing
        it: no references taken, no block freed, LRU order and stats untouched.

        A request holding no blocks is probed as an admission (its prefix hit is looked
        up); one holding blocks as a running request. ``num_new_tokens`` defaults to the
        request's tokens not yet computed nor hit. Raises what ``allocate_slots`` would.
        """
        self.checker.check_not_finished(request)
        request_id = request.request_id
        hits: tuple[Sequence[KVCacheBlock], ...] = ()
        num_hit_tokens = 0
        admitting = not any(self.coordinator.get_blocks(request_id))
        if admitting and self.enable_caching and not request.skip_reading_prefix_cache:
            hits, num_hit_tokens, _ = self.coordinator.find_longest_cache_hit(
                request.block_hashes, request.num_tokens - 1
            )
        num_computed_tokens = request.num_computed_tokens
        num_local_computed_tokens = num_computed_tokens + num_hit_tokens
        total_computed_tokens = num_local_computed_tokens + options.num_external_computed_tokens
        if num_new_tokens is None:
            num_new_tokens = max(request.num_tokens - total_computed_tokens, 0)
        self.checker.check_allocation(
            request, num_computed_tokens, num_new_tokens, num_hit_tokens, hits, options
        )
        watermark_blocks = self._watermark_blocks_for(request, options)
        fits = not options.full_sequence_must_fit or self._full_sequence_fits(
            request, hits, num_local_computed_tokens, options, watermark_blocks
        )
        num_free = self.block_pool.get_num_free_blocks() + (
            self.coordinator.get_num_blocks_freed_by_skipping(request_id, total_computed_tokens)
        )
        num_required = self._num_required(
            request_id, hits, num_local_computed_tokens, num_new_tokens, options
        )
        fits = fits and num_required + watermark_blocks <= num_free - options.reserved_blocks
        return AllocationProbe(num_hit_tokens, num_new_tokens, num_required, num_free, fits)

    def num_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        options: AllocationOptions = PLAIN_ALLOCATION,
    ) -> int:
        """Free blocks ``allocate_slots`` with these arguments would consume, net of
        those it first releases because they slid out of view: what a cap on one
        owner's blocks must admit. Checks the arguments as ``allocate_slots`` does;
        changes nothing."""
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        num_computed_tokens = request.num_computed_tokens
        self.checker.check_allocation(
            request, num_computed_tokens, num_new_tokens, num_new_computed_tokens, hits, options
        )
        num_local_computed_tokens = num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = num_local_computed_tokens + options.num_external_computed_tokens
        request_id = request.request_id
        return self._num_required(
            request_id, hits, num_local_computed_tokens, num_new_tokens, options
        ) - self.coordinator.get_num_blocks_freed_by_skipping(request_id, total_computed_tokens)

    def _num_required(
        self,
        request_id: str,
        hits: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_new_tokens: int,
        options: AllocationOptions,
    ) -> int:
        """The predictor's count for an allocation: the blocks it would take from the
        free queue."""
        total_computed_tokens = num_local_computed_tokens + options.num_external_computed_tokens
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        return self.coordinator.get_num_blocks_to_allocate(
            request_id,
            min(num_tokens_main_model + options.num_lookahead_tokens, self.max_model_len),
            hits,
            options.num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens=num_local_computed_tokens,
            num_tokens_main_model=num_tokens_main_model,
        )

    # -- retention policy: pins and priorities --------------------------------------

    @property
    def retention_policy(self) -> RetentionPolicy | None:
        return self.block_pool.retention_policy

    @property
    def priorities_enabled(self) -> bool:
        return self.retention_policy is not None and self.retention_policy.priorities_enabled

    def expire_retention(self, now: float) -> None:
        """Let time pass to ``now`` (seconds, any monotonic origin): expired pins let go
        of their blocks, expired priorities revert. The caller owns the clock, so a
        replica can follow its server's time exactly."""
        self.block_pool.expire_retention(now)

    def pin_prefix(
        self,
        tenant: str,
        token_ids: Sequence[int],
        now: float,
        *,
        ttl_s: float | None = None,
        refresh_on_hit: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> Pin:
        """Pin the whole blocks of ``token_ids`` for ``tenant`` (for ``ttl_s`` seconds
        from ``now``, refreshed by each hit with ``refresh_on_hit``; None: until
        unpinned). Blocks not cached yet join the pin when they are. Pinning a prefix
        the tenant has pinned already refreshes that pin. Raises InvalidArgumentError
        for a prefix shorter than a block, QuotaExceededError past the pinned budget."""
        probe = self.new_request(
            f"pin:{tenant}",
            token_ids,
            cache_salt=cache_salt,
            lora_name=lora_name,
            lora_path=lora_path,
        )
        return self.pin_request_prompt(
            tenant, probe, now, ttl_s=ttl_s, refresh_on_hit=refresh_on_hit
        )

    def pin_request_prompt(
        self,
        tenant: str,
        request: Request,
        now: float,
        *,
        ttl_s: float | None = None,
        refresh_on_hit: bool = False,
    ) -> Pin:
        """``pin_prefix`` of ``request``'s prompt, by the request's own block hashes
        (whatever entered them: multimodal items, embeddings, the engine's hash
        function)."""
        pin_id, num_tokens, keys = self.prepare_pin(tenant, request)
        check_duration(ttl_s, "pin TTL")
        self.expire_retention(now)
        return self.place_pin(
            PinPlaced(now, tenant, pin_id, num_tokens, keys, ttl_s, refresh_on_hit)
        )

    def prepare_pin(
        self, tenant: str, request: Request
    ) -> tuple[str, int, tuple[BlockHashWithGroupId, ...]]:
        """The id, token count and cache keys of a pin of ``request``'s prompt (its
        whole blocks), placing nothing. InvalidArgumentError for no tenant or a prompt
        shorter than a block."""
        if not tenant:
            raise InvalidArgumentError("a pin needs a tenant")
        hashes = request.block_hashes[: request.num_prompt_tokens // self.hash_block_size]
        keys = self._pin_keys(hashes)
        if not keys:
            raise InvalidArgumentError(
                f"a pin covers whole blocks; {request.num_prompt_tokens} tokens do not fill "
                f"one block of {self.scheduler_block_size} tokens"
            )
        return hashes[-1].hex()[:32], len(hashes) * self.hash_block_size, keys

    def place_pin(self, placed: PinPlaced) -> Pin:
        """Place a prepared pin as of ``placed.now`` (time is not advanced: see
        ``expire_retention``); a pin of that owner and id already there is refreshed.
        QuotaExceededError (nothing changed) past the pinned budget."""
        expires_at = None if placed.ttl_s is None else placed.now + placed.ttl_s
        retention = self.retention_policy
        key = (placed.owner, placed.pin_id)
        existing = retention.pins.get(key) if retention is not None else None
        if existing is not None and retention is not None:
            existing.ttl_s, existing.expires_at = placed.ttl_s, expires_at
            existing.refresh_on_hit = placed.refresh_on_hit
            retention.schedule_pin_expiry(existing)
            return existing
        pin = Pin(
            placed.pin_id,
            placed.owner,
            placed.num_tokens,
            placed.keys,
            placed.ttl_s,
            placed.refresh_on_hit,
            expires_at,
        )
        self.block_pool.pin(pin)
        return pin

    def apply_retention_event(self, event: RetentionEvent) -> None:
        """Apply a change the pool's owner decided, as it applied it (a pin over the
        budget is dropped on both sides alike)."""
        if isinstance(event, Tick):
            self.expire_retention(event.now)
        elif isinstance(event, PinPlaced):
            with contextlib.suppress(QuotaExceededError):
                self.place_pin(event)
        else:
            self.unpin_prefix(event.owner, event.pin_id)

    def unpin_prefix(self, tenant: str, pin_id: str) -> bool:
        """Drop ``tenant``'s pin ``pin_id``; False if it has no such pin."""
        return self.block_pool.unpin(tenant, pin_id) is not None

    def list_pins(self, tenant: str | None = None) -> list[Pin]:
        """The pins of ``tenant`` (None: every tenant's), by tenant then id."""
        retention = self.retention_policy
        if retention is None:
            return []
        return [
            pin for key, pin in sorted(retention.pins.items()) if tenant is None or key[0] == tenant
        ]

    def _pin_keys(self, block_hashes: Sequence[BlockHash]) -> tuple[BlockHashWithGroupId, ...]:
        """The cache keys of the whole blocks ``block_hashes`` fingerprint, in every
        group a hit reads blocks from (attention groups other than cross attention)."""
        keys: list[BlockHashWithGroupId] = []
        for group_id, manager in enumerate(self.coordinator.single_type_managers):
            spec = manager.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or isinstance(spec, CrossAttentionSpec):
                continue
            hashes = resolve_block_hashes(block_hashes, self.hash_block_size, manager.block_size)
            suffix = group_id.to_bytes(4, "big")
            keys.extend(h + suffix for h in hashes)
        return tuple(keys)

    # -- freeing and bookkeeping --------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release every block of ``request``, last block first (per group).

        A request that was never allocated for (aborted while waiting) is a no-op. A
        finished request is forgotten; any other (preempted) stays known and restarts
        its ``num_computed_tokens`` check from 0.
        """
        self.coordinator.free(request.request_id)
        self.checker.record_free(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget ``request`` as ``free`` does, but keep its blocks referenced, held as
        ``take_kv_cache_block_copies``' are until ``free_retained_blocks``: vLLM's
        scheduler defers the free while a step in flight may still write them (a KV
        connector loading into a reused block would race that write). Table order, each
        group's leading null blocks left out."""
        blocks = self.coordinator.pop_blocks_for_free(request.request_id)
        self._retained_holds.update(b.block_id for b in blocks)
        self.checker.record_free(request)
        return blocks

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """List ``request_id``'s blocks from ``start_token`` (block-aligned) for zeroing
        again (``take_new_block_ids``): a failed asynchronous load left them unwritten."""
        self.checker.check_known(request_id)
        self.coordinator.record_blocks_for_zeroing(request_id, start_token)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        self.checker.check_known(request_id)
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The block table of each group (null blocks included, as id 0)."""
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks of this request that every request holding
        blocks shares (for cascade attention)."""
        self.checker.check_known(running_request_id)
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache entries of ``block_ids``, in the order given (see ``BlockPool``)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self, restore_block_order: bool = False) -> bool:
        """Forget every cached prefix; False (nothing changed) while blocks are in use.
        ``restore_block_order`` also returns the free queue to a new pool's order."""
        if not self.block_pool.reset_prefix_cache(restore_block_order):
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call; ``BlockStored`` gains its group's spec kind."""
        events = self.block_pool.take_events()
        metadata = self._group_event_metadata
        for i, event in enumerate(events):
            if (
                isinstance(event, BlockStored)
                and event.group_idx is not None
                and 0 <= event.group_idx < len(metadata)
            ):
                kind, window = metadata[event.group_idx]
                events[i] = dataclasses.replace(
                    event, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window
                )
        return events

    def take_new_block_ids(self) -> list[int]:
        """Blocks allocated since the last call, for the runtime to zero (recorded only
        when ``kv_cache_config.needs_kv_cache_zeroing``)."""
        return self.coordinator.take_new_block_ids()

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        # One shared empty object: most decode steps allocate nothing. (A loop, not
        # any(): the compiled core would call any() through a generic Python call;
        # bench_core decode-heavy: 8% faster with the loop, mixed 5%; 2 runs each,
        # spread 2-4%.)
        for group in blocks:
            if group:
                return KVCacheBlocks(blocks)
        return self.empty_kv_cache_blocks

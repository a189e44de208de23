"""Layer 2: ``KVCacheCoordinator`` fans each call out over the KV cache groups.

Three kinds, chosen by ``get_kv_cache_coordinator``: no prefix caching (any number of
groups), one group (``UnitaryKVCacheCoordinator``), or several groups that must agree on
one prefix hit (``HybridKVCacheCoordinator``). All groups draw from one ``BlockPool``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvservice.core.block_pool import BlockPool
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_block import BlockHash, KVCacheBlock
from kvservice.core.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvservice.core.retention_policy import RetentionPolicy
from kvservice.core.single_type_kv_cache_manager import (
    BlockCopy,
    CacheHitQuery,
    HitBlocks,
    MambaManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    manager_class_for_spec,
)

if TYPE_CHECKING:
    from kvservice.core.request import Request

# (hit blocks per group, hit length in tokens, tokens of a longer prefix that some group
# matched but the joint hit could not use)
CacheHit = tuple[HitBlocks, int, int]


def _validate_block_sizes(
    kv_cache_config: KVCacheConfig,
    enable_caching: bool,
    scheduler_block_size: int,
    hash_block_size: int,
) -> None:
    if scheduler_block_size <= 0 or hash_block_size <= 0:
        raise InvalidArgumentError(
            f"scheduler_block_size and hash_block_size must be positive, got "
            f"{scheduler_block_size} and {hash_block_size}"
        )
    if scheduler_block_size % hash_block_size != 0:
        raise InvalidArgumentError(
            f"scheduler_block_size ({scheduler_block_size}) must be a multiple of "
            f"hash_block_size ({hash_block_size})"
        )
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if scheduler_block_size % spec.block_size != 0:
            raise InvalidArgumentError(
                f"scheduler_block_size ({scheduler_block_size}) must be a multiple of KV cache "
                f"group {i}'s block_size ({spec.block_size}); use their least common multiple"
            )
        if enable_caching and isinstance(spec, CrossAttentionSpec):
            raise InvalidArgumentError(
                f"KV cache group {i} is cross attention, which cannot be prefix cached; "
                f"set enable_caching=False for encoder-decoder models"
            )
        if isinstance(spec, MambaSpec):
            _validate_mamba(i, spec, enable_caching)
        if enable_caching and spec.block_size % hash_block_size != 0:
            raise InvalidArgumentError(
                f"KV cache group {i}'s block_size ({spec.block_size}) must be a multiple of "
                f"hash_block_size ({hash_block_size})"
            )


def _validate_mamba(group_id: int, spec: MambaSpec, enable_caching: bool) -> None:
    if enable_caching and spec.mamba_cache_mode == "none":
        raise InvalidArgumentError(
            f"KV cache group {group_id} is Mamba with mamba_cache_mode 'none', which keeps no "
            f"prefix-cache states; with enable_caching=True mamba_cache_mode must be 'align' "
            f"(or the kvservice extension 'all', by name; or set enable_caching=False)"
        )
    if not enable_caching and spec.mamba_cache_mode != "none":
        raise InvalidArgumentError(
            f"KV cache group {group_id} has mamba_cache_mode {spec.mamba_cache_mode!r}, which "
            f"needs prefix caching; with enable_caching=False mamba_cache_mode must be one "
            f"of ['none'] (or set enable_caching=True)"
        )


def _eagle_group_ids(kv_cache_config: KVCacheConfig, use_eagle: bool) -> frozenset[int]:
    if not use_eagle:
        return frozenset()
    groups = kv_cache_config.kv_cache_groups
    marked = frozenset(i for i, g in enumerate(groups) if g.is_eagle_group)
    # Unmarked: every attention group (a drafter has no Mamba or cross-attention state).
    ids = marked or frozenset(
        i
        for i, g in enumerate(groups)
        if not isinstance(g.kv_cache_spec, MambaSpec | CrossAttentionSpec)
    )
    for i in ids:
        if isinstance(
            groups[i].kv_cache_spec, ChunkedLocalAttentionSpec | CrossAttentionSpec | MambaSpec
        ):
            raise InvalidArgumentError(
                f"KV cache group {i} ({groups[i].kv_cache_spec.kind.value}) cannot serve an "
                f"EAGLE drafter; mark the drafter's groups with is_eagle_group"
            )
    return ids


def _validate_retention_interval(kv_cache_config: KVCacheConfig, scheduler_block_size: int) -> None:
    interval = kv_cache_config.prefix_cache_retention_interval
    if interval is None or interval == 0:
        return  # 0 is allowed everywhere: full attention simply stays dense
    if interval < 0:
        raise InvalidArgumentError(
            f"prefix_cache_retention_interval must be non-negative (or None), got {interval}"
        )
    if interval % scheduler_block_size != 0:
        raise InvalidArgumentError(
            f"prefix_cache_retention_interval ({interval}) must be a multiple of "
            f"scheduler_block_size ({scheduler_block_size})"
        )
    if not any(
        isinstance(g.kv_cache_spec, SlidingWindowSpec | MambaSpec)
        for g in kv_cache_config.kv_cache_groups
    ):
        raise InvalidArgumentError(
            f"prefix_cache_retention_interval={interval}, but the model has no sliding-window "
            f"or Mamba group to retain sparsely; full attention is always dense"
        )


class KVCacheCoordinator(ABC):
    """Owns the pool and one ``SingleTypeKVCacheManager`` per group."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int,
        use_eagle: bool = False,
        retention_policy: RetentionPolicy | None = None,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        _validate_block_sizes(
            kv_cache_config, enable_caching, scheduler_block_size, hash_block_size
        )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            retention_policy,
            num_hash_lookahead_tokens,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                kv_cache_spec=group.kv_cache_spec,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
                max_model_len=max_model_len,
                max_in_flight_tokens=max_in_flight_tokens,
                # vLLM zeroes attention pages only: a Mamba state is written whole
                # (or copied) before it is read.
                record_new_block_ids=kv_cache_config.needs_kv_cache_zeroing
                and isinstance(group.kv_cache_spec, AttentionSpec),
            )
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        # Cross attention is sized by the encoder input, not by the decoder's tokens.
        self._is_cross_attention = tuple(
            isinstance(g.kv_cache_spec, CrossAttentionSpec) for g in kv_cache_config.kv_cache_groups
        )
        self.eagle_group_ids = _eagle_group_ids(kv_cache_config, use_eagle)
        for gid in self.eagle_group_ids:
            self.single_type_managers[gid].use_eagle = True
        for manager in self.single_type_managers:
            if isinstance(manager, MambaManager):
                # Mamba checkpoints follow EAGLE's replay boundary.
                manager.drop_eagle_checkpoint_block = use_eagle
        _validate_retention_interval(kv_cache_config, scheduler_block_size)
        self.retention_interval = kv_cache_config.prefix_cache_retention_interval
        for manager in self.single_type_managers:
            manager.retention_interval = self.retention_interval
        self._setup()

    def _setup(self) -> None:
        """Subclass hook, run at the end of construction."""

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        *,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
    ) -> int:
        """Blocks the allocation will take from the free queue, summed over groups."""
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            if self._is_cross_attention[i]:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, apply_admission_cap
                )
            else:
                hits = new_computed_blocks[i] if new_computed_blocks else ()
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    hits,
                    total_computed_tokens,
                    apply_admission_cap,
                    num_local_computed_tokens=num_local_computed_tokens,
                    num_tokens_main_model=num_tokens_main_model,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> None:
        """Attach the prefix hits of every group, then allocate the external blocks
        (not listed for zeroing in ``skip_zeroing_group_ids``: a load writes them).

        Two phases: if one group allocated its external blocks before another group had
        touched its hits, the allocation could evict those untouched hit blocks and hand
        the same physical block out twice. A running request gets no new hits: nothing.
        """
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            assert not any(new_computed_blocks), "a running request cannot get new prefix hits"
            return
        for i, manager in enumerate(self.single_type_managers):
            hits = new_computed_blocks[i] if new_computed_blocks else ()
            manager.add_local_computed_blocks(
                request_id, hits, num_local_computed_tokens, num_external_computed_tokens
            )
        for i, manager in enumerate(self.single_type_managers):
            if not self._is_cross_attention[i]:
                manager.allocate_external_computed_blocks(
                    request_id,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                    i not in skip_zeroing_group_ids,
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_encoder_tokens: int = 0,
        num_tokens_main_model: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(request_id, num_encoder_tokens)
            if self._is_cross_attention[i]
            else manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for i, manager in enumerate(self.single_type_managers)
        )

    def take_pending_cow_copies(self) -> list[BlockCopy]:
        """Every group's queued copies, group by group (see
        ``SingleTypeKVCacheManager.take_pending_cow_copies``)."""
        copies: list[BlockCopy] = []
        for manager in self.single_type_managers:
            copies += manager.take_pending_cow_copies()
        return copies

    def new_step_starts(self) -> None:
        """The scheduler starts a new step: states cached in the last one are usable."""
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        boundaries = self.get_reachable_boundaries(request)
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens, boundaries)

    def get_replay_boundary(self, request: Request) -> int:
        """Where a replay of this prompt resumes: its last token is always recomputed;
        with EAGLE, one scheduler block earlier, whose drop needs the block after it."""
        if self.eagle_group_ids:
            sbs = self.scheduler_block_size
            return max(request.num_prompt_tokens // sbs * sbs - sbs, 0)
        return request.num_prompt_tokens - 1

    def get_reachable_boundaries(self, request: Request) -> tuple[int, ...]:
        """Positions later requests are known to resume from; only sparse retention
        (an interval configured) looks at them."""
        if self.retention_interval is None:
            return ()
        replay = self.get_replay_boundary(request)
        if request.shared_prefix_boundary:
            return (replay, request.shared_prefix_boundary)
        return (replay,)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Every group's ``pop_blocks_for_free``, group after group."""
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        for manager in self.single_type_managers:
            manager.record_blocks_for_zeroing(request_id, start_token)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_num_blocks_freed_by_skipping(self, request_id: str, total_computed_tokens: int) -> int:
        return sum(
            m.get_num_blocks_freed_by_skipping(request_id, total_computed_tokens)
            for m in self.single_type_managers
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers
        ]

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.single_type_managers)

    def take_new_block_ids(self) -> list[int]:
        ids: list[int] = []
        for manager in self.single_type_managers:
            ids.extend(manager.take_new_block_ids())
        return ids

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> CacheHit:
        """The longest prefix of at most ``max_cache_hit_length`` tokens that every group
        can reuse. Takes no references."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: no lookups, any number of groups (including none)."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> CacheHit:
        return tuple([] for _ in self.single_type_managers), 0, 0

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * len(self.single_type_managers)


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group, prefix caching on: the manager's own search, aligned to its block."""

    def _setup(self) -> None:
        assert len(self.single_type_managers) == 1
        manager = self._manager = self.single_type_managers[0]
        self.block_size = manager.block_size
        if self.block_pool.hash_block_size != self.block_size:
            raise InvalidArgumentError(
                f"with one KV cache group, hash_block_size ({self.block_pool.hash_block_size}) "
                f"must equal the group's block_size ({self.block_size})"
            )
        self._hit_query = CacheHitQuery(
            (0,), self.block_pool, manager.kv_cache_spec, self.block_size, manager.use_eagle
        )

    # The fan-outs below are the base class's loops for one group, without the loop:
    # they run on every decode step (bench_core decode-heavy: 6% faster with them,
    # mixed 7%; 2 runs each, spread under 2%).

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        *,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
    ) -> int:
        return self._manager.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks[0] if new_computed_blocks else (),
            total_computed_tokens,
            apply_admission_cap,
            num_local_computed_tokens=num_local_computed_tokens,
            num_tokens_main_model=num_tokens_main_model,
        )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_encoder_tokens: int = 0,
        num_tokens_main_model: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        return (self._manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model),)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._manager.cache_blocks(
            request, num_computed_tokens, self.get_reachable_boundaries(request)
        )

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self._manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> CacheHit:
        blocks, hit_length = type(self._manager).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, self._hit_query
        )
        # One group cannot lag behind another: no uncached shared prefix.
        return blocks, hit_length, 0


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups (full attention, sliding window, chunked local, Mamba) that must
    agree on one hit length, a multiple of every group's block size (the scheduler
    block size), or, with partial-block hits (``enable_partial_hash_hits``), of the
    hash block size: such a hit may end inside a block, which the request then copies.

    Groups with equal specs are searched together. Full attention goes first: its
    left-to-right hit is the tightest first bound, and since its hits are downward
    closed a shorter candidate only trims it. The other types are searched again with
    each shorter candidate until no group shortens it (a fixed point).
    """

    def _setup(self) -> None:
        self.enable_partial_hash_hits = self._partial_hash_hits_possible()
        hash_block_size = self.block_pool.hash_block_size
        self.alignment_tokens = (
            hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size
        )
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = self.alignment_tokens
        self.attention_groups = self._split_attention_groups()

    def _partial_hash_hits_possible(self) -> bool:
        """Partial-block hits, as vLLM 0.33 enables them: a Mamba "align" group whose
        block is larger than the hash block, and every group able to look hits up per
        hash block (full attention, Mamba) or with blocks of one hash block."""
        hash_block_size = self.block_pool.hash_block_size
        managers = self.single_type_managers
        has_fine_mamba = any(
            isinstance(m.kv_cache_spec, MambaSpec)
            and m.kv_cache_spec.mamba_cache_mode == "align"
            and m.block_size > hash_block_size
            for m in managers
        )
        return has_fine_mamba and all(
            m.supports_fine_grained_hash_lookup or m.block_size == hash_block_size for m in managers
        )

    def _split_attention_groups(self) -> list[_SpecGroup]:
        ids_by_spec: list[tuple[KVCacheSpec, list[int]]] = []
        for i, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if (
                isinstance(spec, ChunkedLocalAttentionSpec)
                and spec.block_size != self.alignment_tokens
            ):
                raise InvalidArgumentError(
                    f"KV cache group {i} (chunked local attention, block_size {spec.block_size}) "
                    f"needs every group to share its block size for prefix caching; the "
                    f"scheduler block size is {self.alignment_tokens}"
                )
            for known_spec, group_ids in ids_by_spec:
                if known_spec == spec:
                    group_ids.append(i)
                    break
            else:
                ids_by_spec.append((spec, [i]))
        groups: list[_SpecGroup] = []
        for spec, group_ids in ids_by_spec:
            # Groups searched together must agree on EAGLE, or one list would be a block
            # longer than the other; siblings of a drafter group are treated as drafters.
            use_eagle = any(gid in self.eagle_group_ids for gid in group_ids)
            for gid in group_ids:
                self.single_type_managers[gid].use_eagle = use_eagle
            query = CacheHitQuery(
                tuple(group_ids), self.block_pool, spec, self.alignment_tokens, use_eagle
            )
            groups.append(_SpecGroup(manager_class_for_spec(spec), query))
        groups.sort(key=lambda g: not isinstance(g.query.kv_cache_spec, FullAttentionSpec))
        return groups

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> CacheHit:
        num_groups = len(self.single_type_managers)
        hits_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        full_hit_length: dict[int, int] = {}
        longest = 0
        # With two types, full attention first, one pass, as vLLM 0.33's
        # ``is_simple_hybrid``: the second search ran with the full-attention bound and
        # only the full-attention list needs trimming (another pass would give an EAGLE
        # drop back again). vLLM's rule, not a speed case: bench_core hybrid is within
        # its spread without it.
        one_pass = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0].query.kv_cache_spec, FullAttentionSpec
        )
        hit_length = max_cache_hit_length
        while True:
            candidate = hit_length
            for group in self.attention_groups:
                query = group.query
                spec, first_id = query.kv_cache_spec, query.kv_cache_group_ids[0]
                is_full = isinstance(spec, FullAttentionSpec)
                if is_full and first_id in full_hit_length:
                    # Hits are downward closed: a shorter candidate only trims them (to
                    # a block boundary, or to a hash boundary with partial hits).
                    candidate = min(candidate, full_hit_length[first_id])
                    candidate -= candidate % min(spec.block_size, self.alignment_tokens)
                    continue
                max_length = candidate
                if query.use_eagle and not is_full:
                    # Match one unit past the candidate, then give it back: the drop
                    # lands on the candidate instead of one unit below it.
                    margin = (
                        self.alignment_tokens
                        if self.enable_partial_hash_hits
                        and group.manager_cls.supports_fine_grained_hash_lookup
                        else spec.block_size
                    )
                    max_length = min(candidate + margin, max_cache_hit_length)
                lists, length = group.manager_cls.find_longest_cache_hit(
                    block_hashes, max_length, query
                )
                assert length <= candidate, "a group's hit exceeded the joint candidate"
                for gid, blocks in zip(query.kv_cache_group_ids, lists, strict=True):
                    hits_by_group[gid] = blocks
                if is_full:
                    full_hit_length[first_id] = length
                longest = max(longest, length)
                candidate = length
            if candidate >= hit_length:
                break
            hit_length = candidate
            if one_pass:
                break
        for group in self.attention_groups:
            spec = group.query.kv_cache_spec
            if isinstance(spec, FullAttentionSpec):
                for gid in group.query.kv_cache_group_ids:
                    full_hits = hits_by_group[gid]
                    assert full_hits is not None
                    del full_hits[-(-hit_length // spec.block_size) :]
        result = tuple(hits if hits is not None else [] for hits in hits_by_group)
        return result, hit_length, longest - hit_length

    def _align_cacheable(self, num_tokens: int) -> int:
        """The longest prefix of ``num_tokens`` a later hit could match: hits end on
        scheduler-block boundaries, or anywhere with partial hits (rounding there would
        register a moved Mamba entry again)."""
        if self.enable_partial_hash_hits:
            return num_tokens
        return num_tokens - num_tokens % self.scheduler_block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        aligned = self._align_cacheable(num_computed_tokens)
        boundaries = self.get_reachable_boundaries(request)
        for manager in self.single_type_managers:
            num_tokens = aligned
            if manager.use_eagle and aligned > 0:
                # EAGLE matches one block past the aligned boundary, then drops it.
                num_tokens = min(num_computed_tokens, aligned + manager.block_size)
            manager.cache_blocks(request, num_tokens, boundaries)


@dataclass(frozen=True, slots=True)
class _SpecGroup:
    """KV cache groups with equal specs, searched together by the hybrid coordinator
    with their type's rule."""

    manager_cls: type[SingleTypeKVCacheManager]
    query: CacheHitQuery


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    scheduler_block_size: int,
    hash_block_size: int,
    max_in_flight_tokens: int,
    use_eagle: bool = False,
    retention_policy: RetentionPolicy | None = None,
    num_hash_lookahead_tokens: int = 0,
) -> KVCacheCoordinator:
    args = (
        max_model_len,
        enable_caching,
        enable_kv_cache_events,
        scheduler_block_size,
        hash_block_size,
        max_in_flight_tokens,
    )
    if not enable_caching or not kv_cache_config.kv_cache_groups:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config,
            *args,
            use_eagle=use_eagle,
            retention_policy=retention_policy,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config,
            *args,
            use_eagle=use_eagle,
            retention_policy=retention_policy,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
    return HybridKVCacheCoordinator(
        kv_cache_config, *args, use_eagle=use_eagle, retention_policy=retention_policy
    )

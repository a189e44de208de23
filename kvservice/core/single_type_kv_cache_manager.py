"""Layer 3: one ``SingleTypeKVCacheManager`` per KV cache group.

Each manager turns token counts into block counts with its own group's block size,
keeps the group's block table per request, and knows its attention type's rules: which
blocks a request no longer needs (``get_num_skipped_tokens``) and which cached blocks
make a usable prefix hit (``find_longest_cache_hit``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvservice.core.block_pool import BlockPool, resolve_block_hashes
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_block import BlockHash, BlockHashWithGroupId, KVCacheBlock
from kvservice.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

if TYPE_CHECKING:
    from kvservice.core.request import Request

HitBlocks = tuple[list[KVCacheBlock], ...]
# A copy-on-write copy the runtime must apply: (source block, destination block).
BlockCopy = tuple[KVCacheBlock, KVCacheBlock]


@dataclass(frozen=True, slots=True)
class CacheHitQuery:
    """What a prefix-hit search reads besides the hashes and the length bound: the KV
    cache groups searched together (one spec), the pool, the boundary a hit must end
    on, and whether an EAGLE drafter reads these groups. A coordinator builds one per
    spec, once; ``SingleTypeKVCacheManager.find_longest_cache_hit`` takes it."""

    kv_cache_group_ids: Sequence[int]
    block_pool: BlockPool
    kv_cache_spec: KVCacheSpec
    alignment_tokens: int
    use_eagle: bool = False


def sparse_retention_mask(
    block_indices: range,
    block_size: int,
    need: int,
    shift: int,
    alignment_tokens: int,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int],
) -> list[bool] | None:
    """Which blocks a group whose hit reads only ``need`` blocks must cache (None: all).

    A hit ends on an ``alignment_tokens`` boundary and reads the ``need`` blocks before
    it (shifted ``shift`` blocks later with EAGLE). Segments are ``alignment_tokens``
    long when ``retention_interval`` is None (dense: every reusable block), absent when
    it is 0, and ``retention_interval`` tokens otherwise; each keeps its last ``need``
    blocks. With an interval, the runs ending at each reachable boundary are kept too.

    Block size 16, need 1, interval 64, 256 tokens, replay boundary 255 (hit 240):
    blocks 3, 7, 11, 15 (segment ends) and 14 (before token 240).
    """
    segment = alignment_tokens if retention_interval is None else retention_interval
    per_segment = segment // block_size
    if retention_interval is None and per_segment == 0:
        return None  # hits may end inside any block (partial hits): all are reusable
    if per_segment and need >= per_segment:
        return None
    keep: set[int] = set()
    if per_segment:
        keep.update(i for i in block_indices if (i - shift) % per_segment >= per_segment - need)
    if retention_interval is not None:
        for boundary in reachable_boundaries:
            end = (boundary - boundary % alignment_tokens) // block_size
            if end > 0:
                keep.update(range(end - need + shift, end + shift))
    return [i in keep for i in block_indices]


class SingleTypeKVCacheManager(ABC):
    """Block tables of one KV cache group, drawing from the shared ``BlockPool``.

    ``num_cached_block[request_id]`` counts the leading blocks of a request already in
    the prefix cache; a request in it is running (it gets no new prefix hits).
    ``max_admission_blocks_per_request`` is the most blocks the admission gate
    (``full_sequence_must_fit``) counts for one request: set for window-bounded groups
    (a window plus the tokens in flight), None for the others.
    """

    spec_type: ClassVar[type[KVCacheSpec]]

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        record_new_block_ids: bool = False,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # The boundary a prefix hit may end on; the hybrid coordinator raises it to the
        # LCM of all groups' block sizes (or lowers it to the hash block size).
        self.cache_hit_alignment_tokens = self.block_size
        self._null_block = block_pool.null_block
        self._record_new_block_ids = record_new_block_ids
        self.new_block_ids: list[int] = []
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        # Set by the coordinator for the groups an EAGLE drafter reads.
        self.use_eagle = False
        # Sparse retention (KVCacheConfig.prefix_cache_retention_interval), set by the
        # coordinator; only window-bounded and Mamba groups make use of it.
        self.retention_interval: int | None = None
        # Requests whose hit ends inside a block: (table index, block), until the next
        # allocation gives them a private copy of it.
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        # (source, destination) copies not yet taken by the runtime. Each holds one
        # reference on both ends beyond the block tables', so that neither is recycled
        # (and zeroed) before the copy reads and writes it.
        self._pending_cow_copies: list[BlockCopy] = []

    # Hash-unit granularity lookups: full attention and Mamba can end a hit inside a
    # block; the other types need block-aligned hits (they turn partial hits off).
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    # -- prediction (no side effects) -------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        *,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
    ) -> int:
        """Blocks the allocation of ``num_tokens`` slots will take from the free queue.

        Counts the new blocks plus the prefix-hit blocks that are free now: touching
        them takes them out of the free queue, so they consume capacity although no new
        memory is used, plus one private copy when the hit ends inside a block. Must
        equal what ``add_local_computed_blocks``, ``allocate_external_computed_blocks``
        and ``allocate_new_blocks`` then take (``apply_admission_cap`` is the exception:
        the admission gate's upper bound). ``num_local_computed_tokens`` defaults to
        ``total_computed_tokens``.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        cap = self.max_admission_blocks_per_request
        if apply_admission_cap and cap is not None:
            num_required_blocks = min(num_required_blocks, cap)
        req_blocks = self.req_to_blocks.get(request_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        if request_id in self.num_cached_block:
            # Running: no new hits. Speculative decoding may have over-allocated earlier.
            return max(num_required_blocks - num_held, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_blocks = len(new_computed_blocks) + num_held
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, num_local_blocks), 0)
        num_skipped_hits = max(0, num_skipped_blocks - num_held)
        num_evictable = self._num_evictable(new_computed_blocks[num_skipped_hits:])
        num_local = num_local_computed_tokens
        if num_local is None:
            num_local = total_computed_tokens
        if self._has_partial_local_hit(new_computed_blocks, num_local):
            num_new_blocks += 1  # the private copy of the block the hit ends inside
        return num_new_blocks + num_evictable

    @staticmethod
    def _num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
        return sum(1 for block in blocks if block.ref_cnt == 0 and not block.is_null)

    def _has_partial_local_hit(
        self, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int
    ) -> bool:
        """Whether the local hit ends inside one of this group's blocks: the request
        must not write into that shared block, so it gets a private copy."""
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    # -- allocation -------------------------------------------------------------------

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Attach prefix-hit blocks to a new request's table (taking a reference).

        Hits that are already out of this group's window are replaced by null blocks.
        """
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"request {request_id!r} already holds blocks in this group"
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = max(self.get_num_skipped_tokens(total) // self.block_size, 0)
        hits = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(hits)
        else:
            assert not hits, "prefix hits with caching disabled"
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(hits)
        self.num_cached_block[request_id] = len(req_blocks)
        if self._has_partial_local_hit(hits, num_local_computed_tokens):
            # The shared tail block is never written: the next allocation swaps a private
            # copy in, and that copy is cached afresh once it fills.
            index = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (index, hits[-1])
            self.num_cached_block[request_id] = index

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Allocate the blocks a KV connector will load ``num_external_computed_tokens``
        into, after the local hits (and their null padding). Without
        ``record_for_zeroing`` they are not listed for zeroing: an asynchronous load
        writes them, and zeroing them at the same time would race it."""
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(total)
        if num_skipped_tokens > 0:
            # Some external tokens may be out of view already.
            num_external_computed_tokens = min(
                total - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(0, cdiv(total, self.block_size) - len(req_blocks))
        self._append_new_blocks(req_blocks, num_new, record_for_zeroing)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """Grow the request's table to hold ``num_tokens`` slots; return the new blocks
        (a private copy of a partially hit block first)."""
        cow_blocks: list[KVCacheBlock] = []
        partial = self._partial_hit_reqs.pop(request_id, None)
        if partial is not None:
            index, source = partial
            copy = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, index, source, copy)
            if self._record_new_block_ids:
                self.new_block_ids.append(copy.block_id)
            cow_blocks.append(copy)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return cow_blocks
        return cow_blocks + self._append_new_blocks(req_blocks, num_new)

    def _apply_cow(
        self, request_id: str, index: int, source: KVCacheBlock, copy: KVCacheBlock
    ) -> None:
        """Swap a private copy in for the partially hit ``source`` and queue the copy.

        The source keeps the reference the hit took (it is no longer in the table: that
        reference now holds it for the copy); the copy takes one beyond the table's.
        """
        req_blocks = self.req_to_blocks[request_id]
        assert req_blocks[index] is source and not source.is_null and source.ref_cnt > 0
        req_blocks[index] = copy
        self._pending_cow_copies.append((source, copy))
        copy.ref_cnt += 1

    def take_pending_cow_copies(self) -> list[BlockCopy]:
        """The copies queued since the last call. Both ends of each stay held: the
        caller releases them once the copies have been applied."""
        copies, self._pending_cow_copies = self._pending_cow_copies, []
        return copies

    @property
    def pending_cow_copies(self) -> Sequence[BlockCopy]:
        return self._pending_cow_copies

    def _append_new_blocks(
        self, req_blocks: list[KVCacheBlock], num_new: int, record_for_zeroing: bool = True
    ) -> list[KVCacheBlock]:
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def take_new_block_ids(self) -> list[int]:
        """Blocks allocated since the last call (the runtime zeroes them before use)."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """List the request's blocks from ``start_token`` (block-aligned) for zeroing
        again: blocks a failed asynchronous load left unwritten."""
        if not self._record_new_block_ids:
            return
        if start_token % self.block_size:
            raise InvalidArgumentError(
                f"start_token {start_token} is not a multiple of the block size {self.block_size}"
            )
        blocks = self.req_to_blocks.get(request_id, [])
        self.new_block_ids.extend(b.block_id for b in blocks[start_token // self.block_size :])

    def new_step_starts(self) -> None:
        """The scheduler starts a new step (only Mamba keeps per-step state)."""

    # -- caching ----------------------------------------------------------------------

    def cache_blocks(
        self, request: Request, num_tokens: int, reachable_boundaries: Sequence[int] = ()
    ) -> None:
        """Enter the request's blocks that ``num_tokens`` fills into the prefix cache.

        ``reachable_boundaries``: token positions a later request is known to resume
        from (the replay boundary, a shared-prefix junction); sparse-retention groups
        keep the blocks a hit ending there needs.
        """
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full_blocks = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
            block_mask=self.reachable_block_mask(
                num_cached_blocks, num_full_blocks, reachable_boundaries
            ),
        )
        self.num_cached_block[request_id] = num_full_blocks

    def reachable_block_mask(
        self, num_cached_blocks: int, num_full_blocks: int, reachable_boundaries: Sequence[int]
    ) -> list[bool] | None:
        """Which of the blocks being cached a later prefix hit can use; None = all."""
        return None

    # -- freeing ----------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first, so that a chain's tail is
        evicted before its root."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and return its blocks in table order, without the leading
        null blocks and still referenced: the caller frees them later (a step in
        flight may still write them)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        first = 0
        while first < len(blocks) and blocks[first].is_null:
            first += 1
        return blocks[first:]

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no future token attends to (their blocks can go)."""
        return 0

    def _num_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> int:
        """The leading table entries ``remove_skipped_blocks`` releases up to."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped_tokens <= 0 or not blocks:
            return 0
        return min(num_skipped_tokens // self.block_size, len(blocks))

    def _indices_to_remove(self, request_id: str, first: int, last: int) -> list[int]:
        """Table indices in ``[first, last)`` that ``_remove_blocks_in_range`` frees,
        last first: it stops at the first null block (everything before it was removed
        earlier)."""
        blocks = self.req_to_blocks.get(request_id, [])
        indices: list[int] = []
        for i in range(min(last, len(blocks)) - 1, first - 1, -1):
            if blocks[i].is_null:
                break
            indices.append(i)
        return indices

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Free the table entries in ``[first, last)``, later ones first, replacing them
        with the null block."""
        indices = self._indices_to_remove(request_id, first, last)
        if not indices:
            return
        blocks = self.req_to_blocks[request_id]
        removed = [blocks[i] for i in indices]
        for i in indices:
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks no future token attends to, replacing them with the null block."""
        num_skipped_blocks = self._num_skipped_blocks(request_id, total_computed_tokens)
        if num_skipped_blocks:
            self._remove_blocks_in_range(request_id, 0, num_skipped_blocks)

    def _indices_freed_by_skipping(self, request_id: str, total_computed_tokens: int) -> list[int]:
        """Table indices ``remove_skipped_blocks`` would release now."""
        num_skipped_blocks = self._num_skipped_blocks(request_id, total_computed_tokens)
        return self._indices_to_remove(request_id, 0, num_skipped_blocks)

    def get_num_blocks_freed_by_skipping(self, request_id: str, total_computed_tokens: int) -> int:
        """How many blocks ``remove_skipped_blocks`` would return to the free queue now
        (shared blocks only lose a reference). No side effects."""
        blocks = self.req_to_blocks.get(request_id, [])
        return sum(
            1
            for i in self._indices_freed_by_skipping(request_id, total_computed_tokens)
            if blocks[i].ref_cnt == 1
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks shared by every request holding blocks (cascade attention)."""
        return 0

    # -- prefix hits ------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls, block_hashes: Sequence[BlockHash], max_length: int, query: CacheHitQuery
    ) -> tuple[HitBlocks, int]:
        """The longest usable cached prefix of at most ``max_length`` tokens: one block
        list per group of ``query.kv_cache_group_ids`` (null blocks where the group
        needs nothing) and its length in tokens, a multiple of
        ``query.alignment_tokens``. Takes no references.

        ``query.use_eagle``: an EAGLE drafter recomputes the hidden states of the last
        hit block, so one block (one alignment unit at most) of the hit is given back."""


def _fine_grained_hit(
    query: CacheHitQuery,
    block_hashes: Sequence[BlockHash],
    first_fine_index: int,
    end_fine_index: int,
) -> tuple[int, list[KVCacheBlock]] | None:
    """The highest hash boundary in ``[first, end)`` that is cached in every group:
    ``(fine index, blocks)``, or None. ``block_hashes`` are per hash block."""
    block_pool, group_ids = query.block_pool, query.kv_cache_group_ids
    for fine_index in range(end_fine_index - 1, first_fine_index - 1, -1):
        hit = block_pool.get_cached_block(block_hashes[fine_index], group_ids)
        if hit is not None:
            return fine_index, hit
    return None


class FullAttentionManager(SingleTypeKVCacheManager):
    spec_type = FullAttentionSpec
    supports_fine_grained_hash_lookup = True

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: Sequence[BlockHash], max_length: int, query: CacheHitQuery
    ) -> tuple[HitBlocks, int]:
        """Left to right; the first miss ends the prefix (hashes are chained).

        With EAGLE, 48 cached tokens of block size 16 hit only 16 for a 48-token prompt:
        the cap at 47 leaves 2 blocks, and EAGLE gives one back.
        """
        block_pool, group_ids = query.block_pool, query.kv_cache_group_ids
        block_size = query.kv_cache_spec.block_size
        alignment_tokens = query.alignment_tokens
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_blocks = min(max_length // block_size, len(hashes))
        computed: HitBlocks = tuple([] for _ in group_ids)
        if len(group_ids) == 1:
            # The common case, without a list per probe and with the key built here
            # (bench_core admission-heavy: 12% faster with this; 2 runs, spread 1%).
            cache = block_pool.cached_block_hash_to_block
            suffix = group_ids[0].to_bytes(4, "big")
            out = computed[0]
            for i in range(num_blocks):
                block = cache.get_one_block(hashes[i] + suffix)
                if block is None:
                    break
                out.append(block)
        else:
            for i in range(num_blocks):
                hit = block_pool.get_cached_block(hashes[i], group_ids)
                if hit is None:
                    break
                # By index, here and below: zip(strict=True) compiles to a generic call
                # per hit block (the README's compiled core).
                for index, blocks in enumerate(computed):
                    blocks.append(hit[index])
        hit_length = len(computed[0]) * block_size
        if alignment_tokens < block_size:
            hit_length = cls._extend_into_next_block(
                query, block_hashes, max_length, computed, hit_length
            )
        if query.use_eagle and hit_length > 0:
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % alignment_tokens
        num_hit_blocks = cdiv(hit_length, block_size)
        for blocks in computed:
            del blocks[num_hit_blocks:]
        return computed, hit_length

    @staticmethod
    def _extend_into_next_block(
        query: CacheHitQuery,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        computed: HitBlocks,
        hit_length: int,
    ) -> int:
        """Partial hits: probe the hash boundaries inside the first block that missed,
        highest first; a partial entry there extends the hit into that block."""
        alignment_tokens = query.alignment_tokens
        assert alignment_tokens == query.block_pool.hash_block_size, (
            "partial-block hits are aligned to the hash block size"
        )
        scale = query.kv_cache_spec.block_size // alignment_tokens
        first = len(computed[0]) * scale
        end = min(first + scale - 1, max_length // alignment_tokens, len(block_hashes))
        found = _fine_grained_hit(query, block_hashes, first, end)
        if found is None:
            return hit_length
        fine_index, hit = found
        for index, blocks in enumerate(computed):
            blocks.append(hit[index])
        return (fine_index + 1) * alignment_tokens

    def cache_blocks(
        self, request: Request, num_tokens: int, reachable_boundaries: Sequence[int] = ()
    ) -> None:
        super().cache_blocks(request, num_tokens, reachable_boundaries)
        if self.block_size != self.block_pool.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Register the prompt's last reusable hash boundary as a partial entry when it
        falls inside a block, once the tokens up to it are computed (the same call
        registers it again after its block filled up, beside the block's full key).

        A resend of the prompt hits at most ``num_prompt_tokens - 1`` tokens; an EAGLE
        lookup reads the whole prompt before giving one hash block back.
        """
        hbs = self.block_pool.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        index = boundary // self.block_size
        if index < len(blocks):
            self.block_pool.cache_partial_block(
                request, blocks[index], boundary, self.kv_cache_group_id, self.block_size
            )

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Nothing to remove: every past token stays in view."""

    def get_num_blocks_freed_by_skipping(self, request_id: str, total_computed_tokens: int) -> int:
        return 0

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        num_holders = len(self.req_to_blocks)
        count = 0
        for block in self.req_to_blocks.get(running_request_id, []):
            if block.ref_cnt != num_holders:
                break
            count += 1
        return count


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Each token attends to the ``sliding_window`` tokens ending at itself."""

    spec_type = SlidingWindowSpec

    @property
    def sliding_window(self) -> int:
        spec = self.kv_cache_spec
        assert isinstance(spec, SlidingWindowSpec)
        return spec.sliding_window

    @staticmethod
    def num_contiguous_blocks_needed(sliding_window: int, block_size: int, use_eagle: bool) -> int:
        # -1: the current token is inside its own window; +1 with EAGLE, whose last
        # block is given back.
        return cdiv(sliding_window - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: Sequence[BlockHash], max_length: int, query: CacheHitQuery
    ) -> tuple[HitBlocks, int]:
        """Right to left: the hit ends at the latest run of cached blocks long enough to
        cover one window; blocks before the run are null. A run that reaches block 0
        counts even when shorter.

        Example, block size 4, window 8 (2 blocks needed), blocks 2 and 3 cached:
        ``[NULL, NULL, B2, B3]``, 16 tokens.
        """
        spec, use_eagle = query.kv_cache_spec, query.use_eagle
        assert isinstance(spec, SlidingWindowSpec)
        block_pool, group_ids = query.block_pool, query.kv_cache_group_ids
        block_size, alignment_tokens = spec.block_size, query.alignment_tokens
        need = cls.num_contiguous_blocks_needed(spec.sliding_window, block_size, use_eagle)
        # With EAGLE the run's last block is given back, so the block before it must end
        # on an aligned boundary.
        end_shift = 0 if use_eagle else 1
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_blocks = min(max_length // block_size, len(hashes))
        null = block_pool.null_block
        computed: HitBlocks = tuple([null] * num_blocks for _ in group_ids)
        run = 0
        found = False
        for i in range(num_blocks - 1, -1, -1):
            hit = block_pool.get_cached_block(hashes[i], group_ids)
            if hit is None:
                run = 0
                continue
            if run == 0 and ((i + end_shift) * block_size) % alignment_tokens != 0:
                continue  # a hit must end on an aligned boundary
            for index, blocks in enumerate(computed):
                blocks[i] = hit[index]
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run :]
                found = True
                break
        if not found:
            for blocks in computed:
                del blocks[run:]
        if use_eagle and computed[0]:
            for blocks in computed:
                blocks.pop()
        while (len(computed[0]) * block_size) % alignment_tokens != 0:
            for blocks in computed:
                blocks.pop()
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token.

        Window 4, 7 computed tokens: the next token (index 7) attends to tokens 4..7,
        so tokens 0..3 are skipped: 7 - 4 + 1 = 4.
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def reachable_block_mask(
        self, num_cached_blocks: int, num_full_blocks: int, reachable_boundaries: Sequence[int]
    ) -> list[bool] | None:
        """Only the window of blocks before a hit's end is ever read (see
        ``sparse_retention_mask``); with EAGLE, the window plus the block after it."""
        need = self.num_contiguous_blocks_needed(
            self.sliding_window, self.block_size, self.use_eagle
        )
        return sparse_retention_mask(
            range(num_cached_blocks, num_full_blocks),
            self.block_size,
            need,
            1 if self.use_eagle else 0,
            self.cache_hit_alignment_tokens,
            self.retention_interval,
            reachable_boundaries,
        )


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Tokens attend only within their chunk of ``attention_chunk_size`` tokens."""

    spec_type = ChunkedLocalAttentionSpec

    @property
    def attention_chunk_size(self) -> int:
        spec = self.kv_cache_spec
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        return spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: Sequence[BlockHash], max_length: int, query: CacheHitQuery
    ) -> tuple[HitBlocks, int]:
        """Blocks before the chunk holding token ``max_length`` are null (nothing will
        attend to them); from that chunk's start, left to right until the first miss.

        Chunk 8, block size 4, max_length 15: blocks 0-1 are null and only block 2
        (tokens 8-11) is probed: ``[NULL, NULL, B2]`` or ``[NULL, NULL]``.
        """
        spec = query.kv_cache_spec
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        assert not query.use_eagle, "EAGLE is not supported with chunked local attention"
        block_pool, group_ids = query.block_pool, query.kv_cache_group_ids
        block_size = spec.block_size
        assert block_size == query.alignment_tokens, (
            "chunked local attention needs hits aligned to its own block size"
        )
        chunk = spec.attention_chunk_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_blocks = min(max_length // block_size, len(hashes))
        start_block = ((max_length // chunk) * chunk) // block_size if max_length > 0 else 0
        null = block_pool.null_block
        computed: HitBlocks = tuple([null] * start_block for _ in group_ids)
        for i in range(start_block, num_blocks):
            hit = block_pool.get_cached_block(hashes[i], group_ids)
            if hit is None:
                break
            for index, blocks in enumerate(computed):
                blocks.append(hit[index])
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the next token's chunk (chunk 8: 13 -> 8, 7 -> 0)."""
        return (num_computed_tokens // self.attention_chunk_size) * self.attention_chunk_size


def mamba_prefill_checkpoint_position(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool
) -> int:
    """The last hash boundary of a prefill of ``num_tokens`` whose state a later
    request can reuse: a resend recomputes at least its last token; with EAGLE the
    hit gives one hash block back, so the boundary is one hash block lower."""
    proof_limit = num_tokens if drop_eagle_block else num_tokens - 1
    position = proof_limit // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


class MambaManager(SingleTypeKVCacheManager):
    """State-space layers: a block holds the state after its last token, and only the
    latest state is read, so everything before the block of the last computed token
    is released (and stays a prefix-cache entry until evicted).

    Mode "align" (vLLM's prefix caching mode) places the state of each step in the
    block of its last token and pads the positions before it with null blocks, which
    ``allocate_slots`` returns too, so the worker's block table stays aligned with the
    tokens. A request holds its current state block, the previous one until the next
    step has read it, and its speculative blocks, which move to the end of the table
    instead of being allocated again. With a hash block smaller than the block, the
    prompt's last reusable hash boundary is also registered (a partial entry), and a
    request that keeps writing into that block first moves the entry to a private copy.

    Mode "none" holds one state (plus the speculative ones) and caches nothing. Mode
    "all" is a kvservice extension, not in vLLM 0.33: it allocates a state block per
    ``block_size`` tokens like attention and caches each; only asked for by name.
    """

    spec_type = MambaSpec
    supports_fine_grained_hash_lookup = True

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        record_new_block_ids: bool = False,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            record_new_block_ids,
            max_admission_blocks_per_request,
        )
        assert isinstance(kv_cache_spec, MambaSpec)
        self.mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        # Set by the coordinator with EAGLE: checkpoints follow its replay boundary.
        self.drop_eagle_checkpoint_block = False
        # Keys cached during the current scheduler step. A state cached this step is
        # written by this step's forward pass (or copied by this step's copies), so a
        # request cannot start from it before the next step: see new_step_starts.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        # Align mode: the table index of the state block the previous step wrote (it is
        # read by the next step, then freed), the table entries already retired, and
        # the requests that took their first allocation (they hold their speculative
        # blocks, at the end of the table).
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        *,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
    ) -> int:
        if new_computed_blocks:
            last_hit = new_computed_blocks[-1].block_hash
            if last_hit is not None and last_hit in self.cached_blocks_this_step:
                # A state cached earlier in this step is not there yet: more blocks than
                # the pool has, so the request waits for the next step.
                return self.block_pool.num_gpu_blocks + 1
        if self.mode != "align":
            # Draft tokens get state blocks of their own, beyond the main model's tokens.
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.num_speculative_blocks * self.block_size,
                new_computed_blocks,
                total_computed_tokens,
                apply_admission_cap,
                num_local_computed_tokens=num_local_computed_tokens,
            )
        # Draft models have no Mamba layers: lookahead slots take no state block.
        n_main = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        num_local = num_local_computed_tokens
        if num_local is None:
            num_local = total_computed_tokens
        # Negative when speculative blocks were over-allocated earlier: the sum over the
        # groups is what vLLM compares with the free blocks.
        num_new_blocks = (
            cdiv(n_main, self.block_size)
            + self.num_speculative_blocks
            - len(new_computed_blocks)
            - len(self.req_to_blocks.get(request_id, ()))
        )
        has_partial_hit = (
            self._has_partial_local_hit(new_computed_blocks, num_local)
            or request_id in self._partial_hit_reqs
        )
        if has_partial_hit:
            num_new_blocks = max(num_new_blocks, 0) + 1
        if num_new_blocks > 0:
            # The table grows by nulls; only the state block (and the copy, and the
            # speculative blocks of a first allocation) are physical.
            cap = 1 + int(has_partial_hit)
            if request_id not in self._allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new_blocks = min(num_new_blocks, cap)
        return num_new_blocks + self._num_evictable(new_computed_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """Align mode returns every entry the step appends to the table, null padding
        included, so the worker's table stays aligned; a private copy of a partially
        hit block comes first."""
        if self.mode != "align":
            return super().allocate_new_blocks(
                request_id, num_tokens + self.num_speculative_blocks * self.block_size
            )
        n_main = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_spec = self.num_speculative_blocks
        num_required = cdiv(n_main, self.block_size) + num_spec
        partial = self._partial_hit_reqs.pop(request_id, None)
        allocated = request_id in self._allocated_block_reqs
        self._allocated_block_reqs.add(request_id)
        if num_required <= len(req_blocks) and partial is None:
            return []  # the state stays in its block
        prev_len = len(req_blocks)
        # The state the previous step wrote (or the hit's) is read by this step.
        if allocated:
            self.last_state_block_idx[request_id] = prev_len - 1 - num_spec
        elif prev_len > 0:
            self.last_state_block_idx[request_id] = prev_len - 1
        state_index = num_required - num_spec - 1
        if prev_len < state_index:
            req_blocks.extend([self._null_block] * (state_index - prev_len))
        if allocated:
            self._relocate_speculative_blocks(req_blocks, prev_len, state_index)
        num_new = max(num_required - len(req_blocks), 0) + (1 if partial is not None else 0)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        returned = req_blocks[prev_len:]
        if partial is not None:
            copy, new_blocks = new_blocks[0], new_blocks[1:]
            index, source = partial
            if allocated:
                self._move_partial_entry(request_id, index, source, copy)
            else:
                self._apply_cow(request_id, index, source, copy)
                returned.insert(0, copy)
            if self._record_new_block_ids:
                self.new_block_ids.append(copy.block_id)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return returned + new_blocks

    def _relocate_speculative_blocks(
        self, req_blocks: list[KVCacheBlock], prev_len: int, state_index: int
    ) -> None:
        """Move the speculative blocks this step leaves behind the new state to the end
        of the table (they are scratch: exclusively owned, never cached)."""
        for index in range(prev_len - self.num_speculative_blocks, prev_len):
            if index >= state_index:
                break
            block = req_blocks[index]
            assert self.block_pool.is_block_writable(block), (
                f"speculative block {block.block_id} is shared or cached"
            )
            req_blocks.append(block)
            req_blocks[index] = self._null_block

    def _move_partial_entry(
        self, request_id: str, index: int, source: KVCacheBlock, copy: KVCacheBlock
    ) -> None:
        """The owner of a partial entry writes on into its block (a running request's
        table only grows), so the entry moves to ``copy``, which the queued copy fills
        before the step overwrites ``source``. A hit on it waits for the next step."""
        assert self.req_to_blocks[request_id][index] is source
        self.block_pool.move_block_hashes(source, copy)
        self._pending_cow_copies.append((source, copy))
        source.ref_cnt += 1  # the copy's hold; ``copy`` holds only the one it was born with
        if copy.block_hash is not None:
            self.cached_blocks_this_step.add(copy.block_hash)

    def cache_blocks(
        self, request: Request, num_tokens: int, reachable_boundaries: Sequence[int] = ()
    ) -> None:
        request_id = request.request_id
        num_cached_before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, reachable_boundaries)
        num_cached_after = self.num_cached_block.get(request_id, 0)
        if self.mode == "align":
            partial_key = self._cache_partial_tail_block(request, num_tokens)
            if partial_key is not None:
                self.cached_blocks_this_step.add(partial_key)
        if num_cached_after > num_cached_before:
            blocks = self.req_to_blocks[request_id]
            for block in blocks[num_cached_before:num_cached_after]:
                if not block.is_null and block.block_hash is not None:
                    self.cached_blocks_this_step.add(block.block_hash)

    def _cache_partial_tail_block(
        self, request: Request, num_tokens: int
    ) -> BlockHashWithGroupId | None:
        """A state exists only where a step ended: when the computed tokens end exactly
        on the prompt's last reusable hash boundary, register that state. Inside a
        block, the request becomes the entry's owner: its next allocation moves the
        entry to a private copy before writing on."""
        hbs = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        boundary = mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, hbs, self.drop_eagle_checkpoint_block
        )
        if num_tokens != boundary:
            return None
        index = cdiv(num_tokens, self.block_size) - 1
        blocks = self.req_to_blocks.get(request.request_id, [])
        if index >= len(blocks) or blocks[index].is_null:
            return None
        source = blocks[index]
        if source.block_hash_num_tokens == num_tokens:
            return None  # already keyed here (a hit, or an earlier step)
        key = self.block_pool.cache_partial_block(
            request, source, num_tokens, self.kv_cache_group_id, self.block_size
        )
        if key is not None and num_tokens % self.block_size:
            self._partial_hit_reqs[request.request_id] = (index, source)
            self.num_cached_block[request.request_id] = index
        return key

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is read again."""
        return num_computed_tokens - 1

    def _indices_to_remove(self, request_id: str, first: int, last: int) -> list[int]:
        if self.mode != "align":
            return super()._indices_to_remove(request_id, first, last)
        # Align mode leaves null gaps between states: look past them, from the entries
        # not retired yet.
        blocks = self.req_to_blocks.get(request_id, [])
        first = max(first, self._num_retired_blocks.get(request_id, 0))
        last = min(last, len(blocks))
        return [i for i in range(last - 1, first - 1, -1) if not blocks[i].is_null]

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        super()._remove_blocks_in_range(request_id, first, last)
        if self.mode == "align":
            blocks = self.req_to_blocks.get(request_id, [])
            last = min(last, len(blocks))
            if max(first, self._num_retired_blocks.get(request_id, 0)) < last:
                self._num_retired_blocks[request_id] = last

    def _stale_state_index(self, request_id: str, total_computed_tokens: int) -> int | None:
        """Align mode: the table index of the previous step's state once this step no
        longer reads it, if it is still held."""
        index = self.last_state_block_idx.get(request_id)
        if index is None or index >= cdiv(total_computed_tokens, self.block_size) - 1:
            return None
        if self.req_to_blocks[request_id][index].is_null:
            return None
        return index

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, total_computed_tokens)
        if self.mode != "align":
            return
        index = self._stale_state_index(request_id, total_computed_tokens)
        if index is not None:
            blocks = self.req_to_blocks[request_id]
            self.block_pool.free_blocks([blocks[index]])
            blocks[index] = self._null_block

    def _indices_freed_by_skipping(self, request_id: str, total_computed_tokens: int) -> list[int]:
        indices = super()._indices_freed_by_skipping(request_id, total_computed_tokens)
        if self.mode == "align":
            index = self._stale_state_index(request_id, total_computed_tokens)
            if index is not None and index not in indices:
                indices.append(index)
        return indices

    def reachable_block_mask(
        self, num_cached_blocks: int, num_full_blocks: int, reachable_boundaries: Sequence[int]
    ) -> list[bool] | None:
        """A hit reads one state, at an aligned boundary: keep those states only."""
        return sparse_retention_mask(
            range(num_cached_blocks, num_full_blocks),
            self.block_size,
            1,
            0,
            self.cache_hit_alignment_tokens,
            self.retention_interval,
            reachable_boundaries,
        )

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: Sequence[BlockHash], max_length: int, query: CacheHitQuery
    ) -> tuple[HitBlocks, int]:
        """Right to left: the latest cached state ending on an aligned boundary is the
        whole hit (``[NULL] * i + [state]``); earlier states are never read. With
        partial hits (alignment below the block size) every hash boundary is a
        candidate, mid-block states included."""
        spec = query.kv_cache_spec
        assert isinstance(spec, MambaSpec)
        assert not query.use_eagle, "EAGLE is not supported with Mamba groups"
        block_pool, group_ids = query.block_pool, query.kv_cache_group_ids
        block_size, alignment_tokens = spec.block_size, query.alignment_tokens
        null = block_pool.null_block
        if alignment_tokens < block_size:
            assert alignment_tokens == block_pool.hash_block_size
            end = min(max_length // alignment_tokens, len(block_hashes))
            found = _fine_grained_hit(query, block_hashes, 0, end)
            if found is None:
                return tuple([] for _ in group_ids), 0
            fine_index, fine_hit = found
            hit_length = (fine_index + 1) * alignment_tokens
            index = cdiv(hit_length, block_size) - 1
            return tuple([null] * index + [block] for block in fine_hit), hit_length
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        for i in range(min(max_length // block_size, len(hashes)) - 1, -1, -1):
            if ((i + 1) * block_size) % alignment_tokens != 0:
                continue
            hit = block_pool.get_cached_block(hashes[i], group_ids)
            if hit is not None:
                return tuple([null] * i + [block] for block in hit), (i + 1) * block_size
        return tuple([] for _ in group_ids), 0


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder output for cross attention: allocated once for ``num_encoder_tokens``
    (the coordinator passes that count), never prefix cached."""

    spec_type = CrossAttentionSpec

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: Sequence[BlockHash], max_length: int, query: CacheHitQuery
    ) -> tuple[HitBlocks, int]:
        raise NotImplementedError("cross attention does not support prefix caching")

    def cache_blocks(
        self, request: Request, num_tokens: int, reachable_boundaries: Sequence[int] = ()
    ) -> None:
        raise ValueError("Should not be called as prefix caching is disabled.")


# Each manager names the spec it serves (``spec_type``); the map is derived from that.
SPEC_MANAGER_MAP: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    manager.spec_type: manager
    for manager in (
        FullAttentionManager,
        SlidingWindowManager,
        ChunkedLocalAttentionManager,
        CrossAttentionManager,
        MambaManager,
    )
}


def manager_class_for_spec(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    for spec_type in type(kv_cache_spec).__mro__:
        if spec_type in SPEC_MANAGER_MAP:
            return SPEC_MANAGER_MAP[spec_type]
    raise TypeError(f"no KV cache manager for spec type {type(kv_cache_spec).__name__}")


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    block_pool: BlockPool,
    enable_caching: bool,
    kv_cache_group_id: int,
    max_model_len: int,
    max_in_flight_tokens: int,
    record_new_block_ids: bool = False,
) -> SingleTypeKVCacheManager:
    """Build the manager of one group; window-bounded types get their admission cap."""
    cap: int | None = None
    if isinstance(kv_cache_spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
        cap = kv_cache_spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
    return manager_class_for_spec(kv_cache_spec)(
        kv_cache_spec,
        block_pool,
        enable_caching,
        kv_cache_group_id,
        record_new_block_ids=record_new_block_ids,
        max_admission_blocks_per_request=cap,
    )

"""Layer 3: one ``SingleTypeKVCacheManager`` per KV cache group.

Each manager turns token counts into block counts with its own group's block size,
keeps the group's block table per request, and knows its attention type's rules: which
blocks a request no longer needs (``get_num_skipped_tokens``) and which cached blocks
make a usable prefix hit (``find_longest_cache_hit``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kvservice.core.block_pool import BlockPool, resolve_block_hashes
from kvservice.core.kv_cache_block import BlockHash, KVCacheBlock
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
        # LCM of all groups' block sizes.
        self.cache_hit_alignment_tokens = self.block_size
        self._null_block = block_pool.null_block
        self._record_new_block_ids = record_new_block_ids
        self.new_block_ids: list[int] = []
        self._max_admission_blocks_per_request = max_admission_blocks_per_request
        # Set by the coordinator for the groups an EAGLE drafter reads.
        self.use_eagle = False
        # Sparse retention (KVCacheConfig.prefix_cache_retention_interval), set by the
        # coordinator; only window-bounded and Mamba groups make use of it.
        self.retention_interval: int | None = None
        # Partial-block hits (set by the hybrid coordinator): hits may end on a hash
        # boundary inside a block, and prompts register their last hash boundary.
        self.partial_hits = False
        # Requests whose hit ends inside a shared block: (table index, source block),
        # until the next allocation swaps a private copy in.
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        # Copies not yet taken by the runtime, and the references held meanwhile so
        # that neither end of a copy is recycled before the copy is applied.
        self._pending_cow_copies: list[BlockCopy] = []
        self._copy_holds: list[KVCacheBlock] = []

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
        num_required_blocks = -(-num_tokens // self.block_size)
        cap = self._max_admission_blocks_per_request
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
        num_evictable = sum(
            1
            for block in new_computed_blocks[num_skipped_hits:]
            if block.ref_cnt == 0 and not block.is_null
        )
        num_local = total_computed_tokens
        if num_local_computed_tokens is not None:
            num_local = num_local_computed_tokens
        num_cow = (
            1
            if self._partial_hit_index(new_computed_blocks, num_local, total_computed_tokens)
            is not None
            else 0
        )
        return num_new_blocks + num_evictable + num_cow

    def _partial_hit_index(
        self,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        total_computed_tokens: int,
    ) -> int | None:
        """The table index of the shared block a hit ends inside (the request must get
        a private copy before writing the rest of it), or None."""
        if not new_computed_blocks or num_local_computed_tokens % self.block_size == 0:
            return None
        index = num_local_computed_tokens // self.block_size
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        if index < num_skipped_blocks or index >= len(new_computed_blocks):
            return None  # out of view: never read, so never copied
        return index

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
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request cannot get new prefix hits"
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"request {request_id!r} already holds blocks in this group"
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        hits = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(hits)
        else:
            assert not hits, "prefix hits with caching disabled"
        req_blocks.extend([self._null_block] * min(num_skipped_blocks, len(new_computed_blocks)))
        req_blocks.extend(hits)
        self.num_cached_block[request_id] = len(req_blocks)
        index = self._partial_hit_index(new_computed_blocks, num_local_computed_tokens, total)
        if index is not None:
            # The shared tail block is never written: the next allocation swaps a private
            # copy in, and that copy is cached afresh once it fills.
            self._partial_hit_reqs[request_id] = (index, req_blocks[index])
            self.num_cached_block[request_id] = index

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> None:
        """Allocate the blocks a KV connector will load ``num_external_computed_tokens``
        into, after the local hits (skipped positions become null blocks)."""
        if num_external_computed_tokens == 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        if num_skipped_blocks > len(req_blocks):
            req_blocks.extend([self._null_block] * (num_skipped_blocks - len(req_blocks)))
        num_new = max(0, cdiv(total, self.block_size) - len(req_blocks))
        self._append_new_blocks(req_blocks, num_new)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """Grow the request's table to hold ``num_tokens`` slots; return the new blocks
        (a private copy of a partially hit block first)."""
        cow_blocks = self._swap_in_private_copy(request_id)
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new <= 0:
            return cow_blocks
        return cow_blocks + self._append_new_blocks(req_blocks, num_new)

    def _swap_in_private_copy(self, request_id: str) -> list[KVCacheBlock]:
        """Copy-on-write for a hit that ended inside a shared block: a fresh block
        replaces it in the table and a (source, copy) copy is queued."""
        if request_id not in self._partial_hit_reqs:
            return []  # the common case; compiled, a membership test is cheaper than pop
        index, source = self._partial_hit_reqs.pop(request_id)
        req_blocks = self.req_to_blocks[request_id]
        assert req_blocks[index] is source and not source.is_null and source.ref_cnt > 0
        copy = self.block_pool.get_new_blocks(1)[0]
        req_blocks[index] = copy
        # The source keeps the reference the hit took (it is read by the copy); the
        # copy gets one more, so a free in the same step cannot recycle it either.
        copy.ref_cnt += 1
        self._queue_copy(source, copy, holds=(source, copy))
        if self._record_new_block_ids:
            self.new_block_ids.append(copy.block_id)
        return [copy]

    def _queue_copy(
        self, source: KVCacheBlock, dest: KVCacheBlock, holds: Sequence[KVCacheBlock]
    ) -> None:
        self._pending_cow_copies.append((source, dest))
        self._copy_holds.extend(holds)

    def take_pending_cow_copies(self) -> tuple[list[BlockCopy], list[KVCacheBlock]]:
        """The copies queued since the last call, and the blocks held for them; the
        caller releases the holds once the copies have been applied."""
        copies, self._pending_cow_copies = self._pending_cow_copies, []
        holds, self._copy_holds = self._copy_holds, []
        return copies, holds

    @property
    def pending_cow_copies(self) -> Sequence[BlockCopy]:
        return self._pending_cow_copies

    @property
    def copy_holds(self) -> Sequence[KVCacheBlock]:
        return self._copy_holds

    def _append_new_blocks(
        self, req_blocks: list[KVCacheBlock], num_new: int
    ) -> list[KVCacheBlock]:
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def take_new_block_ids(self) -> list[int]:
        """Blocks allocated since the last call (the runtime zeroes them before use)."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

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
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks < num_full_blocks:
            self._cache_full_blocks(
                request, num_cached_blocks, num_full_blocks, reachable_boundaries
            )
        if self.partial_hits and self.block_size > self.block_pool.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Register the prompt's last hash boundary inside a block, so that a later
        request sharing the prompt can hit up to it (attention groups: once the tokens
        up to it are computed)."""
        boundary = self._partial_tail_boundary(request)
        if boundary == 0 or boundary > num_tokens:
            return
        self._register_partial(request, boundary)

    def _partial_tail_boundary(self, request: Request) -> int:
        """The prompt's last hash boundary if it falls inside a block, else 0."""
        hbs = self.block_pool.hash_block_size
        boundary = request.num_prompt_tokens // hbs * hbs
        return 0 if boundary % self.block_size == 0 else boundary

    def _register_partial(self, request: Request, boundary: int) -> None:
        blocks = self.req_to_blocks.get(request.request_id, [])
        index = boundary // self.block_size
        if index < len(blocks):
            self.block_pool.cache_partial_block(
                request, blocks[index], boundary, self.kv_cache_group_id, self.block_size
            )

    def _cache_full_blocks(
        self,
        request: Request,
        num_cached_blocks: int,
        num_full_blocks: int,
        reachable_boundaries: Sequence[int],
    ) -> None:
        request_id = request.request_id
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
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no future token attends to (their blocks can go)."""
        return 0

    def _skipped_blocks(self, request_id: str, total_computed_tokens: int) -> list[int]:
        """Table indices ``remove_skipped_blocks`` would release, last first."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped_tokens <= 0 or not blocks:
            return []
        indices: list[int] = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is self._null_block:
                break  # everything before it was removed earlier
            indices.append(i)
        return indices

    def get_num_blocks_freed_by_skipping(self, request_id: str, total_computed_tokens: int) -> int:
        """How many blocks ``remove_skipped_blocks`` would return to the free queue now
        (shared blocks only lose a reference). No side effects."""
        blocks = self.req_to_blocks.get(request_id, [])
        return sum(
            1
            for i in self._skipped_blocks(request_id, total_computed_tokens)
            if blocks[i].ref_cnt == 1
        )

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks no future token attends to, replacing them with the null block.

        Walks from the last skipped block backwards and stops at the first null one
        (everything before it was removed earlier), so the later block is freed first.
        """
        indices = self._skipped_blocks(request_id, total_computed_tokens)
        if not indices:
            return
        blocks = self.req_to_blocks[request_id]
        removed = [blocks[i] for i in indices]
        for i in indices:
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks shared by every request holding blocks (cascade attention)."""
        return 0

    # -- prefix hits ------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        use_eagle: bool = False,
    ) -> tuple[HitBlocks, int]:
        """The longest usable cached prefix of at most ``max_length`` tokens: one block
        list per group id (null blocks where the group needs nothing) and its length in
        tokens, a multiple of ``alignment_tokens``. Takes no references.

        ``use_eagle``: an EAGLE drafter recomputes the hidden states of the last hit
        block, so one block (one alignment unit at most) of the hit is given back."""


def _fine_grained_hit(
    block_hashes: Sequence[BlockHash],
    first_fine_index: int,
    end_fine_index: int,
    kv_cache_group_ids: Sequence[int],
    block_pool: BlockPool,
) -> tuple[int, list[KVCacheBlock]] | None:
    """The highest hash boundary in ``[first, end)`` that is cached in every group:
    ``(fine index, blocks)``, or None. ``block_hashes`` are per hash block."""
    for fine_index in range(end_fine_index - 1, first_fine_index - 1, -1):
        hit = block_pool.get_cached_block(block_hashes[fine_index], kv_cache_group_ids)
        if hit is not None:
            return fine_index, hit
    return None


class FullAttentionManager(SingleTypeKVCacheManager):
    spec_type = FullAttentionSpec
    supports_fine_grained_hash_lookup = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        use_eagle: bool = False,
    ) -> tuple[HitBlocks, int]:
        """Left to right; the first miss ends the prefix (hashes are chained).

        With EAGLE, 48 cached tokens of block size 16 hit only 16 for a 48-token prompt:
        the cap at 47 leaves 2 blocks, and EAGLE gives one back.
        """
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_blocks = min(max_length // block_size, len(hashes))
        computed: HitBlocks = tuple([] for _ in kv_cache_group_ids)
        if len(kv_cache_group_ids) == 1:
            # The common case, without a list per probe.
            lookup = block_pool.cached_block_hash_to_block.get_one_block
            suffix = kv_cache_group_ids[0].to_bytes(4, "big")
            out = computed[0]
            for i in range(num_blocks):
                block = lookup(hashes[i] + suffix)
                if block is None:
                    break
                out.append(block)
        else:
            for i in range(num_blocks):
                hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
                if hit is None:
                    break
                for blocks, block in zip(computed, hit, strict=True):
                    blocks.append(block)
        hit_length = len(computed[0]) * block_size
        if alignment_tokens < block_size:
            hit_length = cls._extend_into_next_block(
                block_hashes, max_length, kv_cache_group_ids, block_pool, block_size,
                alignment_tokens, computed, hit_length,
            )  # fmt: skip
        if use_eagle and hit_length > 0:
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % alignment_tokens
        num_hit_blocks = cdiv(hit_length, block_size)
        for blocks in computed:
            del blocks[num_hit_blocks:]
        return computed, hit_length

    @staticmethod
    def _extend_into_next_block(
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        block_size: int,
        alignment_tokens: int,
        computed: HitBlocks,
        hit_length: int,
    ) -> int:
        """Partial hits: probe the hash boundaries inside the first block that missed,
        highest first; a partial entry there extends the hit into that block."""
        assert alignment_tokens == block_pool.hash_block_size, (
            "partial-block hits are aligned to the hash block size"
        )
        scale = block_size // alignment_tokens
        first = len(computed[0]) * scale
        end = min(first + scale - 1, max_length // alignment_tokens, len(block_hashes))
        found = _fine_grained_hit(block_hashes, first, end, kv_cache_group_ids, block_pool)
        if found is None:
            return hit_length
        fine_index, hit = found
        for blocks, block in zip(computed, hit, strict=True):
            blocks.append(block)
        return (fine_index + 1) * alignment_tokens

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
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        use_eagle: bool = False,
    ) -> tuple[HitBlocks, int]:
        """Right to left: the hit ends at the latest run of cached blocks long enough to
        cover one window; blocks before the run are null. A run that reaches block 0
        counts even when shorter.

        Example, block size 4, window 8 (2 blocks needed), blocks 2 and 3 cached:
        ``[NULL, NULL, B2, B3]``, 16 tokens.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        need = cls.num_contiguous_blocks_needed(kv_cache_spec.sliding_window, block_size, use_eagle)
        # With EAGLE the run's last block is given back, so the block before it must end
        # on an aligned boundary.
        end_shift = 0 if use_eagle else 1
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_blocks = min(max_length // block_size, len(hashes))
        null = block_pool.null_block
        computed: HitBlocks = tuple([null] * num_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(num_blocks - 1, -1, -1):
            hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if hit is None:
                run = 0
                continue
            if run == 0 and ((i + end_shift) * block_size) % alignment_tokens != 0:
                continue  # a hit must end on an aligned boundary
            for blocks, block in zip(computed, hit, strict=True):
                blocks[i] = block
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
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        use_eagle: bool = False,
    ) -> tuple[HitBlocks, int]:
        """Blocks before the chunk holding token ``max_length`` are null (nothing will
        attend to them); from that chunk's start, left to right until the first miss.

        Chunk 8, block size 4, max_length 15: blocks 0-1 are null and only block 2
        (tokens 8-11) is probed: ``[NULL, NULL, B2]`` or ``[NULL, NULL]``.
        """
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        assert not use_eagle, "EAGLE is not supported with chunked local attention"
        block_size = kv_cache_spec.block_size
        assert block_size == alignment_tokens, (
            "chunked local attention needs hits aligned to its own block size"
        )
        chunk = kv_cache_spec.attention_chunk_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_blocks = min(max_length // block_size, len(hashes))
        start_block = ((max_length // chunk) * chunk) // block_size if max_length > 0 else 0
        null = block_pool.null_block
        computed: HitBlocks = tuple([null] * start_block for _ in kv_cache_group_ids)
        for i in range(start_block, num_blocks):
            hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if hit is None:
                break
            for blocks, block in zip(computed, hit, strict=True):
                blocks.append(block)
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the next token's chunk (chunk 8: 13 -> 8, 7 -> 0)."""
        return (num_computed_tokens // self.attention_chunk_size) * self.attention_chunk_size


class MambaManager(SingleTypeKVCacheManager):
    """State-space layers: a block holds the state after its last token, and only the
    latest state is read, so everything before the block of the last computed token
    is released (and stays a prefix-cache entry until evicted).

    Mode "all" allocates a block per ``block_size`` tokens like attention. Mode
    "align" places the state of each step in the block of its last token and pads the
    rest with null blocks: a request holds one state block (plus the previous one
    while a step reads it) and its speculative blocks, which move to the end of the
    table instead of being allocated again.
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
        # Align mode: requests that hold their speculative blocks (the table ends with
        # them); their next allocations move those blocks instead of taking new ones.
        self._align_allocated: set[str] = set()
        # The ``num_tokens`` of the cache_blocks call in progress (align mode's mask).
        self._num_tokens_being_cached = 0

    @property
    def _num_speculative_tokens(self) -> int:
        return self.num_speculative_blocks * self.block_size

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
        n_main = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        state_index = cdiv(n_main, self.block_size) - 1
        table = self.req_to_blocks.get(request_id, [])
        if self.mode != "align":
            stale = self._stale_partial_state(table, state_index, n_main)
            return (1 if stale is not None else 0) + super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self._num_speculative_tokens,
                new_computed_blocks,
                total_computed_tokens,
                apply_admission_cap,
                num_local_computed_tokens=num_local_computed_tokens,
            )
        if request_id in self._align_allocated:
            body = table[: len(table) - self.num_speculative_blocks]
            num_new = 1 if state_index >= len(body) else 0
            return num_new + (1 if self._stale_partial_state(body, state_index, n_main) else 0)
        num_local = total_computed_tokens
        if num_local_computed_tokens is not None:
            num_local = num_local_computed_tokens
        # Evictable hits and the private copy of a partial hit, as for any group.
        count = super().get_num_blocks_to_allocate(
            request_id,
            0,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens=num_local,
        )
        length = len(table) + len(new_computed_blocks)
        if total_computed_tokens > num_local:
            num_external_end = cdiv(total_computed_tokens, self.block_size)
            count += 1 if num_external_end > length else 0
            length = max(length, num_external_end)
        return count + (1 if state_index >= length else 0) + self.num_speculative_blocks

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        n_main = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        if self.mode != "align":
            if request_id not in self._partial_hit_reqs:  # else its hit block is copied
                table = self.req_to_blocks.get(request_id, [])
                self._move_stale_partial_state(table, cdiv(n_main, self.block_size) - 1, n_main)
            # Draft tokens get state blocks of their own, beyond the main model's tokens.
            return super().allocate_new_blocks(
                request_id, num_tokens + self._num_speculative_tokens
            )
        cow_blocks = self._swap_in_private_copy(request_id)
        table = self.req_to_blocks.setdefault(request_id, [])
        state_index = cdiv(n_main, self.block_size) - 1
        num_spec = self.num_speculative_blocks
        if request_id in self._align_allocated:
            body, spec = table[: len(table) - num_spec], table[len(table) - num_spec :]
            self._move_stale_partial_state(body, state_index, n_main)
        else:
            body, spec = table, []
        new_blocks: list[KVCacheBlock] = []
        if state_index >= len(body):
            body = [*body, *[self._null_block] * (state_index - len(body))]
            new_blocks = self.block_pool.get_new_blocks(1)
            body += new_blocks
        if request_id not in self._align_allocated:
            spec = self.block_pool.get_new_blocks(num_spec)
            new_blocks += spec
            self._align_allocated.add(request_id)
        table[:] = body + spec
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return cow_blocks + new_blocks

    def _stale_partial_state(
        self, body: Sequence[KVCacheBlock], state_index: int, n_main: int
    ) -> KVCacheBlock | None:
        """The request's own state block that is a partial prefix-cache entry and that
        this step would overwrite in place (its state at the entry's boundary must be
        kept for hits), or None."""
        if state_index >= len(body):
            return None
        block = body[state_index]
        num_tokens = block.block_hash_num_tokens
        if block.is_null or block.block_hash is None or num_tokens is None:
            return None
        if num_tokens % self.block_size == 0 or num_tokens >= n_main:
            return None
        return block

    def _move_stale_partial_state(
        self, body: Sequence[KVCacheBlock], state_index: int, n_main: int
    ) -> None:
        """Before the owner of a partial entry writes over it, the entry moves to a
        private copy of the block (held until the copy is applied)."""
        block = self._stale_partial_state(body, state_index, n_main)
        if block is None:
            return
        copy = self.block_pool.get_new_blocks(1)[0]
        self.block_pool.move_block_hashes(block, copy)
        self._queue_copy(block, copy, holds=(copy,))
        if self._record_new_block_ids:
            self.new_block_ids.append(copy.block_id)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """A state exists only where a step ended: register the prompt's last hash
        boundary when the computed tokens end exactly there."""
        boundary = self._partial_tail_boundary(request)
        if boundary and boundary == num_tokens:
            self._register_partial(request, boundary)

    def _register_partial(self, request: Request, boundary: int) -> None:
        blocks = self.req_to_blocks.get(request.request_id, [])
        index = cdiv(boundary, self.block_size) - 1
        if index < len(blocks):
            self.block_pool.cache_partial_block(
                request, blocks[index], boundary, self.kv_cache_group_id, self.block_size
            )

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._align_allocated.discard(request_id)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is read again."""
        return max(num_computed_tokens - 1, 0)

    def _skipped_blocks(self, request_id: str, total_computed_tokens: int) -> list[int]:
        if self.mode != "align":
            return super()._skipped_blocks(request_id, total_computed_tokens)
        # Align mode leaves null gaps between states: look past them.
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        end = min(num_skipped_blocks, len(blocks) - self.num_speculative_blocks)
        return [i for i in range(end - 1, -1, -1) if not blocks[i].is_null]

    def reachable_block_mask(
        self, num_cached_blocks: int, num_full_blocks: int, reachable_boundaries: Sequence[int]
    ) -> list[bool] | None:
        """A hit reads one state, at an aligned boundary: keep those states only. In
        align mode a block holds its boundary's state only if a step ended exactly
        there, which is the last block being cached when ``num_tokens`` is aligned."""
        mask = sparse_retention_mask(
            range(num_cached_blocks, num_full_blocks),
            self.block_size,
            1,
            0,
            self.cache_hit_alignment_tokens,
            self.retention_interval,
            reachable_boundaries,
        )
        if self.mode != "align":
            return mask
        last = num_full_blocks - 1 if self._num_tokens_being_cached % self.block_size == 0 else -1
        return [
            i == last and (mask is None or mask[i - num_cached_blocks])
            for i in range(num_cached_blocks, num_full_blocks)
        ]

    def cache_blocks(
        self, request: Request, num_tokens: int, reachable_boundaries: Sequence[int] = ()
    ) -> None:
        self._num_tokens_being_cached = num_tokens
        super().cache_blocks(request, num_tokens, reachable_boundaries)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        use_eagle: bool = False,
    ) -> tuple[HitBlocks, int]:
        """Right to left: the latest cached state ending on an aligned boundary is the
        whole hit (``[NULL] * i + [state]``); earlier states are never read. With
        partial hits (alignment below the block size) every hash boundary is a
        candidate, mid-block states included."""
        assert isinstance(kv_cache_spec, MambaSpec)
        assert not use_eagle, "EAGLE is not supported with Mamba groups"
        block_size = kv_cache_spec.block_size
        null = block_pool.null_block
        if alignment_tokens < block_size:
            assert alignment_tokens == block_pool.hash_block_size
            end = min(max_length // alignment_tokens, len(block_hashes))
            found = _fine_grained_hit(block_hashes, 0, end, kv_cache_group_ids, block_pool)
            if found is None:
                return tuple([] for _ in kv_cache_group_ids), 0
            fine_index, fine_hit = found
            hit_length = (fine_index + 1) * alignment_tokens
            index = cdiv(hit_length, block_size) - 1
            return tuple([null] * index + [block] for block in fine_hit), hit_length
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        for i in range(min(max_length // block_size, len(hashes)) - 1, -1, -1):
            if ((i + 1) * block_size) % alignment_tokens != 0:
                continue
            hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if hit is not None:
                return tuple([null] * i + [block] for block in hit), (i + 1) * block_size
        return tuple([] for _ in kv_cache_group_ids), 0


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder output for cross attention: allocated once for ``num_encoder_tokens``
    (the coordinator passes that count), never prefix cached."""

    spec_type = CrossAttentionSpec

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        use_eagle: bool = False,
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

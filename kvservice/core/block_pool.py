"""Layer 4, ``BlockPool``: every physical block, its ref count, the free queue (which is
also the eviction order) and the prefix cache map from block hash to block.

Allocation never consults the cache: ``get_new_blocks`` pops the front of the free
queue, and a popped block that was still a cache entry is evicted right then. So
eviction under pressure is a side effect of allocation, and cached-but-free blocks
count as free (``get_usage`` counts only blocks that requests hold).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvservice.core.block_hashing import (
    ExtraKeys,
    first_mm_index,
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    to_event_extra_keys,
)
from kvservice.core.errors import InvalidArgumentError, QuotaExceededError
from kvservice.core.kv_cache_block import (
    DEFAULT_PRIORITY,
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvservice.core.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvservice.core.retention_policy import Pin, PriorityFreeQueue, RetentionPolicy

if TYPE_CHECKING:
    from kvservice.core.request import Request


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class BlockHashToBlockMap:
    """Prefix cache map: key -> the first cached block with that key.

    Several blocks may carry one key: a block that fills up is cached even when an
    identical block exists, because block tables are append-only (a request never swaps
    a block id for an equal one). Lookups return the first inserted; later ones wait in
    ``_duplicates`` in insertion order and are promoted when the first is evicted.
    """

    def __init__(self) -> None:
        self._first: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self._duplicates: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        return self._first.get(key)

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        """Whether block ``block_id`` is filed under ``key``."""
        first = self._first.get(key)
        if first is None:
            return False
        return first.block_id == block_id or block_id in self._duplicates.get(key, {})

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        if key not in self._first:
            self._first[key] = block
        else:
            self._duplicates.setdefault(key, {})[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove and return the block ``block_id`` under ``key``; None if it is not there."""
        first = self._first.get(key)
        if first is None:
            return None
        if first.block_id == block_id:
            rest = self._duplicates.get(key)
            if rest:
                promoted_id = next(iter(rest))
                self._first[key] = rest.pop(promoted_id)
                if not rest:
                    del self._duplicates[key]
            else:
                del self._first[key]
            return first
        rest = self._duplicates.get(key)
        if rest is None or block_id not in rest:
            return None
        block = rest.pop(block_id)
        if not rest:
            del self._duplicates[key]
        return block

    def blocks_of(self, key: BlockHashWithGroupId) -> list[KVCacheBlock]:
        """All blocks under ``key``, first inserted first."""
        first = self._first.get(key)
        if first is None:
            return []
        return [first, *self._duplicates.get(key, {}).values()]

    def __iter__(self) -> Iterator[BlockHashWithGroupId]:
        return iter(self._first)

    def num_blocks(self) -> int:
        return len(self._first) + sum(len(d) for d in self._duplicates.values())

    def __len__(self) -> int:
        return len(self._first)


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """Hashes computed every ``hash_block_size`` tokens, viewed at ``block_size``.

    Element i is the fine hash at the last boundary of coarse block i: each fine hash
    already chains over its whole prefix, so it fingerprints the coarse block too.
    """

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int):
        assert block_size % hash_block_size == 0, (
            f"block size {block_size} is not a multiple of hash block size {hash_block_size}"
        )
        self._hashes = block_hashes
        self._scale = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._hashes) // self._scale

    def __getitem__(self, i: int) -> BlockHash:  # type: ignore[override]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._hashes[(i + 1) * self._scale - 1]


def resolve_block_hashes(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """The request's hashes at ``block_size`` granularity."""
    if block_size == hash_block_size:
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


class BlockPool:
    """All ``num_gpu_blocks`` blocks; block 0 is the null block.

    The null block stands in for positions a request no longer needs (outside a sliding
    window, before a local-attention chunk) so block tables stay index-aligned. It is
    never freed, hashed, evicted or counted as free: usable capacity is N - 1.

    A cached block is the entry of the prefix its ``block_hash`` stands for, and may be
    filed under more keys: partial entries of shorter prefixes ending inside it (a
    prompt's last reusable hash boundary, kept after the block filled up). Evicting,
    promoting or moving the block handles all of its keys.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        retention_policy: RetentionPolicy | None = None,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
            raise InvalidArgumentError(
                f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        # Tokens after each block its hash covers (lookahead block hashes): the KV events
        # publish them and the extra keys of the window they extend.
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        # Pins and priorities (None: vLLM's LRU and nothing else, the default).
        self.retention_policy = retention_policy
        # The time of the last expire_retention: pins refreshed by a hit count from it.
        self.now = 0.0
        with _gc_paused():
            # A million tracked objects would trigger collections that rescan them all
            # (most of the construction time at 1M blocks).
            self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
            self.free_block_queue = self._new_free_queue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block id -> the keys a block is filed under besides its primary block_hash:
        # partial entries of a block cached for a longer prefix.
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        # Hashed blocks evicted because their block was reused for a new allocation,
        # and because a caller invalidated them (evict_blocks); for metrics.
        self.num_evicted_on_reuse = 0
        self.num_evicted_on_request = 0

    def _new_free_queue(self, blocks: list[KVCacheBlock]) -> FreeKVCacheBlockQueue:
        if self.retention_policy is not None and self.retention_policy.priorities_enabled:
            return PriorityFreeQueue(blocks)
        return FreeKVCacheBlockQueue(blocks)

    # -- prefix cache -----------------------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in every listed group, or None if any misses."""
        cached: list[KVCacheBlock] = []
        cache = self.cached_block_hash_to_block
        for group_id in kv_cache_group_ids:
            block = cache.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            cached.append(block)
        return cached

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix cache.

        Null blocks and blocks the mask leaves out stay unhashed. One ``BlockStored``
        event describes the whole call, even when every block was left out.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        assert len(hashes) >= num_full_blocks, (
            f"request {request.request_id!r} has {len(hashes)} block hashes, "
            f"{num_full_blocks} needed: hashes are computed when tokens are appended"
        )
        gid_suffix = kv_cache_group_id.to_bytes(4, "big")
        retention = self.retention_policy
        stored_indices: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            num_tokens = (i + 1) * block_size
            if block.block_hash is not None:
                # Only shorter (partial) entries of this very block may precede its full key.
                current = block.block_hash_num_tokens
                assert current is not None and current < num_tokens, (
                    f"block {block.block_id} is already cached for {current} tokens; it "
                    f"cannot be cached again for {num_tokens}"
                )
                self._emit_block_removed(self._remove_cached_block_hashes(block))
            key = hashes[i] + gid_suffix
            block.set_block_hash(key, num_tokens)
            self.cached_block_hash_to_block.insert(key, block)
            stored_indices.append(i)
            if retention is not None:
                self._apply_retention(request, block, key, i * block_size, num_tokens)
        if self.enable_kv_cache_events:
            parent = hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self.kv_event_queue.append(
                self._block_stored(
                    request,
                    [hashes[i] for i in stored_indices],
                    parent,
                    num_cached_blocks * block_size,
                    num_full_blocks * block_size,
                    block_size,
                    kv_cache_group_id,
                    self._event_extra_keys(request, stored_indices, block_size),
                    self._lookahead_token_ids(
                        request, [(i + 1) * block_size for i in stored_indices]
                    ),
                )
            )

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make ``block`` the cache entry of the prefix ending at ``num_tokens``, a hash
        boundary that may lie inside the block (a partial entry, for partial-block hits).

        A block already cached for a longer prefix keeps that key and gains this one
        beside it; a shorter entry is replaced, and so is every key when
        ``replace_existing_hashes`` (the block's content was replaced). Returns the key
        (also when the block already had it), or None for the null block.
        """
        if block.is_null:
            return None
        hbs = self.hash_block_size
        assert block_size % hbs == 0 and num_tokens % hbs == 0, (
            f"a partial entry ends on a hash boundary, got {num_tokens} tokens "
            f"(block {block_size}, hash block {hbs})"
        )
        num_hash_blocks = num_tokens // hbs
        assert 0 < num_hash_blocks <= len(request.block_hashes)
        block_hash = request.block_hashes[num_hash_blocks - 1]
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        already_cached = block.block_hash == key or self.cached_block_hash_to_block.contain(
            key, block.block_id
        )
        current = block.block_hash_num_tokens
        if replace_existing_hashes:
            self._emit_block_removed(self._remove_cached_block_hashes(block))
            already_cached = False
        elif not already_cached and current is not None and current < num_tokens:
            self._emit_block_removed(self._remove_cached_block_hashes(block))
        self._insert_block_hash(key, block, num_tokens)
        if self.enable_kv_cache_events and not already_cached:
            start = num_tokens - hbs
            mm_idx = first_mm_index(request.mm_features, start, num_tokens)
            extra_keys, _ = self._window_extra_keys(request, start, num_tokens, mm_idx)
            self.kv_event_queue.append(
                self._block_stored(
                    request,
                    [block_hash],
                    request.block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None,
                    start,
                    num_tokens,
                    hbs,
                    kv_cache_group_id,
                    to_event_extra_keys([extra_keys]),
                    self._lookahead_token_ids(request, [num_tokens]),
                )
            )
        return key

    def _insert_block_hash(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        """File ``block`` under ``key``: as its primary key if it has none, else as one
        more (alias) key; nothing if it already carries it."""
        if block.block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)
        if self.retention_policy is not None and key in self.retention_policy.pins_by_key:
            self._hold_for_pins(key)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        """Unfile ``block`` from every key it carries (primary first, then aliases);
        returns the keys that were filed."""
        keys: list[BlockHashWithGroupId] = []
        if block.block_hash is not None:
            keys.append(block.block_hash)
        keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if not keys:
            return keys
        cache = self.cached_block_hash_to_block
        removed = [key for key in keys if cache.pop(key, block.block_id) is not None]
        block.reset_hash()
        if self.retention_policy is not None and block.block_id in self.retention_policy.holders:
            self._release_pin_holds(block, hold_again=True)
        return removed

    def aliases_of(self, block: KVCacheBlock) -> set[BlockHashWithGroupId]:
        """The keys ``block`` is filed under besides its primary ``block_hash``."""
        return self.cached_block_hashes_by_block.get(block.block_id, set())

    def move_block_hashes(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Re-point ``src``'s cache entries at ``dst`` (which will receive a copy of its
        content), so that ``src`` can be written again. No events: the cached content
        stays the same."""
        assert dst.block_hash is None and dst.block_id not in self.cached_block_hashes_by_block
        num_tokens = src.block_hash_num_tokens
        for key in self._remove_cached_block_hashes(src):
            self._insert_block_hash(key, dst, num_tokens)  # the first becomes the primary

    @staticmethod
    def is_block_writable(block: KVCacheBlock) -> bool:
        """Whether one request may write into ``block`` in place: it alone holds it and
        it is no prefix-cache entry."""
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    def _event_extra_keys(
        self, request: Request, indices: Sequence[int], block_size: int
    ) -> list[ExtraKeys] | None:
        """Per cached block, the extra keys of its whole window of ``block_size``
        tokens, in the untagged form events publish."""
        if not request.has_extra_keys:
            return [None] * len(indices) if indices else None
        keys: list[ExtraKeys] = []
        mm_idx = 0
        for i in indices:
            block_keys, mm_idx = self._window_extra_keys(
                request, i * block_size, (i + 1) * block_size, mm_idx
            )
            keys.append(block_keys)
        return to_event_extra_keys(keys)

    def _window_extra_keys(
        self, request: Request, start: int, end: int, mm_idx: int
    ) -> tuple[ExtraKeys, int]:
        """The extra keys of the window a block's hash covers (with lookahead hashes,
        the block and the tokens after it)."""
        lookahead = self.num_hash_lookahead_tokens
        if lookahead:
            return generate_lookahead_block_hash_extra_keys(
                request, start, end, end + lookahead, mm_idx
            )
        return generate_block_hash_extra_keys(request, start, end, mm_idx)

    def _lookahead_token_ids(self, request: Request, ends: Sequence[int]) -> list[list[int]] | None:
        """Per block ending at each of ``ends``, the tokens after it its hash covers;
        None without lookahead hashes."""
        lookahead = self.num_hash_lookahead_tokens
        if not lookahead:
            return None
        tokens = request.all_token_ids
        return [list(tokens[end : end + lookahead]) for end in ends]

    def _block_stored(
        self,
        request: Request,
        block_hashes: list[BlockHash],
        parent_block_hash: BlockHash | None,
        start_token_idx: int,
        end_token_idx: int,
        block_size: int,
        kv_cache_group_id: int,
        extra_keys: list[ExtraKeys] | None,
        lookahead_token_ids: list[list[int]] | None = None,
    ) -> BlockStored:
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=request.token_ids_between(start_token_idx, end_token_idx),
            block_size=block_size,
            lora_id=request.lora_int_id if request.lora_name else None,
            medium=MEDIUM_GPU,
            lora_name=request.lora_name,
            extra_keys=extra_keys,
            group_idx=kv_cache_group_id,
            lookahead_token_ids=lookahead_token_ids,
        )

    def _emit_block_removed(self, keys: list[BlockHashWithGroupId]) -> None:
        if not self.enable_kv_cache_events:
            return
        for key in keys:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[get_block_hash(key)],
                    medium=MEDIUM_GPU,
                    group_idx=get_group_id(key),
                )
            )

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop every cache entry of ``block``; True if it had one."""
        removed = self._remove_cached_block_hashes(block)
        if not removed:
            return False
        self._emit_block_removed(removed)
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Invalidate the cache entries of ``block_ids`` (e.g. KV a connector failed to
        load). Ref counts and the free queue are untouched. In the order given (vLLM's
        scheduler passes a set: its iteration order orders the removal events)."""
        ids = list(dict.fromkeys(block_ids))
        bad = sorted(i for i in ids if not 0 <= i < self.num_gpu_blocks)
        if bad:
            raise InvalidArgumentError(
                f"block ids {bad} are out of range; "
                f"the pool has blocks 0..{self.num_gpu_blocks - 1}"
            )
        for block_id in ids:
            if self._maybe_evict_cached_block(self.blocks[block_id]):
                self.num_evicted_on_request += 1

    def reset_prefix_cache(self, restore_block_order: bool = False) -> bool:
        """Forget every cache entry; refused (False) while any request holds a block.

        ``restore_block_order`` also puts the free queue back in block-id order: the
        pool is then indistinguishable from a new one, for a scheduler that replays
        its decisions from a fresh pool.
        """
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks - 1 == self._num_blocks_held_only_by_pins() > 0:
            # Pins do not keep a reset from happening: they let go and wait for their
            # prefixes to be cached again.
            for block_id in list(self._pin_holders()):
                self._release_pin_holds(self.blocks[block_id], hold_again=False)
            num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # the null block is always "used"
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if restore_block_order:
            self.free_block_queue = self._new_free_queue(self.blocks[1:])
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- allocation -------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the front of the free queue, evicting their cache
        entries. Callers check capacity first (``allocate_slots``); running dry here is
        a bug, hence ValueError rather than None."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            retention = self.retention_policy
            for block in ret:
                if block.block_hash is not None:
                    if retention is not None:
                        retention.count_eviction(block.priority)
                    if self._maybe_evict_cached_block(block):
                        self.num_evicted_on_reuse += 1
                block.ref_cnt = 1
        else:
            for block in ret:
                block.ref_cnt = 1
        return ret

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue."""
        retention = self.retention_policy
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if retention is not None and block.block_id in retention.holders:
                self._record_pinned_hit(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, given in eviction priority order.

        Blocks reaching 0 rejoin the free queue: unhashed ones at the front (scratch is
        reused first, while it is still warm), hashed ones at the back (cached prefixes
        age in LRU order).
        """
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if caching and block.block_hash is not None:
                    evict_last.append(block)
                else:
                    evict_first.append(block)
        if evict_first:
            self.free_block_queue.prepend_n(evict_first)
        if evict_last:
            self.free_block_queue.append_n(evict_last)

    # -- retention policy: pins and priorities --------------------------------------

    def _apply_retention(
        self, request: Request, block: KVCacheBlock, key: BlockHashWithGroupId, start: int, end: int
    ) -> None:
        """A block just cached takes its request's priority and joins waiting pins."""
        retention = self.retention_policy
        assert retention is not None
        config = request.retention
        if config is not None and retention.priorities_enabled:
            priority, duration_s = config.block_priority(start, end, request.num_prompt_tokens)
            retention.set_priority(block, priority, duration_s, self.now)
        if key in retention.pins_by_key:
            self._hold_for_pins(key)

    def pin(self, pin: Pin) -> None:
        """Register ``pin`` and hold the blocks of its keys cached now; the rest join it
        as they are cached. Refused (QuotaExceededError, nothing changed) when the pins'
        keys would pass the pool's pinned budget."""
        retention = self.retention_policy
        if retention is None:
            raise QuotaExceededError(
                "pinning is off in this pool: its pinned budget is 0 blocks "
                "(set a pinned fraction, e.g. --max-pinned-fraction 0.1)"
            )
        retention.check_budget(pin.pin_id, len(pin.keys))
        retention.pins[pin.owner_key] = pin
        for key in pin.keys:
            retention.pins_by_key.setdefault(key, []).append(pin)
        retention.schedule_pin_expiry(pin)
        retention.stats.pins_created += 1
        for key in pin.keys:
            self._hold_for_pins(key)

    def unpin(self, tenant: str, pin_id: str, expired: bool = False) -> Pin | None:
        """Drop ``tenant``'s pin ``pin_id`` and its holds (its blocks age as freed
        cached blocks); None if there is no such pin. Counted as removed, or as
        ``expired``."""
        retention = self.retention_policy
        pin = retention.pins.pop((tenant, pin_id), None) if retention is not None else None
        if retention is None or pin is None:
            return None
        for key in pin.keys:
            waiting = retention.pins_by_key[key]
            waiting.remove(pin)
            if not waiting:
                del retention.pins_by_key[key]
        held = list(pin.held.values())
        pin.held.clear()
        for block in held:
            holders = retention.holders[block.block_id]
            holders.remove(pin)
            if not holders:
                del retention.holders[block.block_id]
        self.free_blocks(held)
        if expired:
            retention.stats.pins_expired += 1
        else:
            retention.stats.pins_removed += 1
        return pin

    def expire_retention(self, now: float) -> None:
        """Let time pass to ``now``: pins past their TTL let go, priorities past their
        duration fall back to the default (a free block moves to the front of the
        default level: it is the least recently used there)."""
        self.now = now
        retention = self.retention_policy
        if retention is None:
            return
        for pin in retention.expired_pins(now):
            self.unpin(pin.tenant, pin.pin_id, expired=True)
        queue = self.free_block_queue
        for block in retention.expired_priorities(now, self.blocks):
            if block.block_hash is None:
                continue
            block.priority = DEFAULT_PRIORITY
            retention.stats.priorities_expired += 1
            if block.prev_free_block is not None and isinstance(queue, PriorityFreeQueue):
                queue.requeue_at_front(block)

    def _hold_for_pins(self, key: BlockHashWithGroupId) -> None:
        """Every pin waiting on ``key`` takes a reference on the block cached under it."""
        retention = self.retention_policy
        assert retention is not None
        block = self.cached_block_hash_to_block.get_one_block(key)
        if block is None:
            return
        for pin in retention.pins_by_key.get(key, ()):
            if key in pin.held:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            pin.held[key] = block
            retention.holders.setdefault(block.block_id, []).append(pin)

    def _release_pin_holds(self, block: KVCacheBlock, hold_again: bool) -> None:
        """The pins holding ``block`` let go of it and wait for its keys again; with
        ``hold_again`` another block under the same key, if any, is held instead (the
        block lost its keys)."""
        retention = self.retention_policy
        assert retention is not None
        pins = retention.holders.pop(block.block_id, [])
        keys: list[BlockHashWithGroupId] = []
        for pin in pins:
            for key in [k for k, held in pin.held.items() if held is block]:
                del pin.held[key]
                keys.append(key)
        self.free_blocks([block] * len(pins))
        if hold_again:
            for key in keys:
                self._hold_for_pins(key)

    def _record_pinned_hit(self, block: KVCacheBlock) -> None:
        retention = self.retention_policy
        assert retention is not None
        for pin in retention.holders[block.block_id]:
            pin.num_hits += 1
            retention.stats.pinned_block_hits += 1
            if pin.refresh_on_hit and pin.ttl_s is not None:
                pin.expires_at = self.now + pin.ttl_s
                retention.schedule_pin_expiry(pin)

    def _pin_holders(self) -> dict[int, list[Pin]]:
        return self.retention_policy.holders if self.retention_policy is not None else {}

    def _num_blocks_held_only_by_pins(self) -> int:
        holders = self._pin_holders()
        return sum(1 for i, pins in holders.items() if self.blocks[i].ref_cnt == len(pins))

    # -- accounting -------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks are free)."""
        total = self.num_gpu_blocks - 1
        if total == 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

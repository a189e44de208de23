"""``KVCacheBlock`` and the free queue that orders blocks for eviction.

The queue is intrusive: each block carries its own ``prev_free_block`` /
``next_free_block`` links, so removing a block from the middle (a prefix-cache hit
on a free block) is O(1) without a lookup. Two sentinel blocks (id -1) bound the
list, so a linked block never has a ``None`` neighbour.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Final

# Block ids per KV cache group, in block-table order: a prefix hit, an allocation's new
# blocks. (The client spells the same type ``kvservice.client.BlockIds``: it loads
# nothing of the core.)
BlockIds = tuple[tuple[int, ...], ...]

# ``block hash ‖ group id (4 bytes, big endian)``: the key of the prefix cache map.
BlockHash = bytes
BlockHashWithGroupId = bytes

# TensorRT-LLM's default retention priority: a block nobody gave a priority to. The
# priority eviction policy evicts lower priorities first (core/retention.py).
DEFAULT_PRIORITY: Final = 35


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return key[:-4]


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big")


class KVCacheBlock:
    """One physical block: its id, how many block tables hold it, and its cache key.

    ``ref_cnt`` counts the request block tables that contain the block; 0 means the
    block sits in the free queue (and may still be a prefix-cache entry until it is
    reused). The free-list links belong to ``FreeKVCacheBlockQueue`` alone.
    ``priority`` is the block's retention priority while it is cached; only the
    priority eviction policy reads it.
    """

    __slots__ = (
        "_block_hash",
        "_block_hash_num_tokens",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "priority",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHashWithGroupId | None = None
        self._block_hash_num_tokens: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False
        self.priority = DEFAULT_PRIORITY

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Length of the prefix the hash fingerprints: a block boundary, or a hash
        boundary inside the block for a partial entry (None when unknown)."""
        return self._block_hash_num_tokens

    def set_block_hash(
        self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None
    ) -> None:
        assert self._block_hash is None, (
            f"block {self.block_id} already has a hash; a block is cached once between resets"
        )
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None
        self.priority = DEFAULT_PRIORITY

    def __repr__(self) -> str:
        # Neighbour ids, not neighbours: printing the objects would recurse the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self._block_hash!r}, prev_free_block={prev_id}, "
            f"next_free_block={next_id})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order: the front is evicted (reused) first.

    ``BlockPool.free_blocks`` prepends blocks without a hash (scratch blocks are reused
    first) and appends hashed ones (cached prefixes age in LRU order); callers free a
    request's blocks in reverse so a chain's tail is evicted before its root.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for prev, nxt in itertools.pairwise(chain):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block; ``ValueError`` when the queue is empty."""
        first = self.fake_free_list_head.next_free_block
        if first is None or first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, front first."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n, f"cannot pop {n} of {self.num_free_blocks} free blocks"
        self.num_free_blocks -= n
        head = self.fake_free_list_head
        curr = head.next_free_block
        ret: list[KVCacheBlock] = []
        for _ in range(n):
            assert curr is not None
            ret.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        assert curr is not None
        head.next_free_block = curr
        curr.prev_free_block = head
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue; ``RuntimeError`` if not queued."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in the given order (evicted last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None, "the tail sentinel lost its link: the free queue is corrupted"
        n = 0
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
            n += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += n

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in the given order (evicted first)."""
        head = self.fake_free_list_head
        first = head.next_free_block
        assert first is not None, "the head sentinel lost its link: the free queue is corrupted"
        last = head
        n = 0
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
            n += 1
        last.next_free_block = first
        first.prev_free_block = last
        self.num_free_blocks += n

    def __iter__(self) -> Iterator[KVCacheBlock]:
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            yield curr
            curr = curr.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front-to-back list of the queue (for tests and audits; O(n))."""
        return list(self)

"""``KVCacheBlock`` and ``FreeKVCacheBlockQueue`` (catalogue U6-U13)."""

from __future__ import annotations

import pytest

from kvservice.core.kv_cache_block import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)


def blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def assert_links_consistent(queue: FreeKVCacheBlockQueue) -> None:
    """Walk head to tail checking that every prev link mirrors the next link."""
    prev = queue.fake_free_list_head
    curr = prev.next_free_block
    count = 0
    while curr is not queue.fake_free_list_tail:
        assert curr is not None
        assert curr.prev_free_block is prev
        prev, curr = curr, curr.next_free_block
        count += 1
    assert queue.fake_free_list_tail.prev_free_block is prev
    assert count == queue.num_free_blocks


class TestKVCacheBlock:
    def test_fresh_block_state(self) -> None:
        """A new block has no references, no hash, no free-list links and is not null."""
        block = KVCacheBlock(0)
        assert block.block_id == 0
        assert block.ref_cnt == 0
        assert block.block_hash is None
        assert block.prev_free_block is None
        assert block.next_free_block is None
        assert block.is_null is False

    def test_ref_count_and_hash_lifecycle(self) -> None:
        """U6: the ref count moves freely; a hash is set once and cleared by reset_hash."""
        block = KVCacheBlock(0)
        block.ref_cnt += 1
        assert block.ref_cnt == 1
        block.ref_cnt -= 1
        assert block.ref_cnt == 0
        key = make_block_hash_with_group_id(b"abc", 0)
        block.set_block_hash(key)
        assert block.block_hash == b"abc\x00\x00\x00\x00"
        block.reset_hash()
        assert block.block_hash is None

    def test_setting_a_second_hash_is_refused(self) -> None:
        """A block that already carries a hash refuses another one (AssertionError)."""
        block = KVCacheBlock(3)
        block.set_block_hash(make_block_hash_with_group_id(b"one", 0))
        with pytest.raises(AssertionError):
            block.set_block_hash(make_block_hash_with_group_id(b"two", 0))
        assert block.block_hash == make_block_hash_with_group_id(b"one", 0)

    def test_uses_slots(self) -> None:
        """U7: the block has no __dict__ and an unknown attribute cannot be set."""
        block = KVCacheBlock(1)
        assert not hasattr(block, "__dict__")
        unknown = "not_a_field"
        with pytest.raises(AttributeError):
            setattr(block, unknown, 1)

    def test_repr_names_neighbour_ids(self) -> None:
        """The repr shows neighbour ids rather than neighbour objects (no recursion)."""
        queue = FreeKVCacheBlockQueue(blocks(3))
        middle = queue.get_all_free_blocks()[1]
        text = repr(middle)
        assert "prev_free_block=0" in text
        assert "next_free_block=2" in text

    def test_group_id_suffix_round_trip(self) -> None:
        """The map key is the hash followed by the group id as 4 big-endian bytes."""
        key = make_block_hash_with_group_id(b"\x01\x02", 258)
        assert key == b"\x01\x02\x00\x00\x01\x02"
        assert get_block_hash(key) == b"\x01\x02"
        assert get_group_id(key) == 258


class TestFreeQueuePrimitives:
    def test_initialization_single_block(self) -> None:
        """U8: a one-block queue counts 1 and both sentinels point at that block."""
        (b0,) = blocks(1)
        queue = FreeKVCacheBlockQueue([b0])
        assert queue.num_free_blocks == 1
        assert queue.fake_free_list_head.next_free_block is b0
        assert queue.fake_free_list_tail.prev_free_block is b0
        assert queue.fake_free_list_head.block_id == -1
        assert queue.fake_free_list_tail.block_id == -1

    def test_initial_order_is_the_given_order(self) -> None:
        """The queue starts in the order of the list it was built from."""
        bs = blocks(6)
        order = [bs[i] for i in (1, 3, 5, 4, 0, 2)]
        queue = FreeKVCacheBlockQueue(order)
        assert queue_ids(queue) == [1, 3, 5, 4, 0, 2]
        assert_links_consistent(queue)

    def test_operations(self) -> None:
        """U9: popleft, remove and append keep the count and the links consistent."""
        b0, b1, b2, b3, b4 = bs = blocks(5)
        queue = FreeKVCacheBlockQueue(bs)

        assert queue.popleft() is b0
        assert queue.num_free_blocks == 4
        assert b0.prev_free_block is None and b0.next_free_block is None

        queue.remove(b2)
        assert queue.num_free_blocks == 3
        assert b1.next_free_block is b3
        assert b3.prev_free_block is b1
        assert b2.prev_free_block is None and b2.next_free_block is None

        queue.append(b2)
        assert queue.num_free_blocks == 4
        assert queue.fake_free_list_tail.prev_free_block is b2
        assert b2.prev_free_block is b4
        assert b4.next_free_block is b2
        assert_links_consistent(queue)

        for expected in (b1, b3, b4, b2):
            assert queue.popleft() is expected
        assert queue.num_free_blocks == 0
        assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
        assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head

        with pytest.raises(ValueError, match="No free blocks available"):
            queue.popleft()

    def test_remove_of_unqueued_block_raises(self) -> None:
        """Removing a block that is not linked into the queue raises RuntimeError."""
        b0, b1 = bs = blocks(2)
        queue = FreeKVCacheBlockQueue(bs)
        queue.popleft()
        with pytest.raises(RuntimeError):
            queue.remove(b0)
        assert queue.num_free_blocks == 1
        assert queue_ids(queue) == [b1.block_id]

    def test_append_n(self) -> None:
        """U10: append_n adds blocks at the tail in order; an empty list is a no-op."""
        b0, b1, b2, b3, b4, b5 = blocks(6)
        queue = FreeKVCacheBlockQueue([])
        queue.append_n([])
        assert queue.num_free_blocks == 0
        assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail

        queue.append_n([b0])
        assert queue_ids(queue) == [0]
        queue.append_n([b4, b5])
        assert queue_ids(queue) == [0, 4, 5]
        queue.append_n([b1, b2, b3])
        assert queue_ids(queue) == [0, 4, 5, 1, 2, 3]
        assert queue.num_free_blocks == 6
        assert_links_consistent(queue)

    def test_append_n_on_corrupted_queue(self) -> None:
        """U10: append_n asserts the tail sentinel is linked and leaves the count at 0."""
        queue = FreeKVCacheBlockQueue([])
        queue.fake_free_list_tail.prev_free_block = None
        with pytest.raises(AssertionError):
            queue.append_n([KVCacheBlock(0)])
        assert queue.num_free_blocks == 0

    def test_prepend_n(self) -> None:
        """U11: prepend_n inserts blocks in order in front of the current head."""
        b0, b1, b2, _b3, b4, b5 = blocks(6)
        queue = FreeKVCacheBlockQueue([b0])
        queue.prepend_n([])
        assert queue_ids(queue) == [0]
        assert queue.num_free_blocks == 1

        queue.prepend_n([b4, b5])
        assert queue_ids(queue) == [4, 5, 0]
        queue.prepend_n([b1, b2])
        assert queue_ids(queue) == [1, 2, 4, 5, 0]
        assert queue.num_free_blocks == 5
        assert_links_consistent(queue)

        assert [queue.popleft().block_id for _ in range(5)] == [1, 2, 4, 5, 0]
        assert queue.num_free_blocks == 0

    def test_prepend_n_into_empty_queue(self) -> None:
        """prepend_n on an empty queue links the blocks between the two sentinels."""
        b0, b1 = blocks(2)
        queue = FreeKVCacheBlockQueue([])
        queue.prepend_n([b1, b0])
        assert queue_ids(queue) == [1, 0]
        assert_links_consistent(queue)

    def test_popleft_n(self) -> None:
        """U12: popleft_n pops from the front in order and clears the popped links."""
        bs = blocks(6)
        b0, b1, b2, b3, b4, b5 = bs
        queue = FreeKVCacheBlockQueue([b1, b3, b5, b4, b0, b2])

        assert queue.popleft_n(0) == []
        assert queue.num_free_blocks == 6

        popped = queue.popleft_n(1)
        assert popped == [b1]
        assert b1.prev_free_block is None and b1.next_free_block is None
        assert queue.num_free_blocks == 5

        popped = queue.popleft_n(2)
        assert popped == [b3, b5]
        assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
        assert queue.num_free_blocks == 3
        assert_links_consistent(queue)

        assert queue.popleft_n(3) == [b4, b0, b2]
        assert queue.num_free_blocks == 0
        assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail

    def test_popleft_n_more_than_available(self) -> None:
        """Asking popleft_n for more blocks than are queued fails an assertion."""
        queue = FreeKVCacheBlockQueue(blocks(2))
        with pytest.raises(AssertionError):
            queue.popleft_n(3)
        assert queue.num_free_blocks == 2

    def test_get_all_free_blocks(self) -> None:
        """U13: get_all_free_blocks lists the queue front to back after each change."""
        bs = blocks(5)
        queue = FreeKVCacheBlockQueue(bs)
        assert queue.get_all_free_blocks() == bs
        queue.popleft()
        assert queue.get_all_free_blocks() == bs[1:]
        queue.remove(bs[2])
        assert queue.get_all_free_blocks() == [bs[1], bs[3], bs[4]]
        queue.append(bs[2])
        assert queue.get_all_free_blocks() == [bs[1], bs[3], bs[4], bs[2]]

"""Sparse prefix-cache retention for sliding-window and Mamba groups (catalogue 44-47,
49, 60-64, 67, 68) and the shared-prefix junction that pins a cache entry."""

from __future__ import annotations

import dataclasses

import pytest

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import KVCacheSpec, MambaSpec
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.single_type_kv_cache_manager import sparse_retention_mask
from tests.core.helpers import finish, make_config, prefill
from tests.core.support import cached_hash_indices, full, sliding


def manager(num_blocks: int, *specs: KVCacheSpec, retention: int | None) -> KVCacheManager:
    config = dataclasses.replace(
        make_config(num_blocks, *specs), prefix_cache_retention_interval=retention
    )
    return KVCacheManager(config, 8192)


def cached_after_prefill(m: KVCacheManager, prompt: list[int], gid: int) -> set[int]:
    req = m.new_request("producer", prompt)
    prefill(m, req)
    return cached_hash_indices(m, req.block_hashes, gid)


def mask_set(mask: list[bool] | None) -> set[int] | None:
    return None if mask is None else {i for i, keep in enumerate(mask) if keep}


class TestRetentionMask:
    @pytest.mark.parametrize(
        ("retention", "boundaries", "expected"),
        [
            (None, (255,), None),  # dense
            (16, (255,), None),  # one block per segment: everything is reachable
            (64, (255,), {3, 7, 11, 14, 15}),
            (0, (255,), {14}),
            (0, (255, 96), {5, 14}),
            (0, (255, 100), {5, 14}),  # the junction rounds down to a hit boundary
            (64, (255, 96), {3, 5, 7, 11, 14, 15}),
            (None, (255, 96), None),
            (0, (255, 512), {14}),  # beyond the blocks being cached
            (0, (255, 0), {14}),
        ],
    )
    def test_one_block_windows(
        self, retention: int | None, boundaries: tuple[int, ...], expected: set[int] | None
    ) -> None:
        """63, 64: a group that reads one block (Mamba, or a window of one block)."""
        mask = sparse_retention_mask(range(16), 16, 1, 0, 16, retention, boundaries)
        assert mask_set(mask) == expected

    def test_wider_window_keeps_a_run(self) -> None:
        """67: a 48-token window reads three blocks before each kept boundary."""
        mask = sparse_retention_mask(range(16), 16, 3, 0, 16, 0, (255, 96))
        assert mask_set(mask) == {3, 4, 5, 12, 13, 14}


class TestRetentionInManagers:
    def test_pure_sliding_window_interval(self) -> None:
        """60: window 16, retention 64, 256 tokens: segment ends plus the replay run;
        a replay hits 240 tokens."""
        m = manager(40, sliding(16, 16), retention=64)
        prompt = list(range(256))
        assert cached_after_prefill(m, prompt, 0) == {3, 7, 11, 14, 15}
        _, num_hit, _ = m.get_computed_blocks(m.new_request("replay", prompt))
        assert num_hit == 240

    def test_pure_sliding_window_latest_only(self) -> None:
        """61: retention 0 keeps only the replay boundary's block."""
        m = manager(40, sliding(16, 16), retention=0)
        prompt = list(range(256))
        assert cached_after_prefill(m, prompt, 0) == {14}
        _, num_hit, _ = m.get_computed_blocks(m.new_request("replay", prompt))
        assert num_hit == 240

    def test_pure_sliding_window_dense(self) -> None:
        """62: no interval caches every block."""
        m = manager(40, sliding(16, 16), retention=None)
        assert cached_after_prefill(m, list(range(256)), 0) == set(range(16))

    def test_hybrid_interval_aligns_to_the_scheduler_block(self) -> None:
        """44: [Full 32, SW 8 w 8], retention 64, 128 tokens: the window group keeps
        7 and 15 (64-token segments) and 11 (replay hit at 96)."""
        m = manager(60, full(32), sliding(8, 8), retention=64)
        req = m.new_request("producer", list(range(128)))
        prefill(m, req)
        assert cached_hash_indices(m, req.block_hashes, 1) == {7, 11, 15}

    def test_latest_only_reuses_the_replay_boundary(self) -> None:
        """49: retention 0 keeps window block 11; the same prompt hits 96 tokens, the
        first 96 tokens alone (hit capped at 64 by full attention) hit nothing."""
        m = manager(60, full(32), sliding(8, 8), retention=0)
        prompt = list(range(128))
        req = m.new_request("producer", prompt)
        prefill(m, req)
        assert cached_hash_indices(m, req.block_hashes, 1) == {11}
        finish(m, req)
        hit, num_hit, _ = m.get_computed_blocks(m.new_request("replay", prompt))
        assert num_hit == 96
        assert len(hit.blocks[1]) == 12
        _, num_hit, _ = m.get_computed_blocks(m.new_request("short", prompt[:96]))
        assert num_hit == 0

    @pytest.mark.parametrize(
        ("retention", "expected_hit"),
        [(None, 64), (0, 0)],
    )
    def test_shared_prefix_without_pin(self, retention: int | None, expected_hit: int) -> None:
        """68: two prompts sharing 64 tokens; with retention 0 the producer's window
        blocks at 64 were not kept, so the consumer hits nothing but learns the junction."""
        m = manager(60, full(16), sliding(16, 32), retention=retention)
        shared = list(range(64))
        prefill(m, m.new_request("0", [*shared, *range(1000, 1040)]))
        consumer = m.new_request("1", [*shared, *range(2000, 2040)])
        _, num_hit, boundary = m.get_computed_blocks(consumer)
        assert num_hit == expected_hit
        if retention == 0:
            assert boundary == 64
            assert consumer.shared_prefix_boundary == 64

    def test_shared_prefix_pinned_by_the_consumer(self) -> None:
        """68: the consumer that learned the junction caches the window before it, so a
        third request sharing the prefix hits 64 tokens."""
        m = manager(60, full(16), sliding(16, 32), retention=0)
        shared = list(range(64))
        prefill(m, m.new_request("0", [*shared, *range(1000, 1040)]))
        prefill(m, m.new_request("1", [*shared, *range(2000, 2040)]))
        _, num_hit, _ = m.get_computed_blocks(m.new_request("2", [*shared, *range(3000, 3040)]))
        assert num_hit == 64

    def test_mamba_keeps_only_reachable_states(self) -> None:
        """65: [Full, Mamba] with retention 0: Mamba keeps the replay state (block 14
        of a 256-token prompt); a consumer-pinned junction at 96 adds block 5."""
        mamba = MambaSpec(16, ((4, 64),), ("float32",), mamba_cache_mode="all")
        m = manager(80, full(16), mamba, retention=0)
        prompt = list(range(256))
        assert cached_after_prefill(m, prompt, 1) == {14}
        consumer = m.new_request("consumer", [*prompt[:96], *range(5000, 5160)])
        _, num_hit, boundary = m.get_computed_blocks(consumer)
        assert (num_hit, boundary) == (0, 96)
        prefill(m, consumer)
        assert 5 in cached_hash_indices(m, consumer.block_hashes, 1)


class TestRetentionValidation:
    @pytest.mark.parametrize(
        ("retention", "message"),
        [(33, "multiple of scheduler_block_size"), (-32, "non-negative")],
    )
    def test_invalid_intervals(self, retention: int, message: str) -> None:
        """45: the interval must be a non-negative multiple of the scheduler block."""
        with pytest.raises(InvalidArgumentError, match=message):
            manager(60, full(32), sliding(8, 8), retention=retention)

    def test_zero_retention_is_ignored_for_full_attention(self) -> None:
        """46: retention 0 on a full-attention model is allowed and changes nothing."""
        m = manager(20, full(16), retention=0)
        assert m.coordinator.retention_interval == 0
        assert cached_after_prefill(m, list(range(64)), 0) == {0, 1, 2, 3}

    def test_positive_retention_rejects_full_attention_only(self) -> None:
        """47: a positive interval on a model without window or Mamba groups is refused."""
        with pytest.raises(InvalidArgumentError, match="no sliding-window or Mamba"):
            manager(20, full(16), retention=16)

"""Pool sizing from a memory budget and the capacity checks (catalogue U35, U37 and the
null-block reservation)."""

from __future__ import annotations

import pytest

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from kvservice.core.kv_cache_sizing import (
    check_enough_kv_cache_memory,
    get_max_concurrency,
    get_num_blocks,
    kv_cache_config_from_memory,
    num_blocks_per_request,
)

# vLLM's test spec: block 16, 2 KV heads of 64, float32 -> 16 KiB per block per layer.
M = 16384


def full_m() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")


def sliding_m(window: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sliding_window=window
    )


def group(names: list[str], spec: KVCacheSpec) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(names, spec)


def config(num_blocks: int, *groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=list(groups))


class TestKVCacheConfigFromMemory:
    def test_page_size(self) -> None:
        """The reference spec's page is 16 KiB (K and V of 16 tokens x 2 heads x 64)."""
        assert full_m().page_size_bytes == M
        assert sliding_m().page_size_bytes == M

    def test_two_full_layers(self) -> None:
        """U37: two full layers in one group with M*2*32 bytes get 32 blocks and one
        tensor of M*32 per layer."""
        cfg = kv_cache_config_from_memory([group(["l1", "l2"], full_m())], M * 2 * 32)
        assert cfg.num_blocks == 32
        assert cfg.kv_cache_tensors == [
            KVCacheTensor(size=M * 32, shared_by=["l1"]),
            KVCacheTensor(size=M * 32, shared_by=["l2"]),
        ]
        assert len(cfg.kv_cache_groups) == 1

    def test_two_sliding_window_layers(self) -> None:
        """U37: two sliding-window layers in one group also get 32 blocks."""
        cfg = kv_cache_config_from_memory([group(["l1", "l2"], sliding_m())], M * 2 * 32)
        assert cfg.num_blocks == 32

    def test_hybrid_one_layer_per_group(self) -> None:
        """U37: full + SW as two one-layer groups share tensors, so the same memory
        buys 64 blocks in one tensor of M*64 shared by both layers."""
        cfg = kv_cache_config_from_memory(
            [group(["l1"], full_m()), group(["l2"], sliding_m())], M * 2 * 32
        )
        assert cfg.num_blocks == 64
        assert cfg.kv_cache_tensors == [KVCacheTensor(size=M * 64, shared_by=["l1", "l2"])]

    def test_hybrid_grouped_layers(self) -> None:
        """U37: 2 full + 4 SW layers in groups of two get 32 blocks and two tensors,
        the i-th shared by the i-th layer of every group."""
        groups = [
            group(["l1", "l2"], full_m()),
            group(["l3", "l5"], sliding_m()),
            group(["l4", "l6"], sliding_m()),
        ]
        cfg = kv_cache_config_from_memory(groups, M * 2 * 32)
        assert cfg.num_blocks == 32
        assert cfg.kv_cache_tensors == [
            KVCacheTensor(size=M * 32, shared_by=["l1", "l3", "l4"]),
            KVCacheTensor(size=M * 32, shared_by=["l2", "l5", "l6"]),
        ]

    def test_num_gpu_blocks_override(self) -> None:
        """U37: num_gpu_blocks_override replaces the computed block count."""
        cfg = kv_cache_config_from_memory(
            [group(["l1", "l2"], full_m())], M * 2 * 32, num_gpu_blocks_override=16
        )
        assert cfg.num_blocks == 16

    def test_attention_free(self) -> None:
        """U38: with no KV cache groups the config has only the null block."""
        cfg = kv_cache_config_from_memory([], 0)
        assert (cfg.num_blocks, cfg.kv_cache_tensors, cfg.kv_cache_groups) == (1, [], [])

    def test_too_little_memory(self) -> None:
        """Memory for fewer than two blocks (the null block plus one) is refused."""
        with pytest.raises(InvalidArgumentError):
            kv_cache_config_from_memory([group(["l1"], full_m())], M + M // 2)

    def test_get_num_blocks_rounds_down(self) -> None:
        """get_num_blocks is memory // page // layers, never negative."""
        assert get_num_blocks(M * 2 * 32 + M - 1, M, 2) == 32
        assert get_num_blocks(-5, M, 1) == 0


class TestNullBlockReservation:
    def test_blocks_per_request(self) -> None:
        """A 512-token request needs 32 blocks of 16 tokens."""
        cfg = config(33, group(["l1"], full_m()))
        assert num_blocks_per_request(cfg, 512, 512) == 32

    def test_exactly_needed_blocks_rejected(self) -> None:
        """max_model_len 512 at block 16: a pool of 32 blocks is rejected because block
        0 is the null block."""
        cfg = config(32, group(["l1"], full_m()))
        with pytest.raises(InvalidArgumentError, match="max seq len"):
            check_enough_kv_cache_memory(cfg, 512, 512)

    def test_one_more_block_accepted(self) -> None:
        """A pool of 33 blocks serves a 512-token request."""
        check_enough_kv_cache_memory(config(33, group(["l1"], full_m())), 512, 512)

    def test_from_memory_then_check(self) -> None:
        """Memory for 33 pages passes the check; an override of 32 blocks does not."""
        groups = [group(["l1"], full_m())]
        check_enough_kv_cache_memory(kv_cache_config_from_memory(groups, M * 33), 512, 512)
        small = kv_cache_config_from_memory(groups, M * 33, num_gpu_blocks_override=32)
        with pytest.raises(InvalidArgumentError):
            check_enough_kv_cache_memory(small, 512, 512)


class TestMaxConcurrency:
    def test_full_attention(self) -> None:
        """U35: 32 full layers, max_model_len 16384, 1536 blocks -> concurrency 1.5."""
        layers = [f"layer.{i}" for i in range(32)]
        cfg = config(1536, group(layers, full_m()))
        assert get_max_concurrency(cfg, 16384, 1024) == pytest.approx(1.5)

    def test_sliding_window(self) -> None:
        """U35: window 1024 with 1024 batched tokens needs 129 blocks per request, so
        129*3 blocks give concurrency 3."""
        spec = sliding_m(1024)
        cfg = config(129 * 3, group(["l1"], spec))
        assert num_blocks_per_request(cfg, 16384, 1024) == 129
        assert get_max_concurrency(cfg, 16384, 1024) == pytest.approx(3.0)

    def test_hybrid(self) -> None:
        """U35: full + SW(1024) need 1024 + 129 blocks per request; (1024+129)*3 blocks
        give concurrency 3."""
        cfg = config((1024 + 129) * 3, group(["l1"], full_m()), group(["l2"], sliding_m(1024)))
        assert get_max_concurrency(cfg, 16384, 1024) == pytest.approx(3.0)

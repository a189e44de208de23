"""Slot writes, zeroing and copies against direct loops; the layout; bad input."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_runtime.kv_cache import BLOCK_DIM, PagedKVCache, torch_dtype
from gpu_runtime.ops import copy_blocks, reshape_and_cache, zero_blocks
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from kvservice.core.kv_cache_sizing import kv_cache_config_from_memory
from tests.gpu_runtime.reference import ref_write

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_cache(
    num_blocks: int, block_size: int, heads: int, head_size: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, heads, head_size, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_reshape_and_cache_matches_a_loop(dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(seed)
    num_blocks, block_size, heads, head_size = 12, rng.choice([1, 4, 16]), 2, 8
    cache = random_cache(num_blocks, block_size, heads, head_size, dtype, seed)
    num_tokens = rng.randint(1, min(20, num_blocks * block_size))
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    slots[rng.randrange(num_tokens)] = -1  # one padding token
    written = rng.randint(1, num_tokens)  # the tail beyond the slot mapping is padding
    key = torch.randn(num_tokens, heads, head_size).to(dtype)
    value = torch.randn(num_tokens, heads, head_size).to(dtype)
    expected = ref_write(key, value, cache, slots[:written])
    reshape_and_cache(key, value, cache, torch.tensor(slots[:written]))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("seed", range(3))
def test_zero_blocks_matches_a_loop(seed: int) -> None:
    rng = random.Random(seed)
    cache = torch.randn(3, 2, 10, 4, 2, 8)
    ids = rng.sample(range(10), rng.randint(0, 10))
    expected = cache.clone()
    for i in ids:
        expected[:, :, i] = 0
    zero_blocks(cache, torch.tensor(ids, dtype=torch.int64), BLOCK_DIM)
    assert torch.equal(cache, expected)


def test_copy_blocks_reads_every_source_before_writing() -> None:
    cache = torch.randn(3, 2, 10, 4, 2, 8)
    before = cache.clone()
    # A chain and a swap: 1->2, 2->4 copies the original 2; 5<->6 swap.
    pairs = [(1, 2), (2, 4), (5, 6), (6, 5)]
    copy_blocks(
        cache, torch.tensor([s for s, _ in pairs]), torch.tensor([d for _, d in pairs]), BLOCK_DIM
    )
    expected = before.clone()
    for src, dst in pairs:
        expected[:, :, dst] = before[:, :, src]
    assert torch.equal(cache, expected)


def tiny_config(num_blocks: int = 8, dtype: str = "float32") -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=dtype)
    return kv_cache_config_from_memory(
        [KVCacheGroupSpec(["a", "b"], spec)],
        available_memory=0,
        num_gpu_blocks_override=num_blocks,
        needs_kv_cache_zeroing=True,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_layout_is_sized_by_the_core_and_layers_are_views(dtype: str) -> None:
    config = tiny_config(dtype=dtype)
    cache = PagedKVCache(config)
    assert cache.nbytes == sum(t.size for t in config.kv_cache_tensors)
    layer = cache.layer("b")
    assert layer.shape == (2, 8, 4, 2, 8)
    assert layer.dtype == torch_dtype(dtype)
    layer[1, 3].fill_(1.0)  # values of block 3 of layer b
    assert cache.groups[0][1, 1, 3].eq(1).all()
    cache.zero_blocks([3])
    assert not cache.buffer.any()


def test_zero_and_copy_cover_every_layer_and_group() -> None:
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    # Same page size, different shape and dtype: bs 8 x 1 head x 16 x bf16.
    window = SlidingWindowSpec(
        block_size=8, num_kv_heads=1, head_size=16, dtype="bfloat16", sliding_window=8
    )
    config = KVCacheConfig(
        num_blocks=6,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["f0", "f1"], full), KVCacheGroupSpec(["w0"], window)],
    )
    cache = PagedKVCache(config)
    assert cache.layer("w0").shape == (2, 6, 8, 1, 16)
    cache.layer("f1")[:, 2].fill_(3.0)
    cache.layer("w0")[:, 4].fill_(5.0)  # group 1 owns block 4 in the pool
    cache.copy_blocks([(2, 1), (4, 3)])
    assert cache.layer("f1")[:, 1].eq(3).all()
    assert cache.layer("w0")[:, 3].eq(5).all()
    cache.zero_blocks([1, 2, 3, 4])
    assert not cache.buffer.any()


def assert_refused(match: str, call: object, cache: torch.Tensor) -> None:
    before = cache.clone()
    with pytest.raises(InvalidArgumentError, match=match):
        call()  # type: ignore[operator]
    assert torch.equal(cache, before), "a refused call wrote into the cache"


def test_bad_slot_writes_are_refused_before_writing() -> None:
    cache = random_cache(4, 4, 2, 8, torch.float32, 0)
    key = torch.randn(3, 2, 8)
    slots = torch.tensor([0, 5, 9])
    assert_refused(
        r"slot_mapping has 4 entries but key has only 3 tokens \(shape \(3, 2, 8\)\)",
        lambda: reshape_and_cache(key, key, cache, torch.tensor([0, 1, 2, 3])),
        cache,
    )
    assert_refused(
        r"slot_mapping holds 16, out of range \[-1, 16\)",
        lambda: reshape_and_cache(key, key, cache, torch.tensor([0, 16, 1])),
        cache,
    )
    assert_refused(
        r"key has shape \(3, 2, 8\) but value has shape \(3, 2, 4\)",
        lambda: reshape_and_cache(key, torch.randn(3, 2, 4), cache, slots),
        cache,
    )
    assert_refused(
        r"key has shape \(3, 1, 8\) but kv_cache \(2, 4, 4, 2, 8\) holds 2 KV heads",
        lambda: reshape_and_cache(key[:, :1], key[:, :1], cache, slots),
        cache,
    )
    assert_refused(
        r"key has dtype torch.float16 but kv_cache has dtype torch.float32",
        lambda: reshape_and_cache(key.half(), key.half(), cache, slots),
        cache,
    )
    assert_refused(
        r"slot_mapping must be int32 or int64",
        lambda: reshape_and_cache(key, key, cache, slots.float()),
        cache,
    )
    assert_refused(
        r"slot_mapping has duplicate entries",
        lambda: reshape_and_cache(key, key, cache, torch.tensor([1, 1, 2])),
        cache,
    )


def test_bad_block_ids_are_refused_before_writing() -> None:
    cache = PagedKVCache(tiny_config())
    cache.buffer.random_(0, 255)
    buffer = cache.buffer
    assert_refused(
        r"block_ids holds 8, out of range \[0, 8\)", lambda: cache.zero_blocks([1, 8]), buffer
    )
    assert_refused(r"block_ids holds -1", lambda: cache.zero_blocks([-1]), buffer)
    assert_refused(r"src holds 9, out of range", lambda: cache.copy_blocks([(9, 1)]), buffer)
    assert_refused(
        r"dst has duplicate entries", lambda: cache.copy_blocks([(1, 2), (3, 2)]), buffer
    )
    assert_refused(r"null block", lambda: cache.copy_blocks([(1, 0)]), buffer)

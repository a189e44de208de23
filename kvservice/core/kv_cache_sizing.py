"""Sizing the pool: how many blocks a memory budget buys, and whether they suffice.

Layout (vLLM's hybrid layout): with G groups of at most L layers each, there are L
tensors of ``page_size * num_blocks`` bytes; tensor i is shared by the i-th layer of
every group, so one block id names one page in each tensor. A single group of L
layers is the same layout with G = 1.
"""

from __future__ import annotations

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    cdiv,
)


def get_num_blocks(available_memory: int, page_size: int, num_layers: int) -> int:
    """Blocks that ``available_memory`` bytes hold when each block costs one page in
    each of ``num_layers`` tensors. The null block is one of them."""
    if page_size <= 0 or num_layers <= 0:
        raise InvalidArgumentError(
            f"page_size and num_layers must be positive, got {page_size} and {num_layers}"
        )
    return max(available_memory // page_size // num_layers, 0)


def kv_cache_config_from_memory(
    kv_cache_groups: list[KVCacheGroupSpec],
    available_memory: int,
    num_gpu_blocks_override: int | None = None,
    needs_kv_cache_zeroing: bool = False,
) -> KVCacheConfig:
    """Build the config for ``available_memory`` bytes of KV cache (null block included).

    >>> from kvservice.core.kv_cache_interface import FullAttentionSpec
    >>> spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64)
    >>> groups = [KVCacheGroupSpec(["l0", "l1"], spec)]
    >>> kv_cache_config_from_memory(groups, 16384 * 2 * 32).num_blocks
    32
    """
    if not kv_cache_groups:
        # Attention-free model: only the null block exists.
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    probe = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups)
    page_size = probe.page_size_bytes
    num_layers = max(len(g.layer_names) for g in kv_cache_groups)
    num_blocks = get_num_blocks(available_memory, page_size, num_layers)
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    if num_blocks < 2:
        raise InvalidArgumentError(
            f"{available_memory} bytes hold {num_blocks} block(s) of {page_size} bytes x "
            f"{num_layers} layers; at least 2 are needed (block 0 is the null block)"
        )
    tensors = [
        KVCacheTensor(
            size=page_size * num_blocks,
            shared_by=[g.layer_names[i] for g in kv_cache_groups if i < len(g.layer_names)],
        )
        for i in range(num_layers)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=kv_cache_groups,
        needs_kv_cache_zeroing=needs_kv_cache_zeroing,
    )


def num_blocks_per_request(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Blocks one request of ``max_model_len`` tokens holds at most, over all groups."""
    return sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in kv_cache_config.kv_cache_groups
    )


def check_enough_kv_cache_memory(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
) -> None:
    """Refuse a pool that cannot hold one request of ``max_model_len`` tokens; the null
    block is not usable, so it is not counted."""
    needed = num_blocks_per_request(kv_cache_config, max_model_len, max_num_batched_tokens)
    usable = kv_cache_config.num_blocks - 1
    if needed > usable:
        raise InvalidArgumentError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{needed} blocks are needed but the pool has {usable} usable blocks "
            f"(num_blocks={kv_cache_config.num_blocks}, block 0 is the null block). "
            f"Give the KV cache more memory or lower max_model_len."
        )


def get_max_concurrency(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int
) -> float:
    """How many requests of ``max_model_len`` tokens fit in the pool at once."""
    per_request = num_blocks_per_request(kv_cache_config, max_model_len, max_num_batched_tokens)
    return kv_cache_config.num_blocks / per_request if per_request else float("inf")

"""vLLM's ``KVCacheConfig`` in kvservice's terms, and the features kvservice refuses.

Only what decides allocation crosses over: block sizes, windows, Mamba modes, the pool
size and the EAGLE flags. A spec kvservice has no manager for is refused at startup by
name, never approximated: an approximation would hand out different block ids than
vLLM's own manager and nothing would notice until the model read the wrong KV.
"""

from __future__ import annotations

from typing import Any

from vllm.v1 import kv_cache_interface as vllm_spec

from kvservice.core.kv_cache_interface import (
    DTYPE_SIZES,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

# Allocation never reads the element type, only the page size does: a dtype kvservice
# does not name is stood in for by one of the same width.
_DTYPE_BY_WIDTH = {1: "uint8", 2: "float16", 4: "float32"}


class UnsupportedKVCacheConfigError(ValueError):
    """vLLM computed a KV cache layout that kvservice's manager does not implement."""


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name in DTYPE_SIZES:
        return name
    width = getattr(dtype, "itemsize", 2)
    return _DTYPE_BY_WIDTH.get(width, "float16")


def _attention_fields(spec: Any) -> dict[str, Any]:
    return {
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": _dtype_name(spec.dtype),
    }


def core_spec(spec: Any, group_id: int) -> KVCacheSpec:
    """The kvservice spec that allocates exactly as vLLM's manager for ``spec`` does."""
    kind = type(spec)
    # Full attention with a window or chunk set is what vLLM builds when the hybrid
    # allocator is off: those layers then hold every block, as full attention does.
    if kind in (vllm_spec.FullAttentionSpec, vllm_spec.MLAAttentionSpec):
        return FullAttentionSpec(**_attention_fields(spec))
    if kind is vllm_spec.SlidingWindowSpec and spec.extra_retained_tokens == 0:
        return SlidingWindowSpec(**_attention_fields(spec), sliding_window=spec.sliding_window)
    if kind is vllm_spec.ChunkedLocalAttentionSpec:
        return ChunkedLocalAttentionSpec(
            **_attention_fields(spec), attention_chunk_size=spec.attention_chunk_size
        )
    if kind is vllm_spec.CrossAttentionSpec:
        return CrossAttentionSpec(**_attention_fields(spec))
    if (
        kind is vllm_spec.MambaSpec
        and spec.mamba_cache_mode in ("none", "align")
        and spec.num_prefill_checkpoint_blocks == 0
    ):
        return MambaSpec(
            block_size=spec.block_size,
            shapes=tuple(tuple(shape) for shape in spec.shapes),
            dtypes=tuple(_dtype_name(dtype) for dtype in spec.dtypes),
            page_size_padded=spec.page_size_padded,
            mamba_cache_mode=spec.mamba_cache_mode,
            num_speculative_blocks=spec.num_speculative_blocks,
        )
    raise UnsupportedKVCacheConfigError(
        f"KV cache group {group_id} uses {kind.__name__} ({spec!r}), which kvservice's "
        "manager does not implement; supported: full attention (and MLA), sliding window, "
        "chunked local attention, cross attention, Mamba with mamba_cache_mode 'none' or "
        "'align' and no prefill checkpoint blocks"
    )


def core_cache_config(config: Any, num_blocks: int | None = None) -> KVCacheConfig:
    """kvservice's ``KVCacheConfig`` for vLLM's: same groups, in order, and the same
    pool unless ``num_blocks`` names a smaller one (a kvservice server's)."""
    groups = []
    for group_id, group in enumerate(config.kv_cache_groups):
        if group.host_resident or group.role != vllm_spec.KVCacheGroupRole.DEFAULT:
            raise UnsupportedKVCacheConfigError(
                f"KV cache group {group_id} is a HiSparse group (host_resident="
                f"{group.host_resident}, role={group.role.value}); kvservice does not "
                "manage host-resident pools"
            )
        groups.append(
            KVCacheGroupSpec(
                list(group.layer_names),
                core_spec(group.kv_cache_spec, group_id),
                is_eagle_group=group.is_eagle_group,
            )
        )
    return KVCacheConfig(
        num_blocks=config.num_blocks if num_blocks is None else num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        needs_kv_cache_zeroing=config.needs_kv_cache_zeroing,
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
    )

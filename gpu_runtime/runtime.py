"""``KVCacheRuntime``: the KV tensors plus the per-step work a scheduler step implies.

A server holding a ``KVCacheManager`` calls, once per scheduler step and before the
model runs: ``apply(manager.take_new_block_ids(), copies)`` (zero, then copy, as vLLM's
worker does), then ``build_metadata`` per KV cache group from the block tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.kv_cache import PagedKVCache
from kvservice.core.kv_cache_interface import KVCacheConfig


class KVCacheRuntime:
    """Owns the ``PagedKVCache`` of one ``KVCacheConfig`` on one device."""

    def __init__(self, config: KVCacheConfig, device: torch.device | str = "cpu") -> None:
        self.kv_cache = PagedKVCache(config, device)
        self.device = self.kv_cache.device

    def apply(
        self,
        new_block_ids_to_zero: Sequence[int] | None = None,
        copies: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Zero freshly allocated blocks, then apply copy-on-write copies.

        Zero first: a copy's destination is a fresh block, and copying after the zero
        keeps the copied data. Both are validated before anything is written.
        """
        if new_block_ids_to_zero:
            self.kv_cache.zero_blocks(list(new_block_ids_to_zero))
        if copies:
            self.kv_cache.copy_blocks(list(copies))

    def build_metadata(
        self,
        group: int,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> AttentionMetadata:
        """The step's metadata for KV cache group ``group`` (block tables from
        ``KVCacheManager.get_block_ids(request_id)[group]``)."""
        spec = self.kv_cache.specs[group]
        return AttentionMetadata.build(
            query_lens,
            seq_lens,
            block_tables,
            spec.block_size,
            self.kv_cache.num_blocks,
            self.device,
        )

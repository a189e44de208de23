"""The interface every paged-attention backend implements, with its input checks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.validation import check_device, check_dim, check_dtype
from kvservice.core.errors import InvalidArgumentError

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AttentionBackend(ABC):
    """Paged attention over one layer's KV cache for one step's batch.

    ``forward`` takes the packed queries ``[num_tokens, num_q_heads, head_size]`` of
    all sequences, one layer's cache ``[2, num_blocks, block_size, num_kv_heads,
    head_size]`` (new tokens already written) and the step's metadata; it returns the
    attention output shaped like the query. Attention is causal: new token ``j`` of
    sequence ``i`` sits at position ``seq_lens[i] - query_lens[i] + j`` and sees every
    position up to its own. Grouped-query attention: ``num_q_heads`` must be a
    multiple of ``num_kv_heads``.
    """

    name: ClassVar[str]

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float | None = None,
        *,
        validate: bool = True,
    ) -> torch.Tensor:
        """``validate=False`` skips ``check_attention_inputs`` for callers whose shapes
        are fixed by construction and whose metadata was validated when built (the
        per-layer hot path, as for ``reshape_and_cache``)."""
        if validate:
            check_attention_inputs(query, kv_cache, metadata)
        head_size = query.shape[-1]
        return self._forward(query, kv_cache, metadata, scale or head_size**-0.5)

    @abstractmethod
    def _forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The backend's computation on validated inputs."""


def check_attention_inputs(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    """Shapes, dtypes and devices of a ``forward`` call; host-side only (no sync)."""
    check_dim("query", query, 3, "[num_tokens, num_q_heads, head_size]")
    check_dim("kv_cache", kv_cache, 5, "[2, num_blocks, block_size, num_kv_heads, head_size]")
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    num_tokens, num_q_heads, q_head_size = query.shape
    if kv_cache.shape[0] != 2:
        raise InvalidArgumentError(
            f"kv_cache must hold keys and values in dim 0 (size 2), got shape "
            f"{tuple(kv_cache.shape)}"
        )
    if q_head_size != head_size:
        raise InvalidArgumentError(
            f"query has shape {tuple(query.shape)} (head_size {q_head_size}) but kv_cache "
            f"{tuple(kv_cache.shape)} has head_size {head_size}"
        )
    if num_q_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"query has {num_q_heads} heads (shape {tuple(query.shape)}), not a multiple of "
            f"the {num_kv_heads} KV heads of kv_cache {tuple(kv_cache.shape)}"
        )
    if num_tokens != metadata.num_tokens:
        raise InvalidArgumentError(
            f"query has {num_tokens} tokens (shape {tuple(query.shape)}) but the metadata's "
            f"query_lens sum to {metadata.num_tokens}"
        )
    if (metadata.block_size, metadata.num_blocks) != (block_size, num_blocks):
        raise InvalidArgumentError(
            f"metadata was built for {metadata.num_blocks} blocks of {metadata.block_size} "
            f"tokens but kv_cache {tuple(kv_cache.shape)} has {num_blocks} of {block_size}"
        )
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"kv_cache has dtype {kv_cache.dtype}; paged attention supports "
            f"{[str(d) for d in SUPPORTED_DTYPES]}"
        )
    check_dtype("query", query, kv_cache.dtype, "kv_cache")
    check_device("query", query, kv_cache.device, "kv_cache")
    check_device("metadata.block_table", metadata.block_table, kv_cache.device, "kv_cache")

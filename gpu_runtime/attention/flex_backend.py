"""FlexAttention paged attention: the KV pool is one long sequence, a ``BlockMask``
lists each sequence's physical blocks, and ``mask_mod`` maps a physical position back
to its logical one.

Compiled (``torch.compile``) this is the CUDA fast path: the kernel visits only the
listed blocks and reads them in place (no gather). Eager it runs on any device but
materialises scores over the whole pool, so it is only for tests on small pools.

``mask_mod`` alone is exact at every position (the eager path ignores block
sparsity): position ``p`` of the pool is block ``p // block_size``, whose logical
index in sequence ``b`` is ``physical_to_logical[b, block]`` (-1 when absent; the
null block 0 is always absent), and it is visible to query ``q`` when its logical
position is at most the query's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gpu_runtime.attention.base import AttentionBackend
from gpu_runtime.attention.metadata import AttentionMetadata

# Query tile of the BlockMask; vLLM's FlexAttention backend uses the same.
Q_BLOCK_SIZE = 16

_compiled_flex: Callable[..., Any] | None = None


def _compiled() -> Callable[..., Any]:
    # One compiled function per process: recompiles are keyed on shapes, not calls.
    global _compiled_flex  # noqa: PLW0603
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, fullgraph=True)
    return _compiled_flex


class FlexAttentionBackend(AttentionBackend):
    """Paged attention with ``torch.nn.attention.flex_attention``."""

    name = "flex"

    def __init__(self, compile: bool = True) -> None:
        self.compile = compile

    @staticmethod
    def supports(num_q_heads: int, num_kv_heads: int, dtype: torch.dtype) -> bool:
        """Compiled flex decoding needs a power-of-two GQA group."""
        group = num_q_heads // num_kv_heads
        return dtype in (torch.float32, torch.bfloat16, torch.float16) and group & (group - 1) == 0

    def _forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        num_seqs, num_q_heads = metadata.num_seqs, query.shape[1]
        q_len = metadata.max_query_len
        device = query.device
        block_mask, dest = _step_plan(metadata, num_blocks, device)
        # Queries padded per sequence to [B, Hq, max_query_len, D]; decode needs no padding.
        if dest is None:
            q = query.view(num_seqs, 1, num_q_heads, head_size)
        else:
            q = query.new_zeros(num_seqs * q_len, num_q_heads, head_size)
            q.index_copy_(0, dest, query)
            q = q.view(num_seqs, q_len, num_q_heads, head_size)
        pool = num_blocks * block_size
        k = kv_cache[0].view(1, pool, num_kv_heads, head_size).transpose(1, 2)
        v = kv_cache[1].view(1, pool, num_kv_heads, head_size).transpose(1, 2)
        flex: Callable[..., Any] = flex_attention
        if self.compile:
            flex = _compiled()
        out: torch.Tensor = flex(
            q.transpose(1, 2), k, v, block_mask=block_mask, scale=scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(num_seqs * q_len, num_q_heads, head_size)
        return out if dest is None else out.index_select(0, dest)


def _step_plan(
    metadata: AttentionMetadata, num_blocks: int, device: torch.device
) -> tuple[BlockMask, torch.Tensor | None]:
    """The step's ``BlockMask`` and, for prefill, each query's row in the padded batch;
    built by the first layer and kept on the metadata for the others (the mask costs
    a dozen small kernels, per layer otherwise)."""
    key = ("flex", num_blocks, device)
    plan = metadata.plans.get(key)
    if plan is None:
        q_len = metadata.max_query_len
        dest = None
        if not metadata.is_decode:
            rows = [b * q_len + j for b, n in enumerate(metadata.query_lens) for j in range(n)]
            dest = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        plan = metadata.plans[key] = (build_block_mask(metadata, num_blocks, q_len), dest)
    block_mask, dest = plan
    assert isinstance(block_mask, BlockMask)
    return block_mask, dest


def build_block_mask(metadata: AttentionMetadata, num_blocks: int, q_len: int) -> BlockMask:
    """The paged ``BlockMask`` for a batch padded to ``q_len`` queries per sequence."""
    block_size = metadata.block_size
    table = metadata.block_table
    num_seqs, width = table.shape
    device = table.device
    seq_lens = metadata.seq_lens_tensor
    query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    first_query_pos = seq_lens - query_lens
    used = (seq_lens + block_size - 1) // block_size  # blocks per sequence
    logical = torch.arange(width, device=device).expand(num_seqs, width)
    valid = logical < used[:, None]
    physical_to_logical = torch.full((num_seqs, num_blocks), -1, dtype=torch.int64, device=device)
    # Padding entries all land on column 0, which is reset below: block 0 is the null
    # block and never holds a sequence's data (sliding-window holes point at it too).
    physical_to_logical.scatter_(1, torch.where(valid, table, 0), torch.where(valid, logical, -1))
    physical_to_logical[:, 0] = -1

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        logical_block = physical_to_logical[b, kv_idx // block_size]
        position = logical_block * block_size + kv_idx % block_size
        return (logical_block >= 0) & (position <= first_query_pos[b] + q_idx)

    num_q_tiles = -(q_len // -Q_BLOCK_SIZE)
    kv_num_blocks = used.to(torch.int32)[:, None, None].expand(num_seqs, 1, num_q_tiles)
    kv_indices = table.to(torch.int32)[:, None, None, :].expand(num_seqs, 1, num_q_tiles, width)
    return BlockMask.from_kv_blocks(
        kv_num_blocks.contiguous(),
        kv_indices.contiguous(),
        BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
        mask_mod=mask_mod,
        seq_lengths=(q_len, num_blocks * block_size),
        compute_q_blocks=False,
    )

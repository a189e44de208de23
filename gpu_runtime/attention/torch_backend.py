"""Plain PyTorch paged attention: gather the blocks, then ``scaled_dot_product_attention``.

Runs anywhere without compiling; the default on CPU and the fallback on CUDA.

Decode gathers the pages of a chunk of sequences into a reused workspace sized to
stay in cache (``workspace_bytes``), then runs one batched SDPA per chunk. The
workspace is reused because fresh multi-megabyte allocations cost page faults on
every call, and the chunking keeps the gathered copy in cache so DRAM sees the KV
bytes about once. Prefill loops over sequences (it is compute bound; the gather is
small next to the attention) and masks causally with the cached prefix in front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)

from gpu_runtime.attention.base import AttentionBackend
from gpu_runtime.attention.metadata import AttentionMetadata
from kvservice.core.kv_cache_interface import cdiv

# Gathered pages per decode chunk on CPU: fits a core's L2/L3 share on the CI VM.
CPU_WORKSPACE_BYTES = 4 << 20
# On CUDA the gather is not cache bound; one chunk for any realistic batch.
CUDA_WORKSPACE_BYTES = 1 << 30


class TorchAttentionBackend(AttentionBackend):
    """Gather-then-SDPA paged attention (no compile, any device)."""

    name = "torch"

    def __init__(self, workspace_bytes: int | None = None) -> None:
        self.workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.dtype != like.dtype or ws.device != like.device or ws.numel() < numel:
            ws = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace = ws
        return ws[:numel]

    def _forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if metadata.is_decode:
            return self._decode(query, kv_cache, metadata, scale)
        return self._prefill(query, kv_cache, metadata, scale)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        num_seqs, num_q_heads = metadata.num_seqs, query.shape[1]
        page = block_size * num_kv_heads * head_size
        pages = kv_cache.view(2, num_blocks, page)
        budget = self.workspace_bytes or (
            CUDA_WORKSPACE_BYTES if kv_cache.is_cuda else CPU_WORKSPACE_BYTES
        )
        page_pair_bytes = 2 * page * kv_cache.element_size()
        q = query.view(num_seqs, num_q_heads, 1, head_size)
        out = torch.empty_like(query)
        seq_lens = metadata.seq_lens
        start = 0
        while start < num_seqs:
            # Grow the chunk while its gathered pages fit the budget; at least one sequence.
            end, width = start + 1, cdiv(seq_lens[start], block_size)
            while end < num_seqs:
                wider = max(width, cdiv(seq_lens[end], block_size))
                if wider * (end + 1 - start) * page_pair_bytes > budget:
                    break
                end, width = end + 1, wider
            count = end - start
            ids = metadata.block_table[start:end, :width].reshape(-1)
            gathered = self._buffer(2 * ids.numel() * page, kv_cache).view(2, ids.numel(), page)
            torch.index_select(pages, 1, ids, out=gathered)
            longest = max(seq_lens[start:end])
            kv = gathered.view(2, count, width * block_size, num_kv_heads, head_size)
            k = kv[0, :, :longest].transpose(1, 2)  # [count, Hkv, longest, D]
            v = kv[1, :, :longest].transpose(1, 2)
            mask = None
            if min(seq_lens[start:end]) != longest:
                positions = torch.arange(longest, device=query.device)
                mask = positions < metadata.seq_lens_tensor[start:end, None]
                mask = mask[:, None, None, :]
            o = F.scaled_dot_product_attention(
                q[start:end], k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[start:end] = o.view(count, num_q_heads, head_size)
            start = end
        return out

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        pages = kv_cache.view(2, num_blocks, block_size * num_kv_heads * head_size)
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, s_len) in enumerate(
            zip(metadata.query_lens, metadata.seq_lens, strict=True)
        ):
            n = cdiv(s_len, block_size)
            kv = pages.index_select(1, metadata.block_table[i, :n])
            kv = kv.view(2, n * block_size, num_kv_heads, head_size)[:, :s_len]
            k = kv[0].transpose(0, 1)[None]  # [1, Hkv, s_len, D]
            v = kv[1].transpose(0, 1)[None]
            q = query[start : start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            mask = None
            if 1 < q_len < s_len:
                # Query j sits at position s_len - q_len + j, after the cached prefix.
                rows = torch.arange(s_len - q_len, s_len, device=query.device)
                mask = torch.arange(s_len, device=query.device)[None, :] <= rows[:, None]
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=q_len == s_len and q_len > 1,
                scale=scale,
                enable_gqa=True,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out

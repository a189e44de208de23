"""Direct references the runtime is tested against: per-token loops and dense
attention on gathered keys and values, computed in float64."""

from __future__ import annotations

import torch

from gpu_runtime.attention.metadata import AttentionMetadata


def ref_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """A copy of ``kv_cache`` with token ``i`` written at ``slots[i]`` (a Python loop)."""
    expected = kv_cache.clone()
    block_size = kv_cache.shape[2]
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        expected[0, slot // block_size, slot % block_size] = key[i]
        expected[1, slot // block_size, slot % block_size] = value[i]
    return expected


def gather_sequence(
    kv_cache: torch.Tensor, table: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[seq_len, Hkv, D]`` of one sequence, token by token."""
    block_size = kv_cache.shape[2]
    keys = [kv_cache[0, table[p // block_size], p % block_size] for p in range(seq_len)]
    values = [kv_cache[1, table[p // block_size], p % block_size] for p in range(seq_len)]
    return torch.stack(keys), torch.stack(values)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of ``q [q_len, Hq, D]`` at the end of ``k, v [s_len, Hkv, D]``,
    float64, GQA by repeating KV heads."""
    q_len, num_q_heads, _ = q.shape
    s_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double() * scale, k64)
    future = torch.ones(q_len, s_len, dtype=torch.bool).triu(s_len - q_len + 1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64)


def ref_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    tables: list[list[int]],
    scale: float,
) -> torch.Tensor:
    """Dense attention per sequence on its gathered keys and values (float64)."""
    outs = []
    start = 0
    for q_len, s_len, table in zip(metadata.query_lens, metadata.seq_lens, tables, strict=True):
        k, v = gather_sequence(kv_cache, table, s_len)
        outs.append(dense_attention(query[start : start + q_len], k, v, scale))
        start += q_len
    return torch.cat(outs)

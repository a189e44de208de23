"""Seeded random batches for the paged-attention tests: shapes, GQA ratios, shuffled
block tables, prefix lengths, and a cache full of stale (finite) data."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from gpu_runtime.attention import AttentionMetadata
from gpu_runtime.ops import reshape_and_cache
from kvservice.core.kv_cache_interface import cdiv


@dataclass
class Case:
    """One random batch: query, a layer's cache (new K/V written), metadata, tables."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    tables: list[list[int]]
    scale: float


def random_case(
    seed: int,
    dtype: torch.dtype,
    *,
    decode: bool,
    gqa_ratios: tuple[int, ...] = (1, 2, 4),
    device: torch.device | str = "cpu",
    max_seq_len: int = 70,
) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block_size = rng.choice([1, 4, 16])
    num_kv_heads = rng.choice([1, 2])
    num_q_heads = num_kv_heads * rng.choice(gqa_ratios)
    head_size = rng.choice([8, 16, 32])
    num_seqs = rng.randint(1, 5)
    seq_lens = [rng.randint(1, max_seq_len) for _ in range(num_seqs)]
    if decode:
        query_lens = [1] * num_seqs
    else:
        # Whole prompts, prompts after a cached prefix, and single tokens, mixed.
        query_lens = [rng.choice([s, rng.randint(1, s), 1]) for s in seq_lens]
    needed = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(needed) + rng.randint(1, 8)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    # Tables may carry extra blocks past the sequence (lookahead), as the core's can.
    tables = [[ids.pop() for _ in range(n)] for n in needed]
    if ids:
        tables[0].append(ids.pop())
    # Stale data everywhere (finite), as in blocks reused after eviction.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen) * 3
    kv_cache = kv_cache.to(device=device, dtype=dtype)
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, num_blocks, device)
    num_tokens = sum(query_lens)
    new_kv = torch.randn(2, num_tokens, num_kv_heads, head_size, generator=gen)
    new_kv = new_kv.to(device=device, dtype=dtype)
    reshape_and_cache(new_kv[0], new_kv[1], kv_cache, metadata.slot_mapping)
    query = torch.randn(num_tokens, num_q_heads, head_size, generator=gen).to(device, dtype)
    return Case(query, kv_cache, metadata, tables, head_size**-0.5)


# (atol, rtol) against the float64 reference, per dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-3, 1e-3),
    torch.bfloat16: (1.5e-2, 1e-2),
    torch.float16: (1.5e-2, 1e-2),
}

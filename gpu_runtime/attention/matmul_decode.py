"""Decode on the CPU as batched fp32 matmuls over the gathered pages.

Measured on the 2-core CI VM (one thread): ``scaled_dot_product_attention`` decode
on the gathered pages (keys of one token for all heads side by side) took 1.4-1.7x
its time on contiguous K/V, and even on contiguous K/V it took 1.0-1.9x the time of
the two matmuls below. Here the query heads of one KV head are the rows of one
matrix: ``scores = q @ K^T`` and ``out = softmax(scores) @ V`` are ``bmm`` calls that
read every key and value once, straight from the gather workspace through strided
views (no second copy). Half types compute in fp32 too: their chunk is gathered in
the cache's dtype (``index_select`` writes only its own dtype) and converted with one
``copy_`` into an fp32 buffer of the same layout, which the views here then read; bf16
scores out of ``bmm`` would miss the half types' tolerance.

A chunk's matmuls are batched one of two ways, whichever needs fewer calls:

* per sequence: one ``bmm`` over the KV heads of that sequence, its keys cut to its own
  length (no mask);
* per KV head: one ``bmm`` over the chunk's sequences, cut to the longest, with an
  additive ``-inf`` mask past each shorter sequence's end.

Every view (query, keys, values, output rows) is built once per step and cached with
the chunk: queries are first copied into a per-step buffer and outputs land in
another, so a layer's call is one copy, one ``index_select`` per chunk (plus the
conversion for half types) and two matmuls plus a ``softmax`` per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MatmulGroup:
    """One ``softmax(q @ key + bias) @ value -> out`` on views of the step's buffers."""

    query: torch.Tensor  # [batch, group, D]
    key: torch.Tensor  # [batch, D, len]: keys transposed, over the workspace
    value: torch.Tensor  # [batch, len, D]
    out: torch.Tensor  # [batch, group, D]
    bias: torch.Tensor | None  # [batch, 1, len] 0 / -inf, None when nothing is masked
    # [batch, group, len], reused by every call: no per-call allocation, which past
    # glibc's mmap threshold (128 KiB) costs page faults on every call.
    scores: torch.Tensor
    probs: torch.Tensor


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Where one chunk's gathered pages sit in the workspace: sequences
    ``[start, end)``, each ``span`` tokens of ``[num_kv_heads, head_size]``, keys at
    element ``offset`` and values ``value_offset`` further."""

    start: int
    end: int
    span: int
    offset: int
    value_offset: int


def build_groups(
    layout: ChunkLayout,
    seq_lens: tuple[int, ...],
    workspace: torch.Tensor,
    queries: torch.Tensor,
    outs: torch.Tensor,
) -> tuple[MatmulGroup, ...]:
    """The chunk's matmul groups; ``queries``/``outs`` are ``[B, Hkv, G, D]``."""
    num_kv_heads = queries.shape[1]
    if layout.end - layout.start <= num_kv_heads:
        return tuple(
            _sequence_group(layout, i, seq_lens[i], workspace, queries, outs)
            for i in range(layout.start, layout.end)
        )
    return tuple(
        _head_group(layout, h, seq_lens, workspace, queries, outs) for h in range(num_kv_heads)
    )


def _sequence_group(
    layout: ChunkLayout,
    index: int,
    length: int,
    workspace: torch.Tensor,
    queries: torch.Tensor,
    outs: torch.Tensor,
) -> MatmulGroup:
    _, num_kv_heads, _, head_size = queries.shape
    row = num_kv_heads * head_size  # one token's keys (or values), all heads
    base = layout.offset + (index - layout.start) * layout.span * row
    key = workspace.as_strided((num_kv_heads, head_size, length), (head_size, 1, row), base)
    value = workspace.as_strided(
        (num_kv_heads, length, head_size), (head_size, row, 1), base + layout.value_offset
    )
    query = queries[index]
    scores = query.new_empty(num_kv_heads, query.shape[1], length)
    return MatmulGroup(query, key, value, outs[index], None, scores, torch.empty_like(scores))


def _head_group(
    layout: ChunkLayout,
    head: int,
    seq_lens: tuple[int, ...],
    workspace: torch.Tensor,
    queries: torch.Tensor,
    outs: torch.Tensor,
) -> MatmulGroup:
    _, num_kv_heads, _, head_size = queries.shape
    row = num_kv_heads * head_size
    lens = seq_lens[layout.start : layout.end]
    count, longest = len(lens), max(lens)
    base = layout.offset + head * head_size
    seq_stride = layout.span * row
    key = workspace.as_strided((count, head_size, longest), (seq_stride, 1, row), base)
    value = workspace.as_strided(
        (count, longest, head_size), (seq_stride, row, 1), base + layout.value_offset
    )
    bias = None
    if min(lens) != longest:
        # Keys past a sequence's end hold the next blocks' (finite) data; -inf drops them.
        ends = torch.tensor(lens, device=workspace.device)[:, None, None]
        positions = torch.arange(longest, device=workspace.device)
        bias = torch.zeros(count, 1, longest, dtype=workspace.dtype, device=workspace.device)
        bias.masked_fill_(positions >= ends, float("-inf"))
    rows = slice(layout.start, layout.end)
    query = queries[rows, head]
    scores = query.new_empty(count, query.shape[1], longest)
    probs = torch.empty_like(scores)
    return MatmulGroup(query, key, value, outs[rows, head], bias, scores, probs)


def run_groups(groups: tuple[MatmulGroup, ...], scale: float) -> None:
    """Attention of every group, written into its ``out`` view."""
    for g in groups:
        # The scale rides on the matmul (alpha): no separate pass over q or the scores.
        if g.bias is None:
            scores = torch.baddbmm(g.scores, g.query, g.key, beta=0, alpha=scale, out=g.scores)
        else:
            scores = torch.baddbmm(g.bias, g.query, g.key, alpha=scale, out=g.scores)
        probs = torch.softmax(scores, dim=-1, out=g.probs)
        torch.bmm(probs, g.value, out=g.out)

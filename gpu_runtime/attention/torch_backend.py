"""Plain PyTorch paged attention: gather the blocks, then ``scaled_dot_product_attention``.

Runs anywhere without compiling; the default on CPU and the fallback on CUDA.

Decode gathers the pages of a chunk of sequences into a reused workspace sized to
stay in cache (``workspace_bytes``), then runs one batched SDPA per chunk. The
workspace is reused because fresh multi-megabyte allocations cost page faults on
every call, and the chunking keeps the gathered copy in cache so DRAM sees the KV
bytes about once. The chunk plan (block ids, masks, workspace views) depends only on
the step's batch, so the first layer builds it and caches it on the metadata; the
other layers' calls are one ``index_select`` and one SDPA with no host-side work
beyond a few identity checks. On the CPU, decode replaces the SDPA by batched matmuls
over the same workspace (``matmul_decode``: SDPA's CPU decode is ~1.4x slower on the
gathered layout than on contiguous K/V, which alone broke the 1.5x target); half types
gather in their own dtype and convert each chunk to an fp32 buffer first. Prefill
loops over sequences (it is compute bound; the gather is small next to the
attention) and masks causally with the cached prefix in front.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)

from gpu_runtime.attention.base import AttentionBackend
from gpu_runtime.attention.matmul_decode import ChunkLayout, MatmulGroup, build_groups, run_groups
from gpu_runtime.attention.metadata import AttentionMetadata
from kvservice.core.kv_cache_interface import cdiv

# Gathered pages per decode chunk on CPU: fits a core's L2/L3 share on the CI VM.
CPU_WORKSPACE_BYTES = 4 << 20
# The same for the matmul decode, whose matmuls re-read the chunk right after the
# gather: 1 MiB measured best on the 2-core VM (0.5 MiB L2 per core) against 0.25 and 4.
# It counts the fp32 chunk the matmuls read, also for half types (their gather is half).
CPU_MATMUL_WORKSPACE_BYTES = 1 << 20
# Cache dtypes the matmul decode takes; they compute in fp32.
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# On CUDA the gather is not cache bound; one chunk for any realistic batch.
CUDA_WORKSPACE_BYTES = 1 << 30


@dataclass(slots=True)
class _DecodeChunk:
    """Sequences ``[start, end)`` gathered together: ``ids`` is their block table cut
    to the ``span // block_size`` blocks the longest needs, flattened; ``mask`` hides
    each shorter sequence's positions past its end (None when all are ``longest``).
    ``views`` caches the gather target and the key/value views over the workspace."""

    start: int
    end: int
    span: int
    longest: int
    ids: torch.Tensor
    mask: torch.Tensor | None
    views: _Views | None = None


@dataclass(frozen=True, slots=True)
class _Views:
    workspace: torch.Tensor  # the views are valid while the backend keeps this one
    page_shape: tuple[int, ...]  # [block_size, Hkv, D]
    gathered: torch.Tensor  # [2, len(ids), block_size, Hkv, D]: index_select's out
    key: torch.Tensor  # [count, Hkv, longest, D] over the gathered keys
    value: torch.Tensor


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    chunks: tuple[_DecodeChunk, ...]
    max_pages: int  # the most pages one chunk gathers: sizes the workspace once


@dataclass(frozen=True, slots=True)
class _FastDecode:
    """One backend's decode setup for one step, valid while the workspace and the
    cache's shape, dtype and device match; ``chunk``/``views`` when there is one chunk."""

    workspace: torch.Tensor
    cache_shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    plan: _DecodePlan
    chunk: _DecodeChunk | None
    views: _Views  # of the first chunk


def _decode_plan(metadata: AttentionMetadata, budget: int, page_pair_bytes: int) -> _DecodePlan:
    """The step's decode chunks, computed by the first layer and reused by the rest."""
    key = ("torch-decode", budget, page_pair_bytes)
    plan = metadata.plans.get(key)
    if plan is None:
        plan = metadata.plans[key] = _build_decode_plan(metadata, budget, page_pair_bytes)
    assert isinstance(plan, _DecodePlan)
    return plan


def _build_decode_plan(
    metadata: AttentionMetadata, budget: int, page_pair_bytes: int
) -> _DecodePlan:
    seq_lens, block_size, num_seqs = metadata.seq_lens, metadata.block_size, metadata.num_seqs
    chunks = []
    start = 0
    while start < num_seqs:
        # Grow the chunk while its gathered pages fit the budget; at least one sequence.
        end, width = start + 1, cdiv(seq_lens[start], block_size)
        while end < num_seqs:
            wider = max(width, cdiv(seq_lens[end], block_size))
            if wider * (end + 1 - start) * page_pair_bytes > budget:
                break
            end, width = end + 1, wider
        ids = metadata.block_table[start:end, :width].reshape(-1).contiguous()
        longest = max(seq_lens[start:end])
        mask = None
        if min(seq_lens[start:end]) != longest:
            positions = torch.arange(longest, device=ids.device)
            mask = positions < metadata.seq_lens_tensor[start:end, None]
            mask = mask[:, None, None, :]
        chunks.append(_DecodeChunk(start, end, width * block_size, longest, ids, mask))
        start = end
    return _DecodePlan(tuple(chunks), max(chunk.ids.numel() for chunk in chunks))


def _chunk_views(
    chunk: _DecodeChunk, workspace: torch.Tensor, page_shape: tuple[int, ...]
) -> _Views:
    """Views of ``workspace`` for ``chunk`` (cached on it while the workspace stays)."""
    views = chunk.views
    if views is not None and views.workspace is workspace and views.page_shape == page_shape:
        return views
    block_size, num_kv_heads, head_size = page_shape
    pages, count, span = chunk.ids.numel(), chunk.end - chunk.start, chunk.span
    numel = pages * block_size * num_kv_heads * head_size
    size = (count, num_kv_heads, chunk.longest, head_size)
    # Pages as in the cache: keys then values, each [count, span, Hkv, D]. (A head-major
    # gather through a permuted out makes SDPA's keys contiguous, but the strided gather
    # costs about what SDPA saves, so the plain page copy stays.)
    gathered = workspace[: 2 * numel].view(2, pages, *page_shape)
    stride = (span * num_kv_heads * head_size, head_size, num_kv_heads * head_size, 1)
    views = _Views(
        workspace,
        page_shape,
        gathered,
        workspace.as_strided(size, stride, workspace.storage_offset()),
        workspace.as_strided(size, stride, workspace.storage_offset() + numel),
    )
    chunk.views = views
    return views


@dataclass(frozen=True, slots=True)
class _MatmulStep:
    """One chunk of ``matmul_decode``: its gather and its matmul groups."""

    ids: torch.Tensor
    gathered: torch.Tensor  # [2, len(ids), block_size, Hkv, D] over the workspace
    # The same over the fp32 compute buffer the groups read, for half types (the
    # gather's ``out`` must have the cache's dtype); None for fp32, which needs no copy.
    converted: torch.Tensor | None
    groups: tuple[MatmulGroup, ...]


@dataclass(frozen=True, slots=True)
class _MatmulDecode:
    """The matmul decode setup of one step (see ``matmul_decode``), valid under the same
    conditions as ``_FastDecode``; ``queries``/``outs`` are its ``[B, Hq, D]`` fp32
    buffers and ``compute`` is the fp32 buffer the matmuls read (``workspace`` for fp32)."""

    workspace: torch.Tensor
    compute: torch.Tensor
    cache_shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    queries: torch.Tensor
    outs: torch.Tensor
    steps: tuple[_MatmulStep, ...]


def _prepare_matmul_decode(
    plan: _DecodePlan,
    metadata: AttentionMetadata,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor,
    compute: torch.Tensor,
) -> _MatmulDecode:
    """``compute`` is the fp32 buffer the matmuls read: ``workspace`` itself for fp32,
    else one as large into which each gathered chunk is converted."""
    num_seqs, num_q_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    queries = compute.new_empty(query.shape)
    outs = torch.empty_like(queries)
    grouped = (num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_size)
    steps = []
    for chunk in plan.chunks:
        shape = (2, chunk.ids.numel(), *kv_cache.shape[2:])
        numel = chunk.ids.numel() * kv_cache.shape[2:].numel()
        gathered = workspace[: 2 * numel].view(shape)
        converted = None if compute is workspace else compute[: 2 * numel].view(shape)
        layout = ChunkLayout(
            chunk.start, chunk.end, chunk.span, int(compute.storage_offset()), numel
        )
        groups = build_groups(
            layout, metadata.seq_lens, compute, queries.view(grouped), outs.view(grouped)
        )
        steps.append(_MatmulStep(chunk.ids, gathered, converted, groups))
    return _MatmulDecode(
        workspace,
        compute,
        kv_cache.shape,
        kv_cache.dtype,
        kv_cache.device,
        queries,
        outs,
        tuple(steps),
    )


def _run_matmul_decode(
    fast: _MatmulDecode, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    fast.queries.copy_(query)
    for step in fast.steps:
        torch.index_select(kv_cache, 1, step.ids, out=step.gathered)
        if step.converted is not None:
            step.converted.copy_(step.gathered)
        run_groups(step.groups, scale)
    # A copy: the next layer's call overwrites the step's output buffer (half types'
    # conversion back to the query's dtype is that copy).
    outs = fast.outs
    return outs.clone() if outs.dtype == query.dtype else outs.to(query.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Gather-then-attend paged attention (no compile, any device): SDPA, or batched
    fp32 matmuls for decode on the CPU (``matmul_decode``)."""

    name = "torch"

    def __init__(
        self, workspace_bytes: int | None = None, matmul_decode: bool | None = None
    ) -> None:
        self.workspace_bytes = workspace_bytes
        # None: matmul decode on the CPU, SDPA otherwise; a bool forces it on or off on
        # any device.
        self.matmul_decode = matmul_decode
        self._workspace: torch.Tensor | None = None
        self._compute: torch.Tensor | None = None  # half types' fp32 matmul input

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The reused workspace, grown (reallocated) when ``numel`` does not fit."""
        ws = self._workspace
        if ws is None or ws.dtype != like.dtype or ws.device != like.device or ws.numel() < numel:
            ws = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace = ws
        return ws

    def _compute_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The matmul decode's fp32 input: the workspace for fp32, else its own buffer
        (grown like the workspace), which a half-type gather is converted into."""
        if like.dtype == torch.float32:
            return self._buffer(numel, like)
        buf = self._compute
        if buf is None or buf.device != like.device or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32, device=like.device)
            self._compute = buf
        return buf

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
        # Per-layer host work is a cached lookup: the chunk plan and its workspace views
        # are built by the step's first layer (kept on the metadata, keyed by this
        # backend) and reused while the cache's shape, dtype and device stay the same.
        fast = metadata.plans.get(self)
        if fast is None or not self._still_valid(fast, query, kv_cache):
            fast = self._prepare_decode(query, kv_cache, metadata)
        if isinstance(fast, _MatmulDecode):
            return _run_matmul_decode(fast, query, kv_cache, scale)
        chunk, views = fast.chunk, fast.views
        if chunk is None:
            return self._decode_chunks(query, kv_cache, fast.plan, scale)
        torch.index_select(kv_cache, 1, chunk.ids, out=views.gathered)
        o = F.scaled_dot_product_attention(
            query.unsqueeze(2),
            views.key,
            views.value,
            attn_mask=chunk.mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    def _uses_matmul(self, kv_cache: torch.Tensor) -> bool:
        # Half types compute in fp32 (their chunk converted after the gather): bf16
        # matmuls were rejected, as bf16 scores out of ``bmm`` missed the 1.5e-2
        # tolerance in 25 of 60 random bf16/fp16 cases, but fp32 compute on half inputs
        # is more accurate than SDPA's half-type decode.
        if kv_cache.dtype not in MATMUL_DTYPES:
            return False
        if self.matmul_decode is not None:
            return self.matmul_decode
        return kv_cache.device.type == "cpu"

    def _still_valid(
        self, fast: _FastDecode | _MatmulDecode, query: torch.Tensor, kv_cache: torch.Tensor
    ) -> bool:
        """Whether a cached setup still fits this call (another layer may differ)."""
        if isinstance(fast, _MatmulDecode) and (
            fast.queries.shape != query.shape
            or (fast.compute is not fast.workspace and fast.compute is not self._compute)
        ):
            return False
        return (
            fast.workspace is self._workspace
            and fast.cache_shape == kv_cache.shape
            and fast.dtype == kv_cache.dtype
            and fast.device == kv_cache.device
        )

    def _prepare_decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> _FastDecode | _MatmulDecode:
        page_shape = kv_cache.shape[2:]
        matmul = self._uses_matmul(kv_cache)
        budget = self.workspace_bytes or (
            CUDA_WORKSPACE_BYTES
            if kv_cache.is_cuda
            else CPU_MATMUL_WORKSPACE_BYTES
            if matmul
            else CPU_WORKSPACE_BYTES
        )
        # The matmul chunk is sized by the fp32 copy its matmuls read.
        element_size = 4 if matmul else kv_cache.element_size()
        plan = _decode_plan(metadata, budget, 2 * page_shape.numel() * element_size)
        numel = 2 * plan.max_pages * page_shape.numel()
        workspace = self._buffer(numel, kv_cache)
        if matmul:
            compute = self._compute_buffer(numel, kv_cache)
            setup = _prepare_matmul_decode(plan, metadata, query, kv_cache, workspace, compute)
            metadata.plans[self] = setup
            return setup
        single = len(plan.chunks) == 1
        fast = _FastDecode(
            workspace,
            kv_cache.shape,
            kv_cache.dtype,
            kv_cache.device,
            plan,
            plan.chunks[0] if single else None,
            _chunk_views(plan.chunks[0], workspace, page_shape),
        )
        metadata.plans[self] = fast
        return fast

    def _decode_chunks(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _DecodePlan,
        scale: float,
    ) -> torch.Tensor:
        """Several chunks: each gathers its sequences' pages into the workspace in turn."""
        page_shape = kv_cache.shape[2:]
        workspace = self._buffer(2 * plan.max_pages * page_shape.numel(), kv_cache)
        q = query.unsqueeze(2)
        out = torch.empty_like(query)
        for chunk in plan.chunks:
            views = _chunk_views(chunk, workspace, page_shape)
            torch.index_select(kv_cache, 1, chunk.ids, out=views.gathered)
            o = F.scaled_dot_product_attention(
                q[chunk.start : chunk.end],
                views.key,
                views.value,
                attn_mask=chunk.mask,
                scale=scale,
                enable_gqa=True,
            )
            out[chunk.start : chunk.end] = o.squeeze(2)
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

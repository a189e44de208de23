"""Shared builders for the core tests: configs, managers and the scheduler's moves."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
)
from kvservice.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvservice.core.request import Request, RequestStatus


def full_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def make_config(num_blocks: int, *specs: KVCacheSpec, zeroing: bool = False) -> KVCacheConfig:
    specs = specs or (full_spec(),)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
        needs_kv_cache_zeroing=zeroing,
    )


def make_manager(
    num_blocks: int = 11, *specs: KVCacheSpec, max_model_len: int = 8192, **kwargs: object
) -> KVCacheManager:
    return KVCacheManager(make_config(num_blocks, *specs), max_model_len, **kwargs)  # type: ignore[arg-type]


def ids(blocks: KVCacheBlocks | None) -> tuple[list[int], ...] | None:
    return None if blocks is None else blocks.get_block_ids()


def prefill(
    manager: KVCacheManager, request: Request, **kwargs: object
) -> tuple[KVCacheBlocks, int, KVCacheBlocks | None]:
    """get_computed_blocks then allocate_slots for the rest of the prompt, as the
    scheduler admits a waiting request; marks it running on success."""
    hit, num_hit, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(
        request,
        request.num_tokens - num_hit - request.num_computed_tokens,
        num_hit,
        hit,
        **kwargs,  # type: ignore[arg-type]
    )
    if new is not None:
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
    check_invariants(manager)
    return hit, num_hit, new


def decode(manager: KVCacheManager, request: Request, token: int) -> KVCacheBlocks | None:
    """Append one sampled token and allocate its slot."""
    request.append_output_token_ids(token)
    new = manager.allocate_slots(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
    check_invariants(manager)
    return new


def finish(manager: KVCacheManager, request: Request) -> None:
    request.status = RequestStatus.FINISHED
    manager.free(request)
    check_invariants(manager)


def free_queue_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def hashed_ids(manager: KVCacheManager) -> set[int]:
    return {b.block_id for b in manager.block_pool.blocks if b.block_hash is not None}


def tokens(*runs: tuple[int, int]) -> list[int]:
    """tokens((0, 16), (1, 16)) -> sixteen 0s then sixteen 1s."""
    out: list[int] = []
    for value, count in runs:
        out += [value] * count
    return out


def block_ids_of(blocks: Sequence[KVCacheBlocks]) -> list[tuple[list[int], ...]]:
    return [b.get_block_ids() for b in blocks]

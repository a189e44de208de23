"""KV cache events, with vLLM 0.33's fields, collected by the pool for ``take_events``.

Block hashes leave the process in external form: the raw hash bytes without the
4-byte group id suffix (see ``kv_cache_block.get_block_hash``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

MEDIUM_GPU: Final = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that entered the prefix cache in one ``cache_full_blocks`` call."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # The tokens after each block its hash also covers (lookahead block hashes); None
    # without them.
    lookahead_token_ids: list[list[int]] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks whose cache entry was evicted (the block was reused or invalidated)."""

    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

"""What vLLM's scheduler and engine read of a manager besides its methods.

vLLM 0.33 reaches past ``KVCacheManager``'s methods in a few places: the engine and
the scheduler read ``coordinator.single_type_managers[i].block_size`` and
``.kv_cache_spec`` (vLLM's spec objects) at construction, the scheduler reads
``coordinator.enable_partial_hash_hits``, and it returns copy-on-write retained blocks
with ``block_pool.free_blocks``. These views answer those reads from kvservice's state,
with vLLM's spec objects where vLLM type-checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvservice.core.kv_cache_block import KVCacheBlock


@dataclass(frozen=True, slots=True)
class SingleTypeManagerView:
    """One KV cache group as the scheduler reads it: its block size in scheduler
    tokens (DCP-scaled for full attention, as vLLM's manager reports it) and vLLM's
    own spec."""

    kv_cache_group_id: int
    block_size: int
    kv_cache_spec: Any


class CoordinatorView:
    """``KVCacheManager.coordinator`` as vLLM's scheduler and engine read it."""

    def __init__(
        self,
        managers: list[SingleTypeManagerView],
        enable_partial_hash_hits: bool,
        eagle_group_ids: frozenset[int],
        block_pool: BlockPoolView,
    ) -> None:
        self.single_type_managers = managers
        self.enable_partial_hash_hits = enable_partial_hash_hits
        self.eagle_group_ids = eagle_group_ids
        self.num_reprefillable_tokens = 0
        self.block_pool = block_pool


class BlockPoolView:
    """``KVCacheManager.block_pool`` as vLLM's scheduler uses it: the free count, usage,
    and ``free_blocks`` for the blocks ``take_kv_cache_block_copies`` retained."""

    def __init__(
        self,
        free_retained: Callable[[list[KVCacheBlock]], None],
        num_free_blocks: Callable[[], int],
        usage: Callable[[], float],
    ) -> None:
        self._free_retained = free_retained
        self.get_num_free_blocks = num_free_blocks
        self.get_usage = usage

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Return retained copy endpoints to the pool, in the order given (vLLM's
        scheduler passes source before destination)."""
        self._free_retained(list(ordered_blocks))

"""What vLLM's scheduler and engine read of a manager besides its methods.

vLLM 0.33 reaches past ``KVCacheManager``'s methods in a few places: the engine and
the scheduler read ``coordinator.single_type_managers[i].block_size`` and
``.kv_cache_spec`` (vLLM's spec objects) at construction, the scheduler reads
``coordinator.enable_partial_hash_hits``, asks ``coordinator.get_num_blocks_to_allocate``
for the blocks in-flight prefills still need (with a KV connector), and returns
copy-on-write retained blocks and deferred frees with ``block_pool.free_blocks``.
These views answer those reads from kvservice's state, with vLLM's spec objects where
vLLM type-checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvservice.core.kv_cache_block import KVCacheBlock
from kvservice.core.kv_cache_coordinator import KVCacheCoordinator


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
        core: KVCacheCoordinator,
        block_pool: BlockPoolView,
    ) -> None:
        self.single_type_managers = managers
        self._core = core
        self.enable_partial_hash_hits: bool = getattr(core, "enable_partial_hash_hits", False)
        self.eagle_group_ids = core.eagle_group_ids
        self.num_reprefillable_tokens = 0
        self.block_pool = block_pool

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """The blocks a request still needs: vLLM's scheduler reserves them for the
        prefills in flight when it admits an asynchronous KV load. ``prefill_end`` only
        places sparse Mamba checkpoints, and connectors are refused on Mamba "align"
        models (``connectors``)."""
        return self._core.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens,
            apply_admission_cap,
            num_local_computed_tokens=num_local_computed_tokens,
            num_tokens_main_model=num_tokens_main_model,
        )


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

"""vLLM's ``KVCacheManager`` answered by kvservice's core in the scheduler's process.

vLLM's scheduler hands the manager its own ``Request`` objects. Each one gets a core
``Request`` that shares its token list and its block hashes (vLLM computes them with
the engine's hash function as tokens arrive), so nothing is copied or hashed twice;
status and ``num_computed_tokens``, which the scheduler sets on its side, are copied
over before each call that reads them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.request import RequestStatus as VllmRequestStatus

from kvservice.core.kv_cache_block import KVCacheBlock
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus
from kvservice.integrations.vllm.cache_config import core_cache_config
from kvservice.integrations.vllm.events import to_vllm_events
from kvservice.integrations.vllm.manager import KVServiceKVCacheManager
from kvservice.integrations.vllm.views import (
    BlockPoolView,
    CoordinatorView,
    SingleTypeManagerView,
)


def _core_status(status: VllmRequestStatus) -> RequestStatus:
    if VllmRequestStatus.is_finished(status):
        return RequestStatus.FINISHED
    if status == VllmRequestStatus.RUNNING:
        return RequestStatus.RUNNING
    if status == VllmRequestStatus.PREEMPTED:
        return RequestStatus.PREEMPTED
    return RequestStatus.WAITING  # every waiting flavour: the watermark applies


_STATUS = {status: _core_status(status) for status in VllmRequestStatus}


class InProcessKVCacheManager(KVServiceKVCacheManager):
    """``KVServiceKVCacheManager`` over a ``kvservice.core.KVCacheManager`` in this
    process (``KVSERVICE_TARGET`` unset)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        args = self.args
        self.core = KVCacheManager(
            core_cache_config(args.kv_cache_config),
            max_model_len=args.max_model_len,
            scheduler_block_size=args.scheduler_block_size,
            hash_block_size=args.hash_block_size,
            enable_caching=args.enable_caching,
            # vLLM's scheduler records prefix-cache stats itself, at admission.
            log_stats=False,
            enable_kv_cache_events=args.enable_kv_cache_events,
            watermark=args.watermark,
            max_in_flight_tokens=args.max_in_flight_tokens,
            use_eagle=args.use_eagle,
            dcp_world_size=args.dcp_world_size,
            pcp_world_size=args.pcp_world_size,
        )
        self.block_pool = BlockPoolView(
            self._free_retained_blocks,
            self.core.block_pool.get_num_free_blocks,
            self.core.block_pool.get_usage,
        )
        core_coordinator = self.core.coordinator
        self.coordinator = CoordinatorView(
            [
                SingleTypeManagerView(i, manager.block_size, group.kv_cache_spec)
                for i, (manager, group) in enumerate(
                    zip(
                        core_coordinator.single_type_managers,
                        args.kv_cache_config.kv_cache_groups,
                        strict=True,
                    )
                )
            ],
            enable_partial_hash_hits=getattr(core_coordinator, "enable_partial_hash_hits", False),
            eagle_group_ids=core_coordinator.eagle_group_ids,
            block_pool=self.block_pool,
        )
        # vLLM request id -> the core's view of that request.
        self._requests: dict[str, Request] = {}

    # -- requests ------------------------------------------------------------------

    def _sync(self, request: Any) -> Request:
        """The core request for vLLM's ``request``, with the scheduler's latest status
        and computed-token count."""
        mirror = self._requests.get(request.request_id)
        if mirror is None:
            mirror = Request(
                request.request_id,
                request._all_token_ids,
                cache_salt=request.cache_salt,
                lora_name=request.lora_request.lora_name if request.lora_request else None,
                skip_reading_prefix_cache=request.skip_reading_prefix_cache,
            )
            # Shared, not copied: vLLM appends to both as the request grows.
            mirror.all_token_ids = request._all_token_ids
            mirror.block_hashes = request.block_hashes
            self._requests[request.request_id] = mirror
        mirror.status = _STATUS[request.status]
        mirror.num_computed_tokens = request.num_computed_tokens
        mirror.num_preemptions = request.num_preemptions
        if self.args.enable_kv_cache_events:
            self._pad_extra_keys(mirror)
        return mirror

    @staticmethod
    def _pad_extra_keys(mirror: Request) -> None:
        # The core reads one extra-key entry per block hash when it emits BlockStored;
        # vLLM's hashes come without them, and the events carry them as unknown.
        missing = len(mirror.block_hashes) - len(mirror.block_extra_keys)
        if missing > 0:
            mirror.block_extra_keys.extend([None] * missing)

    def _blocks(self, blocks: tuple[Any, ...]) -> Any:
        return VllmKVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- the scheduler's calls -------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.core.usage

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        blocks, num_tokens, boundary = self.core.get_computed_blocks(
            self._sync(request), max_cache_hit_length
        )
        return self._blocks(blocks.blocks), num_tokens, boundary

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any | None:
        self.refuse_connector_only(
            "allocate_slots(skip_zeroing_group_ids=...)", skip_zeroing_group_ids
        )
        hits = (
            self.core.create_kv_cache_blocks(new_computed_blocks.blocks)
            if new_computed_blocks is not None
            else None
        )
        new_blocks = self.core.allocate_slots(
            self._sync(request),
            num_new_tokens,
            num_new_computed_tokens,
            hits,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        )
        if new_blocks is None:
            return None
        return self._blocks(new_blocks.blocks)

    def free(self, request: Any) -> None:
        mirror = self._sync(request)
        self.core.free(mirror)
        if mirror.is_finished:
            del self._requests[request.request_id]

    def get_blocks(self, request_id: str) -> Any:
        if request_id not in self._requests:
            return self.empty_kv_cache_blocks
        return self._blocks(self.core.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()  # type: ignore[no-any-return]

    def estimate_cached_tokens(self, request: Any) -> int:
        if request.request_id not in self._requests:
            return 0
        groups = self.core.coordinator.get_blocks(request.request_id)
        return self.cached_tokens_of(
            [[block.block_hash_num_tokens for block in group] for group in groups]
        )

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if self.args.enable_caching:
            self.core.coordinator.cache_blocks(self._sync(request), num_computed_tokens)

    def take_events(self) -> list[Any]:
        return to_vllm_events(self.core.take_events())

    def take_new_block_ids(self) -> list[int]:
        return self.core.take_new_block_ids()

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        taken = self.core.take_kv_cache_block_copies()
        copies = [KVCacheBlockCopy(copy.src_block_id, copy.dst_block_id) for copy in taken.copies]
        return copies, taken.retained_blocks

    def _free_retained_blocks(self, blocks: list[KVCacheBlock]) -> None:
        # The core frees retained blocks last first; vLLM's scheduler decides the order.
        self.core.free_retained_blocks(blocks[::-1])

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.core.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.core.reset_prefix_cache():
            return False
        self.note_prefix_cache_reset()
        return True

    @property
    def retained_holds(self) -> Counter[int]:
        return self.core.retained_holds

"""kvservice's KV cache events as vLLM's ``vllm.distributed.kv_events`` structs, for
the scheduler's own publisher."""

from __future__ import annotations

from typing import Any

from vllm.distributed import kv_events as vllm_events
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvservice.core import kv_events


def _to_vllm(event: kv_events.KVCacheEvent) -> Any:
    if isinstance(event, kv_events.BlockStored):
        parent = event.parent_block_hash
        # vLLM 0.33's field; 0.32 hashes no lookahead tokens and has none.
        lookahead = (
            {"lookahead_token_ids": event.lookahead_token_ids}
            if event.lookahead_token_ids is not None
            else {}
        )
        return vllm_events.BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            **lookahead,
        )
    if isinstance(event, kv_events.BlockRemoved):
        return vllm_events.BlockRemoved(
            block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
            medium=event.medium,
            group_idx=event.group_idx,
        )
    return vllm_events.AllBlocksCleared()


def to_vllm_events(events: list[kv_events.KVCacheEvent]) -> list[Any]:
    return [_to_vllm(event) for event in events]

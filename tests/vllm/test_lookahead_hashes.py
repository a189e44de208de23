"""vLLM 0.33's lookahead block hashes (an EAGLE drafter's default: each hash also covers
the token after its block), against vLLM itself.

kvservice's ``BlockHasher`` must give vLLM's hashes byte for byte (the server hashes
remote requests itself), as tokens arrive, with LoRA, salts, multimodal items and
prompt embeddings; and kvservice's manager must publish vLLM's KV events (the
lookahead tokens, and extra keys over the window the hash covers).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvservice.core.block_hashing import BlockHasher, MultiModalFeature
from kvservice.core.request import Request as CoreRequest
from kvservice.integrations.vllm import KVServiceKVCacheManager

BS = 16
PROMPT = [(7 * i + 3) % 50 for i in range(70)]
# (LoRA, salt, multimodal items (identifier, offset, length), prompt embeddings)
EXTRAS: dict[str, tuple[Any, str | None, tuple[tuple[str, int, int], ...], bool]] = {
    "plain": (None, None, (), False),
    "lora": (("adapter", 3, "/adapters/a"), None, (), False),
    "salt": (None, "tenant-a", (), False),
    # An item ending on a block boundary, one crossing one, one right after it.
    "mm": (None, None, (("img-a", 4, 12), ("img-b", 20, 14), ("img-c", 34, 4)), False),
    "embeds": (None, "s", (), True),
}


def _embeddings(prompt: list[int]) -> torch.Tensor:
    return torch.tensor([[float(t), float(t % 5) / 4.0] for t in prompt], dtype=torch.float32)


def _vllm_request(
    request_id: str, prompt: list[int], extras: str, lookahead: int, hash_fn: Any
) -> Request:
    lora, salt, mm, embeds = EXTRAS[extras]
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for identifier, offset, length in mm
    ]
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=8),
        None,
        lora_request=LoRARequest(*lora) if lora else None,
        cache_salt=salt,
        mm_features=features or None,
        prompt_embeds=_embeddings(prompt) if embeds else None,
        block_hasher=get_request_block_hasher(BS, hash_fn, lookahead),
    )


def _core_request(prompt: list[int], extras: str, hasher: BlockHasher) -> CoreRequest:
    lora, salt, mm, embeds = EXTRAS[extras]
    return CoreRequest(
        "r",
        list(prompt),
        hasher,
        cache_salt=salt,
        lora_name=lora[0] if lora else None,
        lora_path=lora[2] if lora else None,
        lora_int_id=lora[1] if lora else None,
        mm_features=[MultiModalFeature(*item) for item in mm],
        prompt_embeds=_embeddings(prompt).numpy().tobytes() if embeds else None,
    )


@pytest.mark.parametrize("extras", sorted(EXTRAS))
@pytest.mark.parametrize("lookahead", [1, 2])
def test_the_block_hasher_hashes_as_vllm_with_lookahead(extras: str, lookahead: int) -> None:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    prompt = PROMPT[:40]
    theirs = _vllm_request("r", prompt, extras, lookahead, hash_fn)
    ours = _core_request(prompt, extras, BlockHasher(BS, "sha256", None, lookahead))
    assert ours.block_hashes == theirs.block_hashes
    for token in PROMPT[40:]:
        theirs.append_output_token_ids(token)
        ours.append_output_token_ids(token)
        assert ours.block_hashes == theirs.block_hashes
    assert len(ours.block_hashes) == (len(PROMPT) - lookahead) // BS
    # Without lookahead the hashes differ: the test can tell the two apart.
    plain = _core_request(prompt, extras, BlockHasher(BS, "sha256"))
    assert plain.block_hashes[0] != ours.block_hashes[0]


def _managers(lookahead: int) -> tuple[Any, Any]:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=40, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    common: dict[str, Any] = {
        "kv_cache_config": config,
        "max_model_len": 256,
        "scheduler_block_size": BS,
        "hash_block_size": BS,
        "enable_caching": True,
        "enable_kv_cache_events": True,
        "num_hash_lookahead_tokens": lookahead,
    }
    return VllmManager(**common), KVServiceKVCacheManager(**common)


def _run(manager: Any, lookahead: int) -> list[Any]:
    """Admit each request (a hit where an earlier one cached it), decode a few tokens
    caching as vLLM's async scheduler does, free; every event."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    events: list[Any] = []
    for i, extras in enumerate(sorted(EXTRAS) * 2):
        request = _vllm_request(f"{extras}-{i}", PROMPT[:50], extras, lookahead, hash_fn)
        manager.new_step_starts()
        hit, num_hit, _ = manager.get_computed_blocks(request)
        assert manager.allocate_slots(
            request, request.num_tokens - num_hit, num_hit, hit if num_hit else None
        )
        request.num_computed_tokens = request.num_tokens
        for token in PROMPT[50:62]:
            request.append_output_token_ids(token)
            assert manager.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
            manager.cache_blocks(request, request.num_computed_tokens)
        events.extend(manager.take_events())
        request.status = request.status.FINISHED_STOPPED
        manager.free(request)
        events.extend(manager.take_events())
    return events


@pytest.mark.parametrize("lookahead", [1, 2])
def test_kv_events_with_lookahead_are_vllms(lookahead: int) -> None:
    vllm_manager, ours = _managers(lookahead)
    expected, actual = _run(vllm_manager, lookahead), _run(ours, lookahead)
    assert actual == expected
    stored = [e for e in expected if type(e).__name__ == "BlockStored"]
    assert stored and all(e.lookahead_token_ids for e in stored)
    assert any(e.extra_keys and any(k is not None for k in e.extra_keys) for e in stored)

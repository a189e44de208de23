"""The three KV cache writes: new tokens into slots, zeroed blocks, copied blocks.

Each op validates its inputs first (shapes, dtypes, devices, index ranges) and only
then writes, so a refused call changes nothing. ``validate=False`` skips the checks
for callers that validated the step's metadata once (the per-layer hot path).
"""

from __future__ import annotations

import torch

from gpu_runtime.validation import (
    check_device,
    check_dim,
    check_dtype,
    check_index_tensor,
    check_range,
    check_same_shape,
    check_unique,
)
from kvservice.core.errors import InvalidArgumentError


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Write token ``i``'s key and value into slot ``slot_mapping[i]`` of one layer.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``. Only the first
            ``len(slot_mapping)`` tokens are written (the rest may be batch padding).
        kv_cache: one layer's ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
        slot_mapping: ``[n]`` int, ``n <= num_tokens``; slot = block_id * block_size +
            offset; -1 skips the token (padding), as in vLLM.
    """
    if validate:
        _check_slot_write(key, value, kv_cache, slot_mapping)
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    key, value = key[:n], value[:n]
    if n and int(slots.min()) < 0:
        # Padding tokens write nothing: not even to the null block, whose pages the
        # gather path multiplies by zero probabilities (0 * NaN would poison outputs).
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    # The token axis is a view here (blocks and offsets are adjacent in the layout), so
    # each write is a single index_copy_ over all tokens.
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)


def _check_slot_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_dim("kv_cache", kv_cache, 5, "[2, num_blocks, block_size, num_kv_heads, head_size]")
    if kv_cache.shape[0] != 2:
        raise InvalidArgumentError(
            f"kv_cache must hold keys and values in dim 0 (size 2), got shape "
            f"{tuple(kv_cache.shape)}"
        )
    check_dim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    check_same_shape("key", key, "value", value)
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    if tuple(key.shape[1:]) != (num_kv_heads, head_size):
        raise InvalidArgumentError(
            f"key has shape {tuple(key.shape)} but kv_cache {tuple(kv_cache.shape)} holds "
            f"{num_kv_heads} KV heads of size {head_size}"
        )
    check_dtype("key", key, kv_cache.dtype, "kv_cache")
    check_dtype("value", value, kv_cache.dtype, "kv_cache")
    check_device("key", key, kv_cache.device, "kv_cache")
    check_device("slot_mapping", slot_mapping, kv_cache.device, "kv_cache")
    check_dim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_index_tensor("slot_mapping", slot_mapping)
    if slot_mapping.shape[0] > key.shape[0]:
        raise InvalidArgumentError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has only "
            f"{key.shape[0]} tokens (shape {tuple(key.shape)})"
        )
    check_range("slot_mapping", slot_mapping, num_blocks * block_size, allow_padding=True)
    check_unique("slot_mapping", slot_mapping, ignore=-1)


def zero_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, block_dim: int, *, validate: bool = True
) -> None:
    """Zero blocks ``block_ids`` along ``block_dim`` of ``cache``: one ``index_fill_``
    covers every layer, keys and values, when the blocks are not the outermost dim."""
    if validate:
        _check_block_ids("block_ids", block_ids, cache, block_dim)
    cache.index_fill_(block_dim, block_ids.long(), 0)


def copy_blocks(
    cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    block_dim: int,
    *,
    validate: bool = True,
) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` along ``block_dim``, all pairs at once.

    Every source is read before any destination is written: the right-hand side is
    gathered into a temporary first, so chains like ``(1->2, 2->4)`` copy the original
    block 2 into 4.
    """
    if validate:
        _check_block_ids("src", src, cache, block_dim)
        _check_block_ids("dst", dst, cache, block_dim)
        check_same_shape("src", src, "dst", dst)
        check_unique("dst", dst)
    if src.numel() == 0:
        return
    index: list[slice | torch.Tensor] = [slice(None)] * block_dim
    gathered = cache[(*index, src.long())]  # advanced indexing copies: the snapshot
    cache[(*index, dst.long())] = gathered


def _check_block_ids(
    name: str, block_ids: torch.Tensor, cache: torch.Tensor, block_dim: int
) -> None:
    check_dim(name, block_ids, 1, "[num_ids]")
    check_index_tensor(name, block_ids)
    check_device(name, block_ids, cache.device, "the KV cache")
    check_range(name, block_ids, cache.shape[block_dim])

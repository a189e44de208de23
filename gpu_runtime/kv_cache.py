"""The KV tensors of every KV cache group, sized from the core's ``KVCacheConfig``.

Layout
------
One zero-initialised byte buffer ``[num_layers, 2, num_blocks, page_size / 2]`` backs
every group, where ``num_layers`` is the most layers any group has and
``page_size`` is the config's (shared) page size. Group ``g`` views the first
``len(layer_names)`` layers in its own dtype as::

    [num_layers_g, 2, num_blocks, block_size, num_kv_heads, head_size]

so one layer is ``kv[l]`` = ``[2, N, bs, Hkv, D]`` with keys at ``[0]`` and values
at ``[1]`` (vLLM-flash / FlashInfer "NHD" per K and V). Why this layout:

* The block is the third axis of the whole buffer, so zeroing a list of blocks across
  all layers, keys and values, is one ``index_fill_`` and applying all copies is one
  gather plus one scatter (``ops.zero_blocks`` / ``ops.copy_blocks``).
* Within K (or V) of one layer, blocks and offsets are adjacent: the token axis
  ``[N * bs, Hkv, D]`` is a view, so a slot write is one ``index_copy_`` and
  FlexAttention can read the pool as ``[1, Hkv, N * bs, D]`` without a copy.
* Sharing one buffer between groups is the core's sizing (``kv_cache_sizing``: tensor
  ``i`` serves layer ``i`` of every group). A block id belongs to one group at a time,
  so groups never touch each other's bytes, and block ids from the core (zero lists,
  copies) apply to the buffer as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_runtime.ops import copy_blocks, zero_blocks
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import AttentionSpec, KVCacheConfig

# The block axis of the shared buffer and of every group view.
BLOCK_DIM = 2


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype the core names as a string (``"bfloat16"`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"{name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True, slots=True)
class LayerLocation:
    """Where one named layer lives: its group and its index in the group's view."""

    group: int
    layer: int


class PagedKVCache:
    """The KV tensors of one ``KVCacheConfig``: a shared buffer and a view per group.

    Every group's spec must be an ``AttentionSpec`` and all groups must share one page
    size (the config enforces the latter). Memory is ``num_layers * num_blocks *
    page_size`` bytes, as the core sized it.
    """

    def __init__(self, config: KVCacheConfig, device: torch.device | str = "cpu") -> None:
        if not config.kv_cache_groups:
            raise InvalidArgumentError("the KV cache config has no KV cache groups")
        specs: list[AttentionSpec] = []
        for i, group in enumerate(config.kv_cache_groups):
            if not isinstance(group.kv_cache_spec, AttentionSpec):
                raise InvalidArgumentError(
                    f"KV cache group {i} has spec {type(group.kv_cache_spec).__name__}; the "
                    f"runtime stores attention KV only"
                )
            specs.append(group.kv_cache_spec)
        page_size = config.page_size_bytes
        self.config = config
        self.device = torch.device(device)
        self.num_blocks = config.num_blocks
        self.num_layers = max(len(g.layer_names) for g in config.kv_cache_groups)
        # Zeros, not empty: the gather path multiplies masked (zero-probability) slots,
        # and 0 * NaN from uninitialised memory would poison the output.
        self.buffer = torch.zeros(
            (self.num_layers, 2, self.num_blocks, page_size // 2),
            dtype=torch.uint8,
            device=self.device,
        )
        self.specs = specs
        self.groups: list[torch.Tensor] = []
        self.locations: dict[str, LayerLocation] = {}
        for g, (group, spec) in enumerate(zip(config.kv_cache_groups, specs, strict=True)):
            num_layers = len(group.layer_names)
            view = (
                self.buffer[:num_layers]
                .view(torch_dtype(spec.dtype))
                .view(
                    num_layers,
                    2,
                    self.num_blocks,
                    spec.block_size,
                    spec.num_kv_heads,
                    spec.head_size,
                )
            )
            self.groups.append(view)
            for layer, name in enumerate(group.layer_names):
                if name in self.locations:
                    raise InvalidArgumentError(f"layer {name!r} appears in two KV cache groups")
                self.locations[name] = LayerLocation(g, layer)

    def layer(self, name: str) -> torch.Tensor:
        """One layer's ``[2, num_blocks, block_size, num_kv_heads, head_size]`` view."""
        location = self.locations.get(name)
        if location is None:
            raise InvalidArgumentError(f"layer {name!r} is not in the KV cache config")
        return self.groups[location.group][location.layer]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def _ids(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            return ids.to(self.device)
        # Host lists travel as one tensor (one copy per step, not one per id).
        return torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)

    def zero_blocks(self, block_ids: list[int] | torch.Tensor) -> None:
        """Zero these blocks in every layer of every group, keys and values."""
        zero_blocks(self.buffer, self._ids(block_ids), BLOCK_DIM)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply ``(src, dst)`` copies in every layer; all sources are read first."""
        if any(dst == 0 for _, dst in copies):
            raise InvalidArgumentError(f"copies write into block 0, the null block: {copies}")
        src = self._ids([pair[0] for pair in copies])
        dst = self._ids([pair[1] for pair in copies])
        copy_blocks(self.buffer, src, dst, BLOCK_DIM)

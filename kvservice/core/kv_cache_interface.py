"""KV cache specs (what one layer stores per block) and the KV cache config.

Specs describe a layer's KV cache in tokens per block and bytes per page; a
group is a set of layers that share one block table (``KVCacheGroupSpec``); the
config ties the groups to one pool of ``num_blocks`` physical blocks, block 0 of
which is the null block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum

from kvservice.core.errors import InvalidArgumentError

# Bytes per element of the KV cache dtypes we accept (names as torch spells them).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}


class KVCacheSpecKind(StrEnum):
    """The attention type of a group, as vLLM reports it in KV events."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    CROSS_ATTENTION = "cross_attention"
    MAMBA = "mamba"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(a // -b)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Base spec: ``block_size`` tokens per block."""

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidArgumentError(f"block_size must be positive, got {self.block_size}")

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def kind(self) -> KVCacheSpecKind:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Bytes one request of ``max_model_len`` tokens can hold at once in this layer."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    """Keys and values of ``num_kv_heads`` heads of ``head_size`` each, per token."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        super(AttentionSpec, self).__post_init__()  # slots dataclasses need the explicit form
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgumentError(
                f"dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_SIZES)}"
            )
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise InvalidArgumentError(
                f"num_kv_heads and head_size must be positive, got {self.num_kv_heads} "
                f"and {self.head_size}"
            )

    @property
    def page_size_bytes(self) -> int:
        # Keys and values: two tensors of block_size x heads x head_size.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """Every past token is attended to; blocks are held for the request's lifetime."""

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.FULL_ATTENTION

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token attends to the ``sliding_window`` tokens ending at itself."""

    sliding_window: int = 1

    def __post_init__(self) -> None:
        super(SlidingWindowSpec, self).__post_init__()
        if self.sliding_window <= 0:
            raise InvalidArgumentError(
                f"sliding_window must be positive, got {self.sliding_window}"
            )

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.SLIDING_WINDOW

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds at once: a window plus one step, +1 for a window
        that starts mid-block."""
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Tokens attend only within their chunk of ``attention_chunk_size`` tokens."""

    attention_chunk_size: int = 1

    def __post_init__(self) -> None:
        super(ChunkedLocalAttentionSpec, self).__post_init__()
        if self.attention_chunk_size <= 0:
            raise InvalidArgumentError(
                f"attention_chunk_size must be positive, got {self.attention_chunk_size}"
            )

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder layers attending to the encoder output: sized by the encoder input,
    allocated once, never prefix cached."""

    max_num_encoder_input_tokens: int = 0

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.CROSS_ATTENTION

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(self.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


# vLLM 0.33's MambaCacheMode. "all" is a kvservice extension (see MambaSpec), accepted
# only when named, never a default.
MAMBA_CACHE_MODES = ("align", "none")
MAMBA_CACHE_MODE_EXTENSIONS = ("all",)


@dataclass(frozen=True, slots=True)
class MambaSpec(KVCacheSpec):
    """State-space layers: one recurrent state per request, not one entry per token.

    A block holds the state after its last token. ``mamba_cache_mode`` (vLLM 0.33's
    modes): "none" keeps only the live state (no prefix caching; usually
    ``block_size = max_model_len``); "align" keeps only the states of steps that end on
    a block boundary (the scheduler splits chunks there), holding one state block per
    request plus the previous one, and with a hash block smaller than the block it also
    keeps the prompt's last reusable mid-block state, which enables partial-block
    prefix hits. Speculative decoding adds ``num_speculative_blocks`` state blocks per
    request.

    "all" is a kvservice extension that vLLM 0.33 does not have: it keeps the state at
    every block boundary as a prefix-cache entry, one block per ``block_size`` tokens
    like attention. It is never a default; it applies only when asked for by name.
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        super(MambaSpec, self).__post_init__()
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES + MAMBA_CACHE_MODE_EXTENSIONS:
            raise InvalidArgumentError(
                f"mamba_cache_mode {self.mamba_cache_mode!r} is not supported; use one of "
                f"{list(MAMBA_CACHE_MODES)} (vLLM 0.33's modes), or the kvservice "
                f"extension 'all' by name"
            )
        if self.num_speculative_blocks < 0:
            raise InvalidArgumentError(
                f"num_speculative_blocks must be >= 0, got {self.num_speculative_blocks}"
            )
        if len(self.shapes) != len(self.dtypes) or any(d not in DTYPE_SIZES for d in self.dtypes):
            raise InvalidArgumentError(
                f"MambaSpec needs one dtype from {sorted(DTYPE_SIZES)} per state shape, got "
                f"shapes {self.shapes} and dtypes {self.dtypes}"
            )

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.MAMBA

    @property
    def page_size_bytes(self) -> int:
        real = sum(
            math.prod(shape) * DTYPE_SIZES[dtype]
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
        if self.page_size_padded is not None:
            assert self.page_size_padded >= real, "padded page smaller than the state"
            return self.page_size_padded
        return real

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        if self.mamba_cache_mode == "all":
            return cdiv(max_model_len, self.block_size) * self.page_size_bytes
        if self.mamba_cache_mode == "align":
            # The state being written and the previous boundary's state it started from.
            return (2 + self.num_speculative_blocks) * self.page_size_bytes
        return (1 + self.num_speculative_blocks) * self.page_size_bytes


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table because they share one spec.

    ``is_eagle_group`` marks the groups an EAGLE drafter reads; when no group is marked
    and EAGLE is on, every group is treated as one.
    """

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    """One memory region of ``size`` bytes shared by ``shared_by`` layers (one per group)."""

    size: int
    shared_by: list[str]


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The pool (``num_blocks``, null block included) and the groups drawing from it.

    ``needs_kv_cache_zeroing`` makes the attention managers record every freshly
    allocated block id for ``KVCacheManager.take_new_block_ids()``: a runtime that reads
    whole pages must zero them before use.
    """

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    needs_kv_cache_zeroing: bool = False
    # None: cache every reusable block (dense). 0: window-bounded and Mamba groups keep
    # only the blocks a replay or a shared-prefix junction needs. k > 0 (a multiple of
    # the scheduler block size): also one window's worth every k tokens.
    prefix_cache_retention_interval: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise InvalidArgumentError(
                f"num_blocks must be a positive integer (block 0 is the null block), "
                f"got {self.num_blocks!r}"
            )

    @property
    def page_size_bytes(self) -> int:
        """The page size all groups share (the pool's blocks are interchangeable)."""
        sizes = {g.kv_cache_spec.page_size_bytes for g in self.kv_cache_groups}
        if len(sizes) != 1:
            raise InvalidArgumentError(
                f"all KV cache groups must have the same page size, got {sorted(sizes)}"
            )
        return sizes.pop()


def scheduler_block_size_of(groups: list[KVCacheGroupSpec]) -> int:
    """LCM of the groups' block sizes: a boundary every group agrees on."""
    return math.lcm(*(g.kv_cache_spec.block_size for g in groups)) if groups else 1


def hash_block_size_of(groups: list[KVCacheGroupSpec]) -> int:
    """GCD of the prefix-cacheable groups' block sizes: every group's block is a whole
    number of hash blocks."""
    sizes = [
        g.kv_cache_spec.block_size
        for g in groups
        if not isinstance(g.kv_cache_spec, CrossAttentionSpec)
    ]
    return math.gcd(*sizes) if sizes else scheduler_block_size_of(groups)


def scale_for_context_parallelism(
    kv_cache_config: KVCacheConfig, dcp_world_size: int = 1, pcp_world_size: int = 1
) -> KVCacheConfig:
    """The allocator's view of a config under context parallelism.

    Decode context parallelism shards each full-attention block's tokens across the
    ``dcp_world_size`` ranks, so one block id covers ``block_size * dcp_world_size``
    tokens; Mamba states are replicated, so their blocks keep their size. Prefill
    context parallelism gathers K/V after prefill and does not change the geometry.
    Window-bounded and cross attention are not sharded: refused.
    """
    for name, size in (("dcp_world_size", dcp_world_size), ("pcp_world_size", pcp_world_size)):
        if size < 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {size}")
    if dcp_world_size == 1:
        return kv_cache_config
    groups: list[KVCacheGroupSpec] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            groups.append(group)  # a state is replicated on every rank, not sharded
            continue
        if not isinstance(spec, FullAttentionSpec):
            raise InvalidArgumentError(
                f"dcp_world_size={dcp_world_size}: decode context parallelism shards only "
                f"full attention, but KV cache group {i} is {spec.kind.value}"
            )
        scaled = dataclasses.replace(spec, block_size=spec.block_size * dcp_world_size)
        groups.append(dataclasses.replace(group, kv_cache_spec=scaled))
    return dataclasses.replace(kv_cache_config, kv_cache_groups=groups)

"""Hypothesis strategies for the allocator state machines: pool layouts, prompts built
from a few shared prefixes over a tiny vocabulary (so prefix hits really happen), and
the per-step knobs a scheduler passes to ``allocate_slots``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from kvservice.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

# Token values are drawn from range(VOCAB): with three values, independently drawn
# prompts still share cached blocks now and then.
VOCAB = 3

WATERMARKS = (0.0, 0.0, 0.0, 0.1, 0.25)


@dataclass(frozen=True)
class MachineConfig:
    """One pool layout for a state machine run."""

    specs: tuple[KVCacheSpec, ...]
    num_blocks: int
    max_model_len: int
    max_prompt_len: int
    enable_caching: bool = True
    watermark: float = 0.0


@dataclass(frozen=True)
class Knobs:
    """What the scheduler passes to ``allocate_slots`` besides the token counts.

    ``chunk`` caps the tokens scheduled this step (chunked prefill); None = all.
    """

    chunk: int | None
    lookahead: int
    delay_cache_blocks: bool
    full_sequence_must_fit: bool
    reserved_blocks: int
    has_scheduled_reqs: bool


def full(block_size: int, head_size: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size)


def sliding(block_size: int, window: int, head_size: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=head_size, sliding_window=window
    )


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, attention_chunk_size=chunk
    )


@dataclass(frozen=True)
class RequestOptions:
    """Per-request hashing inputs and the prompt-logprobs opt-out of prefix reads."""

    cache_salt: str | None = None
    lora_name: str | None = None
    skip_reading_prefix_cache: bool = False


# Mostly plain requests: a salt or a LoRA adapter keeps a request's hashes apart from
# equal tokens without them; skip_reading_prefix_cache requests never hit but still
# write the cache.
REQUEST_OPTIONS = st.builds(
    RequestOptions,
    cache_salt=st.sampled_from((None, None, None, None, None, "salt")),
    lora_name=st.sampled_from((None, None, None, None, None, "adapter")),
    skip_reading_prefix_cache=st.sampled_from((False, False, False, False, False, True)),
)


def knobs(admission: bool) -> st.SearchStrategy[Knobs]:
    """Mostly plain steps; lookahead, delayed caching, reserved blocks and the
    admission gate now and then (``sampled_from`` with repeats biases the draw)."""
    return st.builds(
        Knobs,
        chunk=st.one_of(st.none(), st.integers(1, 20)),
        lookahead=st.sampled_from((0, 0, 0, 0, 1, 2, 5)),
        delay_cache_blocks=st.sampled_from((False, False, False, False, True)),
        full_sequence_must_fit=(
            st.sampled_from((False, False, True)) if admission else st.just(False)
        ),
        reserved_blocks=st.sampled_from((0, 0, 0, 1, 2)),
        has_scheduled_reqs=st.booleans(),
    )


def token_lists(min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCAB - 1), min_size=min_size, max_size=max_size)


@st.composite
def prompts(
    draw: st.DrawFn,
    prefixes: Sequence[Sequence[int]],
    history: Sequence[Sequence[int]],
    max_len: int,
) -> list[int]:
    """A shared prefix, a (cut) earlier sequence, or nothing, then a short random tail."""
    kinds = ["prefix", "prefix", "fresh"] + (["repeat", "repeat"] if history else [])
    kind = draw(st.sampled_from(kinds))
    base: list[int] = []
    if kind == "prefix":
        base = list(draw(st.sampled_from(prefixes)))
    elif kind == "repeat":
        earlier = draw(st.sampled_from(history))
        base = list(earlier[: draw(st.integers(1, len(earlier)))])
    tail = draw(token_lists(0 if base else 1, 12))
    tokens = (base + tail)[:max_len]
    return tokens or [0]


# -- pool layouts -----------------------------------------------------------------------


@st.composite
def full_attention_configs(draw: st.DrawFn) -> MachineConfig:
    """(a) One full-attention group, block 4 or 16."""
    block_size = draw(st.sampled_from((4, 16)))
    if block_size == 4:
        num_blocks, max_model_len, max_prompt = draw(st.integers(5, 24)), 64, 40
    else:
        num_blocks, max_model_len, max_prompt = draw(st.integers(3, 10)), 128, 80
    return MachineConfig(
        specs=(full(block_size),),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_prompt_len=max_prompt,
        watermark=draw(st.sampled_from(WATERMARKS)),
    )


@st.composite
def hybrid_same_block_configs(draw: st.DrawFn) -> MachineConfig:
    """(b) Full attention + sliding window(s), all block 4, in several group orders
    (two sliding-window groups with equal specs are searched together; different
    windows make three attention types and exercise the fixed-point loop)."""
    windows = st.sampled_from((2, 4, 5, 8, 12))
    layout = draw(st.sampled_from(("fs", "sf", "fss", "fsS")))
    w1, w2 = draw(windows), draw(windows)
    specs: tuple[KVCacheSpec, ...] = {
        "fs": (full(4), sliding(4, w1)),
        "sf": (sliding(4, w1), full(4)),
        "fss": (full(4), sliding(4, w1), sliding(4, w1)),
        "fsS": (full(4), sliding(4, w1), sliding(4, w2)),
    }[layout]
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(6, 40)),
        max_model_len=64,
        max_prompt_len=40,
        watermark=draw(st.sampled_from(WATERMARKS)),
    )


@st.composite
def hybrid_mixed_block_configs(draw: st.DrawFn) -> MachineConfig:
    """(c) Full attention and sliding window with different block sizes (equal page
    sizes): hash_block_size = gcd = 4, scheduler_block_size = lcm = 8."""
    if draw(st.booleans()):
        specs: tuple[KVCacheSpec, ...] = (
            full(8),
            sliding(4, draw(st.sampled_from((3, 4, 6, 8, 16))), head_size=2),
        )
    else:
        specs = (full(4, head_size=2), sliding(8, draw(st.sampled_from((4, 8, 12, 16)))))
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(6, 40)),
        max_model_len=64,
        max_prompt_len=40,
        watermark=draw(st.sampled_from(WATERMARKS)),
    )


@st.composite
def local_attention_configs(draw: st.DrawFn) -> MachineConfig:
    """(e) Chunked local attention (alone, or with full attention and sliding window)
    and a lone sliding-window group."""
    chunk = draw(st.sampled_from((4, 8, 12)))
    window = draw(st.sampled_from((3, 5, 8)))
    specs: tuple[KVCacheSpec, ...] = draw(
        st.sampled_from(
            (
                (full(4), chunked(4, chunk)),
                (chunked(4, chunk),),
                (sliding(4, window),),
                (full(4), sliding(4, window), chunked(4, chunk)),
            )
        )
    )
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(5, 36)),
        max_model_len=64,
        max_prompt_len=40,
        watermark=draw(st.sampled_from(WATERMARKS)),
    )


@st.composite
def no_caching_configs(draw: st.DrawFn) -> MachineConfig:
    """(d) Prefix caching disabled: no hits, no hashes, any number of groups."""
    specs: tuple[KVCacheSpec, ...] = draw(
        st.sampled_from(
            (
                (full(4),),
                (full(4), sliding(4, 8)),
                (full(8), sliding(4, 6, head_size=2)),
                (full(4), chunked(4, 8)),
            )
        )
    )
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(4, 30)),
        max_model_len=64,
        max_prompt_len=40,
        enable_caching=False,
        watermark=draw(st.sampled_from(WATERMARKS)),
    )

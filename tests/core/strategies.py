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
    MambaSpec,
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
    # EAGLE: ``eagle_marks`` sets ``is_eagle_group`` per group (None: no group marked).
    use_eagle: bool = False
    eagle_marks: tuple[bool, ...] | None = None
    retention: int | None = None  # KVCacheConfig.prefix_cache_retention_interval
    dcp: int = 1  # decode context parallel world size
    # Extra moves and checks: KV events replayed after every step, connector
    # (external) tokens at admission, evict_blocks of random ids, probe before
    # allocations.
    events: bool = False
    external: bool = False
    evict: bool = False
    probe: bool = False
    # Shared prefixes are this many scheduler blocks long (EAGLE and Mamba hits need
    # longer cached runs than plain full attention).
    prefix_blocks: tuple[int, int] = (1, 3)


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


def mamba(block_size: int, speculative: int = 0, mode: str = "all") -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((2, 4),),
        dtypes=("float32",),
        mamba_cache_mode=mode,
        num_speculative_blocks=speculative,
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
                (mamba(64, draw(st.integers(0, 2)), mode="none"),),
                (full(4), mamba(64, draw(st.integers(0, 2)), mode="none")),
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


# -- layouts for the feature machines (test_state_machine_hybrid.py) ---------------------


def retention_intervals(scheduler_block_size: int) -> st.SearchStrategy[int | None]:
    """None (dense) most often, 0 (reachable boundaries only) or a small multiple of the
    scheduler block size."""
    sbs = scheduler_block_size
    return st.sampled_from((None, None, 0, 0, sbs, 2 * sbs, 4 * sbs))


@st.composite
def mamba_configs(draw: st.DrawFn) -> MachineConfig:
    """Mamba "all" groups alone, beside full attention, beside full attention and a
    sliding window, beside a sliding window, and with mixed block sizes (hash block
    4, scheduler block 8); speculative state blocks now and then."""
    spec_blocks = st.sampled_from((0, 0, 0, 1, 2))
    window = draw(st.sampled_from((2, 4, 5, 8, 12)))
    layout = draw(st.sampled_from(("m", "m8", "fm", "mf", "fsm", "fmm", "sm", "f8m4", "f4m8")))
    s1, s2 = draw(spec_blocks), draw(spec_blocks)
    specs: tuple[KVCacheSpec, ...] = {
        "m": (mamba(4, s1),),
        "m8": (mamba(8, s1),),
        "fm": (full(4), mamba(4, s1)),
        "mf": (mamba(4, s1), full(4)),
        "fsm": (full(4), sliding(4, window), mamba(4, s1)),
        "fmm": (full(4), mamba(4, s1), mamba(4, s2)),
        "sm": (sliding(4, window), mamba(4, s1)),
        "f8m4": (full(8), mamba(4, s1)),
        "f4m8": (full(4), mamba(8, s1)),
    }[layout]
    sbs = 8 if layout in ("m8", "f8m4", "f4m8") else 4
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(5, 36)),
        max_model_len=64,
        max_prompt_len=40,
        watermark=draw(st.sampled_from(WATERMARKS)),
        retention=draw(retention_intervals(sbs)),
        prefix_blocks=(2, 5),
        events=True,
        external=True,
        evict=True,
        probe=True,
    )


@st.composite
def eagle_configs(draw: st.DrawFn) -> MachineConfig:
    """EAGLE on (or off) for full attention, a lone sliding window, and hybrid layouts;
    groups unmarked (every attention group drafts) or some marked ``is_eagle_group``."""
    window = st.sampled_from((2, 4, 5, 8, 12))
    w1, w2 = draw(window), draw(window)
    layout = draw(st.sampled_from(("f4", "f16", "s", "fs", "sf", "fss", "fsS", "f8s4", "fm")))
    specs: tuple[KVCacheSpec, ...] = {
        "f4": (full(4),),
        "f16": (full(16),),
        "s": (sliding(4, w1),),
        "fs": (full(4), sliding(4, w1)),
        "sf": (sliding(4, w1), full(4)),
        "fss": (full(4), sliding(4, w1), sliding(4, w1)),
        "fsS": (full(4), sliding(4, w1), sliding(4, w2)),
        "f8s4": (full(8), sliding(4, w1, head_size=2)),
        "fm": (full(4), mamba(4)),
    }[layout]
    marks: tuple[bool, ...] | None = None
    if draw(st.booleans()):
        marks = tuple(not isinstance(spec, MambaSpec) and draw(st.booleans()) for spec in specs)
    has_sparse = any(isinstance(spec, SlidingWindowSpec | MambaSpec) for spec in specs)
    sbs = 16 if layout == "f16" else 8 if layout == "f8s4" else 4
    retention = draw(retention_intervals(sbs)) if has_sparse else None
    big = layout == "f16"
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(3, 12) if big else st.integers(5, 36)),
        max_model_len=128 if big else 64,
        max_prompt_len=80 if big else 40,
        watermark=draw(st.sampled_from(WATERMARKS)),
        use_eagle=draw(st.sampled_from((True, True, True, False))),
        eagle_marks=marks,
        retention=retention,
        prefix_blocks=(2, 5),
        events=True,
        external=True,
        evict=True,
        probe=True,
    )


@st.composite
def retention_configs(draw: st.DrawFn) -> MachineConfig:
    """Sliding-window groups (alone, beside full attention, two windows, mixed block
    sizes) under retention intervals None, 0 and k."""
    window = st.sampled_from((2, 3, 4, 5, 8, 12, 16))
    w1, w2 = draw(window), draw(window)
    layout = draw(st.sampled_from(("s", "fs", "fss", "fsS", "f8s4", "f4s8")))
    specs: tuple[KVCacheSpec, ...] = {
        "s": (sliding(4, w1),),
        "fs": (full(4), sliding(4, w1)),
        "fss": (full(4), sliding(4, w1), sliding(4, w1)),
        "fsS": (full(4), sliding(4, w1), sliding(4, w2)),
        "f8s4": (full(8), sliding(4, w1, head_size=2)),
        "f4s8": (full(4, head_size=2), sliding(8, w1)),
    }[layout]
    sbs = 8 if layout in ("f8s4", "f4s8") else 4
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(6, 40)),
        max_model_len=64,
        max_prompt_len=40,
        watermark=draw(st.sampled_from(WATERMARKS)),
        retention=draw(st.sampled_from((None, 0, 0, sbs, 2 * sbs, 3 * sbs))),
        events=True,
        external=True,
        evict=True,
        probe=True,
    )


@st.composite
def dcp_configs(draw: st.DrawFn) -> MachineConfig:
    """Decode context parallelism: full-attention blocks cover ``block_size * dcp``
    tokens (alone, or beside an unscaled Mamba group of the scaled size)."""
    dcp = draw(st.sampled_from((2, 4)))
    layout = draw(st.sampled_from(("f4", "f4", "f8", "fm")))
    specs: tuple[KVCacheSpec, ...] = {
        "f4": (full(4),),
        "f8": (full(8),),
        "fm": (full(4), mamba(4 * dcp)),
    }[layout]
    return MachineConfig(
        specs=specs,
        num_blocks=draw(st.integers(3, 16)),
        max_model_len=128,
        max_prompt_len=80,
        watermark=draw(st.sampled_from(WATERMARKS)),
        dcp=dcp,
        retention=draw(st.sampled_from((None, 0))) if layout == "fm" else None,
        events=True,
        external=True,
        evict=True,
        probe=True,
    )

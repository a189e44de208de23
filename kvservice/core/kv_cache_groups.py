"""A pool's KV cache groups written as text: what ``kvservice serve --kv-cache-groups``
takes, and what the vLLM integration names when a server's pool is not the one vLLM
computed, so the fix can be pasted.

One word per group, comma separated, in vLLM's group order: ``full_attention``,
``sliding_window:W`` (a window of W tokens), ``chunked_local_attention:C`` (chunks of C
tokens), ``mamba:B`` (a Mamba state group of B tokens per block). A Mistral-style model
(a window on every layer) is ``sliding_window:4096``; a Gemma-style one
``full_attention,sliding_window:1024``; an encoder-decoder model (Whisper-style) adds
``cross_attention`` (its decoder's layers attending to the encoder's output, sized per
request by the encoder input). The attention groups' block size and page are the
pool's (``--block-size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MambaSpec,
    SlidingWindowSpec,
)

# The kinds a word names, and whether it takes a size (window, chunk, block size).
_SIZED = {
    KVCacheSpecKind.SLIDING_WINDOW: "window in tokens",
    KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: "chunk in tokens",
    KVCacheSpecKind.MAMBA: "block size in tokens",
}
# The kinds a bare word names.
_UNSIZED = (KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.CROSS_ATTENTION)
_WORDS = (
    "full_attention, sliding_window:W, chunked_local_attention:C, mamba:B, "
    "cross_attention (comma separated)"
)


@dataclass(frozen=True, slots=True)
class GroupShape:
    """One group as a word names it: its kind and, for the sized kinds, the size."""

    kind: KVCacheSpecKind
    size: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.size}" if self.kind in _SIZED else self.kind.value

    @classmethod
    def reported(
        cls, kind: str, block_size: int, sliding_window: int | None, chunk_size: int | None
    ) -> GroupShape:
        """The word of a group as ``GetCacheConfig`` reports it."""
        shape_kind = KVCacheSpecKind(kind)
        sizes = {
            KVCacheSpecKind.SLIDING_WINDOW: sliding_window,
            KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION: chunk_size,
            KVCacheSpecKind.MAMBA: block_size,
        }
        return cls(shape_kind, sizes.get(shape_kind) or 0)


def parse_groups(text: str) -> list[GroupShape]:
    """The groups ``text`` names; ``InvalidArgumentError`` naming the word it cannot
    read."""
    if not text.strip():
        raise InvalidArgumentError(f"no KV cache group named; use {_WORDS}")
    return [_parse(word.strip()) for word in text.split(",")]


def _parse(word: str) -> GroupShape:
    name, _, size = word.partition(":")
    try:
        kind = KVCacheSpecKind(name)
    except ValueError:
        raise InvalidArgumentError(
            f"KV cache group {word!r}: unknown kind {name!r}; use {_WORDS}"
        ) from None
    if kind not in _SIZED and kind not in _UNSIZED:
        raise InvalidArgumentError(
            f"KV cache group {word!r}: a {name} group cannot be laid out from its name; "
            f"use {_WORDS}"
        )
    if kind not in _SIZED:
        if size:
            raise InvalidArgumentError(f"KV cache group {word!r}: {name} takes no size")
        return GroupShape(kind)
    if not size.isdigit() or int(size) <= 0:
        raise InvalidArgumentError(
            f"KV cache group {word!r}: {name} needs its {_SIZED[kind]}, a positive integer "
            f"({name}:N)"
        )
    return GroupShape(kind, int(size))


def shape_of(spec: KVCacheSpec) -> GroupShape:
    """The word of a group's spec (as vLLM's or the server's manager holds it)."""
    if isinstance(spec, SlidingWindowSpec):
        return GroupShape(spec.kind, spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupShape(spec.kind, spec.attention_chunk_size)
    if isinstance(spec, MambaSpec):
        return GroupShape(spec.kind, spec.block_size)
    return GroupShape(spec.kind)


def format_groups(specs: Sequence[KVCacheSpec]) -> str:
    """``--kv-cache-groups``' text for these groups."""
    return ",".join(str(shape_of(spec)) for spec in specs)


def group_spec(
    shape: GroupShape,
    attention: AttentionSpec | None,
    page_size_bytes: int,
    enable_caching: bool,
    encoder_tokens: int = 0,
) -> KVCacheSpec:
    """The core's spec of the group ``shape`` names: the attention kinds shaped as
    ``attention`` (block size, heads, head size, dtype; None for a Mamba group); a
    Mamba group one state padded to ``page_size_bytes`` (the pool's blocks are
    interchangeable between groups), in "align" mode with prefix caching, else
    "none"; a cross-attention group sized for ``encoder_tokens`` encoder input tokens
    (what the pool's memory check counts)."""
    if shape.kind is KVCacheSpecKind.MAMBA:
        return MambaSpec(
            shape.size,
            shapes=((1,),),
            dtypes=("float32",),
            page_size_padded=page_size_bytes,
            mamba_cache_mode="align" if enable_caching else "none",
        )
    if attention is None:
        raise InvalidArgumentError(f"a {shape} group needs the attention layers' shape")
    layout = (attention.block_size, attention.num_kv_heads, attention.head_size, attention.dtype)
    match shape.kind:
        case KVCacheSpecKind.FULL_ATTENTION:
            return FullAttentionSpec(*layout)
        case KVCacheSpecKind.SLIDING_WINDOW:
            return SlidingWindowSpec(*layout, sliding_window=shape.size)
        case KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION:
            return ChunkedLocalAttentionSpec(*layout, attention_chunk_size=shape.size)
        case KVCacheSpecKind.CROSS_ATTENTION:
            return CrossAttentionSpec(*layout, max_num_encoder_input_tokens=encoder_tokens)
    raise InvalidArgumentError(f"a {shape} group cannot be laid out from its name; use {_WORDS}")

"""``--kv-cache-groups``' words: read back as written, every spec's word, and a clear
refusal naming the word that cannot be read."""

from __future__ import annotations

import pytest

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_groups import GroupShape, format_groups, parse_groups
from kvservice.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpecKind,
    MambaSpec,
    SlidingWindowSpec,
)


def test_words_read_back_as_written() -> None:
    text = (
        "full_attention,sliding_window:1024,chunked_local_attention:8192,mamba:64,cross_attention"
    )
    shapes = parse_groups(text)
    assert shapes == [
        GroupShape(KVCacheSpecKind.FULL_ATTENTION),
        GroupShape(KVCacheSpecKind.SLIDING_WINDOW, 1024),
        GroupShape(KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION, 8192),
        GroupShape(KVCacheSpecKind.MAMBA, 64),
        GroupShape(KVCacheSpecKind.CROSS_ATTENTION),
    ]
    assert ",".join(map(str, shapes)) == text
    assert parse_groups(" sliding_window:64 ") == [GroupShape(KVCacheSpecKind.SLIDING_WINDOW, 64)]


def test_every_spec_has_its_word() -> None:
    specs = [
        FullAttentionSpec(16),
        SlidingWindowSpec(16, sliding_window=4096),
        ChunkedLocalAttentionSpec(16, attention_chunk_size=8192),
        MambaSpec(32, shapes=((1,),), dtypes=("float32",)),
    ]
    text = format_groups(specs)
    assert text == "full_attention,sliding_window:4096,chunked_local_attention:8192,mamba:32"
    assert format_groups(specs[1:2]) == "sliding_window:4096"  # Mistral-style


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no KV cache group named"),
        ("full", "unknown kind 'full'"),
        ("sliding_window", r"sliding_window needs its window in tokens.*sliding_window:N"),
        ("sliding_window:-4", "needs its window in tokens, a positive integer"),
        ("mamba:0", "needs its block size in tokens"),
        ("full_attention:16", "full_attention takes no size"),
        ("full_attention,,mamba:16", "unknown kind ''"),
        ("cross_attention:1500", "cross_attention takes no size"),
    ],
)
def test_a_word_that_cannot_be_read_is_named(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_groups(text)

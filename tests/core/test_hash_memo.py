"""``BlockHasher`` remembers the hashes of shared prefixes: a remembered hash is the
hash of that very block, whatever the hasher saw before (other suffixes, salts, LoRA
adapters), and the memo stays bounded."""

from __future__ import annotations

import random

import pytest

from kvservice.core.block_hashing import HASH_MEMO_CAPACITY, BlockHasher
from kvservice.core.request import Request
from tests.core.support import DEFAULT_SEED, REF_HASH_FNS

BLOCK = 16


def memo_hasher(algo: str = "sha256", seed: str | None = None) -> BlockHasher:
    """A hasher that hashes the Python way, through the memo, in either build: the
    compiled build's C chain would otherwise take every plain sha256 request."""
    hasher = BlockHasher(BLOCK, algo, none_hash_seed=seed)
    hasher.native_chain = None
    return hasher


def reference_hashes(
    algo: str, tokens: list[int], lora: str | None = None, salt: str | None = None
) -> list[bytes]:
    """vLLM's chain, from the reference hash function: LoRA keys every block, the salt
    the first only, each tagged with its kind (a LoRA name without a path keys None)."""
    ref = REF_HASH_FNS[algo]
    parent = ref(DEFAULT_SEED)
    hashes = []
    for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        keys = ([("lora", lora, None)] if lora else []) + (
            [("cache_salt", salt)] if salt and start == 0 else []
        )
        parent = ref((parent, tuple(tokens[start : start + BLOCK]), tuple(keys) or None))
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_shared_prefixes_hash_as_if_nothing_was_remembered(algo: str) -> None:
    rng = random.Random(7)
    hasher = memo_hasher(algo, DEFAULT_SEED)
    system = [rng.getrandbits(15) for _ in range(5 * BLOCK)]
    variants: list[tuple[list[int], str | None, str | None]] = []
    for _ in range(6):
        suffix = [rng.getrandbits(15) for _ in range(rng.randint(0, 3 * BLOCK))]
        variants.append((system + suffix, None, None))
    variants += [
        (system, None, None),  # the prefix alone, once remembered
        (system[: 3 * BLOCK] + [1] * BLOCK, None, None),  # diverges inside the prefix
        (system, "adapter-a", None),
        (system, "adapter-b", None),
        (system, None, "tenant-a"),
        (system, "adapter-a", "tenant-a"),
    ]
    for round_ in range(2):  # the second time, everything is remembered
        for i, (tokens, lora, salt) in enumerate(variants):
            request = Request(f"r{round_}-{i}", tokens, hasher, lora_name=lora, cache_salt=salt)
            assert request.block_hashes == reference_hashes(algo, tokens, lora, salt)


def test_output_blocks_extend_a_remembered_chain() -> None:
    hasher = memo_hasher()
    prompt = list(range(2 * BLOCK))
    first = Request("first", prompt, hasher)
    first.append_output_token_ids(list(range(100, 100 + BLOCK)))
    second = Request("second", prompt + list(range(100, 100 + BLOCK)), hasher)
    assert second.block_hashes == first.block_hashes
    assert second.block_hashes == reference_hashes("sha256", second.prompt_token_ids)


def test_the_memo_is_bounded() -> None:
    hasher = memo_hasher()
    tokens = list(range((HASH_MEMO_CAPACITY + 100) * BLOCK))
    request = Request("long", tokens, hasher)
    assert len(hasher._memo) <= HASH_MEMO_CAPACITY
    again = Request("again", tokens[: 4 * BLOCK], hasher)
    assert again.block_hashes == request.block_hashes[:4]
    assert again.block_hashes == reference_hashes("sha256", tokens[: 4 * BLOCK])

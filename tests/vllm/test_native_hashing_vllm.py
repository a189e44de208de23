"""Plain requests hash as vLLM 0.33.0's own block hasher hashes them, with ``sha256``
and ``sha256_cbor``: in the compiled build through the C chain (``_native_hashing.c``),
on the sources through pickle or cbor2; a packed prompt read in place; the blocks that
decode tokens complete. The reference is vLLM's ``get_request_block_hasher``, not a
copy of it."""

from __future__ import annotations

import random
from array import array

import pytest

from kvservice.core import COMPILED
from kvservice.core.block_hashing import BlockHasher
from kvservice.core.request import Request
from tests.vllm.support import vllm_hashed_request


@pytest.mark.parametrize("packed", [False, True], ids=["list", "array"])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_plain_requests_hash_as_vllms_hasher(algo: str, packed: bool) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(200_000) for _ in range(16 * 7 + 5)] + [0, 255, 256, 65535, 65536]
    hasher = BlockHasher(16, algo)
    assert (hasher.native_chain is not None) == COMPILED
    ours = Request("r", array("I", prompt) if packed else prompt, hasher)
    theirs = vllm_hashed_request("r", prompt, algo)
    assert ours.block_hashes == theirs.block_hashes and len(ours.block_hashes) == 7
    for token in range(100, 140):  # decode tokens, one at a time
        ours.append_output_token_ids(token)
        theirs.append_output_token_ids(token)
    assert ours.block_hashes == theirs.block_hashes and len(ours.block_hashes) == 10


@pytest.mark.parametrize("odd", [2**40, True], ids=["past-int32", "bool"])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_a_token_the_chain_declines_hashes_as_vllms_hasher(algo: str, odd: int) -> None:
    # The C chain declines the block that holds it; Python hashes it, as vLLM does.
    prompt = [7] * 20 + [odd] + [9] * 27
    ours = Request("r", prompt, BlockHasher(16, algo))
    theirs = vllm_hashed_request("r", prompt, algo)
    assert ours.block_hashes == theirs.block_hashes and len(ours.block_hashes) == 3

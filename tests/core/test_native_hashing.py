"""The C chains of vLLM's ``sha256`` and ``sha256_cbor`` block hashes
(``_native_hashing.c``) hash exactly what ``pickle.dumps`` (``cbor2.dumps``) writes, or
decline (None) and leave the chain to Python.

Their only reference is pickle, cbor2 and hashlib: a digest equal to the reference's
for every token value written in another form (pickle's BININT1, BININT2, BININT,
negative; CBOR's heads of 0, 1, 2 and 4 bytes, both signs), every tuple size (TUPLE1-3,
MARK ... TUPLE; CBOR's array heads) and buffer (on the stack, on the heap) means the
bytes were equal."""

from __future__ import annotations

import array
import hashlib
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.core import COMPILED
from kvservice.core.block_hashing import BlockHasher, NativeChain, native_chain
from kvservice.core.request import Request
from tests.core.support import DEFAULT_SEED, REF_HASH_FNS

INT32 = (-(2**31), 2**31 - 1)
# The boundaries of each integer form, and values equal to opcode bytes.
EDGE_TOKENS = [0, 1, 23, 24, 255, 256, 65535, 65536, *INT32]
EDGE_TOKENS += [-1, -24, -25, -256, -257, -65536, -65537, 0x28, 0x74, 0x80, 0x94, 0x2E]
PARENT = hashlib.sha256(b"parent").digest()
ALGOS = ["sha256", "sha256_cbor"]


def reference_chain(
    parent: bytes,
    tokens: list[Any],
    start: int,
    num_blocks: int,
    block_size: int,
    algo: str = "sha256",
) -> list[bytes]:
    hashes = []
    for b in range(num_blocks):
        first = start + b * block_size
        block = (parent, tuple(tokens[first : first + block_size]), None)
        parent = REF_HASH_FNS[algo](block)
        hashes.append(parent)
    return hashes


def built_chain(algo: str) -> NativeChain:
    native = native_chain(algo)
    assert native is not None
    return native


def test_the_compiled_build_has_the_chains() -> None:
    # The sources never import it: their parity is the rest of tests/core.
    for algo in ALGOS:
        assert (native_chain(algo) is not None) == COMPILED
        assert (BlockHasher(16, algo).native_chain is not None) == COMPILED
    assert BlockHasher(16, "xxhash").native_chain is None
    assert BlockHasher(16, "xxhash_cbor").native_chain is None


needs_build = pytest.mark.skipif(not COMPILED, reason="the C chain is built with the compiled core")


@pytest.fixture(params=ALGOS)
def algo(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def chain(algo: str) -> NativeChain:
    return built_chain(algo)


# Each integer opcode's range drawn on its own, so that every byte of each form varies.
tokens_in_int32 = st.one_of(
    st.sampled_from(EDGE_TOKENS),
    st.integers(0, 255),
    st.integers(256, 65535),
    st.integers(65536, INT32[1]),
    st.integers(-256, -1),
    st.integers(-65536, -257),
    st.integers(INT32[0], -1),
)


@needs_build
@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3, 4, 16, 17, 203, 300]),
    num_blocks=st.integers(0, 4),
    start=st.integers(0, 3),
    extra=st.integers(0, 3),
    parent_size=st.sampled_from([1, 23, 24, 31, 32, 33, 255]),
    algo=st.sampled_from(ALGOS),
    data=st.data(),
)
def test_the_chain_is_the_references(
    block_size: int,
    num_blocks: int,
    start: int,
    extra: int,
    parent_size: int,
    algo: str,
    data: st.DataObject,
) -> None:
    chain = built_chain(algo)
    size = start + num_blocks * block_size + extra
    tokens = data.draw(st.lists(tokens_in_int32, min_size=size, max_size=size))
    parent = bytes(range(parent_size))
    expected = reference_chain(parent, tokens, start, num_blocks, block_size, algo)
    assert chain(parent, tokens, start, num_blocks, block_size) == expected
    # A packed prompt, read in place: signed, and unsigned as the server unpacks one.
    assert chain(parent, array.array("i", tokens), start, num_blocks, block_size) == expected
    unsigned = array.array("I", [t for t in tokens if t >= 0])
    count = len(unsigned) // block_size
    assert chain(parent, unsigned, 0, count, block_size) == reference_chain(
        parent, list(unsigned), 0, count, block_size, algo
    )


@needs_build
@pytest.mark.parametrize(
    "odd", [2**31, -(2**31) - 1, 2**40, 2**70, True, False], ids=lambda v: f"{v!r}"
)
def test_a_token_written_otherwise_is_left_to_python(
    chain: NativeChain, algo: str, odd: Any
) -> None:
    tokens = [5] * 8 + [odd] + [6] * 7
    assert chain(PARENT, tokens, 0, 1, 16) is None
    # Before the odd token's block the chain is C's; it stops there as a whole.
    assert chain(PARENT, tokens, 0, 1, 8) == reference_chain(PARENT, tokens, 0, 1, 8, algo)
    assert chain(PARENT, tokens, 0, 2, 8) is None


@needs_build
def test_a_packed_id_past_int32_is_left_to_python(chain: NativeChain, algo: str) -> None:
    tokens = array.array("I", [5] * 8 + [2**31] + [6] * 7)
    assert chain(PARENT, tokens, 0, 1, 16) is None
    expected = reference_chain(PARENT, list(tokens), 0, 1, 8, algo)
    assert chain(PARENT, tokens, 0, 1, 8) == expected


@needs_build
@pytest.mark.parametrize(
    "token_ids",
    [(1, 2), range(1, 3), array.array("q", [1, 2]), array.array("H", [1, 2]), bytearray(b"ab")],
    ids=repr,
)
def test_other_sequences_are_left_to_python(chain: NativeChain, token_ids: Any) -> None:
    assert chain(PARENT, token_ids, 0, 1, 2) is None


@pytest.mark.parametrize("typecode", ["q", "H", "b"])
def test_a_prompt_packed_otherwise_hashes_as_its_list_does(algo: str, typecode: str) -> None:
    tokens = [t % 100 for t in range(40)]
    hasher = BlockHasher(16, algo, DEFAULT_SEED)
    request = Request("packed", array.array(typecode, tokens), hasher)
    assert request.block_hashes == reference_chain(hasher.none_hash, tokens, 0, 2, 16, algo)


@needs_build
def test_a_block_past_one_pickle_frame_is_left_to_python(chain: NativeChain, algo: str) -> None:
    # pickle splits a frame past 64 KiB: 13,200 tokens of 5 bytes; CBOR has no frames.
    tokens = [70000 + t for t in range(13_200)]
    expected = reference_chain(PARENT, tokens, 0, 1, len(tokens), algo)
    assert chain(PARENT, tokens, 0, 1, len(tokens)) == (None if algo == "sha256" else expected)
    # Just under it, one frame: the chain's.
    under = tokens[:13_000]
    assert chain(PARENT, under, 0, 1, 13_000) == reference_chain(PARENT, under, 0, 1, 13_000, algo)
    hasher = BlockHasher(len(tokens), algo, DEFAULT_SEED)
    request = Request("long", tokens, hasher)
    assert request.block_hashes == reference_chain(
        hasher.none_hash, tokens, 0, 1, len(tokens), algo
    )


@needs_build
def test_an_int_subclass_is_left_to_python(chain: NativeChain) -> None:
    class TokenId(int):
        pass

    assert chain(PARENT, [1, TokenId(2), 3, 4], 0, 1, 4) is None


@needs_build
def test_a_long_parent_is_left_to_python(chain: NativeChain, algo: str) -> None:
    assert chain(bytes(256), [1, 2], 0, 1, 2) is None
    expected = reference_chain(bytes(255), [1, 2], 0, 1, 2, algo)
    assert chain(bytes(255), [1, 2], 0, 1, 2) == expected


@needs_build
@pytest.mark.parametrize(
    ("start", "num_blocks", "block_size"), [(0, 3, 4), (1, 2, 4), (-1, 1, 4), (0, 1, 0), (0, -1, 4)]
)
def test_a_window_outside_the_tokens_is_an_error(
    chain: NativeChain, start: int, num_blocks: int, block_size: int
) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        chain(PARENT, list(range(8)), start, num_blocks, block_size)
    with pytest.raises(ValueError, match="do not fit"):
        chain(PARENT, array.array("I", range(8)), start, num_blocks, block_size)


@needs_build
def test_arguments_of_another_type_are_an_error(chain: NativeChain) -> None:
    with pytest.raises(TypeError, match="the parent hash must be bytes"):
        chain(bytearray(PARENT), [1, 2], 0, 1, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="5 arguments"):
        chain(PARENT, [1, 2], 0, 1)  # type: ignore[call-arg]


def test_a_packed_prompt_hashes_as_its_list_does(algo: str) -> None:
    rng = random.Random(4)
    tokens = [rng.getrandbits(17) for _ in range(100)]
    hasher = BlockHasher(16, algo, DEFAULT_SEED)
    packed = Request("packed", array.array("I", tokens), hasher)
    assert isinstance(packed.all_token_ids, array.array)
    assert packed.block_hashes == reference_chain(hasher.none_hash, tokens, 0, 6, 16, algo)
    packed.append_output_token_ids(list(range(30)))  # the ids become a list
    longer = [*tokens, *range(30)]
    assert packed.block_hashes == reference_chain(hasher.none_hash, longer, 0, 8, 16, algo)


@pytest.mark.parametrize("odd", [2**40, True])
def test_a_request_with_such_tokens_hashes_as_the_reference(algo: str, odd: int) -> None:
    # Through BlockHasher, in either build: the C chain declines, Python hashes (vLLM's
    # own hasher: tests/vllm/test_native_hashing_vllm.py).
    rng = random.Random(3)
    tokens = [rng.getrandbits(17) for _ in range(40)] + [odd] + [7] * 23
    hasher = BlockHasher(16, algo, DEFAULT_SEED)
    request = Request("odd", tokens, hasher)
    assert request.block_hashes == reference_chain(hasher.none_hash, tokens, 0, 4, 16, algo)

"""Block hashing: extra keys, chained hashes, literal vectors and the manager's use of
them (catalogue U14-U16, U20-U24, 18, 19)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvservice.core.block_hashing import (
    HASH_FUNCTIONS,
    BlockHasher,
    MultiModalFeature,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    hash_block_tokens,
)
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_block import make_block_hash_with_group_id
from kvservice.core.request import Request
from tests.core.helpers import ids, make_manager, prefill, tokens
from tests.core.support import DEFAULT_SEED, REF_HASH_FNS, ref_sha256

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
REPO_ROOT = Path(__file__).resolve().parents[2]

# Computed once, outside kvservice, with hashlib / pickle (highest protocol) /
# cbor2 (canonical) / xxhash.xxh3_128_digest directly:
#   none = fn("vllm-none-hash")
#   h0 = fn((none, (0, 1, 2), None));             h1 = fn((h0, (3, 4, 5), None))
#   e0 = fn((none, (0, 1, 2), (("hash1", 0),)));  e1 = fn((e0, (3, 4, 5), (("hash2", 0),)))
#   s0 = fn((none, (0, 1, 2), ("lora-a", "salt"))); s1 = fn((s0, (3, 4, 5), ("lora-a",)))
VECTORS: dict[str, dict[str, str]] = {
    "sha256": {
        "none": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "h0": "11222bda924e6f5b065e26e0d6fcf5ed3af84fad32aabe5aa2d440a7b89eed44",
        "h1": "f40bce77d241d4f954ba37260b948ee7b994c7efd12290dd283ddc41dd119e6a",
        "e0": "a707aa1b5cd7e0764adbb2b041050cedcff460a4509726ff2b60195c612d8166",
        "e1": "5a7fe0e3fe533865395f90f5b0b48bfaf75a305ea37c7a7a363b84190a7fb04d",
        "s0": "91629b0c572ef81e52633df65d5e91902bdbfd76c3927897afcf866beefb340b",
        "s1": "ac6320e67e0cb6bfc8535ada75f3af5cdb9bc14dd88a1f6ebd159f0182d6206c",
    },
    "sha256_cbor": {
        "none": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "h0": "de53cd63287368d9f8dccd26856a766f5b9ac89ada1ee1f4be519c879cc7b6e3",
        "h1": "80b5eceedc1d2a533ed2ccc00db48f88e07c10290d3369f9573c0bd1b0a81a55",
        "e0": "e4091c4d81bf6a1626ba1e61de3818490e2ed2d075ca3b78e12fb43cf81794db",
        "e1": "b319c209de2ef625b6de8e1ecd833bf2401697d5de1c7efe6a6757622638a1cc",
        "s0": "6a5a56f6c0eccac3ad3a578cd0171cb153494b616192931018731eb7f9c370de",
        "s1": "13e15f8118823c6e3b56104ff88caf9128f3963e2f22c65154c88b322dc7c2c9",
    },
    "xxhash": {
        "none": "d98f72b9c430d985211489af307f0229",
        "h0": "a649f264fc40aef238ffefe5b2f123c9",
        "h1": "c37ebf4cde7d831209879171cf952312",
        "e0": "989b7bf48377c38ca3fd8dc7ca3b8d63",
        "e1": "6f1744a2cb396e7f82910e2c41b7d5da",
        "s0": "fafe247b4e0d0352e618a1b48376d29a",
        "s1": "e0945d9793ef9f7704a480bb22806726",
    },
    "xxhash_cbor": {
        "none": "a4e364baa0791a6f63bbf917db9b700d",
        "h0": "100ae5440f1f938ac088a27d4dd40609",
        "h1": "8ed88d8e08ede6eef1e7417e12ad9096",
        "e0": "b67a3bf239d0d9d853168fee34b00136",
        "e1": "29fb9d30ea1b8f510af312f12375d28a",
        "s0": "9e1b09712edb924d961dd61e50cf807c",
        "s1": "89b71bd447165af7e0e86e70dc75a95b",
    },
}

# Prints the same vectors, computed through kvservice, as JSON (run in a subprocess).
_VECTOR_SCRIPT = """
import json
from kvservice.core.block_hashing import BlockHasher, MultiModalFeature
from kvservice.core.request import Request
out = {}
for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
    hasher = BlockHasher(3, algo, "vllm-none-hash")
    plain = Request("p", list(range(6)), hasher)
    mm = Request("m", list(range(6)), hasher, mm_features=[
        MultiModalFeature("hash1", 0, 3), MultiModalFeature("hash2", 3, 3)])
    salted = Request("s", list(range(6)), hasher, lora_name="lora-a", cache_salt="salt")
    out[algo] = {
        "none": hasher.none_hash.hex(),
        "h0": plain.block_hashes[0].hex(), "h1": plain.block_hashes[1].hex(),
        "e0": mm.block_hashes[0].hex(), "e1": mm.block_hashes[1].hex(),
        "s0": salted.block_hashes[0].hex(), "s1": salted.block_hashes[1].hex(),
    }
out["default_sha256_none"] = BlockHasher(3, "sha256").none_hash.hex()
print(json.dumps(out))
"""


def bare_request(
    num_tokens: int,
    mm: list[MultiModalFeature] | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> Request:
    """A request without a hasher, for calling the extra-key functions directly."""
    return Request(
        "r",
        list(range(num_tokens)),
        mm_features=mm or [],
        cache_salt=cache_salt,
        lora_name=lora_name,
    )


class TestExtraKeys:
    def test_multimodal_keys(self) -> None:
        """U14: mm keys are (identifier, offset - block_start) and the next index
        advances past items that end inside the block."""
        req = bare_request(
            20, [MultiModalFeature("hash1", 0, 5), MultiModalFeature("hash2", 10, 5)]
        )
        assert generate_block_hash_extra_keys(req, 0, 5, 0) == ((("hash1", 0),), 1)
        assert generate_block_hash_extra_keys(req, 3, 8, 0) == ((("hash1", -3),), 1)
        assert generate_block_hash_extra_keys(req, 6, 10, 0) == (None, 1)
        assert generate_block_hash_extra_keys(req, 0, 15, 0) == (
            (("hash1", 0), ("hash2", 10)),
            2,
        )

    def test_item_spanning_blocks_keeps_index(self) -> None:
        """An item that continues past the block end is keyed but not passed."""
        req = bare_request(20, [MultiModalFeature("img", 2, 10)])
        assert generate_block_hash_extra_keys(req, 0, 4, 0) == ((("img", 2),), 0)
        assert generate_block_hash_extra_keys(req, 4, 8, 0) == ((("img", -2),), 0)
        assert generate_block_hash_extra_keys(req, 8, 12, 0) == ((("img", -6),), 1)

    def test_no_mm_inputs(self) -> None:
        """U15: a plain request has no extra keys and the index stays 0."""
        req = bare_request(20)
        assert generate_block_hash_extra_keys(req, 0, 5, 0) == (None, 0)

    def test_cache_salt(self) -> None:
        """U16: the salt keys only the block that starts at token 0, after mm keys."""
        req = bare_request(20, cache_salt="salt")
        assert generate_block_hash_extra_keys(req, 0, 1, 0) == (("salt",), 0)
        assert generate_block_hash_extra_keys(req, 0, 10, 0) == (("salt",), 0)
        assert generate_block_hash_extra_keys(req, 1, 2, 0) == (None, 0)
        assert generate_block_hash_extra_keys(req, 6, 10, 0) == (None, 0)

        with_mm = bare_request(20, [MultiModalFeature("hash1", 0, 5)], cache_salt="salt")
        assert generate_block_hash_extra_keys(with_mm, 0, 5, 0) == ((("hash1", 0), "salt"), 1)

    def test_lora(self) -> None:
        """U20 (newest): the LoRA key is the adapter name; without LoRA there is none."""
        req = bare_request(20, lora_name="test_lora_adapter")
        assert generate_block_hash_extra_keys(req, 0, 5, 0) == (("test_lora_adapter",), 0)
        assert generate_block_hash_extra_keys(req, 5, 10, 0) == (("test_lora_adapter",), 0)
        assert generate_block_hash_extra_keys(bare_request(20), 0, 5, 0) == (None, 0)

    def test_key_order_lora_mm_salt(self) -> None:
        """Keys concatenate as LoRA name, then mm keys, then the salt."""
        req = bare_request(
            8, [MultiModalFeature("pic", 1, 2)], cache_salt="pepper", lora_name="adapter"
        )
        assert generate_block_hash_extra_keys(req, 0, 4, 0) == (
            ("adapter", ("pic", 1), "pepper"),
            1,
        )


class TestHashFunctions:
    @pytest.mark.parametrize("algo", ALGOS)
    def test_hash_block_tokens(self, algo: str) -> None:
        """U21: a block hash is fn((parent, tuple(tokens), extra_keys))."""
        fn = get_hash_fn_by_name(algo)
        ref = REF_HASH_FNS[algo]
        got = hash_block_tokens(fn, b"123", [1, 2, 3], ("key1", "key2"), b"seed")
        assert got == ref((b"123", (1, 2, 3), ("key1", "key2")))

    @pytest.mark.parametrize("algo", ALGOS)
    def test_missing_parent_uses_none_hash(self, algo: str) -> None:
        """A block without a parent is chained on the none hash."""
        fn = get_hash_fn_by_name(algo)
        ref = REF_HASH_FNS[algo]
        got = hash_block_tokens(fn, None, (7, 8), None, b"the-none-hash")
        assert got == ref((b"the-none-hash", (7, 8), None))

    @pytest.mark.parametrize(
        ("algo", "digest_size"),
        [("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16), ("xxhash_cbor", 16)],
    )
    def test_digest_sizes(self, algo: str, digest_size: int) -> None:
        """SHA-256 variants give 32 bytes, xxh3-128 variants 16 bytes."""
        assert len(get_hash_fn_by_name(algo)(("x", 1))) == digest_size

    def test_registry_names(self) -> None:
        """Exactly the four vLLM hash functions are registered."""
        assert sorted(HASH_FUNCTIONS) == sorted(ALGOS)

    def test_unknown_hash_function(self) -> None:
        """An unknown hash name is an invalid argument (a ValueError)."""
        with pytest.raises(InvalidArgumentError, match="Unsupported hash function"):
            get_hash_fn_by_name("builtin")
        with pytest.raises(ValueError):
            BlockHasher(16, "sha256_64bit")


class TestHashVectors:
    @pytest.mark.parametrize("algo", ALGOS)
    def test_none_hash_literal(self, algo: str) -> None:
        """NONE_HASH of the default seed matches the literal digest."""
        hasher = BlockHasher(3, algo, DEFAULT_SEED)
        assert hasher.none_hash.hex() == VECTORS[algo]["none"]

    @pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
    def test_crypto_default_seed_is_fixed(self, algo: str) -> None:
        """For SHA-256 variants the default chain seed is "vllm-none-hash"."""
        assert BlockHasher(3, algo).none_hash.hex() == VECTORS[algo]["none"]
        assert BlockHasher(3, algo).none_hash == BlockHasher(3, algo).none_hash

    @pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
    def test_xxhash_default_seed_is_random(self, algo: str) -> None:
        """For xxhash variants the default seed is random per hasher, never the fixed
        string."""
        first, second = BlockHasher(3, algo), BlockHasher(3, algo)
        assert first.none_hash != second.none_hash
        assert VECTORS[algo]["none"] not in (first.none_hash.hex(), second.none_hash.hex())

    @pytest.mark.parametrize("algo", ALGOS)
    def test_chained_hashes_without_extra_keys(self, algo: str) -> None:
        """U24: tokens 0..5, block size 3: h0 and h1 match the literal digests."""
        req = Request("r", list(range(6)), BlockHasher(3, algo, DEFAULT_SEED))
        assert [h.hex() for h in req.block_hashes] == [VECTORS[algo]["h0"], VECTORS[algo]["h1"]]

    @pytest.mark.parametrize("algo", ALGOS)
    def test_chained_hashes_with_mm_keys(self, algo: str) -> None:
        """U22: with mm items (0,3,"hash1") and (3,3,"hash2") the two hashes match the
        literal digests."""
        mm = [MultiModalFeature("hash1", 0, 3), MultiModalFeature("hash2", 3, 3)]
        req = Request("r", list(range(6)), BlockHasher(3, algo, DEFAULT_SEED), mm_features=mm)
        assert [h.hex() for h in req.block_hashes] == [VECTORS[algo]["e0"], VECTORS[algo]["e1"]]
        assert req.block_extra_keys == [(("hash1", 0),), (("hash2", 0),)]

    @pytest.mark.parametrize("algo", ALGOS)
    def test_chained_hashes_with_lora_and_salt(self, algo: str) -> None:
        """LoRA name on every block, salt on block 0 only: both hashes match the
        literal digests."""
        req = Request(
            "r",
            list(range(6)),
            BlockHasher(3, algo, DEFAULT_SEED),
            lora_name="lora-a",
            cache_salt="salt",
        )
        assert [h.hex() for h in req.block_hashes] == [VECTORS[algo]["s0"], VECTORS[algo]["s1"]]

    @pytest.mark.parametrize("algo", ALGOS)
    def test_vectors_match_reference_functions(self, algo: str) -> None:
        """The literal digests agree with the reference functions in this test suite."""
        ref = REF_HASH_FNS[algo]
        none = ref(DEFAULT_SEED)
        h0 = ref((none, (0, 1, 2), None))
        assert (none.hex(), h0.hex()) == (VECTORS[algo]["none"], VECTORS[algo]["h0"])
        assert ref((h0, (3, 4, 5), None)).hex() == VECTORS[algo]["h1"]

    def test_different_mm_identifier_changes_every_hash(self) -> None:
        """U23: a different first mm identifier changes both chained block hashes."""
        hasher = BlockHasher(3, "sha256")
        a = Request(
            "a",
            list(range(6)),
            hasher,
            mm_features=[MultiModalFeature("hash1", 0, 3), MultiModalFeature("hash2", 3, 3)],
        )
        b = Request(
            "b",
            list(range(6)),
            hasher,
            mm_features=[MultiModalFeature("hash3", 0, 3), MultiModalFeature("hash2", 3, 3)],
        )
        assert len(a.block_hashes) == len(b.block_hashes) == 2
        assert a.block_hashes[0] != b.block_hashes[0]
        assert a.block_hashes[1] != b.block_hashes[1]

    def test_pythonhashseed_is_not_consulted_in_process(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Setting PYTHONHASHSEED does not change the default sha256 chain seed."""
        monkeypatch.setenv("PYTHONHASHSEED", "python hash seed")
        assert BlockHasher(3, "sha256").none_hash.hex() == VECTORS["sha256"]["none"]

    @pytest.mark.parametrize("seed", ["0", "4242"])
    def test_hashes_independent_of_pythonhashseed(self, seed: str) -> None:
        """A process with another PYTHONHASHSEED computes the same literal digests."""
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _VECTOR_SCRIPT],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO_ROOT,
            check=True,
            timeout=60,
        )
        out: dict[str, Any] = json.loads(proc.stdout)
        for algo in ALGOS:
            assert out[algo] == VECTORS[algo]
        assert out["default_sha256_none"] == VECTORS["sha256"]["none"]


class TestIncrementalHashing:
    def test_hashes_grow_as_blocks_fill(self) -> None:
        """Only full blocks are hashed; appended output tokens hash the block they
        complete, chained on the prompt's hashes."""
        hasher = BlockHasher(4, "sha256")
        req = Request("r", [1, 2, 3, 4, 5, 6], hasher)
        assert len(req.block_hashes) == 1
        req.append_output_token_ids(7)
        assert len(req.block_hashes) == 1
        req.append_output_token_ids([8, 9])
        assert len(req.block_hashes) == 2
        none = ref_sha256(DEFAULT_SEED)
        h0 = ref_sha256((none, (1, 2, 3, 4), None))
        assert req.block_hashes == [h0, ref_sha256((h0, (5, 6, 7, 8), None))]

    def test_request_without_hasher_has_no_hashes(self) -> None:
        """A request built without a hasher never gets block hashes."""
        req = Request("r", list(range(32)))
        req.append_output_token_ids([1, 2, 3])
        assert req.block_hashes == []


MM_PROMPT = [
    *range(10),
    *[-1] * 6,
    *[-1] * 4,
    *range(10, 20),
    *[-1] * 2,
    *[-1] * 16,
]


class TestManagerHashing:
    def test_mm_prefix_caching(self) -> None:
        """18: mm items key each block by (identifier, offset - block start); a second
        request with the same images hits the three full blocks."""
        m = make_manager(11)
        mm = [
            MultiModalFeature("aaa", 11, 10),
            MultiModalFeature("bbb", 30, 18),
            MultiModalFeature("ccc", 48, 7),
        ]
        prompt = [*MM_PROMPT, *[-1] * 7, *[100] * 4]
        assert len(prompt) == 59
        req0 = m.new_request("0", prompt, mm_features=mm)

        none = ref_sha256(DEFAULT_SEED)
        h0 = ref_sha256((none, tuple(prompt[0:16]), (("aaa", 11),)))
        h1 = ref_sha256((h0, tuple(prompt[16:32]), (("aaa", -5), ("bbb", 14))))
        h2 = ref_sha256((h1, tuple(prompt[32:48]), (("bbb", -2),)))
        assert req0.block_hashes == [h0, h1, h2]

        hit, num_hit, new = prefill(m, req0)
        assert (num_hit, ids(hit), ids(new)) == (0, ([],), ([1, 2, 3, 4],))
        for block_id, h in zip((1, 2, 3), (h0, h1, h2), strict=True):
            assert m.block_pool.blocks[block_id].block_hash == make_block_hash_with_group_id(h, 0)

        req0.append_output_token_ids([8] * 5)
        new = m.allocate_slots(req0, 5)
        assert ids(new) == ([],)
        req0.num_computed_tokens += 5
        check_invariants(m)
        h3 = ref_sha256((h2, (*prompt[48:], *[8] * 5), (("ccc", 0),)))
        assert req0.block_hashes == [h0, h1, h2, h3]
        assert m.block_pool.blocks[4].block_hash == make_block_hash_with_group_id(h3, 0)

        req1 = m.new_request("1", [*MM_PROMPT, *[-1] * 7, *[200] * 5], mm_features=mm)
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert (ids(hit), num_hit) == (([1, 2, 3],), 48)

    def test_same_tokens_other_image_miss(self) -> None:
        """A request with the same tokens but another image identifier gets no hit."""
        m = make_manager(11)
        prompt = [*MM_PROMPT, 5]
        prefill(m, m.new_request("0", prompt, mm_features=[MultiModalFeature("aaa", 11, 10)]))
        other = m.new_request("1", prompt, mm_features=[MultiModalFeature("zzz", 11, 10)])
        _, num_hit, _ = m.get_computed_blocks(other)
        assert num_hit == 0

    def test_cache_key_salting(self) -> None:
        """19: the salt keys only block 0; the same salt hits, another salt misses."""
        m = make_manager(11)
        prompt = [*tokens((0, 16), (1, 16), (2, 16)), *[3] * 11]
        req0 = m.new_request("0", prompt, cache_salt="salt1")
        none = ref_sha256(DEFAULT_SEED)
        h0 = ref_sha256((none, tuple(prompt[0:16]), ("salt1",)))
        h1 = ref_sha256((h0, tuple(prompt[16:32]), None))
        h2 = ref_sha256((h1, tuple(prompt[32:48]), None))
        assert req0.block_hashes == [h0, h1, h2]

        _, _, new = prefill(m, req0)
        assert ids(new) == ([1, 2, 3, 4],)
        req0.append_output_token_ids([8] * 5)
        assert ids(m.allocate_slots(req0, 5)) == ([],)
        check_invariants(m)
        h3 = ref_sha256((h2, (*prompt[48:], *[8] * 5), None))
        assert req0.block_hashes[3] == h3

        same = m.new_request("1", [*prompt[:48], *[9] * 5], cache_salt="salt1")
        hit, num_hit, _ = m.get_computed_blocks(same)
        assert (ids(hit), num_hit) == (([1, 2, 3],), 48)

        other = m.new_request("2", [*prompt[:48], *[9] * 5], cache_salt="salt2")
        hit, num_hit, _ = m.get_computed_blocks(other)
        assert (ids(hit), num_hit) == (([],), 0)
        assert other.block_hashes[0] == ref_sha256((none, tuple(prompt[0:16]), ("salt2",)))

    @pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
    def test_manager_uses_its_hash_function(self, algo: str) -> None:
        """Requests made by a manager are hashed with its hash function and block size."""
        m = make_manager(11, hash_algo=algo)
        req = m.new_request("r", list(range(40)))
        ref = REF_HASH_FNS[algo]
        none = ref(DEFAULT_SEED)
        h0 = ref((none, tuple(range(16)), None))
        assert req.block_hashes == [h0, ref((h0, tuple(range(16, 32)), None))]

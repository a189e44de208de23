"""Block hashing: extra keys, chained hashes, literal vectors and the manager's use of
them (catalogue U14-U16, U20-U24, 18, 19)."""

from __future__ import annotations

import hashlib
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
    first_mm_index,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    get_mm_features_in_window,
    hash_block_tokens,
    resolve_none_hash_seed,
    to_event_extra_keys,
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
# cbor2 (canonical) / xxhash.xxh3_128_digest directly, and checked against vLLM 0.33.0's
# request block hasher (tagged extra keys; L = ("lora", "lora-a", "/adapters/lora-a")):
#   none = fn("vllm-none-hash")
#   h0 = fn((none, (0, 1, 2), None));  h1 = fn((h0, (3, 4, 5), None))
#   e0 = fn((none, (0, 1, 2), (("mm", "hash1", 0),)))
#   e1 = fn((e0, (3, 4, 5), (("mm", "hash2", 0),)))
#   s0 = fn((none, (0, 1, 2), (L, ("cache_salt", "salt"))));  s1 = fn((s0, (3, 4, 5), (L,)))
VECTORS: dict[str, dict[str, str]] = {
    "sha256": {
        "none": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "h0": "11222bda924e6f5b065e26e0d6fcf5ed3af84fad32aabe5aa2d440a7b89eed44",
        "h1": "f40bce77d241d4f954ba37260b948ee7b994c7efd12290dd283ddc41dd119e6a",
        "e0": "c6c1204412e3fb544c246f99e628071e6d123bbc38ad6e97987ed2cca63b4508",
        "e1": "8f198c38cd73a784cb1655eb41eaffd1b7304ecac3a5495bc8d988a6d1ceec0f",
        "s0": "20ec992e669754722faca208776175b1ac2ee1abbc8a7008f9c21b1bf434b681",
        "s1": "9c81d50ab40a9a7146e908d256541db93652d69c38e517ef0a90a9942bb4aa57",
    },
    "sha256_cbor": {
        "none": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "h0": "de53cd63287368d9f8dccd26856a766f5b9ac89ada1ee1f4be519c879cc7b6e3",
        "h1": "80b5eceedc1d2a533ed2ccc00db48f88e07c10290d3369f9573c0bd1b0a81a55",
        "e0": "960e9441934aacb5fc9b4fcd9fc88e09753fba754c23237db01dbd447abf2a3e",
        "e1": "ddab5796c677ebd328b6a3edc79d38a5e96dabe2f36d3259b28a590d4b117220",
        "s0": "76bf09fb8cf434cb8cc5104ab24a87753eb8950195edf30427c4d26f07a401aa",
        "s1": "26cb049355f62922c30831b8c7b899d607f860e77c562677eabda47dc9fc5c6a",
    },
    "xxhash": {
        "none": "d98f72b9c430d985211489af307f0229",
        "h0": "a649f264fc40aef238ffefe5b2f123c9",
        "h1": "c37ebf4cde7d831209879171cf952312",
        "e0": "c627b067f729f33f3b2186fbf000d30d",
        "e1": "53e9cbfff23857e91c94287ffe71e941",
        "s0": "d14d300492867759d4608b5c7ffab51e",
        "s1": "7f271b3dfe03d685d16ee70c1cf82183",
    },
    "xxhash_cbor": {
        "none": "a4e364baa0791a6f63bbf917db9b700d",
        "h0": "100ae5440f1f938ac088a27d4dd40609",
        "h1": "8ed88d8e08ede6eef1e7417e12ad9096",
        "e0": "715dfdf2b2d486f4ae870d5df61629fd",
        "e1": "ba92d55a1a31ad58891ab46da125eead",
        "s0": "558f5f6c9ad6b94ac3b6926ad2767438",
        "s1": "9998eb94af5cff47f1e0033c142fabf4",
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
    salted = Request(
        "s", list(range(6)), hasher, lora_name="lora-a", lora_path="/adapters/lora-a",
        cache_salt="salt")
    out[algo] = {
        "none": hasher.none_hash.hex(),
        "h0": plain.block_hashes[0].hex(), "h1": plain.block_hashes[1].hex(),
        "e0": mm.block_hashes[0].hex(), "e1": mm.block_hashes[1].hex(),
        "s0": salted.block_hashes[0].hex(), "s1": salted.block_hashes[1].hex(),
    }
out["default_seed"] = BlockHasher(3, "sha256").none_hash_seed
print(json.dumps(out))
"""


def bare_request(
    num_tokens: int,
    mm: list[MultiModalFeature] | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
) -> Request:
    """A request without a hasher, for calling the extra-key functions directly."""
    return Request(
        "r",
        list(range(num_tokens)),
        mm_features=mm or [],
        cache_salt=cache_salt,
        lora_name=lora_name,
        lora_path=lora_path,
    )


class TestExtraKeys:
    def test_multimodal_keys(self) -> None:
        """U14: mm keys are ("mm", identifier, offset - block_start) and the next index
        advances past items that end inside the block."""
        req = bare_request(
            20, [MultiModalFeature("hash1", 0, 5), MultiModalFeature("hash2", 10, 5)]
        )
        assert generate_block_hash_extra_keys(req, 0, 5, 0) == ((("mm", "hash1", 0),), 1)
        assert generate_block_hash_extra_keys(req, 3, 8, 0) == ((("mm", "hash1", -3),), 1)
        assert generate_block_hash_extra_keys(req, 6, 10, 0) == (None, 1)
        assert generate_block_hash_extra_keys(req, 0, 15, 0) == (
            (("mm", "hash1", 0), ("mm", "hash2", 10)),
            2,
        )

    def test_item_spanning_blocks_keeps_index(self) -> None:
        """An item that continues past the block end is keyed but not passed."""
        req = bare_request(20, [MultiModalFeature("img", 2, 10)])
        assert generate_block_hash_extra_keys(req, 0, 4, 0) == ((("mm", "img", 2),), 0)
        assert generate_block_hash_extra_keys(req, 4, 8, 0) == ((("mm", "img", -2),), 0)
        assert generate_block_hash_extra_keys(req, 8, 12, 0) == ((("mm", "img", -6),), 1)

    def test_block_starting_where_an_item_ends_is_not_keyed(self) -> None:
        """>= comparisons: a block that starts exactly at an item's end has passed it,
        and the last item ending at the block start needs no scan at all."""
        req = bare_request(20, [MultiModalFeature("a", 0, 4), MultiModalFeature("b", 4, 4)])
        assert generate_block_hash_extra_keys(req, 4, 8, 0) == ((("mm", "b", 0),), 2)
        assert generate_block_hash_extra_keys(req, 8, 12, 0) == (None, 0)

    def test_window_starts_at_the_first_overlapping_item(self) -> None:
        """A block hashed after the prompt (once output tokens complete it) starts its
        scan at the first item overlapping it (vLLM's get_mm_features_in_window), not
        at the last item: both items of the block [8, 16) are keyed."""
        features = [MultiModalFeature("a", 6, 4), MultiModalFeature("b", 12, 2)]
        assert get_mm_features_in_window(features, 8, 16) == (0, 2)
        assert get_mm_features_in_window(features, 10, 12) == (1, 1)
        assert first_mm_index(features, 8, 16) == 0
        assert first_mm_index(features, 10, 16) == 1
        assert first_mm_index(features, 14, 16) == 0  # every item ended: no scan
        hasher = BlockHasher(8, "sha256")
        req = Request("r", list(range(14)), hasher, mm_features=features)
        req.append_output_token_ids([14, 15])
        h0 = ref_sha256((hasher.none_hash, tuple(range(8)), (("mm", "a", 6),)))
        keys = (("mm", "a", -2), ("mm", "b", 4))
        assert req.block_hashes == [h0, ref_sha256((h0, tuple(range(8, 16)), keys))]

    def test_no_mm_inputs(self) -> None:
        """U15: a plain request has no extra keys and the index stays 0."""
        req = bare_request(20)
        assert generate_block_hash_extra_keys(req, 0, 5, 0) == (None, 0)

    def test_cache_salt(self) -> None:
        """U16: the salt keys only the block that starts at token 0, after mm keys."""
        req = bare_request(20, cache_salt="salt")
        salt = ("cache_salt", "salt")
        assert generate_block_hash_extra_keys(req, 0, 1, 0) == ((salt,), 0)
        assert generate_block_hash_extra_keys(req, 0, 10, 0) == ((salt,), 0)
        assert generate_block_hash_extra_keys(req, 1, 2, 0) == (None, 0)
        assert generate_block_hash_extra_keys(req, 6, 10, 0) == (None, 0)

        with_mm = bare_request(20, [MultiModalFeature("hash1", 0, 5)], cache_salt="salt")
        assert generate_block_hash_extra_keys(with_mm, 0, 5, 0) == (
            (("mm", "hash1", 0), salt),
            1,
        )

    def test_lora(self) -> None:
        """U20: the LoRA key is ("lora", name, path) on every block; without LoRA there
        is none."""
        req = bare_request(20, lora_name="adapter", lora_path="/adapters/a")
        lora = ("lora", "adapter", "/adapters/a")
        assert generate_block_hash_extra_keys(req, 0, 5, 0) == ((lora,), 0)
        assert generate_block_hash_extra_keys(req, 5, 10, 0) == ((lora,), 0)
        assert generate_block_hash_extra_keys(bare_request(20), 0, 5, 0) == (None, 0)

    def test_key_order_lora_mm_salt_embeds(self) -> None:
        """Keys concatenate as LoRA, mm items, salt, then the prompt embeddings' digest
        (SHA-256 of the rows of the window)."""
        embeds = bytes(range(32))  # 8 prompt tokens, 4 bytes each
        req = Request(
            "r",
            list(range(8)),
            mm_features=[MultiModalFeature("pic", 1, 2)],
            cache_salt="pepper",
            lora_name="adapter",
            lora_path="/a",
            prompt_embeds=embeds,
        )
        assert generate_block_hash_extra_keys(req, 0, 4, 0) == (
            (
                ("lora", "adapter", "/a"),
                ("mm", "pic", 1),
                ("cache_salt", "pepper"),
                ("prompt_embeds", hashlib.sha256(embeds[:16]).digest()),
            ),
            1,
        )
        # Past the prompt the window holds no rows: the digest of nothing.
        keys, _ = generate_block_hash_extra_keys(req, 8, 12, 1)
        assert keys == (("lora", "adapter", "/a"), ("prompt_embeds", hashlib.sha256().digest()))

    def test_embeddings_must_split_into_one_row_per_token(self) -> None:
        with pytest.raises(InvalidArgumentError, match="one row per prompt token"):
            Request("r", [1, 2, 3], prompt_embeds=bytes(10))

    def test_salt_equal_to_lora_name_keys_differently(self) -> None:
        """Tagged keys: a salt equal to another request's LoRA name gives other hashes
        (untagged, both blocks would be keyed ("x",) and hit each other)."""
        hasher = BlockHasher(4, "sha256")
        salted = Request("s", list(range(4)), hasher, cache_salt="x")
        lora = Request("l", list(range(4)), hasher, lora_name="x", lora_path="/x")
        assert salted.block_hashes != lora.block_hashes

    def test_lora_path_is_part_of_the_key(self) -> None:
        """One LoRA name re-pointed at another adapter path hashes differently."""
        hasher = BlockHasher(4, "sha256")
        v1 = Request("1", list(range(4)), hasher, lora_name="a", lora_path="/a/v1")
        v2 = Request("2", list(range(4)), hasher, lora_name="a", lora_path="/a/v2")
        assert v1.block_hashes != v2.block_hashes

    def test_event_form_is_untagged(self) -> None:
        """KV events publish the pre-tagging shapes: (identifier, offset) for an mm
        key, the bare value otherwise; None entries stay None."""
        keys = (
            ("lora", "a", "/p"),
            ("mm", "img", -3),
            ("cache_salt", "s"),
            ("prompt_embeds", b"d"),
        )
        assert to_event_extra_keys([keys, None]) == [("a", ("img", -3), "s", b"d"), None]
        assert to_event_extra_keys([]) is None


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

    @pytest.mark.parametrize("algo", ALGOS)
    def test_chained_hashes_with_lora_and_salt(self, algo: str) -> None:
        """LoRA name and path on every block, salt on block 0 only: both hashes match
        the literal digests."""
        req = Request(
            "r",
            list(range(6)),
            BlockHasher(3, algo, DEFAULT_SEED),
            lora_name="lora-a",
            lora_path="/adapters/lora-a",
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

    @pytest.mark.parametrize("algo", ALGOS)
    def test_pythonhashseed_sets_the_chain_seed(
        self, algo: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As vLLM's resolve_none_hash_seed: PYTHONHASHSEED, when set, is the seed for
        every hash function, so processes started with one seed share a prefix cache;
        an explicit seed still wins over it."""
        monkeypatch.setenv("PYTHONHASHSEED", "4242")
        hasher = BlockHasher(3, algo)
        assert hasher.none_hash_seed == "4242"
        assert hasher.none_hash == REF_HASH_FNS[algo]("4242")
        assert BlockHasher(3, algo).none_hash == hasher.none_hash
        assert BlockHasher(3, algo, DEFAULT_SEED).none_hash.hex() == VECTORS[algo]["none"]

    def test_without_pythonhashseed_the_defaults_apply(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Unset: the fixed seed for SHA-256, a fresh random one for xxhash."""
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        assert resolve_none_hash_seed("sha256_cbor") == DEFAULT_SEED
        first, second = resolve_none_hash_seed("xxhash"), resolve_none_hash_seed("xxhash")
        assert first != second and len(first) == 64
        assert resolve_none_hash_seed("xxhash", "mine") == "mine"

    @pytest.mark.parametrize("seed", ["0", "4242"])
    def test_hashes_independent_of_python_hash_randomization(self, seed: str) -> None:
        """A process with another PYTHONHASHSEED (so another str/bytes hash
        randomization) computes the same literal digests from the same chain seed, and
        its default seed is that PYTHONHASHSEED."""
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
        assert out["default_seed"] == seed


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
        h0 = ref_sha256((none, tuple(prompt[0:16]), (("mm", "aaa", 11),)))
        h1 = ref_sha256((h0, tuple(prompt[16:32]), (("mm", "aaa", -5), ("mm", "bbb", 14))))
        h2 = ref_sha256((h1, tuple(prompt[32:48]), (("mm", "bbb", -2),)))
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
        h3 = ref_sha256((h2, (*prompt[48:], *[8] * 5), (("mm", "ccc", 0),)))
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
        h0 = ref_sha256((none, tuple(prompt[0:16]), (("cache_salt", "salt1"),)))
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
        salt2 = (("cache_salt", "salt2"),)
        assert other.block_hashes[0] == ref_sha256((none, tuple(prompt[0:16]), salt2))

    @pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
    def test_manager_uses_its_hash_function(self, algo: str) -> None:
        """Requests made by a manager are hashed with its hash function and block size."""
        m = make_manager(11, hash_algo=algo)
        req = m.new_request("r", list(range(40)))
        ref = REF_HASH_FNS[algo]
        none = ref(DEFAULT_SEED)
        h0 = ref((none, tuple(range(16)), None))
        assert req.block_hashes == [h0, ref((h0, tuple(range(16, 32)), None))]

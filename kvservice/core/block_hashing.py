"""Prefix-cache block hashes, byte-identical to vLLM 0.33.

A block's hash covers ``(parent_hash, token_ids, extra_keys)``: chaining the parent in
makes one lookup per block enough to prove the whole prefix matches. The chain starts
from ``NONE_HASH = hash_fn(seed)``. Extra keys keep blocks with equal tokens apart when
their meaning differs, each tagged by its kind so that equal strings of different kinds
never collide: ``("lora", name, path)`` on every block of a LoRA request,
``("mm", identifier, offset)`` per multimodal item overlapping the block (offset
relative to the block start), ``("cache_salt", salt)`` on the first block only (it
poisons every later hash through the chain) and ``("prompt_embeds", digest)`` of the
block's prompt embeddings.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import pickle
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import cbor2
import xxhash

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_block import BlockHash

if TYPE_CHECKING:
    from kvservice.core.request import Request

HashFn = Callable[[Any], bytes]
ExtraKeys = tuple[Any, ...] | None
# (parent, token ids: a list or an array of 4-byte ints, start, number of blocks, block
# size) -> the chained hashes, or None where the C code leaves a block to pickle (see
# _native_hashing.c).
NativeChain = Callable[[BlockHash, MutableSequence[int], int, int, int], "list[BlockHash] | None"]

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickled object (vLLM's default ``prefix_caching_hash_algo``)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of canonical CBOR: reproducible across languages and Python versions."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    """128-bit xxh3 of the pickled object (fast, not collision resistant)."""
    return bytes(xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))


def xxhash_cbor(obj: Any) -> bytes:
    """128-bit xxh3 of canonical CBOR."""
    return bytes(xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True)))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}
CRYPTOGRAPHIC_HASHES = frozenset({"sha256", "sha256_cbor"})


def native_chain(hash_algo: str) -> NativeChain | None:
    """``hash_algo``'s chain written in C (``_native_hashing.c``: pickle's or cbor2's
    bytes without either, OpenSSL's SHA-256 without a hashlib object), built with the
    compiled packages, for ``sha256`` and ``sha256_cbor``; None for the others, and
    where the sources run (``KVSERVICE_PURE_PYTHON=1``)."""
    try:
        from kvservice.core import _native_hashing  # noqa: PLC0415 (absent from the sources)
    except ImportError:
        return None
    if hash_algo == "sha256":
        return _native_hashing.sha256_pickle_chain
    if hash_algo == "sha256_cbor":
        return _native_hashing.sha256_cbor_chain
    return None


def get_hash_fn_by_name(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"Unsupported hash function: {name!r}; use one of {sorted(HASH_FUNCTIONS)}"
        ) from None


def resolve_none_hash_seed(hash_algo: str, none_hash_seed: str | None = None) -> str:
    """The seed ``NONE_HASH`` derives from, as vLLM's ``resolve_none_hash_seed``.

    ``PYTHONHASHSEED`` wins when set, so a pool and vLLM instances started the usual way
    for a shared prefix cache compute the same hashes. Otherwise the SHA variants use
    vLLM's fixed seed (``cache_salt`` is the isolation mechanism), and the
    non-cryptographic ones a random seed, since a known seed would let anyone craft
    xxhash collisions offline. An explicit ``none_hash_seed`` (kvservice's
    ``--none-hash-seed``) wins over all of these.
    """
    if none_hash_seed is not None:
        return none_hash_seed
    env_seed = os.environ.get("PYTHONHASHSEED")
    if env_seed is not None:
        return env_seed
    if hash_algo in CRYPTOGRAPHIC_HASHES:
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(32).hex()


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One multimodal item of a prompt: ``length`` placeholder tokens from ``offset``."""

    identifier: str
    offset: int
    length: int


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: ExtraKeys,
    none_hash: BlockHash,
) -> BlockHash:
    """Hash one full block, chained on its parent (``none_hash`` for the first block)."""
    if not parent_block_hash:
        parent_block_hash = none_hash
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def get_mm_features_in_window(
    features: Sequence[MultiModalFeature], start: int, end: int
) -> tuple[int, int]:
    """``(lo, hi)``: the indices of the items overlapping ``[start, end)``. Items are
    sorted by offset and do not overlap, so their ends are sorted too."""
    lo = bisect.bisect_left(features, start + 1, key=_feature_end)
    hi = bisect.bisect_left(features, end, key=_feature_offset)
    return lo, hi


def _feature_end(feature: MultiModalFeature) -> int:
    return feature.offset + feature.length


def _feature_offset(feature: MultiModalFeature) -> int:
    return feature.offset


def first_mm_index(features: Sequence[MultiModalFeature], start: int, end: int) -> int:
    """Where the multimodal scan of a window ``[start, end)`` begins: the first item
    overlapping it, when some item ends after ``start``; else 0."""
    if start > 0 and features and _feature_end(features[-1]) > start:
        return get_mm_features_in_window(features, start, end)[0]
    return 0


def _gen_mm_extra_hash_keys(
    features: Sequence[MultiModalFeature], start: int, end: int, start_mm_idx: int
) -> tuple[list[Any], int]:
    """``("mm", identifier, offset - start)`` for the items overlapping ``[start, end)``,
    and the index of the item the next block should start from."""
    keys: list[Any] = []
    if not features or _feature_end(features[-1]) <= start:
        return keys, start_mm_idx
    if start_mm_idx < 0:
        start_mm_idx += len(features)
    idx = start_mm_idx
    while idx < len(features):
        item = features[idx]
        if end <= item.offset:
            break  # the block has not reached this item
        if start >= item.offset + item.length:
            idx += 1  # the block has passed this item
            continue
        keys.append(("mm", item.identifier, item.offset - start))
        if end < item.offset + item.length:
            break  # the item goes on past this block
        idx += 1  # the block holds the item's end and may hold the next item
    return keys, idx


def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[ExtraKeys, int]:
    """Extra keys of the window ``[start_token_idx, end_token_idx)`` in vLLM's order
    (LoRA, multimodal items, cache salt, prompt embeddings), or None; and the
    multimodal index the next window starts from."""
    mm_keys, next_mm_idx = _gen_mm_extra_hash_keys(
        request.mm_features, start_token_idx, end_token_idx, start_mm_idx
    )
    keys: list[Any] = []
    if request.lora_name:
        keys.append(("lora", request.lora_name, request.lora_path))
    keys += mm_keys
    if start_token_idx == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    if request.prompt_embeds is not None:
        keys.append(("prompt_embeds", request.prompt_embeds_digest(start_token_idx, end_token_idx)))
    return (tuple(keys) if keys else None), next_mm_idx


# Blocks remembered by BlockHasher; about 6 MB when full. The memo pays where prompts
# share prefixes and blocks are pickled: `kvservice bench` (shared system prompt,
# in-process, 2,048 requests, 150 steps, 3 rounds) ran 390-404 steps/s with it, 330-346
# without (2 runs each). The C chain goes without it: 569-572 steps/s against 559-583
# for the memo and pickle, each tree in turn (3 runs each).
HASH_MEMO_CAPACITY: Final = 16384


def generate_lookahead_block_hash_extra_keys(
    request: Request,
    start_token_idx: int,
    end_token_idx: int,
    hash_end_token_idx: int,
    start_mm_idx: int,
) -> tuple[ExtraKeys, int]:
    """Extra keys of a block hashed with lookahead tokens: those of the window up to
    ``hash_end_token_idx`` (the block and the tokens after it); the multimodal index
    steps back to the first item the next block still overlaps."""
    keys, mm_idx = generate_block_hash_extra_keys(
        request, start_token_idx, hash_end_token_idx, start_mm_idx
    )
    features = request.mm_features
    while mm_idx > 0 and _feature_end(features[mm_idx - 1]) > end_token_idx:
        mm_idx -= 1
    return keys, mm_idx


def to_event_extra_keys(extra_keys: Iterable[ExtraKeys]) -> list[ExtraKeys] | None:
    """The per-block extra keys a ``BlockStored`` event publishes: untagged, in the
    shapes KV event consumers parse (an mm key becomes ``(identifier, offset)``, every
    other key its bare value); None without blocks."""
    event_keys = [
        None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
        for keys in extra_keys
    ]
    return event_keys or None


def _tokens_from(request: Request, start: int, end: int) -> tuple[list[int], int]:
    """Request tokens as a list that holds ``[start, end)``, and the index in the request
    of its first: a list request's own ids (sliced natively, no copy), or for a packed
    prompt (an array) those ids made ints once, which pickling makes of them anyway."""
    ids = request.all_token_ids
    if isinstance(ids, list):
        return ids, 0
    return list(ids[start:end]), start


class BlockHasher:
    """Computes a request's new full-block hashes as its tokens arrive.

    One per pool: ``hash_block_size`` tokens per hashed block, one hash function, one
    chain seed (``none_hash_seed``, resolved as ``resolve_none_hash_seed`` says).
    ``none_hash_seed_fingerprint`` lets a client check that it hashes the same way
    without the seed itself leaving the process.

    Blocks without extra keys or lookahead hashed with ``sha256`` (vLLM's default) or
    ``sha256_cbor`` go to the C chain when the build has it (``native_chain``: bench_core's
    admission-heavy requests hash in under a third of the time). Otherwise it
    remembers the hashes of recent blocks, keyed by exactly what was hashed (parent
    hash, token ids, extra keys), so requests that share a prefix (a system prompt, the
    earlier turns of a chat) hash its blocks once. Token ids are ints: equal keys
    pickle to equal bytes, so a remembered hash is the hash. A request stops looking at
    its first miss: every later block's parent is then a hash never seen before.
    """

    def __init__(
        self,
        hash_block_size: int,
        hash_algo: str = "sha256",
        none_hash_seed: str | None = None,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        if hash_block_size <= 0:
            raise InvalidArgumentError(f"hash_block_size must be positive, got {hash_block_size}")
        if num_hash_lookahead_tokens < 0:
            raise InvalidArgumentError(
                f"num_hash_lookahead_tokens must be >= 0, got {num_hash_lookahead_tokens}"
            )
        self.hash_block_size = hash_block_size
        # vLLM 0.33's lookahead block hashes (an EAGLE drafter's default): each hash also
        # covers the tokens after its block, so it exists only once they do.
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.hash_algo = hash_algo
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        self.none_hash_seed = resolve_none_hash_seed(hash_algo, none_hash_seed)
        self.none_hash: BlockHash = self.hash_fn(self.none_hash_seed)
        seed_digest = hashlib.sha256(self.none_hash_seed.encode()).hexdigest()
        self.none_hash_seed_fingerprint = seed_digest[:16]
        self._memo: dict[tuple[BlockHash, tuple[int, ...], ExtraKeys], BlockHash] = {}
        self.native_chain = native_chain(hash_algo)

    def __call__(self, request: Request) -> list[BlockHash]:
        """Hashes of the full blocks not yet in ``request.block_hashes``."""
        bs = self.hash_block_size
        lookahead = self.num_hash_lookahead_tokens
        hashes = request.block_hashes
        start = len(hashes) * bs
        num_tokens = request.num_tokens - lookahead
        new_hashes: list[BlockHash] = []
        if start + bs > num_tokens:
            return new_hashes
        parent = hashes[-1] if hashes else None
        plain = not request.has_extra_keys
        if plain and not lookahead and self.native_chain is not None:
            # A packed prompt (an array) is read in place: no Python int per id.
            chained = self.native_chain(
                parent or self.none_hash,
                request.all_token_ids,
                start,
                (num_tokens - start) // bs,
                bs,
            )
            if chained is not None:
                return chained
        mm_idx = first_mm_index(request.mm_features, start, start + bs)
        tokens, first = _tokens_from(request, start, num_tokens)
        hash_fn, memo = self.hash_fn, self._memo
        looking = True  # until a block is not remembered: each later parent is then new
        while start + bs <= num_tokens:
            keys: ExtraKeys = None
            if lookahead:
                keys, mm_idx = self._lookahead_keys(request, start, start + bs, mm_idx)
            elif not plain:
                keys, mm_idx = generate_block_hash_extra_keys(request, start, start + bs, mm_idx)
            # What hash_block_tokens hashes.
            block = (
                parent or self.none_hash,
                tuple(tokens[start - first : start + bs - first]),
                keys,
            )
            block_hash = memo.get(block) if looking else None
            if block_hash is None:
                looking = False
                block_hash = hash_fn(block)
                if len(memo) >= HASH_MEMO_CAPACITY:
                    memo.clear()  # cheaper than keeping LRU order; shared blocks come back
                memo[block] = block_hash
            parent = block_hash
            new_hashes.append(parent)
            start += bs
        return new_hashes

    def _lookahead_keys(
        self, request: Request, start: int, end: int, mm_idx: int
    ) -> tuple[ExtraKeys, int]:
        """vLLM's extra keys of a lookahead hash: ``(E, token)`` for one lookahead
        token, ``(E, *tokens)`` for more, where ``E`` covers the block and the tokens."""
        lookahead = self.num_hash_lookahead_tokens
        window_keys, mm_idx = generate_lookahead_block_hash_extra_keys(
            request, start, end, end + lookahead, mm_idx
        )
        tokens = request.all_token_ids
        if lookahead == 1:
            return (window_keys, tokens[end]), mm_idx
        return (window_keys, *tokens[end : end + lookahead]), mm_idx

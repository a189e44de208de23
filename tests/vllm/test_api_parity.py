"""The service's API against vLLM 0.33.0's own ``KVCacheManager``, over real gRPC:
what a request carries besides its tokens (LoRA name, path and int id, cache salt,
multimodal items, prompt embeddings) hashes its blocks as vLLM does, and both event
streams (``SubscribeEvents`` and the ZMQ stream) carry each block's extra keys in
vLLM's untagged form and the adapter's id; a step boundary (``NewStepStarts``)
refuses a same-step Mamba hit where vLLM's does, and a Mamba "align" allocation
answers vLLM's null padding; ``GetCacheConfig`` reports the seed vLLM resolves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import BlockStored as VllmStored
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_none_hash_seed,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec
from vllm.v1.request import Request

from kvservice.client import AsyncKVClient, CacheSnapshot, MultiModalFeature
from kvservice.client import BlockStored as GrpcStored
from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.testing import SchedulerSetup, block_hasher, build_scheduler
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.zmq_events.wire import int_block_hash
from tests.server.support import HYBRID_POOL, tokens
from tests.server.test_step_boundaries import FIRST, MAMBA_POOL, SECOND
from tests.servers import THREAD_TIMEOUT_S, running_server, server_in_thread
from tests.vllm.support import ZMQ_POOL, VllmSubscriber, settle

# KV events on both streams; room for every request below at once.
EVENTS_POOL = dataclasses.replace(ZMQ_POOL, num_blocks=40, kv_events=True)
PROMPT = tokens(40, start=100)


@dataclasses.dataclass(frozen=True)
class Extras:
    """What a request carries besides its tokens, as both sides take it."""

    lora: tuple[str, int, str] | None = None  # (name, int id, path)
    salt: str | None = None
    mm: tuple[tuple[str, int, int], ...] = ()  # (identifier, offset, length)
    embeds: bool = False


# (request id, prompt, extras), admitted in this order on both sides.
REQUESTS = [
    ("lora", PROMPT, Extras(lora=("adapter", 7, "/adapters/a"))),
    # The same tokens under a cache salt equal to the LoRA name: no hit (tagged keys).
    ("salt", PROMPT, Extras(salt="adapter")),
    # The same adapter name at another path: no hit; at the same path: a hit.
    ("other-path", PROMPT, Extras(lora=("adapter", 8, "/adapters/b"))),
    ("same-path", [*PROMPT, 1, 2], Extras(lora=("adapter", 7, "/adapters/a"))),
    ("mm", tokens(40, start=300), Extras(mm=(("img-0", 4, 20), ("img-1", 30, 4)))),
    ("embeds", tokens(40, start=500), Extras(embeds=True, salt="s")),
]


def _embeddings(prompt: list[int]) -> torch.Tensor:
    return torch.tensor([[float(t), float(t % 5) / 4.0] for t in prompt], dtype=torch.float32)


class VllmSide:
    """vLLM's manager on the server's pool, driven as the server is."""

    def __init__(self, config: ServerConfig) -> None:
        lookahead = config.num_hash_lookahead_tokens
        hash_fn = get_hash_fn_by_name(config.hash_algo)
        init_none_hash(hash_fn)
        spec = FullAttentionSpec(
            block_size=config.block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        self.manager = VllmManager(
            KVCacheConfig(
                num_blocks=config.num_blocks,
                kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
            ),
            max_model_len=config.max_model_len,
            scheduler_block_size=config.block_size,
            hash_block_size=config.block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
            num_hash_lookahead_tokens=lookahead,
        )
        self.hasher = get_request_block_hasher(config.block_size, hash_fn, lookahead)
        self.events: list[Any] = []

    def admit(self, request_id: str, prompt: list[int], extras: Extras) -> int:
        """Lookup, then allocate the whole prompt with the hit; the hit's tokens."""
        request = Request(
            request_id,
            list(prompt),
            SamplingParams(max_tokens=1),
            None,
            lora_request=LoRARequest(*extras.lora) if extras.lora else None,
            cache_salt=extras.salt,
            mm_features=_mm_features(extras.mm),
            prompt_embeds=_embeddings(prompt) if extras.embeds else None,
            block_hasher=self.hasher,
        )
        hit, num_hit, _ = self.manager.get_computed_blocks(request)
        assert self.manager.allocate_slots(request, len(prompt) - num_hit, num_hit, hit)
        self.events.extend(self.manager.take_events())
        return int(num_hit)


async def _admit(client: AsyncKVClient, request_id: str, prompt: list[int], extras: Extras) -> int:
    embeds = _embeddings(prompt) if extras.embeds else None
    row_bytes = embeds[0].numel() * embeds.element_size() if embeds is not None else 0
    await client.add_request(
        request_id,
        prompt,
        cache_salt=extras.salt,
        lora_name=extras.lora[0] if extras.lora else None,
        lora_int_id=extras.lora[1] if extras.lora else None,
        lora_path=extras.lora[2] if extras.lora else None,
        mm_features=[MultiModalFeature(*item) for item in extras.mm],
        prompt_embeds=embeds.numpy().tobytes() if embeds is not None else None,
        prompt_embeds_row_bytes=row_bytes,
    )
    hit = await client.get_computed_blocks(request_id)
    assert await client.allocate_slots(request_id, len(prompt) - hit.num_computed_tokens, hit)
    return hit.num_computed_tokens


def _mm_features(items: Sequence[tuple[str, int, int]]) -> list[MultiModalFeatureSpec] | None:
    """vLLM's features for (identifier, offset, length) image items; None for none."""
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for identifier, offset, length in items
    ]
    return features or None


def _plain(value: Any) -> Any:
    """Lists (msgpack's form of a tuple) and tuples alike, for comparing keys."""
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    return value


def _stored(event: Any) -> tuple[Any, ...]:
    """What both streams and vLLM must agree on of a BlockStored."""
    # vLLM publishes 8-byte int hashes by default; SubscribeEvents the whole bytes.
    hashes = tuple(h if isinstance(h, int) else int_block_hash(h) for h in event.block_hashes)
    return (
        hashes,
        tuple(event.token_ids),
        event.lora_id,
        event.lora_name,
        _plain(event.extra_keys),
        _plain(event.lookahead_token_ids),
    )


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def _grpc_events(server: KVCacheServer, items: AsyncIterator[Any]) -> list[GrpcStored]:
    """The events after the snapshot, up to the log's last sequence."""
    assert server.events is not None
    stored: list[GrpcStored] = []
    sequence = 0
    while sequence < server.events.last_sequence:
        item = await asyncio.wait_for(anext(items), THREAD_TIMEOUT_S)
        assert not isinstance(item, CacheSnapshot)
        sequence = item.sequence
        if isinstance(item, GrpcStored):
            stored.append(item)
    return stored


@pytest.mark.parametrize("lookahead", [0, 1])
async def test_request_extras_hash_and_publish_as_vllm(
    zmq_context: zmq.asyncio.Context, lookahead: int
) -> None:
    """Every request's hit and every BlockStored (hashes, tokens, LoRA id and name,
    extra keys per block, and with lookahead block hashes the tokens after each block)
    on SubscribeEvents and on ZMQ, against vLLM's."""
    config = dataclasses.replace(EVENTS_POOL, num_hash_lookahead_tokens=lookahead)
    reference = VllmSide(config)
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        subscriber = VllmSubscriber(zmq_context, server)
        items = client.subscribe_events()
        assert isinstance(await asyncio.wait_for(anext(items), THREAD_TIMEOUT_S), CacheSnapshot)
        hits = {}
        for request_id, prompt, extras in REQUESTS:
            hits[request_id] = await _admit(client, request_id, prompt, extras)
            assert hits[request_id] == reference.admit(request_id, prompt, extras), request_id
        assert hits == {
            "lora": 0,
            "salt": 0,
            "other-path": 0,
            "same-path": 32,
            "mm": 0,
            "embeds": 0,
        }
        grpc_stored = await _grpc_events(server, items)
        await items.aclose()
        await subscriber.catch_up(await settle(server))
        zmq_stored = [e for e in subscriber.events if isinstance(e, VllmStored)]
        subscriber.close()
    expected = [_stored(e) for e in reference.events if isinstance(e, VllmStored)]
    assert [_stored(e) for e in grpc_stored] == expected
    assert [_stored(e) for e in zmq_stored] == expected
    if lookahead:
        assert all(e[-1] and len(e[-1]) == len(e[0]) for e in expected)
        return
    # One BlockStored per request but same-path, whose full blocks were all hits.
    lora, salt, other_path, mm, embeds = (e[2:-1] for e in expected)
    assert lora == (7, "adapter", (("adapter",), ("adapter",)))
    assert salt == (None, None, (("adapter",), None))  # the salt, on the first block only
    assert other_path[:2] == (8, "adapter")
    assert mm[2] == ((("img-0", 4),), (("img-0", -12), ("img-1", 14)))
    rows = _embeddings(REQUESTS[-1][1]).numpy()
    digests = [hashlib.sha256(rows[i : i + 16].tobytes()).digest() for i in (0, 16)]
    assert embeds[2] == (("s", digests[0]), (digests[1],))


def _mamba_reference() -> VllmManager:
    common = {"block_size": 16, "num_kv_heads": 1, "head_size": 4, "dtype": torch.float32}
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(**common)),
        KVCacheGroupSpec(
            ["mamba"],
            VllmMambaSpec(
                block_size=16, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align"
            ),
        ),
    ]
    init_none_hash(get_hash_fn_by_name("sha256"))
    return VllmManager(
        KVCacheConfig(
            num_blocks=MAMBA_POOL.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        ),
        max_model_len=MAMBA_POOL.max_model_len,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
    )


async def test_step_boundaries_and_mamba_answers_as_vllm() -> None:
    """The same calls on the server and on vLLM's manager: the same hits, the same
    same-step refusal (None), the same block ids per group with Mamba's null padding."""
    vllm = _mamba_reference()
    hasher = get_request_block_hasher(16, get_hash_fn_by_name("sha256"))
    requests = {
        rid: Request(rid, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        for rid, prompt in (("0", FIRST), ("1", SECOND))
    }

    def vllm_admit(rid: str) -> tuple[int, Any]:
        request = requests[rid]
        hit, num_hit, _ = vllm.get_computed_blocks(request)
        new = vllm.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        if new is None:
            return num_hit, None
        request.num_computed_tokens = request.num_tokens
        return num_hit, tuple(tuple(group) for group in new.get_block_ids())

    async with (
        running_server(MAMBA_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):

        async def served(rid: str) -> tuple[int, Any]:
            hit = await client.get_computed_blocks(rid)
            allocation = await client.allocate_slots(
                rid, len(requests[rid].prompt_token_ids or ()) - hit.num_computed_tokens, hit
            )
            return hit.num_computed_tokens, None if allocation is None else allocation.new_block_ids

        answers = []
        for rid in ("0", "1"):
            await client.add_request(rid, requests[rid].prompt_token_ids or [])
        for boundary, rid in ((True, "0"), (False, "1"), (True, "1")):
            if boundary:
                vllm.new_step_starts()
                await client.new_step_starts()
            ours, theirs = await served(rid), vllm_admit(rid)
            assert ours == theirs, (rid, ours, theirs)
            answers.append(ours)
        assert answers[0] == (0, ((1, 2), (0, 3)))  # Mamba: null padding, then the state
        assert answers[1] == (32, None)
        assert answers[2][0] == 32
        assert vllm.block_pool.get_num_free_blocks() == (await client.get_usage()).num_free_blocks


SEED_CASES = [
    # (hash_algo, --none-hash-seed, PYTHONHASHSEED, reported seed source)
    ("sha256", None, None, "default"),
    ("sha256_cbor", None, "42", "PYTHONHASHSEED"),
    ("xxhash", None, None, "random"),
    ("xxhash", None, "42", "PYTHONHASHSEED"),
    ("xxhash_cbor", "chosen", "42", "explicit"),
]


@pytest.mark.parametrize(("algo", "explicit", "env", "source"), SEED_CASES)
async def test_cache_config_reports_the_seed_vllm_resolves(
    monkeypatch: pytest.MonkeyPatch, algo: str, explicit: str | None, env: str | None, source: str
) -> None:
    """The seed is reported unless it is a random one, and equals vLLM's
    ``resolve_none_hash_seed`` under the same environment (or the explicit seed)."""
    if env is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", env)
    config = dataclasses.replace(HYBRID_POOL, hash_algo=algo, none_hash_seed=explicit)
    async with running_server(config) as server, AsyncKVClient(server.handle.target) as client:
        reported = await client.get_cache_config()
        effective = server.table.manager.block_hasher.none_hash_seed
    assert reported.none_hash_seed_source == source
    assert reported.none_hash_seed == ("" if source == "random" else effective)
    assert (
        reported.none_hash_seed_fingerprint == hashlib.sha256(effective.encode()).hexdigest()[:16]
    )
    if source != "random":
        vllm_seed = (
            explicit if explicit is not None else resolve_none_hash_seed(get_hash_fn_by_name(algo))
        )
        assert reported.none_hash_seed == vllm_seed


def test_the_remote_manager_sends_what_vllm_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM integration's remote mode: requests with a LoRA adapter, a salt,
    prompt embeddings or multimodal items reach the server with them, so the server
    hits exactly where vLLM's hashes (the replica's) hit; a different answer would stop
    the manager."""
    setup = SchedulerSetup(num_blocks=64, max_model_len=512)
    config = dataclasses.replace(
        ZMQ_POOL, num_blocks=64, max_model_len=512, kv_events_config=ServerConfig().kv_events_config
    )
    hasher = block_hasher(16)
    embeds = {"x": _embeddings(PROMPT), "y": _embeddings(PROMPT) + 1.0}
    # (request id, LoRA, salt, embeddings, multimodal items) -> the hit vLLM's hashes give.
    image, other = ("image-a", 4, 8), ("image-b", 4, 8)
    cases = [
        ("a", ("adapter", 1, "/adapters/a"), None, None, (), 0),
        ("b", ("adapter", 1, "/adapters/a"), None, None, (), 32),
        ("c", ("adapter", 2, "/adapters/c"), None, None, (), 0),
        ("d", None, "adapter", None, (), 0),
        ("e", None, None, "x", (), 0),
        ("f", None, None, "x", (), 32),
        ("g", None, None, "y", (), 0),
        ("h", None, None, None, (image,), 0),
        ("i", None, None, None, (image,), 32),
        ("j", None, None, None, (other,), 0),
        ("l", None, None, None, (), 0),
        ("m", None, None, None, (("image-b", 20, 8),), 16),  # the item is in block 2
    ]
    with server_in_thread(config) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.handle.target)
        scheduler = build_scheduler(setup, KVServiceScheduler)
        manager = scheduler.kv_cache_manager
        for rid, lora, salt, embedding, mm, expected_hit in cases:
            request = Request(
                rid,
                list(PROMPT),
                SamplingParams(max_tokens=1),
                None,
                lora_request=LoRARequest(*lora) if lora else None,
                cache_salt=salt,
                prompt_embeds=embeds[embedding] if embedding else None,
                mm_features=_mm_features(mm),
                block_hasher=hasher,
            )
            manager.new_step_starts()
            blocks, num_hit, _ = manager.get_computed_blocks(request)
            assert num_hit == expected_hit, rid
            hit = blocks if num_hit else None
            assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
            # The step goes to the server, which must answer every call as the replica.
            manager.take_kv_cache_block_copies()
        assert manager.server is not None and manager.server.round_trips == len(cases)
        scheduler.shutdown()

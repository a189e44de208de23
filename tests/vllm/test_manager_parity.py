"""kvservice's core against vLLM 0.33.0's own ``KVCacheManager``, operation by operation.

One seeded scheduler model drives both managers with the same operations: several
requests per step (decodes and prefill chunks of the running requests, admissions of
waiting ones, preemptions when the pool runs dry, finishes), ``new_step_starts`` at
the top of each step, the copy-on-write copies taken and their blocks released at its
end. Mamba "align" prefills are split where vLLM's scheduler splits them. After every
operation the two sides must agree on the answer (hit blocks and length, the entries
appended per group or ``None``), the block tables, every block's reference count and
cached prefix length, the free count and usage, the KV events and the requests' block
hashes; copy pairs at the end of each step.

Hashes are compared raw where both sides derive the same chain seed (a shared
``PYTHONHASHSEED``, or a SHA variant's fixed seed), and renumbered by first appearance
where each side draws a random xxhash seed.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as vllm_utils
from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFullSpec
from vllm.v1.kv_cache_interface import KVCacheConfig as VllmConfig
from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VllmGroupSpec
from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec
from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmSlidingSpec
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus as VllmStatus

from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvservice.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvservice.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice.core.request import Request, RequestStatus

MAX_MODEL_LEN = 512
NUM_STEPS = 80


@dataclass(frozen=True)
class Case:
    """One pool: its groups (``("full", block_size, 0)``, ``("mamba", block_size,
    num_speculative_blocks)`` in "align" mode, ``("swa", block_size, window)``),
    hashing, and the extra keys its requests may carry."""

    name: str
    groups: tuple[tuple[str, int, int], ...]
    hash_block_size: int
    hash_algo: str
    num_blocks: int
    python_hash_seed: str | None = None
    extras: frozenset[str] = frozenset()

    @property
    def scheduler_block_size(self) -> int:
        return math.lcm(*(bs for _, bs, _ in self.groups))

    @property
    def mamba_align(self) -> bool:
        return any(kind == "mamba" for kind, _, _ in self.groups)

    @property
    def partial_hits(self) -> bool:
        return any(kind == "mamba" and bs > self.hash_block_size for kind, bs, _ in self.groups)

    @property
    def same_seed(self) -> bool:
        """Whether both sides derive the same chain seed (then hashes compare raw)."""
        return self.python_hash_seed is not None or self.hash_algo.startswith("sha256")


CASES = [
    Case("full_mamba_equal_blocks", (("full", 16, 0), ("mamba", 16, 0)), 16, "sha256", 40),
    Case(
        "full_mamba_block_4x_hash",
        (("full", 16, 0), ("mamba", 16, 0)),
        4,
        "sha256_cbor",
        48,
        extras=frozenset({"lora", "salt"}),
    ),
    Case(
        "small_full_mamba_4x_hash",
        (("full", 4, 0), ("mamba", 16, 0)),
        4,
        "xxhash",
        80,
        python_hash_seed="1234",
        extras=frozenset({"mm", "lora"}),
    ),
    Case(
        "full_mamba_4x_hash_extras",
        (("full", 8, 0), ("mamba", 8, 0)),
        2,
        "sha256",
        60,
        extras=frozenset({"mm", "salt", "embeds"}),
    ),
    Case(
        "full_mamba_speculative",
        (("full", 8, 0), ("mamba", 8, 1)),
        8,
        "sha256",
        50,
        extras=frozenset({"salt"}),
    ),
    Case(
        "full_mamba_speculative_4x_hash",
        (("full", 8, 0), ("mamba", 8, 1)),
        2,
        "xxhash_cbor",
        60,
        python_hash_seed="0",
    ),
    Case(
        "full_sliding_window_mixed_blocks",
        (("full", 8, 0), ("swa", 4, 8)),
        4,
        "sha256",
        40,
        extras=frozenset({"lora", "mm"}),
    ),
    Case(
        "full_lora_salt_mm",
        (("full", 8, 0),),
        8,
        "sha256",
        40,
        extras=frozenset({"lora", "salt", "mm", "embeds"}),
    ),
    Case(
        "full_xxhash_random_seeds",
        (("full", 4, 0),),
        4,
        "xxhash",
        30,
        extras=frozenset({"lora", "salt"}),
    ),
]

# LoRA adapters: one name at two paths (a re-pointed name), and a name equal to a salt.
LORAS = [("alpha", 1, "/adapters/alpha-v1"), ("alpha", 2, "/adapters/alpha-v2"), ("beta", 3, "/b")]
SALTS = ["alpha", "beta"]
MM_IDS = ["img-0", "img-1"]


@dataclass
class Extras:
    """What enters a request's hashes besides its tokens (identical on both sides)."""

    lora: tuple[str, int, str] | None = None
    salt: str | None = None
    mm: tuple[tuple[str, int, int], ...] = ()  # (identifier, offset, length)
    embeds: bool = False


def _embeddings(prompt: Sequence[int]) -> torch.Tensor:
    """Prompt embeddings (two float32 values per token) derived from the tokens: equal
    prompts embed equally."""
    rows = [[float(t), float(t % 7) / 8.0] for t in prompt]
    return torch.tensor(rows, dtype=torch.float32)


class Renumber:
    """Hashes as the test compares them: raw bytes, or first-appearance numbers when
    each side drew its own random seed."""

    def __init__(self, raw: bool) -> None:
        self.raw = raw
        self.numbers: dict[bytes, int] = {}

    def __call__(self, value: bytes | int | None) -> object:
        if value is None:
            return None
        assert isinstance(value, bytes), f"event hashes must be bytes, got {value!r}"
        if self.raw:
            return value
        return self.numbers.setdefault(value, len(self.numbers))


def _norm_event(event: object, h: Renumber) -> tuple[object, ...]:
    if isinstance(event, BlockStored | VllmBlockStored):
        extra = event.extra_keys
        return (
            "stored",
            [h(x) for x in event.block_hashes],
            h(event.parent_block_hash),
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            None if extra is None else [None if k is None else tuple(k) for k in extra],
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
        )
    if isinstance(event, BlockRemoved | VllmBlockRemoved):
        return ("removed", [h(x) for x in event.block_hashes], event.medium, event.group_idx)
    assert isinstance(event, AllBlocksCleared | VllmAllBlocksCleared), event
    return ("cleared",)


def _ids(blocks: KVCacheBlocks | VllmBlocks | None) -> object:
    return None if blocks is None else [[b.block_id for b in group] for group in blocks.blocks]


class VllmSide:
    """vLLM 0.33.0's manager and requests."""

    def __init__(self, case: Case) -> None:
        hash_fn = get_hash_fn_by_name(case.hash_algo)
        vllm_utils.init_none_hash(hash_fn)  # reads PYTHONHASHSEED, as at engine start
        self.hasher = vllm_utils.get_request_block_hasher(case.hash_block_size, hash_fn)
        groups = [
            VllmGroupSpec([f"layer.{i}"], self._spec(*group)) for i, group in enumerate(case.groups)
        ]
        self.manager = VllmManager(
            VllmConfig(num_blocks=case.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=case.scheduler_block_size,
            hash_block_size=case.hash_block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.requests: dict[str, VllmRequest] = {}
        self.hits: dict[str, VllmBlocks] = {}

    @staticmethod
    def _spec(
        kind: str, block_size: int, arg: int
    ) -> VllmFullSpec | VllmMambaSpec | VllmSlidingSpec:
        if kind == "full":
            return VllmFullSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
            )
        if kind == "swa":
            return VllmSlidingSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=1,
                dtype=torch.float32,
                sliding_window=arg,
            )
        return VllmMambaSpec(
            block_size=block_size,
            shapes=((2,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=arg,
        )

    def add(self, request_id: str, prompt: list[int], extras: Extras) -> None:
        lora = LoRARequest(*extras.lora) if extras.lora else None
        mm = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for identifier, offset, length in extras.mm
        ]
        self.requests[request_id] = VllmRequest(
            request_id,
            list(prompt),
            SamplingParams(max_tokens=MAX_MODEL_LEN),
            None,
            prompt_embeds=_embeddings(prompt) if extras.embeds else None,
            mm_features=mm or None,
            lora_request=lora,
            cache_salt=extras.salt,
            block_hasher=self.hasher,
        )

    def block_hashes(self, request_id: str) -> list[bytes]:
        return list(self.requests[request_id].block_hashes)

    def lookup(self, request_id: str) -> tuple[object, int, int]:
        request = self.requests[request_id]
        blocks, num_hit, boundary = self.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary  # as the scheduler does at admission
        self.hits[request_id] = blocks
        return _ids(blocks), num_hit, boundary

    def allocate(self, request_id: str, num_new: int, num_hit: int, lookahead: int) -> object:
        hit = self.hits.pop(request_id, None)
        return _ids(
            self.manager.allocate_slots(
                self.requests[request_id], num_new, num_hit, hit, num_lookahead_tokens=lookahead
            )
        )

    def set_computed(self, request_id: str, num_computed: int) -> None:
        request = self.requests[request_id]
        request.num_computed_tokens = num_computed
        request.status = VllmStatus.RUNNING

    def append(self, request_id: str, token: int) -> None:
        self.requests[request_id].append_output_token_ids(token)

    def preempt(self, request_id: str) -> None:
        request = self.requests[request_id]
        self.manager.free(request)
        request.status = VllmStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def finish(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        request.status = VllmStatus.FINISHED_STOPPED
        self.manager.free(request)

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def take_copies(self) -> list[tuple[int, int]]:
        copies, retained = self.manager.take_kv_cache_block_copies()
        # vLLM's scheduler releases them once the step that runs the copies is done.
        self.manager.block_pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def events(self) -> list[object]:
        return list(self.manager.take_events())

    def reset(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def tables(self) -> dict[str, object]:
        get_blocks = self.manager.coordinator.get_blocks
        return {rid: [[b.block_id for b in g] for g in get_blocks(rid)] for rid in self.requests}

    def pool_state(self) -> tuple[object, ...]:
        pool = self.manager.block_pool
        blocks = [(b.ref_cnt, b.block_hash_num_tokens) for b in pool.blocks[1:]]
        return pool.get_num_free_blocks(), round(self.manager.usage, 9), blocks


class CoreSide:
    """kvservice's core manager and requests."""

    def __init__(self, case: Case) -> None:
        groups = [
            KVCacheGroupSpec([f"layer.{i}"], self._spec(*group))
            for i, group in enumerate(case.groups)
        ]
        self.manager = KVCacheManager(
            KVCacheConfig(num_blocks=case.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups),
            MAX_MODEL_LEN,
            scheduler_block_size=case.scheduler_block_size,
            hash_block_size=case.hash_block_size,
            enable_kv_cache_events=True,
            hash_algo=case.hash_algo,
        )
        self.requests: dict[str, Request] = {}
        self.hits: dict[str, KVCacheBlocks] = {}

    @staticmethod
    def _spec(kind: str, block_size: int, arg: int) -> KVCacheSpec:
        if kind == "full":
            return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1)
        if kind == "swa":
            return SlidingWindowSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, sliding_window=arg
            )
        return MambaSpec(
            block_size=block_size,
            shapes=((2,),),
            dtypes=("float32",),
            mamba_cache_mode="align",
            num_speculative_blocks=arg,
        )

    def add(self, request_id: str, prompt: list[int], extras: Extras) -> None:
        lora_name, lora_int_id, lora_path = extras.lora or (None, None, None)
        embeds = _embeddings(prompt).numpy().tobytes() if extras.embeds else None
        self.requests[request_id] = self.manager.new_request(
            request_id,
            prompt,
            cache_salt=extras.salt,
            lora_name=lora_name,
            lora_path=lora_path,
            lora_int_id=lora_int_id,
            mm_features=[MultiModalFeature(i, offset, length) for i, offset, length in extras.mm],
            prompt_embeds=embeds,
        )

    def block_hashes(self, request_id: str) -> list[bytes]:
        return list(self.requests[request_id].block_hashes)

    def lookup(self, request_id: str) -> tuple[object, int, int]:
        blocks, num_hit, boundary = self.manager.get_computed_blocks(self.requests[request_id])
        self.hits[request_id] = blocks
        return _ids(blocks), num_hit, boundary

    def allocate(self, request_id: str, num_new: int, num_hit: int, lookahead: int) -> object:
        hit = self.hits.pop(request_id, None)
        return _ids(
            self.manager.allocate_slots(
                self.requests[request_id], num_new, num_hit, hit, num_lookahead_tokens=lookahead
            )
        )

    def set_computed(self, request_id: str, num_computed: int) -> None:
        request = self.requests[request_id]
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING

    def append(self, request_id: str, token: int) -> None:
        self.requests[request_id].append_output_token_ids(token)

    def preempt(self, request_id: str) -> None:
        request = self.requests[request_id]
        self.manager.free(request)
        request.preempt()

    def finish(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        request.status = RequestStatus.FINISHED
        self.manager.free(request)

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def take_copies(self) -> list[tuple[int, int]]:
        taken = self.manager.take_kv_cache_block_copies()
        self.manager.free_retained_blocks(taken.retained_blocks)
        return [(c.src_block_id, c.dst_block_id) for c in taken.copies]

    def events(self) -> list[object]:
        return list(self.manager.take_events())

    def reset(self) -> bool:
        return self.manager.reset_prefix_cache()

    def tables(self) -> dict[str, object]:
        get_blocks = self.manager.coordinator.get_blocks
        return {rid: [[b.block_id for b in g] for g in get_blocks(rid)] for rid in self.requests}

    def pool_state(self) -> tuple[object, ...]:
        pool = self.manager.block_pool
        blocks = [(b.ref_cnt, b.block_hash_num_tokens) for b in pool.blocks[1:]]
        return pool.get_num_free_blocks(), round(self.manager.usage, 9), blocks


@dataclass
class Tracked:
    """The scheduler model's view of one request (identical on both sides)."""

    request_id: str
    prompt: list[int]
    num_tokens: int
    num_computed: int = 0


@dataclass
class Driver:
    """Drives both sides with one seeded operation sequence, comparing as it goes."""

    case: Case
    rng: random.Random
    vllm: VllmSide
    core: CoreSide
    vllm_hashes: Renumber
    core_hashes: Renumber
    waiting: deque[Tracked] = field(default_factory=deque)
    running: list[Tracked] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    extras_of: dict[str, Extras] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    next_id: int = 0

    def both(self, what: str, op: Callable[[VllmSide | CoreSide], object]) -> object:
        """Run ``op`` on both sides; they must answer alike, then agree on all state."""
        self.log.append(what)
        expected, got = op(self.vllm), op(self.core)
        self.check(what, expected, got)
        return got

    def check(self, what: str, expected: object, got: object) -> None:
        if expected != got:
            recent = "\n  ".join(self.log[-12:])
            pytest.fail(
                f"{self.case.name}: {what}: vLLM {expected!r} != kvservice {got!r}\n"
                f"last operations:\n  {recent}"
            )
        check_invariants(self.core.manager)
        self.compare_state(what)

    def compare_state(self, what: str) -> None:
        for name, expected, got in (
            ("pool", self.vllm.pool_state(), self.core.pool_state()),
            ("tables", self.vllm.tables(), self.core.tables()),
            (
                "events",
                [_norm_event(e, self.vllm_hashes) for e in self.vllm.events()],
                [_norm_event(e, self.core_hashes) for e in self.core.events()],
            ),
        ):
            if expected != got:
                recent = "\n  ".join(self.log[-12:])
                pytest.fail(
                    f"{self.case.name}: after {what}, {name} differ:\n  vLLM      {expected!r}"
                    f"\n  kvservice {got!r}\nlast operations:\n  {recent}"
                )

    def compare_hashes(self, request_id: str) -> None:
        expected = [self.vllm_hashes(h) for h in self.vllm.block_hashes(request_id)]
        got = [self.core_hashes(h) for h in self.core.block_hashes(request_id)]
        self.check(f"block hashes of {request_id}", expected, got)

    # -- the workload ------------------------------------------------------------------

    def new_prompt(self) -> list[int]:
        """Shared prefixes, replays of earlier prompts (exact: they hit partial tails),
        lengths on and off the hash block."""
        rng = self.rng
        if self.prompts and rng.random() < 0.5:
            prompt = list(rng.choice(self.prompts))
            if rng.random() < 0.5:
                prompt += [rng.randrange(50, 60) for _ in range(rng.randrange(1, 9))]
        else:
            prefix_len = rng.choice([0, 3, 8, 16, 20, 32])
            prefix = [7 + i % 5 for i in range(prefix_len)]
            prompt = prefix + [rng.randrange(100, 110) for _ in range(rng.randrange(1, 40))]
        hbs = self.case.hash_block_size
        if rng.random() < 0.3 and len(prompt) > hbs:
            prompt = prompt[: len(prompt) // hbs * hbs]  # a multiple of the hash block
        prompt = prompt[: MAX_MODEL_LEN // 4]
        self.prompts.append(prompt)
        return prompt

    def new_extras(self, prompt: list[int]) -> Extras:
        rng, kinds = self.rng, self.case.extras
        extras = Extras()
        if "lora" in kinds and rng.random() < 0.4:
            extras.lora = rng.choice(LORAS)
        if "salt" in kinds and rng.random() < 0.4:
            extras.salt = rng.choice(SALTS)
        if "mm" in kinds and rng.random() < 0.5 and len(prompt) >= 4:
            items: list[tuple[str, int, int]] = []
            offset = rng.randrange(0, 3)
            while offset < len(prompt) - 1 and len(items) < 3:
                length = rng.randrange(1, min(12, len(prompt) - offset) + 1)
                items.append((rng.choice(MM_IDS), offset, length))
                offset += length + rng.randrange(0, 6)
            extras.mm = tuple(items)
        if "embeds" in kinds and rng.random() < 0.3:
            extras.embeds = True
        return extras

    def add_request(self) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        prompt = self.new_prompt()
        extras = self.new_extras(prompt)
        self.extras_of[request_id] = extras
        self.both(
            f"add {request_id} {len(prompt)} tokens {extras}",
            lambda s: s.add(request_id, prompt, extras),
        )
        self.compare_hashes(request_id)
        self.waiting.append(Tracked(request_id, prompt, len(prompt)))

    def chunk(self, req: Tracked, start: int, budget: int) -> int:
        """Tokens to schedule from ``start``: the rest, within the budget, split for a
        Mamba "align" group as vLLM's scheduler splits (``_mamba_block_aligned_split``,
        without EAGLE, prefill checkpoints or junction stops)."""
        num_new = min(req.num_tokens - start, budget)
        prefill_end = max(len(req.prompt), req.num_tokens - 1)
        if not self.case.mamba_align or start >= prefill_end:
            return num_new
        bs = self.case.scheduler_block_size
        hbs = self.case.hash_block_size
        end = start + num_new
        last_cache_position = max((req.num_tokens - 1) // bs * bs, 0)
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= budget:
                end = aligned
        tail = max((len(req.prompt) - 1) // hbs * hbs, 0) if self.case.partial_hits else 0
        stops = (
            (start // bs + 1) * bs if start % bs else 0,
            last_cache_position,
            tail if last_cache_position < tail < len(req.prompt) else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def allocate(self, req: Tracked, num_new: int, num_hit: int) -> bool:
        lookahead = self.rng.choice([0, 0, 0, 2])
        rid = req.request_id
        got = self.both(
            f"allocate {rid} new={num_new} hit={num_hit} computed={req.num_computed} "
            f"lookahead={lookahead}",
            lambda s: s.allocate(rid, num_new, num_hit, lookahead),
        )
        if got is None:
            return False
        req.num_computed += num_hit + num_new
        computed = req.num_computed
        self.both(f"set {rid} computed={computed}", lambda s: s.set_computed(rid, computed))
        return True

    def preempt(self, req: Tracked) -> None:
        self.running.remove(req)
        req.num_computed = 0
        self.both(f"preempt {req.request_id}", lambda s: s.preempt(req.request_id))
        self.waiting.appendleft(req)

    def finish(self, req: Tracked) -> None:
        self.running.remove(req)
        self.both(f"finish {req.request_id}", lambda s: s.finish(req.request_id))

    def step(self) -> None:
        rng = self.rng
        budget = rng.choice([8, 16, 32, 64])
        self.both("new_step_starts", lambda s: s.new_step())
        scheduled: list[Tracked] = []
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted for an earlier request
            num_new = self.chunk(req, req.num_computed, budget)
            if num_new <= 0:
                continue
            while not self.allocate(req, num_new, 0):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append(req)
        for _ in range(rng.randrange(0, 4)):
            if not self.waiting or not self.admit(self.waiting[0], budget):
                break
            req = self.waiting.popleft()
            self.running.append(req)
            scheduled.append(req)
        self.both("take copies", lambda s: s.take_copies())
        for req in scheduled:
            if req in self.running and req.num_computed == req.num_tokens:
                self.sample(req)

    def admit(self, req: Tracked, budget: int) -> bool:
        """Look the waiting request up and allocate its first chunk after the hit."""
        rid = req.request_id
        found = self.both(f"lookup {rid}", lambda s: s.lookup(rid))
        assert isinstance(found, tuple)
        num_hit = found[1]
        assert isinstance(num_hit, int)
        num_new = self.chunk(req, num_hit, budget)
        return num_new > 0 and self.allocate(req, num_new, num_hit)

    def sample(self, req: Tracked) -> None:
        """The model's output: one token (sometimes one of the prompt's, so replays
        of outputs hit), then maybe the request finishes."""
        rid = req.request_id
        if self.rng.random() < 0.15 or req.num_tokens >= MAX_MODEL_LEN // 2:
            self.finish(req)
            return
        token = self.rng.choice([*req.prompt[:4], self.rng.randrange(200, 210)])
        self.both(f"append {rid} {token}", lambda s: s.append(rid, token))
        req.num_tokens += 1
        self.compare_hashes(rid)

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            if not self.running and self.rng.random() < 0.2:
                # Succeeds only while no block is held (the waiting requests hold none).
                self.both("reset_prefix_cache", lambda s: s.reset())
            for _ in range(self.rng.randrange(0, 3)):
                self.add_request()
            self.step()


def run_case(case: Case, seed: int, num_steps: int, monkeypatch: pytest.MonkeyPatch) -> Driver:
    if case.python_hash_seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", case.python_hash_seed)
    # vLLM publishes bytes hashes (as kvservice does) instead of their lower 64 bits.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    driver = Driver(
        case,
        random.Random(seed),
        VllmSide(case),
        CoreSide(case),
        Renumber(case.same_seed),
        Renumber(case.same_seed),
    )
    driver.run(num_steps)
    return driver


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_decisions_as_vllm(case: Case, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    run_case(case, seed, NUM_STEPS, monkeypatch)

"""Stateful property tests: random admit / chunked prefill / decode / preempt / finish /
reset_prefix_cache sequences against ``KVCacheManager``, driven the way vLLM's scheduler
drives it.

The scheduler moves modelled here:

- admit a waiting (or preempted) request: ``get_computed_blocks`` then
  ``allocate_slots(req, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
  ...)``; on success the caller sets ``req.num_computed_tokens = hit + new`` and marks the
  request running. ``num_new_tokens`` may be a chunk of the rest of the prompt.
- a running request that has not computed all its tokens gets its next chunk:
  ``allocate_slots(req, chunk)``; one that has computed everything decodes:
  ``append_output_token_ids`` then ``allocate_slots(req, 1)``.
- preemption: ``manager.free(req)`` then ``req.preempt()``; the request waits again.
- finish / abort: ``req.status = FINISHED`` then ``manager.free(req)``.
- ``reset_prefix_cache()`` at any time.

Prompts come from a three-token vocabulary and a few shared prefixes (and earlier
sequences, outputs included), so prefix hits and duplicates happen; pools are small, so
``None`` happens. Now and then a request carries a cache salt or a LoRA name (part of
its hashes, so it may only hit blocks cached under the same ones), or skips prefix reads
(prompt logprobs: no hits, still cached), and steps use lookahead slots, the watermark,
``reserved_blocks``, ``full_sequence_must_fit`` or ``delay_cache_blocks``.

Every step is checked against a model computed from a snapshot taken just before it:
which blocks move, in which order they leave and rejoin the free queue, which ref counts
and hashes change, and whether the answer is ``None``. After every step the pool
invariants hold (``check_invariants``) and every cached block in a block table carries
the hash of the request's tokens at that index. At the end every request is freed and
the pool must be whole again.

The same machine also models the features the layouts of
``test_state_machine_hybrid.py`` turn on (``MachineConfig``): Mamba groups (only the
state block of the last computed token is held, plus speculative blocks; older states
are released last first), EAGLE (hits give one block back; hybrid drafter groups cache
one block past the scheduler-block boundary), sparse retention intervals (which blocks
a window or Mamba group caches, from an independent oracle), decode context
parallelism (scaled full-attention blocks), connector (external) tokens at admission,
``evict_blocks`` of random ids, ``probe`` before allocations, and KV events replayed
after every step into a model of the cache that must equal the pool's hash map. Every
prefix hit (chunked local attention aside) is checked against an independent
recomputation of the longest usable hit.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvservice.core.allocation_options import AllocationOptions
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_block import KVCacheBlock, get_block_hash, get_group_id
from kvservice.core.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from kvservice.core.kv_cache_manager import AllocationProbe, KVCacheBlocks, KVCacheManager
from kvservice.core.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvservice.core.request import Request, RequestStatus
from tests.core.helpers import make_config
from tests.core.strategies import (
    REQUEST_OPTIONS,
    VOCAB,
    Knobs,
    MachineConfig,
    full_attention_configs,
    hybrid_mixed_block_configs,
    hybrid_same_block_configs,
    knobs,
    local_attention_configs,
    no_caching_configs,
    prompts,
    token_lists,
)

ADMISSION_KNOBS = knobs(admission=True)
RUNNING_KNOBS = knobs(admission=False)
TOKENS = st.integers(0, VOCAB - 1)
MAX_LIVE_REQUESTS = 6
MAX_HISTORY = 16
NULL = 0  # block id of the null block


# -- model helpers (written from the reference, not from the implementation) ------------


def num_skipped_tokens(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Leading tokens no future token attends to (reference §4.6/§4.7); a Mamba group
    reads only the state after the last computed token."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_computed_tokens - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk = spec.attention_chunk_size
        return num_computed_tokens // chunk * chunk
    if isinstance(spec, MambaSpec):
        return max(num_computed_tokens - 1, 0)
    return 0


def sliding_window_blocks_needed(spec: SlidingWindowSpec) -> int:
    return cdiv(spec.sliding_window - 1, spec.block_size)


def speculative_tokens(spec: KVCacheSpec) -> int:
    """Mamba allocates state blocks for draft tokens beyond the main model's tokens."""
    return spec.num_speculative_blocks * spec.block_size if isinstance(spec, MambaSpec) else 0


def retained_block(
    index: int,
    block_size: int,
    need: int,
    shift: int,
    alignment: int,
    interval: int | None,
    boundaries: Sequence[int],
) -> bool:
    """Whether a window or Mamba group enters block ``index`` into the cache when it
    fills (reference §4.7 and §12 row 8), written as "some retained hit end reads it".

    A hit ending at block boundary ``E`` (an ``alignment`` multiple) reads the ``need``
    blocks ``[E - need + shift, E + shift)`` (``shift`` 1 with EAGLE: the window and the
    block after the end). Retained ends: every multiple of the segment (``alignment``
    when ``interval`` is None, none when 0, else ``interval`` tokens); with an interval
    also each reachable boundary rounded down to ``alignment`` (when above 0)."""
    segment = alignment if interval is None else interval
    if segment:
        per_segment = segment // block_size
        # The smallest segment end above index - shift must be at most index - shift + need.
        lowest = index - shift + 1
        first_end = -(-lowest // per_segment) * per_segment
        if first_end <= index - shift + need:
            return True
    if interval is not None:
        for boundary in boundaries:
            end = (boundary - boundary % alignment) // block_size
            if end > 0 and end - need + shift <= index < end + shift:
                return True
    return False


@dataclass(frozen=True)
class PoolState:
    """Everything a step may change, by block id."""

    ref_cnts: tuple[int, ...]
    queue: tuple[int, ...]  # free queue, front (evicted first) to back
    hashes: tuple[bytes | None, ...]
    hash_map: dict[bytes, tuple[int, ...]]  # key -> block ids, first inserted first
    tables: tuple[dict[str, tuple[int, ...]], ...]  # per group: request -> block ids
    cached: tuple[dict[str, int], ...]  # per group: num_cached_block
    hash_tokens: tuple[int | None, ...]  # the prefix length the primary key stands for
    # Keys besides the primary (partial entries of a filled block), in the pool's order.
    aliases: tuple[tuple[bytes, ...], ...]


def take_state(manager: KVCacheManager) -> PoolState:
    pool = manager.block_pool
    cache = pool.cached_block_hash_to_block
    managers = manager.coordinator.single_type_managers
    return PoolState(
        ref_cnts=tuple(b.ref_cnt for b in pool.blocks),
        queue=tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
        hashes=tuple(b.block_hash for b in pool.blocks),
        hash_map={key: tuple(b.block_id for b in cache.blocks_of(key)) for key in cache},
        tables=tuple(
            {rid: tuple(b.block_id for b in blocks) for rid, blocks in m.req_to_blocks.items()}
            for m in managers
        ),
        cached=tuple(dict(m.num_cached_block) for m in managers),
        hash_tokens=tuple(b.block_hash_num_tokens for b in pool.blocks),
        aliases=tuple(tuple(pool.aliases_of(b)) for b in pool.blocks),
    )


def assert_same_state(actual: PoolState, expected: PoolState, what: str) -> None:
    """Field by field, so a failure names the part that differs."""
    assert actual.ref_cnts == expected.ref_cnts, f"{what}: ref counts"
    assert actual.queue == expected.queue, f"{what}: free queue order"
    assert actual.hashes == expected.hashes, f"{what}: block hashes"
    assert actual.hash_map == expected.hash_map, f"{what}: hash map"
    assert actual.tables == expected.tables, f"{what}: block tables"
    assert actual.cached == expected.cached, f"{what}: num_cached_block"
    assert actual.hash_tokens == expected.hash_tokens, f"{what}: cached prefix lengths"
    assert [set(a) for a in actual.aliases] == [set(a) for a in expected.aliases], (
        f"{what}: second keys"
    )


class _CacheModel:
    """The prefix cache as an allocation should leave it: each block's primary key, the
    prefix length it stands for and its second keys, and the map (key -> blocks)."""

    def __init__(self, before: PoolState) -> None:
        self.hashes = list(before.hashes)
        self.hash_tokens = list(before.hash_tokens)
        self.aliases = [list(a) for a in before.aliases]
        self.hash_map = {k: list(ids) for k, ids in before.hash_map.items()}

    def removals(self, before: PoolState | None, block_id: int) -> list[KVCacheEvent]:
        """One BlockRemoved per key of the block (primary first), as dropping it emits."""
        if before is not None:
            keys = [before.hashes[block_id], *before.aliases[block_id]]
        else:
            keys = [self.hashes[block_id], *self.aliases[block_id]]
        return [
            BlockRemoved([get_block_hash(key)], MEDIUM_GPU, get_group_id(key))
            for key in keys
            if key is not None
        ]

    def drop(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            for key in (self.hashes[block_id], *self.aliases[block_id]):
                if key is not None:
                    self.hash_map[key].remove(block_id)
            self.hashes[block_id] = self.hash_tokens[block_id] = None
            self.aliases[block_id] = []

    def insert(self, key: bytes, block_id: int, num_tokens: int) -> None:
        if self.hashes[block_id] is None:
            self.hashes[block_id], self.hash_tokens[block_id] = key, num_tokens
        else:
            self.aliases[block_id].append(key)
        self.hash_map.setdefault(key, []).append(block_id)

    def hash_map_state(self) -> dict[bytes, tuple[int, ...]]:
        return {k: tuple(v) for k, v in self.hash_map.items() if v}


def is_subsequence(needle: Sequence[int], haystack: Sequence[int]) -> bool:
    it = iter(haystack)
    return all(x in it for x in needle)


# -- the machine --------------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Base machine; subclasses pick the pool layouts (``configs``)."""

    configs: ClassVar[st.SearchStrategy[MachineConfig]]

    def __init__(self) -> None:
        super().__init__()
        self._manager: KVCacheManager | None = None
        self._cfg: MachineConfig | None = None
        self.requests: dict[str, Request] = {}  # not finished
        self.waiting: list[str] = []  # holds no blocks (new or preempted)
        self.running: list[str] = []  # allocated at least once since (re)admission
        self.history: list[list[int]] = []
        self.prefixes: list[list[int]] = []
        self.next_id = 0
        # Model of the features (filled in by setup).
        self.hybrid = False  # the hybrid coordinator (caching on, several groups)
        self.eagle: list[bool] = []  # per group: searched and cached as an EAGLE group
        self.alignment: list[int] = []  # per group: where its hits may end
        self.spec_groups: list[list[int]] = []  # equal specs, full attention first
        # Replay of the KV events: (group, external hash) -> cached blocks under it.
        self.event_model: Counter[tuple[int, bytes]] = Counter()
        # shared_prefix_boundary per request, as get_computed_blocks should have set it.
        self.shared_boundary: dict[str, int] = {}
        # (group, request, index) of held blocks whose cache entry evict_blocks dropped.
        self.evicted_held: set[tuple[int, str, int]] = set()
        # False while a rule or invariant runs: teardown skips its checks after a failure.
        self.clean = True

    @property
    def m(self) -> KVCacheManager:
        assert self._manager is not None
        return self._manager

    @property
    def cfg(self) -> MachineConfig:
        assert self._cfg is not None
        return self._cfg

    def specs(self) -> list[KVCacheSpec]:
        """The groups' specs as the allocator sees them (DCP-scaled)."""
        return [m.kv_cache_spec for m in self.m.coordinator.single_type_managers]

    def expected_key(self, request: Request, group: int, index: int) -> bytes:
        """The cache key of block ``index`` of ``group``: the request's hash at the
        group's block boundary (last fine hash of the coarse block) + group id."""
        scale = self.specs()[group].block_size // self.m.hash_block_size
        return request.block_hashes[(index + 1) * scale - 1] + group.to_bytes(4, "big")

    def num_hashed_blocks(self, request: Request, group: int) -> int:
        scale = self.specs()[group].block_size // self.m.hash_block_size
        return len(request.block_hashes) // scale

    # -- setup ----------------------------------------------------------------------------

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        cfg = data.draw(self.configs, label="config")
        self._cfg = cfg
        config = make_config(cfg.num_blocks, *cfg.specs)
        if cfg.eagle_marks is not None:
            groups = [
                dataclasses.replace(group, is_eagle_group=mark)
                for group, mark in zip(config.kv_cache_groups, cfg.eagle_marks, strict=True)
            ]
            config = dataclasses.replace(config, kv_cache_groups=groups)
        config = dataclasses.replace(config, prefix_cache_retention_interval=cfg.retention)
        self._manager = KVCacheManager(
            config,
            cfg.max_model_len,
            enable_caching=cfg.enable_caching,
            watermark=cfg.watermark,
            use_eagle=cfg.use_eagle,
            dcp_world_size=cfg.dcp,
            enable_kv_cache_events=cfg.events,
        )
        specs = self.specs()
        # DCP scales full attention only; a Mamba state is replicated.
        assert [spec.block_size for spec in specs] == [
            spec.block_size * (cfg.dcp if isinstance(spec, FullAttentionSpec) else 1)
            for spec in cfg.specs
        ]
        sizes = [spec.block_size for spec in specs]
        assert self.m.hash_block_size == math.gcd(*sizes)
        assert self.m.scheduler_block_size == math.lcm(*sizes)
        sbs = self.m.scheduler_block_size
        self.hybrid = cfg.enable_caching and len(specs) > 1
        self.alignment = [sbs if self.hybrid else spec.block_size for spec in specs]
        for group, spec in enumerate(specs):
            for known in self.spec_groups:
                if specs[known[0]] == spec:
                    known.append(group)
                    break
            else:
                self.spec_groups.append([group])
        self.spec_groups.sort(key=lambda ids: not isinstance(specs[ids[0]], FullAttentionSpec))
        self.eagle = self.eagle_groups()
        assert [s.use_eagle for s in self.m.coordinator.single_type_managers] == self.eagle
        self.prefixes = data.draw(
            st.lists(
                token_lists(cfg.prefix_blocks[0] * sbs, cfg.prefix_blocks[1] * sbs),
                min_size=1,
                max_size=3,
            ),
            label="prefixes",
        )

    def eagle_groups(self) -> list[bool]:
        """EAGLE reads the marked groups, or every non-Mamba group when none is marked;
        the hybrid coordinator extends a mark to groups with an equal spec."""
        cfg, specs = self.cfg, self.specs()
        if not cfg.use_eagle:
            return [False] * len(specs)
        marks = cfg.eagle_marks or (False,) * len(specs)
        ids = {i for i, mark in enumerate(marks) if mark} or {
            i for i, spec in enumerate(specs) if not isinstance(spec, MambaSpec)
        }
        if self.hybrid:
            for siblings in self.spec_groups:
                if ids & set(siblings):
                    ids |= set(siblings)
        return [i in ids for i in range(len(specs))]

    # -- the one rule ----------------------------------------------------------------------

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler action, drawn by weight among those possible now.

        A single rule with our own weights: Hypothesis orders separate rules by
        argument count and name and leans towards the first, which starved the
        decode steps in favour of ``reset_prefix_cache``."""
        self.clean = False
        if data.draw(st.booleans(), label="a new scheduler step"):
            # States cached in the last step become usable (Mamba hits wait for it).
            self.m.new_step_starts()
        actions: list[tuple[Callable[[st.DataObject], None], int]] = [(self.reset_prefix_cache, 1)]
        if len(self.requests) < MAX_LIVE_REQUESTS:
            actions.append((self.add_request, 3))
        if self.waiting:
            actions.append((self.schedule_waiting, 4))
        if self.running:
            actions += [(self.schedule_running, 6), (self.preempt, 1)]
        if self.requests:
            actions.append((self.finish, 2))
        if self.cfg.evict:
            actions.append((self.evict_blocks, 1))
        by_name = {action.__name__: action for action, _ in actions}
        choices = [action.__name__ for action, weight in actions for _ in range(weight)]
        by_name[data.draw(st.sampled_from(choices), label="action")](data)
        self.clean = True

    def add_request(self, data: st.DataObject) -> None:
        tokens = data.draw(
            prompts(self.prefixes, self.history, self.cfg.max_prompt_len), label="prompt"
        )
        options = data.draw(REQUEST_OPTIONS, label="options")
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.requests[rid] = self.m.new_request(
            rid,
            tokens,
            cache_salt=options.cache_salt,
            lora_name=options.lora_name,
            skip_reading_prefix_cache=options.skip_reading_prefix_cache,
        )
        self.waiting.append(rid)
        self.remember(tokens)

    def schedule_waiting(self, data: st.DataObject) -> None:
        """Admit a waiting or preempted request: look up its prefix, then allocate the
        rest of its tokens (or a chunk of them), some of them loaded by a KV connector
        (external tokens) when the layout allows it."""
        rid = data.draw(st.sampled_from(self.waiting), label="request")
        request = self.requests[rid]
        step = data.draw(ADMISSION_KNOBS, label="knobs")
        hits, num_hit = self.lookup(request)
        remaining = request.num_tokens - num_hit
        num_external = 0
        if self.cfg.external and data.draw(st.sampled_from((False, False, True)), label="ext"):
            num_external = data.draw(st.integers(1, remaining), label="external tokens")
            event("external tokens")
        rest = remaining - num_external
        num_new = rest if step.chunk is None else min(rest, step.chunk)
        probe = self.maybe_probe(data, request, num_new, num_external, step, num_hit)
        if self.allocate(request, num_new, hits, num_hit, step, num_external, probe) is not None:
            request.num_computed_tokens = num_hit + num_external + num_new
            request.status = RequestStatus.RUNNING
            self.waiting.remove(rid)
            self.running.append(rid)

    def schedule_running(self, data: st.DataObject) -> None:
        """Next chunk of a running request, or one decode step once all its tokens are
        computed (append the sampled token, then allocate its slot)."""
        rid = data.draw(st.sampled_from(self.running), label="request")
        request = self.requests[rid]
        step = data.draw(RUNNING_KNOBS, label="knobs")
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= self.cfg.max_model_len:
                self.release(request, finish=True)  # length limit: the request stops
                return
            request.append_output_token_ids(data.draw(TOKENS, label="token"))
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = remaining if step.chunk is None else min(remaining, step.chunk)
        probe = self.maybe_probe(data, request, num_new, 0, step, 0)
        if self.allocate(request, num_new, None, 0, step, 0, probe) is not None:
            request.num_computed_tokens += num_new

    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.running), label="request")
        self.release(self.requests[rid], finish=False)

    def finish(self, data: st.DataObject) -> None:
        """Finish a running request, or abort a waiting one."""
        rid = data.draw(st.sampled_from(sorted(self.requests)), label="request")
        self.release(self.requests[rid], finish=True)

    def reset_prefix_cache(self, data: st.DataObject) -> None:
        pool = self.m.block_pool
        before = take_state(self.m)
        all_free = pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert self.m.reset_prefix_cache() == all_free
        event(f"reset_prefix_cache -> {all_free}")
        after = take_state(self.m)
        if all_free:
            assert after.hash_map == {}
            assert all(h is None for h in after.hashes)
            expected = dataclasses.replace(
                before,
                hashes=after.hashes,
                hash_map=after.hash_map,
                hash_tokens=after.hash_tokens,
                aliases=after.aliases,
            )
            assert_same_state(after, expected, "successful reset_prefix_cache")
        else:
            assert_same_state(after, before, "refused reset_prefix_cache")

    def evict_blocks(self, data: st.DataObject) -> None:
        """``evict_blocks`` of random ids (held or free, hashed or not, the null block,
        now and then one out of range): only the cache entries of those blocks go,
        duplicates under the same key move up; ref counts, the queue and the tables
        stay. An id out of range is refused before anything changes."""
        m = self.m
        n = self.cfg.num_blocks
        ids = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3), label="evict")
        if data.draw(st.sampled_from((False,) * 9 + (True,)), label="out of range"):
            ids.add(n + data.draw(st.integers(0, 2), label="bad id"))
        before = take_state(m)
        if max(ids) >= n:
            with pytest.raises(InvalidArgumentError, match="out of range"):
                m.evict_blocks(ids)
            assert_same_state(take_state(m), before, "refused evict_blocks")
            event("evict_blocks refused")
            return
        m.evict_blocks(ids)
        hashes = list(before.hashes)
        hash_tokens = list(before.hash_tokens)
        aliases = list(before.aliases)
        hash_map = {key: list(ids_) for key, ids_ in before.hash_map.items()}
        for block_id in sorted(ids):
            key = before.hashes[block_id]
            if key is None:
                continue
            event("evict_blocks dropped an entry")
            for dropped in (key, *before.aliases[block_id]):
                hash_map[dropped].remove(block_id)
            hashes[block_id] = hash_tokens[block_id] = None
            aliases[block_id] = ()
            for group, table_map in enumerate(before.tables):
                for rid, table in table_map.items():
                    self.evicted_held.update(
                        (group, rid, i) for i, b in enumerate(table) if b == block_id
                    )
        expected = dataclasses.replace(
            before,
            hashes=tuple(hashes),
            hash_map={k: tuple(v) for k, v in hash_map.items() if v},
            hash_tokens=tuple(hash_tokens),
            aliases=tuple(aliases),
        )
        assert_same_state(take_state(m), expected, "evict_blocks")

    # -- scheduler moves, each checked against a model ------------------------------------

    def remember(self, tokens: list[int]) -> None:
        self.history.append(list(tokens))
        del self.history[:-MAX_HISTORY]

    def is_cached(self, request: Request, group: int, index: int) -> bool:
        if index >= self.num_hashed_blocks(request, group):
            return False
        key = self.expected_key(request, group, index)
        return self.m.block_pool.cached_block_hash_to_block.get_one_block(key) is not None

    def group_can_hit(self, request: Request, group: int, length: int, cap: int) -> bool:
        """Whether ``group`` can serve a hit of ``length`` tokens (reference §4.7): full
        attention needs every block before it, a sliding window the blocks of one window
        before it (all of them if the prefix is shorter), Mamba the state at it. An EAGLE
        group recomputes its last hit block, so it also needs the block after the end
        (within the ``num_tokens - 1`` cap)."""
        if length == 0:
            return True
        spec = self.specs()[group]
        num_blocks = length // spec.block_size
        if isinstance(spec, MambaSpec):
            return self.is_cached(request, group, num_blocks - 1)
        last = num_blocks - 1
        if self.eagle[group]:
            if (num_blocks + 1) * spec.block_size > cap:
                return False
            last = num_blocks
        first = 0
        if isinstance(spec, SlidingWindowSpec):
            first = max(0, num_blocks - sliding_window_blocks_needed(spec))
        return all(self.is_cached(request, group, i) for i in range(first, last + 1))

    def longest_hit(self, request: Request, groups: Sequence[int], cap: int) -> int:
        """The longest hit of at most ``cap`` tokens, on the groups' common alignment,
        that every one of ``groups`` can serve (the fixed point the hybrid search
        converges to: each group's usable lengths are closed under this search)."""
        align = self.alignment[groups[0]]
        for length in range(cap - cap % align, -1, -align):
            if all(self.group_can_hit(request, g, length, cap) for g in groups):
                return length
        return 0

    def lookup(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """``get_computed_blocks``: side-effect free (but for the request's
        shared_prefix_boundary), block aligned, capped at ``num_tokens - 1``, every hit
        block carries the request's hash, and the hit is the longest usable one."""
        m = self.m
        before = take_state(m)
        num_events = len(m.block_pool.kv_event_queue)
        hits, num_hit, boundary = m.get_computed_blocks(request)
        assert_same_state(take_state(m), before, "get_computed_blocks")
        assert len(m.block_pool.kv_event_queue) == num_events, "a lookup emitted events"
        event("prefix hit" if num_hit else "prefix miss")
        specs = self.specs()
        rid = request.request_id
        # Every lookup records its boundary (0: none), as vLLM's scheduler does.
        assert request.shared_prefix_boundary == boundary
        self.shared_boundary[rid] = boundary
        if not self.cfg.enable_caching or request.skip_reading_prefix_cache:
            assert num_hit == 0 and not any(hits.blocks) and boundary == 0
            return hits, num_hit
        cap = request.num_tokens - 1
        assert 0 <= num_hit <= max(0, cap)
        assert num_hit % m.scheduler_block_size == 0
        assert boundary == 0 or boundary > num_hit
        if boundary:
            event("shared prefix boundary")
        assert len(hits.blocks) == len(specs)
        first_block = m.block_pool.cached_block_hash_to_block.get_one_block
        for group, (spec, blocks) in enumerate(zip(specs, hits.blocks, strict=True)):
            assert len(blocks) * spec.block_size == num_hit, f"group {group} hit length"
            for i, block in enumerate(blocks):
                if block.is_null:
                    assert not isinstance(spec, FullAttentionSpec), "null in a full hit"
                    continue
                key = self.expected_key(request, group, i)
                assert block.block_hash == key
                assert block is first_block(key), "a hit is the first block cached under its key"
            if isinstance(spec, SlidingWindowSpec) and blocks:
                # The hit ends with a run covering one window (or a run from block 0).
                run = min(sliding_window_blocks_needed(spec), len(blocks))
                assert not any(b.is_null for b in blocks[len(blocks) - run :])
        if len(specs) == 1 and isinstance(specs[0], FullAttentionSpec) and not self.eagle[0]:
            # One full-attention group: the hit is the longest cached prefix that the
            # num_tokens - 1 cap allows.
            n = len(hits.blocks[0])
            if (n + 1) * specs[0].block_size <= request.num_tokens - 1:
                assert first_block(self.expected_key(request, 0, n)) is None, (
                    "the hit stopped before the first uncached block"
                )
        if not any(isinstance(spec, ChunkedLocalAttentionSpec) for spec in specs):
            self.check_hit(request, hits, num_hit, boundary, cap)
        return hits, num_hit

    def check_hit(
        self, request: Request, hits: KVCacheBlocks, num_hit: int, boundary: int, cap: int
    ) -> None:
        """The hit against the independent oracle: its length, which blocks are real
        (full attention: all; a window: the last window's worth; Mamba: the last one),
        and the shared-prefix boundary (how far the first group searched alone got)."""
        specs = self.specs()
        every_group = list(range(len(specs)))
        expected = self.longest_hit(request, every_group, cap)
        assert num_hit == expected, f"hit {num_hit}, the longest usable hit is {expected}"
        if self.cfg.use_eagle and num_hit:
            event("EAGLE hit")
        if any(self.eagle):
            # EAGLE never hits more than the same cache without it, minus one block.
            saved = self.eagle
            self.eagle = [False] * len(specs)
            plain = self.longest_hit(request, every_group, cap)
            self.eagle = saved
            assert num_hit <= plain, f"EAGLE hit {num_hit} above the plain hit {plain}"
            if (
                num_hit
                and all(saved)
                and all(spec.block_size == self.alignment[g] for g, spec in enumerate(specs))
            ):
                # Every group drafts at block granularity: one block is given back.
                assert num_hit <= plain - self.alignment[0], "EAGLE gave no block back"
        first = self.longest_hit(request, self.spec_groups[0], cap) if self.hybrid else num_hit
        assert boundary == (first if first > num_hit else 0), "shared prefix boundary"
        for group, (spec, blocks) in enumerate(zip(specs, hits.blocks, strict=True)):
            num_blocks = len(blocks)
            if isinstance(spec, MambaSpec):
                real = range(max(num_blocks - 1, 0), num_blocks)
            elif isinstance(spec, SlidingWindowSpec):
                real = range(max(0, num_blocks - sliding_window_blocks_needed(spec)), num_blocks)
            else:
                real = range(num_blocks)
            assert [i for i, b in enumerate(blocks) if not b.is_null] == list(real), (
                f"group {group}: real hit blocks"
            )

    def maybe_probe(
        self,
        data: st.DataObject,
        request: Request,
        num_new: int,
        num_external: int,
        step: Knobs,
        num_hit: int,
    ) -> AllocationProbe | None:
        """``probe`` with the arguments of the coming allocation, now and then: it must
        change nothing and report the hit the lookup found; ``allocate`` then checks its
        prediction against the outcome."""
        if not self.cfg.probe or not data.draw(st.booleans(), label="probe"):
            return None
        m = self.m
        before = take_state(m)
        num_events = len(m.block_pool.kv_event_queue)
        boundary = request.shared_prefix_boundary
        probe = m.probe(
            request,
            num_new_tokens=num_new,
            options=AllocationOptions(
                num_lookahead_tokens=step.lookahead,
                num_external_computed_tokens=num_external,
                full_sequence_must_fit=step.full_sequence_must_fit,
                reserved_blocks=step.reserved_blocks,
                has_scheduled_reqs=step.has_scheduled_reqs,
            ),
        )
        assert_same_state(take_state(m), before, "probe")
        assert len(m.block_pool.kv_event_queue) == num_events, "probe emitted events"
        assert request.shared_prefix_boundary == boundary, "probe set the boundary"
        assert probe.num_hit_tokens == num_hit, "probe hit differs from the lookup"
        assert probe.num_new_tokens == num_new
        return probe

    def blocks_to_skip(
        self, request_id: str, total_computed_tokens: int
    ) -> list[list[tuple[int, KVCacheBlock]]]:
        """What ``remove_skipped_blocks`` will free, per group, in the order it frees
        them: from the last skipped block down to the first one already null."""
        removed: list[list[tuple[int, KVCacheBlock]]] = []
        for single in self.m.coordinator.single_type_managers:
            table = single.req_to_blocks.get(request_id, [])
            skipped = num_skipped_tokens(single.kv_cache_spec, total_computed_tokens)
            out: list[tuple[int, KVCacheBlock]] = []
            for i in range(min(skipped // single.block_size, len(table)) - 1, -1, -1):
                if table[i].is_null:
                    break
                out.append((i, table[i]))
            removed.append(out)
        return removed

    def reachable_boundaries(self, request: Request) -> tuple[int, ...]:
        """Where later requests resume (only read with a retention interval): the replay
        boundary (the last prompt token; with EAGLE one scheduler block before the last
        whole one) and the shared-prefix junction the lookup noted."""
        if self.cfg.retention is None:
            return ()
        sbs = self.m.scheduler_block_size
        prompt = request.num_prompt_tokens
        replay = max(prompt // sbs * sbs - sbs, 0) if any(self.eagle) else prompt - 1
        junction = self.shared_boundary.get(request.request_id)
        return (replay, junction) if junction else (replay,)

    def retained(self, group: int, index: int, boundaries: Sequence[int]) -> bool:
        """Whether block ``index`` of ``group`` is entered into the cache when it fills:
        full attention caches all; a window or Mamba group what a hit can read."""
        spec = self.specs()[group]
        if isinstance(spec, SlidingWindowSpec):
            eagle = self.eagle[group]
            need = sliding_window_blocks_needed(spec) + (1 if eagle else 0)
            shift = 1 if eagle else 0
        elif isinstance(spec, MambaSpec):
            need, shift = 1, 0
        else:
            return True
        return retained_block(
            index,
            spec.block_size,
            need,
            shift,
            self.alignment[group],
            self.cfg.retention,
            boundaries,
        )

    def allocate(
        self,
        request: Request,
        num_new: int,
        hits: KVCacheBlocks | None,
        num_hit: int,
        step: Knobs,
        num_external: int = 0,
        probe: AllocationProbe | None = None,
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` with the scheduler's arguments, checked against a model.

        Prediction == allocation: ``allocate_slots`` first calls
        ``remove_skipped_blocks`` (which frees out-of-window blocks even when the answer
        is None), then predicts with ``get_num_blocks_to_allocate``. The prediction does
        not depend on that removal: it reads the table lengths (removal only swaps
        blocks for the null block), ``num_cached_block`` membership, and the ref counts
        of the prefix hits, which only a request holding no blocks yet can have (so
        nothing of it can be removed). So we predict before the call with the same
        arguments, compute independently which blocks the removal frees
        (``freed_by_skip``), and require the free count to drop by exactly
        ``prediction - freed_by_skip``, and the model of
        the allocation itself (touched free hits + external blocks + new blocks per
        group) to take exactly ``prediction`` blocks off the free queue.
        """
        m, cfg = self.m, self.cfg
        pool = m.block_pool
        rid = request.request_id
        caching = cfg.enable_caching
        specs = self.specs()
        hit_lists: tuple[Sequence[KVCacheBlock], ...] = hits.blocks if hits is not None else ()
        total = request.num_computed_tokens + num_hit + num_external
        need_slot = min(total + num_new + step.lookahead, cfg.max_model_len)

        before = take_state(m)
        num_events = len(pool.kv_event_queue)
        free_before = pool.get_num_free_blocks()
        removed = self.blocks_to_skip(rid, total)
        freed_by_skip = sum(1 for group in removed for _, b in group if b.ref_cnt == 1)
        num_local = request.num_computed_tokens + num_hit
        predicted = m.coordinator.get_num_blocks_to_allocate(
            rid,
            need_slot,
            hit_lists,
            0,
            total,
            num_local_computed_tokens=num_local,
            num_tokens_main_model=total + num_new,
        )
        watermark = (
            int(cfg.watermark * cfg.num_blocks)  # only for admissions while others run
            if step.has_scheduled_reqs
            and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            else 0
        )
        refused = predicted + watermark > free_before + freed_by_skip - step.reserved_blocks
        if step.full_sequence_must_fit:
            # The admission gate runs first, on the free count before the removal.
            whole = m.coordinator.get_num_blocks_to_allocate(
                rid,
                min(request.num_tokens, cfg.max_model_len),
                hit_lists,
                0,
                total,
                apply_admission_cap=True,
                num_local_computed_tokens=num_local,
                num_tokens_main_model=min(request.num_tokens, cfg.max_model_len),
            )
            refused = refused or whole + watermark > free_before

        # Model of remove_skipped_blocks: each group frees its removed blocks, high
        # index first; unhashed ones to the queue front, hashed ones to the back.
        ref = list(before.ref_cnts)
        queue = list(before.queue)
        tables = [dict(t) for t in before.tables]
        for group, group_removed in enumerate(removed):
            if not group_removed:
                continue
            table = list(tables[group][rid])
            front: list[int] = []
            back: list[int] = []
            for i, block in group_removed:
                table[i] = NULL
                ref[block.block_id] -= 1
                if ref[block.block_id] == 0:
                    hashed = caching and before.hashes[block.block_id] is not None
                    (back if hashed else front).append(block.block_id)
            tables[group][rid] = tuple(table)
            queue = front + queue + back

        result = m.allocate_slots(
            request,
            num_new,
            num_hit,
            hits,
            num_lookahead_tokens=step.lookahead,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=step.delay_cache_blocks,
            full_sequence_must_fit=step.full_sequence_must_fit,
            reserved_blocks=step.reserved_blocks,
            has_scheduled_reqs=step.has_scheduled_reqs,
        )
        after = take_state(m)
        assert (result is None) == refused, (
            f"allocate_slots answered {'None' if result is None else 'blocks'}: predicted "
            f"{predicted}, watermark {watermark}, free {free_before} (+{freed_by_skip} "
            f"skipped), reserved {step.reserved_blocks}"
        )
        if probe is not None:
            assert probe.would_fit == (result is not None), "probe would_fit"
            assert probe.num_blocks_to_allocate == predicted, "probe block count"
            assert probe.num_free_blocks == free_before + freed_by_skip, "probe free count"
            event("probe checked")
        self.check_skipped_are_null(rid, total)
        if freed_by_skip:
            event("remove_skipped_blocks freed blocks")
        if result is None:
            event("allocate_slots -> None")
            # Nothing changes but the out-of-window blocks the removal released.
            expected = dataclasses.replace(
                before, ref_cnts=tuple(ref), queue=tuple(queue), tables=tuple(tables)
            )
            assert_same_state(after, expected, "allocate_slots -> None")
            return None

        # Attach the prefix hits of every group (touch: a free hit leaves the queue),
        # then allocate every group's blocks for the external tokens (two phases), then
        # pop the new blocks of each group, in group order, from the queue front.
        attach = num_external > 0 or any(hit_lists)
        touched_free = 0
        prev_cached: list[int] = []
        for group, spec in enumerate(specs):
            table = list(tables[group].get(rid, ()))
            if attach:
                assert not table, "a waiting request holds no blocks"
                group_hits = hit_lists[group] if hit_lists else ()
                num_skipped = num_skipped_tokens(spec, total) // spec.block_size
                kept = group_hits[num_skipped:]
                for block in kept:
                    if block.is_null:
                        continue
                    if ref[block.block_id] == 0:
                        queue.remove(block.block_id)
                        touched_free += 1
                    ref[block.block_id] += 1
                # Null padding for every skipped position, beyond the hits too.
                table = [NULL] * num_skipped + [b.block_id for b in kept]
                prev_cached.append(len(table))
            else:
                prev_cached.append(before.cached[group].get(rid, 0))
            tables[group][rid] = tuple(table)
        external_ids: list[list[int]] = []
        for group, spec in enumerate(specs):
            table = list(tables[group][rid])
            popped: list[int] = []
            # External tokens already out of view need no block.
            if min(num_external, total - num_skipped_tokens(spec, total)) > 0:
                n = max(0, cdiv(total, spec.block_size) - len(table))
                popped, queue = queue[:n], queue[n:]
                for block_id in popped:
                    ref[block_id] = 1
            tables[group][rid] = tuple(table + popped)
            external_ids.append(popped)
        new_ids: list[list[int]] = []
        for group, spec in enumerate(specs):
            table = list(tables[group][rid])
            n = max(0, cdiv(need_slot + speculative_tokens(spec), spec.block_size) - len(table))
            popped, queue = queue[:n], queue[n:]
            for block_id in popped:
                ref[block_id] = 1
            tables[group][rid] = tuple(table + popped)
            new_ids.append(popped)

        if touched_free:
            event("a free cached block was hit")
        if any(external_ids):
            event("external blocks allocated")
        if any(before.hashes[b] is not None for ids in new_ids + external_ids for b in ids):
            event("allocation evicted a cached block")
        num_taken = touched_free + sum(len(ids) for ids in external_ids + new_ids)
        assert num_taken == predicted, f"prediction {predicted} but the model takes {num_taken}"
        assert free_before - pool.get_num_free_blocks() == predicted - freed_by_skip, (
            f"free count dropped by {free_before - pool.get_num_free_blocks()}, expected "
            f"prediction {predicted} - {freed_by_skip} freed by remove_skipped_blocks"
        )
        got = result.get_block_ids()
        assert got == tuple(new_ids), f"new blocks {got}, expected {new_ids} (queue order)"
        all_new = [b for ids in got for b in ids] + [b for ids in external_ids for b in ids]
        assert NULL not in all_new, "the null block was handed out"
        for table_map in after.tables:
            for other, table_ids in table_map.items():
                if other != rid:
                    assert not set(all_new) & set(table_ids), f"new block held by {other}"
        assert after.queue == tuple(queue), "free queue after allocation"
        assert after.ref_cnts == tuple(ref), "ref counts after allocation"
        assert after.tables == tuple(tables), "block tables after allocation"
        for group, spec in enumerate(specs):
            if isinstance(spec, MambaSpec):
                # Mamba holds the state block of the last computed token and the blocks
                # after it (this step's states and the speculative ones), nothing before.
                held = after.tables[group][rid]
                live = max(total - 1, 0) // spec.block_size
                assert all(b == NULL for b in held[:live]), "Mamba holds an old state"
                assert NULL not in held[live:], "Mamba lost a live state"
                assert len(held) >= cdiv(need_slot, spec.block_size) + (
                    spec.num_speculative_blocks
                ), "Mamba speculative blocks"

        # Caching: blocks that became full up to min(computed + new, num_tokens)
        # (aligned down to the scheduler block size with several groups, one block
        # further in an EAGLE group) get the request's hash unless the retention rule
        # leaves them out; popped blocks lost theirs. Lookahead slots are never cached.
        # A full-attention group whose block is larger than the hash block also enters
        # the prompt's last reusable hash boundary (a partial entry) in its block.
        model = _CacheModel(before)
        tokens_to_cache = min(total + num_new, request.num_tokens)
        aligned = tokens_to_cache
        if self.hybrid:
            aligned -= tokens_to_cache % m.scheduler_block_size
        boundaries = self.reachable_boundaries(request)
        # Events: one removal per key of each popped cached block, in pop order; then per
        # group one BlockStored for the blocks cached (parent: the logical block before)
        # and the partial entry's.
        expected_events: list[KVCacheEvent] = [
            removed
            for ids in external_ids + new_ids
            for b in ids
            for removed in model.removals(before, b)
        ]
        model.drop(all_new)
        for group, spec in enumerate(specs):
            cached_now = prev_cached[group]
            group_tokens = aligned
            if self.hybrid and self.eagle[group] and aligned > 0:
                group_tokens = min(tokens_to_cache, aligned + spec.block_size)
            caches = caching and not step.delay_cache_blocks
            if caches:
                cached_now = max(cached_now, group_tokens // spec.block_size)
            assert after.cached[group].get(rid, 0) == cached_now, f"group {group} cached count"
            final_table = tables[group][rid]
            stored: list[bytes] = []
            for i in range(prev_cached[group], cached_now):
                block_id = final_table[i]
                if block_id == NULL:
                    continue
                if not self.retained(group, i, boundaries):
                    event("retention left a block out")
                    continue
                expected_events += model.removals(None, block_id)  # a partial entry
                model.drop([block_id])
                key = self.expected_key(request, group, i)
                model.insert(key, block_id, (i + 1) * spec.block_size)
                stored.append(get_block_hash(key))
            if cached_now > prev_cached[group]:
                first, bs = prev_cached[group], spec.block_size
                expected_events.append(
                    BlockStored(
                        block_hashes=stored,
                        parent_block_hash=(
                            get_block_hash(self.expected_key(request, group, first - 1))
                            if first
                            else None
                        ),
                        token_ids=request.token_ids_between(first * bs, cached_now * bs),
                        block_size=bs,
                        lora_id=None,
                        medium=MEDIUM_GPU,
                        lora_name=request.lora_name,
                        group_idx=group,
                    )
                )
            if caches and isinstance(spec, FullAttentionSpec):
                expected_events += self.partial_tail(model, request, group, group_tokens, tables)
        assert after.hashes == tuple(model.hashes), "block hashes after allocation"
        assert after.hash_tokens == tuple(model.hash_tokens), "cached prefix lengths"
        assert [set(a) for a in after.aliases] == [set(a) for a in model.aliases], "second keys"
        assert after.hash_map == model.hash_map_state(), "hash map"
        if cfg.events:
            emitted = [
                dataclasses.replace(e, extra_keys=None) if isinstance(e, BlockStored) else e
                for e in pool.kv_event_queue[num_events:]
            ]
            assert emitted == expected_events, "events of allocate_slots"
        return result

    def partial_tail(
        self,
        model: _CacheModel,
        request: Request,
        group: int,
        num_tokens: int,
        tables: list[dict[str, tuple[int, ...]]],
    ) -> list[KVCacheEvent]:
        """vLLM's FullAttentionManager._cache_partial_tail_block: the prompt's partial
        entry (``partial_tail_entry``) is entered in its block once computed; as a
        second key when the block already has its longer full key, replacing a shorter
        entry. Returns the events (removals, then the entry's BlockStored)."""
        entry = self.partial_tail_entry(request, group)
        if entry is None:
            return []
        boundary, key = entry
        hbs = self.m.hash_block_size
        table = tables[group][request.request_id]
        index = boundary // self.specs()[group].block_size
        if boundary > num_tokens or index >= len(table):
            return []  # not computed yet
        block_id = table[index]
        if model.hashes[block_id] == key or key in model.aliases[block_id]:
            return []
        fine = get_block_hash(key)
        events: list[KVCacheEvent] = []
        current = model.hash_tokens[block_id]
        if current is not None and current < boundary:
            events += model.removals(None, block_id)
            model.drop([block_id])
        model.insert(key, block_id, boundary)
        event("a partial entry was registered")
        events.append(
            BlockStored(
                block_hashes=[fine],
                parent_block_hash=request.block_hashes[boundary // hbs - 2]
                if boundary > hbs
                else None,
                token_ids=request.token_ids_between(boundary - hbs, boundary),
                block_size=hbs,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=request.lora_name,
                group_idx=group,
            )
        )
        return events

    def partial_tail_entry(self, request: Request, group: int) -> tuple[int, bytes] | None:
        """(boundary, key) of the partial entry a full-attention group enters for the
        request's prompt: its last reusable hash boundary (num_prompt_tokens - 1, all
        of it with EAGLE, rounded down to the hash block) if it lies inside a block."""
        spec = self.specs()[group]
        hbs = self.m.hash_block_size
        if not isinstance(spec, FullAttentionSpec) or spec.block_size == hbs:
            return None
        limit = request.num_prompt_tokens - (0 if self.eagle[group] else 1)
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary % spec.block_size == 0:
            return None
        return boundary, request.block_hashes[boundary // hbs - 1] + group.to_bytes(4, "big")

    def partial_keys(self, request: Request, group: int, index: int) -> set[bytes]:
        """The keys of the hash boundaries strictly inside block ``index``."""
        scale = self.specs()[group].block_size // self.m.hash_block_size
        suffix = group.to_bytes(4, "big")
        fine = request.block_hashes[index * scale : (index + 1) * scale - 1]
        return {block_hash + suffix for block_hash in fine}

    def check_skipped_are_null(self, request_id: str, total_computed_tokens: int) -> None:
        """After ``allocate_slots`` every block before the window is the null block."""
        for single in self.m.coordinator.single_type_managers:
            table = single.req_to_blocks.get(request_id, [])
            skipped = num_skipped_tokens(single.kv_cache_spec, total_computed_tokens)
            k = min(skipped // single.block_size, len(table))
            assert all(b.is_null for b in table[:k]), "an out-of-window block is still held"

    def release(self, request: Request, finish: bool) -> None:
        """Finish (``status = FINISHED``, then ``free``) or preempt (``free``, then
        ``preempt()``), checked against a model of ``free``: each group's blocks are
        released last block first; unhashed ones go to the front of the queue, hashed
        ones to the back; hashes stay."""
        m = self.m
        rid = request.request_id
        before = take_state(m)
        if finish:
            request.status = RequestStatus.FINISHED
            m.free(request)
        else:
            m.free(request)
            request.preempt()
        after = take_state(m)

        ref = list(before.ref_cnts)
        fronts: list[list[int]] = []
        backs: list[list[int]] = []
        for group_tables in before.tables:
            front: list[int] = []
            back: list[int] = []
            for block_id in reversed(group_tables.get(rid, ())):
                if block_id == NULL:
                    continue
                ref[block_id] -= 1
                if ref[block_id] == 0:
                    hashed = self.cfg.enable_caching and before.hashes[block_id] is not None
                    (back if hashed else front).append(block_id)
            fronts.append(front)
            backs.append(back)
        # Front: each group's unhashed blocks are prepended in turn, so the last group's
        # come first. Back: hashed blocks, each group's in reverse table order (the
        # relative order of different groups' hashed blocks is not pinned down here).
        expected_front = [b for front in reversed(fronts) for b in front]
        num_back = sum(len(back) for back in backs)
        queue = list(after.queue)
        assert queue[: len(expected_front)] == expected_front, "unhashed blocks go first"
        middle = queue[len(expected_front) : len(queue) - num_back]
        assert middle == list(before.queue), "blocks already free keep their order"
        tail = queue[len(queue) - num_back :]
        assert Counter(tail) == Counter(b for back in backs for b in back)
        for back in backs:
            assert is_subsequence(back, tail), "hashed blocks are queued last block first"
        if len(backs) == 1:
            assert tail == backs[0]

        expected = dataclasses.replace(
            before,
            ref_cnts=tuple(ref),
            queue=after.queue,
            tables=tuple({r: t for r, t in g.items() if r != rid} for g in before.tables),
            cached=tuple({r: n for r, n in g.items() if r != rid} for g in before.cached),
        )
        assert_same_state(after, expected, "free")
        self.evicted_held = {entry for entry in self.evicted_held if entry[1] != rid}

        if finish:
            self.requests.pop(rid)
            self.shared_boundary.pop(rid, None)
            self.remember(request.token_ids_between(0, request.num_tokens))
            if rid in self.waiting:
                self.waiting.remove(rid)
        else:
            assert request.status == RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
            self.waiting.append(rid)
        if rid in self.running:
            self.running.remove(rid)

    # -- checked after every step -----------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        if self._manager is None:
            return
        self.clean = False
        m = self.m
        pool = m.block_pool
        check_invariants(m)
        usable = pool.num_gpu_blocks - 1
        assert m.usage == 1.0 - pool.get_num_free_blocks() / usable
        specs = self.specs()
        held_any = False
        for group, single in enumerate(m.coordinator.single_type_managers):
            spec = specs[group]
            assert set(single.req_to_blocks) <= set(self.running), "a stopped request holds blocks"
            assert set(single.num_cached_block) <= set(single.req_to_blocks)
            for rid, blocks in single.req_to_blocks.items():
                held_any = held_any or any(not b.is_null for b in blocks)
                request = self.requests[rid]
                num_cached = single.num_cached_block.get(rid, 0)
                for i, block in enumerate(blocks):
                    if block.is_null:
                        assert not isinstance(spec, FullAttentionSpec), "null in a full table"
                        continue
                    # Partial entries (a prompt's boundary inside the block, this
                    # request's or another's sharing the block) stand for a shorter
                    # prefix of the same tokens.
                    partial = self.partial_keys(request, group, i)
                    aliases = m.block_pool.aliases_of(block)
                    assert aliases <= partial, "a second key for another prefix"
                    if block.block_hash in partial:
                        continue
                    if i >= num_cached:
                        assert block.block_hash is None, (
                            f"group {group}: {rid} block {i} is hashed but not yet cached"
                        )
                    elif block.block_hash is not None:
                        assert block.block_hash == self.expected_key(request, group, i), (
                            f"group {group}: {rid} block {i} carries another prefix's hash"
                        )
                    elif self.cfg.enable_caching and (group, rid, i) not in self.evicted_held:
                        assert not isinstance(spec, FullAttentionSpec), (
                            f"group {group}: {rid} cached full-attention block {i} has no hash"
                        )
        for rid in self.running:
            # Cascade attention: leading full-attention blocks shared by every request
            # that holds blocks in the group; other attention types report 0.
            common = m.get_num_common_prefix_blocks(rid)
            for group, single in enumerate(m.coordinator.single_type_managers):
                expected = 0
                if self.cfg.enable_caching and isinstance(specs[group], FullAttentionSpec):
                    holders = len(single.req_to_blocks)
                    for block in single.req_to_blocks.get(rid, []):
                        if block.ref_cnt != holders:
                            break
                        expected += 1
                assert common[group] == expected, f"group {group}: common prefix of {rid}"
        if not held_any:
            event("pool whole between steps")
            assert pool.get_num_free_blocks() == usable, "nothing is held but blocks are missing"
            assert m.usage == 0.0
        self.replay_events()
        self.clean = True

    def replay_events(self) -> None:
        """Drain ``take_events`` into the model of the cache (stored adds, removed
        drops, cleared empties) and require it to equal the pool's hash map: the events
        are complete and gap-free. Counts per key, since several blocks may be cached
        under one key (duplicates)."""
        m = self.m
        events = m.take_events()
        if not self.cfg.events:
            assert events == [], "events without enable_kv_cache_events"
            return
        specs = self.specs()
        model = self.event_model
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.group_idx is not None and 0 <= ev.group_idx < len(specs)
                spec = specs[ev.group_idx]
                # A cache_full_blocks call (its blocks), or a partial entry (one hash block).
                assert ev.block_size in (spec.block_size, m.hash_block_size), "block size"
                assert ev.kv_cache_spec_kind == spec.kind.value
                window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
                assert ev.kv_cache_spec_sliding_window == window
                assert ev.medium == MEDIUM_GPU
                assert len(ev.token_ids) % ev.block_size == 0
                assert len(ev.block_hashes) <= len(ev.token_ids) // ev.block_size
                for block_hash in ev.block_hashes:
                    model[(ev.group_idx, block_hash)] += 1
            elif isinstance(ev, BlockRemoved):
                assert ev.group_idx is not None and ev.medium == MEDIUM_GPU
                assert len(ev.block_hashes) == 1
                for block_hash in ev.block_hashes:
                    assert model[(ev.group_idx, block_hash)] > 0, "removed a hash never stored"
                    model[(ev.group_idx, block_hash)] -= 1
            else:
                assert isinstance(ev, AllBlocksCleared)
                model.clear()
        cache = m.block_pool.cached_block_hash_to_block
        expected = Counter(
            {(get_group_id(k), get_block_hash(k)): len(cache.blocks_of(k)) for k in cache}
        )
        assert +model == expected, "the replayed events disagree with the hash map"
        if events:
            event("events replayed")

    def teardown(self) -> None:
        """Free every request; the pool must be whole again."""
        if self._manager is None or not self.clean:
            return
        for rid in sorted(self.requests):
            self.release(self.requests[rid], finish=True)
        m = self.m
        check_invariants(m)
        assert m.block_pool.get_num_free_blocks() == self.cfg.num_blocks - 1
        assert m.usage == 0.0
        for single in m.coordinator.single_type_managers:
            assert not single.req_to_blocks and not single.num_cached_block
        self.replay_events()


# KVSERVICE_STATE_MACHINE_SCALE=10 runs ten times as many examples (a longer soak).
SCALE = float(os.environ.get("KVSERVICE_STATE_MACHINE_SCALE", "1"))


def machine_settings(max_examples: int, steps: int) -> settings:
    return settings(
        max_examples=max(1, round(max_examples * SCALE)),
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


SETTINGS = machine_settings(60, 40)


class FullAttentionMachine(AllocatorMachine):
    """(a) One full-attention group, block 4 or 16."""

    configs = full_attention_configs()


class HybridSameBlockMachine(AllocatorMachine):
    """(b) Full attention + sliding window(s), one block size."""

    configs = hybrid_same_block_configs()


class HybridMixedBlockMachine(AllocatorMachine):
    """(c) Full attention and sliding window with different block sizes."""

    configs = hybrid_mixed_block_configs()


class NoPrefixCacheMachine(AllocatorMachine):
    """(d) Prefix caching disabled."""

    configs = no_caching_configs()


class LocalAttentionMachine(AllocatorMachine):
    """(e) Chunked local attention and lone sliding-window groups."""

    configs = local_attention_configs()


TestFullAttention = FullAttentionMachine.TestCase
TestFullAttention.settings = SETTINGS
TestHybridSameBlock = HybridSameBlockMachine.TestCase
TestHybridSameBlock.settings = SETTINGS
TestHybridMixedBlock = HybridMixedBlockMachine.TestCase
TestHybridMixedBlock.settings = SETTINGS
TestNoPrefixCache = NoPrefixCacheMachine.TestCase
TestNoPrefixCache.settings = SETTINGS
TestLocalAttention = LocalAttentionMachine.TestCase
TestLocalAttention.settings = SETTINGS

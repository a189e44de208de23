"""Stateful property test for partial-block prefix hits and copy-on-write.

Hybrid layouts with a Mamba "align" group larger than the hash block (so partial hits
are on), beside full attention and a one-hash-block sliding window. The machine plays
the scheduler and a model runtime at once: it admits and advances requests, frees and
evicts, and at the end of each step zeroes the fresh blocks, applies the queued
copies and then "writes" every scheduled token into a model of the KV memory (an
attention slot holds the prefix its token ends; a Mamba block holds the prefix its
state summarises).

Checked after every step: the allocator invariants (``check_invariants``: ref counts
with copy holds, a copy's ends never free before the copy is taken, no shared block a
request may still write); that ``probe`` predicted exactly the blocks an allocation
took and whether it fit; that every block a request reads (its hit, its window, its
Mamba state) holds the right content, which fails if a shared tail was written in
place or a copy was missing; and that every prefix-cache entry describes the content
of its block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_block import get_block_hash, get_group_id
from kvservice.core.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus
from tests.core.strategies import full, mamba, sliding
from tests.core.test_state_machine import machine_settings

HASH_BLOCK = 2
MAX_MODEL_LEN = 64

LAYOUTS: dict[str, tuple[KVCacheSpec, ...]] = {
    "f2m4": (full(2), mamba(4, mode="align")),
    "f4m4": (full(4), mamba(4, mode="align")),
    "f4m8": (full(4), mamba(8, mode="align")),
    "m4f4": (mamba(4, mode="align"), full(4)),
    "f4s2m4": (full(4), sliding(2, 4), mamba(4, mode="align")),
    "f4m4s": (full(4), mamba(4, speculative=1, mode="align")),
    "f4ma4m8": (full(4), mamba(4), mamba(8, mode="align")),  # an "all" group beside
}

Prefix = tuple[int, ...]
# Attention block: slot -> the prefix its token ends; Mamba block: the prefix summarised.
Content = dict[int, Prefix] | Prefix


@dataclass
class Planned:
    """An allocation of this step whose tokens the model writes when the step ends."""

    request: Request
    start: int
    num_tokens: int


@dataclass
class Memory:
    """What the KV memory holds, block by block (absent: zeroed)."""

    blocks: dict[int, Content] = field(default_factory=dict)

    def slot(self, block_id: int, index: int) -> Prefix | None:
        content = self.blocks.get(block_id)
        return content.get(index) if isinstance(content, dict) else None

    def write_slot(self, block_id: int, index: int, prefix: Prefix) -> None:
        content = self.blocks.get(block_id)
        if not isinstance(content, dict):
            content = self.blocks[block_id] = {}
        content[index] = prefix


class PartialHitMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.specs: tuple[KVCacheSpec, ...] = ()
        self.memory = Memory()
        self.running: dict[str, Request] = {}
        self.planned: list[Planned] = []
        self.prefix_of: dict[bytes, Prefix] = {}
        self.bases: list[list[int]] = []
        self.next_id = 0

    @property
    def manager(self) -> KVCacheManager:
        assert self.m is not None
        return self.m

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.specs = LAYOUTS[data.draw(st.sampled_from(sorted(LAYOUTS)), label="layout")]
        groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(self.specs)]
        config = KVCacheConfig(
            data.draw(st.integers(8, 40), label="num_blocks"),
            [],
            groups,
            needs_kv_cache_zeroing=True,
        )
        self.m = KVCacheManager(config, MAX_MODEL_LEN, hash_block_size=HASH_BLOCK)
        assert self.m.coordinator.enable_partial_hash_hits  # type: ignore[attr-defined]
        tokens = st.lists(st.integers(0, 3), min_size=4, max_size=24)
        self.bases = [data.draw(tokens, label="base") for _ in range(3)]

    # -- scheduler moves --------------------------------------------------------------

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        m = self.manager
        base = data.draw(st.sampled_from(self.bases))
        keep = data.draw(st.integers(0, len(base)))
        suffix = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=10))
        prompt = (base[:keep] + suffix)[: MAX_MODEL_LEN - 8]
        request = m.new_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        hit, num_hit, _ = m.get_computed_blocks(request)
        if self.written_this_step() & {b.block_id for group in hit.blocks for b in group}:
            # The hit reads KV this step computes: as in vLLM, only the attention of the
            # same forward pass could see it, so a copy or a state read must wait for
            # the step's end (an entry moved this step is the core's to defer).
            self.end_step()
            hit, num_hit, _ = m.get_computed_blocks(request)
        self.check_hit_shape(hit.blocks, num_hit)
        remaining = request.num_tokens - num_hit
        num_new = self.split(request, num_hit, data.draw(st.integers(1, remaining), label="chunk"))
        if self.allocate(request, num_new, num_hit, hit):
            request.status = RequestStatus.RUNNING
            self.running[request.request_id] = request

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        busy = {p.request.request_id for p in self.planned}
        idle = sorted(rid for rid in self.running if rid not in busy)
        if not idle:
            return
        request = self.running[data.draw(st.sampled_from(idle))]
        if request.num_tokens + 1 >= MAX_MODEL_LEN:
            return
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining == 0:
            request.append_output_token_ids(data.draw(st.integers(0, 5)))
            remaining = 1
        num_new = data.draw(st.integers(1, remaining), label="chunk")
        self.allocate(request, self.split(request, request.num_computed_tokens, num_new), 0, None)

    def split(self, request: Request, start: int, num_new: int) -> int:
        """Clip a prefill chunk where vLLM's scheduler clips it for Mamba "align"
        (``_mamba_block_aligned_split``): a state exists only where a chunk ends, so
        chunks before the prompt's end stop on block boundaries, at the last boundary
        whose state a later request can reuse, and at the prompt's last reusable hash
        boundary; one starting inside a block stops at that block's end."""
        m = self.manager
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new
        bs = m.scheduler_block_size
        end = start + num_new
        if end < prefill_end and end // bs * bs > start:
            end = end // bs * bs
        last_cache_position = max(request.num_tokens - 1, 0) // bs * bs
        tail = max(request.num_prompt_tokens - 1, 0) // HASH_BLOCK * HASH_BLOCK
        stops = (
            (start // bs + 1) * bs if start % bs else 0,
            last_cache_position,
            tail if last_cache_position < tail < request.num_prompt_tokens else 0,
        )
        return min((stop for stop in stops if start < stop < end), default=end) - start

    @rule()
    def end_step(self) -> None:
        """The runtime's turn: zero, copy, then the model writes the step's tokens."""
        m = self.manager
        for block_id in m.take_new_block_ids():
            self.memory.blocks.pop(block_id, None)
        taken = m.take_kv_cache_block_copies()
        snapshot = dict(self.memory.blocks)  # copies read the state before any of them
        for copy in taken.copies:
            source = snapshot.get(copy.src_block_id)
            if source is None:
                self.memory.blocks.pop(copy.dst_block_id, None)
            else:
                self.memory.blocks[copy.dst_block_id] = (
                    dict(source) if isinstance(source, dict) else source
                )
        for planned in self.planned:
            self.check_reads(planned)
            self.write(planned)
            planned.request.num_computed_tokens = planned.start + planned.num_tokens
        self.planned.clear()
        m.free_retained_blocks(taken.retained_blocks)
        m.new_step_starts()

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        busy = {p.request.request_id for p in self.planned}
        idle = sorted(rid for rid in self.running if rid not in busy)
        if not idle:
            return
        request = self.running.pop(data.draw(st.sampled_from(idle)))
        request.status = RequestStatus.FINISHED
        self.manager.free(request)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        num_blocks = self.manager.block_pool.num_gpu_blocks
        ids = data.draw(st.sets(st.integers(1, num_blocks - 1), max_size=3))
        self.manager.evict_blocks(ids)

    # -- checks -----------------------------------------------------------------------

    def allocate(self, request: Request, num_new: int, num_hit: int, hit: object) -> bool:
        m = self.manager
        for i, block_hash in enumerate(request.block_hashes):
            self.prefix_of[block_hash] = tuple(request.all_token_ids[: (i + 1) * HASH_BLOCK])
        probe = m.probe(request, num_new)
        free_before = m.block_pool.get_num_free_blocks()
        freed_by_skipping = probe.num_free_blocks - free_before
        start = request.num_computed_tokens + num_hit
        new = m.allocate_slots(request, num_new, num_hit, hit)  # type: ignore[arg-type]
        assert (new is not None) == probe.would_fit, (probe, new)
        if new is None:
            return False
        taken = free_before + freed_by_skipping - m.block_pool.get_num_free_blocks()
        assert taken == probe.num_blocks_to_allocate, (taken, probe)
        self.planned.append(Planned(request, start, num_new))
        return True

    def written_this_step(self) -> set[int]:
        """Blocks the model writes when the step ends."""
        written: set[int] = set()
        for planned in self.planned:
            end = planned.start + planned.num_tokens
            tables = self.manager.coordinator.get_blocks(planned.request.request_id)
            for spec, table in zip(self.specs, tables, strict=True):
                bs = spec.block_size
                if isinstance(spec, MambaSpec):
                    written.add(table[cdiv(end, bs) - 1].block_id)
                else:
                    written.update(table[p // bs].block_id for p in range(planned.start, end))
        return written

    def check_hit_shape(self, hit: tuple[object, ...], num_hit: int) -> None:
        assert num_hit % HASH_BLOCK == 0
        for spec, blocks in zip(self.specs, hit, strict=True):
            assert isinstance(blocks, list | tuple)
            assert len(blocks) == (cdiv(num_hit, spec.block_size) if num_hit else 0)

    def check_reads(self, planned: Planned) -> None:
        """Every block the step reads holds what the request computed before it."""
        tokens = planned.request.all_token_ids
        start = planned.start
        tables = self.manager.coordinator.get_blocks(planned.request.request_id)
        for spec, table in zip(self.specs, tables, strict=True):
            if isinstance(spec, MambaSpec):
                if start:
                    block = table[cdiv(start, spec.block_size) - 1]
                    assert not block.is_null
                    assert self.memory.blocks.get(block.block_id) == tuple(tokens[:start]), (
                        f"state block {block.block_id} does not hold the state at {start}"
                    )
                continue
            first = 0
            if isinstance(spec, SlidingWindowSpec):
                first = max(0, start - spec.sliding_window + 1)
            for pos in range(first, start):
                block = table[pos // spec.block_size]
                assert not block.is_null, f"position {pos} reads the null block"
                got = self.memory.slot(block.block_id, pos % spec.block_size)
                assert got == tuple(tokens[: pos + 1]), (
                    f"block {block.block_id} slot {pos % spec.block_size} is stale"
                )

    def write(self, planned: Planned) -> None:
        tokens = planned.request.all_token_ids
        end = planned.start + planned.num_tokens
        tables = self.manager.coordinator.get_blocks(planned.request.request_id)
        for spec, table in zip(self.specs, tables, strict=True):
            bs = spec.block_size
            if isinstance(spec, MambaSpec):
                if spec.mamba_cache_mode == "all":
                    # Mode "all" also keeps the state at each block boundary it passes.
                    first = planned.start // bs + 1
                    for boundary in range(first * bs, end, bs):
                        self.memory.blocks[table[boundary // bs - 1].block_id] = tuple(
                            tokens[:boundary]
                        )
                self.memory.blocks[table[cdiv(end, bs) - 1].block_id] = tuple(tokens[:end])
                continue
            for pos in range(planned.start, end):
                block = table[pos // bs]
                self.memory.write_slot(block.block_id, pos % bs, tuple(tokens[: pos + 1]))

    @invariant()
    def allocator_invariants(self) -> None:
        if self.m is not None:
            check_invariants(self.m)

    @invariant()
    def cache_entries_describe_their_blocks(self) -> None:
        """Between steps, every entry's block holds the prefix its hash stands for."""
        if self.m is None or self.planned:
            return
        cache = self.m.block_pool.cached_block_hash_to_block
        for key in cache:
            prefix = self.prefix_of[get_block_hash(key)]
            spec = self.specs[get_group_id(key)]
            for block in cache.blocks_of(key):
                num_tokens = block.block_hash_num_tokens
                assert num_tokens is not None
                if key != block.block_hash:
                    # A second key: a shorter prefix ending inside an attention block
                    # that since filled up (its first slots still hold that prefix).
                    assert not isinstance(spec, MambaSpec) and len(prefix) < num_tokens
                else:
                    assert num_tokens == len(prefix)
                if isinstance(spec, MambaSpec):
                    assert self.memory.blocks.get(block.block_id) == prefix, (
                        f"cached state block {block.block_id} was overwritten"
                    )
                    continue
                block_start = (cdiv(len(prefix), spec.block_size) - 1) * spec.block_size
                for pos in range(block_start, len(prefix)):
                    got = self.memory.slot(block.block_id, pos - block_start)
                    assert got == prefix[: pos + 1], f"cached block {block.block_id} is stale"


TestPartialHits = PartialHitMachine.TestCase
TestPartialHits.settings = machine_settings(60, 40)

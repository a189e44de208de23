"""kvservice's offload index against vLLM 0.33's ``CPUOffloadingManager``, and the
priority policy vLLM lacks.

**Differential.** ``Twin`` drives vLLM's manager and ``KVServiceOffloadingManager`` with
the same calls, the way the offloading connector's scheduler makes them: requests over
prompts that share prefixes (one or two KV cache groups; key positions known for
every key, none, or some), lookups until the first miss and loads of the hits,
stores of each request's next keys (and re-offers of earlier ones) with their
completions (some failed, some with keys that were never prepared), loads completed
late, touches, requests finished (twice, or never seen), cache resets with jobs in
flight, and the schedule end. Every answer (lookups, load and store specs with their
chunk ids, evicted keys, request contexts), every event, every stats payload, and
after every call every resident key with its chunk id and ref count, in the policy's
own order, plus the free chunk list, must be identical. Tiers of 3 to 64 chunks, so
evictions and refused stores are frequent; store thresholds 0 and 3 (with a tracker
small enough to drop keys); ``lru`` and ``arc``; and kvservice's ``priority`` policy
with no retention asked for, which must decide exactly as vLLM's ``lru``. Seeded loops,
and a hypothesis state machine over the same operations. Then vLLM's own scheduler and
``OffloadingConnector`` (the fake worker of ``offload_harness``) on vLLM's
``CPUOffloadingSpec`` and on ``KVServiceOffloadingSpec`` must decide alike step by step.

**Priority policy.** Lower priorities are evicted first and LRU within a priority;
reuse raises a chunk's priority; pinned keys are never evicted until their TTL runs
out; a pin past the pinned budget is refused, changing nothing; and the adapter's
``kv_transfer_params`` (``kvservice_priority``, ``cache_control``) reach the index.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvservice.core.errors import InvalidArgumentError, QuotaExceededError
from kvservice.core.offload_index import LOOKUP_HIT, LOOKUP_MISS, OffloadIndex, RequestAccess
from kvservice.integrations.vllm.offloading import (
    KVServiceOffloadingManager,
    KVServiceOffloadingSpec,
)
from kvservice.integrations.vllm.testing import SchedulerSetup, build_scheduler
from tests.vllm.offload_harness import OffloadWorkload
from tests.vllm.scheduler_harness import first_difference

TOKENS_PER_CHUNK = 16

# -- the twin --------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One tier: vLLM's policy, and the policy kvservice runs beside it (the same,
    unless ``ours`` names another that must decide alike)."""

    policy: str
    num_chunks: int
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    num_groups: int = 1
    ours: str | None = None

    def __str__(self) -> str:
        ours = f"({self.ours})" if self.ours else ""
        return (
            f"{self.policy}{ours}-{self.num_chunks}c-t{self.store_threshold}"
            f"-m{self.max_tracker_size}-g{self.num_groups}"
        )


@dataclass
class TwinRequest:
    req_id: str
    # Offer order: chunk by chunk, each chunk's keys group by group.
    keys: list[bytes]
    ref_ctx: ReqContext
    our_ctx: ReqContext
    next_store: int = 0
    finished: bool = False


@dataclass
class Job:
    req: TwinRequest
    keys: list[bytes]


def comparable(value: Any) -> Any:
    """A manager's answer as plain data (load/store specs hold numpy arrays)."""
    if isinstance(value, PrepareStoreOutput):
        return ("store", value.keys_to_store, comparable(value.store_spec), value.evicted_keys)
    if isinstance(value, LoadStoreSpec):
        assert type(value) is CPULoadStoreSpec
        ids = value.block_ids
        return ("spec", ids.dtype.str, ids.tolist())
    if isinstance(value, RequestOffloadingContext):
        return ("context", value.policy)
    return value


def make_prompts(rng: random.Random, num_prompts: int) -> list[list[bytes]]:
    """Prompts as block hashes: a few shared prefixes, each with unique suffixes."""
    prefixes = [[rng.randbytes(8) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    return [
        rng.choice(prefixes) + [rng.randbytes(8) for _ in range(rng.randint(1, 8))]
        for _ in range(num_prompts)
    ]


class Twin:
    """vLLM's ``CPUOffloadingManager`` and kvservice's manager, driven alike and
    compared after every call (see the module docstring)."""

    MAX_ACTIVE = 10

    def __init__(self, setup: Setup, seed: int) -> None:
        self.setup = setup
        self.ref = CPUOffloadingManager(
            setup.num_chunks,
            cache_policy=setup.policy,
            enable_events=True,
            store_threshold=setup.store_threshold,
            max_tracker_size=setup.max_tracker_size,
        )
        self.ours = KVServiceOffloadingManager(
            setup.num_chunks,
            setup.ours or setup.policy,
            enable_events=True,
            store_threshold=setup.store_threshold,
            max_tracker_size=setup.max_tracker_size,
        )
        self.prompts = make_prompts(random.Random(seed), 12)
        self.requests: list[TwinRequest] = []
        self.stores: list[Job] = []
        self.loads: list[Job] = []
        self.num_requests = 0
        self.log: list[str] = []

    # -- calling both --

    def call(self, name: str, req: TwinRequest | None, *args: Any, **kwargs: Any) -> Any:
        """``name(*args, req_context=ctx, **kwargs)`` on both managers (no ``req_context``
        when ``req`` is None); the answers must agree, then the tiers."""
        self.log.append(f"{name}{'' if req is None else ' ' + req.req_id} {args} {kwargs}")
        answers = []
        for manager, ctx in ((self.ref, req and req.ref_ctx), (self.ours, req and req.our_ctx)):
            context = {} if req is None else {"req_context": ctx}
            answers.append(getattr(manager, name)(*args, **context, **kwargs))
        ref, ours = (comparable(a) for a in answers)
        assert ours == ref, f"{name}: vLLM {ref!r}, kvservice {ours!r} after {self.log[-8:]}"
        self.check_tiers(name)
        return answers[0]

    def check_tiers(self, after: str) -> None:
        ref, ours = self.ref_state(), self.our_state()
        if ours != ref:
            raise AssertionError(f"tiers differ after {after}: {self.log[-8:]}\n{ref}\n{ours}")

    def ref_state(self) -> tuple[Any, ...]:
        policy: Any = self.ref._policy
        if hasattr(policy, "chunks"):
            items = list(policy.chunks.items())
        else:
            items = [*policy.t1.items(), *policy.t2.items()]
        table = [(key, chunk.chunk_id, chunk.ref_cnt) for key, chunk in items]
        return table, list(self.ref._free_list), self.ref._num_allocated_chunks

    def our_state(self) -> tuple[Any, ...]:
        index = self.ours.index
        table = [(key, chunk_id, ref) for key, (chunk_id, ref) in index.chunk_table().items()]
        return table, index.free_chunk_ids(), index.num_allocated_chunks

    # -- what the scheduler does --

    def new_request(self, rng: random.Random) -> None:
        if len(self.active()) >= self.MAX_ACTIVE:
            self.finish(rng)
        prompt = rng.choice(self.prompts)
        hashes = prompt[: rng.randint(1, len(prompt))]
        groups = range(self.setup.num_groups)
        keys = [make_offload_key(h, g) for h in hashes for g in groups]
        self.num_requests += 1
        req_id = f"r{self.num_requests}"
        req = TwinRequest(req_id, keys, ReqContext(req_id), ReqContext(req_id))
        self._set_positions(rng, req)
        self.requests.append(req)
        if rng.random() < 0.8:  # else the managers meet it first in a later call
            self.call("on_new_request", req)

    def _set_positions(self, rng: random.Random, req: TwinRequest) -> None:
        # "first": the first group's keys only (the others' order is then by group).
        mode = rng.choices(("all", "none", "some", "first"), (0.6, 0.1, 0.15, 0.15))[0]
        for i, key in enumerate(req.keys):
            in_first = i % self.setup.num_groups == 0
            if (
                mode == "all"
                or (mode == "some" and rng.random() < 0.5)
                or (mode == "first" and in_first)
            ):
                position = (i // self.setup.num_groups + 1) * TOKENS_PER_CHUNK
                for ctx in (req.ref_ctx, req.our_ctx):
                    ctx.set_offload_key_position(key, position)

    def active(self) -> list[TwinRequest]:
        return [r for r in self.requests if not r.finished]

    def lookup_and_load(self, rng: random.Random) -> None:
        active = self.active()
        if not active:
            return
        req = rng.choice(active)
        hits: list[bytes] = []
        for key in req.keys:
            if self.call("lookup", req, key) != LookupResult.HIT:
                break
            self.call("get_load_source", req, key)
            hits.append(key)
        if hits and rng.random() < 0.7:
            keys = hits[: rng.randint(1, len(hits))]
            self.call("prepare_load", req, keys)
            self.loads.append(Job(req, keys))

    def store(self, rng: random.Random) -> None:
        active = self.active()
        if not active:
            return
        req = rng.choice(active)
        start = req.next_store
        if rng.random() < 0.3:  # offered again, as a request sharing the prefix would
            start = rng.randint(0, start)
        keys = req.keys[start : start + rng.randint(1, 4 * self.setup.num_groups)]
        if not keys:
            return
        if rng.random() < 0.15:  # out of order, as sliding-window backfills arrive
            rng.shuffle(keys)
        output = self.call("prepare_store", req, keys)
        if output is None:
            return
        req.next_store = max(req.next_store, start + len(keys))
        if output.keys_to_store:
            self.stores.append(Job(req, list(output.keys_to_store)))

    def complete_store(self, rng: random.Random) -> None:
        if not self.stores:
            return
        job = self.stores.pop(rng.randrange(len(self.stores)))
        keys = list(job.keys)
        if rng.random() < 0.2:  # a key this job never prepared: ignored
            keys.insert(rng.randrange(len(keys) + 1), rng.choice(rng.choice(self.requests).keys))
        success = rng.random() < 0.75
        self.call("complete_store", job.req, keys, success=success)
        if not success:  # the request offers the failed keys again
            job.req.next_store = min(job.req.next_store, job.req.keys.index(job.keys[0]))

    def complete_load(self, rng: random.Random) -> None:
        if self.loads:
            job = self.loads.pop(rng.randrange(len(self.loads)))
            self.call("complete_load", job.req, job.keys)

    def touch(self, rng: random.Random) -> None:
        if self.requests:
            req = rng.choice(self.requests)
            self.call("touch", req, rng.sample(req.keys, rng.randint(0, len(req.keys))))

    def finish(self, rng: random.Random) -> None:
        active = self.active()
        if rng.random() < 0.1 or not active:
            # Finished twice, or never seen by the managers: both ignore it.
            stranger = TwinRequest("stranger", [], ReqContext("x"), ReqContext("x"))
            finished = [r for r in self.requests if r.finished]
            self.call("on_request_finished", rng.choice([*finished, stranger]))
            return
        req = rng.choice(active)
        req.finished = True
        self.call("on_request_finished", req)

    def lookup_any(self, rng: random.Random) -> None:
        if self.requests:
            req = rng.choice(self.requests)
            self.call("lookup", req, rng.choice(req.keys) if req.keys else b"\0" * 12)

    def take_events(self, rng: random.Random) -> None:
        self.log.append("take_events")
        ref, ours = list(self.ref.take_events()), list(self.ours.take_events())
        assert ours == ref, f"events differ after {self.log[-8:]}:\n{ref}\n{ours}"

    def stats(self, rng: random.Random) -> None:
        self.log.append("get_stats")
        ref, ours = self.ref.get_stats(), self.ours.get_stats()
        assert ours.data == ref.data, f"stats differ after {self.log[-8:]}"
        assert self.ours.config_info() == self.ref.config_info()

    def schedule_end(self, rng: random.Random) -> None:
        context = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        self.call("on_schedule_end", None, context)
        self.call("has_pending_work", None)

    def reset(self, rng: random.Random) -> None:
        # Jobs in flight are forgotten: the scheduler never completes pre-reset jobs.
        self.stores.clear()
        self.loads.clear()
        self.call("reset_cache", None)
        self.call("on_reset_flushed", None)

    def finish_all(self) -> None:
        """Every job completed and every request finished: the tiers still agree."""
        rng = random.Random(0)
        while self.loads:
            self.complete_load(rng)
        while self.stores:
            job = self.stores.pop()
            self.call("complete_store", job.req, job.keys)
        for req in self.active():
            req.finished = True
            self.call("on_request_finished", req)
        self.take_events(rng)
        self.stats(rng)


OPS: dict[str, float] = {
    "new_request": 3,
    "lookup_and_load": 4,
    "store": 7,
    "complete_store": 5,
    "complete_load": 3,
    "touch": 1,
    "finish": 2,
    "lookup_any": 1,
    "take_events": 1,
    "stats": 1,
    "schedule_end": 1,
    "reset": 0.1,
}


def run_twin(setup: Setup, seed: int, num_ops: int) -> Twin:
    twin = Twin(setup, seed)
    rng = random.Random(seed)
    names, weights = list(OPS), list(OPS.values())
    for _ in range(num_ops):
        getattr(twin, rng.choices(names, weights)[0])(rng)
    twin.finish_all()
    return twin


SETUPS = [
    Setup("lru", 3),
    Setup("lru", 8, num_groups=2),
    Setup("lru", 64),
    Setup("lru", 6, store_threshold=3),
    Setup("lru", 8, store_threshold=3, max_tracker_size=6, num_groups=2),
    Setup("arc", 3),
    Setup("arc", 8, num_groups=2),
    Setup("arc", 64),
    Setup("arc", 6, store_threshold=3),
    Setup("arc", 8, store_threshold=3, max_tracker_size=6, num_groups=2),
    Setup("lru", 5, ours="priority"),
    Setup("lru", 8, store_threshold=3, num_groups=2, ours="priority"),
]


@pytest.mark.parametrize("setup", SETUPS, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_decides_as_vllm_cpu_offloading_manager(setup: Setup, seed: int) -> None:
    twin = run_twin(setup, seed, 1500)
    assert twin.num_requests > 50


def test_the_differential_sees_evictions_refusals_and_failed_stores() -> None:
    """The seeded runs reach what they are for (else they could pass vacuously)."""
    twin = Twin(Setup("lru", 3), 0)
    seen = {"evicted": 0, "refused": 0, "failed": 0}
    compare = twin.call

    def counting(name: str, req: TwinRequest | None, *args: Any, **kwargs: Any) -> Any:
        answer = compare(name, req, *args, **kwargs)
        if name == "prepare_store":
            seen["refused"] += answer is None
            seen["evicted"] += bool(answer and answer.evicted_keys)
        seen["failed"] += kwargs.get("success") is False
        return answer

    twin.call = counting  # type: ignore[method-assign]
    rng = random.Random(0)
    names, weights = list(OPS), list(OPS.values())
    for _ in range(1500):
        getattr(twin, rng.choices(names, weights)[0])(rng)
    assert seen["evicted"] > 50 and seen["refused"] > 10 and seen["failed"] > 5, seen


class OffloadMachine(RuleBasedStateMachine):
    """The twin's operations in any order hypothesis picks (each draws its choices
    from a seed, so a failure shrinks to the few calls that matter)."""

    SETUP = Setup("lru", 4)

    def __init__(self) -> None:
        super().__init__()
        self.twin = Twin(self.SETUP, 0)

    def _op(self, name: str, seed: int) -> None:
        getattr(self.twin, name)(random.Random(seed))

    seeds = st.integers(0, 2**16)

    @rule(seed=seeds)
    def new_request(self, seed: int) -> None:
        self._op("new_request", seed)

    @rule(seed=seeds)
    def lookup_and_load(self, seed: int) -> None:
        self._op("lookup_and_load", seed)

    @rule(seed=seeds)
    def store(self, seed: int) -> None:
        self._op("store", seed)

    @rule(seed=seeds)
    def complete_store(self, seed: int) -> None:
        self._op("complete_store", seed)

    @rule(seed=seeds)
    def complete_load(self, seed: int) -> None:
        self._op("complete_load", seed)

    @rule(seed=seeds)
    def touch(self, seed: int) -> None:
        self._op("touch", seed)

    @rule(seed=seeds)
    def finish(self, seed: int) -> None:
        self._op("finish", seed)

    @rule(seed=seeds)
    def events_and_stats(self, seed: int) -> None:
        self._op("take_events", seed)
        self._op("stats", seed)

    @rule()
    def reset(self) -> None:
        self._op("reset", 0)

    def teardown(self) -> None:
        self.twin.finish_all()


MACHINE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _machine(name: str, setup: Setup) -> Any:
    machine: Any = type(name, (OffloadMachine,), {"SETUP": setup})
    test_case = machine.TestCase
    test_case.settings = MACHINE_SETTINGS
    return test_case


TestLRUMachine = _machine("LRUMachine", Setup("lru", 4, num_groups=2))
TestARCMachine = _machine("ARCMachine", Setup("arc", 4))
TestThresholdMachine = _machine(
    "ThresholdMachine", Setup("arc", 5, store_threshold=3, max_tracker_size=4)
)


# -- vLLM's scheduler on either spec ---------------------------------------------------

OUR_SPEC = {
    "spec_name": "KVServiceOffloadingSpec",
    "spec_module_path": "kvservice.integrations.vllm.offloading",
}


def _scheduler_run(setup: SchedulerSetup, seed: int) -> tuple[list[Any], Any]:
    scheduler = build_scheduler(setup)
    try:
        workload = OffloadWorkload(
            seed, load_failure_rate=0.15, num_requests=200, repeat_rate=0.5, max_tokens=(1, 40)
        )
        return workload.run(scheduler), scheduler.get_kv_connector().connector_scheduler.manager
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("threshold", [0, 2])
def test_vllms_scheduler_decides_alike_on_either_spec(policy: str, threshold: int) -> None:
    """vLLM's own scheduler and OffloadingConnector (a fake worker, failed loads
    recomputed), once on ``CPUOffloadingSpec`` and once on ``KVServiceOffloadingSpec``:
    every step's schedule, transfers (GPU blocks and CPU chunk ids), stats and KV
    events (the tier's included) alike."""
    stock = SchedulerSetup(
        num_blocks=80,
        offload_cpu_bytes=1 << 18,  # 64 chunks, fewer than the GPU blocks: the tier evicts
        offload_eviction_policy=policy,
        offload_extra=(("store_threshold", threshold),),
        kv_load_failure_policy="recompute",
    )
    ours = dataclasses.replace(stock, offload_extra=(*stock.offload_extra, *OUR_SPEC.items()))
    expected, stock_manager = _scheduler_run(stock, 1)
    actual, our_manager = _scheduler_run(ours, 1)
    assert type(stock_manager) is CPUOffloadingManager
    assert type(our_manager) is KVServiceOffloadingManager
    assert first_difference(expected, actual) is None
    evicted = [e for step in expected for e in step["events"] if e.medium == "CPU"]
    assert evicted and any(step["transfers"] and step["transfers"]["loads"] for step in expected)


# -- the spec --------------------------------------------------------------------------


def offloading_config(**extra: Any) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=8192,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 1 << 22, **extra},
        engine_id="engine-0",
        model=OffloadingModelConfig(name="tiny", dtype="float16", max_model_len=1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


@pytest.mark.parametrize("policy", ["lru", "arc", "priority"])
def test_spec_loads_from_extra_config_and_sizes_the_tier_as_vllm(policy: str) -> None:
    config = offloading_config(**OUR_SPEC, eviction_policy=policy, store_threshold=3)
    spec = OffloadingSpecFactory.create_spec(config)
    assert type(spec) is KVServiceOffloadingSpec
    stock = CPUOffloadingSpec(offloading_config())
    assert (spec.num_chunks, spec.kv_bytes_per_chunk) == (
        stock.num_chunks,
        stock.kv_bytes_per_chunk,
    )
    assert spec.num_chunks > 0
    manager = spec.get_manager()
    assert isinstance(manager, KVServiceOffloadingManager)
    assert spec.get_manager() is manager
    assert manager.index.num_chunks == spec.num_chunks
    assert manager.index.store_threshold == 3
    assert manager.config_info() == stock.get_manager().config_info()
    assert type(spec).build_metric_definitions(config.extra_config).keys() == (
        CPUOffloadingSpec.build_metric_definitions(config.extra_config).keys()
    )


def test_unknown_eviction_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'lfu'.*\['lru', 'arc', 'priority'\]"):
        OffloadingSpecFactory.create_spec(offloading_config(**OUR_SPEC, eviction_policy="lfu"))
    with pytest.raises(ValueError, match=r"\['lru', 'arc', 'priority'\]"):
        KVServiceOffloadingManager(8, "lfu")
    with pytest.raises(ValueError, match="cache_policy_module_path"):
        KVServiceOffloadingSpec(offloading_config(cache_policy_module_path="my.policies"))


# -- the priority policy and pins ------------------------------------------------------


def key(i: int, group: int = 0) -> bytes:
    made: bytes = make_offload_key(i.to_bytes(8, "big"), group)
    return made


def no_positions(key: bytes) -> int | None:
    return None


def store(
    index: OffloadIndex, keys: Sequence[bytes], priority: int = 35, complete: bool = True
) -> list[bytes] | None:
    """Store ``keys`` for a new request at ``priority``; the evicted keys (None: no room)."""
    req = index.request_access(no_positions, priority)
    plan = index.prepare_store(keys, req)
    if plan is None:
        return None
    if complete:
        index.complete_store(plan.keys_to_store)
    index.request_finished(req)
    return plan.evicted_keys


class TestPriorityPolicy:
    def test_lower_priorities_are_evicted_first(self) -> None:
        """Newer chunks of a lower priority go before older ones of a higher."""
        index = OffloadIndex(4, "priority")
        store(index, [key(0), key(1)], priority=80)
        store(index, [key(2), key(3)], priority=10)
        # Within one request the tail goes first (vLLM's LRU: a prefix's head stays).
        assert store(index, [key(4), key(5)]) == [key(3), key(2)]
        # 35 (default) before 80, though stored later.
        assert store(index, [key(6), key(7)], priority=90) == [key(5), key(4)]
        assert store(index, [key(8)]) == [key(1)]

    def test_lru_within_a_priority(self) -> None:
        index = OffloadIndex(3, "priority")
        for i in range(3):
            store(index, [key(i)], priority=50)
        index.touch([key(0)])
        assert store(index, [key(3)], priority=50) == [key(1)]
        assert store(index, [key(4)], priority=50) == [key(2)]

    def test_reuse_raises_a_chunks_priority(self) -> None:
        index = OffloadIndex(2, "priority")
        store(index, [key(0)], priority=10)
        store(index, [key(1)], priority=20)
        reader = index.request_access(no_positions, 90)
        index.prepare_load([key(0)], reader)
        index.complete_load([key(0)])
        assert store(index, [key(2)], priority=30) == [key(1)]

    def test_a_refused_load_changes_nothing(self) -> None:
        index = OffloadIndex(2, "priority")
        store(index, [key(0)])
        req = index.request_access(no_positions)
        with pytest.raises(InvalidArgumentError, match="not stored"):
            index.prepare_load([key(0), key(9)], req)
        assert index.chunk_table() == {key(0): (0, 0)}


class TestPins:
    def test_a_pinned_key_is_never_evicted(self) -> None:
        index = OffloadIndex(4, "priority")
        store(index, [key(i) for i in range(4)], priority=0)
        index.pin("p", [key(0), key(1)], ttl_s=10.0, now=0.0)
        evicted: list[bytes] = []
        for i in range(4, 40):
            evicted += store(index, [key(i)], priority=100) or []
        assert key(0) not in evicted and key(1) not in evicted
        assert index.lookup(key(0)) == index.lookup(key(1)) == LOOKUP_HIT
        # Every idle chunk but the pinned ones busy being read: no room.
        reader = index.request_access(no_positions)
        index.prepare_load([key(38), key(39)], reader)
        assert store(index, [key(99)]) is None

    def test_after_its_ttl_a_pinned_key_is_evicted(self) -> None:
        index = OffloadIndex(3, "priority")
        store(index, [key(0)], priority=0)
        index.pin("p", [key(0)], ttl_s=10.0, now=0.0)
        store(index, [key(1), key(2)], priority=100)
        assert store(index, [key(3)]) == [key(2)]
        assert index.expire_pins(9.99) == 0
        assert index.is_pinned(key(0))
        assert index.expire_pins(10.0) == 1
        assert not index.is_pinned(key(0))
        assert store(index, [key(4)]) == [key(0)]
        assert index.pin_counters.expired == 1

    def test_a_key_stored_after_its_pin_is_held(self) -> None:
        index = OffloadIndex(2, "priority")
        index.pin("p", [key(7)], ttl_s=None, now=0.0)
        store(index, [key(7)], priority=0)
        for i in range(10):
            assert store(index, [key(i)]) != [key(7)]
        assert index.lookup(key(7)) == LOOKUP_HIT
        assert index.unpin("p") and not index.unpin("p")
        assert store(index, [key(20)]) == [key(7)]

    def test_pinning_again_refreshes_the_ttl(self) -> None:
        index = OffloadIndex(4, "priority")
        index.pin("p", [key(0)], ttl_s=10.0, now=0.0)
        index.pin("p", [key(0)], ttl_s=10.0, now=5.0)
        assert index.expire_pins(12.0) == 0
        assert index.expire_pins(15.0) == 1

    def test_a_pin_over_capacity_is_refused_and_changes_nothing(self) -> None:
        index = OffloadIndex(4, "priority", max_pinned_chunks=3)
        index.pin("a", [key(0), key(1)], ttl_s=None, now=0.0)
        with pytest.raises(QuotaExceededError, match=r"pin 'b' needs 2 chunks.* 2 of the 3"):
            index.pin("b", [key(2), key(3)], ttl_s=None, now=0.0)
        assert not index.is_pinned(key(2)) and index.pin_counters.refused == 1
        with pytest.raises(QuotaExceededError, match="needs 5 chunks"):
            OffloadIndex(4, "priority").pin("c", [key(i) for i in range(5)], None, 0.0)
        with pytest.raises(InvalidArgumentError, match=r"max_pinned_chunks must be in \[0, 4\]"):
            OffloadIndex(4, "priority", max_pinned_chunks=5)

    def test_pins_need_the_priority_policy(self) -> None:
        for policy in ("lru", "arc"):
            with pytest.raises(InvalidArgumentError, match="'priority' offload eviction policy"):
                OffloadIndex(4, policy).pin("p", [key(0)], ttl_s=1.0, now=0.0)

    def test_a_reset_keeps_pins_and_staleness_is_per_index(self) -> None:
        index = OffloadIndex(2, "priority")
        req = index.request_access(no_positions)
        index.pin("p", [key(0)], ttl_s=None, now=0.0)
        index.reset()
        assert not index.is_current(req) and index.is_pinned(key(0))
        assert not OffloadIndex(2, "priority").is_current(index.request_access(no_positions))
        assert isinstance(index.request_access(no_positions), RequestAccess)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_request(
    manager: KVServiceOffloadingManager, req_id: str, keys: list[bytes], params: Any = None
) -> None:
    ctx = ReqContext(req_id, kv_transfer_params=params)
    manager.on_new_request(ctx)
    output = manager.prepare_store(keys, ctx)
    assert output is not None
    manager.complete_store(output.keys_to_store, ctx)
    manager.on_request_finished(ctx)


class TestAdapterRetention:
    def test_kv_transfer_params_set_priority_and_pin(self) -> None:
        clock = FakeClock()
        manager = KVServiceOffloadingManager(4, "priority", clock=clock)
        pinned = {"kvservice_priority": 0, "cache_control": {"type": "ephemeral", "ttl": "5m"}}
        run_request(manager, "a", [key(0), key(1)], pinned)
        run_request(manager, "b", [key(2), key(3)], {"kvservice_priority": 10})
        assert manager.index.is_pinned(key(0)) and manager.index.is_pinned(key(1))
        ctx = ReqContext("c")
        output = manager.prepare_store([key(4), key(5)], ctx)
        assert output is not None and output.evicted_keys == [key(3), key(2)]
        clock.now += 301
        manager.on_schedule_end(ScheduleEndContext((), ()))
        assert not manager.index.is_pinned(key(0))
        manager.complete_store([key(4), key(5)], ctx)
        # Unpinned, request a's chunks (priority 0) go first, its tail before its head.
        output = manager.prepare_store([key(6)], ReqContext("d"))
        assert output is not None and output.evicted_keys == [key(1)]

    def test_malformed_retention_is_logged_and_ignored(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        manager = KVServiceOffloadingManager(4, "priority")
        with caplog.at_level(logging.WARNING):
            run_request(manager, "a", [key(0)], {"kvservice_priority": "high"})
        assert "offload retention ignored" in caplog.text
        assert manager.index.lookup(key(0)) == LOOKUP_HIT

    def test_a_request_pin_past_the_budget_is_dropped(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        manager = KVServiceOffloadingManager(4, "priority", max_pinned_fraction=0.25)
        with caplog.at_level(logging.WARNING):
            run_request(manager, "a", [key(0), key(1)], {"cache_control": "1h"})
        assert "offload pin dropped" in caplog.text and not manager.index.is_pinned(key(0))
        manager.pin([key(0)], ttl_s=None)
        with pytest.raises(QuotaExceededError):
            manager.pin([key(1)], ttl_s=None)

    @pytest.mark.parametrize("policy", ["lru", "arc"])
    def test_lru_and_arc_ignore_retention(self, policy: str) -> None:
        manager = KVServiceOffloadingManager(2, policy)
        params = {"kvservice_priority": "not even a number", "cache_control": "5m"}
        run_request(manager, "a", [key(0)], params)
        assert not manager.index.is_pinned(key(0))
        assert manager.index.lookup(key(0)) == LOOKUP_HIT
        assert manager.index.lookup(key(9)) == LOOKUP_MISS


def test_the_adapter_keeps_vllms_defaults() -> None:
    """The hooks CPUOffloadingManager leaves to the base class answer alike."""
    ours, ref = KVServiceOffloadingManager(1), CPUOffloadingManager(1)
    with ours.lock, ref.lock:
        assert ours.has_pending_work() is ref.has_pending_work() is False
    assert list(ours.take_events()) == list(ref.take_events()) == []
    assert ours.config_info() == ref.config_info() == [{}]

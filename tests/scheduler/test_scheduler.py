"""The reference scheduler over both backends: for every workload kind, the same
scheduler code makes the same decisions in-process and against a real server (same
block ids, preemptions and finishing order), recorded traces replay to the same
answers, and every run leaves the pool whole."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvservice.client import AdmitOptions, KVClient
from kvservice.client.errors import RemoteStepError
from kvservice.core import errors as core_errors
from kvservice.scheduler.backend import Backend, InProcessBackend, RemoteBackend
from kvservice.scheduler.loop import Policy, Scheduler, SchedulerConfig, StepRecord
from kvservice.scheduler.replicated import ReplicatedBackend, StepBackend, StreamBackend
from kvservice.scheduler.trace import (
    TraceMismatchError,
    TracingBackend,
    check_replay,
    read_trace,
    write_trace,
)
from kvservice.server.config import build_manager
from kvservice.workloads import (
    FewShotConfig,
    LengthDistribution,
    LongDocumentQAConfig,
    MultiTurnChatConfig,
    NoSharingConfig,
    RequestSpec,
    SharedSystemPromptConfig,
    WorkloadConfig,
    generate,
)
from tests.server import support as server_support
from tests.servers import server_in_thread

MAX_MODEL_LEN = 256
# 23 usable blocks of 16 tokens: a handful of requests fill it, so they preempt.
TIGHT_POOL = dataclasses.replace(
    server_support.SMALL_POOL,
    num_blocks=24,
    max_model_len=MAX_MODEL_LEN,
    num_layers=1,
    model_name="scheduler-test",
)

L = LengthDistribution
_OUTPUT = L(median=24, sigma=0.6, low=1, high=64)
WORKLOADS: dict[str, WorkloadConfig] = {
    "shared_system_prompt": SharedSystemPromptConfig(
        num_requests=12, system_prompt_len=64, user_len=L(24, 0.7, 1, 96)
    ),
    "multi_turn_chat": MultiTurnChatConfig(
        num_conversations=3, turns_per_conversation=3, user_len=L(20, 0.7, 1, 64), turn_gap_steps=4
    ),
    "few_shot": FewShotConfig(
        num_requests=10,
        instruction_len=16,
        examples_per_task=4,
        example_len=L(24, 0.4, 8, 48),
        question_len=L(12, 0.5, 1, 32),
    ),
    "long_document_qa": LongDocumentQAConfig(
        num_documents=3,
        questions_per_document=3,
        document_len=L(128, 0.3, 48, 176),
        question_len=L(12, 0.5, 1, 32),
    ),
    "no_sharing": NoSharingConfig(num_requests=12, prompt_len=L(64, 0.8, 1, 176)),
}


def workload(kind: str, seed: int = 1, num_priorities: int = 1) -> list[RequestSpec]:
    config = dataclasses.replace(
        WORKLOADS[kind],
        max_model_len=MAX_MODEL_LEN,
        output_len=_OUTPUT,
        requests_per_step=2.0,
        num_priorities=num_priorities,
    )
    return generate(config, seed)


def run(
    backend: Backend, specs: Sequence[RequestSpec], config: SchedulerConfig
) -> list[StepRecord]:
    """Run the workload to the end and check the pool is whole again."""
    records = Scheduler(backend, config, specs).run(max_steps=5_000)
    assert backend.num_free_blocks() == TIGHT_POOL.num_blocks - 1  # block 0 is the null block
    return records


def run_in_process(specs: Sequence[RequestSpec], config: SchedulerConfig) -> list[StepRecord]:
    return run(InProcessBackend(build_manager(TIGHT_POOL)), specs, config)


REMOTE_MODES = ("unary", "step", "stream")


def run_remote(
    specs: Sequence[RequestSpec], config: SchedulerConfig, mode: str = "unary"
) -> list[StepRecord]:
    """Run against a fresh server over one transport: one RPC per call (unary), one
    ``Step`` RPC per step (step) or one ``StepStream`` message per step (stream)."""
    with server_in_thread(TIGHT_POOL) as server, KVClient(server.target) as client:
        if mode == "unary":
            return run(RemoteBackend(client), specs, config)
        if mode == "step":
            return run_replicated(StepBackend(client), client, specs, config)
        # Each step checked while the next is planned: the most messages in flight.
        with StreamBackend(client, overlap=True) as backend:
            return run_replicated(backend, client, specs, config)


def run_replicated(
    backend: ReplicatedBackend,
    client: KVClient,
    specs: Sequence[RequestSpec],
    config: SchedulerConfig,
) -> list[StepRecord]:
    records = run(backend, specs, config)
    backend.flush()
    # The server's pool is whole too (the replica's was checked by run), and every step
    # cost one message (the last one's frees one more).
    assert client.get_usage().num_free_blocks == TIGHT_POOL.num_blocks - 1
    assert backend.round_trips <= len(records) + 1
    return records


def num_preemptions(records: Sequence[StepRecord]) -> int:
    return sum(len(r.preempted) for r in records)


def first_admission_hit_tokens(records: Sequence[StepRecord]) -> int:
    """Prefix hits of first admissions (a re-admission re-hits its own blocks)."""
    seen: set[str] = set()
    total = 0
    for record in records:
        for s in record.scheduled:
            if s.request_id not in seen:
                seen.add(s.request_id)
                total += s.num_hit_tokens
    return total


def finished_order(records: Sequence[StepRecord]) -> list[str]:
    return [rid for r in records for rid in r.finished]


FCFS = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=128, seed=7)


@pytest.mark.parametrize("mode", REMOTE_MODES)
@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_same_decisions_in_process_and_remote(kind: str, mode: str) -> None:
    specs = workload(kind)
    local = run_in_process(specs, FCFS)
    assert run_remote(specs, FCFS, mode) == local
    assert sorted(finished_order(local)) == sorted(s.request_id for s in specs)
    # Only the no-sharing workload never hits the prefix cache.
    assert (first_admission_hit_tokens(local) == 0) == (kind == "no_sharing")


def test_tight_pool_preempts_and_re_prefills() -> None:
    specs = workload("few_shot")
    records = run_in_process(specs, FCFS)
    assert num_preemptions(records) > 0
    # A preempted request is admitted again later, hitting its own cached blocks.
    preempted = {rid for r in records for rid in r.preempted}
    readmitted = [
        s
        for i, r in enumerate(records)
        for s in r.scheduled
        if s.num_hit_tokens and s.request_id in preempted
    ]
    assert readmitted, "no preempted request was re-admitted with a prefix hit"


@pytest.mark.parametrize("mode", REMOTE_MODES)
def test_priority_policy_and_lookahead_match_remote(mode: str) -> None:
    specs = workload("shared_system_prompt", num_priorities=3)
    config = dataclasses.replace(FCFS, policy=Policy.PRIORITY, num_lookahead_tokens=2)
    local = run_in_process(specs, config)
    assert num_preemptions(local) > 0
    assert run_remote(specs, config, mode) == local


@pytest.mark.parametrize("mode", REMOTE_MODES)
def test_no_chunked_prefill_matches_remote(mode: str) -> None:
    specs = workload("long_document_qa")
    config = dataclasses.replace(FCFS, enable_chunked_prefill=False, max_num_batched_tokens=256)
    local = run_in_process(specs, config)
    assert run_remote(specs, config, mode) == local


def test_trace_replays_to_the_same_answers(tmp_path: Path) -> None:
    specs = workload("multi_turn_chat")
    tracer = TracingBackend(InProcessBackend(build_manager(TIGHT_POOL)))
    run(tracer, specs, FCFS)
    path = tmp_path / "run.jsonl"
    write_trace(path, tracer.trace({"workload": "multi_turn_chat", "seed": 1}))
    trace = read_trace(path)
    assert trace.entries == tuple(tracer.entries)
    # A step's admissions are one recorded call, not a lookup and an allocation each.
    ops = {entry.op for entry in trace.entries}
    assert "admit" in ops and "get_computed_blocks" not in ops
    assert trace.meta == {"workload": "multi_turn_chat", "seed": 1}

    assert check_replay(trace, InProcessBackend(build_manager(TIGHT_POOL))) == len(trace.entries)
    with server_in_thread(TIGHT_POOL) as server, KVClient(server.target) as client:
        check_replay(trace, RemoteBackend(client))


def test_replay_reports_a_different_answer(tmp_path: Path) -> None:
    specs = workload("no_sharing")
    tracer = TracingBackend(InProcessBackend(build_manager(TIGHT_POOL)))
    run(tracer, specs, FCFS)
    # The same calls on a larger pool answer other block ids at some point.
    other = InProcessBackend(build_manager(dataclasses.replace(TIGHT_POOL, num_blocks=64)))
    with pytest.raises(TraceMismatchError):
        check_replay(tracer.trace(), other)


@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_workloads_are_seeded_and_fit(kind: str) -> None:
    specs = workload(kind, seed=3)
    assert specs == workload(kind, seed=3)
    assert specs != workload(kind, seed=4)
    assert all(s.max_total_tokens <= MAX_MODEL_LEN for s in specs)
    assert [s.arrival_step for s in specs] == sorted(s.arrival_step for s in specs)
    assert len({s.request_id for s in specs}) == len(specs)


def test_multi_turn_turns_extend_the_conversation() -> None:
    specs = workload("multi_turn_chat")
    by_id = {s.request_id: s for s in specs}
    first, second = by_id["chat-0"], by_id["chat-1"]
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert len(second.prompt_token_ids) > first.max_total_tokens


@pytest.mark.parametrize(
    ("policy", "victim"), [(Policy.FCFS, "c"), (Policy.PRIORITY, "b")], ids=["fcfs", "priority"]
)
def test_preemption_picks_the_policy_victim(policy: Policy, victim: str) -> None:
    """Three requests that outgrow the pool together: FCFS preempts the last admitted
    (c), the priority policy the largest priority value (b)."""
    specs = [
        RequestSpec(rid, tuple(range(i * 1000, i * 1000 + 96)), 150, priority=p)
        for i, (rid, p) in enumerate([("a", 0), ("b", 2), ("c", 1)])
    ]
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512, policy=policy)
    records = run_in_process(specs, config)
    first = next(r for r in records if r.preempted)
    assert first.preempted == (victim,)


@pytest.mark.parametrize("mode", ["step", "stream"])
def test_trace_crosses_batching_backends(mode: str) -> None:
    """A run recorded over a batching backend (answers resolved at each send) replays
    in-process, and an in-process recording replays over the batching backend."""
    specs = workload("shared_system_prompt")
    with (
        server_in_thread(TIGHT_POOL) as server,
        KVClient(server.target) as client,
        contextlib.ExitStack() as stack,
    ):
        replicated: ReplicatedBackend = (
            StepBackend(client) if mode == "step" else stack.enter_context(StreamBackend(client))
        )
        tracer = TracingBackend(replicated)
        run(tracer, specs, FCFS)
    recorded = tracer.trace()
    allocations = [e for e in recorded.entries if e.op == "allocate_slots"]
    assert allocations and all(e.result is not None for e in allocations[:5])
    check_replay(recorded, InProcessBackend(build_manager(TIGHT_POOL)))

    local = TracingBackend(InProcessBackend(build_manager(TIGHT_POOL)))
    run(local, specs, FCFS)
    with server_in_thread(TIGHT_POOL) as server, KVClient(server.target) as client:
        assert check_replay(local.trace(), StepBackend(client)) == len(local.entries)


# Full attention beside a Mamba "align" group: a state cached in a step is no hit
# until the next, so the decisions depend on where each backend's steps begin.
MAMBA_POOL = dataclasses.replace(
    server_support.HYBRID_POOL,
    num_blocks=40,
    block_size=16,
    mamba_block_size=16,
    hash_block_size=0,
    max_model_len=MAX_MODEL_LEN,
)


def _run_on(backend: Backend, specs: Sequence[RequestSpec]) -> list[StepRecord]:
    records = Scheduler(backend, FCFS, specs).run(max_steps=5_000)
    assert backend.num_free_blocks() == MAMBA_POOL.num_blocks - 1
    return records


@pytest.mark.parametrize("mode", REMOTE_MODES)
@pytest.mark.parametrize("kind", ["long_document_qa", "shared_system_prompt"])
def test_every_backend_announces_steps(kind: str, mode: str) -> None:
    """On a hybrid Mamba pool every backend starts the server's steps where the
    in-process table starts its own (the unary backend with a NewStepStarts RPC, the
    batching ones with an operation after the last step's frees): the same decisions.
    (A backend that did not would have its pool take each allocation for a step, and
    these workloads would hit states the others refuse.)"""
    specs = workload(kind)
    local = _run_on(InProcessBackend(build_manager(MAMBA_POOL)), specs)
    assert first_admission_hit_tokens(local) > 0
    with server_in_thread(MAMBA_POOL) as server, KVClient(server.target) as client:
        if mode == "unary":
            remote = _run_on(RemoteBackend(client), specs)
        elif mode == "step":
            remote = _run_on(StepBackend(client), specs)
        else:
            with StreamBackend(client, overlap=True) as stream:
                remote = _run_on(stream, specs)
    assert remote == local


# Full attention beside a sliding window of 32 tokens, a watermark, and hashes of half a
# block (partial-block hits copy on write): every knob a replica must lay out as the
# server's (GetCacheConfig) to decide as it does.
WINDOW_POOL = dataclasses.replace(
    TIGHT_POOL, num_blocks=48, sliding_window=32, watermark=0.1, hash_block_size=8
)


@pytest.mark.parametrize("retention", [None, 0])
@pytest.mark.parametrize("kind", ["long_document_qa", "shared_system_prompt"])
def test_a_replica_decides_as_the_server_on_a_window_pool(kind: str, retention: int | None) -> None:
    pool = dataclasses.replace(WINDOW_POOL, prefix_cache_retention_interval=retention)
    specs = workload(kind)
    local = Scheduler(InProcessBackend(build_manager(pool)), FCFS, specs).run(5_000)
    assert first_admission_hit_tokens(local) > 0
    with server_in_thread(pool) as server, KVClient(server.target) as client:
        backend = StepBackend(client)
        assert backend.manager.watermark_blocks == client.get_cache_config().watermark_blocks
        remote = Scheduler(backend, FCFS, specs).run(5_000)
        backend.flush()
        assert client.get_usage().num_free_blocks == pool.num_blocks - 1
        assert client.audit().ok
    assert remote == local


def test_a_trace_records_each_step_boundary_before_the_step_s_allocations(
    tmp_path: Path,
) -> None:
    """Version 3 traces hold ``new_step_starts``: one per step, after the last step's
    appends and frees and before the step's allocations; they replay to the same
    answers on a hybrid Mamba pool."""
    specs = workload("shared_system_prompt")
    tracer = TracingBackend(InProcessBackend(build_manager(MAMBA_POOL)))
    records = _run_on(tracer, specs)
    ops = [entry.op for entry in tracer.entries]
    assert ops.count("new_step_starts") == len(records)
    starts = [i for i, op in enumerate(ops) if op == "new_step_starts"]
    for start, end in zip(starts, [*starts[1:], len(ops)], strict=True):
        # A step's allocations, then its appends: the appends (and frees) of a step
        # come before the next step's boundary, never after it.
        step = ops[start:end]
        decided = [i for i, op in enumerate(step) if op in ("allocate_slots", "admit")]
        appended = [i for i, op in enumerate(step) if op == "append_tokens"]
        if decided and appended:
            assert max(decided) < min(appended)
    path = tmp_path / "v3.jsonl"
    write_trace(path, tracer.trace())
    assert json.loads(path.read_text(encoding="utf-8").splitlines()[0])["version"] == 3
    assert check_replay(read_trace(path), InProcessBackend(build_manager(MAMBA_POOL))) == len(ops)


def test_a_call_the_replica_refuses_changes_nothing_here_or_on_the_server() -> None:
    with server_in_thread(TIGHT_POOL) as server, KVClient(server.target) as client:
        backend = StepBackend(client)
        backend.add_request("a", list(range(20)))
        with pytest.raises(core_errors.RequestNotFoundError, match="ghost"):
            backend.append_tokens("ghost", [1])  # refused at once, never sent
        backend.add_request("b", list(range(100, 120)))
        backend.flush()
        assert client.get_request("a").num_tokens == 20
        assert client.get_request("b").num_tokens == 20
        assert backend.round_trips == 1


def test_a_server_that_answers_otherwise_stops_the_backend() -> None:
    """Another client allocating from the pool makes the server's answer differ from
    the replica's: the check names the call and both answers, and every later call is
    refused (the two no longer agree)."""
    with (
        server_in_thread(TIGHT_POOL) as server,
        KVClient(server.target) as client,
        KVClient(server.target) as intruder,
        StreamBackend(client) as backend,
    ):
        backend.add_request("a", list(range(20)))
        backend.allocate_slots("a", 20)
        backend.end_step()
        intruder.add_request("x", list(range(500, 540)))
        intruder.allocate_slots("x", 40)
        backend.add_request("b", list(range(100, 120)))
        backend.allocate_slots("b", 20)
        with pytest.raises(RemoteStepError, match=r"allocate_slots\('b', 20\).*another client"):
            backend.end_step()
        with pytest.raises(RemoteStepError, match="earlier failure"):
            backend.append_tokens("a", [1])


def test_a_replicated_backend_refuses_a_pool_in_use() -> None:
    with server_in_thread(TIGHT_POOL) as server, KVClient(server.target) as client:
        client.add_request("x", list(range(40)))
        client.allocate_slots("x", 40)
        with pytest.raises(RemoteStepError, match="holds 3 blocks for 1 requests"):
            StepBackend(client)
        client.free("x")
        StepBackend(client).flush()  # idle again: accepted


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("backend_cls", [StepBackend, StreamBackend])
def test_a_replicated_backend_follows_the_servers_pins_and_expiries(
    backend_cls: type[StepBackend] | type[StreamBackend], overlap: bool
) -> None:
    """On a pool with retention the backend opens a replica session: an operator's pins
    and unpins, and pins expiring on the server's clock, reach the replica at the same
    step boundaries as the server's pool (every answer is checked), and both end alike."""
    pool = dataclasses.replace(TIGHT_POOL, eviction_policy="priority", max_pinned_fraction=0.3)
    prefixes = [tuple(range(p * 1000, p * 1000 + 32)) for p in range(3)]
    specs = [
        RequestSpec(
            f"r{i}", prefixes[i % 3] + tuple(range(9000 + 50 * i, 9010 + 50 * i)), 6, i // 2
        )
        for i in range(40)
    ]
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256)
    with (
        server_in_thread(pool) as server,
        KVClient(server.target) as client,
        KVClient(server.target) as admin,
    ):
        backend = backend_cls(client, overlap=overlap)
        scheduler = Scheduler(backend, config, specs)
        for step in range(200):
            if step % 5 == 1:
                admin.pin_prefix(list(prefixes[step % 3]), ttl_s=0.01 if step % 2 else None)
            if step % 9 == 4 and admin.list_pins().pins:
                admin.unpin_prefix(admin.list_pins().pins[0].pin_id)
            if scheduler.done:
                if step > 60:
                    break
                scheduler = Scheduler(backend, config, [])  # steps with nothing to do
            scheduler.step()
        backend.flush()
        retention = backend.manager.retention_policy
        assert retention is not None and retention.stats.pins_created > 0
        assert retention.stats.pinned_block_hits > 0
        server_pins = {(p.pin_id, p.num_held_blocks) for p in admin.list_pins().pins}
        assert server_pins == {(p.pin_id, len(p.held)) for p in backend.manager.list_pins()}
        assert admin.get_usage().num_free_blocks == backend.num_free_blocks()
        assert admin.audit().ok


def test_steady_decode_steps_are_one_message() -> None:
    """The replica answers every call: a step sends exactly one message, after its
    decisions."""
    specs = [RequestSpec(f"r{i}", tuple(range(i * 100, i * 100 + 20)), 40) for i in range(4)]
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512)
    with server_in_thread(TIGHT_POOL) as server, KVClient(server.target) as client:
        backend = StepBackend(client)
        scheduler = Scheduler(backend, config, specs)
        first = scheduler.step()  # the admissions
        assert len(first.scheduled) == 4
        assert backend.round_trips == 1
        for _ in range(10):
            before = backend.round_trips
            record = scheduler.step()
            assert len(record.scheduled) == 4 and not record.preempted
            assert backend.round_trips == before + 1
        scheduler.abort_all()
        assert backend.num_free_blocks() == TIGHT_POOL.num_blocks - 1


def test_a_version_1_trace_still_replays(tmp_path: Path) -> None:
    """Traces from before ``admit`` hold lookups and allocations: still read and
    replayed; a version this code does not know is refused."""
    tracer = TracingBackend(InProcessBackend(build_manager(TIGHT_POOL)))
    tracer.add_request("a", list(range(40)))
    hit = tracer.get_computed_blocks("a")
    assert tracer.allocate_slots("a", 40, None, 0, True) is not None
    tracer.add_request("b", list(range(40)))
    hit = tracer.get_computed_blocks("b")
    assert hit.num_computed_tokens == 32  # two full blocks of a's
    assert tracer.allocate_slots("b", 8, hit, 0, True) is not None
    path = tmp_path / "v1.jsonl"
    write_trace(path, tracer.trace())
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    path.write_text("\n".join([json.dumps({**header, "version": 1}), *lines[1:]]) + "\n")
    assert check_replay(read_trace(path), InProcessBackend(build_manager(TIGHT_POOL))) == 6

    path.write_text("\n".join([json.dumps({**header, "version": 99}), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="version 99"):
        read_trace(path)


def test_in_process_admit_refuses_bad_ids_and_changes_nothing() -> None:
    backend = InProcessBackend(build_manager(TIGHT_POOL))
    backend.add_request("a", list(range(40)))
    backend.add_request("b", list(range(100, 140)))
    free = backend.num_free_blocks()

    def admit(request_ids: list[str], token_budget: int) -> list[tuple[str, int]]:
        admitted = backend.admit(
            request_ids,
            token_budget,
            AdmitOptions(full_sequence_must_fit=True),
        )
        return [(item.request_id, item.num_new_tokens) for item in admitted]

    # The server's own checks of an Admit (one copy: kvservice.request_table.admission).
    with pytest.raises(core_errors.RequestNotFoundError, match="ghost"):
        admit(["a", "ghost"], 512)
    with pytest.raises(core_errors.InvalidArgumentError, match="'a' is named twice"):
        admit(["a", "b", "a"], 512)
    with pytest.raises(core_errors.InvalidArgumentError, match="request_ids is empty"):
        admit([], 512)
    with pytest.raises(core_errors.InvalidArgumentError, match="token_budget = -1"):
        admit(["a"], -1)
    assert backend.num_free_blocks() == free  # not even the first id was admitted

    # The budget runs out inside b: a chunk of it, as chunked prefill allows.
    assert admit(["a", "b"], 60) == [("a", 40), ("b", 20)]
    assert backend.num_free_blocks() == free - 3 - 2
    with pytest.raises(core_errors.FailedPreconditionError, match="'a' is running"):
        admit(["a"], 512)


@pytest.mark.parametrize("mode", ["step", "stream"])
def test_a_step_admitting_several_requests_is_one_message_for_them(mode: str) -> None:
    """Four requests sharing a cached prefix arrive while two run: the admissions ride
    in the step's one message with the running allocations, and the step's appends and
    frees wait for the next step's message: every step sends exactly one message, and
    the decisions are in-process's."""
    prefix = tuple(range(5000, 5032))  # two full blocks every request shares
    specs = [
        RequestSpec(
            f"r{i}", prefix + tuple(range(i * 100, i * 100 + 8)), 20, arrival_step=0 if i < 2 else 3
        )
        for i in range(6)
    ]
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512)
    local = run_in_process(specs, config)
    with (
        server_in_thread(TIGHT_POOL) as server,
        KVClient(server.target) as client,
        contextlib.ExitStack() as stack,
    ):
        backend: ReplicatedBackend = (
            StepBackend(client) if mode == "step" else stack.enter_context(StreamBackend(client))
        )
        scheduler = Scheduler(backend, config, specs)
        records: list[StepRecord] = []
        sends: list[int] = []
        while not scheduler.done:
            before = backend.round_trips
            records.append(scheduler.step())
            sends.append(backend.round_trips - before)
        assert backend.num_free_blocks() == TIGHT_POOL.num_blocks - 1
    assert records == local
    seen: set[str] = set()
    for record, num_sends in zip(records, sends, strict=True):
        admitted = [s for s in record.scheduled if s.request_id not in seen]
        seen.update(s.request_id for s in admitted)
        assert num_sends == 1, record
    burst = next(r for r in records if r.step == 3)
    assert [(s.request_id, s.num_hit_tokens) for s in burst.scheduled] == [
        ("r0", 0),
        ("r1", 0),
        *((f"r{i}", 32) for i in range(2, 6)),
    ]


@pytest.mark.parametrize("mode", ["in-process", *REMOTE_MODES])
def test_system_prompts_kept_at_a_priority_decide_alike_in_every_mode(mode: str) -> None:
    """The shared_system_prompt workload with its system prompts at priority 90, on a
    pool with the priority policy: the reference scheduler sends each request's
    retention through every door, and every mode decides as in-process; the priorities
    change the decisions (hits survive that LRU evicts)."""
    pool = dataclasses.replace(TIGHT_POOL, eviction_policy="priority")
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=128)
    base = SharedSystemPromptConfig(
        num_requests=12,
        system_prompt_len=64,
        user_len=L(24, 0.7, 1, 96),
        num_system_prompts=4,
        max_model_len=MAX_MODEL_LEN,
        output_len=_OUTPUT,
        requests_per_step=0.5,
    )
    kept = generate(dataclasses.replace(base, system_prompt_priority=90), 4)
    assert all(spec.prefix_priority == 90 and spec.prefix_len == 64 for spec in kept)

    def records(specs: list[RequestSpec], run_mode: str) -> list[StepRecord]:
        if run_mode == "in-process":
            return run(InProcessBackend(build_manager(pool)), specs, config)
        with server_in_thread(pool) as server, KVClient(server.target) as client:
            if run_mode == "unary":
                return run(RemoteBackend(client), specs, config)
            backend_cls = StepBackend if run_mode == "step" else StreamBackend
            with backend_cls(client, overlap=True) as backend:
                return run_replicated(backend, client, specs, config)

    expected = records(kept, "in-process")
    assert records(kept, mode) == expected
    if mode == "in-process":
        lru = records(generate(base, 4), "in-process")

        def hits(run: list[StepRecord]) -> int:
            return sum(s.num_hit_tokens for record in run for s in record.scheduled)

        assert hits(expected) > hits(lru)  # the kept prompts are hit where LRU lost them

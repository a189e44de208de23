"""Why a user turns retention on, side by side in one run: a shared system prompt under
a churn of unique prompts, served by vLLM 0.33.0's LRU, kvservice's LRU, kvservice with
the prompt pinned and kvservice with the prompt at a high eviction priority; then what
each policy costs the allocator on bench_core's 1M-block workload.

**Hits.** Every ``--system-every``-th request is an agent turn: the shared system prompt
plus a short question. The others are unique long prompts that fill the pool between
two turns, so LRU has usually evicted the system prompt by the next one. One seeded
workload, one scheduler loop for every policy (admit in order while the answer is not
``None``, one decode token per running request per step, preempt the newest when a
decode does not fit); printed: prefix-hit tokens, prompt tokens computed, and the turns
that hit the whole system prompt.

**Cost.** bench_core's ``mixed 1M`` workload (``run_workload``, the same loop as
``make bench``), once per policy in rounds, the policies' order rotating: LRU, priority
(every other request's shared prefix at priority 60, so two levels are live) and pinned
(the workload's shared prefixes pinned). ops/s per CPU second, best round; the cost is
each round's ratio to LRU, lowest-highest.

Run: ``python -m benchmarks.bench_retention`` (kvservice compiled unless
``KVSERVICE_PURE_PYTHON=1``; vLLM must be installed, as for the differential tests).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.bench_core import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    KVServiceEngine,
    Prompts,
    SchedRequest,
    VLLMEngine,
    WorkloadSpec,
    run_workload,
    workloads,
)
from kvservice.core.retention_policy import RetentionConfig, TokenRangeRetention

POLICIES = ("vLLM LRU", "kvservice LRU", "kvservice pinned", "kvservice priority")
HIGH_PRIORITY = 80


@dataclass(frozen=True)
class ChurnSpec:
    """The system-prompt-under-churn workload (lengths in blocks unless named tokens)."""

    num_blocks: int
    num_requests: int
    system_blocks: int
    system_every: int
    unique_blocks: tuple[int, int]
    question_tokens: tuple[int, int]
    decode_tokens: tuple[int, int]
    max_running: int
    pinned_fraction: float


@dataclass
class ChurnResult:
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    turns: int = 0
    turns_fully_hit: int = 0
    preemptions: int = 0


@dataclass
class Scheduler:
    """What the loop needs of a policy: its manager and how it makes requests."""

    manager: Any
    new_request: Callable[[str, list[int]], SchedRequest]
    running: Any
    finished: Any
    preempt: Callable[[Any], None]


def churn_prompts(spec: ChurnSpec, seed: int) -> tuple[list[int], list[list[int]], list[int]]:
    """The system prompt, every request's prompt and decode length."""
    rng = random.Random(seed)
    system = [rng.getrandbits(15) for _ in range(spec.system_blocks * BLOCK_SIZE)]
    prompts: list[list[int]] = []
    for i in range(spec.num_requests):
        if i % spec.system_every == 0:
            question = rng.randint(*spec.question_tokens)
            prompts.append(system + [rng.getrandbits(15) for _ in range(question)])
        else:
            length = rng.randint(*spec.unique_blocks) * BLOCK_SIZE + rng.randrange(BLOCK_SIZE)
            prompts.append([rng.getrandbits(15) for _ in range(length)])
    decode = [rng.randint(*spec.decode_tokens) for _ in range(spec.num_requests)]
    return system, prompts, decode


def run_churn(sched: Scheduler, spec: ChurnSpec, seed: int) -> ChurnResult:
    system, prompts, decode_lengths = churn_prompts(spec, seed)
    manager = sched.manager
    result = ChurnResult()
    waiting: list[tuple[SchedRequest, int, bool]] = []
    running: list[tuple[SchedRequest, int, bool]] = []
    left: dict[int, int] = {}
    next_request = 0
    token = 0
    while next_request < len(prompts) or waiting or running:
        while next_request < len(prompts) and len(waiting) + len(running) < spec.max_running:
            i = next_request
            request = sched.new_request(f"r{i}", prompts[i])
            waiting.append((request, i, i % spec.system_every == 0))
            left[id(request)] = decode_lengths[i]
            next_request += 1
        while waiting:
            request, i, is_turn = waiting[0]
            hit, num_hit, _ = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if manager.allocate_slots(request, num_new, num_hit, hit) is None:
                break
            result.hit_tokens += num_hit
            result.computed_prompt_tokens += num_new
            if is_turn and request.num_computed_tokens == 0:
                result.turns += 1
                result.turns_fully_hit += num_hit >= len(system)
            request.num_computed_tokens = request.num_tokens
            request.status = sched.running
            running.append(waiting.pop(0))
        j = 0
        while j < len(running):
            request = running[j][0]
            if left[id(request)] == 0:
                request.status = sched.finished
                manager.free(request)
                running.pop(j)
                continue
            token += 1
            request.append_output_token_ids(token % 30_000)
            if manager.allocate_slots(request, 1) is None:
                victim = running.pop()
                manager.free(victim[0])
                sched.preempt(victim[0])
                waiting.insert(0, victim)
                result.preemptions += 1
                continue  # retry this request (or, if it was the victim, the next)
            request.num_computed_tokens += 1
            left[id(request)] -= 1
            j += 1
    return result


# -- policies -------------------------------------------------------------------------


def kvservice_manager(engine: KVServiceEngine, num_blocks: int, **kwargs: Any) -> Any:
    kvi = engine.interface
    spec = kvi.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bfloat16"
    )
    config = kvi.KVCacheConfig(num_blocks, [], [kvi.KVCacheGroupSpec(["layer0"], spec)])
    return engine.manager_cls(config, max_model_len=MAX_MODEL_LEN, hash_algo="sha256", **kwargs)


def with_prefix_priority(
    manager: Any, prefixes: Sequence[list[int]], share: Callable[[list[int]], bool] | None
) -> Callable[[str, list[int]], SchedRequest]:
    """Requests ``share`` picks keep their shared prefix at ``HIGH_PRIORITY`` (None:
    none does, but each request is looked up alike, so every policy pays the same)."""
    configs = {
        tuple(p[:BLOCK_SIZE]): RetentionConfig((TokenRangeRetention(0, len(p), HIGH_PRIORITY),))
        for p in prefixes
    }

    def new_request(request_id: str, prompt: list[int]) -> SchedRequest:
        config = configs.get(tuple(prompt[:BLOCK_SIZE]))
        if config is None or share is None or not share(prompt):
            return manager.new_request(request_id, prompt)  # type: ignore[no-any-return]
        return manager.new_request(request_id, prompt, retention=config)  # type: ignore[no-any-return]

    return new_request


def churn_scheduler(
    policy: str, spec: ChurnSpec, system: list[int], vllm: VLLMEngine, kvs: KVServiceEngine
) -> Scheduler:
    if policy == "vLLM LRU":
        config = WorkloadSpec("churn", spec.num_blocks, 1, 1, (1, 1), (1, 1), (1, 1))
        manager = vllm.make_manager(config)
        return Scheduler(
            manager, vllm.request_factory(manager), vllm.running, vllm.finished, vllm.preempt
        )
    kwargs: dict[str, Any] = {}
    if policy == "kvservice pinned":
        kwargs["max_pinned_fraction"] = spec.pinned_fraction
    if policy == "kvservice priority":
        kwargs["eviction_policy"] = "priority"
    manager = kvservice_manager(kvs, spec.num_blocks, **kwargs)
    new_request = manager.new_request
    if policy == "kvservice pinned":
        manager.pin_prefix("bench", system, now=0.0)
    if policy == "kvservice priority":
        new_request = with_prefix_priority(manager, [system], lambda _: True)
    return Scheduler(manager, new_request, kvs.running, kvs.finished, kvs.preempt)


class PolicyEngine:
    """bench_core's kvservice engine with a retention policy, for ``run_workload``."""

    def __init__(self, base: KVServiceEngine, policy: str, seed: int, num_ops: int) -> None:
        self.base, self.policy, self.seed, self.num_ops = base, policy, seed, num_ops
        self.running, self.finished = base.running, base.finished
        self.prefixes: list[list[int]] = []

    def make_manager(self, spec: WorkloadSpec) -> Any:
        kwargs: dict[str, Any] = {}
        if self.policy == "priority":
            kwargs["eviction_policy"] = "priority"
        if self.policy == "pinned":
            kwargs["max_pinned_fraction"] = 0.01
        manager = kvservice_manager(self.base, spec.num_blocks, **kwargs)
        # The workload's shared prefixes, as run_workload will generate them.
        prompts = Prompts(spec, self.seed, self.num_ops // 4 + 1).prompts
        self.prefixes = _shared_prefixes(prompts)
        if self.policy == "pinned":
            for prefix in self.prefixes:
                manager.pin_prefix("bench", prefix, now=0.0)
        return manager

    def request_factory(self, manager: Any) -> Callable[[str, list[int]], SchedRequest]:
        share = (lambda p: p[-1] % 2 == 0) if self.policy == "priority" else None
        return with_prefix_priority(manager, self.prefixes, share)

    def preempt(self, request: Any) -> None:
        request.preempt()


def _shared_prefixes(prompts: list[list[int]]) -> list[list[int]]:
    """The whole blocks every prompt starting like another shares with it."""
    by_start: dict[tuple[int, ...], list[int]] = {}
    for prompt in prompts:
        start = tuple(prompt[:BLOCK_SIZE])
        common = by_start.setdefault(start, prompt)
        n = 0
        while n < min(len(common), len(prompt)) and common[n] == prompt[n]:
            n += 1
        by_start[start] = common[: n // BLOCK_SIZE * BLOCK_SIZE]
    return [p for p in by_start.values() if p]


# -- the run --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--blocks", type=int, default=768, help="the churn pool's blocks")
    parser.add_argument("--system-blocks", type=int, default=96)
    parser.add_argument("--system-every", type=int, default=16)
    parser.add_argument("--ops", type=int, default=60_000, help="manager calls per cost run")
    parser.add_argument("--rounds", type=int, default=5, help="cost rounds; best of each")
    parser.add_argument("--big-pool", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    spec = ChurnSpec(
        num_blocks=args.blocks,
        num_requests=args.requests,
        system_blocks=args.system_blocks,
        system_every=args.system_every,
        unique_blocks=(24, 80),
        question_tokens=(8, 64),
        decode_tokens=(16, 96),
        max_running=8,
        pinned_fraction=0.15,
    )
    vllm, kvs = VLLMEngine(), KVServiceEngine()
    print(
        f"bench_retention: vLLM {vllm.version}, kvservice "
        f"{'compiled' if kvs.compiled else 'pure Python'}; seed {args.seed}"
    )
    print_hits(spec, args.seed, vllm, kvs)
    print_cost(args, kvs)
    return 0


def print_hits(spec: ChurnSpec, seed: int, vllm: VLLMEngine, kvs: KVServiceEngine) -> None:
    system = churn_prompts(spec, seed)[0]
    print(
        f"\nsystem prompt under churn: {spec.num_blocks} blocks of {BLOCK_SIZE}, "
        f"{spec.num_requests} requests, {spec.max_running} running; a "
        f"{len(system)}-token system prompt every {spec.system_every}th request, the "
        f"others unique ({spec.unique_blocks[0]}-{spec.unique_blocks[1]} blocks); pinned: "
        f"budget {spec.pinned_fraction:.0%}; priority: the system prompt at {HIGH_PRIORITY}"
    )
    print(f"{'policy':<20}{'hit tokens':>12}{'vs LRU':>8}{'computed':>11}{'full turns':>12}")
    results = {
        p: run_churn(churn_scheduler(p, spec, system, vllm, kvs), spec, seed) for p in POLICIES
    }
    if results["vLLM LRU"].hit_tokens != results["kvservice LRU"].hit_tokens:
        print("  !! kvservice LRU and vLLM LRU disagree")
    base = results["vLLM LRU"].hit_tokens or 1
    for policy, r in results.items():
        print(
            f"{policy:<20}{r.hit_tokens:>12,}{r.hit_tokens / base:>7.2f}x"
            f"{r.computed_prompt_tokens:>11,}{r.turns_fully_hit:>7}/{r.turns:<4}"
        )


def print_cost(args: argparse.Namespace, kvs: KVServiceEngine) -> None:
    spec = next(s for s in workloads(args.big_pool) if s.name.startswith("mixed "))
    policies = ("lru", "priority", "pinned")
    per_round: dict[str, list[float]] = {p: [] for p in policies}
    hits: dict[str, int] = {}
    for r in range(args.rounds):
        for policy in policies[r % 3 :] + policies[: r % 3]:
            engine = PolicyEngine(kvs, policy, args.seed, args.ops)
            mix, seconds = run_workload(engine, spec, args.ops, args.seed)
            per_round[policy].append(mix.ops / seconds)
            hits[policy] = mix.hit_tokens
    print(
        f"\nallocator cost, bench_core '{spec.name}' ({args.ops} calls, {args.rounds} rounds, "
        "order rotating): ops/s per CPU second, best round; ratio to LRU per round"
    )
    print(f"{'policy':<10}{'ops/s':>10}{'vs LRU':>13}{'hit tokens':>12}")
    for policy in policies:
        ratios = [x / y for x, y in zip(per_round[policy], per_round["lru"], strict=True)]
        print(
            f"{policy:<10}{max(per_round[policy]):>10,.0f}"
            f"{min(ratios):>8.2f}-{max(ratios):.2f}{hits[policy]:>12,}"
        )


if __name__ == "__main__":
    raise SystemExit(main())

"""The tiny transformer on the paged cache, driven by the core's ``KVCacheManager``.

Prefix caching must be invisible: every logit the paged run produces (prefill after a
prefix hit, decode, recompute after preemption, blocks reused after eviction) equals
the same sequence computed from scratch with no cache, within the dtype's tolerance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from gpu_runtime.attention import AttentionBackend, FlexAttentionBackend, TorchAttentionBackend
from gpu_runtime.model import TinyModelConfig, TinyTransformer
from gpu_runtime.runtime import KVCacheRuntime
from kvservice.core.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus

BLOCK_SIZE = 4
MODEL = TinyModelConfig()
TOLERANCES = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


@dataclass
class Driver:
    """A minimal scheduler: admit with prefix lookup, decode greedily, preempt."""

    manager: KVCacheManager
    runtime: KVCacheRuntime
    model: TinyTransformer
    atol: float
    rng: random.Random
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    allocated: list[int] = field(default_factory=list)
    checked: int = 0

    def step(self, jobs: list[tuple[Request, int]]) -> None:
        """Compute ``n`` new tokens of each request in one batch; check the logits."""
        self.runtime.apply(self.manager.take_new_block_ids(), None)
        requests = [r for r, _ in jobs]
        metadata = self.runtime.build_metadata(
            0,
            [n for _, n in jobs],
            [r.num_tokens for r in requests],
            [self.manager.get_block_ids(r.request_id)[0] for r in requests],
        )
        tokens = [t for r, n in jobs for t in r.all_token_ids[r.num_tokens - n :]]
        logits = self.model.forward(tokens, metadata, self.runtime.kv_cache)
        ends = torch.tensor([n for _, n in jobs]).cumsum(0) - 1
        for request, end in zip(requests, ends.tolist(), strict=True):
            expected = self.model.forward_dense(request.all_token_ids)[-1]
            torch.testing.assert_close(logits[end], expected, atol=self.atol, rtol=self.atol)
            self.checked += 1
            request.num_computed_tokens = request.num_tokens
            request.status = RequestStatus.RUNNING
            request.append_output_token_ids(int(logits[end].argmax()))

    def admit(self, request: Request) -> int | None:
        """Prefix lookup + allocation; the number of tokens to compute, or None."""
        hit, num_hit, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        if new is None:
            return None
        self.prefix_hit_tokens += num_hit
        self.allocated.extend(new.get_block_ids()[0])
        return request.num_tokens - num_hit

    def grow(self, request: Request) -> bool:
        new = self.manager.allocate_slots(request, 1)
        if new is None:
            return False
        self.allocated.extend(new.get_block_ids()[0])
        return True


def run_workload(
    backend: AttentionBackend, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> Driver:
    spec = MODEL.kv_cache_spec(BLOCK_SIZE, str(dtype).removeprefix("torch."))
    config = KVCacheConfig(
        num_blocks=14,  # small: admissions evict cached prefixes, decode preempts
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(MODEL.layer_names, spec)],
        needs_kv_cache_zeroing=True,
    )
    manager = KVCacheManager(config, max_model_len=64)
    model = TinyTransformer(MODEL, dtype=dtype, device=device, backend=backend)
    rng = random.Random(seed)
    driver = Driver(manager, KVCacheRuntime(config, device), model, TOLERANCES[dtype], rng)
    prefixes = [
        [rng.randrange(MODEL.vocab_size) for _ in range(rng.choice([5, 8, 11]))] for _ in range(3)
    ]
    waiting: list[Request] = []
    running: list[Request] = []
    for i in range(10):
        suffix = [rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(1, 6))]
        waiting.append(manager.new_request(f"r{i}", rng.choice(prefixes) + suffix))
    steps = 0
    while (waiting or running) and steps < 60:
        steps += 1
        jobs: list[tuple[Request, int]] = []
        for request in list(running):
            if request not in running:
                continue  # preempted earlier in this step
            if request.num_output_tokens >= 10 or request.num_tokens >= 40:
                running.remove(request)
                request.status = RequestStatus.FINISHED
                manager.free(request)
                continue
            request.num_computed_tokens = request.num_tokens - 1
            while not driver.grow(request):
                # No room: preempt the newest running request (maybe this one).
                victim = running.pop()
                manager.free(victim)
                victim.preempt()
                waiting.insert(0, victim)
                driver.preemptions += 1
                jobs = [(r, n) for r, n in jobs if r is not victim]
                if victim is request:
                    break
            else:
                jobs.append((request, 1))
        while waiting and len(running) < 4:
            todo = driver.admit(waiting[0])
            if todo is None:
                break
            request = waiting.pop(0)
            running.append(request)
            jobs.append((request, todo))
        if jobs:
            driver.step(jobs)
    return driver


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        (TorchAttentionBackend(), torch.float32),
        (TorchAttentionBackend(), torch.bfloat16),
        (FlexAttentionBackend(compile=False), torch.float32),
    ],
    ids=["torch-fp32", "torch-bf16", "flex-eager-fp32"],
)
def test_prefix_caching_is_invisible_in_the_logits(
    backend: AttentionBackend, dtype: torch.dtype
) -> None:
    driver = run_workload(backend, dtype, seed=0)
    # The workload must have exercised what it claims to check.
    assert driver.checked > 30
    assert driver.prefix_hit_tokens > 0
    assert driver.preemptions > 0
    assert len(driver.allocated) > len(set(driver.allocated)), "no block was ever reused"

"""The co-located runtime (``--runtime torch``): the server owns the KV tensors.

End to end through the real service: a scheduler drives admission (with prefix hits),
decode, preemption and finishing over gRPC, while ``gpu_runtime``'s tiny transformer
runs in the same process on the server's own tensors (``handle.runtime``) at the
block ids the answers carry. Prefix caching must be invisible in the logits, and every
block an answer hands out must already read as zeros when the answer arrives (the
cache starts full of NaN, so a block the server failed to zero would poison them).
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from gpu_runtime.attention import TorchAttentionBackend
from gpu_runtime.model import TinyModelConfig, TinyTransformer
from gpu_runtime.runtime import KVCacheRuntime
from kvservice.cli import build_parser
from kvservice.client import AsyncKVClient, FreeMode, StepBuilder
from kvservice.client.types import Allocation
from kvservice.core.errors import InvalidArgumentError
from kvservice.server.app import KVCacheServer
from kvservice.server.config import ServerConfig
from kvservice.server.errors import RuntimeUnavailableError
from kvservice.server.runtime import kv_cache_budget
from kvservice.server.settings import SettingsError, load_settings
from tests.servers import TIMEOUT_S, run_kvservice, running_server

MODEL = TinyModelConfig()
BLOCK_SIZE = 4
# 13 usable blocks of 4 tokens: admissions evict cached prefixes, decode preempts.
RUNTIME_POOL = ServerConfig(
    port=0,
    metrics_port=None,
    num_blocks=14,
    block_size=BLOCK_SIZE,
    max_model_len=48,
    num_layers=MODEL.num_layers,
    num_kv_heads=MODEL.num_kv_heads,
    head_size=MODEL.head_size,
    dtype="float32",
    shutdown_grace_s=0,
    runtime="torch",
    device="cpu",
)
ATOL = 1e-3
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    # Tiny tensors: OpenMP fork/join on 2 shared cores costs more than the math.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fill_with_nan(runtime: KVCacheRuntime) -> None:
    """Poison every block but the null block 0: the runtime's paged attention reads
    block 0 as padding and relies on it holding zeros (the buffer's initial value,
    which nothing ever writes), exactly as before this call."""
    for view in runtime.kv_cache.groups:
        view[:, :, 1:].fill_(float("nan"))


def assert_zeroed(runtime: KVCacheRuntime, allocation: Allocation) -> None:
    """The answer names its fresh blocks as zeroed by the server, and they are."""
    fresh = [b for group in allocation.new_block_ids for b in group]
    assert allocation.block_ids_to_zero == ()
    assert sorted(allocation.block_ids_zeroed) == sorted(fresh)
    for view in runtime.kv_cache.groups:
        blocks = view[:, :, list(allocation.block_ids_zeroed)]
        assert torch.equal(blocks, torch.zeros_like(blocks)), allocation.block_ids_zeroed


@dataclass
class Scheduler:
    """A minimal scheduler over the real client: admit with prefix lookup, decode
    greedily, preempt the newest request when out of blocks, finish."""

    client: AsyncKVClient
    runtime: KVCacheRuntime
    model: TinyTransformer
    tokens: dict[str, list[int]] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)
    num_outputs: dict[str, int] = field(default_factory=dict)
    hit_requests: set[str] = field(default_factory=set)
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    allocated: list[int] = field(default_factory=list)
    checked: int = 0
    checked_after_hit: int = 0

    async def add(self, request_id: str, prompt: list[int]) -> None:
        await self.client.add_request(request_id, prompt)
        self.tokens[request_id] = list(prompt)
        self.num_outputs[request_id] = 0

    def _took(self, request_id: str, allocation: Allocation) -> None:
        assert_zeroed(self.runtime, allocation)
        self.tables[request_id].extend(allocation.new_block_ids[0])
        self.allocated.extend(allocation.new_block_ids[0])

    async def admit(self, request_id: str) -> int | None:
        """Lookup + allocation; the tokens to compute, or None when there is no room."""
        hit = await self.client.get_computed_blocks(request_id)
        num_hit = hit.num_computed_tokens
        allocation = await self.client.allocate_slots(
            request_id, len(self.tokens[request_id]) - num_hit, hit
        )
        if allocation is None:
            return None
        self.tables[request_id] = list(hit.block_ids[0])
        self._took(request_id, allocation)
        if num_hit:
            self.prefix_hit_tokens += num_hit
            self.hit_requests.add(request_id)
        return len(self.tokens[request_id]) - num_hit

    async def grow(self, request_id: str) -> bool:
        allocation = await self.client.allocate_slots(request_id, 1)
        if allocation is None:
            return False
        self._took(request_id, allocation)
        return True

    async def preempt(self, request_id: str) -> None:
        await self.client.free(request_id, FreeMode.PREEMPT)
        del self.tables[request_id]
        self.preemptions += 1

    async def finish(self, request_id: str) -> None:
        await self.client.free(request_id, FreeMode.FINISH)
        del self.tables[request_id]

    async def step(self, jobs: list[tuple[str, int]]) -> None:
        """Run ``n`` new tokens of each request in one batch on the server's tensors;
        check each request's last logits against the dense oracle; append the
        sampled tokens through the service."""
        for rid, _ in jobs:
            # The tables kept from the answers are the server's.
            assert (await self.client.get_block_ids(rid))[0] == tuple(self.tables[rid])
        metadata = self.runtime.build_metadata(
            0,
            [n for _, n in jobs],
            [len(self.tokens[rid]) for rid, _ in jobs],
            [self.tables[rid] for rid, _ in jobs],
        )
        new_tokens = [t for rid, n in jobs for t in self.tokens[rid][-n:]]
        logits = self.model.forward(new_tokens, metadata, self.runtime.kv_cache)
        ends = torch.tensor([n for _, n in jobs]).cumsum(0) - 1
        for (rid, _), end in zip(jobs, ends.tolist(), strict=True):
            expected = self.model.forward_dense(self.tokens[rid])[-1]
            torch.testing.assert_close(logits[end].cpu(), expected.cpu(), atol=ATOL, rtol=ATOL)
            self.checked += 1
            self.checked_after_hit += rid in self.hit_requests
            sampled = int(logits[end].argmax())
            await self.client.append_tokens(rid, [sampled])
            self.tokens[rid].append(sampled)
            self.num_outputs[rid] += 1


async def run_workload(device: str, seed: int) -> Scheduler:
    config = dataclasses.replace(RUNTIME_POOL, device=device)
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target, client_id="runtime-test") as client,
    ):
        runtime = server.handle.runtime
        assert runtime is not None
        fill_with_nan(runtime)
        model = TinyTransformer(MODEL, device=device, backend=TorchAttentionBackend())
        scheduler = Scheduler(client, runtime, model)
        rng = random.Random(seed)
        prefixes = [
            [rng.randrange(MODEL.vocab_size) for _ in range(rng.choice([5, 8, 11]))]
            for _ in range(3)
        ]
        waiting: list[str] = []
        for i in range(10):
            suffix = [rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(1, 6))]
            await scheduler.add(f"r{i}", rng.choice(prefixes) + suffix)
            waiting.append(f"r{i}")
        running: list[str] = []
        steps = 0
        while (waiting or running) and steps < 60:
            steps += 1
            jobs: list[tuple[str, int]] = []
            for rid in list(running):
                if rid not in running:
                    continue  # preempted earlier in this step
                if scheduler.num_outputs[rid] >= 10 or len(scheduler.tokens[rid]) >= 40:
                    running.remove(rid)
                    await scheduler.finish(rid)
                    continue
                while not await scheduler.grow(rid):
                    # No room: preempt the newest running request (maybe this one).
                    victim = running.pop()
                    await scheduler.preempt(victim)
                    waiting.insert(0, victim)
                    jobs = [(r, n) for r, n in jobs if r != victim]
                    if victim == rid:
                        break
                else:
                    jobs.append((rid, 1))
            while waiting and len(running) < 4:
                todo = await scheduler.admit(waiting[0])
                if todo is None:
                    break
                running.append(waiting.pop(0))
                jobs.append((running[-1], todo))
            if jobs:
                await scheduler.step(jobs)
        config_seen = await client.get_cache_config()
        assert config_seen.blocks_zeroed_by_server
        assert config_seen.needs_kv_cache_zeroing
        assert config_seen.runtime_device == device
        return scheduler


def assert_exercised(scheduler: Scheduler) -> None:
    # The workload must have exercised what it claims to check.
    assert scheduler.checked > 30
    assert scheduler.prefix_hit_tokens > 0
    assert scheduler.checked_after_hit > 0
    assert scheduler.preemptions > 0
    assert len(scheduler.allocated) > len(set(scheduler.allocated)), "no block was reused"


async def test_prefix_caching_is_invisible_through_the_service() -> None:
    assert_exercised(await run_workload("cpu", seed=0))


@needs_cuda
async def test_prefix_caching_is_invisible_through_the_service_on_cuda() -> None:
    assert_exercised(await run_workload("cuda", seed=0))


async def test_a_step_zeroes_its_blocks_once_before_answering() -> None:
    """Step and StepStream: every allocation of a step is zeroed by one runtime call
    made before the step's answer, and each answer names its blocks as zeroed."""
    async with (
        running_server(RUNTIME_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        runtime = server.handle.runtime
        assert runtime is not None
        fill_with_nan(runtime)
        calls: list[list[int]] = []
        apply = runtime.apply

        def counting_apply(
            new_block_ids_to_zero: Sequence[int] | None = None,
            copies: Sequence[tuple[int, int]] | None = None,
        ) -> None:
            calls.append(list(new_block_ids_to_zero or []))
            apply(new_block_ids_to_zero, copies)

        runtime.apply = counting_apply  # type: ignore[method-assign]
        step = StepBuilder()
        adds = [step.add_request(f"s{i}", list(range(i * 10, i * 10 + 6))) for i in range(3)]
        allocs = [step.allocate_slots(f"s{i}", 6) for i in range(3)]
        results = await client.step(step)
        assert results.ok and len(adds) == 3
        answers = [results[a] for a in allocs]
        assert all(a is not None for a in answers)
        for answer in answers:
            assert answer is not None
            assert_zeroed(runtime, answer)
        assert calls == [[b for a in answers if a for b in a.block_ids_zeroed]]

        async with client.session() as session:
            stream_step = StepBuilder()
            for i in range(3):
                stream_step.append_tokens(f"s{i}", [1, 2, 3])
            grows = [stream_step.allocate_slots(f"s{i}", 3) for i in range(3)]
            streamed = await session.step(stream_step)
        grown = [streamed[g] for g in grows]
        assert len(calls) == 2
        for answer in grown:
            assert answer is not None
            assert_zeroed(runtime, answer)
        assert calls[1] == [b for a in grown if a for b in a.block_ids_zeroed]


async def test_without_a_runtime_the_answer_lists_blocks_for_the_worker() -> None:
    """The default: no tensors in the server, fresh blocks go to block_ids_to_zero."""
    config = dataclasses.replace(
        RUNTIME_POOL, runtime="none", needs_kv_cache_zeroing=True, num_blocks=20
    )
    async with running_server(config) as server, AsyncKVClient(server.handle.target) as client:
        assert server.handle.runtime is None
        await client.add_request("w", list(range(9)))
        allocation = await client.allocate_slots("w", 9)
        assert allocation is not None
        assert allocation.block_ids_zeroed == ()
        assert list(allocation.block_ids_to_zero) == list(allocation.new_block_ids[0])
        seen = await client.get_cache_config()
        assert (seen.blocks_zeroed_by_server, seen.runtime_device) == (False, "")


def test_the_runtime_is_sized_from_the_server_pool() -> None:
    """The tensors match the pool, zeroing is forced on, and a CPU memory budget sizes
    num_blocks from the bytes given (num_blocks ignored)."""
    server = KVCacheServer(RUNTIME_POOL)
    assert server.runtime is not None
    kv_config = server.table.manager.kv_cache_config
    assert kv_config.needs_kv_cache_zeroing
    assert server.runtime.kv_cache.num_blocks == kv_config.num_blocks == 14
    page = kv_config.page_size_bytes
    budget = page * MODEL.num_layers * 37 + page // 2  # 37.5 blocks' worth
    sized = KVCacheServer(dataclasses.replace(RUNTIME_POOL, kv_cache_memory_bytes=budget))
    assert sized.runtime is not None
    assert sized.table.manager.kv_cache_config.num_blocks == 37
    assert sized.runtime.kv_cache.nbytes <= budget


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"runtime": "none", "device": "cuda"}, "needs runtime 'torch'"),
        ({"gpu_memory_utilization": 0.5}, "needs --runtime torch --device cuda"),
        ({"kv_cache_memory_bytes": -1}, "must be positive"),
        ({"runtime": "jax"}, "runtime must be one of"),
    ],
)
def test_meaningless_runtime_options_are_refused(changes: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        KVCacheServer(dataclasses.replace(RUNTIME_POOL, **changes))  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
def test_cuda_absent_is_refused_in_process() -> None:
    with pytest.raises(RuntimeUnavailableError, match=r"torch\.cuda\.is_available\(\) is False"):
        KVCacheServer(dataclasses.replace(RUNTIME_POOL, device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
async def test_bad_device_fails_startup_with_exit_code_2() -> None:
    """`kvservice serve --runtime torch --device cuda` without CUDA: a clear message
    on stderr, exit code 2, nothing served."""
    status, stdout, message = await run_kvservice(
        "serve", "--port=0", "--no-metrics", "--runtime=torch", "--device=cuda"
    )
    assert status == 2
    assert message.startswith("kvservice: device 'cuda' is not available"), message
    assert "Traceback" not in message
    assert "serving" not in stdout


def test_the_default_server_does_not_import_torch() -> None:
    """`make serve` without flags stays light: building the CLI, the settings and a
    server (no runtime) imports neither torch nor gpu_runtime."""
    code = (
        "import os, sys\n"
        "from kvservice.cli import build_parser\n"
        "from kvservice.server.app import KVCacheServer\n"
        "from kvservice.server.settings import load_settings\n"
        "args = build_parser().parse_args(['serve', '--port=0', '--no-metrics'])\n"
        "KVCacheServer(load_settings(vars(args), os.environ).server)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'gpu_runtime')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@needs_cuda
def test_cuda_budget_comes_from_free_device_memory() -> None:
    """gpu_memory_utilization sizes the pool from torch.cuda.mem_get_info; a byte
    budget over the free memory is refused before anything is allocated."""
    free, total = torch.cuda.mem_get_info()
    config = dataclasses.replace(RUNTIME_POOL, device="cuda")
    used = total - free
    utilization = min(1.0, (used + 64 * 2**20) / total)
    budget = kv_cache_budget(dataclasses.replace(config, gpu_memory_utilization=utilization))
    assert budget is not None
    assert 0 < budget <= free
    with pytest.raises(RuntimeUnavailableError, match="exceeds the free memory"):
        KVCacheServer(dataclasses.replace(config, kv_cache_memory_bytes=total + 1))
    server = KVCacheServer(dataclasses.replace(config, kv_cache_memory_bytes=16 * 2**20))
    assert server.runtime is not None
    assert server.runtime.kv_cache.buffer.device.type == "cuda"
    assert server.runtime.kv_cache.nbytes <= 16 * 2**20


def test_runtime_settings_from_flags_env_and_file(tmp_path: Path) -> None:
    """The runtime options ride the one settings table: flags, KVSERVICE_* and TOML;
    0 spells "no memory budget" on every surface."""
    default = load_settings(vars(build_parser().parse_args(["serve"])), {}).server
    assert (default.runtime, default.device, default.has_runtime) == ("none", "cpu", False)
    assert default.kv_cache_memory_bytes is None and default.gpu_memory_utilization is None
    config = tmp_path / "c.toml"
    config.write_text('runtime = "torch"\nkv_cache_memory_bytes = 0\n')
    env = {"KVSERVICE_DEVICE": "cuda", "KVSERVICE_GPU_MEMORY_UTILIZATION": "0.5"}
    args = build_parser().parse_args(["serve", "--config", str(config)])
    server = load_settings(vars(args), env, args.config).server
    assert (server.runtime, server.device, server.gpu_memory_utilization) == ("torch", "cuda", 0.5)
    assert server.kv_cache_memory_bytes is None
    args = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "4096"])
    assert load_settings(vars(args), {}).server.kv_cache_memory_bytes == 4096
    with pytest.raises(SettingsError, match="device must be one of cpu, cuda"):
        load_settings({}, {"KVSERVICE_DEVICE": "tpu"})

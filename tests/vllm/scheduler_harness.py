"""vLLM 0.33's real ``Scheduler`` driven without a model, for differential tests.

``build_scheduler`` builds vLLM's scheduler from a tiny local ``config.json`` naming a
stub architecture that is registered but never run; ``FakeModelRunner`` answers each
``SchedulerOutput`` with one sampled token for every request whose prompt is done
(seeded by request and position, so two schedulers fed the same requests sample the
same tokens), and requests stop through vLLM's own checks (stop tokens, ``max_tokens``).
``Workload`` drives one scheduler step by step with seeded arrivals and aborts, and
``snapshot`` reduces a step to what must match between two managers.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from vllm import ModelRegistry
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvservice.integrations.vllm import KVServiceScheduler

VOCAB_SIZE = 64
STOP_TOKEN = 7
MAX_MODEL_LEN = 4096


class StubForCausalLM(torch.nn.Module):
    """Registered so that ``ModelConfig`` accepts the config; never instantiated."""

    def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: Any) -> Any:
        raise NotImplementedError

    def forward(self, input_ids: Any, positions: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def compute_logits(self, hidden_states: Any) -> Any:
        raise NotImplementedError


@cache
def _model_dir() -> str:
    ModelRegistry.register_model("StubForCausalLM", StubForCausalLM)
    init_none_hash(sha256)
    path = tempfile.mkdtemp(prefix="kvservice-vllm-stub-")
    config = {
        "architectures": ["StubForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_MODEL_LEN,
    }
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    return path


@dataclass(frozen=True)
class SchedulerSetup:
    """One scheduler configuration; ``groups`` are (kind, block size, window)."""

    num_blocks: int = 129
    block_size: int = 16
    groups: tuple[tuple[str, int, int], ...] = (("full", 16, 0),)
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    watermark: float = 0.0
    max_model_len: int = 2048


def _spec(kind: str, block_size: int, window: int) -> Any:
    common = {"block_size": block_size, "num_kv_heads": 4, "head_size": 16, "dtype": torch.float16}
    if kind == "full":
        return FullAttentionSpec(**common)
    assert kind == "sliding_window", kind
    return SlidingWindowSpec(**common, sliding_window=window)


def kv_cache_config(setup: SchedulerSetup) -> Any:
    return KVCacheConfig(
        num_blocks=setup.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layers.{i}"], _spec(kind, size, window))
            for i, (kind, size, window) in enumerate(setup.groups)
        ],
    )


def vllm_config(setup: SchedulerSetup) -> Any:
    model = ModelConfig(
        model=_model_dir(),
        skip_tokenizer_init=True,
        max_model_len=setup.max_model_len,
        dtype="float16",
        seed=0,
    )
    cache_config = CacheConfig(
        block_size=setup.block_size, enable_prefix_caching=setup.enable_prefix_caching
    )
    cache_config.num_gpu_blocks = setup.num_blocks
    scheduler_config = SchedulerConfig(
        max_model_len=setup.max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        long_prefill_token_threshold=setup.long_prefill_token_threshold,
        enable_chunked_prefill=setup.enable_chunked_prefill,
        watermark=setup.watermark,
    )
    return VllmConfig(
        model_config=model, cache_config=cache_config, scheduler_config=scheduler_config
    )


def build_scheduler(setup: SchedulerSetup, scheduler_cls: type = Scheduler) -> Any:
    """vLLM's ``Scheduler`` (or ``KVServiceScheduler``) for ``setup``, stats on."""
    config = vllm_config(setup)
    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config(setup),
        structured_output_manager=StructuredOutputManager(config),
        block_size=setup.block_size,
        log_stats=True,
    )


def _block_hasher(block_size: int) -> Callable[[Request], list[Any]]:
    hasher: Callable[[Request], list[Any]] = get_request_block_hasher(block_size, sha256)
    return hasher


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    arrival_time: float = 0.0

    def build(self, hash_block_size: int) -> Request:
        return Request(
            self.request_id,
            list(self.prompt),
            SamplingParams(max_tokens=self.max_tokens, stop_token_ids=[STOP_TOKEN]),
            None,
            arrival_time=self.arrival_time,
            cache_salt=self.cache_salt,
            block_hasher=_block_hasher(hash_block_size),
        )


def sampled_token(request_id: str, position: int) -> int:
    """The fake model's token at ``position``: a function of the request and position
    only, so twin schedulers sample alike whatever their steps."""
    return random.Random(f"{request_id}:{position}").randrange(VOCAB_SIZE)


def model_runner_output(scheduler: Any, output: Any) -> Any:
    """One sampled token for each scheduled request whose known tokens are all computed
    (a prefill chunk that does not finish the prompt samples nothing)."""
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([sampled_token(req_id, request.num_tokens)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _block_ids(ids: Any) -> Any:
    return None if ids is None else tuple(tuple(group) for group in ids)


def snapshot(scheduler: Any, output: Any) -> dict[str, Any]:
    """Everything of one step that depends on the KV cache manager."""
    cached = output.scheduled_cached_reqs
    return {
        "new": [
            (r.req_id, _block_ids(r.block_ids), r.num_computed_tokens)
            for r in output.scheduled_new_reqs
        ],
        "cached": list(
            zip(
                cached.req_ids,
                [_block_ids(ids) for ids in cached.new_block_ids],
                cached.num_computed_tokens,
                cached.num_output_tokens,
                strict=True,
            )
        ),
        "resumed": sorted(cached.resumed_req_ids),
        "num_scheduled_tokens": dict(output.num_scheduled_tokens),
        "preempted": sorted(output.preempted_req_ids),
        "finished": sorted(output.finished_req_ids),
        "block_ids_to_zero": output.new_block_ids_to_zero,
        "copies": output.kv_cache_block_copies,
        "usage": scheduler.kv_cache_manager.usage,
        "free": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
    }


def _stats(engine_outputs: Any) -> Any:
    for outputs in engine_outputs.values():
        stats = outputs.scheduler_stats
        if stats is not None:
            p = stats.prefix_cache_stats
            return (
                stats.kv_cache_usage,
                (
                    p.reset,
                    p.requests,
                    p.queries,
                    p.hits,
                    p.preempted_requests,
                    p.preempted_queries,
                    p.preempted_hits,
                ),
            )
    return None


@dataclass
class Workload:
    """Seeded traffic: shared prefixes, arrivals over steps, aborts before a step and
    between ``schedule`` and ``update_from_output``."""

    seed: int
    num_requests: int = 60
    prompt_len: tuple[int, int] = (8, 300)
    max_tokens: tuple[int, int] = (1, 60)
    arrivals_per_step: tuple[int, int] = (0, 6)
    abort_rate: float = 0.02
    salts: tuple[str | None, ...] = (None,)
    shared_prefixes: int = 4
    hash_block_size: int = 16
    _specs: list[RequestSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        prefixes = [
            tuple(rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(16, 160)))
            for _ in range(self.shared_prefixes)
        ]
        for i in range(self.num_requests):
            length = rng.randrange(*self.prompt_len)
            prefix = rng.choice(prefixes) if prefixes and rng.random() < 0.6 else ()
            body = tuple(rng.randrange(VOCAB_SIZE) for _ in range(max(length - len(prefix), 1)))
            self._specs.append(
                RequestSpec(
                    f"req-{i}",
                    prefix + body,
                    rng.randrange(*self.max_tokens),
                    cache_salt=rng.choice(self.salts),
                    arrival_time=float(i),
                )
            )

    def run(self, scheduler: Any, max_steps: int = 2000) -> list[Any]:
        """Drive ``scheduler`` to completion; the per-step snapshots."""
        rng = random.Random(self.seed + 1)
        pending = list(self._specs)
        trace: list[Any] = []
        for _ in range(max_steps):
            for _ in range(rng.randrange(*self.arrivals_per_step)):
                if pending:
                    scheduler.add_request(pending.pop(0).build(self.hash_block_size))
            self._maybe_abort(scheduler, rng)
            if not pending and not scheduler.has_requests():
                return trace
            output = scheduler.schedule()
            step = snapshot(scheduler, output)
            runner_output = model_runner_output(scheduler, output)
            self._maybe_abort(scheduler, rng)
            engine_outputs = scheduler.update_from_output(output, runner_output)
            step["stats"] = _stats(engine_outputs)
            trace.append(step)
        raise AssertionError(f"workload {self.seed} did not finish in {max_steps} steps")

    def _maybe_abort(self, scheduler: Any, rng: random.Random) -> None:
        live = sorted(scheduler.requests)
        victims = [req_id for req_id in live if rng.random() < self.abort_rate]
        if victims:
            scheduler.finish_requests(victims, RequestStatus.FINISHED_ABORTED)


def first_difference(a: list[Any], b: list[Any]) -> str | None:
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            keys = [k for k in x if x[k] != y.get(k)]
            return f"step {step}: " + "; ".join(f"{k}: {x[k]!r} != {y.get(k)!r}" for k in keys)
    if len(a) != len(b):
        return f"lengths differ: {len(a)} != {len(b)}"
    return None


__all__ = [
    "KVServiceScheduler",
    "SchedulerSetup",
    "Workload",
    "build_scheduler",
    "first_difference",
]

"""vLLM 0.33's scheduler without a model: for tests and benchmarks of the integration.

``build_scheduler`` builds vLLM's own ``Scheduler`` (or ``KVServiceScheduler``) from a
tiny local ``config.json`` naming a stub architecture that is registered with vLLM but
never run, so nothing is downloaded and no GPU is needed. The caller plays the model:
it answers each ``SchedulerOutput`` with a ``ModelRunnerOutput`` of its own.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache
from typing import Any
from unittest import mock

import torch
from vllm import ModelRegistry
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

VOCAB_SIZE = 64
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
    """One scheduler configuration; ``groups`` are (kind, block size, window):
    ``"full"``, ``"sliding_window"``, or ``"mamba"`` (a Mamba "align" state group; the
    config then sets vLLM's ``mamba_cache_mode="align"``, whose scheduler splits
    prefills where the states are cached). ``hash_block_size`` below ``block_size``
    enables partial-block prefix hits (0: ``block_size``)."""

    num_blocks: int = 129
    block_size: int = 16
    groups: tuple[tuple[str, int, int], ...] = (("full", 16, 0),)
    hash_block_size: int = 0
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    watermark: float = 0.0
    max_model_len: int = 2048
    # vLLM's default on a GPU; the scheduler is then driven in the engine's batch-queue
    # order (two steps in flight).
    async_scheduling: bool = False
    # Draft tokens per step (vLLM's n-gram speculative decoding: no draft model).
    num_speculative_tokens: int = 0
    # The drafter scheduled as EAGLE is (``eagle_drafting``): lookahead slots for its
    # drafts, and prefix hits that drop their last block (vLLM's
    # --speculative-config '{"disable_lookahead_block_hashes": true}'), or with
    # ``eagle_lookahead_hashes`` vLLM 0.33's default: each block hash covers the token
    # after the block instead.
    eagle: bool = False
    eagle_lookahead_hashes: bool = False
    # The groups holding the drafter's layers (vLLM marks them ``is_eagle_group``);
    # empty: none marked, so every group counts as the drafter's.
    eagle_groups: tuple[int, ...] = ()
    # vLLM's CPU offloading (``--kv-offloading-size``): the host bytes of its
    # OffloadingConnector (0: no connector), its eviction policy and extra config.
    offload_cpu_bytes: int = 0
    offload_eviction_policy: str = "lru"
    offload_extra: tuple[tuple[str, Any], ...] = ()
    # vLLM's kv_load_failure_policy: "fail" (its default) or "recompute".
    kv_load_failure_policy: str = "fail"

    @property
    def mamba_align(self) -> bool:
        return any(kind == "mamba" for kind, _, _ in self.groups)

    @property
    def hash_block(self) -> int:
        return self.hash_block_size or self.block_size

    @property
    def drops_eagle_block(self) -> bool:
        """Whether vLLM builds its manager with ``use_eagle``: an EAGLE drafter without
        lookahead hashes (off, or nothing to hash without prefix caching)."""
        return (self.eagle or self.eagle_lookahead_hashes) and not self.hash_lookahead

    @property
    def hash_lookahead(self) -> int:
        """Tokens after each block its hash covers (vLLM's EAGLE default: one)."""
        return 1 if self.eagle_lookahead_hashes and self.enable_prefix_caching else 0


def _spec(kind: str, block_size: int, window: int) -> Any:
    common = {"block_size": block_size, "num_kv_heads": 4, "head_size": 16, "dtype": torch.float16}
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "mamba":
        # The state padded to the attention page, as vLLM unifies hybrid pages.
        page = FullAttentionSpec(**common).page_size_bytes
        return MambaSpec(
            block_size=block_size,
            shapes=((2,),),
            dtypes=(torch.float32,),
            page_size_padded=page,
            mamba_cache_mode="align",
        )
    assert kind == "sliding_window", kind
    return SlidingWindowSpec(**common, sliding_window=window)


def kv_cache_config(setup: SchedulerSetup) -> Any:
    return KVCacheConfig(
        num_blocks=setup.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [f"layers.{i}"], _spec(kind, size, window), is_eagle_group=i in setup.eagle_groups
            )
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
    if setup.mamba_align:
        # What vLLM's engine sets for a hybrid Mamba model with prefix caching: the
        # scheduler reads mamba_cache_mode to split prefills at cached states.
        cache_config.mamba_cache_mode = "align"
        cache_config.mamba_block_size = setup.block_size
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
    speculative_config = (
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=setup.num_speculative_tokens,
            prompt_lookup_min=1,
            prompt_lookup_max=3,
            **_legacy_eagle_hashes(setup),
        )
        if setup.num_speculative_tokens
        else None
    )
    config = VllmConfig(
        model_config=model,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        speculative_config=speculative_config,
        kv_transfer_config=_offloading(setup),
        # Events on (published nowhere), so the offload tier's can be compared.
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            if setup.offload_cpu_bytes
            else None
        ),
    )
    # Set after the config is built: vLLM turns it off where the platform (this CPU)
    # cannot overlap steps, but the scheduler itself runs anywhere.
    config.scheduler_config.async_scheduling = setup.async_scheduling
    return config


def _legacy_eagle_hashes(setup: SchedulerSetup) -> dict[str, bool]:
    """vLLM 0.33's option for EAGLE's trailing-block drop instead of lookahead block
    hashes (0.32 has only the drop)."""
    if "disable_lookahead_block_hashes" not in SpeculativeConfig.__dataclass_fields__:
        return {}
    return {"disable_lookahead_block_hashes": setup.eagle and not setup.eagle_lookahead_hashes}


def _offloading(setup: SchedulerSetup) -> Any:
    """vLLM's native ``OffloadingConnector`` for ``setup``, as ``--kv-offloading-size``
    configures it; None without offloading."""
    if not setup.offload_cpu_bytes:
        return None
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "cpu_bytes_to_use": setup.offload_cpu_bytes,
            "eviction_policy": setup.offload_eviction_policy,
            **dict(setup.offload_extra),
        },
        kv_load_failure_policy=setup.kv_load_failure_policy,
    )


@contextmanager
def eagle_drafting() -> Iterator[None]:
    """vLLM's scheduler as it runs an EAGLE drafter, without its draft model (which an
    EAGLE ``SpeculativeConfig`` needs to load): the n-gram drafter answers as EAGLE
    (``use_eagle`` and the trailing-block drop), so the scheduler reserves lookahead
    slots for the drafts and builds its manager with ``use_eagle``, and the drafts
    still come from the caller."""
    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(SpeculativeConfig, "use_eagle", lambda _: True))
        if hasattr(SpeculativeConfig, "needs_eagle_block_drop"):  # vLLM 0.33
            patches.enter_context(
                mock.patch.object(SpeculativeConfig, "needs_eagle_block_drop", lambda _: True)
            )
        yield


def build_scheduler(setup: SchedulerSetup, scheduler_cls: type | None = None) -> Any:
    """vLLM's scheduler for ``setup`` (``Scheduler``, or ``AsyncScheduler`` with async
    scheduling, as vLLM picks it), or ``scheduler_cls`` (``KVServiceScheduler``), stats
    on. As vLLM's engine does before building its scheduler, the hash chain's seed is set
    for the configured algorithm (sha256) first."""
    config = vllm_config(setup)
    init_none_hash(sha256)
    if scheduler_cls is None:
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
    with eagle_drafting() if setup.eagle or setup.eagle_lookahead_hashes else nullcontext():
        return scheduler_cls(
            vllm_config=config,
            kv_cache_config=kv_cache_config(setup),
            structured_output_manager=StructuredOutputManager(config),
            block_size=setup.block_size,
            hash_block_size=setup.hash_block,
            log_stats=True,
        )


def block_hasher(block_size: int, num_lookahead_tokens: int = 0) -> Callable[[Request], list[Any]]:
    """vLLM's request hasher, as its engine builds it (``num_lookahead_tokens``: its
    ``VllmConfig.num_hash_lookahead_tokens``)."""
    hasher: Callable[[Request], list[Any]]
    if num_lookahead_tokens:
        hasher = get_request_block_hasher(block_size, sha256, num_lookahead_tokens)
    else:  # vLLM 0.32's hasher takes no lookahead
        hasher = get_request_block_hasher(block_size, sha256)
    return hasher

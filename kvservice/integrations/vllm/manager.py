"""``KVServiceKVCacheManager``: vLLM 0.33's ``KVCacheManager``, answered by kvservice.

vLLM's scheduler builds its manager with keyword arguments (``Scheduler.__init__``);
this class takes exactly those. Where the answers come from is read from the
environment, so that ``vllm serve --scheduler-cls`` needs no code: with
``KVSERVICE_TARGET`` set, a kvservice server (``RemoteKVCacheManager``); unset, the core
in this process (``InProcessKVCacheManager``). Either way the scheduler gets vLLM's own
types back (``KVCacheBlocks``, ``PrefixCacheStats``, KV events) and the decisions
vLLM's built-in manager would make.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks
from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec
from vllm.v1.metrics.stats import PrefixCacheStats

from kvservice.integrations.vllm.settings import ConnectionSettings


@dataclass(frozen=True, slots=True)
class ManagerArgs:
    """The keyword arguments vLLM 0.33's ``Scheduler`` passes to ``KVCacheManager``."""

    kv_cache_config: Any
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    use_eagle: bool = False
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0
    log_stats: bool = False
    enable_kv_cache_events: bool = False
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    metrics_collector: Any = None
    watermark: float = 0.0
    enable_mamba_shared_prefix_checkpoint: bool = False

    def refuse_unsupported(self) -> None:
        """Refuse, at construction, the features kvservice does not implement, naming
        the vLLM option that turns each on."""
        unsupported = {
            "num_hash_lookahead_tokens (lookahead block hashes)": self.num_hash_lookahead_tokens,
            "num_prefill_lookahead (multi-module MTP drafting)": self.num_prefill_lookahead,
            "metrics_collector (--kv-cache-metrics)": self.metrics_collector is not None,
            "enable_mamba_shared_prefix_checkpoint": self.enable_mamba_shared_prefix_checkpoint,
        }
        named = [name for name, value in unsupported.items() if value]
        if named:
            raise NotImplementedError(
                f"kvservice's KV cache manager does not implement {', '.join(named)}; "
                "turn these off or use vLLM's built-in manager"
            )


class KVServiceKVCacheManager:
    """vLLM 0.33's ``KVCacheManager`` interface over kvservice.

    Constructed as vLLM's scheduler constructs its manager; ``KVSERVICE_TARGET`` picks
    the subclass (see the module docstring). The parts that do not depend on where
    blocks live are here: the prefix-cache stats vLLM's scheduler records at admission,
    the shared empty ``KVCacheBlocks``, and the refusals of paths kvservice does not
    serve.
    """

    block_pool: Any
    coordinator: Any

    def __new__(cls, **kwargs: Any) -> KVServiceKVCacheManager:
        if cls is not KVServiceKVCacheManager:
            return object.__new__(cls)
        # Each backend imports only what it needs: in-process serving loads no gRPC.
        if ConnectionSettings.from_env().target is None:
            from kvservice.integrations.vllm.inprocess import (  # noqa: PLC0415
                InProcessKVCacheManager,
            )

            return object.__new__(InProcessKVCacheManager)
        from kvservice.integrations.vllm.remote import RemoteKVCacheManager  # noqa: PLC0415

        return object.__new__(RemoteKVCacheManager)

    def __init__(self, **kwargs: Any) -> None:
        self.args = ManagerArgs(**kwargs)
        self.args.refuse_unsupported()
        config = self.args.kv_cache_config
        self.kv_cache_config = config
        self.max_model_len = self.args.max_model_len
        self.enable_caching = self.args.enable_caching
        self.log_stats = self.args.log_stats
        self.use_eagle = self.args.use_eagle
        self.mamba_shared_prefix_checkpoint = False
        self.num_kv_cache_groups = len(config.kv_cache_groups)
        self.prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if self.log_stats else None
        )
        self.empty_kv_cache_blocks = VllmKVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        # The groups estimate_cached_tokens reads: prefix-cacheable, neither cross
        # attention nor encoder-only.
        self._cached_token_groups = tuple(
            i
            for i, group in enumerate(config.kv_cache_groups)
            if group.kv_cache_spec.prefix_cacheable
            and not isinstance(group.kv_cache_spec, CrossAttentionSpec | EncoderOnlyAttentionSpec)
        )

    # -- prefix-cache stats: recorded by the scheduler at admission ------------------

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call; starts a fresh window."""
        if self.prefix_cache_stats is None:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def note_prefix_cache_reset(self) -> None:
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True

    # -- answers that need no blocks ----------------------------------------------------

    def cached_tokens_of(self, hash_lengths: Sequence[Sequence[int | None]]) -> int:
        """vLLM's ``estimate_cached_tokens`` from each group's blocks' hashed lengths:
        the shortest, over prefix-cacheable groups, of the longest cached prefix."""
        cached: int | None = None
        for group_id in self._cached_token_groups:
            longest = max((n or 0 for n in hash_lengths[group_id]), default=0)
            cached = longest if cached is None else min(cached, longest)
        return cached or 0

    def close(self) -> None:
        """Release what the manager holds outside this process (nothing in-process)."""

    def check_hashing(self, hash_algo: str, none_hash_seed: str | None) -> None:
        """Refuse a block store that hashes otherwise than vLLM (in-process, vLLM's own
        hashes are used: nothing to check)."""

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM calls this at the top of ``schedule()``)."""

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba "align" boundary states for a KV connector: none without one."""
        return {}

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33 (cascade attention was removed): zeros."""
        return [0] * self.num_kv_cache_groups

    # -- paths for KV connectors, which kvservice does not serve -------------------------

    @staticmethod
    def refuse_connector_only(call: str, value: object) -> None:
        if value:
            raise NotImplementedError(
                f"{call} is used by vLLM's KV connectors, which kvservice's manager does "
                "not support"
            )

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int, bool]:
        self.refuse_connector_only("get_computed_blocks_for_connector", True)
        raise AssertionError("unreachable")

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        self.refuse_connector_only("pop_blocks_for_free", True)
        raise AssertionError("unreachable")

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        self.refuse_connector_only("truncate_computed_blocks", True)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self.refuse_connector_only("record_blocks_for_zeroing", True)

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        self.refuse_connector_only("finalize_partial_tail_offloads", True)
        raise AssertionError("unreachable")

"""``KVServiceKVCacheManager``: vLLM's ``KVCacheManager``, answered by kvservice.

Written for vLLM 0.33, and run on 0.32 as well (``versions`` says what differs).

vLLM's scheduler builds its manager with keyword arguments (``Scheduler.__init__``);
this class takes exactly those, and answers with vLLM's own types (``KVCacheBlocks``,
``PrefixCacheStats``, KV events). The decisions come from kvservice's core in this
process. With ``KVSERVICE_TARGET`` set, that core is a replica and a kvservice server is
the authority: every decision is also sent to the server and confirmed there before
the scheduler's output is used (``server_link``, one round trip per step). The
connection is read from the environment so that ``vllm serve --scheduler-cls`` needs
no code.

vLLM's scheduler hands the manager its own ``Request`` objects. Each gets a core
``Request`` sharing its token list and its block hashes (vLLM computes them with the
engine's hash function as tokens arrive), so nothing is copied or hashed twice; the
status and ``num_computed_tokens``, which the scheduler sets on its side, are copied
over before each call that reads them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm import __version__ as vllm_version
from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import RequestStatus as VllmRequestStatus

from kvservice.core.allocation_options import allocation_options
from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.errors import KVCacheError
from kvservice.core.kv_cache_block import BlockIds, KVCacheBlock
from kvservice.core.kv_cache_groups import format_groups
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus
from kvservice.core.retention_policy import RetentionEvent
from kvservice.integrations.vllm.cache_config import core_cache_config
from kvservice.integrations.vllm.embeds import prompt_embeds_bytes
from kvservice.integrations.vllm.events import to_vllm_events
from kvservice.integrations.vllm.retention import (
    NO_RETENTION,
    PIN_TENANT,
    RequestRetention,
    RetentionSettings,
    request_retention,
)
from kvservice.integrations.vllm.settings import ConnectionSettings
from kvservice.integrations.vllm.versions import refuse_divergences
from kvservice.integrations.vllm.views import (
    BlockPoolView,
    CoordinatorView,
    SingleTypeManagerView,
)

if TYPE_CHECKING:
    from kvservice.integrations.vllm.server_link import PoolLayout, ServerLink

_NO_HIT: tuple[int, BlockIds] = (0, ())

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ManagerArgs:
    """The keyword arguments vLLM's ``Scheduler`` passes to ``KVCacheManager`` (0.32
    passes no ``num_hash_lookahead_tokens``: its default is 0.32's meaning)."""

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
            # An EAGLE drafter reads one token ahead (1): no token is re-prefilled, so
            # nothing changes; multi-module MTP reads further and re-prefills them.
            "num_prefill_lookahead (multi-module MTP drafting)": self.num_prefill_lookahead > 1,
            "metrics_collector (--kv-cache-metrics)": self.metrics_collector is not None,
            "enable_mamba_shared_prefix_checkpoint": self.enable_mamba_shared_prefix_checkpoint,
        }
        named = [name for name, value in unsupported.items() if value]
        if named:
            raise NotImplementedError(
                f"kvservice's KV cache manager does not implement {', '.join(named)}; "
                "turn these off or use vLLM's built-in manager"
            )


def _core_status(status: VllmRequestStatus) -> RequestStatus:
    if VllmRequestStatus.is_finished(status):
        return RequestStatus.FINISHED
    if status == VllmRequestStatus.RUNNING:
        return RequestStatus.RUNNING
    if status == VllmRequestStatus.PREEMPTED:
        return RequestStatus.PREEMPTED
    return RequestStatus.WAITING  # every waiting flavour: the watermark applies


_STATUS = {status: _core_status(status) for status in VllmRequestStatus}


def _ids(blocks: tuple[Sequence[KVCacheBlock], ...]) -> BlockIds:
    return tuple(tuple(block.block_id for block in group) for group in blocks)


class KVServiceKVCacheManager:
    """vLLM's ``KVCacheManager`` interface over kvservice (see the module
    docstring). ``server`` is the link to the confirming server, None in-process."""

    def __init__(self, **kwargs: Any) -> None:
        self.args = args = ManagerArgs(**kwargs)
        args.refuse_unsupported()
        config = args.kv_cache_config
        refuse_divergences(vllm_version, config, args.enable_caching, args.use_eagle)
        self.kv_cache_config = config
        self.max_model_len = args.max_model_len
        self.enable_caching = args.enable_caching
        self.log_stats = args.log_stats
        self.use_eagle = args.use_eagle
        self.mamba_shared_prefix_checkpoint = False
        self.num_kv_cache_groups = len(config.kv_cache_groups)
        self.prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if args.log_stats else None
        )
        self.empty_kv_cache_blocks = VllmKVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self._no_block_ids: BlockIds = tuple(() for _ in range(self.num_kv_cache_groups))
        settings = ConnectionSettings.from_env()
        retention = RetentionSettings.from_env()
        if settings.target is not None and retention.enabled:
            raise ValueError(
                "KVSERVICE_EVICTION_POLICY and KVSERVICE_MAX_PINNED_FRACTION set the "
                "in-process pool's retention; a remote pool's is the server's "
                "(kvservice serve --eviction-policy / --max-pinned-fraction)"
            )
        # The server first: its pool, when smaller than vLLM's, is the replica's too.
        link = None if settings.target is None else self._connect(settings)
        num_blocks = config.num_blocks if link is None else link.pool_size(config.num_blocks)
        # A replica keeps its server's retention policy and pinned budget.
        policy, max_pinned_blocks = retention.eviction_policy, None
        if link is not None:
            policy = link.server_config.eviction_policy
            max_pinned_blocks = link.server_config.max_pinned_blocks
        self.core = KVCacheManager(
            core_cache_config(config, num_blocks),
            max_model_len=args.max_model_len,
            scheduler_block_size=args.scheduler_block_size,
            hash_block_size=args.hash_block_size,
            enable_caching=args.enable_caching,
            # vLLM's scheduler records prefix-cache stats itself, at admission.
            log_stats=False,
            enable_kv_cache_events=args.enable_kv_cache_events,
            watermark=args.watermark,
            max_in_flight_tokens=args.max_in_flight_tokens,
            use_eagle=args.use_eagle,
            dcp_world_size=args.dcp_world_size,
            pcp_world_size=args.pcp_world_size,
            # vLLM hashes the requests; the core publishes the lookahead tokens.
            num_hash_lookahead_tokens=args.num_hash_lookahead_tokens,
            eviction_policy=policy,
            max_pinned_fraction=retention.max_pinned_fraction,
            max_pinned_blocks=max_pinned_blocks,
        )
        self.block_pool = BlockPoolView(
            self._free_retained_blocks,
            self.core.block_pool.get_num_free_blocks,
            self.core.block_pool.get_usage,
        )
        core_managers = self.core.coordinator.single_type_managers
        # Only a group whose blocks hold several hash blocks can be hit partway into a
        # block and queue a copy-on-write copy; an allocation reads only those.
        self._copying_managers = [
            manager for manager in core_managers if manager.block_size != self.core.hash_block_size
        ]
        self.coordinator = CoordinatorView(
            [
                SingleTypeManagerView(i, manager.block_size, group.kv_cache_spec)
                for i, (manager, group) in enumerate(
                    zip(core_managers, config.kv_cache_groups, strict=True)
                )
            ],
            self.core.coordinator,
            self.block_pool,
        )
        # estimate_cached_tokens reads the prefix-cacheable groups that are neither
        # cross attention nor encoder-only.
        self._cached_token_groups = tuple(
            i
            for i, group in enumerate(config.kv_cache_groups)
            if group.kv_cache_spec.prefix_cacheable
            and not isinstance(group.kv_cache_spec, CrossAttentionSpec | EncoderOnlyAttentionSpec)
        )
        # Whether remove_skipped_blocks can release anything (a window, chunked local
        # attention or a Mamba group).
        self._skipping_groups = any(
            not isinstance(group.kv_cache_spec, FullAttentionSpec)
            for group in config.kv_cache_groups
        )
        # vLLM request id -> the core's view of that request.
        self._requests: dict[str, Request] = {}
        self.server: ServerLink | None = None
        if link is not None:
            link.retention_sink = self._apply_server_retention
            link.start(self._layout(link))
            self.server = link

    @staticmethod
    def _connect(settings: ConnectionSettings) -> ServerLink:
        # In-process serving loads no gRPC: the link is imported only when needed.
        from kvservice.integrations.vllm.server_link import ServerLink  # noqa: PLC0415

        return ServerLink(settings)

    def _layout(self, link: ServerLink) -> PoolLayout:
        """The pool this engine needs the server to have, as vLLM computed it (the pool
        size the replica's, which ``pool_size`` may have lowered to the server's)."""
        from kvservice.integrations.vllm.server_link import PoolLayout  # noqa: PLC0415

        managers = self.core.coordinator.single_type_managers
        return PoolLayout(
            groups=[(m.kv_cache_spec.kind.value, m.block_size) for m in managers],
            kv_cache_groups=format_groups([m.kv_cache_spec for m in managers]),
            prefix_cache_retention_interval=(
                self.core.kv_cache_config.prefix_cache_retention_interval
            ),
            num_blocks=self.core.block_pool.num_gpu_blocks,
            watermark=self.args.watermark,
            watermark_blocks=self.core.watermark_blocks,
            enable_caching=self.enable_caching,
            max_model_len=self.max_model_len,
            hash_block_size=self.args.hash_block_size,
            # The window-bounded groups' admission gate: vLLM's max_in_flight_tokens.
            max_in_flight_tokens=self.core.max_in_flight_tokens,
            admission_caps=tuple(m.max_admission_blocks_per_request for m in managers),
            eagle_group_ids=self.core.coordinator.eagle_group_ids,
            num_hash_lookahead_tokens=self.core.num_hash_lookahead_tokens,
        )

    # -- requests ------------------------------------------------------------------

    def _sync(self, request: Any) -> Request:
        """The core request for vLLM's ``request``, with the scheduler's latest status
        and computed-token count."""
        mirror = self._requests.get(request.request_id)
        if mirror is None:
            # Hashes come from vLLM; the keys' inputs are for the KV events' extra_keys.
            lora = request.lora_request
            embeds, _ = prompt_embeds_bytes(request)
            wanted = self._retention_of(request)
            mirror = Request(
                request.request_id,
                request._all_token_ids,
                cache_salt=request.cache_salt,
                lora_name=lora.lora_name if lora else None,
                lora_path=lora.lora_path if lora else None,
                lora_int_id=lora.lora_int_id if lora else None,
                mm_features=[
                    MultiModalFeature(f.identifier, f.mm_position.offset, f.mm_position.length)
                    for f in request.mm_features or ()
                ],
                skip_reading_prefix_cache=request.skip_reading_prefix_cache,
                prompt_embeds=embeds,
                retention=wanted.config,
            )
            # Shared, not copied: vLLM appends to both as the request grows.
            mirror.all_token_ids = request._all_token_ids
            mirror.block_hashes = request.block_hashes
            self._requests[request.request_id] = mirror
            if self.server is not None:
                # The server pins, and ships the pin to this replica at its boundary.
                self.server.retain(request.request_id, wanted.config, wanted.pin_ttl_s)
            elif wanted.pin_ttl_s is not None:
                self._pin_prompt(mirror, wanted.pin_ttl_s)
        mirror.status = _STATUS[request.status]
        mirror.num_computed_tokens = request.num_computed_tokens
        mirror.num_in_flight_tokens = request.num_in_flight_tokens
        return mirror

    def _retention_of(self, request: Any) -> RequestRetention:
        """What ``request``'s ``extra_args`` ask for, as far as this pool can serve it;
        a request asking for more is served without it, and logged."""
        params = request.sampling_params
        try:
            wanted = request_retention(params.extra_args if params is not None else None)
        except KVCacheError as error:
            logger.warning("request %s: retention ignored: %s", request.request_id, error)
            return NO_RETENTION
        config, pin_ttl_s = wanted.config, wanted.pin_ttl_s
        if config is not None and not self.core.priorities_enabled:
            logger.warning(
                "request %s: retention priorities ignored: this pool evicts by LRU "
                "(set KVSERVICE_EVICTION_POLICY=priority, or the server's "
                "--eviction-policy priority)",
                request.request_id,
            )
            config = None
        retention = self.core.retention_policy
        if pin_ttl_s is not None and (retention is None or retention.max_pinned_blocks == 0):
            # A server would refuse the whole request, which the scheduler cannot take
            # back: the pin is dropped here, as in-process.
            logger.warning(
                "request %s: cache_control pin ignored: pinning is off in this pool "
                "(set KVSERVICE_MAX_PINNED_FRACTION, or the server's --max-pinned-fraction)",
                request.request_id,
            )
            pin_ttl_s = None
        return RequestRetention(config, pin_ttl_s)

    def _pin_prompt(self, request: Request, ttl_s: float) -> None:
        """Pin the whole blocks of ``request``'s prompt (Dynamo's ``cache_control``), by
        vLLM's own block hashes; they join the pin as this request caches them."""
        try:
            self.core.pin_request_prompt(PIN_TENANT, request, time.monotonic(), ttl_s=ttl_s)
        except KVCacheError as error:
            logger.warning("request %s: cache_control pin refused: %s", request.request_id, error)

    def _apply_server_retention(self, events: list[RetentionEvent]) -> None:
        """The server's retention decisions (time passing, pins and unpins of other
        callers), applied where the server applied them."""
        for event in events:
            self.core.apply_retention_event(event)

    def _blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> Any:
        return VllmKVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- the scheduler's calls ---------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.core.usage

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        server = self.server
        if server is not None:
            server.check_alive()
        blocks, num_tokens, boundary = self.core.get_computed_blocks(
            self._sync(request), max_cache_hit_length
        )
        if server is not None:
            server.looked_up(
                request, _ids(blocks.blocks), num_tokens, boundary, max_cache_hit_length
            )
        return self._blocks(blocks.blocks), num_tokens, boundary

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any | None:
        server = self.server
        if server is not None:
            server.check_alive()
        hits = (
            self.core.create_kv_cache_blocks(new_computed_blocks.blocks)
            if new_computed_blocks is not None
            else None
        )
        copying = server is not None and self._copying_managers
        if copying:
            # The copies this allocation queues are the ones the server answers it with.
            pending_before = self._num_pending_copies()
        options = allocation_options(
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        )
        mirror = self._sync(request)
        new_blocks = self.core.allocate_slots_with_options(
            mirror, num_new_tokens, num_new_computed_tokens, hits, options, skip_zeroing_group_ids
        )
        if server is not None:
            if new_blocks is None:
                answer = None
            elif new_blocks is self.core.empty_kv_cache_blocks:
                answer = self._no_block_ids  # most decode steps: one shared answer
            else:
                answer = _ids(new_blocks.blocks)
            copies = self._copies_since(pending_before) if copying else ()
            if hits is not None or not server.record_allocation(
                mirror, num_new_tokens, options, answer, copies
            ):
                hit = _NO_HIT if hits is None else (num_new_computed_tokens, _ids(hits.blocks))
                server.allocated(request, num_new_tokens, hit, options, answer, copies)
        return None if new_blocks is None else self._blocks(new_blocks.blocks)

    def _num_pending_copies(self) -> list[int]:
        """How many copy-on-write copies each group's manager has queued."""
        return [len(manager.pending_cow_copies) for manager in self._copying_managers]

    def _copies_since(self, before: list[int]) -> tuple[tuple[int, int], ...]:
        """The copies (src, dst) queued since ``_num_pending_copies`` answered ``before``."""
        if self._num_pending_copies() == before:
            return ()  # almost every allocation
        return tuple(
            (src.block_id, dst.block_id)
            for manager, num_before in zip(self._copying_managers, before, strict=True)
            for src, dst in manager.pending_cow_copies[num_before:]
        )

    def free(self, request: Any) -> None:
        if self.server is not None:
            self.server.check_alive()
        mirror = self._sync(request)
        self.core.free(mirror)
        if mirror.is_finished:
            del self._requests[request.request_id]
        if self.server is not None:
            self.server.freed(request)

    def get_blocks(self, request_id: str) -> Any:
        if request_id not in self._requests:
            return self.empty_kv_cache_blocks
        return self._blocks(self.core.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()  # type: ignore[no-any-return]

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Each attention group's blocks up to ``num_computed_tokens`` (cross attention,
        encoder-only and state groups whole), as vLLM hands them to a connector."""
        clipped = []
        for ids, manager in zip(
            self.get_block_ids(request_id), self.coordinator.single_type_managers, strict=True
        ):
            spec = manager.kv_cache_spec
            whole = not isinstance(spec, AttentionSpec) or isinstance(
                spec, CrossAttentionSpec | EncoderOnlyAttentionSpec
            )
            clipped.append(ids if whole else ids[: -(-num_computed_tokens // spec.block_size)])
        return tuple(clipped)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Release the blocks a window no longer reads (a connector path of vLLM's)."""
        mirror = self._requests.get(request_id)
        if mirror is None:
            return
        if self.server is not None:
            self.server.check_alive()
        self.core.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens)
        if self.server is not None and self._skipping_groups:
            # Full attention skips nothing: only a pool with windows sends the call.
            self.server.skipped(mirror, processed_computed_tokens)

    def estimate_cached_tokens(self, request: Any) -> int:
        """vLLM's estimate: the shortest, over prefix-cacheable groups, of the longest
        prefix a block of the request is cached for."""
        if request.request_id not in self._requests:
            return 0
        groups = self.core.coordinator.get_blocks(request.request_id)
        cached: int | None = None
        for group_id in self._cached_token_groups:
            longest = max((b.block_hash_num_tokens or 0 for b in groups[group_id]), default=0)
            cached = longest if cached is None else min(cached, longest)
        return cached or 0

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Hash the blocks the first ``num_computed_tokens`` tokens fill (vLLM's
        scheduler calls it after a step's outputs under async scheduling or with draft
        tokens); monotonic and idempotent."""
        if not self.enable_caching:
            return
        if self.server is not None:
            self.server.check_alive()
        self.core.coordinator.cache_blocks(self._sync(request), num_computed_tokens)
        if self.server is not None:
            self.server.cached(request, num_computed_tokens)

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM calls this at the top of ``schedule()``): no
        step is planned on a previous one the server has not confirmed."""
        if self.server is not None:
            self.server.confirm()
            # After the previous step's frees, before this step's lookups.
            self.server.step_started()
        if self.server is None and self.core.retention_policy is not None:
            # In-process the clock is this process's; a replica's is its server's.
            self.core.expire_retention(time.monotonic())
        self.core.new_step_starts()

    def take_events(self) -> list[Any]:
        return to_vllm_events(self.core.take_events())

    def take_new_block_ids(self) -> list[int]:
        return self.core.take_new_block_ids()

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        if self.server is not None:
            # The scheduler's last manager call before its SchedulerOutput leaves
            # schedule(): nothing of this step is used before the server confirmed it.
            self.server.flush()
        taken = self.core.take_kv_cache_block_copies()
        copies = [KVCacheBlockCopy(copy.src_block_id, copy.dst_block_id) for copy in taken.copies]
        return copies, taken.retained_blocks

    def _free_retained_blocks(self, blocks: list[KVCacheBlock]) -> None:
        # In the order vLLM's scheduler passes them (each copy's source, then its
        # destination), which decides what is evicted first; the server, which kept
        # its holds for this (keep_copy_holds), releases them at the same point.
        self.core.free_retained_blocks(blocks)
        if self.server is not None:
            self.server.released([block.block_id for block in blocks])

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba "align" boundary states for a KV connector: none without one."""
        return {}

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the cache entries of blocks whose KV failed to load (a connector's)."""
        if self.server is not None:
            self.server.check_alive()
        self.core.evict_blocks(block_ids)
        if self.server is not None and block_ids:
            self.server.evicted(block_ids)

    def reset_prefix_cache(self) -> bool:
        if self.server is not None:
            self.server.flush()
        if not self.core.reset_prefix_cache():
            return False
        if self.server is not None:
            self.server.reset_prefix_cache()
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33 (cascade attention was removed): zeros."""
        return [0] * self.num_kv_cache_groups

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

    # -- lifecycle ----------------------------------------------------------------------

    def check_hashing(self, hash_algo: str, none_hash_seed: str | None) -> None:
        """Refuse a server that hashes otherwise than vLLM (in-process, vLLM's own hashes
        are used: nothing to check)."""
        if self.server is not None:
            self.server.check_hashing(hash_algo, none_hash_seed)

    def close(self) -> None:
        """Send the server what is left and end the session (nothing in-process)."""
        if self.server is not None:
            self.server.close()

    # -- paths of vLLM's scheduler for KV connectors -----------------------------------

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int, bool]:
        """The local hit a connector starts from: ``get_computed_blocks``' (per-group
        diverging hits, for Mamba hybrids, are refused at start by ``connectors``)."""
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        """``blocks`` (a lookup's hit) cut at the block-aligned ``num_computed_tokens``;
        no reference changes. A Mamba group keeps what it has up to there."""
        truncated: list[list[Any]] = []
        for group_blocks, manager in zip(
            blocks.blocks, self.coordinator.single_type_managers, strict=True
        ):
            if num_computed_tokens % manager.block_size:
                raise ValueError(
                    f"truncate_computed_blocks: {num_computed_tokens} tokens is not a "
                    f"multiple of group {manager.kv_cache_group_id}'s block size "
                    f"{manager.block_size}"
                )
            num_blocks = num_computed_tokens // manager.block_size
            if not isinstance(manager.kv_cache_spec, MambaSpec) and num_blocks > len(group_blocks):
                raise ValueError(
                    f"truncate_computed_blocks: {num_computed_tokens} tokens is past the "
                    f"hit of group {manager.kv_cache_group_id} ({len(group_blocks)} blocks)"
                )
            truncated.append(list(group_blocks[:num_blocks]))
        return self._blocks(tuple(truncated))

    def pop_blocks_for_free(self, request: Any) -> list[KVCacheBlock]:
        """Forget ``request`` but keep its blocks until vLLM's scheduler hands them to
        ``block_pool.free_blocks`` (it defers the free while a step in flight may still
        write them)."""
        if self.server is not None:
            self.server.check_alive()
        mirror = self._sync(request)
        blocks = self.core.pop_blocks_for_free(mirror)
        if mirror.is_finished:
            del self._requests[request.request_id]
        if self.server is not None:
            self.server.freed(request, keep_blocks=True)
        return blocks

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """List the request's blocks from ``start_token`` for zeroing again (a failed
        load left them unwritten)."""
        self.core.record_blocks_for_zeroing(request_id, start_token)

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """Mamba "align" partial tails a producer connector offloads: none (a Mamba
        "align" model with a producer connector is refused at start)."""
        return []

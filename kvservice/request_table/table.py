"""``RequestTable``: the requests of one pool and the calls on them.

It does what vLLM's scheduler does around its ``KVCacheManager`` (the requests by
tenant and id, ``num_computed_tokens``, request status, the prefix hit carried from
lookup to allocation) and checks every argument before anything changes, so a refused
call leaves no trace. Each call names its tenant (the default tenant unless told);
the server names the one it authenticated.

It is not thread safe on purpose: one asyncio loop owns it, and no method awaits, so
each call runs to completion before the next starts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Protocol, TypeVar

from kvservice.core.allocation_options import AllocationOptions
from kvservice.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    OutOfRangeError,
    QuotaExceededError,
    RequestNotFoundError,
)
from kvservice.core.invariants import InvariantViolationError, check_invariants
from kvservice.core.kv_cache_block import BlockHash, BlockHashWithGroupId, BlockIds
from kvservice.core.kv_cache_manager import AllocationProbe, KVCacheBlocks, KVCacheManager
from kvservice.core.request import Request, RequestStatus, computed_after_allocation
from kvservice.core.retention_policy import (
    Pin,
    PinPlaced,
    PinRemoved,
    RetentionEvent,
    RetentionPolicy,
    Tick,
)
from kvservice.request_table.client_hashes import ClientHashes
from kvservice.request_table.errors import (
    AlreadyExistsError,
    LimitExceededError,
    PinNotFoundError,
    StaleHitError,
)
from kvservice.request_table.limits import LimitError, RequestLimits, mm_identifier_bytes
from kvservice.request_table.reporting import (
    AllocationResult,
    EventSink,
    Reporter,
    TableObserver,
)
from kvservice.request_table.retention_sequence import RetentionSequence
from kvservice.request_table.runtime_sync import HoldOwner, KVRuntime, RuntimeSync
from kvservice.request_table.tenancy import (
    DEFAULT_TENANT,
    RequestLedger,
    TenantLedger,
    check_tenant_blocks,
    core_request_id,
    pin_owner,
    tenant_cache_salt,
    tenant_of_pin_owner,
)
from kvservice.request_table.types import (
    AllocateArgs,
    Allocation,
    BlockIdsPerGroup,
    ComputedBlocks,
    FreeMode,
    NewRequest,
    PinArgs,
    PinnedBudget,
    PinView,
    PoolUsage,
)

# Told (tenant, reason) of every call refused for a limit: "quota" (max_blocks), or
# the name of the ``RequestLimits`` setting.
RefusalSink = Callable[[str, str], None]


_T = TypeVar("_T")


class RequestOwnership(Protocol):
    """Learns which requests come and go (the server's sessions: a session owns what
    is added under it); called right after the change, on the table's loop."""

    def adopt(self, tenant: str, request_id: str, session_id: str) -> None:
        """``request_id`` of ``tenant`` was just added under ``session_id``."""
        ...

    def release(self, tenant: str, request_id: str) -> None:
        """``request_id`` of ``tenant`` was just finished (forgotten)."""
        ...


class _PrefixHit:
    """A lookup's hit, kept until AllocateSlots attaches it. The lookup took no
    references, so a free hit block may be evicted meanwhile; the cache keys seen at
    lookup time tell whether each block still holds that content.

    A plain class, as ``AllocateArgs`` is: one is built per lookup, and a dataclass's
    ``__init__`` would run interpreted."""

    __slots__ = ("block_ids", "blocks", "keys")

    def __init__(self, blocks: KVCacheBlocks) -> None:
        groups = blocks.blocks
        self.blocks = blocks
        self.block_ids: BlockIds = tuple([tuple([b.block_id for b in group]) for group in groups])
        self.keys: tuple[tuple[BlockHashWithGroupId | None, ...], ...] = tuple(
            [tuple([b.block_hash for b in group]) for group in groups]
        )

    def first_evicted_block(self) -> int | None:
        # Indexes, not zip(strict=True), which compiles to a generic call: the keys
        # were read off these very blocks, so the lengths match.
        for index, group in enumerate(self.blocks.blocks):
            keys = self.keys[index]
            for row, block in enumerate(group):
                if block.block_hash != keys[row]:
                    return block.block_id
        return None


class RequestTable:
    """The requests around one ``KVCacheManager``; one method per RPC.

    Optional collaborators: ``observer`` (the metrics) and ``events`` (the KV event
    log) hear of every change (``reporting``); ``runtime`` (the co-located KV
    tensors) zeroes fresh blocks and applies copies (``runtime_sync``); ``quotas``
    bound the blocks each tenant holds (``tenancy``), ``limits`` the sizes of a new
    request's fields and the requests and waiting tokens each tenant holds
    (``limits``), and ``on_refusal`` hears of each call refused for one of them; token
    ids must be below ``vocab_size`` (0: no bound).

    Retention (pins and priorities, when the manager has them): the table owns the
    clock the core never reads. Each call that may allocate or pin first lets time
    pass to ``clock()`` (``expire_retention``); without retention nothing is read.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        observer: TableObserver | None = None,
        runtime: KVRuntime | None = None,
        events: EventSink | None = None,
        quotas: Mapping[str, int] | None = None,
        on_refusal: RefusalSink | None = None,
        vocab_size: int = 0,
        limits: RequestLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        trusted_hash_tenants: Collection[str] = (),
    ) -> None:
        if vocab_size < 0:
            raise InvalidArgumentError(f"vocab_size must be >= 0 (0: no bound), got {vocab_size}")
        self.manager = manager
        self.vocab_size = vocab_size
        # By core key (``tenancy.core_request_id``): the request and its pending hit.
        self._requests: dict[str, Request] = {}
        self._hits: dict[str, _PrefixHit] = {}
        # Who owns each request (set by the server's sessions).
        self.ownership: RequestOwnership | None = None
        self.tenants = TenantLedger(quotas)
        # The tenants whose requests may come with the client's block hashes.
        self.client_hashes = ClientHashes(manager.block_hasher, trusted_hash_tenants)
        self.limits = limits or RequestLimits()
        self.requests_per_tenant = RequestLedger(
            self.limits.max_requests_per_tenant,
            self.limits.max_waiting_tokens_per_tenant,
            self.limits.max_prompt_embeds_bytes_per_tenant,
            self.limits.max_mm_items_per_tenant,
            self.limits.max_mm_identifier_bytes_per_tenant,
        )
        self._on_refusal = on_refusal
        self._runtime_sync = RuntimeSync(manager, runtime, self.tenants)
        self._reporter = Reporter(manager, observer, events, self.usage)
        self._no_new_blocks = manager.empty_kv_cache_blocks
        self._no_new_block_ids = self._no_new_blocks.get_block_ids()
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        # The same per tenant: tenant -> [queries, hits].
        self._prefix_cache_by_tenant: dict[str, list[int]] = {}
        # Inside ``batched()``: the runtime's zeroing and copies wait for the batch to
        # end, and so do the reporter's observations of the pool.
        self._batch_depth = 0
        # Pins and priorities (None: vLLM's LRU, and no clock is read).
        self._retention: RetentionPolicy | None = manager.retention_policy
        self._clock = clock
        # The time of the last ``_tick`` (what pins' TTLs are reported against).
        self._now = 0.0
        # While a replica session drives the pool, retention changes wait for its step
        # boundaries (``retention_sequence``).
        self.retention_sequence = RetentionSequence()
        # The retention clock reads ``clock() - _clock_origin``: a replica session
        # starts it from 0, as its fresh replica's pool starts.
        self._clock_origin = 0.0
        # A replica's table (``follow_server``): its server's events move its time.
        self._follows_server = False
        self._after_change()

    # -- requests -------------------------------------------------------------------

    def add_request(self, new: NewRequest, tenant: str, session_id: str | None = None) -> Request:
        """Register a WAITING request of ``tenant``, owned by ``session_id`` when one
        is given; ALREADY_EXISTS for an id the tenant already uses (another tenant's
        ids are no concern of it)."""
        rid = new.request_id
        with self._reporting_limits(tenant):
            self.limits.check_fields(
                rid, new.cache_salt, new.lora_name, new.mm_features, new.lora_path
            )
        key = core_request_id(tenant, rid)
        if key in self._requests:
            raise AlreadyExistsError(
                f"request {rid!r} already exists; finish it (FreeRequest FINISH) before "
                f"reusing its id"
            )
        self._check_new_tokens(
            rid, new.prompt_token_ids, 0, new.prompt_field, nonnegative=new.packed
        )
        for f in new.mm_features:
            if not f.identifier:
                raise InvalidArgumentError(
                    f"request {rid!r}: multimodal item at offset {f.offset} has no identifier"
                )
        _check_lora(new)
        _check_prompt_embeds(new)
        self._check_retention(new)
        claimed = self._claimed_prompt_keys(new, tenant)
        embeds_bytes = len(new.prompt_embeds) if new.prompt_embeds is not None else 0
        mm_items = len(new.mm_features)
        mm_bytes = mm_identifier_bytes(new.mm_features)
        with self._reporting_limits(tenant):
            self.requests_per_tenant.check_add(
                tenant, rid, len(new.prompt_token_ids), embeds_bytes, mm_items, mm_bytes
            )
        salt = tenant_cache_salt(tenant, new.cache_salt)
        request = Request(
            key,
            new.prompt_token_ids,
            self.manager.block_hasher,
            cache_salt=salt,
            lora_name=new.lora_name,
            mm_features=new.mm_features,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            lora_path=new.lora_path,
            lora_int_id=new.lora_int_id,
            prompt_embeds=new.prompt_embeds,
            retention=new.retention,
            client_hashed=claimed is not None,
        )
        if claimed is not None:
            request.block_hashes.extend(claimed)
        if new.cache_control_ttl_s is not None:
            # The last thing that may refuse the call: a refused pin adds no request,
            # and nothing after it refuses (so a pin never outlives a refused add).
            self._pin_prompt(request, new.cache_control_ttl_s, tenant)
        self._requests[key] = request
        self.requests_per_tenant.added(tenant, request.num_tokens, embeds_bytes, mm_items, mm_bytes)
        if session_id is not None and self.ownership is not None:
            self.ownership.adopt(tenant, rid, session_id)
        return request

    def _claimed_prompt_keys(self, new: NewRequest, tenant: str) -> list[BlockHash] | None:
        """The cache keys of a ``client_hashed`` request's claimed prompt hashes (None:
        the server hashes it); refused before anything changes (``client_hashes``)."""
        rid = new.request_id
        if not new.client_hashed:
            if new.block_hashes:
                raise InvalidArgumentError(
                    f"request {rid!r} carries block_hashes but is not client_hashed; set "
                    "client_hashed to have the server take them, or leave them out"
                )
            return None
        self.client_hashes.check_trusted(f"request {rid!r} is client_hashed", tenant)
        return self.client_hashes.keys(rid, tenant, new.block_hashes, 0, len(new.prompt_token_ids))

    def _pin_prompt(self, request: Request, ttl_s: float, tenant: str) -> None:
        """AddRequest's ``cache_control_ttl``: pin the prompt's whole blocks, by the
        request's own hashes (under a replica session, at its next boundaries)."""
        owner = pin_owner(tenant)
        if self.retention_sequence.driver is not None:
            pin_id, num_tokens, keys = self.manager.prepare_pin(owner, request)
            try:
                self._check_pin_budget(len(keys), owner, pin_id)
            except QuotaExceededError:
                # A replica's scheduler cannot take a refused request back: the request
                # is added without its pin (counted in kvservice_pins_refused_total).
                return
            placed = PinPlaced(self._time(), owner, pin_id, num_tokens, keys, ttl_s, False)
            self.retention_sequence.queue(placed)
            return
        self._tick()
        self._charged_pin(
            tenant,
            lambda owner: self.manager.pin_request_prompt(owner, request, self._now, ttl_s=ttl_s),
        )
        self._reporter.changed()

    def _check_retention(self, new: NewRequest) -> None:
        """Refuse retention this pool cannot honour, and a cache_control_ttl pin of a
        prompt whose blocks a pin cannot name (checked before anything changes)."""
        rid = new.request_id
        if new.retention is not None and not self.manager.priorities_enabled:
            policy = self._retention.policy if self._retention is not None else "lru"
            raise FailedPreconditionError(
                f"request {rid!r} carries retention priorities, but this pool evicts by "
                f"{policy} only; start the server with --eviction-policy priority to "
                f"honour them (or send the request without retention)"
            )
        ttl = new.cache_control_ttl_s
        if ttl is None:
            return
        if not ttl > 0:
            raise InvalidArgumentError(
                f"request {rid!r}: cache_control_ttl must be a positive duration, got {ttl}s"
            )

    def check_request_size(self, request_id: str, num_mm_items: int, tenant: str) -> None:
        """The checks of ``add_request`` that need only the id and the number of
        multimodal items, for a caller to run before it builds the request's values
        (reading a message's items costs far more than counting them)."""
        with self._reporting_limits(tenant):
            self.limits.check_request_id(request_id)
            self.limits.check_mm_item_count(request_id, num_mm_items)
            self.requests_per_tenant.check_mm_items(tenant, request_id, num_mm_items)

    def append_tokens(
        self,
        request_id: str,
        token_ids: Sequence[int],
        tenant: str,
        block_hashes: Sequence[bytes] = (),
    ) -> Request:
        """Append sampled tokens, hashing the blocks they complete; for a
        ``client_hashed`` request, entering ``block_hashes`` (the client's hashes of
        blocks the tokens complete) instead."""
        request = self._get(request_id, tenant)
        self._check_new_tokens(request_id, token_ids, request.num_tokens, "token_ids")
        claimed = self._claimed_appended_keys(request, token_ids, tenant, block_hashes)
        if request.status is RequestStatus.RUNNING:
            request.append_output_token_ids(token_ids)
            if claimed:
                request.block_hashes.extend(claimed)
            return request
        # Tokens of a request that is not running count against the waiting limit.
        with self._reporting_limits(tenant):
            self.requests_per_tenant.check_waiting(tenant, request_id, len(token_ids))
        request.append_output_token_ids(token_ids)
        if claimed:
            request.block_hashes.extend(claimed)
        self.requests_per_tenant.waiting_changed(tenant, len(token_ids))
        return request

    def _claimed_appended_keys(
        self, request: Request, token_ids: Sequence[int], tenant: str, hashes: Sequence[bytes]
    ) -> list[BlockHash]:
        """The cache keys of the hashes sent with an append (none for a request the
        server hashes, which must come without any)."""
        rid = request.request_id
        if not request.client_hashed:
            if hashes:
                raise InvalidArgumentError(
                    f"request {rid!r} is hashed by the server (it came without "
                    "client_hashed); send its appends without block_hashes"
                )
            return []
        if not hashes:
            return []
        return self.client_hashes.keys(
            rid,
            tenant,
            hashes,
            len(request.block_hashes),
            request.num_tokens + len(token_ids),
        )

    def _reporting_limits(self, tenant: str) -> _ReportingLimits:
        """A block that tells the refusal sink of a limit the block refuses the call
        for."""
        return _ReportingLimits(self._on_refusal, tenant)

    def _check_new_tokens(
        self,
        rid: str,
        token_ids: Sequence[int],
        num_existing: int,
        name: str,
        *,
        nonnegative: bool = False,
    ) -> None:
        """Refuse ids out of range and a request grown past max_model_len;
        ``nonnegative``: the ids are known to be >= 0 (they came packed unsigned)."""
        if not token_ids:
            raise InvalidArgumentError(f"request {rid!r}: {name} must hold at least one token")
        # The generator that names the first bad index runs only when there is one.
        if not nonnegative and _lowest(token_ids) < 0:
            negative = next(i for i, t in enumerate(token_ids) if t < 0)
            raise InvalidArgumentError(
                f"request {rid!r}: {name}[{negative}] = {token_ids[negative]}; token ids "
                f"must be >= 0"
            )
        vocab_size = self.vocab_size
        if vocab_size and _highest(token_ids) >= vocab_size:
            outside = next(i for i, t in enumerate(token_ids) if t >= vocab_size)
            raise InvalidArgumentError(
                f"request {rid!r}: {name}[{outside}] = {token_ids[outside]} is outside the "
                f"vocabulary; token ids must be < vocab_size {vocab_size}"
            )
        total = num_existing + len(token_ids)
        max_len = self.manager.max_model_len
        if total > max_len:
            raise OutOfRangeError(
                f"request {rid!r}: {num_existing} + {len(token_ids)} tokens = {total} exceeds "
                f"max_model_len {max_len}"
            )

    def _get(self, request_id: str, tenant: str) -> Request:
        # Another tenant's request answers exactly as an unknown id: no existence leak.
        request = self._requests.get(core_request_id(tenant, request_id))
        if request is None:
            raise RequestNotFoundError(
                f"request {request_id!r} is not known (never added, or finished); "
                f"call AddRequest first"
            )
        return request

    # -- lookup and allocation ------------------------------------------------------

    def get_computed_blocks(
        self, request_id: str, tenant: str, max_cache_hit_length: int | None = None
    ) -> ComputedBlocks:
        """The cached prefix of a waiting or preempted request (at most
        ``max_cache_hit_length`` tokens, vLLM's cap), remembered for the next
        ``allocate_slots``. Side effect: records prefix cache stats."""
        self._tick()
        if max_cache_hit_length is not None and max_cache_hit_length < 0:
            raise InvalidArgumentError(
                f"max_cache_hit_length must be >= 0, got {max_cache_hit_length}"
            )
        request = self._get(request_id, tenant)
        if request.status == RequestStatus.RUNNING:
            raise FailedPreconditionError(
                f"request {request_id!r} is running; prefix lookups are for waiting or "
                f"preempted requests (free it with PREEMPT to re-admit it)"
            )
        blocks, num_hit, boundary = self.manager.get_computed_blocks(request, max_cache_hit_length)
        hit = self._hits[request.request_id] = _PrefixHit(blocks)
        self._after_change(tenant)
        return ComputedBlocks(hit.block_ids, num_hit, boundary)

    def allocate_slots(self, request_id: str, args: AllocateArgs, tenant: str) -> Allocation:
        """``allocate_slots`` for a known request; counts the outcome either way.
        RESOURCE_EXHAUSTED (nothing changed) when it would take ``tenant`` past its
        block quota."""
        self._tick()
        try:
            allocation = self._allocate(request_id, args, tenant)
        except KVCacheError:
            self._reporter.allocated(AllocationResult.INVALID)
            # A refusal changes nothing, but hand on anything the core queued anyway
            # rather than let it surface later under another call.
            self._reporter.publish_events()
            raise
        ok = allocation.new_block_ids is not None
        self._reporter.allocated(AllocationResult.OK if ok else AllocationResult.NO_SPACE)
        # Even NO_SPACE may have released blocks that slid out of a sliding window.
        self._reporter.changed()
        return allocation

    def _allocate(self, request_id: str, args: AllocateArgs, tenant: str) -> Allocation:
        request = self._get(request_id, tenant)
        key = request.request_id
        hit = None
        if args.num_computed_tokens is not None:
            self._check_num_computed_tokens(request_id, args.num_computed_tokens)
        if args.num_in_flight_tokens < 0:
            raise InvalidArgumentError(
                f"request {request_id!r}: num_in_flight_tokens must be >= 0, got "
                f"{args.num_in_flight_tokens}"
            )
        if args.new_computed_block_ids:
            hit = self._hit_to_attach(request_id, key, args.new_computed_block_ids)
        previous = request.num_computed_tokens
        if args.num_computed_tokens is not None:
            request.num_computed_tokens = args.num_computed_tokens
        # A tenant the ledger counts has its quota checked first and is charged the
        # blocks the call took: tenants never share a block, so the pool's loss is
        # exactly the tenant's gain (negative when blocks slid out of a window).
        counted = self.tenants.counts(tenant)
        pool = self.manager.block_pool
        free_before = pool.get_num_free_blocks() if counted else 0
        request.num_in_flight_tokens = args.num_in_flight_tokens
        try:
            if counted and self.tenants.has_quota(tenant):
                self._check_quota(request, request_id, tenant, args, hit)
            new_blocks = self.manager.allocate_slots_with_options(
                request, args.num_new_tokens, args.num_new_computed_tokens, hit, args.options
            )
        except Exception:
            request.num_computed_tokens = previous
            raise
        finally:
            request.num_in_flight_tokens = 0
            if counted:
                self.tenants.charge(tenant, free_before - pool.get_num_free_blocks())
        if new_blocks is None:
            # No room changes nothing, the value set for this call included.
            request.num_computed_tokens = previous
            return Allocation(request, None)
        self._hits.pop(key, None)
        # vLLM's scheduler advances the count right after scheduling; the next call
        # sends num_computed_tokens only to correct it (rejected draft tokens).
        request.num_computed_tokens = computed_after_allocation(
            request.num_computed_tokens,
            args.num_new_computed_tokens,
            args.options.num_external_computed_tokens,
            args.num_new_tokens,
        )
        if request.status is not RequestStatus.RUNNING:
            self.requests_per_tenant.waiting_changed(tenant, -request.num_tokens)
            request.status = RequestStatus.RUNNING
        return self._runtime_sync.allocation(
            request, self._block_ids(new_blocks), tenant, self._batch_depth > 0
        )

    def _block_ids(self, blocks: KVCacheBlocks) -> BlockIdsPerGroup:
        """An allocation's new block ids. Most decode allocations take no block: the
        core answers its one shared empty ``KVCacheBlocks`` for them, and the table
        one shared (never mutated) answer of its ids rather than list none anew
        (bench_decode_layers table layer: 5% faster with this; 3 runs, spread 2-4%)."""
        if blocks is self._no_new_blocks:
            return self._no_new_block_ids
        return blocks.get_block_ids()

    def _check_quota(
        self,
        request: Request,
        request_id: str,
        tenant: str,
        args: AllocateArgs,
        hit: KVCacheBlocks | None,
    ) -> None:
        """Refuse an allocation that would take ``tenant`` past its quota, counted
        with the core's own predictor: the blocks it would take from the free queue,
        less those sliding out of view. The core's argument checks run first, so a
        malformed call still answers its own status."""
        needed = self.manager.num_blocks_needed(
            request, args.num_new_tokens, args.num_new_computed_tokens, hit, args.options
        )
        try:
            self.tenants.check(tenant, request_id, needed)
        except QuotaExceededError:
            if self._on_refusal is not None:
                self._on_refusal(tenant, "quota")
            raise

    def _check_num_computed_tokens(self, rid: str, value: int) -> None:
        if value < 0:
            raise InvalidArgumentError(
                f"request {rid!r}: num_computed_tokens must be >= 0, got {value}"
            )
        if value > self.manager.max_model_len:
            raise OutOfRangeError(
                f"request {rid!r}: num_computed_tokens {value} exceeds max_model_len "
                f"{self.manager.max_model_len}"
            )

    def _hit_to_attach(self, rid: str, key: str, block_ids: BlockIds) -> KVCacheBlocks | None:
        """The remembered hit the client named (``rid``, stored under ``key``),
        checked against what it was told and against eviction since; None when the
        client attaches nothing."""
        if not any(block_ids):
            return None
        hit = self._hits.get(key)
        if hit is None:
            raise FailedPreconditionError(
                f"request {rid!r}: new_computed_block_ids given but no prefix hit is "
                f"pending; call GetComputedBlocks first"
            )
        if block_ids != hit.block_ids:
            raise FailedPreconditionError(
                f"request {rid!r}: new_computed_block_ids {[list(g) for g in block_ids]} do "
                f"not match the last GetComputedBlocks answer {[list(g) for g in hit.block_ids]}"
            )
        evicted = hit.first_evicted_block()
        if evicted is not None:
            raise StaleHitError(
                f"request {rid!r}: block {evicted} of the prefix hit was evicted or reset "
                f"since GetComputedBlocks; look the prefix up again"
            )
        return hit.blocks

    def probe(
        self,
        request_id: str,
        num_new_tokens: int | None,
        options: AllocationOptions,
        tenant: str,
    ) -> AllocationProbe:
        """What a lookup plus ``allocate_slots`` would do now; changes nothing (no
        references, LRU order and prefix cache stats untouched). ``num_new_tokens=None``
        probes every token not yet computed nor hit. ``would_fit`` is also false when
        the allocation would take the tenant past its block quota."""
        request = self._get(request_id, tenant)
        probe = self.manager.probe(request, num_new_tokens, options)
        if not probe.would_fit or not self.tenants.has_quota(tenant):
            return probe
        # The probe counts blocks sliding out of view as free; they are the tenant's.
        freed = probe.num_free_blocks - self.manager.block_pool.get_num_free_blocks()
        if self.tenants.fits(tenant, probe.num_blocks_to_allocate - freed):
            return probe
        return dataclasses.replace(probe, would_fit=False)

    # -- steps and copy holds ---------------------------------------------------------

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM's ``KVCacheManager.new_step_starts``): a Mamba
        state cached from now on is refused as a prefix hit until the next one. The
        boundary is the pool's, whichever tenant announces it."""
        self._tick()
        self.manager.new_step_starts()

    def free_retained_blocks(
        self, block_ids: Sequence[int], tenant: str, session_id: str | None
    ) -> int:
        """Release copy holds a step kept for ``session_id`` (``batched(keep_copy_holds=
        ...)``), one per id, in the order given; the pool's free blocks after.
        FAILED_PRECONDITION (nothing released) for a block the session does not hold
        that many times."""
        if session_id is None:
            raise FailedPreconditionError(
                "free_retained_blocks releases holds a session's steps kept "
                "(keep_copy_holds); this call carries no session"
            )
        self._runtime_sync.release_kept((tenant, session_id), block_ids)
        self._reporter.changed()
        return self.manager.block_pool.get_num_free_blocks()

    def evict_blocks(self, block_ids: Sequence[int], tenant: str, session_id: str | None) -> None:
        """vLLM's ``evict_blocks``: drop the prefix-cache entries of blocks whose KV
        failed to load. Refused for a block that neither a
        request of ``tenant`` nor the session's kept holds hold (FAILED_PRECONDITION,
        nothing evicted): no tenant drops another's cache."""
        held = self._blocks_of(tenant, session_id)
        for index, block_id in enumerate(block_ids):
            if block_id not in held:
                raise FailedPreconditionError(
                    f"block_ids[{index}] = {block_id}: no request of this tenant holds "
                    f"block {block_id}; evict_blocks drops only the caller's own blocks"
                )
        self.manager.evict_blocks(block_ids)
        self._reporter.changed()

    def _blocks_of(self, tenant: str, session_id: str | None) -> set[int]:
        """The blocks ``tenant``'s requests and ``session_id``'s kept holds hold."""
        held: set[int] = set()
        coordinator = self.manager.coordinator
        for key in self._requests:
            if getattr(key, "tenant", DEFAULT_TENANT) != tenant:
                continue
            for group in coordinator.get_blocks(key):
                held.update(b.block_id for b in group if not b.is_null)
        if session_id is not None:
            held.update(self._runtime_sync.kept_by((tenant, session_id)))
        return held

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, tenant: str
    ) -> int:
        """vLLM's ``remove_skipped_blocks``: release the blocks a window no longer
        reads below ``processed_computed_tokens``; the pool's free blocks after.
        OUT_OF_RANGE, nothing released, past the request's computed tokens."""
        request = self._get(request_id, tenant)
        if not 0 <= processed_computed_tokens <= request.num_computed_tokens:
            raise OutOfRangeError(
                f"request {request_id!r}: remove_skipped_blocks({processed_computed_tokens}) "
                f"must lie within the request's {request.num_computed_tokens} computed tokens"
            )
        pool = self.manager.block_pool
        free_before = pool.get_num_free_blocks()
        self.manager.coordinator.remove_skipped_blocks(
            request.request_id, processed_computed_tokens
        )
        if self.tenants.counts(tenant):
            self.tenants.charge(tenant, free_before - pool.get_num_free_blocks())
        self._reporter.changed()
        return pool.get_num_free_blocks()

    def cache_blocks(self, request_id: str, num_computed_tokens: int, tenant: str) -> None:
        """vLLM's ``cache_blocks``: hash into the prefix cache the request's blocks its
        first ``num_computed_tokens`` tokens fill (after a step's outputs came back under
        async scheduling or with draft tokens). Monotonic and idempotent. OUT_OF_RANGE,
        changing nothing, past the request's known tokens or its allocated slots."""
        request = self._get(request_id, tenant)
        limit = min(request.num_tokens, request.num_computed_tokens)
        if not 0 <= num_computed_tokens <= limit:
            raise OutOfRangeError(
                f"request {request_id!r}: cache_blocks({num_computed_tokens}) must lie "
                f"within the request's {request.num_tokens} known tokens and its "
                f"{request.num_computed_tokens} computed ones"
            )
        if self.manager.enable_caching:
            self.manager.coordinator.cache_blocks(request, num_computed_tokens)
            self._reporter.changed()

    def release_copy_holds(self, tenant: str, session_id: str) -> int:
        """Release every copy hold ``session_id`` kept (the session ended); how many."""
        released = self._runtime_sync.release_all_kept((tenant, session_id))
        if released:
            self._reporter.changed()
        return released

    def copy_hold_owners(self) -> dict[HoldOwner, int]:
        """The copy holds kept (``batched(keep_copy_holds=...)``) per (tenant, session
        id) keeping them: for the server's audit, which checks each session is live."""
        return self._runtime_sync.kept_per_owner()

    # -- retention: pins and the clock ----------------------------------------------

    def _tick(self) -> None:
        """Let time pass to ``clock()`` for the pool's pins and priorities: expired
        pins let go (their blocks' tenants are charged the blocks that went free),
        expired priorities revert. Nothing (no clock read) without retention."""
        if (
            self._retention is None
            or self.retention_sequence.driver is not None
            or self._follows_server
        ):
            return  # no retention, or time passes at the replica's step boundaries
        self._advance(self._time())

    def _time(self) -> float:
        return self._clock() - self._clock_origin

    def _advance(self, now: float) -> None:
        """Time passes to ``now`` (``_tick``'s work, at a time given)."""
        retention = self._retention
        assert retention is not None
        self._now = now
        deadline = retention.next_deadline()
        if deadline is None or deadline > now:
            self.manager.expire_retention(now)  # records the time; nothing expires
            return
        freed = self._blocks_freed_by_expiry(retention, now)
        self.manager.expire_retention(now)
        for tenant, num_blocks in freed.items():
            self.tenants.charge(tenant, -num_blocks)
        self._reporter.changed()

    def _blocks_freed_by_expiry(self, retention: RetentionPolicy, now: float) -> dict[str, int]:
        """Per counted tenant, the blocks the pins expiring by ``now`` hold alone (one
        reference per pin and key; tenants share no block, so every other reference on
        such a block is the same tenant's)."""
        holds: dict[int, int] = {}
        owners: dict[int, str] = {}
        for pin in list(retention.pins.values()):
            if pin.expires_at is None or pin.expires_at > now:
                continue
            tenant = tenant_of_pin_owner(pin.tenant)
            if not self.tenants.counts(tenant):
                continue
            for block in pin.held.values():
                holds[block.block_id] = holds.get(block.block_id, 0) + 1
                owners[block.block_id] = tenant
        freed: dict[str, int] = {}
        blocks = self.manager.block_pool.blocks
        for block_id, num_holds in holds.items():
            if blocks[block_id].ref_cnt == num_holds:
                tenant = owners[block_id]
                freed[tenant] = freed.get(tenant, 0) + 1
        return freed

    def _charged_pin(self, tenant: str, pin: Callable[[str], _T]) -> _T:
        """``pin(owner)`` for ``tenant`` (after ``_tick``), charging the tenant the
        cached blocks the pin took out of the free queue."""
        pool = self.manager.block_pool
        counted = self.tenants.counts(tenant)
        free_before = pool.get_num_free_blocks()
        try:
            return pin(pin_owner(tenant))
        finally:
            if counted:
                self.tenants.charge(tenant, free_before - pool.get_num_free_blocks())

    def pin_prefix(self, args: PinArgs, tenant: str) -> PinView:
        """Pin the whole blocks of ``args.token_ids`` for ``tenant`` (README,
        Retention); pinning a prefix the tenant pinned already refreshes that pin.
        INVALID_ARGUMENT (shorter than a block, bad ids or TTL), OUT_OF_RANGE (past
        max_model_len), RESOURCE_EXHAUSTED (pinning off, or past the pinned budget);
        a refusal changes nothing (the arguments are checked before time passes)."""
        self._check_pin_tokens(args)
        with self._reporting_limits(tenant):
            self.limits.check_fields("(pin)", args.cache_salt, args.lora_name, (), args.lora_path)
        if args.lora_path and not args.lora_name:
            raise InvalidArgumentError(
                "pin: lora_path is set without lora_name; name the LoRA adapter "
                "(lora_name) whose lora_path it is"
            )
        if args.ttl_s is not None and not args.ttl_s > 0:
            raise InvalidArgumentError(
                f"pin: ttl_seconds must be positive (or 0: until unpinned), got {args.ttl_s}"
            )
        probe = self._pin_probe(args, tenant)
        if self.retention_sequence.driver is not None:
            return self._queue_pin(args, probe, tenant)
        self._tick()
        pin = self._charged_pin(
            tenant,
            lambda owner: self.manager.pin_request_prompt(
                owner, probe, self._now, ttl_s=args.ttl_s, refresh_on_hit=args.refresh_on_hit
            ),
        )
        self._reporter.changed()
        return self._pin_view(pin)

    def _pin_probe(self, args: PinArgs, tenant: str) -> Request:
        """The request whose prompt's whole blocks a pin names: its tokens hashed by the
        server or, with ``args.block_hashes``, keyed by the client's hashes as the
        tenant's client_hashed requests are (``client_hashes``; refused before
        anything changes)."""
        probe_id = f"pin:{pin_owner(tenant)}"
        salt = tenant_cache_salt(tenant, args.cache_salt)
        if not args.block_hashes:
            return self.manager.new_request(
                probe_id,
                args.token_ids,
                cache_salt=salt,
                lora_name=args.lora_name,
                lora_path=args.lora_path,
            )
        keys = self.client_hashes.pin_keys(tenant, args.block_hashes, len(args.token_ids))
        claimed = Request(
            probe_id,
            args.token_ids,
            self.manager.block_hasher,
            cache_salt=salt,
            lora_name=args.lora_name,
            lora_path=args.lora_path,
            client_hashed=True,
        )
        claimed.block_hashes.extend(keys)
        return claimed

    def _check_pin_tokens(self, args: PinArgs) -> None:
        token_ids = args.token_ids
        name = "packed_token_ids" if args.packed else "token_ids"
        if not token_ids:
            raise InvalidArgumentError(f"pin: {name} must hold at least one block of tokens")
        if not args.packed and min(token_ids) < 0:
            negative = next(i for i, t in enumerate(token_ids) if t < 0)
            raise InvalidArgumentError(
                f"pin: {name}[{negative}] = {token_ids[negative]}; token ids must be >= 0"
            )
        if self.vocab_size and max(token_ids) >= self.vocab_size:
            outside = next(i for i, t in enumerate(token_ids) if t >= self.vocab_size)
            raise InvalidArgumentError(
                f"pin: {name}[{outside}] = {token_ids[outside]} is outside the vocabulary; "
                f"token ids must be < vocab_size {self.vocab_size}"
            )
        if len(token_ids) > self.manager.max_model_len:
            raise OutOfRangeError(
                f"pin: {len(token_ids)} tokens exceed max_model_len "
                f"{self.manager.max_model_len}; no request could hit such a prefix"
            )

    def unpin_prefix(self, pin_id: str, tenant: str) -> None:
        """Drop ``tenant``'s pin ``pin_id`` (its blocks age as freed cached blocks).
        NOT_FOUND when the tenant has no such pin."""
        if not pin_id:
            raise InvalidArgumentError("unpin: pin_id must not be empty (ListPins names them)")
        if self.retention_sequence.driver is not None:
            self._queue_unpin(pin_id, tenant)
            return
        self._tick()
        pool = self.manager.block_pool
        free_before = pool.get_num_free_blocks()
        removed = self.manager.unpin_prefix(pin_owner(tenant), pin_id)
        if not removed:
            raise PinNotFoundError(
                f"pin {pin_id!r} is not known (never pinned by this tenant, unpinned, or "
                f"expired); ListPins names the tenant's pins"
            )
        if self.tenants.counts(tenant):
            self.tenants.charge(tenant, free_before - pool.get_num_free_blocks())
        self._reporter.changed()

    # -- retention under a replica session (``retention_sequence``) ------------------

    def follow_server(self) -> None:
        """This table is a replica of a server's: its retention changes only by the
        server's events (``apply_retention_event``), never by a clock of its own."""
        self._follows_server = True

    def apply_retention_event(self, event: RetentionEvent) -> None:
        """A retention change the server shipped, applied where the server did."""
        self._apply_event(event)

    def check_replica_free(self) -> None:
        """FAILED_PRECONDITION while a replica session drives the pool's retention."""
        if self._retention is not None and self.retention_sequence.driver is not None:
            raise FailedPreconditionError(
                "another replica session drives this pool's retention; one scheduler "
                "keeps a replica of a pool at a time (close the other session first)"
            )

    def start_replica(self, session_id: str) -> None:
        """``session_id`` keeps a replica of the pool, fresh: from now on retention
        changes wait for its step boundaries (``check_replica_free`` first). The
        retention clock restarts from 0, as the replica's; the pins there are taken
        out now and placed again, with what is left of their TTLs, at the replica's
        first boundary (it resets the pool to a fresh one meanwhile)."""
        retention = self._retention
        if retention is None:
            return  # nothing the server decides on its own
        self.check_replica_free()
        self._tick()
        old_now = self._now
        self._clock_origin = self._clock()
        sequence = self.retention_sequence
        sequence.start(session_id)
        for pin in list(retention.pins.values()):
            left = None if pin.expires_at is None else pin.expires_at - old_now
            if left is not None and left <= 0:
                continue
            # Placed at a time before 0 such that it expires as before, and a hit still
            # refreshes it to its whole TTL.
            placed_at = 0.0 if left is None or pin.ttl_s is None else left - pin.ttl_s
            sequence.queue(
                PinPlaced(
                    placed_at,
                    pin.tenant,
                    pin.pin_id,
                    pin.num_tokens,
                    pin.keys,
                    pin.ttl_s,
                    pin.refresh_on_hit,
                )
            )
            self._apply_event(PinRemoved(old_now, pin.tenant, pin.pin_id))
        self._advance(0.0)

    def end_replica(self, session_id: str) -> None:
        """The replica session ended: what waited takes effect, the clock runs again."""
        if self.retention_sequence.driver != session_id:
            return
        for event in self.retention_sequence.stop():
            self._apply_event(event)
        self._tick()

    def begin_replica_step(self, session_id: str | None) -> bool:
        """A Step message of ``session_id`` begins: True if it drives the pool (call
        ``end_replica_step`` once its operations ran)."""
        sequence = self.retention_sequence
        if session_id is None or sequence.driver != session_id:
            return False
        sequence.step += 1
        return True

    def end_replica_step(self) -> list[RetentionEvent]:
        """The driver's message ran: the changes due after it are applied (the replica
        applied them as it sent it), then those to ship with its answer are returned
        (see ``retention_sequence``): the server's clock now, and what was queued."""
        sequence = self.retention_sequence
        for event in sequence.due():
            self._apply_event(event)
        return sequence.end_step(self._time())

    def _apply_event(self, event: RetentionEvent) -> None:
        """Apply a held change, as the replica will, charging tenants what pins take or
        give back."""
        if isinstance(event, Tick):
            self._advance(event.now)
            return
        tenant = tenant_of_pin_owner(event.owner)
        self._charged_pin(tenant, lambda _: self.manager.apply_retention_event(event))
        self._reporter.changed()

    def _queue_pin(self, args: PinArgs, probe: Request, tenant: str) -> PinView:
        """A pin of ``probe``'s prompt for the replica's next boundaries: answered now
        (as it will be placed, holding nothing yet), placed when the boundary comes."""
        owner = pin_owner(tenant)
        pin_id, num_tokens, keys = self.manager.prepare_pin(owner, probe)
        self._check_pin_budget(len(keys), owner, pin_id)
        now = self._time()
        placed = PinPlaced(now, owner, pin_id, num_tokens, keys, args.ttl_s, args.refresh_on_hit)
        self.retention_sequence.queue(placed)
        expires_at = None if args.ttl_s is None else now + args.ttl_s
        pending = Pin(pin_id, owner, num_tokens, keys, args.ttl_s, args.refresh_on_hit, expires_at)
        return self._pin_view(pending)

    def _check_pin_budget(self, num_keys: int, owner: str, pin_id: str) -> None:
        """Refuse now a pin the boundary would refuse: past the budget, counting the
        pins placed and those waiting (a pin there already is refreshed, not added)."""
        retention = self._retention
        assert retention is not None
        waiting = [e for e in self.retention_sequence.queued if isinstance(e, PinPlaced)]
        if (owner, pin_id) in retention.pins or any(
            (e.owner, e.pin_id) == (owner, pin_id) for e in waiting
        ):
            return
        retention.check_budget(pin_id, num_keys, sum(len(e.keys) for e in waiting))

    def _queue_unpin(self, pin_id: str, tenant: str) -> None:
        owner = pin_owner(tenant)
        retention = self._retention
        assert retention is not None
        waiting = any(
            isinstance(e, PinPlaced) and (e.owner, e.pin_id) == (owner, pin_id)
            for e in self.retention_sequence.queued
        )
        if (owner, pin_id) not in retention.pins and not waiting:
            raise PinNotFoundError(
                f"pin {pin_id!r} is not known (never pinned by this tenant, unpinned, or "
                f"expired); ListPins names the tenant's pins"
            )
        self.retention_sequence.queue(PinRemoved(self._time(), owner, pin_id))

    def list_pins(self, tenant: str | None) -> list[PinView]:
        """The pins of ``tenant`` (None: every tenant's), by tenant then id."""
        self._tick()
        owner = None if tenant is None else pin_owner(tenant)
        return [self._pin_view(pin) for pin in self.manager.list_pins(owner)]

    def pinned_budget(self) -> PinnedBudget:
        """The pool's pinned blocks, reserved blocks and budget (zeros without pins)."""
        retention = self._retention
        if retention is None:
            return PinnedBudget(0, 0, 0)
        return PinnedBudget(
            retention.num_pinned_blocks,
            retention.num_reserved_blocks,
            retention.max_pinned_blocks,
        )

    def pins_per_tenant(self) -> dict[str, int]:
        """Pins per tenant (a copy: safe to read from the metrics thread, since the
        keys are copied in one C-level step)."""
        retention = self._retention
        counts: dict[str, int] = {}
        if retention is None:
            return counts
        for owner, _ in list(retention.pins):
            tenant = tenant_of_pin_owner(owner)
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    def _pin_view(self, pin: Pin) -> PinView:
        expires_in = None if pin.expires_at is None else max(0.0, pin.expires_at - self._now)
        return PinView(
            pin_id=pin.pin_id,
            tenant=tenant_of_pin_owner(pin.tenant),
            num_tokens=pin.num_tokens,
            num_reserved_blocks=len(pin.keys),
            num_held_blocks=len(pin.held),
            ttl_s=pin.ttl_s,
            refresh_on_hit=pin.refresh_on_hit,
            expires_in_s=expires_in,
            num_hits=pin.num_hits,
        )

    # -- freeing and queries --------------------------------------------------------

    def free(
        self, request_id: str, mode: FreeMode, tenant: str, keep_blocks: bool = False
    ) -> Request:
        """Release the request's blocks; PREEMPT keeps it for re-prefill, FINISH
        forgets it. ``keep_blocks`` (vLLM's ``pop_blocks_for_free``): the blocks stay
        held for the running Step's session, which releases them later
        (``free_retained_blocks``)."""
        request = self._get(request_id, tenant)
        key = request.request_id
        if mode is FreeMode.PREEMPT and request.status != RequestStatus.RUNNING:
            raise FailedPreconditionError(
                f"request {request_id!r} is {request.status.name}; only a running request "
                f"can be preempted (use FINISH to drop it)"
            )
        if keep_blocks and self._runtime_sync.keep_holds is None:
            raise FailedPreconditionError(
                f"free({request_id!r}, keep_blocks) keeps the blocks for a session to "
                f"release; it must run inside a session's Step"
            )
        self._hits.pop(key, None)
        if mode is FreeMode.FINISH:
            waiting = 0 if request.status == RequestStatus.RUNNING else request.num_tokens
            request.status = RequestStatus.FINISHED
            del self._requests[key]
            embeds = request.prompt_embeds
            self.requests_per_tenant.finished(
                tenant,
                waiting,
                len(embeds) if embeds is not None else 0,
                len(request.mm_features),
                mm_identifier_bytes(request.mm_features),
            )
            if self.ownership is not None:
                self.ownership.release(tenant, request_id)
        if keep_blocks:
            # Nothing goes back to the pool yet: the tenant is charged at the release.
            self._runtime_sync.keep(self.manager.pop_blocks_for_free(request))
        elif self.tenants.counts(tenant):
            pool = self.manager.block_pool
            free_before = pool.get_num_free_blocks()
            self.manager.free(request)
            self.tenants.charge(tenant, free_before - pool.get_num_free_blocks())
        else:
            self.manager.free(request)
        if mode is FreeMode.PREEMPT:
            request.preempt()
            # Never refused (the scheduler needs the room): it may take the tenant past
            # its waiting limit, which then refuses new requests until it is back under.
            self.requests_per_tenant.waiting_changed(tenant, request.num_tokens)
            self._reporter.preempted()
        self._reporter.changed()
        return request

    def get_request(self, request_id: str, tenant: str) -> Request:
        """A known request of ``tenant``; NOT_FOUND otherwise."""
        return self._get(request_id, tenant)

    def get_block_ids(self, request_id: str, tenant: str) -> BlockIdsPerGroup:
        """The request's block table per group; empty lists before its first
        allocation."""
        key = self._get(request_id, tenant).request_id
        try:
            return self.manager.get_block_ids(key)
        except RequestNotFoundError:
            # The manager learns of a request at its first allocation; to the table it
            # already exists and simply holds nothing.
            return tuple([] for _ in range(self.manager.num_kv_cache_groups))

    def reset_prefix_cache(self, fresh_pool: bool = False) -> bool:
        """Forget every cached prefix (with ``fresh_pool``, also restore a new pool's
        block order); False while blocks are in use."""
        # Remembered hits are kept: their blocks lost their keys, so attaching one now
        # answers ABORTED, which tells the client to look up again.
        reset = self.manager.reset_prefix_cache(restore_block_order=fresh_pool)
        if reset and self._retention is not None:
            # Only pins held blocks, and they let go: no tenant holds any now.
            self.tenants.release_all()
        self._after_change()
        return reset

    @property
    def num_requests(self) -> int:
        """Requests the table knows (waiting, running and preempted)."""
        return len(self._requests)

    def audit(self) -> None:
        """Raise ``InvariantViolationError`` unless the pool is consistent, every
        block table belongs to a known request and each tenant's block count is what
        its requests hold. O(pool size): for tests and debugging, not the hot path."""
        check_invariants(self.manager)
        for single in self.manager.coordinator.single_type_managers:
            orphans = sorted(
                rid
                for rid, blocks in single.req_to_blocks.items()
                if blocks and rid not in self._requests
            )
            if orphans:
                raise InvariantViolationError(
                    f"requests {orphans[:5]} hold blocks but are not known to the table"
                )
        check_tenant_blocks(self.manager, self.tenant_blocks(), self._runtime_sync.kept_blocks())
        self.requests_per_tenant.check(self._requests)
        kept, held = self._runtime_sync.num_kept(), self.manager.retained_holds.total()
        if kept != held:
            raise InvariantViolationError(
                f"the sessions keep {kept} copy holds; the pool holds {held} for copies"
            )

    def tenant_blocks(self) -> dict[str, int]:
        """Blocks held per tenant (a copy; safe to read from the metrics thread)."""
        return self.tenants.blocks_per_tenant(self.usage().num_used_blocks)

    def usage(self) -> PoolUsage:
        """The pool's usage and totals, every tenant's together."""
        manager = self.manager
        num_blocks = manager.kv_cache_config.num_blocks
        num_free = manager.block_pool.get_num_free_blocks()
        return PoolUsage(
            usage=manager.usage,
            num_free_blocks=num_free,
            # Block 0 (the null block) is never free and never counted as used.
            num_used_blocks=num_blocks - 1 - num_free,
            num_blocks=num_blocks,
            num_requests=len(self._requests),
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
        )

    def tenant_usage(self, tenant: str) -> PoolUsage:
        """What ``tenant`` holds and looked up, with the pool's free space (which every
        tenant allocates from). On a server whose only tenant is the default one, the
        same as ``usage()``."""
        pool = self.usage()
        queries, hits = self._prefix_cache_by_tenant.get(tenant, (0, 0))
        return dataclasses.replace(
            pool,
            num_used_blocks=self.tenant_blocks().get(tenant, 0),
            num_requests=self.requests_per_tenant.requests(tenant),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
        )

    # -- batching and reporting ------------------------------------------------------

    @contextmanager
    def batched(self, keep_copy_holds: HoldOwner | None = None) -> Iterator[None]:
        """Apply the runtime's zeroing and copies, and report the pool to the
        observer, once when the block ends instead of after every change in it (a
        ``Step`` of many operations). The observer sees the same totals: gauges end
        at the same values and the prefix cache counters move by the sum of the
        batch's stats. Nothing awaits inside, so no scrape can tell apart (beyond
        seeing a value one step old, as any gauge may).

        ``keep_copy_holds`` (tenant, session id): the copy holds the block's
        allocations take are kept for that session to release
        (``free_retained_blocks``) instead of when the block ends."""
        self._batch_depth += 1
        if self._batch_depth == 1:
            self._reporter.begin_batch()
            self._runtime_sync.keep_holds = keep_copy_holds
        try:
            yield
        finally:
            self._batch_depth -= 1
            if not self._batch_depth:
                self._runtime_sync.keep_holds = None
                try:
                    # Also on an exception: the operations before it stay applied, so
                    # their blocks must be zeroed all the same.
                    self._runtime_sync.apply()
                finally:
                    self._reporter.end_batch()

    def publish_events(self) -> None:
        """Hand the manager's pending KV events to the event sink (none without one)."""
        self._reporter.publish_events()

    def _after_change(self, tenant: str | None = None) -> None:
        """Add the change's prefix cache stats to the totals of ``usage()`` (and of
        ``tenant``'s, for a lookup of its) and report it."""
        stats = self.manager.make_prefix_cache_stats()
        if stats is not None:
            self._prefix_cache_queries += stats.queries
            self._prefix_cache_hits += stats.hits
            if tenant is not None:
                counts = self._prefix_cache_by_tenant.setdefault(tenant, [0, 0])
                counts[0] += stats.queries
                counts[1] += stats.hits
        self._reporter.changed(stats)


def _check_lora(new: NewRequest) -> None:
    """A LoRA path or int id describes the adapter ``lora_name`` names: refuse one
    without it, and an int id vLLM would refuse (ids start at 1)."""
    rid = new.request_id
    if not new.lora_name and (new.lora_path or new.lora_int_id):
        field = "lora_path" if new.lora_path else "lora_int_id"
        raise InvalidArgumentError(
            f"request {rid!r}: {field} is set without lora_name; name the LoRA adapter "
            f"(lora_name) whose {field} it is"
        )
    if new.lora_int_id is not None and new.lora_int_id < 1:
        raise InvalidArgumentError(
            f"request {rid!r}: lora_int_id = {new.lora_int_id}; vLLM's LoRA ids are >= 1 (0: no id)"
        )


def _check_prompt_embeds(new: NewRequest) -> None:
    """Prompt embeddings must be one row of the declared width per prompt token: the
    core hashes each block's rows, so a length that is off would hash rows of the
    wrong tokens."""
    rid = new.request_id
    row_bytes = new.prompt_embeds_row_bytes
    if new.prompt_embeds is None:
        if row_bytes:
            raise InvalidArgumentError(
                f"request {rid!r}: prompt_embeds_row_bytes = {row_bytes} but prompt_embeds "
                f"is empty; send both or neither"
            )
        return
    num_tokens = len(new.prompt_token_ids)
    if row_bytes <= 0:
        raise InvalidArgumentError(
            f"request {rid!r}: prompt_embeds ({len(new.prompt_embeds)} bytes) needs "
            f"prompt_embeds_row_bytes > 0 (bytes per token: hidden size times element "
            f"size), got {row_bytes}"
        )
    if len(new.prompt_embeds) != num_tokens * row_bytes:
        raise InvalidArgumentError(
            f"request {rid!r}: prompt_embeds holds {len(new.prompt_embeds)} bytes; "
            f"{num_tokens} prompt tokens of {row_bytes} bytes each are "
            f"{num_tokens * row_bytes}"
        )


# Speed: min() and max() run in C over many ids, but they are builtins called with an
# argument tuple, and a decode's append carries one id: looking at it took the table
# layer of ``python -m benchmarks.bench_decode_layers --layers table,step --rounds 15``
# from 1.57-1.62x to 1.36-1.43x the core's cost (3 runs each, alternating).
def _lowest(token_ids: Sequence[int]) -> int:
    return token_ids[0] if len(token_ids) == 1 else min(token_ids)


def _highest(token_ids: Sequence[int]) -> int:
    return token_ids[0] if len(token_ids) == 1 else max(token_ids)


class _ReportingLimits:
    """``with`` it, a limit that refuses the call inside is told to the refusal sink.

    A class, not a ``contextmanager`` generator: compiled, it runs natively, and
    ``check_request_size`` enters one per added request."""

    __slots__ = ("_sink", "_tenant")

    def __init__(self, sink: RefusalSink | None, tenant: str) -> None:
        self._sink = sink
        self._tenant = tenant

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Returns None: the refusal goes on up.
        if self._sink is not None and isinstance(exc, (LimitError, LimitExceededError)):
            self._sink(self._tenant, exc.limit)

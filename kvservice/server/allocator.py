"""The service's state: one ``KVCacheManager`` and the requests allocated from it.

``Allocator`` does what vLLM's scheduler does around its manager (the request table,
``num_computed_tokens``, request status, the prefix hit carried from lookup to
allocation) and checks every argument before anything changes, so a refused call
leaves no trace. It knows nothing of gRPC.

It is not thread safe on purpose: one asyncio loop owns it, and no method awaits, so
each call runs to completion before the next starts.

With a co-located runtime (``KVRuntime``) it also keeps the KV tensors in step with
the block table: every block an allocation hands out is zeroed before the allocation
returns, or, inside ``batched()``, once when the batch ends (one zeroing for a whole
``Step``), which is still before any answer leaves the server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvservice.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    OutOfRangeError,
    QuotaExceededError,
    RequestNotFoundError,
)
from kvservice.core.invariants import InvariantViolationError, check_invariants
from kvservice.core.kv_cache_block import BlockHashWithGroupId, KVCacheBlock
from kvservice.core.kv_cache_manager import AllocationProbe, KVCacheBlocks, KVCacheManager
from kvservice.core.kv_events import KVCacheEvent
from kvservice.core.request import Request, RequestStatus
from kvservice.server.allocation import (
    AllocateArgs,
    Allocation,
    AllocationResult,
    AllocatorObserver,
    BlockIdsPerGroup,
    ComputedBlocks,
    FreeMode,
    KVRuntime,
    NewRequest,
    PoolUsage,
    ProbeArgs,
    RequestOwnership,
    plain_allocate_args,
)
from kvservice.server.caller import DEFAULT_TENANT, current_caller
from kvservice.server.errors import AlreadyExistsError, StaleHitError
from kvservice.server.pool_reporter import PoolReporter
from kvservice.server.tenancy import (
    TenantLedger,
    core_request_id,
    tenant_cache_salt,
)

# Receives the manager's KV events right after the change that caused them.
EventSink = Callable[[list[KVCacheEvent]], None]
# Told (tenant, reason) of every allocation refused for a tenant's quota.
RefusalSink = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class _PrefixHit:
    """A lookup's hit, kept until AllocateSlots attaches it. The lookup took no
    references, so a free hit block may be evicted meanwhile; the cache keys seen at
    lookup time tell whether each block still holds that content."""

    blocks: KVCacheBlocks
    block_ids: tuple[tuple[int, ...], ...]
    keys: tuple[tuple[BlockHashWithGroupId | None, ...], ...]

    @classmethod
    def of(cls, blocks: KVCacheBlocks) -> _PrefixHit:
        # List comprehensions: a hit is tens of blocks on every admission.
        groups = blocks.blocks
        return cls(
            blocks,
            tuple([tuple([b.block_id for b in group]) for group in groups]),
            tuple([tuple([b.block_hash for b in group]) for group in groups]),
        )

    def first_evicted_block(self) -> int | None:
        for group, keys in zip(self.blocks.blocks, self.keys, strict=True):
            # Compared whole first (the usual answer: nothing was evicted).
            if tuple([block.block_hash for block in group]) == keys:
                continue
            for block, key in zip(group, keys, strict=True):
                if block.block_hash != key:
                    return block.block_id
        return None


class Allocator:
    """The request table around one ``KVCacheManager``; one method per RPC."""

    def __init__(
        self,
        manager: KVCacheManager,
        observer: AllocatorObserver | None = None,
        runtime: KVRuntime | None = None,
        events: EventSink | None = None,
        quotas: Mapping[str, int] | None = None,
        on_refusal: RefusalSink | None = None,
        vocab_size: int = 0,
    ) -> None:
        if runtime is not None and not manager.kv_cache_config.needs_kv_cache_zeroing:
            # The core records fresh blocks only when zeroing is on; without the
            # record the runtime would hand out blocks holding another request's KV.
            raise InvalidArgumentError("a runtime needs a pool with needs_kv_cache_zeroing")
        if vocab_size < 0:
            raise InvalidArgumentError(f"vocab_size must be >= 0 (0: no bound), got {vocab_size}")
        self.manager = manager
        # Token ids must be below this; 0: no upper bound.
        self.vocab_size = vocab_size
        self._runtime = runtime
        # With a sink, every change hands the manager's events on before the call
        # returns, so none is ever pending between two RPCs (what makes a snapshot
        # taken then match the events published so far).
        self._events = events
        # Fresh blocks handed out inside a batch, zeroed once when it ends.
        self._to_zero: list[int] = []
        # Copy-on-write copies of the batch (applied after the zeroing), and the blocks
        # the core holds for them per owning tenant, released once they are applied or
        # handed to the worker.
        self._copies: list[tuple[int, int]] = []
        self._retained: list[tuple[str, list[KVCacheBlock]]] = []
        self._requests: dict[str, Request] = {}
        # Who owns each request (set by the server when sessions are on).
        self.ownership: RequestOwnership | None = None
        self._hits: dict[str, _PrefixHit] = {}
        # Blocks held per tenant, against ``quotas`` (tenant -> max_blocks). The
        # default tenant is charged only when it has a quota: otherwise its count is
        # what the named tenants do not hold (``tenant_blocks``), and the hot path of a
        # server without tenants does no ledger work at all.
        self.tenants = TenantLedger(quotas)
        self._charge_default = self.tenants.has_quota(DEFAULT_TENANT)
        # Read on every allocation: the groups' managers (whether copies are queued)
        # and whether the core records fresh blocks (only when zeroing is on).
        self._singles = tuple(manager.coordinator.single_type_managers)
        self._records_fresh = manager.kv_cache_config.needs_kv_cache_zeroing
        # The named tenant of each request (the default tenant's are not listed).
        self._tenant_of: dict[str, str] = {}
        self._on_refusal = on_refusal
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        # Inside ``batched()``: the runtime's zeroing and copies wait for the batch to
        # end, and so do the reporter's observations of the pool.
        self._batch_depth = 0
        self._reporter = PoolReporter(observer, self.usage)
        # Most decode allocations take no block: the core answers its one shared empty
        # KVCacheBlocks, and the allocator one shared answer of its ids (read by the
        # converters, never mutated; see ``_block_ids``).
        self._no_new_blocks = manager.empty_kv_cache_blocks
        self._no_new_block_ids = self._no_new_blocks.get_block_ids()
        # What lets ``allocate_new_tokens`` skip the general path's per-call work.
        self._plain_fast = not (
            runtime is not None or events is not None or self._records_fresh or self._charge_default
        )
        self._after_change()

    # -- requests -------------------------------------------------------------------

    def add_request(self, new: NewRequest, tenant: str | None = None) -> Request:
        """Register a WAITING request of ``tenant``; ALREADY_EXISTS for an id the
        tenant already uses (another tenant's ids are no concern of it)."""
        rid = new.request_id
        tenant = _tenant(tenant)
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
        request = Request(
            key,
            new.prompt_token_ids,
            self.manager.block_hasher,
            cache_salt=tenant_cache_salt(tenant, new.cache_salt),
            lora_name=new.lora_name,
            mm_features=new.mm_features,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
        )
        self._requests[key] = request
        if tenant != DEFAULT_TENANT:
            self._tenant_of[key] = tenant
        if self.ownership is not None:
            self.ownership.adopt(rid)
        return request

    def append_tokens(
        self, request_id: str, token_ids: list[int], tenant: str | None = None
    ) -> Request:
        """Append sampled tokens (hashing the blocks they complete)."""
        request = self._get(request_id, tenant)
        self._check_new_tokens(request_id, token_ids, request.num_tokens, "token_ids")
        request.append_output_token_ids(token_ids)
        return request

    def append_token(self, request_id: str, token_id: int, tenant: str) -> Request:
        """``append_tokens`` of one token: a decode step's call, one per entry of an
        AppendTokensBatch. A request of the default tenant with a token in range takes
        the checks inline; anything else takes the general path, which answers it."""
        request = self._requests.get(request_id) if tenant == DEFAULT_TENANT else None
        if (
            request is None
            or token_id < 0
            or (self.vocab_size and token_id >= self.vocab_size)
            or request.num_tokens >= self.manager.max_model_len
        ):
            return self.append_tokens(request_id, [token_id], tenant)
        request.append_output_token_ids(token_id)
        return request

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
        # min() and max() run in C; the generator that names the first bad index runs
        # only when there is one (a decode step appends one token per request per step).
        if not nonnegative and min(token_ids) < 0:
            negative = next(i for i, t in enumerate(token_ids) if t < 0)
            raise InvalidArgumentError(
                f"request {rid!r}: {name}[{negative}] = {token_ids[negative]}; token ids "
                f"must be >= 0"
            )
        vocab_size = self.vocab_size
        if vocab_size and max(token_ids) >= vocab_size:
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

    def _get(self, request_id: str, tenant: str | None = None) -> Request:
        # Another tenant's request answers exactly as an unknown id: no existence leak.
        if tenant is None:
            tenant = current_caller().tenant
        request = self._requests.get(core_request_id(tenant, request_id) if tenant else request_id)
        if request is None:
            raise RequestNotFoundError(
                f"request {request_id!r} is not known (never added, or finished); "
                f"call AddRequest first"
            )
        return request

    # -- lookup and allocation ------------------------------------------------------

    def get_computed_blocks(self, request_id: str, tenant: str | None = None) -> ComputedBlocks:
        """The cached prefix of a waiting or preempted request, remembered for the
        next ``allocate_slots``. Side effect: records prefix cache stats."""
        request = self._get(request_id, tenant)
        if request.status == RequestStatus.RUNNING:
            raise FailedPreconditionError(
                f"request {request_id!r} is running; prefix lookups are for waiting or "
                f"preempted requests (free it with PREEMPT to re-admit it)"
            )
        try:
            blocks, num_hit, boundary = self.manager.get_computed_blocks(request)
        except KVCacheError as err:
            raise _renamed(err, request.request_id, request_id) from None
        hit = self._hits[request.request_id] = _PrefixHit.of(blocks)
        self._after_change()
        # The remembered ids themselves: a caller that names them back (Admit does)
        # is checked against them at the cost of an identity comparison.
        return ComputedBlocks(hit.block_ids, num_hit, boundary)

    def allocate_slots(
        self, request_id: str, args: AllocateArgs, tenant: str | None = None
    ) -> Allocation:
        """``allocate_slots`` for a known request; counts the outcome either way.
        RESOURCE_EXHAUSTED (nothing changed) when it would take ``tenant`` past its
        block quota."""
        try:
            allocation = self._allocate(request_id, args, tenant)
        except KVCacheError:
            self._reporter.record(AllocationResult.INVALID)
            # A refusal changes nothing, but hand on anything the core queued anyway
            # rather than let it surface later under another call.
            self.publish_events()
            raise
        ok = allocation.new_block_ids is not None
        self._reporter.record(AllocationResult.OK if ok else AllocationResult.NO_SPACE)
        # Even NO_SPACE may have released blocks that slid out of a sliding window.
        # Reported as ``_after_change`` does, less asking the core for prefix cache
        # stats (an allocation records none); written out here and in ``free`` so the
        # hot path makes no extra call.
        if self._events is not None:
            self.publish_events()
        self._reporter.pool_changed()
        return allocation

    def allocate_new_tokens(self, request_id: str, num_new_tokens: int, tenant: str) -> Allocation:
        """``allocate_slots`` with only ``num_new_tokens`` set: a decode step's call, one
        per entry of an AllocateSlotsBatch. The common case (a known request of the
        default tenant, no hit pending, a pool without runtime, event sink or charged
        default tenant) runs the core call with none of the general path's per-call
        layers; anything else takes the general path, so every outcome, refusals
        included, is the one ``allocate_slots`` gives."""
        request = self._requests.get(request_id)
        if (
            request is None
            or not self._plain_fast
            or tenant != DEFAULT_TENANT
            or self._retained
            or request_id in self._hits
        ):
            return self.allocate_slots(request_id, plain_allocate_args(num_new_tokens), tenant)
        previous = request.num_computed_tokens
        try:
            new_blocks = self.manager.allocate_slots(request, num_new_tokens)
        except KVCacheError:
            # Refused before any change: the general path answers it, named as usual.
            return self.allocate_slots(request_id, plain_allocate_args(num_new_tokens), tenant)
        reporter = self._reporter
        if new_blocks is None:
            reporter.record(AllocationResult.NO_SPACE)
            reporter.pool_changed()
            return Allocation(request, None)
        request.num_computed_tokens = previous + num_new_tokens
        request.status = RequestStatus.RUNNING
        copies = self._take_copies(DEFAULT_TENANT) if self._copies_pending() else []
        if self._retained and not self._batch_depth:
            self._release_retained()
        reporter.record(AllocationResult.OK)
        reporter.pool_changed()
        if copies:
            return Allocation(request, self._block_ids(new_blocks), block_copies_to_apply=copies)
        return Allocation(request, self._block_ids(new_blocks))

    def _block_ids(self, blocks: KVCacheBlocks) -> BlockIdsPerGroup:
        """An allocation's new block ids; the core's shared empty answer (most decode
        allocations) maps to the allocator's one shared empty ids."""
        if blocks is self._no_new_blocks:
            return self._no_new_block_ids
        return blocks.get_block_ids()

    def _allocate(self, request_id: str, args: AllocateArgs, tenant: str | None) -> Allocation:
        request = self._get(request_id, tenant)
        key = request.request_id
        previous = request.num_computed_tokens
        hit = None
        # The checks below are skipped inline for the common decode call (no count to
        # set, no hit to attach): each is a Python call per operation otherwise.
        if args.num_computed_tokens is not None:
            self._check_num_computed_tokens(request_id, args.num_computed_tokens)
        if args.new_computed_block_ids:
            hit = self._hit_to_attach(request_id, args.new_computed_block_ids, key)
        if args.num_computed_tokens is not None:
            request.num_computed_tokens = args.num_computed_tokens
        owner = self._owner(key)
        if owner == DEFAULT_TENANT and not self._charge_default:
            try:
                new_blocks = self._call_allocate_slots(request, args, hit, previous)
            except KVCacheError as err:
                raise _renamed(err, key, request_id) from None
        else:
            new_blocks = self._allocate_charged(request, request_id, owner, args, hit, previous)
        if new_blocks is None:
            # No room changes nothing, the value set for this call included.
            request.num_computed_tokens = previous
            return Allocation(request, None)
        self._hits.pop(key, None)
        # vLLM's scheduler advances the count right after scheduling; the next call
        # sends num_computed_tokens only to correct it (rejected draft tokens).
        request.num_computed_tokens += (
            args.num_new_computed_tokens + args.num_external_computed_tokens + args.num_new_tokens
        )
        request.status = RequestStatus.RUNNING
        fresh = self.manager.take_new_block_ids() if self._records_fresh else []
        copies = self._take_copies(owner) if self._copies_pending() else []
        if self._runtime is None:
            if self._retained and not self._batch_depth:
                self._release_retained()
            return Allocation(
                request,
                self._block_ids(new_blocks),
                block_ids_to_zero=fresh,
                block_copies_to_apply=copies,
            )
        self._to_zero.extend(fresh)
        self._copies.extend(copies)
        if not self._batch_depth:
            self._apply_runtime()
        return Allocation(
            request,
            self._block_ids(new_blocks),
            block_ids_zeroed=fresh,
            block_copies_applied=copies,
        )

    def _allocate_charged(
        self,
        request: Request,
        request_id: str,
        owner: str,
        args: AllocateArgs,
        hit: KVCacheBlocks | None,
        previous: int,
    ) -> KVCacheBlocks | None:
        """The core call for a tenant the ledger counts: its quota checked first, and
        the blocks it took charged to it."""
        key = request.request_id
        pool = self.manager.block_pool
        free_before = pool.get_num_free_blocks()
        try:
            if self.tenants.has_quota(owner):
                self._check_quota(request, request_id, owner, args, hit, previous)
            return self._call_allocate_slots(request, args, hit, previous)
        except KVCacheError as err:
            raise _renamed(err, key, request_id) from None
        finally:
            # Tenants never share a block, so the pool's loss is exactly the owner's gain
            # (negative when blocks slid out of a window).
            self.tenants.charge(owner, free_before - pool.get_num_free_blocks())

    def _charges(self, owner: str) -> bool:
        """Whether the ledger counts ``owner``'s blocks (see ``__init__``)."""
        return owner != DEFAULT_TENANT or self._charge_default

    def _copies_pending(self) -> bool:
        """Whether the core queued copy-on-write copies (rare: a partial-block hit);
        checked so that an allocation without one skips taking them."""
        return any(single.pending_cow_copies for single in self._singles)

    def _take_copies(self, owner: str) -> list[tuple[int, int]]:
        """The allocation's copy-on-write copies; the blocks held for them wait in
        ``_retained`` until ``_release_retained``."""
        taken = self.manager.take_kv_cache_block_copies()
        if taken.retained_blocks:
            self._retained.append((owner, taken.retained_blocks))
        return [(c.src_block_id, c.dst_block_id) for c in taken.copies]

    def _release_retained(self) -> None:
        """Release the holds of copies now applied (runtime) or in answers on their way
        to the worker, which applies each answer's copies before the model writes and
        before it zeroes the blocks of a later answer; a released source may be reused
        from then on. Charged to the tenant that took the copy."""
        retained, self._retained = self._retained, []
        pool = self.manager.block_pool
        for owner, blocks in retained:
            free_before = pool.get_num_free_blocks()
            self.manager.free_retained_blocks(blocks)
            if self._charges(owner):
                self.tenants.charge(owner, free_before - pool.get_num_free_blocks())

    def probe(self, request_id: str, args: ProbeArgs, tenant: str | None = None) -> AllocationProbe:
        """What a lookup plus ``allocate_slots`` would do now; changes nothing (no
        references, LRU order and prefix cache stats untouched). ``would_fit`` is also
        false when the allocation would take the tenant past its block quota."""
        request = self._get(request_id, tenant)
        try:
            probe = self.manager.probe(
                request,
                args.num_new_tokens,
                num_lookahead_tokens=args.num_lookahead_tokens,
                num_external_computed_tokens=args.num_external_computed_tokens,
                num_encoder_tokens=args.num_encoder_tokens,
                full_sequence_must_fit=args.full_sequence_must_fit,
                reserved_blocks=args.reserved_blocks,
                has_scheduled_reqs=args.has_scheduled_reqs,
            )
        except KVCacheError as err:
            raise _renamed(err, request.request_id, request_id) from None
        owner = self._owner(request.request_id)
        if not probe.would_fit or not self.tenants.has_quota(owner):
            return probe
        # The probe counts blocks sliding out of view as free; they are the owner's.
        freed = probe.num_free_blocks - self.manager.block_pool.get_num_free_blocks()
        if self.tenants.fits(owner, probe.num_blocks_to_allocate - freed):
            return probe
        return dataclasses.replace(probe, would_fit=False)

    def _check_quota(
        self,
        request: Request,
        request_id: str,
        tenant: str,
        args: AllocateArgs,
        hit: KVCacheBlocks | None,
        previous: int,
    ) -> None:
        """Refuse (restoring ``num_computed_tokens``) an allocation that would take
        ``tenant`` past its quota, counted with the core's own predictor: the blocks
        it would take from the free queue, less those sliding out of view. The core's
        argument checks run first, so a malformed call still answers its own status."""
        try:
            needed = self.manager.num_blocks_needed(
                request,
                args.num_new_tokens,
                args.num_new_computed_tokens,
                hit,
                args.num_lookahead_tokens,
                args.num_external_computed_tokens,
                args.num_encoder_tokens,
                args.reserved_blocks,
            )
            self.tenants.check(tenant, request_id, needed)
        except QuotaExceededError:
            request.num_computed_tokens = previous
            if self._on_refusal is not None:
                self._on_refusal(tenant, "quota")
            raise
        except KVCacheError:
            request.num_computed_tokens = previous
            raise

    def _call_allocate_slots(
        self, request: Request, args: AllocateArgs, hit: KVCacheBlocks | None, previous: int
    ) -> KVCacheBlocks | None:
        """The core call; a refusal restores ``num_computed_tokens`` to ``previous``."""
        try:
            return self.manager.allocate_slots(
                request,
                args.num_new_tokens,
                args.num_new_computed_tokens,
                hit,
                num_lookahead_tokens=args.num_lookahead_tokens,
                num_external_computed_tokens=args.num_external_computed_tokens,
                delay_cache_blocks=args.delay_cache_blocks,
                num_encoder_tokens=args.num_encoder_tokens,
                full_sequence_must_fit=args.full_sequence_must_fit,
                reserved_blocks=args.reserved_blocks,
                has_scheduled_reqs=args.has_scheduled_reqs,
            )
        except Exception:
            request.num_computed_tokens = previous
            raise

    def _check_num_computed_tokens(self, rid: str, value: int | None) -> None:
        if value is None:
            return
        if value < 0:
            raise InvalidArgumentError(
                f"request {rid!r}: num_computed_tokens must be >= 0, got {value}"
            )
        if value > self.manager.max_model_len:
            raise OutOfRangeError(
                f"request {rid!r}: num_computed_tokens {value} exceeds max_model_len "
                f"{self.manager.max_model_len}"
            )

    def _hit_to_attach(
        self, rid: str, block_ids: tuple[tuple[int, ...], ...], key: str
    ) -> KVCacheBlocks | None:
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

    # -- freeing and queries --------------------------------------------------------

    def free(self, request_id: str, mode: FreeMode, tenant: str | None = None) -> Request:
        """Release the request's blocks; PREEMPT keeps it for re-prefill, FINISH
        forgets it."""
        request = self._get(request_id, tenant)
        key = request.request_id
        owner = self._owner(key)
        if mode is FreeMode.PREEMPT and request.status != RequestStatus.RUNNING:
            raise FailedPreconditionError(
                f"request {request_id!r} is {request.status.name}; only a running request "
                f"can be preempted (use FINISH to drop it)"
            )
        self._hits.pop(key, None)
        if mode is FreeMode.FINISH:
            request.status = RequestStatus.FINISHED
            del self._requests[key]
            self._tenant_of.pop(key, None)
            if self.ownership is not None:
                self.ownership.release(request_id)
        if self._charges(owner):
            free_before = self.manager.block_pool.get_num_free_blocks()
            self.manager.free(request)
            self.tenants.charge(owner, free_before - self.manager.block_pool.get_num_free_blocks())
        else:
            self.manager.free(request)
        if mode is FreeMode.PREEMPT:
            request.preempt()
            # Reported right away, even inside a batch.
            observer = self._reporter.observer
            if observer is not None:
                observer.record_preemption()
        # ``_after_change`` less the prefix cache stats (see ``allocate_slots``).
        if self._events is not None:
            self.publish_events()
        self._reporter.pool_changed()
        return request

    def get_request(self, request_id: str, tenant: str | None = None) -> Request:
        """A known request of ``tenant``; NOT_FOUND otherwise."""
        return self._get(request_id, tenant)

    def get_block_ids(self, request_id: str, tenant: str | None = None) -> BlockIdsPerGroup:
        """The request's block table per group; empty lists before its first
        allocation."""
        key = self._get(request_id, tenant).request_id
        try:
            return self.manager.get_block_ids(key)
        except RequestNotFoundError:
            # The manager learns of a request at its first allocation; to the service
            # it already exists and simply holds nothing.
            return tuple([] for _ in range(self.manager.num_kv_cache_groups))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while blocks are in use."""
        # Remembered hits are kept: their blocks lost their keys, so attaching one now
        # answers ABORTED, which tells the client to look up again.
        reset = self.manager.reset_prefix_cache()
        self._after_change()
        return reset

    @property
    def num_requests(self) -> int:
        """Requests the server knows (waiting, running and preempted)."""
        return len(self._requests)

    def audit(self) -> None:
        """Raise ``InvariantViolationError`` unless the pool is consistent and every
        block table belongs to a known request. O(pool size): for tests and
        debugging, not the hot path."""
        check_invariants(self.manager)
        for single in self.manager.coordinator.single_type_managers:
            orphans = sorted(
                rid
                for rid, blocks in single.req_to_blocks.items()
                if blocks and rid not in self._requests
            )
            if orphans:
                raise InvariantViolationError(
                    f"requests {orphans[:5]} hold blocks but are not known to the service"
                )
        self._audit_tenants()

    def _audit_tenants(self) -> None:
        """Each tenant's ledger count must equal the distinct blocks its requests
        hold, and no block may be held by two tenants."""
        holders: dict[int, str] = {}
        for single in self.manager.coordinator.single_type_managers:
            for key, blocks in single.req_to_blocks.items():
                owner = self._owner(key)
                for block in blocks:
                    if block.is_null:
                        continue
                    other = holders.setdefault(block.block_id, owner)
                    if other != owner:
                        raise InvariantViolationError(
                            f"block {block.block_id} is held by tenants {other!r} and {owner!r}"
                        )
        counted: dict[str, int] = {}
        for owner in holders.values():
            counted[owner] = counted.get(owner, 0) + 1
        ledger = {t: n for t, n in self.tenant_blocks().items() if n}
        if counted != ledger:
            raise InvariantViolationError(
                f"blocks held per tenant {counted} do not match the quota ledger {ledger}"
            )

    def _owner(self, key: str) -> str:
        """The tenant a core key belongs to."""
        return self._tenant_of.get(key, DEFAULT_TENANT)

    def tenant_blocks(self) -> dict[str, int]:
        """Blocks held per tenant (a copy; safe to read from the metrics thread). An
        uncharged default tenant holds every used block no named tenant holds: each
        change of the pool's free count is some tenant's, and tenants share no block."""
        held = self.tenants.snapshot()
        if self._charge_default:
            return held
        num_blocks = self.manager.kv_cache_config.num_blocks
        # Block 0 (the null block) is never free and held by no one.
        used = num_blocks - 1 - self.manager.block_pool.get_num_free_blocks()
        default = used - sum(held.values())
        if default:
            held[DEFAULT_TENANT] = default
        return held

    def usage(self) -> PoolUsage:
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

    # -- observation ----------------------------------------------------------------

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Report the pool to the observer once, when the block ends, instead of after
        every change in it (a ``Step`` of many operations). The observer sees the same
        totals: gauges end at the same values and the prefix cache counters move by the
        sum of the batch's stats. Nothing awaits inside, so no scrape can tell apart
        (beyond seeing a value one step old, as any gauge may)."""
        self._batch_depth += 1
        if self._batch_depth == 1:
            self._reporter.begin_batch()
        try:
            yield
        finally:
            self._batch_depth -= 1
            if not self._batch_depth:
                try:
                    # Also on an exception: the operations before it stay applied, so
                    # their blocks must be zeroed all the same.
                    self._apply_runtime()
                finally:
                    self._reporter.end_batch()

    def _apply_runtime(self) -> None:
        """Zero the fresh blocks handed out since the last call, then apply the
        copy-on-write copies (one ``KVRuntime.apply``), then release the blocks held
        for the copies."""
        try:
            if self._runtime is None or not (self._to_zero or self._copies):
                return
            # Taken before applying: a device failure must not zero or copy the same ids
            # again inside a later answer (the failure itself answers INTERNAL).
            to_zero, self._to_zero = self._to_zero, []
            copies, self._copies = self._copies, []
            self._runtime.apply(to_zero, copies or None)
        finally:
            self._release_retained()

    def publish_events(self) -> None:
        """Hand the manager's pending KV events to the sink (none without one)."""
        if self._events is not None:
            events = self.manager.take_events()
            if events:
                self._events(events)

    def _after_change(self) -> None:
        """Hand on the change's events, add its prefix cache stats to the totals of
        ``usage()`` and report the pool."""
        self.publish_events()
        stats = self.manager.make_prefix_cache_stats()
        if stats is not None:
            self._prefix_cache_queries += stats.queries
            self._prefix_cache_hits += stats.hits
        self._reporter.pool_changed(stats)


def _tenant(tenant: str | None) -> str:
    """``tenant``, or when None the tenant of the call running in this task (the
    default tenant outside any call): the RPC boundary and the sessions' reaper set
    it in ``caller.CURRENT_CALLER``."""
    return current_caller().tenant if tenant is None else tenant


def _renamed(err: KVCacheError, key: str, request_id: str) -> KVCacheError:
    """``err`` as the client should read it: a core error about ``key`` (a named
    tenant's core key) re-made to name ``request_id``, the id the client knows."""
    if key == request_id or repr(key) not in str(err):
        return err
    return type(err)(str(err).replace(repr(key), repr(request_id)))

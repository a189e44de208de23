"""The KV tensors kept in step with the block table: fresh blocks zeroed and
copy-on-write copies applied before an answer hands their ids out.

Every block an allocation takes fresh from a pool that needs zeroing, and every
copy-on-write copy a partial prefix hit needs, goes to one of two places:

* a co-located runtime (``KVRuntime``: the server's own KV tensors) zeroes and copies
  them before the allocation returns or, inside a batch (``RequestTable.batched()``),
  once when the batch ends (one zeroing for a whole ``Step``), which is still before
  any answer leaves the server; the answer lists them as done;
* otherwise the answer lists them for the client's worker to apply.

The core holds both ends of each copy (retained) until the copy is applied or on its
way to the worker; ``RuntimeSync`` releases the holds then, charged to the tenant that
took the copy. A caller may instead keep them (``keep_holds``: a ``Step`` sent with
``keep_copy_holds``) and release them itself, in its own order (``release_kept``), as
vLLM's scheduler frees ``take_kv_cache_block_copies``' retained blocks: a scheduler
whose replica must agree with the pool block for block releases them where vLLM does.
Kept holds belong to a session (``HoldOwner``) and end with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvservice.core.errors import FailedPreconditionError, InvalidArgumentError
from kvservice.core.kv_cache_block import KVCacheBlock
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request
from kvservice.request_table.tenancy import TenantLedger
from kvservice.request_table.types import Allocation, BlockIdsPerGroup


class KVRuntime(Protocol):
    """The KV tensors the server owns (``gpu_runtime.runtime.KVCacheRuntime``); a
    protocol so the table needs no torch."""

    def apply(
        self,
        new_block_ids_to_zero: Sequence[int] | None = None,
        copies: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Zero fresh blocks, then apply copy-on-write ``(src, dst)`` copies."""
        ...


# Who kept copy holds: (tenant, session id).
HoldOwner = tuple[str, str]


class RuntimeSync:
    """Where one table's fresh blocks and copies go, and the holds they keep."""

    def __init__(
        self, manager: KVCacheManager, runtime: KVRuntime | None, tenants: TenantLedger
    ) -> None:
        if runtime is not None and not manager.kv_cache_config.needs_kv_cache_zeroing:
            # The core records fresh blocks only when zeroing is on; without the
            # record the runtime would hand out blocks holding another request's KV.
            raise InvalidArgumentError("a runtime needs a pool with needs_kv_cache_zeroing")
        self._manager = manager
        self._runtime = runtime
        self._tenants = tenants
        # Read on every allocation: whether the core records fresh blocks (only when
        # zeroing is on) and the groups' managers (whether copies are queued).
        self._records_fresh = manager.kv_cache_config.needs_kv_cache_zeroing
        self._singles = tuple(manager.coordinator.single_type_managers)
        # Waiting for the runtime: fresh blocks, then copies (applied after zeroing).
        self._to_zero: list[int] = []
        self._copies: list[tuple[int, int]] = []
        # The blocks the core holds for copies, per owning tenant, until they are
        # applied or handed to the worker.
        self._retained: list[tuple[str, list[KVCacheBlock]]] = []
        # While set (a Step with keep_copy_holds): whose the holds taken now are.
        self.keep_holds: HoldOwner | None = None
        # Holds kept for their owner to release, block ids in the order taken.
        self._kept: dict[HoldOwner, list[int]] = {}

    def allocation(
        self, request: Request, new_block_ids: BlockIdsPerGroup, owner: str, batched: bool
    ) -> Allocation:
        """The answer of an allocation that fitted, with its fresh blocks and copies
        applied by the runtime (at once, or when the batch ends) or listed for the
        worker."""
        fresh: Sequence[int] = self._manager.take_new_block_ids() if self._records_fresh else ()
        copies = self._take_copies(owner) if self._copies_pending() else ()
        if self._runtime is None:
            if self._retained and not batched:
                self._release_retained()
            return Allocation(request, new_block_ids, fresh, (), copies, ())
        self._to_zero.extend(fresh)
        self._copies.extend(copies)
        if not batched:
            self.apply()
        return Allocation(request, new_block_ids, (), fresh, (), copies)

    def apply(self) -> None:
        """Zero the fresh blocks handed out since the last call, then apply the
        copies (one ``KVRuntime.apply``), then release the blocks held for them."""
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

    def _copies_pending(self) -> bool:
        """Whether the core queued copy-on-write copies (rare: a partial-block hit)."""
        return any(single.pending_cow_copies for single in self._singles)

    def _take_copies(self, owner: str) -> list[tuple[int, int]]:
        taken = self._manager.take_kv_cache_block_copies()
        if taken.retained_blocks:
            if self.keep_holds is not None:
                held = self._kept.setdefault(self.keep_holds, [])
                held.extend(b.block_id for b in taken.retained_blocks)
            else:
                self._retained.append((owner, taken.retained_blocks))
        return [(c.src_block_id, c.dst_block_id) for c in taken.copies]

    def keep(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Keep the core's holds on ``blocks`` (a request's deferred free) for the
        session of the running Step to release, as its copy holds are."""
        assert self.keep_holds is not None, "keep() outside a Step with keep_copy_holds"
        self._kept.setdefault(self.keep_holds, []).extend(b.block_id for b in blocks)

    def release_kept(self, owner: HoldOwner, block_ids: Sequence[int]) -> None:
        """Release one kept hold of ``owner`` on each of ``block_ids``, in that order
        (one ``free_retained_blocks``, as vLLM's scheduler frees them); refuses, changing
        nothing, a block ``owner`` does not hold that many times."""
        held = self._kept.get(owner, [])
        left = list(held)
        for index, block_id in enumerate(block_ids):
            try:
                left.remove(block_id)
            except ValueError:
                raise FailedPreconditionError(
                    f"block_ids[{index}] = {block_id}: this session holds no (more) copy "
                    f"hold on block {block_id} (it holds {sorted(held) or 'none'}); each "
                    f"hold is released once, by the session whose step kept it"
                ) from None
        if not block_ids:
            return
        blocks = self._manager.block_pool.blocks
        self._free(owner[0], [blocks[block_id] for block_id in block_ids])
        if left:
            self._kept[owner] = left
        else:
            self._kept.pop(owner, None)

    def release_all_kept(self, owner: HoldOwner) -> int:
        """Release every hold ``owner`` kept, in the order taken (its session ended);
        how many."""
        held = self._kept.get(owner, [])
        if held:
            self.release_kept(owner, list(held))
        return len(held)

    def kept_by(self, owner: HoldOwner) -> list[int]:
        """The blocks ``owner``'s kept holds hold, in the order taken."""
        return list(self._kept.get(owner, ()))

    def kept_blocks(self) -> dict[str, set[int]]:
        """The blocks each tenant's kept holds hold (for the audit)."""
        blocks: dict[str, set[int]] = {}
        for (tenant, _), ids in self._kept.items():
            blocks.setdefault(tenant, set()).update(ids)
        return blocks

    def kept_per_owner(self) -> dict[HoldOwner, int]:
        """Holds kept per owner (for the audit: each owner must be a live session)."""
        return {owner: len(ids) for owner, ids in self._kept.items()}

    def num_kept(self) -> int:
        """Holds kept, every owner's."""
        return sum(len(ids) for ids in self._kept.values())

    def _release_retained(self) -> None:
        """Release the holds of copies now applied (runtime) or in answers on their way
        to the worker, which applies each answer's copies before the model writes and
        before it zeroes the blocks of a later answer; a released source may be reused
        from then on."""
        retained, self._retained = self._retained, []
        for owner, blocks in retained:
            self._free(owner, blocks)

    def _free(self, tenant: str, blocks: list[KVCacheBlock]) -> None:
        """Release the holds on ``blocks``, charged to ``tenant``."""
        pool = self._manager.block_pool
        free_before = pool.get_num_free_blocks()
        self._manager.free_retained_blocks(blocks)
        if self._tenants.counts(tenant):
            self._tenants.charge(tenant, free_before - pool.get_num_free_blocks())

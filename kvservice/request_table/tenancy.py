"""Tenants inside one pool: request keys, prefix-cache salts and block quotas.

Pure bookkeeping (no gRPC): the server's RPC layer authenticates the tenant and names
it on every call into the table. This is where limits per caller belong.

* Request ids are per tenant: the table and the core key a request by
  ``core_request_id(tenant, request_id)``, the id itself for the default tenant (a
  server without tokens keeps vLLM's ids byte for byte) and a ``TenantRequestId``,
  which no other tenant's id maps to, for a named one.
* Prefix caching is per tenant: the tenant goes into the cache salt, which vLLM mixes
  into the first block's hash only, so every later hash of the chain differs too.
* Blocks are counted per tenant. Since no cached block is ever shared across tenants,
  the blocks a tenant holds change by exactly the change in the pool's free count
  around that tenant's own allocate or free, which is how the ledger counts them.
* Requests are counted per tenant, and so are the tokens of its requests that are not
  running (waiting or preempted), their prompt embeddings and their multimodal items:
  none of these is held in blocks, so only these counts bound the memory they take
  (``RequestLedger``, against ``limits.RequestLimits``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from kvservice.core.errors import QuotaExceededError
from kvservice.core.invariants import InvariantViolationError
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus
from kvservice.request_table.errors import LimitExceededError
from kvservice.request_table.limits import mm_identifier_bytes
from kvservice.request_table.tenant_keys import SEPARATOR as _SEPARATOR
from kvservice.request_table.tenant_keys import TenantRequestId

DEFAULT_TENANT: Final = ""
# Separates the tenant from the request id in a core key; tenant names may not hold it.
_SALT_PREFIX: Final = "kvservice-tenant"


def check_tenant_name(name: str) -> None:
    """Raise ``ValueError`` for a name that cannot identify a tenant."""
    if not name:
        raise ValueError("a tenant name must not be empty (the default tenant is implicit)")
    if _SEPARATOR in name:
        raise ValueError(f"tenant name {name!r} must not contain a NUL character")


def core_request_id(tenant: str, request_id: str) -> str:
    """The key a tenant's request is stored under (see the module docstring)."""
    if tenant == DEFAULT_TENANT:
        return request_id
    return TenantRequestId(tenant, request_id)


def tenant_of(key: str) -> str:
    """The tenant whose request ``key`` is."""
    return key.tenant if isinstance(key, TenantRequestId) else DEFAULT_TENANT


def client_request_id(key: str) -> str:
    """The id the client knows the request ``key`` by."""
    return key.request_id if isinstance(key, TenantRequestId) else key


# The owner the core files the default tenant's pins under (the core needs a name; a
# named tenant's name holds no NUL, so none can spell this one).
_DEFAULT_PIN_OWNER = f"{_SEPARATOR}default"


def pin_owner(tenant: str) -> str:
    """The owner name the core files ``tenant``'s pins under."""
    return tenant or _DEFAULT_PIN_OWNER


def tenant_of_pin_owner(owner: str) -> str:
    """The tenant whose pins the core files under ``owner``."""
    return DEFAULT_TENANT if owner == _DEFAULT_PIN_OWNER else owner


def tenant_cache_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The salt that enters the first block's hash: the client's own for the default
    tenant (today's hashes, byte for byte); for a named tenant, the tenant and the
    client's salt length-prefixed, so no (tenant, salt) pair can spell another's."""
    if tenant == DEFAULT_TENANT:
        return cache_salt
    salt = cache_salt or ""
    return f"{_SALT_PREFIX}:{len(tenant)}:{tenant}:{len(salt)}:{salt}"


class TenantLedger:
    """Blocks each tenant holds, against its quota (tenants without one are unbounded).

    The default tenant is counted only when it has a quota: otherwise its count is
    what the named tenants do not hold (``blocks_per_tenant``), so a server without
    tenants does no ledger work on any call."""

    def __init__(self, quotas: Mapping[str, int] | None = None) -> None:
        self._quotas = dict(quotas or {})
        for tenant, quota in self._quotas.items():
            if quota < 0:
                raise ValueError(f"tenant {tenant!r}: max_blocks must be >= 0, got {quota}")
        self._held: dict[str, int] = {}
        self._counts_default = DEFAULT_TENANT in self._quotas

    def counts(self, tenant: str) -> bool:
        """Whether the ledger counts ``tenant``'s blocks (see the class docstring)."""
        return tenant != DEFAULT_TENANT or self._counts_default

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def has_quota(self, tenant: str) -> bool:
        return tenant in self._quotas

    def fits(self, tenant: str, num_blocks: int) -> bool:
        """Whether ``tenant`` may take ``num_blocks`` more (a negative count: fewer)."""
        quota = self._quotas.get(tenant)
        return quota is None or num_blocks <= 0 or self.held(tenant) + num_blocks <= quota

    def check(self, tenant: str, request_id: str, num_blocks: int) -> None:
        """Raise ``QuotaExceededError`` when taking ``num_blocks`` more would put
        ``tenant`` past its quota."""
        if not self.fits(tenant, num_blocks):
            held, quota = self.held(tenant), self._quotas[tenant]
            raise QuotaExceededError(
                f"request {request_id!r}: allocating {num_blocks} more blocks would take "
                f"tenant {tenant!r} to {held + num_blocks}, past its quota of {quota} "
                f"(max_blocks); free or preempt some of its requests first"
            )

    def release_all(self) -> None:
        """Every tenant now holds nothing (the prefix cache was reset with no block in
        use but the pins', which let go)."""
        self._held.clear()

    def charge(self, tenant: str, num_blocks: int) -> None:
        """Record that ``tenant`` now holds ``num_blocks`` more (negative: fewer)."""
        if num_blocks:
            self._held[tenant] = self._held.get(tenant, 0) + num_blocks

    def blocks_per_tenant(self, num_used_blocks: int) -> dict[str, int]:
        """Blocks held per tenant, given the pool's used blocks (a copy: safe to read
        from the metrics thread). An uncounted default tenant holds every used block
        no named tenant holds: each change of the pool's free count is some tenant's,
        and tenants share no block."""
        held = dict(self._held)
        if self._counts_default:
            return held
        default = num_used_blocks - sum(held.values())
        if default:
            held[DEFAULT_TENANT] = default
        return held


def check_tenant_blocks(
    manager: KVCacheManager,
    ledger: Mapping[str, int],
    copy_holds: Mapping[str, Iterable[int]] | None = None,
) -> None:
    """Raise ``InvariantViolationError`` unless each tenant's ``ledger`` count equals
    the distinct blocks its requests (and the copy holds its sessions keep,
    ``copy_holds``, and its pins) hold and no block is held by two tenants."""
    holders: dict[int, str] = {}

    def hold(block_id: int, owner: str) -> None:
        other = holders.setdefault(block_id, owner)
        if other != owner:
            raise InvariantViolationError(
                f"block {block_id} is held by tenants {other!r} and {owner!r}"
            )

    for single in manager.coordinator.single_type_managers:
        for key, blocks in single.req_to_blocks.items():
            owner = tenant_of(key)
            for block in blocks:
                if not block.is_null:
                    hold(block.block_id, owner)
    for owner, block_ids in (copy_holds or {}).items():
        for block_id in block_ids:
            hold(block_id, owner)
    retention = manager.retention_policy
    if retention is not None:
        for pin in retention.pins.values():
            for block in pin.held.values():
                hold(block.block_id, tenant_of_pin_owner(pin.tenant))
    counted: dict[str, int] = {}
    for owner in holders.values():
        counted[owner] = counted.get(owner, 0) + 1
    expected = {t: n for t, n in ledger.items() if n}
    if counted != expected:
        raise InvariantViolationError(
            f"blocks held per tenant {counted} do not match the quota ledger {expected}"
        )


def describe_tenant(tenant: str) -> str:
    """How a message names ``tenant``."""
    if tenant == DEFAULT_TENANT:
        return "the default tenant (every caller of a server without a tokens file)"
    return f"tenant {tenant!r}"


class RequestLedger:
    """Requests each tenant holds, the tokens of those not running, the bytes of
    prompt embeddings they keep and their multimodal items (count and identifier
    bytes), against ``max_requests``, ``max_waiting_tokens``,
    ``max_prompt_embeds_bytes``, ``max_mm_items`` and ``max_mm_identifier_bytes`` per
    tenant.

    The table tells it every change: a request added (waiting) or finished, a request
    starting to run or preempted, tokens appended to one that is not running. A
    preemption is never refused, so it may take a tenant past its waiting-token limit;
    it then adds nothing until it is back under."""

    def __init__(
        self,
        max_requests: int,
        max_waiting_tokens: int,
        max_prompt_embeds_bytes: int = 0,
        max_mm_items: int = 0,
        max_mm_identifier_bytes: int = 0,
    ) -> None:
        self.max_requests = max_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.max_prompt_embeds_bytes = max_prompt_embeds_bytes
        self.max_mm_items = max_mm_items
        self.max_mm_identifier_bytes = max_mm_identifier_bytes
        self._requests: dict[str, int] = {}
        self._waiting_tokens: dict[str, int] = {}
        self._embeds_bytes: dict[str, int] = {}
        self._mm_items: dict[str, int] = {}
        self._mm_bytes: dict[str, int] = {}

    def requests(self, tenant: str) -> int:
        return self._requests.get(tenant, 0)

    def waiting_tokens(self, tenant: str) -> int:
        return self._waiting_tokens.get(tenant, 0)

    def prompt_embeds_bytes(self, tenant: str) -> int:
        return self._embeds_bytes.get(tenant, 0)

    def mm_items(self, tenant: str) -> int:
        return self._mm_items.get(tenant, 0)

    def mm_identifier_bytes(self, tenant: str) -> int:
        return self._mm_bytes.get(tenant, 0)

    def check_add(
        self,
        tenant: str,
        request_id: str,
        num_tokens: int,
        embeds_bytes: int = 0,
        mm_items: int = 0,
        mm_bytes: int = 0,
    ) -> None:
        """Raise ``LimitExceededError`` unless ``tenant`` may add a waiting request of
        ``num_tokens`` tokens with ``embeds_bytes`` bytes of prompt embeddings and
        ``mm_items`` multimodal items whose identifiers take ``mm_bytes`` bytes."""
        held = self.requests(tenant)
        if held >= self.max_requests:
            raise LimitExceededError(
                "max_requests_per_tenant",
                f"request {request_id!r}: {describe_tenant(tenant)} already holds {held} "
                f"requests, as many as it may (max_requests_per_tenant "
                f"{self.max_requests}); finish some before adding more",
            )
        self.check_waiting(tenant, request_id, num_tokens)
        held = self.prompt_embeds_bytes(tenant)
        if embeds_bytes and held + embeds_bytes > self.max_prompt_embeds_bytes:
            raise LimitExceededError(
                "max_prompt_embeds_bytes_per_tenant",
                f"request {request_id!r}: {embeds_bytes} bytes of prompt embeddings would "
                f"take {describe_tenant(tenant)} to {held + embeds_bytes}, past its limit of "
                f"{self.max_prompt_embeds_bytes} (max_prompt_embeds_bytes_per_tenant); "
                f"finish requests with prompt embeddings first",
            )
        self.check_mm_items(tenant, request_id, mm_items)
        held = self.mm_identifier_bytes(tenant)
        if mm_bytes and held + mm_bytes > self.max_mm_identifier_bytes:
            raise LimitExceededError(
                "max_mm_identifier_bytes_per_tenant",
                f"request {request_id!r}: {mm_bytes} bytes of multimodal identifiers "
                f"would take {describe_tenant(tenant)} to {held + mm_bytes}, past its "
                f"limit of {self.max_mm_identifier_bytes} "
                f"(max_mm_identifier_bytes_per_tenant, --max-mm-identifier-bytes-per-tenant); "
                f"finish multimodal requests first",
            )

    def check_mm_items(self, tenant: str, request_id: str, mm_items: int) -> None:
        """Raise ``LimitExceededError`` unless ``tenant`` may hold ``mm_items`` more
        multimodal items (checked on the count alone, before the items are read)."""
        held = self.mm_items(tenant)
        if mm_items and held + mm_items > self.max_mm_items:
            raise LimitExceededError(
                "max_mm_items_per_tenant",
                f"request {request_id!r}: {mm_items} multimodal items would take "
                f"{describe_tenant(tenant)} to {held + mm_items}, past its limit of "
                f"{self.max_mm_items} (max_mm_items_per_tenant, --max-mm-items-per-tenant); "
                f"finish multimodal requests first",
            )

    def check_waiting(self, tenant: str, request_id: str, num_tokens: int) -> None:
        """Raise ``LimitExceededError`` unless ``tenant`` may have ``num_tokens`` more
        tokens waiting."""
        waiting = self.waiting_tokens(tenant)
        if waiting + num_tokens > self.max_waiting_tokens:
            raise LimitExceededError(
                "max_waiting_tokens_per_tenant",
                f"request {request_id!r}: {num_tokens} more waiting tokens would take "
                f"{describe_tenant(tenant)} to {waiting + num_tokens}, past its limit of "
                f"{self.max_waiting_tokens} (max_waiting_tokens_per_tenant); admit or "
                f"finish waiting requests first",
            )

    def added(
        self,
        tenant: str,
        num_tokens: int,
        embeds_bytes: int = 0,
        mm_items: int = 0,
        mm_bytes: int = 0,
    ) -> None:
        """A waiting request of ``num_tokens`` tokens (and ``embeds_bytes`` bytes of
        prompt embeddings, ``mm_items`` multimodal items of ``mm_bytes`` identifier
        bytes) was added."""
        self._requests[tenant] = self.requests(tenant) + 1
        self.waiting_changed(tenant, num_tokens)
        _add_count(self._embeds_bytes, tenant, embeds_bytes)
        _add_count(self._mm_items, tenant, mm_items)
        _add_count(self._mm_bytes, tenant, mm_bytes)

    def finished(
        self,
        tenant: str,
        num_waiting_tokens: int,
        embeds_bytes: int = 0,
        mm_items: int = 0,
        mm_bytes: int = 0,
    ) -> None:
        """A request was forgotten; ``num_waiting_tokens``: its tokens if it was not
        running, else 0; ``embeds_bytes``: its prompt embeddings; ``mm_items`` and
        ``mm_bytes``: its multimodal items and their identifiers' bytes."""
        left = self.requests(tenant) - 1
        if left:
            self._requests[tenant] = left
        else:
            self._requests.pop(tenant, None)
        self.waiting_changed(tenant, -num_waiting_tokens)
        _add_count(self._embeds_bytes, tenant, -embeds_bytes)
        _add_count(self._mm_items, tenant, -mm_items)
        _add_count(self._mm_bytes, tenant, -mm_bytes)

    def waiting_changed(self, tenant: str, num_tokens: int) -> None:
        """``tenant``'s waiting tokens changed by ``num_tokens`` (negative: fewer)."""
        _add_count(self._waiting_tokens, tenant, num_tokens)

    def per_tenant(self) -> dict[str, tuple[int, int]]:
        """(requests, waiting tokens) of every tenant holding a request (a copy: safe
        to read from the metrics thread)."""
        waiting = dict(self._waiting_tokens)
        return {t: (n, waiting.get(t, 0)) for t, n in list(self._requests.items())}

    def check(self, requests: Mapping[str, Request]) -> None:
        """Raise ``InvariantViolationError`` unless the counts are those of
        ``requests`` (by core key)."""
        expected: dict[str, tuple[int, int]] = {}
        embeds: dict[str, int] = {}
        items: dict[str, int] = {}
        item_bytes: dict[str, int] = {}
        for key, request in requests.items():
            tenant = tenant_of(key)
            count, waiting = expected.get(tenant, (0, 0))
            if request.status is not RequestStatus.RUNNING:
                waiting += request.num_tokens
            expected[tenant] = (count + 1, waiting)
            if request.prompt_embeds is not None:
                _add_count(embeds, tenant, len(request.prompt_embeds))
            _add_count(items, tenant, len(request.mm_features))
            _add_count(item_bytes, tenant, mm_identifier_bytes(request.mm_features))
        if expected != self.per_tenant():
            raise InvariantViolationError(
                f"requests and waiting tokens per tenant {expected} do not match the "
                f"request ledger {self.per_tenant()}"
            )
        if embeds != self._embeds_bytes:
            raise InvariantViolationError(
                f"prompt embeddings bytes per tenant {embeds} do not match the request "
                f"ledger {self._embeds_bytes}"
            )
        if items != self._mm_items or item_bytes != self._mm_bytes:
            raise InvariantViolationError(
                f"multimodal items (identifier bytes) per tenant {items} ({item_bytes}) do "
                f"not match the request ledger {self._mm_items} ({self._mm_bytes})"
            )


def _add_count(counts: dict[str, int], tenant: str, change: int) -> None:
    """Add ``change`` to ``tenant``'s count, dropping a count that reaches zero."""
    if change:
        total = counts.get(tenant, 0) + change
        if total:
            counts[tenant] = total
        else:
            counts.pop(tenant, None)

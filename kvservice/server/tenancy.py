"""Tenants inside one pool: request ids, prefix-cache salts and block quotas.

Pure bookkeeping (no gRPC): the allocator calls it with the tenant the RPC boundary
authenticated (``caller.current_caller().tenant``).

* Request ids are per tenant: the core keys its tables by one string, so a named
  tenant's request is stored under ``core_request_id(tenant, request_id)``, a key no
  other tenant's id maps to. The default tenant's ids are stored unchanged, so a
  server without tokens behaves (and hashes) exactly as before.
* Prefix caching is per tenant: the tenant goes into the cache salt, which vLLM mixes
  into the first block's hash only, so every later hash of the chain differs too.
* Blocks are counted per tenant. Since no cached block is ever shared across tenants,
  the blocks a tenant holds change by exactly the change in the pool's free count
  around that tenant's own allocate or free, which is how the ledger counts them.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvservice.core.errors import QuotaExceededError
from kvservice.server.caller import DEFAULT_TENANT

# Separates the tenant from the request id in a core key; tenant names may not hold it.
_SEPARATOR = "\x00"
_SALT_PREFIX = "kvservice-tenant"


def check_tenant_name(name: str) -> None:
    """Raise ``ValueError`` for a name that cannot identify a tenant."""
    if not name:
        raise ValueError("a tenant name must not be empty (the default tenant is implicit)")
    if _SEPARATOR in name:
        raise ValueError(f"tenant name {name!r} must not contain a NUL character")


def core_request_id(tenant: str, request_id: str) -> str:
    """The key the core stores a tenant's request under: the id itself for the default
    tenant; NUL, tenant, NUL, id for a named one (names hold no NUL, so two tenants
    never share a key)."""
    if tenant == DEFAULT_TENANT:
        return request_id
    return f"{_SEPARATOR}{tenant}{_SEPARATOR}{request_id}"


def tenant_cache_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The salt that enters the first block's hash: the client's own for the default
    tenant (today's hashes, byte for byte); for a named tenant, the tenant and the
    client's salt length-prefixed, so no (tenant, salt) pair can spell another's."""
    if tenant == DEFAULT_TENANT:
        return cache_salt
    salt = cache_salt or ""
    return f"{_SALT_PREFIX}:{len(tenant)}:{tenant}:{len(salt)}:{salt}"


class TenantLedger:
    """Blocks each tenant holds, against its quota (tenants without one are unbounded)."""

    def __init__(self, quotas: Mapping[str, int] | None = None) -> None:
        self._quotas = dict(quotas or {})
        for tenant, quota in self._quotas.items():
            if quota < 0:
                raise ValueError(f"tenant {tenant!r}: max_blocks must be >= 0, got {quota}")
        self._held: dict[str, int] = {}

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

    def charge(self, tenant: str, num_blocks: int) -> None:
        """Record that ``tenant`` now holds ``num_blocks`` more (negative: fewer)."""
        if num_blocks:
            self._held[tenant] = self._held.get(tenant, 0) + num_blocks

    def snapshot(self) -> dict[str, int]:
        """Blocks held per tenant that ever held one (a copy: safe to read from the
        metrics thread)."""
        return dict(self._held)

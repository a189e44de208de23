"""The key a named tenant's request is stored under in the core.

A module of its own, left a source: ``TenantRequestId`` subclasses ``str``, which mypyc
refuses for a native class ("Inheriting from most builtin types is unimplemented"), and
``tenancy``, which runs on every operation, is compiled.
"""

from __future__ import annotations

from typing import Final

# Separates the parts of a key (tenant names hold none).
SEPARATOR: Final = "\x00"


class TenantRequestId(str):
    """The key of a named tenant's request: NUL, tenant, NUL, id as a string (names
    hold no NUL, so two tenants never share a key), which the core stores the request
    under. It shows as the id the client knows (``repr``), so an error the core raises
    about the request names that id, and it carries its tenant and id."""

    tenant: str
    request_id: str

    def __new__(cls, tenant: str, request_id: str) -> TenantRequestId:
        key = super().__new__(cls, f"{SEPARATOR}{tenant}{SEPARATOR}{request_id}")
        key.tenant = tenant
        key.request_id = request_id
        return key

    def __repr__(self) -> str:
        return repr(self.request_id)

    def __reduce__(self) -> tuple[type[TenantRequestId], tuple[str, str]]:
        # copy and pickle rebuild it from its parts (str's own would pass the key).
        return TenantRequestId, (self.tenant, self.request_id)

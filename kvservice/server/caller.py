"""Who is calling: the identity the RPC boundary established for the current call.

The interceptors set it once per call (grpc.aio runs every call in its own task, so a
context variable is per call for free): authentication (``auth``) fills ``tenant``,
sessions (``sessions``) fill ``session_id`` and ``epoch``. The servicer reads it once
per call and names it on every call into the request table; nothing below the RPC
layer reads the context variable. Without authentication every caller is the default
tenant ``""``, and without a session every request is unowned: the server then
behaves exactly as a single-tenant, sessionless one.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from kvservice.request_table.tenancy import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated tenant and, when the client opened one, its session.
    ``admin``: whether it may see and act on the whole pool (any caller of a server
    without a tokens file, where there is one tenant; an admin tenant otherwise)."""

    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    epoch: int | None = None
    admin: bool = True


# Frozen, so one shared default is safe.
ANONYMOUS = Caller()
CURRENT_CALLER: ContextVar[Caller] = ContextVar("kvservice_caller", default=ANONYMOUS)


def current_caller() -> Caller:
    """The caller of the RPC running in this task (the default caller outside one)."""
    return CURRENT_CALLER.get()

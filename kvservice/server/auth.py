"""Bearer tokens, tenants and rate limits at the RPC boundary.

A tokens file (``auth_tokens_file``, TOML) binds each token to a tenant::

    [tenants.team-a]
    tokens = ["...at least 16 characters..."]  # one or more; rotate by listing two
    max_blocks = 512        # optional: blocks the tenant may hold at once
    rate_limit = 200.0      # optional: calls (and stream messages) per second
    burst = 400             # optional: calls allowed at once (default: rate_limit, >= 1)
    admin = false           # optional: may call the pool-wide ResetPrefixCache,
                            # SubscribeEvents (whose events carry every tenant's hashes)
                            # and Audit (whose report may name any tenant's requests)
    trust_client_block_hashes = false  # optional: may send client_hashed requests,
                            # whose block hashes the server takes instead of hashing
                            # (in a namespace of the tenant's own: request_table.
                            # client_hashes)

``AuthInterceptor`` runs before every other interceptor: it refuses a call without a
valid ``authorization: Bearer <token>`` with UNAUTHENTICATED (never echoing what was
sent), a non-admin's pool-wide call with PERMISSION_DENIED, and a call over the
tenant's rate with RESOURCE_EXHAUSTED plus a retry hint; a refused call reaches no
later interceptor and no servicer, so it changes nothing. A stream's messages count
against the rate too, but a message over it waits for its turn: the stream is slowed,
not ended. Otherwise it records the
tenant in ``caller.CURRENT_CALLER`` for everything after it. Health checks stay open
so that probes work without a token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import math
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from google.protobuf import descriptor_pool

from kvservice.protocol import AUTHORIZATION_KEY, RETRY_AFTER_KEY
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from kvservice.request_table.tenancy import check_tenant_name
from kvservice.server.caller import CURRENT_CALLER
from kvservice.server.log import LineBudget, clip
from kvservice.server.tls import SecurityConfigError

log = structlog.get_logger("kvservice.auth")

MIN_TOKEN_LENGTH = 16
# Calls that need no token: kubelet and load balancer probes carry none.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
# Pool-wide calls that touch or reveal every tenant's cache: for admin tenants only.
_SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name
ADMIN_METHODS = frozenset(
    f"/{_SERVICE}/{m}" for m in ("ResetPrefixCache", "SubscribeEvents", "Audit")
)
_TENANT_KEYS = frozenset(
    {"tokens", "max_blocks", "rate_limit", "burst", "admin", "trust_client_block_hashes"}
)
_EXPECTED = f"send metadata '{AUTHORIZATION_KEY}: Bearer <token>'"

# Told (tenant, reason) of every refused call; tenant "" when none was established.
RefusalSink = Callable[[str, str], None]
# Told (tenant, seconds) of every wait of a stream message held back to the rate.
DelaySink = Callable[[str, float], None]


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What one tenant may do."""

    name: str
    max_blocks: int | None = None
    rate_limit: float | None = None
    burst: int | None = None
    admin: bool = False
    trust_client_block_hashes: bool = False


class TokenTable:
    """Tokens to tenants. Only SHA-256 digests of the tokens are kept, and a lookup
    compares the digest with every entry in constant time (``hmac.compare_digest``),
    so neither the answer's timing nor a memory dump gives a token away."""

    def __init__(self, tenants: Mapping[str, TenantPolicy], tokens: Mapping[str, str]) -> None:
        self.tenants = dict(tenants)
        self._digests = tuple((_digest(token), tenant) for token, tenant in tokens.items())

    def authenticate(self, token: str) -> TenantPolicy | None:
        """The tenant ``token`` belongs to, or None."""
        presented = _digest(token)
        found: str | None = None
        for digest, tenant in self._digests:
            # No early exit: every entry is compared whatever matched.
            if hmac.compare_digest(presented, digest):
                found = tenant
        return self.tenants[found] if found is not None else None

    @property
    def quotas(self) -> dict[str, int]:
        """``max_blocks`` of every tenant that has one."""
        return {n: p.max_blocks for n, p in self.tenants.items() if p.max_blocks is not None}

    @property
    def trusted_hash_tenants(self) -> frozenset[str]:
        """The tenants whose block hashes the server takes (``client_hashes``)."""
        return frozenset(n for n, p in self.tenants.items() if p.trust_client_block_hashes)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def load_tokens_file(path: str) -> TokenTable:
    """Read and check a tokens file; ``SecurityConfigError`` names the problem (the
    key and tenant, never a token's value)."""
    try:
        with Path(path).open("rb") as f:
            document = tomllib.load(f)
    except OSError as err:
        raise SecurityConfigError(f"auth_tokens_file {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise SecurityConfigError(f"auth_tokens_file {path}: {err}") from None
    return parse_tokens(document, f"auth_tokens_file {path}")


def parse_tokens(document: Mapping[str, Any], where: str) -> TokenTable:
    """A ``TokenTable`` from the parsed TOML ``document``."""
    unknown = set(document) - {"tenants"}
    if unknown:
        raise SecurityConfigError(f"{where}: unknown keys {sorted(unknown)} (expected [tenants.*])")
    tables = document.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise SecurityConfigError(f"{where}: no tenants; add a [tenants.NAME] table with tokens")
    tenants: dict[str, TenantPolicy] = {}
    owners: dict[str, str] = {}
    for name, table in tables.items():
        policy, tokens = _parse_tenant(name, table, f"{where}: tenant {name!r}")
        tenants[name] = policy
        for index, token in enumerate(tokens):
            other = owners.setdefault(token, name)
            if other != name or tokens.index(token) != index:
                raise SecurityConfigError(
                    f"{where}: tenant {name!r}: tokens[{index}] is also a token of tenant "
                    f"{other!r}; every token must be unique"
                )
    return TokenTable(tenants, owners)


def _parse_tenant(name: str, table: Any, where: str) -> tuple[TenantPolicy, list[str]]:
    try:
        check_tenant_name(name)
    except ValueError as err:
        raise SecurityConfigError(f"{where}: {err}") from None
    if not isinstance(table, dict):
        raise SecurityConfigError(f"{where}: expected a table, got {type(table).__name__}")
    unknown = set(table) - _TENANT_KEYS
    if unknown:
        raise SecurityConfigError(
            f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(sorted(_TENANT_KEYS))})"
        )
    tokens = _tokens(table.get("tokens"), where)
    max_blocks = _optional(table, "max_blocks", int, where, minimum=0)
    rate_limit = _optional(table, "rate_limit", float, where, minimum=0, exclusive=True)
    burst = _optional(table, "burst", int, where, minimum=1)
    if burst is not None and rate_limit is None:
        raise SecurityConfigError(f"{where}: burst needs rate_limit")
    admin = _flag(table, "admin", where)
    trusted = _flag(table, "trust_client_block_hashes", where)
    return TenantPolicy(name, max_blocks, rate_limit, burst, admin, trusted), tokens


def _flag(table: Mapping[str, Any], key: str, where: str) -> bool:
    value = table.get(key, False)
    if type(value) is not bool:
        raise SecurityConfigError(f"{where}: {key} must be true or false, got {value!r}")
    return bool(value)


def _tokens(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise SecurityConfigError(f"{where}: tokens must be a non-empty list of strings")
    for index, token in enumerate(value):
        if not isinstance(token, str):
            raise SecurityConfigError(f"{where}: tokens[{index}] must be a string")
        if len(token) < MIN_TOKEN_LENGTH or token != token.strip() or " " in token:
            raise SecurityConfigError(
                f"{where}: tokens[{index}] must be at least {MIN_TOKEN_LENGTH} characters "
                f"with no spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
            )
    return list(value)


def _optional(
    table: Mapping[str, Any],
    key: str,
    kind: type,
    where: str,
    minimum: float,
    exclusive: bool = False,
) -> Any:
    value: Any = table.get(key)
    if value is None:
        return None
    if kind is float and type(value) is int:
        value = float(value)
    bound = f"> {minimum}" if exclusive else f">= {minimum}"
    problem = SecurityConfigError(
        f"{where}: {key} must be a {kind.__name__} {bound}, got {value!r}"
    )
    # The isinstance narrows for mypy; type() also refuses a bool where an int is due.
    if type(value) is not kind or not isinstance(value, int | float):
        raise problem
    if value <= minimum if exclusive else value < minimum:
        raise problem
    return value


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; one per call."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def take(self) -> float:
        """Take a token: 0.0 when granted, else the seconds until one is available
        (nothing is taken then)."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate


@dataclass(frozen=True, slots=True)
class _Refusal:
    code: grpc.StatusCode
    reason: str
    message: str
    trailers: tuple[tuple[str, str], ...] = ()


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Authenticates every call but the health checks, sets the caller's tenant, and
    enforces admin-only methods and per-tenant rate limits."""

    def __init__(
        self,
        tokens: TokenTable,
        on_refusal: RefusalSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_delay: DelaySink | None = None,
    ) -> None:
        self._tokens = tokens
        self._on_refusal = on_refusal
        self._on_delay = on_delay
        # Refusals are counted in the metrics; their lines are kept to a budget.
        self._lines = LineBudget()
        self._buckets = {
            name: TokenBucket(p.rate_limit, p.burst or max(1, math.ceil(p.rate_limit)), clock)
            for name, p in tokens.tenants.items()
            if p.rate_limit is not None
        }

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        method: str = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        policy, refusal = self._admit(method, handler_call_details.invocation_metadata)
        if refusal is not None:
            tenant = policy.name if policy is not None else ""
            if self._on_refusal is not None:
                self._on_refusal(tenant, refusal.reason)
            return _refusing_handler(method, refusal, tenant, self._lines)
        assert policy is not None
        # Same task as the handler: grpc.aio awaits the interceptors, then the handler.
        CURRENT_CALLER.set(
            dataclasses.replace(CURRENT_CALLER.get(), tenant=policy.name, admin=policy.admin)
        )
        handler = await continuation(handler_call_details)
        bucket = self._buckets.get(policy.name)
        if handler is None or bucket is None or handler.stream_stream is None:
            return handler
        return grpc.stream_stream_rpc_method_handler(
            self._metered(handler.stream_stream, policy, bucket),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _admit(self, method: str, metadata: Any) -> tuple[TenantPolicy | None, _Refusal | None]:
        token, problem = _bearer_token(metadata)
        if token is None:
            return None, _Refusal(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", problem)
        policy = self._tokens.authenticate(token)
        if policy is None:
            message = f"the bearer token is not valid for this server; {_EXPECTED}"
            return None, _Refusal(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", message)
        if method in ADMIN_METHODS and not policy.admin:
            message = (
                f"tenant {policy.name!r} may not call {method}: it acts on every tenant's "
                f"cache (set admin = true for the tenant in the tokens file)"
            )
            return policy, _Refusal(grpc.StatusCode.PERMISSION_DENIED, "permission_denied", message)
        bucket = self._buckets.get(policy.name)
        wait = bucket.take() if bucket is not None else 0.0
        if wait:
            return policy, _rate_refusal(policy, wait)
        return policy, None

    def _metered(self, behavior: Any, policy: TenantPolicy, bucket: TokenBucket) -> Any:
        """A stream handler whose every inbound message takes a token, so a stream is
        no way around the rate limit. Over it, the message waits for its token: the
        stream is slowed to the rate, never ended (a scheduler's session is worth
        keeping), and the client's later messages wait in gRPC's flow control."""
        on_delay = self._on_delay

        async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async def charged() -> AsyncIterator[Any]:
                async for message in requests:
                    wait = bucket.take()
                    while wait:
                        if on_delay is not None:
                            on_delay(policy.name, wait)
                        await asyncio.sleep(wait)
                        wait = bucket.take()  # other calls of the tenant may have won
                    yield message

            async for response in behavior(charged(), context):
                yield response

        return stream


def _bearer_token(metadata: Any) -> tuple[str | None, str]:
    """(the token, "") or (None, why there is none)."""
    values = [v for k, v in metadata or () if k == AUTHORIZATION_KEY]
    if not values:
        return None, f"no credentials: {_EXPECTED}"
    if len(values) > 1:
        return None, f"{len(values)} authorization values sent; {_EXPECTED} once"
    scheme, _, token = str(values[0]).partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None, f"authorization metadata is not a bearer token; {_EXPECTED}"
    return token.strip(), ""


def _rate_refusal(policy: TenantPolicy, wait: float) -> _Refusal:
    retry_ms = max(1, math.ceil(wait * 1000))
    message = (
        f"tenant {policy.name!r} is over its rate limit of {policy.rate_limit:g} calls/s; "
        f"retry in {retry_ms} ms ({RETRY_AFTER_KEY} trailer)"
    )
    return _Refusal(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "rate_limited",
        message,
        ((RETRY_AFTER_KEY, str(retry_ms)),),
    )


def _refusing_handler(method: str, refusal: _Refusal, tenant: str, lines: LineBudget) -> Any:
    """A handler of the method's own kind that logs the refusal, with the caller's
    address (only the call's context knows it), and aborts: built without calling the
    next interceptor, so nothing after this one sees a refused call."""

    async def refuse(request: Any, context: Any) -> None:
        try:
            await context.abort(refusal.code, refusal.message, refusal.trailers)
        finally:
            # Once the status is on its way: a stream's client may still be writing
            # its first message, and an abort that comes late turns its write into an
            # INTERNAL error instead of the refusal.
            lines.info(
                log,
                "rpc refused",
                refusal.reason,
                method=clip(method),
                tenant=tenant,
                reason=refusal.reason,
                peer=clip(context.peer() or "-"),
            )

    client_streaming, server_streaming = _streaming(method)
    if client_streaming and server_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if client_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if server_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def _streaming(method: str) -> tuple[bool, bool]:
    """(client streaming, server streaming) of ``/package.Service/Method`` from the
    descriptors the generated modules registered; unary for an unknown method."""
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        descriptor = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    except KeyError:
        return False, False
    if descriptor is None:
        return False, False
    return bool(descriptor.client_streaming), bool(descriptor.server_streaming)

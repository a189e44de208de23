"""Client sessions: leases that own requests, and the scheduler epoch that fences them.

A client opens a session (``OpenSession``) with a TTL and sends its id as the
``x-kvservice-session`` metadata of every later call; each such call renews the lease,
as ``KeepAlive`` does, and an open ``StepStream`` holds it for as long as the stream
lives. Every request added under a session is owned by it. When the lease runs out
(the reaper, ``SessionReaper``, finds it) or a stream opened under it breaks (the
client vanished mid-stream), the session ends and every request it owns is freed with
FINISH, so no block outlives its owner's lease.

Ending a session is an operation of the table's turn (``turns``), wherever the end
comes from: ``CloseSession`` waits for the turn; the reaper, a broken stream, or a
lease found run out by a call ends the session at once (no call is served under it
from then on) and frees what it owns in the turn (``TableTurn.defer``): at once when
the table is free, else as soon as the Step holding the turn gives it back. That Step,
if it runs under the ended session, re-checks its session after each pause and stops
(``StepRunner``), so everything the session owned, what the Step added included, is
freed, and nothing is left ownerless.

A session may own thousands of requests (16,384 at the default per-tenant limit:
about 0.1 s of frees), so its end (``SessionEnd``) frees them a slice at a time
(``turns.SLICE_S``), pausing between slices with the table's turn held, as a Step
does. Why no call can observe or touch a half-ended session's requests in a way that
breaks an invariant:

* From the moment its end is decided, the session is ``ended``: every call under it
  is refused (``_get``), so nothing adds a request to it or allocates for it any more,
  and a Step under it stops at its next pause. The end is recorded in ``_ending`` at
  that same moment, and its requests stay owned by it until each is freed.
* The frees run only in the table's turn, and the turn is held from the first slice
  to the last (a ``Resumable``: the pauses do not give it back), so no call that
  touches the table (none but the end's own frees) runs between two slices: a call
  waiting for the turn, an audit, the reaper's next tick, another session's end all
  come after the last free. Calls that run during the pauses do not touch the table
  (health checks, KeepAlive, OpenSession, GetCacheConfig, metrics scrapes: the
  gauges may show the pool part-way, as during a Step).
* Before its first slice (deferred behind a Step that holds the turn) the session's
  requests are in the table like any of its tenant's: another caller of the tenant
  could free one (the end then skips it: it frees only the requests still recorded as
  the session's) or allocate for one (the end frees that too). Nothing can make the
  session own a request again once it is ended, so the snapshot taken at the first
  slice is all it will ever own.
* A session whose end is decided but not finished counts as live for the audit (its
  requests have an owner whose end will free them), as long as it is in ``_ending``;
  one ended and gone, or ended with no end in progress (a bug), is reported.
* It counts against ``max_sessions_per_tenant`` until its last free: an OpenSession
  during its pauses may be refused, never let past the limit.

Fencing: each session carries its scheduler's epoch; the highest epoch a tenant has
opened is current, and a call under an older one is refused FAILED_PRECONDITION, so a
restarted scheduler (which opens with a higher epoch) cannot be confused with its
stale predecessor. The stale session is not ended by the refusal: it cannot renew
either, so its lease runs out and its requests are freed like any other.

Epochs are kept per tenant: with authentication, one tenant's scheduler must not be
able to fence another's. Without it there is one tenant, hence one epoch per pool.

Bounds: the sessions open and the StepStreams open at once are limited per tenant and
in all (``SessionPolicy``; ``--max-sessions-per-tenant``, ``--max-sessions``,
``--max-step-streams-per-tenant``, ``--max-step-streams``). A call past one is refused
RESOURCE_EXHAUSTED naming the limit and its flag, changes nothing (no lease renewed,
no epoch raised) and is counted in ``kvservice_refusals_total``. The reaper's cost
does not grow with the idle sessions: leases wait in a heap of expiry times, each
live session without an open stream in it once, and a tick looks only at the
entries that are due. A renewal does not touch the heap; an entry found due for a
renewed session is pushed back with its new expiry (lazy deletion), one for a
session ended or streaming is dropped.

``SessionLayer`` resolves the metadata at the RPC boundary and fills
``session_id`` and ``epoch`` of the call's ``Caller``; no servicer method reads the
metadata itself. Like the request table, nothing here is thread safe: it all runs on
the server's loop, and no method awaits while it changes state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from kvservice.core.errors import (
    InvalidArgumentError,
    KVCacheError,
    RequestNotFoundError,
)
from kvservice.protocol import MUTATING_METHODS, SESSION_KEY
from kvservice.request_table.errors import LimitExceededError
from kvservice.request_table.table import RequestTable
from kvservice.request_table.tenancy import describe_tenant
from kvservice.request_table.types import FreeMode
from kvservice.server import background
from kvservice.server.caller import CURRENT_CALLER, current_caller
from kvservice.server.config import ServerConfig
from kvservice.server.log import LineBudget
from kvservice.server.metrics import KVCacheMetrics
from kvservice.server.turns import WHOLE, Resumable, Slices, TableTurn

log = structlog.get_logger("kvservice.sessions")

# Methods that take the session in their message and manage it themselves.
SESSION_METHODS = frozenset({"OpenSession", "KeepAlive", "CloseSession"})
# Ended sessions remembered, so a late call learns why its session is gone.
ENDED_SESSIONS_KEPT = 10_000
MAX_CLIENT_NAME_LENGTH = 256
# How long a stream that ended waits for a cancellation before counting as closed
# cleanly (a cancellation missed by this only delays the reclaim to the lease's end).
STREAM_CLOSE_GRACE_S = 0.1


_COUNT_LIMITS = (
    "max_sessions_per_tenant",
    "max_sessions",
    "max_step_streams_per_tenant",
    "max_step_streams",
)


class SessionNotFoundError(KVCacheError):
    """The session id was never opened here (or belongs to another tenant)."""

    status = "NOT_FOUND"


class SessionEndedError(KVCacheError):
    """The session expired, broke or was closed; the client must open a new one."""

    status = "FAILED_PRECONDITION"


class StaleEpochError(KVCacheError):
    """A newer scheduler epoch has taken over the pool."""

    status = "FAILED_PRECONDITION"


class SessionRequiredError(KVCacheError):
    """A mutating call without a session on a server run with ``require_sessions``."""

    status = "FAILED_PRECONDITION"


@dataclass(frozen=True, slots=True)
class SessionPolicy:
    """The lease bounds, whether sessions are mandatory, and how many sessions and
    StepStreams may be open, per tenant and in all (``ServerConfig``'s defaults)."""

    ttl_min_s: float = 1.0
    ttl_max_s: float = 3600.0
    ttl_default_s: float = 30.0
    require_sessions: bool = False
    max_sessions_per_tenant: int = 1024
    max_sessions: int = 65_536
    max_step_streams_per_tenant: int = 256
    max_step_streams: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.ttl_min_s <= self.ttl_default_s <= self.ttl_max_s < math.inf:
            raise InvalidArgumentError(
                f"session TTLs must satisfy 0 < session_ttl_min ({self.ttl_min_s}) <= "
                f"session_ttl_default ({self.ttl_default_s}) <= session_ttl_max "
                f"({self.ttl_max_s}) < inf"
            )
        for name in _COUNT_LIMITS:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def of(cls, config: ServerConfig) -> SessionPolicy:
        return cls(
            config.session_ttl_min_s,
            config.session_ttl_max_s,
            config.session_ttl_default_s,
            config.require_sessions,
            config.max_sessions_per_tenant,
            config.max_sessions,
            config.max_step_streams_per_tenant,
            config.max_step_streams,
        )

    def ttl(self, requested: float) -> float:
        """The lease to grant for ``requested`` seconds (0: the default)."""
        if requested == 0:
            return self.ttl_default_s
        if not self.ttl_min_s <= requested <= self.ttl_max_s:  # NaN fails this too
            raise InvalidArgumentError(
                f"ttl_seconds must be 0 (the server's default, {self.ttl_default_s}) or "
                f"within [{self.ttl_min_s}, {self.ttl_max_s}] seconds, got {requested}"
            )
        return requested


@dataclass(slots=True, eq=False)
class Session:
    """One client's lease and the requests it owns."""

    session_id: str
    tenant: str
    client_name: str
    epoch: int
    ttl_s: float
    # On the registry's monotonic clock.
    expires_at: float
    requests: set[str] = field(default_factory=set)
    # StepStreams open under the session: while one is, the lease cannot run out.
    open_streams: int = 0
    # Why it ended, from the moment its end is decided; its requests are freed in the
    # table's turn, at once or as the Step holding it gives it back. None while live.
    ended: str | None = None
    # Whether the registry's expiry heap holds an entry for it (at most one).
    queued: bool = False


@dataclass(frozen=True, slots=True)
class Lease:
    """What OpenSession and KeepAlive answer."""

    session: Session
    # Unix time (seconds) at which the lease runs out unless renewed.
    expires_at_unix: float


class SessionEnd(Resumable):
    """One session's end, in the table's turn, a slice at a time: its copy holds
    released, every request it still owns freed (FINISH), then the session forgotten
    (see the module docstring). Called as deferred work it runs its first slice and
    answers itself when there is more (``TableTurn`` then holds the turn on)."""

    __slots__ = ("_pending", "_registry", "num_freed", "reason", "session", "why")

    def __init__(self, registry: SessionRegistry, session: Session, why: str, reason: str) -> None:
        self._registry = registry
        self.session = session
        self.why = why
        # The metrics' reason: client, ttl or stream_broken.
        self.reason = reason
        # The requests left to free, last first; None before the first slice.
        self._pending: list[str] | None = None
        self.num_freed = 0

    def __call__(self) -> SessionEnd | None:
        return None if self.resume(Slices()) else self

    def resume(self, slices: Slices) -> bool:
        return self._registry._end_slice(self, slices)


class SessionRegistry:
    """The open sessions of one pool, who owns which request, and the epochs.

    It is the request table's ``RequestOwnership``: a request added under a session
    is owned by that session until it is finished.
    """

    def __init__(
        self,
        table: RequestTable,
        policy: SessionPolicy,
        metrics: KVCacheMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        turn: TableTurn | None = None,
    ) -> None:
        self.policy = policy
        self._table = table
        # The table's turn: a session's end frees its requests in it.
        self._turn = turn or TableTurn()
        self._metrics = metrics
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        # (tenant, request id) -> the owning session's id.
        self._owners: dict[tuple[str, str], str] = {}
        self._epochs: dict[str, int] = {}
        # Ended sessions: id -> (tenant, why it ended).
        self._ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # Sessions in ``_sessions`` per tenant (``max_sessions_per_tenant``).
        self._sessions_per_tenant: dict[str, int] = {}
        # Leases by expiry (see the module docstring): (expiry when pushed, tie
        # breaker, session). An entry may be older than its session's lease.
        self._expiries: list[tuple[float, int, Session]] = []
        self._tie = itertools.count()
        # Heap entries the reaper has looked at, in all (what a tick costs).
        self.num_inspected = 0
        # StepStreams open, per tenant and in all (``max_step_streams*``).
        self._streams_per_tenant: dict[str, int] = {}
        self._num_streams = 0
        # Sessions whose end is decided and not finished (see the module docstring).
        self._ending: dict[str, SessionEnd] = {}
        # Session churn is logged within a budget; the metrics count every one.
        self._lines = LineBudget()
        # Called with a session's id once it is gone (what else it owned: its offload
        # tier's index).
        self.end_listeners: list[Callable[[str], None]] = []
        table.ownership = self

    # -- the RPCs ------------------------------------------------------------------------

    def open(self, tenant: str, ttl_seconds: float, client_name: str, epoch: int) -> Lease:
        """A new session of ``tenant``; its epoch becomes current if it is the highest.
        INVALID_ARGUMENT for a bad TTL, name or epoch; FAILED_PRECONDITION (nothing
        opened) for an epoch older than the current one; RESOURCE_EXHAUSTED (nothing
        opened, the epoch unchanged) past ``max_sessions_per_tenant`` or
        ``max_sessions``."""
        ttl = self.policy.ttl(ttl_seconds)
        if len(client_name) > MAX_CLIENT_NAME_LENGTH:
            raise InvalidArgumentError(
                f"client_name is {len(client_name)} characters; at most "
                f"{MAX_CLIENT_NAME_LENGTH} are accepted"
            )
        if epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0, got {epoch}")
        current = self.current_epoch(tenant)
        if epoch < current:
            raise StaleEpochError(
                f"epoch {epoch} is older than the pool's current epoch {current}: a newer "
                f"scheduler has taken over; open the session with epoch >= {current}"
            )
        self._check_session_limits(tenant)
        self._epochs[tenant] = epoch
        session = Session(
            secrets.token_urlsafe(16), tenant, client_name, epoch, ttl, self._clock() + ttl
        )
        self._sessions[session.session_id] = session
        self._sessions_per_tenant[tenant] = self._sessions_per_tenant.get(tenant, 0) + 1
        self._queue(session)
        self._record_active()
        if self._metrics is not None:
            self._metrics.sessions_opened.inc()
        self._lines.info(
            log,
            "session opened",
            tenant,
            session_id=session.session_id,
            client_name=client_name,
            epoch=epoch,
            ttl_s=ttl,
            tenant=tenant or "-",
        )
        return self._lease(session)

    def keep_alive(self, session_id: str, tenant: str) -> Lease:
        """Renew the lease (``resolve``'s checks and errors)."""
        return self._lease(self.resolve(session_id, tenant))

    def begin_close(self, session_id: str, tenant: str, free_requests: bool) -> SessionEnd:
        """End the session (``CloseSession``); with ``free_requests`` its end frees
        what it owns (else the requests stay, unowned). Allowed under a superseded
        epoch, so a stale scheduler can still clean up. The caller holds the table's
        turn and runs the end (``resume``) until it is done; ``num_freed`` then says
        how many requests it freed. NOT_FOUND, FAILED_PRECONDITION (already ended) as
        ``resolve``."""
        session = self._get(session_id, tenant)
        if not free_requests:
            for rid in session.requests:
                del self._owners[(tenant, rid)]
            session.requests.clear()
        return self._begin_end(session, "closed by the client", "client")

    def close(self, session_id: str, tenant: str, free_requests: bool) -> int:
        """``begin_close`` run whole (its caller holds the table's turn and does not
        mind the loop held meanwhile: tests and tools); the requests freed."""
        end = self.begin_close(session_id, tenant, free_requests)
        while not end.resume(WHOLE):
            pass
        return end.num_freed

    def resolve(self, session_id: str, tenant: str) -> Session:
        """The caller's live session, its lease renewed. NOT_FOUND for an id never
        opened by this tenant; FAILED_PRECONDITION for one that ended (an expired
        lease is ended here if the reaper has not got to it yet) or whose epoch is
        older than the current one (the lease is then not renewed)."""
        session = self._get(session_id, tenant)
        now = self._clock()
        if not session.open_streams and session.expires_at <= now:
            self._expire(session, "ttl")  # freed in the table's turn
            raise self._ended_error(session_id)
        current = self.current_epoch(tenant)
        if session.epoch < current:
            raise StaleEpochError(
                f"session {session_id!r} has epoch {session.epoch}, older than the pool's "
                f"current epoch {current}: a newer scheduler has taken over; this client "
                f"must stop (or open a new session with epoch >= {current})"
            )
        session.expires_at = now + session.ttl_s
        return session

    def check_live(self, session_id: str, tenant: str) -> None:
        """Raise unless the session is live: ``resolve``'s errors for an unknown or
        ended one, without renewing the lease (a Step re-checks its session with this
        after each pause, and a call after waiting for the table's turn)."""
        self._get(session_id, tenant)

    def current_epoch(self, tenant: str) -> int:
        """The highest epoch ``tenant`` has opened a session with (0 before any)."""
        return self._epochs.get(tenant, 0)

    # -- streams and the reaper ----------------------------------------------------------

    def stream_opened(self, session: Session) -> None:
        session.open_streams += 1

    def stream_closed(self, session: Session, broken: bool) -> None:
        """A stream under ``session`` ended: a broken one ends the session at once
        (its client is gone; what it owns is freed in the table's turn), a clean one
        restarts the lease from now."""
        session.open_streams -= 1
        if self._sessions.get(session.session_id) is not session or session.ended:
            return  # ended meanwhile (closed, or another of its streams broke)
        if broken:
            self._expire(session, "stream_broken")
        else:
            session.expires_at = self._clock() + session.ttl_s
            self._queue(session)

    def reap(self) -> int:
        """End every session whose lease has run out; returns how many. Looks only at
        the heap entries that are due: an idle session costs nothing until its lease
        may have run out."""
        now = self._clock()
        expiries = self._expiries
        ended = 0
        while expiries and expiries[0][0] <= now:
            session = heapq.heappop(expiries)[2]
            self.num_inspected += 1
            session.queued = False
            if (
                session.ended is not None
                or session.open_streams
                or self._sessions.get(session.session_id) is not session
            ):
                continue  # ended, or held by a stream (its close queues it again)
            if session.expires_at > now:
                self._queue(session)  # renewed since it was queued
                continue
            self._expire(session, "ttl")
            ended += 1
        return ended

    def next_expiry_in(self) -> float | None:
        """Seconds until the earliest heap entry is due (None with none): no later
        than the earliest lease runs out, maybe earlier (an entry older than its
        lease, or a session's that has ended or streams)."""
        if not self._expiries:
            return None
        return max(0.0, self._expiries[0][0] - self._clock())

    @property
    def num_queued(self) -> int:
        """Entries in the expiry heap (one per live session without a stream, and
        ones not yet found stale)."""
        return len(self._expiries)

    def stream_started(self, tenant: str) -> None:
        """Count a StepStream of ``tenant`` opening; RESOURCE_EXHAUSTED (nothing
        counted) past ``max_step_streams_per_tenant`` or ``max_step_streams``.
        ``stream_finished`` must follow once it ends."""
        held = self._streams_per_tenant.get(tenant, 0)
        self._check_open(
            tenant,
            "StepStreams",
            "max_step_streams",
            held,
            self._num_streams,
            "close one before opening another",
        )
        self._streams_per_tenant[tenant] = held + 1
        self._num_streams += 1

    def stream_finished(self, tenant: str) -> None:
        """A StepStream counted by ``stream_started`` ended."""
        self._num_streams -= 1
        left = self._streams_per_tenant.get(tenant, 0) - 1
        if left > 0:
            self._streams_per_tenant[tenant] = left
        else:
            self._streams_per_tenant.pop(tenant, None)

    def num_streams(self, tenant: str | None = None) -> int:
        """StepStreams open: of ``tenant``, or in all."""
        if tenant is None:
            return self._num_streams
        return self._streams_per_tenant.get(tenant, 0)

    def num_sessions_of(self, tenant: str) -> int:
        """Sessions of ``tenant`` open (ended ones whose requests are still being
        freed included)."""
        return self._sessions_per_tenant.get(tenant, 0)

    # -- RequestOwnership ----------------------------------------------------------------

    def adopt(self, tenant: str, request_id: str, session_id: str) -> None:
        # Recorded even for a session gone meanwhile (a bug: every call re-checks its
        # session in the table's turn), so the audit reports the ownerless request
        # instead of it passing for an unowned one. A session whose end is pending
        # frees it with the rest.
        self._owners[(tenant, request_id)] = session_id
        session = self._sessions.get(session_id)
        if session is not None:
            session.requests.add(request_id)

    def release(self, tenant: str, request_id: str) -> None:
        owner = self._owners.pop((tenant, request_id), None)
        if owner is not None:
            session = self._sessions.get(owner)
            if session is not None:
                session.requests.discard(request_id)

    # -- audit ---------------------------------------------------------------------------

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_owned_requests(self) -> int:
        return len(self._owners)

    def violations(self) -> list[str]:
        """Where the ownership records disagree with each other or with the table, and
        what is held with no live owner: a request, or a copy hold, of a session that
        has ended (nothing would ever free it)."""
        found: list[str] = []
        ownerless: list[str] = []
        ownerless_blocks: set[int] = set()
        for (tenant, rid), owner in self._owners.items():
            session = self._sessions.get(owner)
            if session is None or not self._owns_still(session):
                ownerless.append(rid)
                ownerless_blocks.update(self._blocks_of(tenant, rid))
            elif rid not in session.requests or session.tenant != tenant:
                found.append(f"request {rid!r} is owned by session {owner!r}, which lacks it")
        if ownerless:
            found.append(
                f"{len(ownerless)} requests (e.g. {sorted(ownerless)[:5]}) belong to sessions "
                f"that have ended, holding {len(ownerless_blocks)} blocks: nothing will free "
                f"them"
            )
        for (tenant, session_id), num_holds in self._table.copy_hold_owners().items():
            session = self._sessions.get(session_id)
            if session is None or not self._owns_still(session) or session.tenant != tenant:
                found.append(
                    f"{num_holds} copy holds are kept for session {session_id!r}, which has "
                    f"ended: nothing will release them"
                )
        for session in self._sessions.values():
            for rid in session.requests:
                if self._owners.get((session.tenant, rid)) != session.session_id:
                    found.append(f"session {session.session_id!r} lists {rid!r} unrecorded")
                elif not self._known(session.tenant, rid):
                    found.append(
                        f"session {session.session_id!r} owns request {rid!r}, which the "
                        f"request table does not know"
                    )
        return found

    def _owns_still(self, session: Session) -> bool:
        """Whether what the session owns has an owner that will free it: live, or
        ended with its end in progress (not one ended with nothing to free it)."""
        return session.ended is None or session.session_id in self._ending

    def _blocks_of(self, tenant: str, request_id: str) -> set[int]:
        try:
            groups = self._table.get_block_ids(request_id, tenant)
        except RequestNotFoundError:
            return set()
        return {block for group in groups for block in group}

    def _known(self, tenant: str, request_id: str) -> bool:
        try:
            self._table.get_request(request_id, tenant)
        except RequestNotFoundError:
            return False
        return True

    # -- internals -----------------------------------------------------------------------

    def _get(self, session_id: str, tenant: str) -> Session:
        session = self._sessions.get(session_id)
        # Another tenant's session is reported as unknown: its id is none of the
        # caller's business.
        if session is not None and session.tenant == tenant:
            if session.ended is not None:  # its requests are being freed
                raise self._ended_error(session_id)
            return session
        ended = self._ended.get(session_id)
        if ended is not None and ended[0] == tenant:
            raise self._ended_error(session_id)
        raise SessionNotFoundError(
            f"session {session_id!r} is not known (never opened on this server, or ended "
            f"long ago); open a new session with OpenSession"
        )

    def _ended_error(self, session_id: str) -> SessionEndedError:
        ended = self._ended.get(session_id)
        why = ended[1] if ended is not None else "ended"
        return SessionEndedError(
            f"session {session_id!r} has ended ({why}) and the "
            f"requests it owned were freed; open a new session with OpenSession"
        )

    def _expire(self, session: Session, reason: str) -> None:
        """End the session now (no call is served under it from here on) and free
        what it owns in the table's turn: at once when the table is free, else as the
        Step holding the turn gives it back; a slice at a time if it owns many."""
        if session.ended is not None:
            return  # its end is already on its way
        why = "its lease ran out" if reason == "ttl" else "its stream broke"
        self._turn.defer(self._begin_end(session, why, reason))

    def _remember_ended(self, session: Session, why: str) -> None:
        self._ended[session.session_id] = (session.tenant, why)
        while len(self._ended) > ENDED_SESSIONS_KEPT:
            self._ended.popitem(last=False)

    def _begin_end(self, session: Session, why: str, reason: str) -> SessionEnd:
        """Decide the session's end: refused to every call from now, recorded as
        ending until its ``SessionEnd`` has freed what it owns."""
        session.ended = why
        self._remember_ended(session, why)
        end = SessionEnd(self, session, why, reason)
        self._ending[session.session_id] = end
        return end

    def _end_slice(self, end: SessionEnd, slices: Slices) -> bool:
        """Up to a slice of ``end`` (in the table's turn); True once it is done. An
        end that fails (a bug) is no longer in progress: the audit then reports what
        its session still owns."""
        try:
            return self._free_slice(end, slices)
        except BaseException:
            self._ending.pop(end.session.session_id, None)
            raise

    def _free_slice(self, end: SessionEnd, slices: Slices) -> bool:
        session = end.session
        tenant, session_id = session.tenant, session.session_id
        pending = end._pending
        if pending is None:
            # Copy holds its steps kept go with it (whether or not it frees its
            # requests); then its requests, in order of id.
            self._table.release_copy_holds(tenant, session_id)
            pending = end._pending = sorted(session.requests, reverse=True)
        owners = self._owners
        table = self._table
        with table.batched():
            while pending:
                rid = pending.pop()
                if owners.get((tenant, rid)) != session_id:
                    session.requests.discard(rid)  # freed by another caller meanwhile
                    continue
                try:
                    table.free(rid, FreeMode.FINISH, tenant)
                except RequestNotFoundError:
                    owners.pop((tenant, rid), None)
                    session.requests.discard(rid)
                    continue
                end.num_freed += 1
                if slices.clock.due():
                    break
        if pending:
            return False
        self._forget(end)
        return True

    def _forget(self, end: SessionEnd) -> None:
        """The end's last step: the session is gone, its place given back."""
        session = end.session
        session.requests.clear()
        del self._sessions[session.session_id]
        self._ending.pop(session.session_id, None)
        # A replica session's held retention changes take effect now.
        self._table.end_replica(session.session_id)
        for listener in self.end_listeners:
            listener(session.session_id)
        left = self._sessions_per_tenant.get(session.tenant, 0) - 1
        if left > 0:
            self._sessions_per_tenant[session.tenant] = left
        else:
            self._sessions_per_tenant.pop(session.tenant, None)
        self._remember_ended(session, end.why)
        self._record_active()
        metrics = self._metrics
        if metrics is not None:
            metrics.sessions_closed[end.reason].inc()
            if end.reason != "client":
                metrics.session_expirations[end.reason].inc()
                metrics.requests_reclaimed.inc(end.num_freed)
        self._lines.info(
            log,
            "session closed" if end.reason == "client" else "session expired",
            end.reason,
            session_id=session.session_id,
            client_name=session.client_name,
            reason=end.reason,
            num_requests_freed=end.num_freed,
        )

    def tenant_sessions(self) -> dict[str, tuple[int, int]]:
        """Tenant -> (sessions open, StepStreams open), a copy (for the metrics'
        scrape thread)."""
        sessions = dict(self._sessions_per_tenant)
        streams = dict(self._streams_per_tenant)
        return {
            tenant: (sessions.get(tenant, 0), streams.get(tenant, 0))
            for tenant in sessions.keys() | streams.keys()
        }

    def _queue(self, session: Session) -> None:
        """Put the session's lease in the expiry heap unless it is there already."""
        if not session.queued:
            session.queued = True
            heapq.heappush(self._expiries, (session.expires_at, next(self._tie), session))

    def _check_session_limits(self, tenant: str) -> None:
        self._check_open(
            tenant,
            "sessions",
            "max_sessions",
            self._sessions_per_tenant.get(tenant, 0),
            len(self._sessions),
            "close some (CloseSession) before opening more",
        )

    def _check_open(
        self, tenant: str, what: str, limit: str, held: int, total: int, hint: str
    ) -> None:
        """Refuse (RESOURCE_EXHAUSTED, counted) one more of ``what`` when ``tenant``
        holds ``held`` of them, as many as ``<limit>_per_tenant`` allows, or the server
        ``total``, as many as ``limit`` allows; ``hint`` says what the tenant can do."""
        bounds = (
            (f"{limit}_per_tenant", held, describe_tenant(tenant), "may", hint),
            (limit, total, "the server", "allows", "retry later"),
        )
        for name, count, owner, verb, advice in bounds:
            bound = getattr(self.policy, name)
            if count >= bound:
                self._refuse(
                    tenant,
                    name,
                    f"{owner} already has {count} {what} open, as many as it {verb} "
                    f"({name} = {bound}, --{name.replace('_', '-')}); {advice}",
                )

    def _refuse(self, tenant: str, limit: str, message: str) -> None:
        """Count the refusal under ``limit`` and raise it (RESOURCE_EXHAUSTED)."""
        if self._metrics is not None:
            self._metrics.record_refusal(tenant, limit)
        raise LimitExceededError(limit, message)

    def _lease(self, session: Session) -> Lease:
        return Lease(session, time.time() + (session.expires_at - self._clock()))

    def _record_active(self) -> None:
        if self._metrics is not None:
            self._metrics.sessions_active.set(len(self._sessions))


class SessionReaper:
    """A task on the server's loop that ends sessions whose lease ran out.

    It wakes at the earliest expiry (at most ``max_sleep_s`` apart, so a session opened
    meanwhile with a shorter lease is not missed by more than that), so a lease ends
    within about a tick of its TTL.
    """

    def __init__(
        self, registry: SessionRegistry, max_sleep_s: float = 1.0, turn: TableTurn | None = None
    ) -> None:
        self._registry = registry
        # Reaping frees requests: in the table's turn, never in the middle of a Step.
        self._turn = turn or TableTurn()
        # A tenth of the shortest lease: a lease is never overrun by more than that.
        self._max_sleep_s = min(max_sleep_s, registry.policy.ttl_min_s / 10)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="session-reaper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await background.cancel(task)

    async def _run(self) -> None:
        while True:
            wait = self._registry.next_expiry_in()
            await asyncio.sleep(self._max_sleep_s if wait is None else min(wait, self._max_sleep_s))
            try:
                await self._turn.run(self._registry.reap)
            except Exception:  # a bug: log it, keep reaping the others
                log.exception("session reaper failed")


# -- the RPC boundary --------------------------------------------------------------------

UnaryBehavior = Callable[[Any, Any], Awaitable[Any]]
StreamBehavior = Callable[[Any, Any], AsyncIterator[Any]]


def metadata_value(context: Any, key: str) -> str | None:
    """The value of metadata ``key`` of the call, None when absent."""
    for k, value in context.invocation_metadata() or ():
        if k == key:
            return str(value)
    return None


class SessionLayer:
    """Resolves ``x-kvservice-session`` for every KVCacheService call: renews the
    lease, applies fencing and ``require_sessions``, and fills the call's ``Caller``.
    Inside ``RpcLayer`` (which turns its refusals into statuses) and after the
    authentication interceptor (which sets the tenant it reads)."""

    def __init__(self, registry: SessionRegistry) -> None:
        self._registry = registry

    def wrap(self, handler: Any, method: str) -> Any:
        if method in SESSION_METHODS:
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: Any, method: str) -> Any:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # server streaming (SubscribeEvents): touches no request

    def _enter(self, context: Any, method: str) -> Session | None:
        """Resolve the call's session and make it the caller's; None without one."""
        session_id = metadata_value(context, SESSION_KEY)
        if session_id is None:
            if self._registry.policy.require_sessions and method in MUTATING_METHODS:
                raise SessionRequiredError(
                    f"{method} needs a session on this server (require_sessions): open one "
                    f"with OpenSession and send its id as {SESSION_KEY} metadata"
                )
            return None
        caller = current_caller()
        session = self._registry.resolve(session_id, caller.tenant)
        CURRENT_CALLER.set(dataclasses.replace(caller, session_id=session_id, epoch=session.epoch))
        return session

    def _unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        async def call(request: Any, context: Any) -> Any:
            # Each call runs in a task of its own: the caller set here is this call's.
            self._enter(context, method)
            return await behavior(request, context)

        return call

    def _stream(self, behavior: StreamBehavior, method: str) -> StreamBehavior:
        registry = self._registry

        async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            # Counted first: a stream refused here renews no lease.
            tenant = current_caller().tenant
            registry.stream_started(tenant)
            try:
                session = self._enter(context, method)
                if session is None:
                    async for response in behavior(requests, context):
                        yield response
                    return
                registry.stream_opened(session)
                broken = False
                try:
                    async for response in behavior(_Renewing(requests, registry, session), context):
                        yield response
                    # A client that cancels or vanishes ends the request iterator just as
                    # a half-close does; its cancellation reaches this task a moment
                    # later. Wait that moment before calling the stream finished.
                    await asyncio.sleep(STREAM_CLOSE_GRACE_S)
                except (asyncio.CancelledError, GeneratorExit):
                    broken = True
                    raise
                finally:
                    registry.stream_closed(session, broken)
            finally:
                registry.stream_finished(tenant)

        return stream


class _Renewing:
    """A stream's inbound messages, each one renewing (and re-fencing) the session."""

    def __init__(self, requests: AsyncIterator[Any], registry: SessionRegistry, session: Session):
        self._requests = requests
        self._registry = registry
        self._session = session

    def __aiter__(self) -> _Renewing:
        return self

    async def __anext__(self) -> Any:
        message = await self._requests.__anext__()
        self._registry.resolve(self._session.session_id, self._session.tenant)
        return message

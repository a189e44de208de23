"""The pool's audit: the ``Audit`` RPC and the periodic self-check.

Both run the same check (``Auditor.run``): the core's invariants (every block free and
queued once, or held with a reference count equal to the block-table entries holding
it; the prefix cache's hash map agreeing with the blocks), every block table belonging
to a request the service knows, the per-tenant ledgers, the sessions' ownership
records agreeing with each other and with the request table, and every held block
having a live owner: no request, and no copy hold kept by a step, belongs to a session
that has ended (nothing would ever free it). A violation is a bug in
the server, never a caller's mistake: it is logged at error level and counted in
``kvservice_audit_failures_total``.

The check is O(pool size): about 5 s of Python for a 1M-block pool, far too long to
stop the server's loop for. A check racing changes would report violations that are not
there, and the pool is not thread safe, so a pool of ``fork_min_blocks`` blocks or more
is checked in a forked child instead: ``fork()`` takes a copy-on-write snapshot of the
whole process at one instant between two RPCs, which stops the loop for the fork alone
(milliseconds; about 0.2 s at 1M blocks), and the child checks the snapshot while the
server carries on (``forking`` says what makes the child safe). A smaller pool is
checked in place, which takes a few tens of milliseconds at most.

Runs are single-flight: a call arriving while a check runs gets that run's report, so
any number of concurrent callers cost one check (and one child). A check that cannot
run (a forked child that crashed or hung, or a process that may not fork) raises
``AuditNotRunError`` and is counted in ``kvservice_audit_errors_total``; it is never
replaced by an in-place check of a large pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass

import structlog

from kvservice.core.errors import FailedPreconditionError, KVCacheError
from kvservice.core.invariants import InvariantViolationError
from kvservice.request_table.table import RequestTable
from kvservice.server import background, forking
from kvservice.server.metrics import KVCacheMetrics
from kvservice.server.sessions import SessionRegistry
from kvservice.server.turns import TableTurn

log = structlog.get_logger("kvservice.audit")

# From this pool size on, the audit runs in a forked snapshot (see the module doc): the
# in-place check of a smaller pool stops the loop for at most a few tens of ms.
FORK_MIN_BLOCKS = 8192
# A forked child that has not answered by then is stuck: it is killed and the run
# reported as not run, so one stuck child cannot stall every later self-check. A 1M-block
# check takes seconds.
FORK_TIMEOUT_S = 300.0


class AuditNotRunError(KVCacheError):
    """The check could not run (its forked child crashed or hung); nothing is known
    about the pool. Retry."""

    status = "UNAVAILABLE"


class AuditUnavailableError(FailedPreconditionError):
    """This process may not check its pool: it is too large to check in place, and a
    forked snapshot is not safe here (the message says why)."""


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What one audit found."""

    violations: tuple[str, ...]
    num_free_blocks: int
    num_held_blocks: int
    num_cached_blocks: int
    num_requests: int
    num_sessions: int
    num_owned_requests: int
    duration_s: float

    @property
    def ok(self) -> bool:
        return not self.violations


class Auditor:
    """Runs the audit of one pool, one run at a time, logging and counting each."""

    def __init__(
        self,
        table: RequestTable,
        sessions: SessionRegistry | None = None,
        metrics: KVCacheMetrics | None = None,
        fork_min_blocks: int = FORK_MIN_BLOCKS,
        fork_timeout_s: float = FORK_TIMEOUT_S,
        turn: TableTurn | None = None,
    ) -> None:
        self._table = table
        # Checks (and forks) take the table's turn: never in the middle of a Step.
        self._turn = turn or TableTurn()
        self._sessions = sessions
        self._metrics = metrics
        self._fork = table.manager.kv_cache_config.num_blocks >= fork_min_blocks
        self._fork_timeout_s = fork_timeout_s
        # The run in progress, which every caller meanwhile shares.
        self._running: asyncio.Task[AuditReport] | None = None

    @property
    def forks(self) -> bool:
        """Whether the pool is checked in a forked snapshot (it is large)."""
        return self._fork

    def unavailable_reason(self) -> str | None:
        """Why this pool cannot be audited in this process, or None when it can."""
        return forking.unsafe_reason() if self._fork else None

    async def run(self) -> AuditReport:
        """Check the pool as it is now, or join the check already running; never
        raises for a violation (it is reported). ``AuditNotRunError`` when the check
        could not run, ``AuditUnavailableError`` when it may not."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise AuditUnavailableError(
                f"the pool's {self._table.manager.kv_cache_config.num_blocks} blocks are "
                f"checked in a forked snapshot, which is not safe in this process: {reason}"
            )
        running = self._running
        if running is None:
            running = self._running = asyncio.get_running_loop().create_task(
                self._run_once(), name="pool-audit"
            )
            running.add_done_callback(self._finished)
        # A caller that goes away (a cancelled RPC) leaves the run to the others.
        return await asyncio.shield(running)

    def _finished(self, task: asyncio.Task[AuditReport]) -> None:
        if self._running is task:
            self._running = None

    async def close(self) -> None:
        """Stop a run in progress (the server is stopping): its child is killed."""
        running, self._running = self._running, None
        if running is not None:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError, KVCacheError):
                await running

    async def _run_once(self) -> AuditReport:
        try:
            if self._fork:
                child = await self._turn.run(self._fork_child)
                report = await self._wait_for_child(*child)
            else:
                report = await self._turn.run(self.check)
        except AuditNotRunError as err:
            if self._metrics is not None:
                self._metrics.audit_errors.inc()
            log.error("pool audit could not run", error=str(err))
            raise
        self._record(report)
        return report

    def check(self) -> AuditReport:
        """Check the pool in place, on the caller's thread (the loop's)."""
        start = time.perf_counter()
        violations = self._violations()
        return self._report(violations, time.perf_counter() - start)

    def _fork_child(self) -> tuple[int, int]:
        """Fork the snapshot's child: (its pid, the end of the pipe it writes to)."""
        read_fd, write_fd = os.pipe()
        pid = forking.fork()
        if pid == 0:
            self._in_child(read_fd, write_fd)  # never returns
        os.close(write_fd)
        return pid, read_fd

    async def _wait_for_child(self, pid: int, read_fd: int) -> AuditReport:
        try:
            payload = await asyncio.wait_for(
                asyncio.to_thread(_collect, read_fd, pid), self._fork_timeout_s
            )
        except TimeoutError:
            # The worker thread then reads EOF and reaps the child.
            _kill(pid)
            raise AuditNotRunError(
                f"the forked audit (child {pid}) did not finish in {self._fork_timeout_s:g} "
                f"s and was killed"
            ) from None
        except asyncio.CancelledError:
            _kill(pid)
            raise
        except ChildProcessError as err:
            raise AuditNotRunError(f"the forked audit {err}; nothing was checked") from None
        fields = json.loads(payload)
        fields["violations"] = tuple(fields["violations"])
        return AuditReport(**fields)

    def _in_child(self, read_fd: int, write_fd: int) -> None:
        """The forked child: check the snapshot, write the report, exit at once (no
        cleanup, no atexit handlers: everything else belongs to the parent)."""
        code = 1
        try:
            forking.prepare_child(write_fd)
            data = json.dumps(dataclasses.asdict(self.check())).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view) :]
            code = 0
        finally:
            os._exit(code)

    def _violations(self) -> list[str]:
        found: list[str] = []
        try:
            self._table.audit()
        except InvariantViolationError as err:
            # The core stops at the first broken rule: one line, the rest unchecked.
            found.append(str(err))
        if self._sessions is not None:
            found += self._sessions.violations()
        return found

    def _report(self, violations: list[str], duration_s: float) -> AuditReport:
        usage = self._table.usage()
        sessions = self._sessions
        return AuditReport(
            violations=tuple(violations),
            num_free_blocks=usage.num_free_blocks,
            num_held_blocks=usage.num_used_blocks,
            num_cached_blocks=self._num_cached_free_blocks(),
            num_requests=usage.num_requests,
            num_sessions=sessions.num_sessions if sessions is not None else 0,
            num_owned_requests=sessions.num_owned_requests if sessions is not None else 0,
            duration_s=duration_s,
        )

    def _num_cached_free_blocks(self) -> int:
        pool = self._table.manager.block_pool
        return sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)

    def _record(self, report: AuditReport) -> None:
        metrics = self._metrics
        if metrics is not None:
            metrics.audit_runs.inc()
        if report.ok:
            if metrics is not None:
                metrics.audit_last_success.set(time.time())
            return
        if metrics is not None:
            metrics.audit_failures.inc()
        log.error(
            "pool audit failed",
            violations=list(report.violations),
            num_requests=report.num_requests,
            duration_ms=round(report.duration_s * 1000, 3),
        )


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _collect(read_fd: int, pid: int) -> bytes:
    """Read the child's report to EOF and reap the child (in a worker thread).
    ``ChildProcessError`` when it wrote nothing or failed."""
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise ChildProcessError(
            f"child {pid} was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        )
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not chunks:
        raise ChildProcessError(f"child {pid} ended with wait status {status}")
    return b"".join(chunks)


class SelfCheck:
    """Runs ``Auditor.run`` every ``interval_s`` seconds on the server's loop."""

    def __init__(self, auditor: Auditor, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"audit interval must be > 0 seconds, got {interval_s}")
        self._auditor = auditor
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        reason = self._auditor.unavailable_reason()
        if reason is not None:
            log.warning("periodic pool audit off", reason=reason)
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pool-self-check")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await background.cancel(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._auditor.run()
            except AuditNotRunError:
                pass  # logged and counted by the run
            except Exception:  # a bug in the audit itself: keep checking later
                log.exception("pool audit crashed")

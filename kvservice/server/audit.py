"""The pool's audit: the ``Audit`` RPC and the periodic self-check.

Both run the same check (``Auditor.run``): the core's invariants (every block free and
queued once, or held with a reference count equal to the block-table entries holding
it; the prefix cache's hash map agreeing with the blocks), every block table belonging
to a request the service knows, and the sessions' ownership records agreeing with each
other and with the request table. A violation is a bug in the server, never a caller's
mistake: it is logged at error level and counted in ``kvservice_audit_failures_total``.

The check is O(pool size): about 5 s of Python for a 1M-block pool, far too long to
stop the server's loop for. A check racing changes would report violations that are not
there, and the pool is not thread safe, so a large pool (``fork_min_blocks`` blocks or
more, where fork is available) is checked in a forked child instead: ``fork()`` takes a
copy-on-write snapshot of the whole process at one instant between two RPCs, which
stops the loop for the fork alone (tens of milliseconds at 1M blocks), and the child
checks the snapshot while the server carries on. A small pool is checked in place,
which takes less than a fork would.
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

from kvservice.core.invariants import InvariantViolationError
from kvservice.request_table.table import RequestTable
from kvservice.server.metrics import KVCacheMetrics
from kvservice.server.sessions import SessionRegistry

log = structlog.get_logger("kvservice.audit")

# From this pool size on, the audit runs in a forked snapshot (see the module doc).
FORK_MIN_BLOCKS = 100_000
CAN_FORK = hasattr(os, "fork")
# A forked child that has not answered by then is stuck (a lock some other thread held
# at the fork, say): it is killed and the run counted as failed, so one stuck child
# cannot stall every later self-check. A 1M-block check takes seconds.
FORK_TIMEOUT_S = 300.0


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
    """Runs the audit of one pool, logging and counting each run."""

    def __init__(
        self,
        table: RequestTable,
        sessions: SessionRegistry | None = None,
        metrics: KVCacheMetrics | None = None,
        fork_min_blocks: int = FORK_MIN_BLOCKS,
        fork_timeout_s: float = FORK_TIMEOUT_S,
    ) -> None:
        self._table = table
        self._sessions = sessions
        self._metrics = metrics
        self._fork = CAN_FORK and table.manager.kv_cache_config.num_blocks >= fork_min_blocks
        self._fork_timeout_s = fork_timeout_s

    async def run(self) -> AuditReport:
        """Check the pool as it is now; never raises for a violation (it is
        reported). A large pool is checked in a forked snapshot, so the loop serves
        calls meanwhile."""
        report = await self._check_forked() if self._fork else self.check()
        self._record(report)
        return report

    def check(self) -> AuditReport:
        """Check the pool in place, on the caller's thread (the loop's)."""
        start = time.perf_counter()
        violations = self._violations()
        return self._report(violations, time.perf_counter() - start)

    async def _check_forked(self) -> AuditReport:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            self._child(read_fd, write_fd)  # never returns
        os.close(write_fd)
        start = time.perf_counter()
        try:
            payload = await asyncio.wait_for(
                asyncio.to_thread(_collect, read_fd, pid), self._fork_timeout_s
            )
        except TimeoutError:
            # The worker thread then reads EOF and reaps the child.
            os.kill(pid, signal.SIGKILL)
            stuck = f"forked audit child {pid} did not finish in {self._fork_timeout_s} s; killed"
            return self._report([stuck], time.perf_counter() - start)
        except ChildProcessError:
            log.exception("forked audit failed; checking in place")
            return self.check()
        fields = json.loads(payload)
        fields["violations"] = tuple(fields["violations"])
        return AuditReport(**fields)

    def _child(self, read_fd: int, write_fd: int) -> None:
        """The forked child: check the snapshot, write the report, exit at once (no
        cleanup, no atexit handlers: everything else belongs to the parent)."""
        code = 1
        try:
            os.close(read_fd)
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


def _collect(read_fd: int, pid: int) -> bytes:
    """Read the child's report to EOF and reap the child (in a worker thread).
    ``ChildProcessError`` when it wrote nothing or failed."""
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not chunks:
        raise ChildProcessError(f"audit child {pid} ended with wait status {status}")
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
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pool-self-check")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._auditor.run()
            except Exception:  # a bug in the audit itself: keep checking later
                log.exception("pool audit crashed")

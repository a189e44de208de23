"""Whose turn it is on the request table.

Every call runs its work on the request table without awaiting, so it runs whole
between two others: that is what makes the table safe without locks, and a ``Step``
isolated. But a Step may carry thousands of operations, hundreds of milliseconds of
work at the limits; run whole, it would hold up every other call for that long, the
health checks included. So a Step pauses every ``SLICE_S`` of work to let the loop run
other tasks, and keeps the table's turn while it does: calls that do not touch the
table (health checks, reflection, lease renewals) go on, the table's other users wait
until the Step is done, so it stays isolated. A call that finds the table free (no
Step pausing: nearly always) runs at once, without awaiting.

Work that must not wait for the turn, yet must not run in the middle of a Step (a
session ended by its broken stream, or by a lease found run out: the end frees what
the session owns), is ``defer``red: it runs at once when the table is free, else as the
holder of the turn gives it back, before any call waiting for the turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger("kvservice.turns")

# Work a Step does between two pauses: a health check waits at most about this long
# behind it (and behind each other Step in progress), far under any probe's timeout.
SLICE_S = 0.005


class TableTurn:
    """The request table's turn: held by a Step for the whole of its run."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        # Work deferred while the turn was taken, run as it is given back.
        self._deferred: list[Callable[[], object]] = []

    @property
    def taken(self) -> bool:
        return self._lock.locked()

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` in its turn: at once when the table is free, else after the
        Step in progress (``work`` must not await)."""
        if not self._lock.locked():
            return work()
        async with self:
            return work()

    def defer(self, work: Callable[[], object]) -> None:
        """``work()`` in the table's turn without awaiting it: at once when the table
        is free (its errors raised to the caller), else by the holder of the turn as it
        gives it back, before any call waiting for the turn (its errors then logged:
        they are no concern of that holder). ``work`` must not await."""
        if not self._lock.locked():
            work()
            return
        self._deferred.append(work)

    async def __aenter__(self) -> TableTurn:
        await self._lock.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            while self._deferred:
                work = self._deferred.pop(0)
                try:
                    work()
                except Exception:  # a bug: log it, run the others, give the turn back
                    log.exception("deferred table work failed")
        finally:
            self._lock.release()


class Slices:
    """Times a Step's work in slices; ``pause`` lets the loop run other tasks between
    two. A slice is ``SLICE_S`` of the thread's CPU time, not of the clock: a Step
    descheduled by a busy machine has done no work meanwhile, and a small Step never
    pauses (nor spreads its KV events over two batches). A cancellation that arrives
    during a pause is held back until ``finish``: a cancelled Step has run entirely or
    not at all."""

    __slots__ = ("_cancelled", "_cpu_deadline", "_deadline")

    def __init__(self) -> None:
        self._cancelled = False
        self._start_slice()

    def _start_slice(self) -> None:
        self._deadline = time.perf_counter() + SLICE_S
        self._cpu_deadline = time.thread_time() + SLICE_S

    def due(self) -> bool:
        """Whether this slice's work is done: the clock first (cheap; CPU time never
        runs ahead of it), then the thread's CPU time."""
        return time.perf_counter() >= self._deadline and time.thread_time() >= self._cpu_deadline

    async def pause(self) -> None:
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._cancelled = True
        self._start_slice()

    def finish(self) -> None:
        """Raise the cancellation held back, if any (the work is done)."""
        if self._cancelled:
            raise asyncio.CancelledError


class _Whole(Slices):
    """Slices never due: the work runs whole (``StepRunner.run_whole``)."""

    __slots__ = ()

    def due(self) -> bool:
        return False


WHOLE = _Whole()

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
holder of the turn gives it back, before any call waiting for the turn. Deferred work
that is too long for one slice (a session owning thousands of requests) returns a
``Resumable``: the turn then stays taken and a task of its own goes on with it, a slice
at a time with a pause between two, and gives the turn back when it is done (so it too
runs before any call that was waiting). Calls that do not touch the table go on during
its pauses, as during a Step's.
"""

from __future__ import annotations

import asyncio
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import structlog

from kvservice.server.slice_clock import SliceClock

T = TypeVar("T")

log = structlog.get_logger("kvservice.turns")

# Work a Step does between two pauses: a health check waits at most about this long
# behind it (and behind each other Step in progress), far under any probe's timeout.
SLICE_S = 0.005
# Passes of the loop a pause lets go by (``Slices.pause``). One pass runs only the
# callbacks already ready, and each hop of a call through the loop (a timer firing, a
# message read, its handler's next step) waits for the next pass: with one pass per
# pause, a health check took one slice per hop (~60 ms behind a large call, measured
# with benchmarks/bench_loop_stalls.py); with 8, ~10-15 ms.
PAUSE_ROUNDS = 8


class Resumable(ABC):
    """Deferred work that did not finish in its first slice: ``resume`` goes on with it,
    holding the table's turn, until it answers True (done)."""

    @abstractmethod
    def resume(self, slices: Slices) -> bool:
        """Do up to a slice more of the work (``slices.clock.due()`` says when to stop); True
        when it is all done. Must not await."""


class TableTurn:
    """The request table's turn: held by a Step for the whole of its run."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        # Work deferred while the turn was taken, run as it is given back.
        self._deferred: list[Callable[[], object]] = []
        # Tasks going on with deferred work that did not fit in a slice (each holds the
        # turn while it runs); kept so they are not collected, awaited by ``drain``.
        self._resuming: set[asyncio.Task[None]] = set()

    @property
    def taken(self) -> bool:
        return self._lock.locked()

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` in its turn: at once when the table is free, else after the
        Step in progress (``work`` must not await)."""
        async with self:
            return work()

    def defer(self, work: Callable[[], object]) -> None:
        """``work()`` in the table's turn without awaiting it: at once when the table
        is free (its errors raised to the caller), else by the holder of the turn as it
        gives it back, before any call waiting for the turn (its errors then logged:
        they are no concern of that holder). ``work`` must not await. When it returns a
        ``Resumable``, the turn stays taken until that is done (see the module
        docstring)."""
        if self._lock.locked():
            self._deferred.append(work)  # run by the holder as it gives the turn back
            return
        if not self._take_now():
            # Being handed to a waiter, which runs the work as it gives the turn back;
            # a task queues for the turn too, should that waiter be cancelled first.
            self._deferred.append(work)
            self._track(asyncio.get_running_loop().create_task(self._visit()))
            return
        try:
            more = work()
        except BaseException:
            self._give_back()
            raise
        self._give_back(more if isinstance(more, Resumable) else None)

    async def drain(self) -> None:
        """Wait for the deferred work still going on (the server's shutdown)."""
        while self._resuming:
            await asyncio.gather(*self._resuming, return_exceptions=True)

    async def __aenter__(self) -> TableTurn:
        await self._lock.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._give_back()

    def _take_now(self) -> bool:
        """Take the turn without awaiting, when nobody holds it or is being handed it
        (``asyncio.Lock.acquire`` returns without suspending exactly then)."""
        acquiring = self._lock.acquire()
        try:
            acquiring.send(None)
        except StopIteration:
            return True
        acquiring.close()  # it would have to wait: withdraw
        return False

    def _give_back(self, more: Resumable | None = None) -> None:
        """Run the deferred work (first what ``more`` has left) holding the turn, then
        release it; unless some work is left for a later slice: a task then goes on
        with it and gives the turn back itself."""
        try:
            while True:
                if more is not None and self._resume_later(more):
                    return  # the task holds the turn on
                more = None
                if not self._deferred:
                    break
                work = self._deferred.pop(0)
                try:
                    result = work()
                except Exception:  # a bug: log it, run the others, give the turn back
                    log.exception("deferred table work failed")
                    continue
                if isinstance(result, Resumable):
                    more = result
        except BaseException:
            self._lock.release()
            raise
        self._lock.release()

    def _resume_later(self, work: Resumable) -> bool:
        """Go on with ``work`` in a task that keeps the turn (True); without a running
        loop (a test or tool driving the table directly), finish it here (False)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            while not work.resume(WHOLE):
                pass
            return False
        self._track(loop.create_task(self._resume(work), name="deferred-table-work"))
        return True

    def _track(self, task: asyncio.Task[None]) -> None:
        self._resuming.add(task)
        task.add_done_callback(self._resuming.discard)

    async def _visit(self) -> None:
        """Take the turn and give it back: runs whatever work is deferred."""
        async with self:
            pass

    async def _resume(self, work: Resumable) -> None:
        # Pauses hold a cancellation back (``Slices``) and nothing raises it again: the
        # work is always finished, whoever cancels the task (the loop's shutdown).
        slices = Slices()
        try:
            while True:
                try:
                    if work.resume(slices):
                        break
                except Exception:  # a bug: log it, give the turn back
                    log.exception("deferred table work failed")
                    break
                await slices.pause()
        finally:
            self._give_back()


class Slices:
    """Times a Step's work in slices (``clock``: see ``SliceClock``); ``pause`` lets the
    loop run other tasks between two. A cancellation that arrives during a pause is
    held back until ``finish``: a cancelled Step has run entirely or not at all.

    Work asks ``slices.clock.due()`` whether a slice is done (a loop takes the clock
    once: it is compiled, and stays the same across pauses)."""

    __slots__ = ("_cancelled", "clock", "pauses")

    def __init__(self, slice_s: float | None = None) -> None:
        """``slice_s``: the work between two pauses, ``SLICE_S`` unless given (read
        here, and the clocks from ``time``, so that a test may set them)."""
        self._cancelled = False
        # Pauses so far: a caller compares it before and after a piece of work to
        # learn whether other tasks ran meanwhile.
        self.pauses = 0
        self.clock = SliceClock(
            SLICE_S if slice_s is None else slice_s, time.perf_counter, time.thread_time
        )

    async def pause(self) -> None:
        """Let the loop run other tasks: ``PAUSE_ROUNDS`` passes of the loop, so a call
        that takes several hops through the loop to be answered (a health check is
        read, dispatched, handled and written back) gets through in one pause rather
        than one hop per slice. A pass with nothing else to run costs microseconds."""
        self.pauses += 1
        try:
            for _ in range(PAUSE_ROUNDS):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._cancelled = True
        self.clock.restart()

    def finish(self) -> None:
        """Raise the cancellation held back, if any (the work is done)."""
        if self._cancelled:
            raise asyncio.CancelledError


# Slices never due: the work runs whole (``StepRunner.run_whole``).
WHOLE = Slices(math.inf)

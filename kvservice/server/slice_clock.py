"""When a slice of a Step's work is done (``turns.Slices`` pauses between two).

Its own module so that it compiles: the columnar operations ask ``due`` once per entry
(thousands a step), and from the compiled runner a call into an interpreted method
costs a frame. ``turns`` itself stays interpreted, so that tests can hold a pause.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SliceClock:
    """Times one slice after another: ``due`` once ``slice_s`` of the thread's CPU time
    has been spent since ``restart``. CPU time, not the clock's: a Step descheduled by a
    busy machine has done no work meanwhile, and a small Step never pauses.

    ``wall`` and ``cpu`` are the clocks read (``time.perf_counter`` and
    ``time.thread_time``; a test passes its own). A ``slice_s`` of infinity is never
    due: the work runs whole."""

    __slots__ = ("_cpu", "_cpu_deadline", "_deadline", "_wall", "slice_s")

    def __init__(
        self,
        slice_s: float,
        wall: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self.slice_s = slice_s
        self._wall = wall
        self._cpu = cpu
        self._deadline = 0.0
        self._cpu_deadline = 0.0
        self.restart()

    def restart(self) -> None:
        """Start a new slice now."""
        self._deadline = self._wall() + self.slice_s
        self._cpu_deadline = self._cpu() + self.slice_s

    def due(self) -> bool:
        """Whether this slice's work is done: the clock first (cheap; CPU time never
        runs ahead of it), then the thread's CPU time."""
        now = self._wall()
        if now < self._deadline:
            return False
        cpu_left = self._cpu_deadline - self._cpu()
        if cpu_left <= 0:
            return True
        # Speed: the thread's CPU time is a system call (~0.8 us here, the clock ~0.06);
        # on a busy machine the clock passes its deadline long before the CPU time, and
        # each check after it read both. The CPU time cannot reach its deadline before
        # the clock has run cpu_left more, so the next look at it waits until then.
        self._deadline = now + cpu_left
        return False

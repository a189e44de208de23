"""How long the server's event loop is held up, measured from inside: loop stalls and
garbage-collector pauses.

``StallWatch`` is a task that sleeps ``interval_s`` at a time and records how late it
wakes: the loop could not run it while something else held it (a call's work, a
collection, a long callback), so its lateness is that stall, to within the interval.
It costs a wake of the server per interval (100 a second by default;
``--loop-stall-interval`` sets it, 0 turns the watch off).

``GcWatch`` times every collection of the cyclic garbage collector through
``gc.callbacks``: a collection runs inside whatever allocation triggered it, so it
stalls the loop for its whole length, wherever it lands (the middle of a Step's slice
included). Both feed the server's metrics (``kvservice_event_loop_stall_seconds``,
``kvservice_gc_pause_seconds``) and keep the longest figure seen, which the load test
and ``benchmarks/bench_loop_stalls.py`` report.

``FullCollections`` is what the server does to the collector
(``--gc-full-collection-interval``): see its docstring for why.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any

from kvservice.server import background

# How often the stall watch wakes: the resolution of what it measures.
STALL_INTERVAL_S = 0.01
# A threshold for full collections that is never reached (it counts collections of
# the middle generation since the last full one).
NEVER = 2**31 - 1


class StallWatch:
    """Records how late a timer of ``interval_s`` runs on the current loop."""

    def __init__(
        self,
        interval_s: float = STALL_INTERVAL_S,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._observe = observe
        self._task: asyncio.Task[None] | None = None
        # The longest lateness seen since the start (or the last ``reset``), and the
        # most CPU time the loop's thread spent in one tick: the work that held the
        # loop, without the time a busy machine left the process descheduled.
        self.longest_s = 0.0
        self.longest_cpu_s = 0.0
        self.num_ticks = 0

    def reset(self) -> None:
        self.longest_s = self.longest_cpu_s = 0.0
        self.num_ticks = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="stall-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await background.cancel(task)

    async def _run(self) -> None:
        interval = self.interval_s
        clock = time.perf_counter
        observe = self._observe
        cpu = time.thread_time
        while True:
            start = clock()
            cpu_start = cpu()
            await asyncio.sleep(interval)
            late = max(0.0, clock() - start - interval)
            self.num_ticks += 1
            self.longest_s = max(self.longest_s, late)
            self.longest_cpu_s = max(self.longest_cpu_s, cpu() - cpu_start)
            if observe is not None:
                observe(late)


class GcWatch:
    """Times each garbage collection (``gc.callbacks``, so process-wide: a watch
    installed by each of two servers in one process sees the collections of both).

    ``inside()`` tells whether a collection started inside the work the caller cares
    about (the server: while the request table's turn is held, i.e. within a Step,
    Admit or session end in progress); such pauses are kept apart."""

    def __init__(
        self,
        observe: Callable[[int, float], None] | None = None,
        inside: Callable[[], bool] | None = None,
    ) -> None:
        self._observe = observe
        self._inside = inside
        self._started = 0.0
        self._started_inside = False
        self.longest_s = 0.0
        self.longest_inside_s = 0.0
        self.num_collections = 0
        self.num_inside = 0
        self.total_s = 0.0
        # The longest pause per generation (0, 1, 2).
        self.longest_by_generation = [0.0, 0.0, 0.0]

    def reset(self) -> None:
        self.longest_s = self.longest_inside_s = self.total_s = 0.0
        self.num_collections = self.num_inside = 0
        self.longest_by_generation = [0.0, 0.0, 0.0]

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._started_inside = self._inside is not None and self._inside()
            return
        pause = time.perf_counter() - self._started
        generation: int = info.get("generation", 2)
        self.num_collections += 1
        self.total_s += pause
        self.longest_s = max(self.longest_s, pause)
        if 0 <= generation < len(self.longest_by_generation):
            self.longest_by_generation[generation] = max(
                self.longest_by_generation[generation], pause
            )
        if self._started_inside:
            self.num_inside += 1
            self.longest_inside_s = max(self.longest_inside_s, pause)
        if self._observe is not None:
            self._observe(generation, pause)


class FullCollections:
    """Python's automatic full collections off, one every ``interval_s`` instead, run
    in the table's turn: never in the middle of a Step's slices
    (``--gc-full-collection-interval``).

    A full collection scans every object the collector tracks that is not frozen: with
    the requests of a busy pool (a few lists each, whose items it visits too) that is
    tens to hundreds of milliseconds, a stall no slice bounds. Python starts one
    whenever the objects that survived two young collections since the last one are a
    quarter of those that survived it: under a steady churn of requests, every few
    seconds, and wherever the allocation that tips the count lands, a Step's slice
    included (measured: 36-92 ms inside a 4,096-operation Step next to 12,288
    requests). The young collections stay automatic (their pauses are bounded by the
    thresholds: ~2-4 ms measured); only the full one moves here, where it runs at
    most once per interval. The requests hold no reference cycles (they are freed by
    reference counting), so the cyclic garbage that waits for it is the few objects a
    call's machinery leaves (exceptions, finished streams): bounded by the interval.

    Not chosen, from measurements (``benchmarks/bench_loop_stalls.py``): a higher
    first threshold (10,000 instead of 700) makes young collections rarer but each
    longer (up to 19 ms: the middle generation then holds ten times more), for no
    less time in all; freezing the survivors after each full collection would keep
    the next one short, but frozen objects are never collected, so the cycles of the
    calls in flight at that moment would leak (about 16 objects per freeze measured
    under one client's calls), a leak without bound on a long-running server.

    Process-wide: the collector's thresholds belong to the process. Installed by each
    server on start and put back when the last one stops (``0`` leaves Python's own
    full collections on, for an application embedding the server that manages the
    collector itself)."""

    _installed = 0
    _saved: tuple[int, int, int] | None = None

    def __init__(self, interval_s: float, run: Callable[[Callable[[], object]], Any]) -> None:
        # ``run(work)``: awaitable running ``work`` in the table's turn.
        self.interval_s = interval_s
        self._run_in_turn = run
        self._task: asyncio.Task[None] | None = None
        self.num_collections = 0

    def start(self) -> None:
        cls = FullCollections
        if cls._installed == 0:
            cls._saved = gc.get_threshold()
            gen0, gen1, _ = cls._saved
            gc.set_threshold(gen0, gen1, NEVER)
        cls._installed += 1
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gc-full")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        await background.cancel(task)
        cls = FullCollections
        cls._installed -= 1
        if cls._installed == 0 and cls._saved is not None:
            gc.set_threshold(*cls._saved)
            cls._saved = None

    def collect(self) -> int:
        self.num_collections += 1
        return gc.collect()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._run_in_turn(self.collect)
